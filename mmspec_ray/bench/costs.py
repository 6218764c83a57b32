"""Target cost profile: AR decode step time, and verify-forward time against the number of tree tokens.

Why: on a CPU a verify forward of n tokens is not almost free as on a GPU, so the best tree size depends on the
machine; this profile is the evidence behind the tree settings in docs/benchmarks.md (docs/toy.md records it).
`python -m mmspec_ray.bench.costs --target toy-m --threads 1`
"""

from __future__ import annotations

import argparse
import statistics

import torch

from mmspec_ray.config import SamplingParams
from mmspec_ray.decoding.calibrate import device_name, verify_seconds  # what tree calibration measures, here reported on its own
from mmspec_ray.decoding.engine import AREngine
from mmspec_ray.targets.base import Request, VLMTarget


def ar_step_seconds(target: VLMTarget, requests: list[Request], new_tokens: int = 64) -> list[float]:
    """Per request: the AR engine's target time per decode step (after a warm-up run)."""
    ar = AREngine(target)
    out = []
    for req in requests:
        ar.generate(req, SamplingParams(), max_new_tokens=8)
        st = ar.generate(req, SamplingParams(), max_new_tokens=new_tokens).stats
        out.append(st.verify_s / max(1, st.cycles))
    return out


def main(argv: list[str] | None = None) -> int:
    from mmspec_ray.targets.registry import load_target
    from mmspec_ray.toy.build import build_toy
    from mmspec_ray.toy.prompts import toy_requests

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="toy-m", choices=["toy-s", "toy-m"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sizes", default="1,4,8,16,24,32,48")
    p.add_argument("--tasks", default="", help="comma-separated toy tasks of the prompts (default: all; e.g. the "
                   "image tasks caption,detail,question,instruction where PyAV is missing)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, or auto (cuda when a GPU is visible)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on cuda, float32 on cpu")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    world = build_toy(a.target)
    target = load_target(world.target, device=a.device, dtype=a.dtype)
    reqs = list(toy_requests(world, "test", 4, seed=0, tasks=tuple(a.tasks.split(",")) if a.tasks else None))
    steps = ar_step_seconds(target, reqs)
    where = (f"{device_name(target.device)}, {target.dtype}" if target.device.type == "cuda"
             else f"{a.threads} thread(s)")
    print(f"{a.target}, {where}: AR step ms per prompt {[round(1e3 * s, 1) for s in steps]}, "
          f"median {1e3 * statistics.median(steps):.1f}")
    v = verify_seconds(target, target.encode(reqs[0]), tuple(int(x) for x in a.sizes.split(",")))
    print("verify forward: " + ", ".join(f"n={n}: {1e3 * s:.1f} ms ({s / v[min(v)]:.2f}x)" for n, s in v.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
