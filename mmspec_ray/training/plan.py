"""The plan `mmspec train-drafter --data` and `jobs/train_drafter.py` print before any work (and `--dry-run`
prints alone): the target, the data and its mix, the method and why, who answers the prompts and where, the
trainer, and where features and the drafter go. Made from the checkpoint's files and the input's metadata only:
no model is loaded."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mmspec_ray.batch.plan import params_text

if TYPE_CHECKING:
    from mmspec_ray.targets.layout import CheckpointLayout
    from mmspec_ray.training.choose import DataMix
    from mmspec_ray.training.pipeline import TrainJob


def train_plan(job: "TrainJob", layout: "CheckpointLayout", rows: int, mix: "DataMix") -> dict[str, Any]:
    """The plan as a dict (also the summary's `plan`); `rows`: input rows after --limit; `mix`: their kinds."""
    from mmspec_ray.training.methods import training_method
    from mmspec_ray.training.schedule import stage_schedule

    m = training_method(job.method)
    stages = stage_schedule(m, job.train)
    dtype = job.decode.get("dtype", "auto")
    if dtype == "auto":
        dtype = "bfloat16" if job.use_gpu else "float32"
    temp = job.recipe.temperature
    return {
        "target": job.target, "family": layout.model_type, "parameters": layout.parameters,
        "data": job.data, "rows": rows, "train_rows": rows - job.heldout, "heldout_rows": job.heldout,
        "mix": {"video": mix.video, "image": mix.image, "text": mix.text},
        "method": m.name, "method_why": job.method_why,
        "datagen": {"actors": job.datagen_actors, "gpus_per_actor": job.gpus_per_actor, "dtype": dtype,
                    "answers": "greedy" if temp == 0 else f"sampled at T = {temp:g}",
                    "max_new_tokens": job.recipe.max_new_tokens},
        "trainer": {"kind": "ray-train" if job.num_workers else "single-process", "workers": job.num_workers,
                    "gpu": job.use_gpu, "cpus_per_worker": job.cpus_per_worker, "epochs": job.train.epochs,
                    "text_epochs": stages.text_epochs, "batch_size": job.train.batch_size},
        "work": job.work_dir, "out": job.out,
    }


def format_train_plan(plan: dict[str, Any]) -> str:
    """The plan as a few lines for the terminal."""
    mix, dg, tr = plan["mix"], plan["datagen"], plan["trainer"]
    n = max(1, plan["rows"])
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
        f"{plan['heldout_rows']} held out for the drafter's τ): {mix['video'] / n:.0%} video, "
        f"{mix['image'] / n:.0%} image, {mix['text'] / n:.0%} text-only",
        f"  method   {plan['method']}: {plan['method_why']}",
        f"  answers  the target answers every training row on {dg['actors']} actor(s), {where}, {dg['dtype']}; "
        f"{dg['answers']}, up to {dg['max_new_tokens']} new tokens",
        f"  trainer  {trainer}; {tr['epochs']} epochs{stage}, batch {tr['batch_size']}",
        f"  work     {plan['work']} (features and checkpoints: a re-run resumes from them)",
        f"  output   {plan['out']}",
    ])
