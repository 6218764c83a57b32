"""ViSpec runs on a toy world (docs/drafters/vispec.md), through the one shared trainer and `train_drafter_on_world`:
vispec itself, its ablations (n_c compressed tokens per image / frame, MTP passes), and eagle2 on vispec's data
(the same text-only stage 1 and long, sampled stage-2 answers, the same epochs: the comparison at the same data and
budget).

    OMP_NUM_THREADS=1 python experiments/vispec_ablation.py vispec --out DIR                  # n_c 1, 1 MTP pass
    OMP_NUM_THREADS=1 python experiments/vispec_ablation.py vispec --objective eagle --out DIR  # EAGLE's loss
    OMP_NUM_THREADS=1 python experiments/vispec_ablation.py vispec --compressed 4 --out DIR   # Table 2's sweep
    OMP_NUM_THREADS=1 python experiments/vispec_ablation.py vispec --mtp-steps 0 --out DIR    # without MTP
    OMP_NUM_THREADS=1 python experiments/vispec_ablation.py eagle2 --out DIR                  # eagle2, vispec's data

Defaults: toy-m, the 200 prompts eagle2's baseline was trained on (rewritten at length, answered at T 1) + 200
text-only prompts, 12 epochs of which 4 text-only (stage 1), no held-out τ per epoch (`--heldout N` to measure it).
`mmspec train-drafter --method vispec --target toy-m --examples 200 --epochs 12 --text-epochs 4 --out DIR` trains
the same drafter, with the held-out τ of 12 validation prompts each epoch.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from mmspec_ray.toy.build import build_toy
from mmspec_ray.toy.drafter import RECIPES, train_drafter_on_world
from mmspec_ray.training.methods import TrainingMethod, ViSpecMethod


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("method", choices=["vispec", "eagle2"])
    p.add_argument("--target", default="toy-m")
    p.add_argument("--examples", type=int, default=200, help="multimodal (and text-only) training prompts")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--text-epochs", type=int, default=4, help="stage-1 (text-only) epochs")
    p.add_argument("--compressed", type=int, default=None, help="vispec: n_c tokens per image / frame (default 1)")
    p.add_argument("--mtp-steps", type=int, default=None, help="vispec: MTP passes after the first (default 1)")
    p.add_argument("--objective", choices=["paper", "eagle", "l1_rank"], default="paper",
                   help="vispec: the training objective (paper: Eq. 6's soft CE; eagle: EAGLE's loss; l1_rank: the "
                        "authors' code)")
    p.add_argument("--answer-temperature", type=float, default=1.0, help="stage-2 answers' sampling temperature")
    p.add_argument("--plain-answers", action="store_true", help="stage 2 on the prompts as they are (greedy)")
    p.add_argument("--heldout", type=int, default=0, help="validation prompts for a held-out τ per epoch")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    method = (ViSpecMethod(a.compressed, a.mtp_steps, objective=a.objective) if a.method == "vispec"
              else TrainingMethod())
    recipe = RECIPES[a.target]
    recipe = recipe.model_copy(update={
        "examples": a.examples, "text_examples": a.examples, "heldout": a.heldout,
        "long_answers": not a.plain_answers, "answer_temperature": 0.0 if a.plain_answers else a.answer_temperature,
        "train": recipe.train.model_copy(update={"epochs": a.epochs, "text_epochs": a.text_epochs,
                                                 "gradual": False})})
    train_drafter_on_world(build_toy(a.target), Path(a.out), method, recipe)


if __name__ == "__main__":
    main()
