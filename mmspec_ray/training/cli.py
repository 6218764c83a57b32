"""Command-line flags of drafter training from a request data set, shared by `mmspec train-drafter --data ...` and
`jobs/train_drafter.py` (the `ray job submit` entry point), so both build the same `TrainJob`."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from typing import TYPE_CHECKING

from pydantic import ValidationError

if TYPE_CHECKING:
    from mmspec_ray.training.pipeline import TrainJob

log = logging.getLogger(__name__)

AUTO_HELP = ("auto (the default): chosen by one rule from the target's depth, the data's video / image / text-only "
             "rows and --answer-temperature, by the project's measurements (docs/training.md, \"Which method\"); "
             "the plan says why")
TRAIN_FLAGS = ("epochs", "batch_size", "lr", "text_epochs", "multistep_epochs", "seed", "bucket_batches")


def add_data_args(p: argparse.ArgumentParser) -> None:
    """Flags for training on a request data set (the method / target / out flags are the caller's)."""
    a = p.add_argument
    a("--data", default=None, help="parquet file or directory of request rows (id, prompt or messages, image / "
      "image_uri / video / video_uri), local or s3://: the target answers them and the drafter learns its features")
    a("--work", default=None, help="features and Ray Train checkpoints, local or s3:// (default: OUT.work); a "
      "re-run with the same --work resumes data generation and training")
    a("--heldout", type=int, default=16, help="last N rows held out for the final τ (default 16)")
    a("--limit", type=int, default=None, help="use only the first N rows")
    a("--batch-size", type=int, default=None)
    a("--lr", type=float, default=None)
    a("--seed", type=int, default=None, help="training seed (initialisation, order, noise)")
    a("--bucket-batches", type=int, default=None,
      help="length bucketing span in batches (default 8; 2 gave a better drafter on toy-s, docs/training.md)")
    a("--max-new-tokens", type=int, default=256, help="the target's answer length cap in data generation")
    a("--answer-temperature", type=float, default=None,
      help="0: greedy answers; >0: sampled answers (default: the method's recipe; greedy for eagle2 and msd)")
    a("--num-workers", type=int, default=0,
      help="0: the single-process trainer (data in memory); N: Ray Train with N data-parallel workers")
    a("--use-gpu", action="store_true", help="Ray Train workers and data generation actors on GPUs")
    a("--cpus-per-worker", type=float, default=1.0)
    a("--max-failures", type=int, default=3, help="Ray Train worker-group restarts from the last checkpoint")
    a("--datagen-actors", type=int, default=1, help="target actors answering prompts (Ray Data actor pool)")
    a("--rows-per-shard", type=int, default=32, help="rows per feature shard: the unit of resume (Ray Train needs at "
      "least as many shards as workers; long video answers of a 7B target are ~10 MB a row)")
    a("--device", default="auto", help="data generation device: auto (cuda with --use-gpu), cpu, cuda")
    a("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    a("--method-option", action="append", default=[], metavar="KEY=VALUE",
      help="an option of the method's class, repeatable (hivis: min_answer_words=0; vispec: mtp_steps=2; "
      "specflash: ratio=0.25); values are JSON (numbers, true/false) or text")
    a("--dry-run", action="store_true", help="print the plan (target, data mix, method and why, trainer) and exit: "
      "no model loaded, nothing written")


def job_from_args(a: argparse.Namespace, target: str) -> "TrainJob":
    """The TrainJob the flags describe (pydantic checks every value; errors name the field)."""
    from mmspec_ray.training.methods import training_method
    from mmspec_ray.training.pipeline import TrainJob

    if not a.out:
        raise ValueError("--out is required with --data: the drafter checkpoint directory or s3:// prefix")
    toy_only = [f for f, v in (("--examples", getattr(a, "examples", None)),
                               ("--text-examples", getattr(a, "text_examples", None)),
                               ("--force", getattr(a, "force", False)),
                               ("--long-answers / --plain-answers", getattr(a, "long_answers", None) is not None))
                if v]
    if toy_only:
        raise ValueError(f"{', '.join(toy_only)}: toy-world options; with --data the rows are the data (use --limit) "
                         "and a re-run resumes (give a new --work and --out to start over)")
    why = "given"
    if a.method == "auto":
        a.method, why = auto_method(a, target)
    train = {"epochs": 8, "batch_size": 16, "lr": 2e-3}
    train.update({k: getattr(a, k) for k in TRAIN_FLAGS if getattr(a, k, None) is not None})
    if getattr(a, "direct", False):
        train["gradual"] = False
    decode = {"device": a.device if a.device != "auto" else ("cuda" if a.use_gpu else "auto"), "dtype": a.dtype}
    return TrainJob(method=a.method, method_why=why, method_options=method_options(a.method_option), target=target,
                    data=a.data, out=a.out, work=a.work, heldout=a.heldout,
                    limit=a.limit, train=train,
                    recipe={"max_new_tokens": a.max_new_tokens, "temperature": a.answer_temperature
                            if a.answer_temperature is not None else training_method(a.method).answer_temperature,
                            "mid_features": "mid" in training_method(a.method).needs,
                            "aux_features": "aux" in training_method(a.method).needs},
                    decode=decode, datagen_actors=a.datagen_actors, gpus_per_actor=1.0 if a.use_gpu else 0.0,
                    num_workers=a.num_workers, use_gpu=a.use_gpu, cpus_per_worker=a.cpus_per_worker,
                    max_failures=a.max_failures, rows_per_shard=a.rows_per_shard)


def method_options(pairs: list[str]) -> dict:
    """`--method-option KEY=VALUE` flags as a dict (values parsed as JSON where they are, else kept as text)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--method-option {pair!r}: expected KEY=VALUE, e.g. min_answer_words=0")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out


def auto_method(a: argparse.Namespace, target: str) -> tuple[str, str]:
    """`--method auto`: (method, why) by `training.choose.choose_method` from the rows in --data (video / image /
    text only), the answer temperature and the target's depth; the plan prints why."""
    from mmspec_ray.training.choose import choose_method, data_mix

    method, why = choose_method(data_mix(a.data), sampled=bool(a.answer_temperature), layers=target_layers(target))
    return method, f"auto: {why}"


def target_layers(target: str) -> int | None:
    """The checkpoint's decoder layers from its config, or None where it cannot be read (the run then refuses the
    checkpoint in one line, before any work)."""
    from mmspec_ray.targets.layout import read_layout
    from mmspec_ray.targets.request import TargetError
    from mmspec_ray.training.choose import decoder_layers

    try:
        return decoder_layers(read_layout(target))
    except (TargetError, OSError, ValueError):
        return None


def toy_auto_method(size: str, examples: int | None, text_examples: int | None, sampled: bool) -> tuple[str, str]:
    """`--method auto` for a toy world trained on its own data (no --data): the same rule, on the mix of the
    world's multimodal training prompts and its text-only corpus, and its target's depth."""
    from mmspec_ray.toy.build import build_toy
    from mmspec_ray.toy.drafter import RECIPES
    from mmspec_ray.toy.model import TOY_SIZES
    from mmspec_ray.toy.prompts import toy_rows
    from mmspec_ray.training.choose import DataMix, choose_method

    n = examples or RECIPES[size].examples
    rows = toy_rows(build_toy(size), "train", n, seed=1)
    video = sum(r["media_type"] != "image" for r in rows)
    text = text_examples or n
    mix = DataMix(len(rows) + text, video, len(rows) - video, text)
    method, why = choose_method(mix, sampled, layers=TOY_SIZES[size].text_layers)
    return method, f"auto: {why}"


def run(a: argparse.Namespace, target: str) -> int:
    """Run the job the flags describe and print one line per kind of row error (with an example, and where every
    row's reason is), then its summary (held-out τ, examples, where the drafter went) as JSON."""
    from mmspec_ray.training.answers import row_error_lines
    from mmspec_ray.training.pipeline import run_train_job

    summary = run_train_job(job_from_args(a, target), dry_run=a.dry_run)
    if summary.get("dry_run"):
        return 0
    for line in row_error_lines(summary.get("row_errors_by_kind") or {}, summary.get("answers", "")):
        print(line)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("history", "plan", "row_errors_by_kind")},
                     indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """`jobs/train_drafter.py`'s flags (the k8s tests parse the RayJob entrypoints with it)."""
    from mmspec_ray.training.methods import METHODS

    p = argparse.ArgumentParser(prog="train_drafter", description=__doc__)
    p.add_argument("--method", default="auto", choices=["auto", *sorted(METHODS)],
                   help=AUTO_HELP)
    p.add_argument("--target", required=True, help="checkpoint directory or s3:// prefix (or toy-s / toy-m)")
    p.add_argument("--out", required=True, help="drafter checkpoint directory or s3:// prefix")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--text-epochs", type=int, default=None, help="stage-1 (text-only) epochs (msd: half by default)")
    p.add_argument("--multistep-epochs", type=int, default=None, help="hivis: multi-step (stage 2) epochs")
    add_data_args(p)
    return p


def toy_data(size: str, limit: int = 600) -> str:
    """A toy world's train-split prompts as a request parquet (the default --data for a toy target)."""
    import pyarrow.parquet as pq

    from mmspec_ray.toy.build import build_toy, mmspec_home
    from mmspec_ray.toy.prompts import toy_request_table

    path = mmspec_home() / "requests" / f"{size}-train-{limit}.parquet"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(toy_request_table(build_toy(size), "train", limit, seed=1), path)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    """`jobs/train_drafter.py`: requests -> Ray Data datagen -> (Ray Train) training -> drafter at --out."""
    from mmspec_ray.toy.model import TOY_SIZES
    from mmspec_ray.toy.resolve import resolve_target

    p = build_parser()
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.data is None:
        if a.target not in TOY_SIZES:
            p.error("--data is required (a parquet of request rows, local or s3://)")
        a.data = toy_data(a.target)
    try:
        return run(a, resolve_target(a.target))
    except (ValidationError, ValueError) as e:
        print(f"train_drafter: error: {e}", file=sys.stderr)
        return 2
