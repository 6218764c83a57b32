"""HiViS data ablations on a toy world (docs/drafters/hivis.md), through the one shared trainer:

  media-only   hivis stage 1 on the multimodal prompts only (no text-only pool): the paper's Table 3 first row and
               the same prompts as eagle2's
  eagle2-data  eagle2 (reads every visual token) on hivis's data: the same answer filter and the text-only pool mixed
               into every epoch, so a comparison with hivis isolates hiding the visual tokens from the data mix
  no-filter    hivis stage 1 without the paper's ">5 words" answer filter (the toy's short-answer tasks kept)

    OMP_NUM_THREADS=1 python scripts/hivis_ablation.py media-only --target toy-m --examples 200 --out DIR
    OMP_NUM_THREADS=1 python scripts/hivis_ablation.py eagle2-data --target toy-m --examples 200 --out DIR

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

    def select(self, target, examples, text_examples):
        return HiViSMethod().select(target, examples, text_examples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["media-only", "eagle2-data", "no-filter"])
    p.add_argument("--target", default="toy-m")
    p.add_argument("--examples", type=int, default=200, help="multimodal (and text-only) training prompts")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    world = build_toy(a.target)
    recipe = RECIPES[a.target].model_copy(update={"examples": a.examples, "text_examples": a.examples})
    target = load_target(world.target)
    mm = load_features(toy_features(world, target, recipe))
    heldout = list(toy_requests(world, "validation", recipe.heldout, seed=2))
    if a.mode == "media-only":
        cfg = recipe.train.model_copy(update={"multistep_epochs": 0})
        train_drafter(HiViSMethod(), target, mm, Path(a.out), cfg, heldout=heldout, text_examples=[])
    elif a.mode == "no-filter":
        text = load_features(toy_features(world, target, recipe, text=True))
        cfg = recipe.train.model_copy(update={"multistep_epochs": 0})
        train_drafter(HiViSMethod(min_answer_words=0), target, mm, Path(a.out), cfg, heldout=heldout,
                      text_examples=text)
    else:
        text = load_features(toy_features(world, target, recipe, text=True))
        train_drafter(Eagle2OnHiViSData(), target, mm, Path(a.out), recipe.train, heldout=heldout,
                      text_examples=text)


if __name__ == "__main__":
    main()
