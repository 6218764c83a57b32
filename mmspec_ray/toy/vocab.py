"""The toy world's closed vocabulary of attributes: shapes, colours, sizes, places, backgrounds, actions."""

from __future__ import annotations

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond", "cross", "star")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 70, 230),
    "yellow": (245, 220, 20),
    "purple": (140, 40, 180),
    "orange": (250, 130, 10),
    "white": (250, 250, 250),
    "black": (15, 15, 15),
}
# Object edge length in pixels, as a fraction of a grid cell.
SIZES: dict[str, float] = {"small": 0.48, "medium": 0.68, "large": 0.9}
# A 3x3 grid: POSITIONS[row * 3 + col].
POSITIONS: tuple[str, ...] = (
    "top left", "top", "top right",
    "left", "center", "right",
    "bottom left", "bottom", "bottom right",
)
BACKGROUNDS: tuple[str, ...] = ("plain", "striped", "checkered", "noisy", "dotted")
BACKGROUND_TONES: dict[str, tuple[int, int, int]] = {
    "gray": (128, 128, 128),
    "sand": (150, 135, 110),
    "slate": (105, 120, 135),
}
# Kinetics-style action labels for clips.
ACTIONS: tuple[str, ...] = (
    "moving left", "moving right", "moving up", "moving down", "spinning",
    "growing", "shrinking", "bouncing", "changing colour", "blinking",
)
NUMBER_WORDS: tuple[str, ...] = ("zero", "one", "two", "three", "four", "five")
