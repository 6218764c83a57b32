"""Command line of the batch jobs (`jobs/caption_kinetics.py`, `jobs/instruct.py`): flags over an optional YAML
job file over defaults. With no flags a job runs on the embedded toy world (toy-s target, its test split).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa

from mmspec_ray.batch.jobspec import (CAPTION_PROMPT, DEFAULT_DRAFTER, DEFAULT_SPLIT, DEFAULT_TOY, DecodeConfig, JobSpec,
                                     merge)
from mmspec_ray.config import S3Config, mmspec_home

log = logging.getLogger("mmspec.batch")

JOBS = {
    "caption_kinetics": {"media": "video", "help": "caption video clips (Kinetics CSV + clip root, or parquet)"},
    "instruct": {"media": "image", "help": "answer an instruction about an image per row"},
}


def build_parser(job: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"jobs/{job}.py", description=JOBS[job]["help"])
    a = p.add_argument
    a("--config", help="YAML job file (JobSpec); flags override it")
    a("--input", help="parquet file/dir (local or s3://)" + (" or a Kinetics annotation CSV" if job ==
      "caption_kinetics" else "") + f"; default: the {DEFAULT_TOY} toy world's {DEFAULT_SPLIT} split")
    if job == "caption_kinetics":
        a("--clip-root", help="folder (local or s3://) of <youtube_id>_<start:06d>_<end:06d>.mp4 clips for a CSV input")
    a("--output", help="output directory (local or s3://); re-running resumes; default under $MMSPEC_HOME/batch/")
    a("--target", help=f"checkpoint dir or s3:// prefix, or a toy world name (default {DEFAULT_TOY})")
    a("--drafter", help='"auto" (the default: a toy world\'s shipped drafter; for a checkpoint the drafter trained '
      'for it with the best recorded held-out tau in $MMSPEC_HOME/drafters and --drafter-dir, else ngram), "ngram", '
      '"none", a drafter checkpoint dir / s3:// prefix, or draft-model:PATH (a smaller checkpoint of the target\'s '
      'family sharing its tokenizer and processor)')
    a("--drafter-dir", action="append", dest="drafter_dirs", help="a folder (local or s3://) of trained drafters "
      "where auto also looks (repeatable)")
    a("--dry-run", action="store_true", help="print the plan (after reading the input's schema and counting rows) "
      "and exit without loading a model or writing anything")
    a("--toy", default=DEFAULT_TOY, help="toy world for the defaults (toy-s, toy-m)")
    a("--split", default=DEFAULT_SPLIT, help="toy world split for the default input")
    a("--num-actors", type=int)
    a("--min-actors", type=int, help="autoscale the pool between --min-actors and --num-actors")
    a("--gpus-per-actor", type=gpus_arg, help="auto (the default): one GPU per actor where the cluster has GPUs, "
      "CPU where it has none; a fraction such as 0.5 packs several actors on one GPU")
    a("--cpus-per-actor", type=float)
    a("--max-new-tokens", type=int)
    a("--temperature", type=float)
    a("--top-p", type=float)
    a("--top-k", type=int)
    a("--min-p", type=float)
    a("--repetition-penalty", type=float, help="default: the checkpoint's generation config")
    a("--seed", type=int)
    a("--limit", type=int, help="only the first N input rows")
    a("--prompt", help="prompt for rows without a prompt column" +
      (f" (default {CAPTION_PROMPT!r})" if job == "caption_kinetics" else ""))
    a("--num-frames", type=int, help="frames per clip (default: the target's convention)")
    a("--fps", type=float, help="sample clips at this rate instead of --num-frames")
    a("--rows-per-block", type=int, help="rows per actor call (retry and resume unit)")
    a("--rows-per-file", type=int, help="combine output into files of at least N rows (default 64; 0: a file per "
      "block, i.e. per --rows-per-block rows)")
    a("--speedup-sample", type=int, help="rows per decoder also decoded with plain AR, for the measured speedup in "
      "the summary (default 16, every 4th settled row; 0: off)")
    a("--device")
    a("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    a("--s3-endpoint", help="S3-compatible endpoint, e.g. http://127.0.0.1:9000 (default: AWS_ENDPOINT_URL_S3, else "
      "AWS_ENDPOINT_URL)")
    a("--s3-region")
    a("--overwrite", action="store_true", default=None, help="start over: delete this job's earlier output "
      "(only files it wrote) instead of resuming")
    a("--redecode-changed", action="store_true", default=None, help="resume after the input changed: decode the "
      "rows of the new or changed input files again and drop rows no longer in the input (refused without it)")
    a("--break-lease", action="store_true", default=None, help="take the output's lease though another job holds "
      "it: after a job crashed, instead of waiting for its lease to expire (never while that job still runs)")
    a("--fingerprint-media", action="store_true", default=None, help="record each row's media URIs' ETag / size "
      "+ mtime and, on a resume, decode again the rows whose media changed behind the same URI (one HEAD or stat per "
      "URI at each run's start)")
    a("--retry-errors", help="comma-separated error kinds to decode again on a resume (e.g. internal,crash,"
      "media.not_found); media.unavailable rows are always retried")
    a("--max-row-crashes", type=int, help="file a row as error kind `crash` after it killed this many decoders "
      "(default 2)")
    a("--no-progress-bars", dest="progress_bars", action="store_false", default=None)
    a("--progress-interval", type=float, dest="progress_interval_s")
    a("-v", "--verbose", action="store_true")
    return p


def gpus_arg(value: str) -> float | str:
    """--gpus-per-actor: auto or a number of GPUs (a fraction packs actors on one GPU)."""
    if value == "auto":
        return value
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither auto nor a number of GPUs") from None


def flag_overrides(a: argparse.Namespace) -> dict[str, Any]:
    """Flags the user gave, nested the way JobSpec is."""
    top = {k: getattr(a, k) for k in ("input", "output", "num_actors", "min_actors", "gpus_per_actor",
                                      "cpus_per_actor", "limit", "rows_per_block", "rows_per_file", "overwrite",
                                      "redecode_changed", "break_lease", "progress_bars", "progress_interval_s",
                                      "max_row_crashes", "fingerprint_media")}
    if a.retry_errors:
        top["retry_errors"] = [k.strip() for k in a.retry_errors.split(",") if k.strip()]
    dec = {k: getattr(a, k) for k in ("target", "drafter", "max_new_tokens", "temperature", "top_p", "top_k",
                                      "min_p", "repetition_penalty", "seed", "device", "dtype", "speedup_sample",
                                      "drafter_dirs")}
    dec["default_prompt"] = a.prompt
    media = {"num_frames": a.num_frames, "fps": a.fps}
    s3 = {}
    if a.s3_endpoint:
        s3 = {"endpoint_override": a.s3_endpoint.split("://", 1)[-1],
              "scheme": "http" if a.s3_endpoint.startswith("http://") else "https"}
    if a.s3_region:
        s3["region"] = a.s3_region
    dec = {k: v for k, v in dec.items() if v is not None}
    media = {k: v for k, v in media.items() if v is not None}
    if media:
        dec["media"] = media
    if s3:
        dec["s3"] = s3
    out = {k: v for k, v in top.items() if v is not None}
    if a.rows_per_file == 0:  # 0: one file per block (finest resume granularity)
        out["rows_per_file"] = None
    if dec:
        out["decode"] = dec
    return out


def resolve_target(target: str) -> str:
    """A toy world name becomes its (built on first use) checkpoint directory; anything else passes through."""
    from mmspec_ray.toy.resolve import resolve_target as resolve

    return resolve(target)


def frames_default(target: str) -> int | None:
    """The target's frames-per-clip convention (toy targets record theirs); None for an s3:// target."""
    if target.startswith("s3://"):
        return None
    from mmspec_ray.targets.hf import video_frames_for

    return video_frames_for(target)


