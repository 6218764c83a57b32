"""One toy-recipe experiment: build a toy-s variant (ToySize fields overridden) in a scratch folder, then gate it.

Usage: python experiments/toy_experiment.py OUT_DIR '{"vision_steps": 1600, "epochs": 3.0}' [--threads 1] [--seed 0]
Prints the build timings and the gate table (docs/history/toy.md, "Recipe experiments"). Not cached under $MMSPEC_HOME.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="scratch folder for the variant's world")
    ap.add_argument("overrides", help="JSON object of ToySize fields to change, e.g. '{\"epochs\": 3.0}'")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO)
    from mmspec_ray.toy.build import build_world
    from mmspec_ray.toy.model import TOY_SIZES
    from mmspec_ray.toy.quality import evaluate, report_markdown

    over = json.loads(args.overrides)
    size = dataclasses.replace(TOY_SIZES["toy-s"], **over)
    t0 = time.time()
    world = build_world(size, args.seed, args.out)
    print("BUILD", round(time.time() - t0, 1), json.dumps(world.manifest()["timings"]), flush=True)
    rep = evaluate(world.target, world.data, max_scenes=200, max_clips=100, detail_samples=10)
    print(report_markdown(rep, f"{over} seed {args.seed}"), flush=True)


if __name__ == "__main__":
    main()
