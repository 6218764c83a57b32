"""The main job's captions in-process: AR against the shipped drafter on a fixed tree (no guard) and on the same tree
under the payoff guard, per row, interleaved (alternating order), toy-s video captions; the guard's speedup over
its first rows (while it learns) and after them; and the calibrated costs the pick came from (docs/benchmarks.md,
"The main job with it").

    OMP_NUM_THREADS=1 .venv/bin/python experiments/guard_warmup.py --prompts 60 --tree k3d1n7
"""

from __future__ import annotations

import argparse
import re

import torch

from mmspec_ray.decoding.calibrate import cached_pick, calibration_key, interpolate
from mmspec_ray.decoding.engine import AREngine, SpecEngine
from mmspec_ray.decoding.tree import TreeConfig
from mmspec_ray.drafters.base import load_drafter
from mmspec_ray.targets import load_target
from mmspec_ray.toy.build import build_toy
from mmspec_ray.toy.drafter import SHIPPED, build_toy_drafter
from mmspec_ray.toy.prompts import toy_requests


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="toy-s")
    p.add_argument("--prompts", type=int, default=60)
    p.add_argument("--first", type=int, default=10, help="rows counted as the guard's learning phase")
    p.add_argument("--tree", default="k3d1n7", help="kKdDnN: the tree (the main job's calibrated pick)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    a = p.parse_args()
    k, d, n = map(int, re.fullmatch(r"k(\d+)d(\d+)n(\d+)", a.tree).groups())
    tree = TreeConfig(top_k=k, depth=d, total_tokens=n)
    world = build_toy(a.target)
    target = load_target(world.target)
    spec = str(build_toy_drafter(a.target, SHIPPED[a.target].method, world=world))
    drafter = load_drafter(spec, target)
    pick = cached_pick(calibration_key(target, spec))
    if pick is not None:
        print(f"calibrated pick on this machine ({torch.get_num_threads()} threads): {pick.tree}, predicted "
              f"{pick.predicted_speedup:.2f}x; verify of 1 token {pick.verify_ms[1]:.2f} ms, of "
              f"{pick.tree.total_tokens} {interpolate(pick.verify_ms, pick.tree.total_tokens):.2f} ms; drafter step "
              f"{pick.draft_ms_per_level:.2f} ms")
    reqs = list(toy_requests(world, "test", a.prompts, seed=3, tasks=("video_caption",)))
    # a drafter each (one that learns from the answers it decodes must not draft a row from another engine's answer)
    engines = {"guarded": SpecEngine(target, drafter, tree, guard=True),
               "fixed": SpecEngine(target, load_drafter(spec, target), tree), "ar": AREngine(target)}
    AREngine(target).generate(reqs[0], max_new_tokens=a.max_new_tokens)  # cold start (lazy inits) off the clock
    rows: dict[str, list[tuple[int, float]]] = {name: [] for name in engines}
    for i, req in enumerate(reqs):
        order = list(engines.items())[::(-1 if i % 2 else 1)]
        answers = {}
        for name, engine in order:
            g = engine.generate(req, max_new_tokens=a.max_new_tokens)
            answers[name] = g.token_ids
            rows[name].append((len(g.token_ids), g.stats.total_s))
        assert answers["guarded"] == answers["fixed"] == answers["ar"], f"row {i}: answers differ"

    def per_token(name: str, part: slice) -> float:
        xs = rows[name][part]
        return sum(s for _, s in xs) / sum(t for t, _ in xs)

    for label, part in ((f"first {a.first} rows", slice(0, a.first)), ("the rest", slice(a.first, None))):
        print(f"{label}: speedup over AR per token: guarded {per_token('ar', part) / per_token('guarded', part):.3f}x, "
              f"fixed tree {per_token('ar', part) / per_token('fixed', part):.3f}x")
    print(f"all {len(reqs)} rows: fixed tree {per_token('ar', slice(None)) / per_token('fixed', slice(None)):.3f}x; "
          "answers identical to AR on every row")


if __name__ == "__main__":
    main()
