"""Grow toy-m from a toy-s world on a machine that has only toy-s (e.g. a lent GPU box: toy-m's 358 MB of weights do
not fit its 64 MiB transfer), and check that the weights are the ones measured elsewhere.

toy/grow.py draws the new layers' readers from torch's global RNG, so the grown weights depend on what the process
ran before the grow (see docs/benchmarks.md, "On a GPU"), and on the CPU's thread split and vector width.
`--rng-state` restores the state saved at the grow of the world to reproduce; `--expect` is that world's
`scripts/weights_digest.py` digest, checked after the grow (a torch 2.11 box with another CPU still grew other
weights from the same state).
`MMSPEC_HOME=... python scripts/gpu_grow_toy_m.py --rng-state rng.pt --expect DIGEST`
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weights_digest import digest  # noqa: E402


def main() -> int:
    import mmspec_ray.toy.build as build

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rng-state", help="torch.get_rng_state() saved at the reference grow (torch.save)")
    p.add_argument("--expect", help="the reference toy-m target's weights digest")
    p.add_argument("--threads", type=int, default=2,
                   help="torch threads: the grow's reductions (each weight's RMS) round by the thread split, so use "
                   "the reference's (2 here); also run with ATEN_CPU_CAPABILITY=avx2 on a CPU with AVX-512")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    grow = build.grow_llava

    def seeded_grow(*args, **kw):
        if a.rng_state:
            torch.set_rng_state(torch.load(a.rng_state))
        return grow(*args, **kw)

    build.grow_llava = seeded_grow
    world = build.build_toy("toy-m", force=True)  # a cached toy-m would ignore --rng-state
    got = digest(world.target)
    print(f"toy-m target weights digest {got}" + (f" (expected {a.expect})" if a.expect else ""))
    if a.expect and got != a.expect:
        print("toy-m differs from the reference: its figures are not comparable", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
