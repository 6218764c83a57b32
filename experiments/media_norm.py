"""ViSpec and MSD trained briefly on the test suite's tiny targets with and without `media_norm` (the RMS
normalisation of the raw media rows, docs/drafters/vispec.md and msd.md): the last epoch's training top-1 per
family. Run it under each ATEN_CPU_CAPABILITY to see whether the vector kernels decide the outcome:

    ATEN_CPU_CAPABILITY=default .venv/bin/python experiments/media_norm.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny family builders of the test suite

from families import FAMILIES, build_target  # noqa: E402
from mmspec_ray.training.datagen import DatagenRecipe, generate_features, load_features  # noqa: E402
from mmspec_ray.training.methods import training_method  # noqa: E402
from mmspec_ray.training.trainer import TrainConfig, train_drafter  # noqa: E402

# the recipes of tests/test_vispec.py and tests/test_msd.py (trained lossless tests)
RECIPES = {"vispec": TrainConfig(epochs=8, batch_size=2, lr=1e-2, warmup_steps=1, text_epochs=0),
           "msd": TrainConfig(epochs=8, batch_size=2, lr=3e-3, warmup_steps=1, text_epochs=0)}


class Fixed:
    """A training method whose heads take `media_norm` as given."""

    def __init__(self, name: str, media_norm: bool) -> None:
        self.inner, self.media_norm = training_method(name), media_norm

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    def head(self, target):
        head = self.inner.head(target)
        return type(head)(head.cfg.model_copy(update={"media_norm": self.media_norm}))


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, kernels {torch.backends.cpu.get_cpu_capability()}, "
          f"ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '(native)')}")
    for family in FAMILIES:
        torch.manual_seed(0)
        target = build_target(family)
        reqs = [r for n, r in FAMILIES[family].requests.items() if n != "text"] * 2
        with tempfile.TemporaryDirectory() as tmp:
            mm = load_features(generate_features(target, reqs, DatagenRecipe(max_new_tokens=12), Path(tmp) / "mm"))
            row = []
            for method, cfg in RECIPES.items():
                for norm in (False, True):
                    out = train_drafter(Fixed(method, norm), target, mm, Path(tmp) / f"{method}-{norm}", cfg)
                    top1 = json.loads((out / "history.json").read_text())[-1]["top1"]
                    row.append(f"{method} {'norm' if norm else 'raw '} {top1:.2f}")
        print(f"{family:16s} " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
