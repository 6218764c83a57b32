"""Where a decoding cycle's time goes: cProfile over `SpecEngine.generate` on toy prompts, grouped into the target's
forwards, the drafter's forwards and the engine's own Python (tree growth, acceptance, KV commit, masks, processors).

Why: the engine's own work must stay small next to the forwards (docs/benchmarks.md records the split).
`python -m mmspec_ray.bench.profile --target toy-m --drafter DIR --tree k3d3n8`
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch

from mmspec_ray.targets.base import Request

# (group, file suffix, function name): cumulative time of these calls. Forwards nest inside the first two groups.
GROUPS = (
    ("target verify forward", "targets/base.py", "verify"),
    ("target prefill", "targets/base.py", "prefill"),
    ("drafter propose (its forwards + tree growth)", "decoding/tree.py", "grow_dynamic_tree"),
    ("drafter observe", "", "observe"),
    ("drafter begin", "", "begin"),
    ("acceptance", "decoding/accept.py", "accept"),
    ("KV commit", "targets/base.py", "commit"),
    ("tree mask + ancestors", "decoding/tree.py", "ancestor_mask"),
    ("per-node processors", "decoding/processors.py", "tree_logits"),
)


def split(stats: pstats.Stats) -> dict[str, float]:
    """Seconds per group (cumulative time of the group's function), and the whole `generate` time."""
    out = {name: 0.0 for name, _, _ in GROUPS}
    total = 0.0
    for (file, _, func), (_, _, _, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        if "mmspec_ray/" not in file:
            continue
        if file.endswith("decoding/engine.py") and func == "generate":
            total += cum
        for name, suffix, fn in GROUPS:
            if func == fn and file.endswith(suffix) and ("drafters/" in file or suffix):
                out[name] += cum
    # growth's own Python: its time less the drafter steps it calls (the step closures are the drafter's forwards)
    steps = sum(cum for (file, _, func), (_, _, _, cum, _) in stats.stats.items()  # type: ignore[attr-defined]
                if "drafters/" in file and func == "step")
    out["tree growth's own Python"] = max(0.0, out["drafter propose (its forwards + tree growth)"] - steps)
    out["generate (total)"] = total
    return out


def profile(engine, requests: list[Request], max_new_tokens: int) -> dict[str, float]:
    engine.generate(requests[0], max_new_tokens=16)  # warm-up
    prof = cProfile.Profile()
    prof.enable()
    for r in requests:
        engine.generate(r, max_new_tokens=max_new_tokens)
    prof.disable()
    return split(pstats.Stats(prof))


def main(argv: list[str] | None = None) -> int:
    from mmspec_ray.bench.run import split_tree
    from mmspec_ray.drafters.base import load_drafter
    from mmspec_ray.decoding.engine import SpecEngine
    from mmspec_ray.targets import load_target
    from mmspec_ray.toy.build import build_toy
    from mmspec_ray.toy.prompts import toy_requests

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="toy-m", choices=["toy-s", "toy-m"])
    p.add_argument("--drafter", required=True, help="a drafter checkpoint directory, or ngram")
    p.add_argument("--tree", default="k3d3n8", help="kKdDnN: top-k K, depth D, N tokens")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    world = build_toy(a.target)
    target = load_target(world.target)
    _, tree = split_tree("x@" + a.tree)
    engine = SpecEngine(target, load_drafter(a.drafter, target), tree)
    res = profile(engine, list(toy_requests(world, "test", a.prompts, seed=0)), a.max_new_tokens)
    total = res["generate (total)"]
    for name, s in res.items():
        print(f"{name:48s} {s:8.3f} s  {100 * s / total:5.1f} %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