def check_drafter_dirs(dirs: tuple[str, ...], s3: S3Config) -> None:
    """Every `--drafter-dir` must exist: a misspelt one would otherwise read as "no drafter found" and decode
    plainly."""
    from mmspec_ray.batch.storage import JobInputError, exists, locate

    for d in dirs:
        try:
            found = exists(locate(d, s3))
        except OSError as e:
            raise JobInputError(f"--drafter-dir {d}: cannot be read ({e}); check the path and the S3 settings") from e
        if not found:
            raise JobInputError(f"--drafter-dir {d} does not exist; give a folder holding trained drafters (or one "
                                "drafter), or leave the flag out to look only in $MMSPEC_HOME/drafters")


def plan(job: str, a: argparse.Namespace) -> tuple[JobSpec, pa.Table | None, str | None]:
    """The JobSpec, for CSV or toy-world inputs the rows built in memory, and why its drafter was chosen."""
    from mmspec_ray.batch.sources import kinetics_rows, toy_rows
    from mmspec_ray.toy.resolve import toy_world

    data: dict[str, Any] = {}
    if a.config:
        import yaml

        data = yaml.safe_load(Path(a.config).read_text()) or {}
    data = merge(data, flag_overrides(a))
    dec = data.setdefault("decode", {})
    dec["target"] = resolve_target(dec.get("target") or a.toy)
    why = None
    if dec.get("drafter", DEFAULT_DRAFTER) == "auto":  # found (or a toy one trained) here, before any decoder starts
        from mmspec_ray.toy.drafter import choose_drafter

        s3 = S3Config.model_validate(dec["s3"]) if "s3" in dec else None
        check_drafter_dirs(tuple(dec.get("drafter_dirs") or ()), s3 or S3Config.from_env())
        choice = choose_drafter("auto", dec["target"], tuple(dec.get("drafter_dirs") or ()), data.get("input"), s3,
                                dec.get("max_new_tokens", DecodeConfig.model_fields["max_new_tokens"].default))
        dec["drafter"], why = choice.spec, choice.why
    media = dec.setdefault("media", {})
    media.setdefault("require", JOBS[job]["media"])
    if job == "caption_kinetics":
        dec.setdefault("default_prompt", CAPTION_PROMPT)
        if media.get("fps") is None and media.get("num_frames") is None:
            media["num_frames"] = frames_default(dec["target"])
    table = None
    if not data.get("input"):
        world = toy_world(a.toy)
        if job == "caption_kinetics":
            table = kinetics_rows(str(world.kinetics_csv(a.split)), str(world.clips / a.split), dec["default_prompt"])
            data["input"] = str(world.kinetics_csv(a.split))
        else:
            table = toy_rows(str(world.examples(a.split)), str(world.data), "image")
            data["input"] = f"{world.examples(a.split)} (image rows)"
    elif job == "caption_kinetics" and data["input"].lower().endswith(".csv"):
        if not a.clip_root:
            from mmspec_ray.batch.storage import JobInputError

            raise JobInputError("a Kinetics CSV input needs --clip-root (the folder of "
                                "<youtube_id>_<start:06d>_<end:06d>.mp4 clips, local or s3://)")
        s3 = S3Config.model_validate(dec["s3"]) if "s3" in dec else S3Config.from_env()
        table = kinetics_rows(data["input"], a.clip_root, dec["default_prompt"], s3)
        if data.get("output"):
            from mmspec_ray.batch.storage import check_disjoint, locate

            out = locate(data["output"], s3)
            check_disjoint(locate(data["input"], s3), out, "annotation CSV")
    if not data.get("output"):
        target_name = Path(dec["target"].rstrip("/")).name
        if target_name == "target":  # a toy world's checkpoint folder: name the world instead
            target_name = Path(dec["target"].rstrip("/")).parent.name
        drafter = Path(str(dec.get("drafter") or DEFAULT_DRAFTER).rstrip("/")).name
        data["output"] = str(mmspec_home() / "batch" / f"{job}-{target_name}-{drafter}")
    return JobSpec.model_validate(data), table, why


def main(argv: list[str] | None, job: str) -> int:
    """Run a job. Exit codes: 0 done; 1 rows missing from the output; 2 a job-level mistake (bad input, output or
    settings: one line printed); 3 done, but some rows failed transiently and a re-run would retry them."""
    a = build_parser(job).parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pydantic import ValidationError

    from mmspec_ray.batch.pipeline import run_job
    from mmspec_ray.batch.storage import JobInputError

    try:
        spec, table, why = plan(job, a)
        log.info("job spec:\n%s", spec.to_yaml())
        summary = run_job(spec, table=table, drafter_why=why, dry_run=a.dry_run)
    except JobInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        print(f"error: job setting {where}: {first['msg']} (got {first.get('input')!r})", file=sys.stderr)
        return 2
    if a.dry_run:
        return 0
    print(json.dumps(summary, indent=2, default=str))
    if not summary["complete"]:
        return 1
    if summary["retryable_rows"]:
        print(f"{summary['retryable_rows']} rows failed with transient errors (media store unreachable): re-run the "
              "same command to decode just those rows", file=sys.stderr)
        return 3
    return 0


def entry(job: str) -> None:
    sys.exit(main(sys.argv[1:], job))
