"""The main job's rows in-process: AR against the shipped suffix drafter with and without openings (the answer's
first tokens guessed from the prompt and verified in the prefill's forward), each through the batch decoder's own
engine (calibrated tree, payoff guard), interleaved per row in alternating order; speedup over AR per token over the
rows after the first `--skip`, cycles per row and the opening's accepted tokens (docs/benchmarks.md, "The main job
with it").

    OMP_NUM_THREADS=1 .venv/bin/python experiments/openings.py --rows 100
"""

from __future__ import annotations

import argparse

from mmspec_ray.batch.decoder import SpecDecoder
from mmspec_ray.batch.jobspec import DecodeConfig
from mmspec_ray.batch.rows import prepare_row
from mmspec_ray.batch.sources import kinetics_rows
from mmspec_ray.decoding.calibrate import auto_tree
from mmspec_ray.decoding.engine import AREngine, SpecEngine
from mmspec_ray.drafters.base import load_drafter
from mmspec_ray.toy.build import build_toy
from mmspec_ray.toy.drafter import SHIPPED, build_toy_drafter

PROMPT = "Describe what happens in the video."  # the caption job's default prompt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=100)
    p.add_argument("--skip", type=int, default=20, help="rows left out of the figure (the guard and corpus learning)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    a = p.parse_args()
    world = build_toy("toy-s")
    drafter = str(build_toy_drafter("toy-s", SHIPPED["toy-s"].method, world=world))
    data = world.root / "data"
    rows = kinetics_rows(str(data / "kinetics_test.csv"), str(data / "clips" / "test"), PROMPT).to_pylist()[:a.rows]
    dec = SpecDecoder(DecodeConfig(target=str(world.target), drafter=drafter, speedup_sample=0,
                                   media={"num_frames": 4, "require": "video"}))
    target = dec.target  # one target for every engine: the same weights in the caches
    off = load_drafter(drafter, target)
    off.cfg = off.cfg.model_copy(update={"openings": False})
    tree = auto_tree(target, drafter, probe=getattr(off, "probe_tree", None))
    requests = [prepare_row(r, dec.config) for r in rows]
    ar = AREngine(target)
    ar.generate(requests[0], max_new_tokens=a.max_new_tokens)  # cold start off the clock
    engines = {"ar": ar, "openings": dec.engine, "no openings": SpecEngine(target, off, tree, guard=True)}
    got: dict[str, list[tuple[int, float, int, int]]] = {k: [] for k in engines}
    for i, req in enumerate(requests):
        answers = {}
        for name, eng in list(engines.items())[::(-1 if i % 2 else 1)]:
            g = eng.generate(req, max_new_tokens=a.max_new_tokens)
            answers[name] = g.token_ids
            got[name].append((len(g.token_ids), g.stats.total_s, g.stats.cycles, g.stats.prefill_accepted))
        assert len({tuple(x) for x in answers.values()}) == 1, f"row {i}: answers differ"
    part = slice(a.skip, None)

    def per_token(name: str) -> float:
        xs = got[name][part]
        return sum(s for _, s, _, _ in xs) / sum(n for n, _, _, _ in xs)

    n = len(got["ar"][part])
    for name in engines:
        xs = got[name][part]
        print(f"{name}: speedup over AR per token {per_token('ar') / per_token(name):.3f}x, "
              f"{sum(s for _, s, _, _ in xs) / n * 1e3:.2f} ms a row, {sum(c for _, _, c, _ in xs) / n:.2f} cycles "
              f"a row, {sum(o for _, _, _, o in xs) / n:.2f} opening tokens accepted a row")
    print(f"rows {a.skip}-{len(requests) - 1} of {len(requests)}; every answer identical to AR's")


if __name__ == "__main__":
    main()
