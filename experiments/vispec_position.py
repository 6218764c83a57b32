"""Accepted draft tokens per cycle by position in the answer (docs/drafters/vispec.md): ViSpec's motivation is that
a drafter loses the image as a long answer goes on ("lost in the middle"), which the global feature counters. This
decodes the bench's long-answer prompts greedily with each drafter and buckets every cycle by the answer position
it starts at.

    OMP_NUM_THREADS=1 python experiments/vispec_position.py --drafter eagle2=DIR,vispec=DIR --out docs/bench/X.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mmspec_ray.drafters.base import load_drafter
from mmspec_ray.decoding.engine import SpecEngine
from mmspec_ray.decoding.tree import TreeConfig
from mmspec_ray.targets import load_target
from mmspec_ray.toy.build import build_toy
from mmspec_ray.toy.prompts import toy_requests


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="toy-m")
    p.add_argument("--drafter", required=True, help="LABEL=DIR,...")
    p.add_argument("--tasks", default="detail,video_detail")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--buckets", default="0,40,80,120", help="answer positions where buckets start")
    p.add_argument("--tree-depth", type=int, default=5)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    world = build_toy(a.target)
    target = load_target(world.target)
    reqs = list(toy_requests(world, "test", a.prompts, seed=0, tasks=tuple(a.tasks.split(","))))
    starts = [int(s) for s in a.buckets.split(",")]
    tree = TreeConfig(top_k=4, depth=a.tree_depth, total_tokens=16 if a.tree_depth == 5 else 24)
    out: dict[str, dict] = {}
    for part in a.drafter.split(","):
        label, path = part.split("=", 1)
        eng = SpecEngine(target, load_drafter(path, target), tree)
        acc = {s: [0, 0] for s in starts}  # bucket start -> [accepted draft tokens, cycles]
        for r in reqs:
            st = eng.generate(r, max_new_tokens=a.max_new_tokens).stats
            pos = 1  # the prefill's token
            for n in st.accepted_per_cycle:
                b = max(s for s in starts if s <= pos)
                acc[b][0] += n
                acc[b][1] += 1
                pos += n + 1
        out[label] = {f"{s}-": {"accepted_per_cycle": v[0] / max(1, v[1]), "cycles": v[1]} for s, v in acc.items()}
        print(label, {k: round(v["accepted_per_cycle"], 2) for k, v in out[label].items()}, flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": "python experiments/vispec_position.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()), "tree": tree.model_dump(), "buckets": out},
        indent=2))


if __name__ == "__main__":
    main()
