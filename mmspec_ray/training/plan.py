"""The plan `mmspec train-drafter --data` and `jobs/train_drafter.py` print before any work (and `--dry-run`
prints alone), as terminal lines: the target, the data and its mix, the method and why, who answers the prompts
and where, where the answers are stored (and how many are reused), the trainer (or, for a corpus-only method, the
corpus it builds), and where checkpoints and the drafter go. The plan itself (`training.pipeline.train_plan`) is
made from the checkpoint's files and the input's metadata only: no model is loaded."""

from __future__ import annotations

from typing import Any

from mmspec_ray.batch.plan import params_text


def format_train_plan(plan: dict[str, Any]) -> str:
    """The plan as a few lines for the terminal."""
    mix, dg = plan["mix"], plan["datagen"]
    n = max(1, mix.get("rows", plan["rows"]))  # the mix is of the whole input, --limit or not
    where = "1 GPU each" if dg["gpus_per_actor"] else "CPU"
    lines = [
        "plan:",
        f"  target   {plan['target']} ({plan['family']}, {params_text(plan['parameters'])} parameters)",
        f"  data     {plan['rows']} rows from {plan['data']} ({plan['train_rows']} to train on, "
        f"{plan['heldout_rows']} held out for the drafter's τ); the input is {mix['video'] / n:.0%} video, "
        f"{mix['image'] / n:.0%} image, {mix['text'] / n:.0%} text-only",
        f"  method   {plan['method']}: {plan['method_why']}",
        f"  answers  the target answers {which_rows(plan)} on {dg['actors']} actor(s), {where}, {dg['dtype']}; "
        f"{dg['answers']}, up to {dg['max_new_tokens']} new tokens",
    ]
    if "stored" in dg:
        from mmspec_ray.training.answers import reuse_text

        done = dg.get("reused_rows", 0)
        todo = max(0, plan["train_rows"] - done)
        lines.append(f"  stored   {reuse_text(dg['stored'], done, todo, dg.get('shared', True))}")
    lines += [
        f"  trainer  {trainer_text(plan)}",
        f"  work     {plan['work']} (checkpoints and the trainer's files: a re-run resumes from them)",
        f"  output   {plan['out']}",
    ]
    return "\n".join(lines)


def which_rows(plan: dict[str, Any]) -> str:
    """The training rows the target answers in this run: every one, or those whose answers are not stored yet."""
    done = plan["datagen"].get("reused_rows", 0)
    return "every training row" if not done else f"the training rows not answered yet " \
        f"({max(0, plan['train_rows'] - done)})"


def trainer_text(plan: dict[str, Any]) -> str:
    """What the trainer does: a corpus built in one pass (suffix: no network, no epochs), or who trains how long."""
    tr = plan["trainer"]
    if tr["kind"] == "corpus":
        return (f"none: {plan['method']} trains no network; it builds its corpus from the target's answers to the "
                f"{plan['train_rows']} training rows in one pass, in one process (no epochs, no batches)")
    if tr["kind"] == "ray-train":
        trainer = (f"Ray Train, {tr['workers']} workers ({'1 GPU' if tr['gpu'] else 'CPU'}, "
                   f"{tr['cpus_per_worker']:g} CPU each; the target is not loaded on them)")
    else:
        trainer = "single process, " + ("as a Ray task holding one GPU" if tr["gpu"] else "in this process")
    stage = f" (the first {tr['text_epochs']} on text-only rows)" if tr["text_epochs"] else ""
    return f"{trainer}; {tr['epochs']} epochs{stage}, batch {tr['batch_size']}"
