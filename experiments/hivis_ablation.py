"""HiViS data ablations on a toy world (docs/drafters/hivis.md), through the one shared trainer:

  media-only   hivis stage 1 on the multimodal prompts only (no text-only pool): the paper's Table 3 first row and
               the same prompts as eagle2's
  eagle2-data  eagle2 (reads every visual token) on hivis's data: the same answer filter and the text-only pool mixed
               into every epoch, so a comparison with hivis isolates hiding the visual tokens from the data mix
  no-filter    hivis stage 1 without the paper's ">5 words" answer filter (the toy's short-answer tasks kept)
  eagle2-data-no-filter
               eagle2 on no-filter's data (every multimodal prompt + the text-only pool, mixed): no-filter's baseline

    OMP_NUM_THREADS=1 python experiments/hivis_ablation.py media-only --target toy-m --examples 200 --out DIR
    OMP_NUM_THREADS=1 python experiments/hivis_ablation.py eagle2-data --target toy-m --examples 200 --out DIR

`--epochs N` (default: the recipe's) and `--multistep-epochs M` (hivis modes; default 0, stage 1 only) resume a
finished run in DIR to N epochs, as `mmspec train-drafter` does: eagle2-data at 11 epochs matches the budget of
hivis stage 1 (8) + stage 2 (3); no-filter with `--epochs 11 --multistep-epochs 3` is stage 2 on unfiltered data.

Same recipe as `mmspec train-drafter` otherwise (the toy size's epochs, batch, lr; features shared under the world).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from mmspec_ray.targets.registry import load_target
from mmspec_ray.toy.build import build_toy
from mmspec_ray.toy.drafter import RECIPES, toy_features
from mmspec_ray.toy.prompts import toy_requests
from mmspec_ray.training.datagen import load_features
from mmspec_ray.training.methods import HiViSMethod, TrainingMethod
from mmspec_ray.training.trainer import train_drafter


class Eagle2OnHiViSData(TrainingMethod):
    """eagle2's head, collate and loss (every visual token read); hivis's answer filter and text mixing."""

    mixes_text = True

    def __init__(self, min_answer_words: int | None = None) -> None:
        self.hivis = HiViSMethod(min_answer_words=min_answer_words)

    def select(self, target, examples, text_examples):
        return self.hivis.select(target, examples, text_examples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["media-only", "eagle2-data", "no-filter", "eagle2-data-no-filter"])
    p.add_argument("--target", default="toy-m")
    p.add_argument("--examples", type=int, default=200, help="multimodal (and text-only) training prompts")
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=None, help="total epochs (default: the recipe's)")
    p.add_argument("--multistep-epochs", type=int, default=0, help="hivis modes: stage-2 epochs at the end")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    world = build_toy(a.target)
    recipe = RECIPES[a.target].model_copy(update={"examples": a.examples, "text_examples": a.examples})
    target = load_target(world.target)
    mm = load_features(toy_features(world, target, recipe))
    heldout = list(toy_requests(world, "validation", recipe.heldout, seed=2))
    train = recipe.train.model_copy(update={"epochs": a.epochs or recipe.train.epochs})
    if a.mode == "media-only":
        cfg = train.model_copy(update={"multistep_epochs": a.multistep_epochs})
        train_drafter(HiViSMethod(), target, mm, Path(a.out), cfg, heldout=heldout, text_examples=[])
    elif a.mode == "no-filter":
        text = load_features(toy_features(world, target, recipe, text=True))
        cfg = train.model_copy(update={"multistep_epochs": a.multistep_epochs})
        train_drafter(HiViSMethod(min_answer_words=0), target, mm, Path(a.out), cfg, heldout=heldout,
                      text_examples=text)
    else:
        text = load_features(toy_features(world, target, recipe, text=True))
        method = Eagle2OnHiViSData(min_answer_words=0 if a.mode == "eagle2-data-no-filter" else None)
        train_drafter(method, target, mm, Path(a.out), train, heldout=heldout, text_examples=text)


if __name__ == "__main__":
    main()
