#!/usr/bin/env python
"""Ray Train against the single-process trainer on the same features, epochs, batch size and LR (docs/training.md):
trains drafters of one method (eagle2 by default) for a toy target from its train-split requests, over seeds, for
each (trainer, workers, length-bucketing span) cell, and prints the held-out τ table. A cell whose drafter already
exists is read back, not retrained, so the table can be re-printed.

    python experiments/train_parity.py --target toy-s --out /tmp/cmp --seeds 0 1 2 3
    python experiments/train_parity.py --method eagle3 --cells 3,4 --target toy-s --out /tmp/cmp3 --seeds 0 1
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path

from mmspec_ray.toy.resolve import resolve_target
from mmspec_ray.training.cli import toy_data
from mmspec_ray.training.pipeline import TrainJob, run_train_job

# (label, Ray Train workers (0: single process), bucket_batches, output folder prefix)
CELLS = [("single process", 0, 8, "sp-seed"), ("Ray Train, 2 workers", 2, 8, "rt-seed"),
         ("Ray Train, 1 worker", 1, 8, "rt1-seed"), ("single process", 0, 2, "sp-b2-seed"),
         ("Ray Train, 2 workers", 2, 2, "rt2-b2-seed")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", default="toy-s")
    p.add_argument("--out", default="/tmp/cmp")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--heldout", type=int, default=24)
    p.add_argument("--method", default="eagle2")
    p.add_argument("--cells", default="0,1,2,3,4", help="which rows of the table to run (indices into CELLS)")
    p.add_argument("--text-epochs", type=int, default=None,
                   help="stage-1 epochs (0: one multimodal stage, for two-stage methods on multimodal rows alone)")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    out = Path(a.out)
    data = toy_data(a.target, a.requests)
    rows = []
    for label, workers, bucket, prefix in [CELLS[int(i)] for i in a.cells.split(",")]:
        taus = []
        for seed in a.seeds:
            d = out / f"{prefix}{seed}"
            if not (d / "history.json").exists():
                run_train_job(TrainJob(method=a.method, target=resolve_target(a.target), data=data, out=str(d),
                                       work=str(out / "work"),
                                       heldout=a.heldout, num_workers=workers, cpus_per_worker=0.5,
                                       train={"epochs": 8, "batch_size": 16, "lr": 2e-3, "seed": seed,
                                              "bucket_batches": bucket,
                                              **({} if a.text_epochs is None else {"text_epochs": a.text_epochs})},
                                       recipe={"max_new_tokens": 200}))
            taus.append(json.loads((d / "history.json").read_text())["heldout_tau"])
        rows.append(f"| {label} | {bucket} | {' / '.join(f'{t:.2f}' for t in taus)} | "
                    f"**{statistics.mean(taus):.2f}** ± {statistics.stdev(taus) if len(taus) > 1 else float('nan'):.2f} |")
    print("| trainer | bucket_batches | held-out τ per seed | mean ± sd |\n|---|---|---|---|\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
