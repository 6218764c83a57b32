"""The plan `mmspec train-drafter --data` and `jobs/train_drafter.py` print before any work (and `--dry-run`
prints alone), as terminal lines: the target, the data and its mix, the method and why, who answers the prompts
and where, the trainer, and where features and the drafter go. The plan itself (`training.pipeline.train_plan`) is
made from the checkpoint's files and the input's metadata only: no model is loaded."""

from __future__ import annotations

from typing import Any

from mmspec_ray.batch.plan import params_text


def format_train_plan(plan: dict[str, Any]) -> str:
    """The plan as a few lines for the terminal."""
    mix, dg, tr = plan["mix"], plan["datagen"], plan["trainer"]
    n = max(1, mix.get("rows", plan["rows"]))  # the mix is of the whole input, --limit or not
    where = "1 GPU each" if dg["gpus_per_actor"] else "CPU"
    if tr["kind"] == "ray-train":
        trainer = (f"Ray Train, {tr['workers']} workers ({'1 GPU' if tr['gpu'] else 'CPU'}, "
                   f"{tr['cpus_per_worker']:g} CPU each; the target is not loaded on them)")
    else:
        trainer = "single process, " + ("as a Ray task holding one GPU" if tr["gpu"] else "in this process")
    stage = f" (the first {tr['text_epochs']} on text-only rows)" if tr["text_epochs"] else ""
    return "\n".join([
        "plan:",
        f"  target   {plan['target']} ({plan['family']}, {params_text(plan['parameters'])} parameters)",
        f"  data     {plan['rows']} rows from {plan['data']} ({plan['train_rows']} to train on, "
        f"{plan['heldout_rows']} held out for the drafter's τ); the input is {mix['video'] / n:.0%} video, "
        f"{mix['image'] / n:.0%} image, {mix['text'] / n:.0%} text-only",
        f"  method   {plan['method']}: {plan['method_why']}",
        f"  answers  the target answers every training row on {dg['actors']} actor(s), {where}, {dg['dtype']}; "
        f"{dg['answers']}, up to {dg['max_new_tokens']} new tokens",
        f"  trainer  {trainer}; {tr['epochs']} epochs{stage}, batch {tr['batch_size']}",
        f"  work     {plan['work']} (features and checkpoints: a re-run resumes from them)",
        f"  output   {plan['out']}",
    ])
