#!/usr/bin/env python
"""How well tree calibration predicts what each tree does (decoding/calibrate.py): calibrates a drafter on a toy
target over the bench's prompts (greedy, a fresh calibration cache), keeping each probe record's request and cycle,
then decodes the same prompts with each fixed tree and prints, per tree, the tokens per forward the records predict
against the ones decoding gives (exact at T = 0: no timing in it), and the draft time per cycle the pick charges
against the one measured while decoding.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/calibration_accuracy.py --target toy-m \\
        --drafter ~/.cache/mmspec/shared-drafters/toy-m-eagle2-n200 [--fixed-phase]    # docs/design.md

`--fixed-phase` probes every request from its first cycle, as calibration did before the phase rotated.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ["MMSPEC_CALIBRATION_DIR"] = tempfile.mkdtemp(prefix="calibration-accuracy-")

from mmspec_ray.bench.workloads import toy_workload  # noqa: E402
from mmspec_ray.config import SamplingParams  # noqa: E402
from mmspec_ray.drafters.base import load_drafter  # noqa: E402
from mmspec_ray.decoding import calibrate  # noqa: E402
from mmspec_ray.decoding.engine import SpecEngine  # noqa: E402
from mmspec_ray.decoding.tree import TreeConfig  # noqa: E402
from mmspec_ray.targets.registry import load_target  # noqa: E402
from mmspec_ray.toy.build import build_toy  # noqa: E402

TREES = "k4d5n16,k4d4n12,k4d3n10,k3d3n8,k3d2n8,k2d4n8,k2d2n8,k2d3n6,k2d2n4,k1d3n4"


def parse_tree(spec: str) -> TreeConfig:
    k, rest = spec.removeprefix("k").split("d")
    d, n = rest.split("n")
    return TreeConfig(top_k=int(k), depth=int(d), total_tokens=int(n))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="toy-m")
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--trees", default=TREES)
    ap.add_argument("--fixed-phase", action="store_true")
    a = ap.parse_args()
    world = build_toy(a.target)
    requests = toy_workload(world, "all", a.prompts, 0).requests
    target = load_target(world.target)
    drafter = load_drafter(a.drafter, target)
    greedy = SamplingParams(temperature=0.0)

    tags: list[tuple[int, int]] = []  # (request, cycle) of each record
    observe, start = calibrate.TreeCalibrator.observe, calibrate.TreeCalibrator.start_request

    def tagged_observe(self, tree, path, *args):
        tags.append((self.requests - 1, self.cycle - 1))
        return observe(self, tree, path, *args)

    def start_request(self, t, inputs):
        start(self, t, inputs)
        if a.fixed_phase:
            self.phase = 0

    calibrate.TreeCalibrator.observe = tagged_observe  # type: ignore[method-assign]
    calibrate.TreeCalibrator.start_request = start_request  # type: ignore[method-assign]
    cal = calibrate.auto_tree(target, a.drafter, recalibrate=True)
    engine = SpecEngine(target, drafter, cal)
    t0 = time.perf_counter()
    for req in requests * 8:
        if engine.calibrator is None:
            break
        engine.generate(req, greedy, max_new_tokens=a.max_new_tokens)
    if cal.result is None:  # too few whole probe cycles in these prompts: pick from what there is
        cal.pick()
    pick = cal.result
    first = sum(1 for _, c in tags if c == 0)
    print(f"calibrated in {time.perf_counter() - t0:.0f} s: {len(cal.records)} records, {first} of them an answer's "
          f"first cycle ({100 * first / len(cal.records):.0f} %); pick k{pick.tree.top_k}d{pick.tree.depth}"
          f"n{pick.tree.total_tokens}, predicted {pick.tokens_per_forward:.2f} tokens/forward")
    print("drafter step ms by top-k timed:",
          {k: round(1e3 * s / n, 2) for k, (s, n) in sorted(cal.steps.items()) if n})
    kids = [tree.children() for tree, _ in cal.records]
    observe_s = cal.observe_s / len(cal.records)
    probe_step = cal.steps[cal.probe.top_k][0] / cal.steps[cal.probe.top_k][1]
    print("| tree | tokens/forward predicted | decoded | draft ms/cycle charged (probe's step) | measured |")
    print("|---|---|---|---|---|")
    for spec in a.trees.split(","):
        tree = parse_tree(spec)
        tpf = calibrate._table(cal.records, kids, cal.costs, 0.0, 0.0, 0.0, tree.top_k, tree.depth,
                               cal.probe.total_tokens)[tree.total_tokens][1]
        eng = SpecEngine(target, drafter, tree)
        committed = cycles = 0
        draft_s = 0.0
        for req in requests:
            st = eng.generate(req, greedy, max_new_tokens=a.max_new_tokens).stats
            committed += st.cycles + sum(st.accepted_per_cycle)
            cycles += st.cycles
            draft_s += st.draft_s - st.drafter_prefill_s
        charged = 1e3 * (calibrate.level_seconds(cal.steps, tree.top_k) * tree.depth + observe_s)
        old = 1e3 * (probe_step * tree.depth + observe_s)
        print(f"| {spec} | {tpf:.2f} | {committed / cycles:.2f} | {charged:.1f} ({old:.1f}) | "
              f"{1e3 * draft_s / cycles:.1f} |")


if __name__ == "__main__":
    main()
