"""EAGLE-2 drafter (placeholder until the trained head lands)."""
