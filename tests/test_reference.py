"""docs/reference.md is generated from the parsers and config models (`python -m mmspec_ray.reference`): it must be
current, and it must list what users set."""

from __future__ import annotations

from pathlib import Path

from mmspec_ray.reference import render

DOC = Path(__file__).parents[1] / "docs" / "reference.md"


def test_the_reference_is_current():
    assert DOC.read_text() == render(), "docs/reference.md is stale: python -m mmspec_ray.reference > docs/reference.md"


def test_the_reference_lists_every_command_and_the_fields_users_set():
    text = render()
    for heading in ("### mmspec", "#### mmspec generate", "#### mmspec train-drafter", "#### mmspec bench",
                    "### jobs/caption_kinetics.py", "### jobs/instruct.py", "### jobs/train_drafter.py",
                    "### job (`JobSpec`)", "#### job.decode (`DecodeConfig`)", "### serve (`ServeSettings`)",
                    "### training (`TrainConfig`)"):
        assert heading + "\n" in text, heading
    for row in ("| `--target` |", "| `--drafter` |", "| `--gpus-per-actor` |", "| `max_new_tokens` | int | `128` |",
                "| `top_k` | int | `8` |"):
        assert row in text, row
