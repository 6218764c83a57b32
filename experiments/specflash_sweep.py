"""SpecFLASH's compression-ratio ablation (the paper's Appendix C, Table 7) on a toy world: one specflash drafter per
C/N in {1, 1/4, 1/9, 1/16, 0}, each trained through the shared trainer on the world's cached target-answered
features (the same examples for every ratio), written to OUT/cn-<label>. Compare them afterwards in one
interleaved run:

    .venv/bin/python experiments/specflash_sweep.py --target toy-s --examples 400 --epochs 4 --out /tmp/sf-sweep
    .venv/bin/mmspec bench --target toy-s --drafter cn1=/tmp/sf-sweep/cn-1,cn4=/tmp/sf-sweep/cn-1_4,... \\
        --tasks video_caption,video_detail
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
from mmspec_ray.training.methods import SpecFlashMethod
from mmspec_ray.training.trainer import train_drafter

RATIOS = {"1": 1.0, "1_4": 1 / 4, "1_9": 1 / 9, "1_16": 1 / 16, "0": 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="toy-s", choices=sorted(RECIPES))
    p.add_argument("--examples", type=int, default=None, help="multimodal training prompts (default: the recipe's)")
    p.add_argument("--epochs", type=int, default=None, help="epochs per drafter (default: the recipe's)")
    p.add_argument("--ratios", default=",".join(RATIOS), help=f"subset of {list(RATIOS)}")
    p.add_argument("--placeholder", default=None, choices=["learned", "offset"], help="placeholder inputs")
    p.add_argument("--group", type=int, default=None, help="K, tokens drafted per forward (default 4)")
    p.add_argument("--no-heldout", action="store_true", help="skip the per-epoch held-out τ (saves time; the "
                   "weights are the same)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    recipe = RECIPES[a.target]
    if a.examples:
        recipe = recipe.model_copy(update={"examples": a.examples})
    train = recipe.train if a.epochs is None else recipe.train.model_copy(update={"epochs": a.epochs})
    world = build_toy(a.target)
    target = load_target(world.target)
    examples = load_features(toy_features(world, target, recipe))
    heldout = [] if a.no_heldout else list(toy_requests(world, "validation", recipe.heldout, seed=2))
    for label in a.ratios.split(","):
        out = Path(a.out) / f"cn-{label}"
        method = SpecFlashMethod(ratio=RATIOS[label], placeholder=a.placeholder, group=a.group)
        train_drafter(method, target, examples, out, train, heldout=heldout)
        print(out)


if __name__ == "__main__":
    main()
