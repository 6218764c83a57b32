"""What the half-precision tie guard costs on a trained target (docs/design.md, Precision): for each tie margin, the
share of verify cycles that end at a near-tie, tokens per target forward, and how many greedy answers equal AR's,
on held-out toy prompts, the target in bfloat16. `--drafter random` (default): an untrained EAGLE-2 drafter, whose
wide trees make every cycle a multi-node forward (the near-tie share is the target's, whatever the drafter
guesses); `--drafter eagle2`: the toy world's trained drafter (trained on first use).

    MMSPEC_HOME=... python experiments/tie_guard_cost.py --target toy-s --prompts 24 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mmspec_ray.drafters.base import load_drafter
from mmspec_ray.drafters.eagle import Eagle2Drafter
from mmspec_ray.decoding.engine import AREngine, SpecEngine
from mmspec_ray.decoding.tree import TreeConfig
from mmspec_ray.targets import load_target
from mmspec_ray.toy.build import build_toy
from mmspec_ray.toy.drafter import build_toy_drafter
from mmspec_ray.toy.prompts import toy_requests


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="toy-s")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--margins", default="0,0.0078125,0.03125,0.125")
    p.add_argument("--drafter", default="random", choices=["random", "eagle2"])
    a = p.parse_args()
    torch.set_num_threads(2)
    world = build_toy(a.target)
    target = load_target(world.target, dtype=a.dtype)
    drafter_dir = str(build_toy_drafter(a.target, "eagle2")) if a.drafter == "eagle2" else None
    requests = list(toy_requests(world, "test", a.prompts, seed=0))
    tree = TreeConfig(top_k=4, depth=5, total_tokens=16)
    ar = [AREngine(target).generate(r, max_new_tokens=a.max_new_tokens).token_ids for r in requests]
    rows = []
    for margin in (float(m) for m in a.margins.split(",")):
        drafter = load_drafter(drafter_dir, target) if drafter_dir else Eagle2Drafter.random(target, seed=0)
        engine = SpecEngine(target, drafter, tree, tie_margin=margin)
        t0 = time.perf_counter()
        gens = [engine.generate(r, max_new_tokens=a.max_new_tokens) for r in requests]
        cycles = sum(g.stats.cycles for g in gens)
        rows.append({"tie_margin": margin, "seconds": round(time.perf_counter() - t0, 2),
                     "equal_to_ar": sum(g.token_ids == want for g, want in zip(gens, ar)), "answers": len(gens),
                     "tie_cycle_share": round(sum(g.stats.tie_cycles for g in gens) / max(1, cycles), 4),
                     "tokens_per_forward": round(sum(len(g.token_ids) - 1 for g in gens) / max(1, cycles), 3)})
        print(json.dumps(rows[-1]), flush=True)
    print("| tie margin | answers = AR | cycles ended at a near-tie | tokens per target forward | seconds |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tie_margin']:g} | {r['equal_to_ar']}/{r['answers']} | {100 * r['tie_cycle_share']:.1f} % | "
              f"{r['tokens_per_forward']:.2f} | {r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
