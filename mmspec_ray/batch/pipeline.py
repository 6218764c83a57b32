"""The Ray Data batch pipeline: read parquet -> skip done ids -> small blocks -> decode media (CPU tasks) ->
SpecDecoder actor pool -> write parquet -> summary.

Exactly-once: every input id must be unique; the output directory is the checkpoint (its readable parts list the
ids already done), so a re-run decodes only the rest. Inside one run, a block's output is written only after its
actor call returned, and a crashed actor is restarted by Ray Data with its in-flight calls retried (actor pool
defaults `max_restarts=-1`, `max_task_retries=-1`), so no row is lost or written twice.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import ray

from mmspec_ray.batch.cluster import check_gpus, connect_ray, plan_actor_cpus, release_failed_run
from mmspec_ray.batch.decoder import SpecDecoder
from mmspec_ray.batch.progress import ProgressPrinter, ProgressTracker
from mmspec_ray.batch.rows import IMAGE_FIELDS, INTERNAL_COLUMNS, OUTPUT_COLUMNS, VIDEO_FIELDS
from mmspec_ray.batch.spec import DecodeConfig, JobSpec
from mmspec_ray.batch.stages import keep_ids, prepare_block
from mmspec_ray.batch.storage import (SUMMARY_NAME, Location, check_ids, clear_output, input_dataset, locate,
                                      parquet_files, scan_output, write_json)
from mmspec_ray.batch.summary import SUMMARY_COLUMNS, format_summary, summarize

log = logging.getLogger(__name__)


def run_job(spec: JobSpec, table: pa.Table | None = None, decoder_cls: type = SpecDecoder) -> dict[str, Any]:
    """Run (or resume) a batch job and return its summary (also written to `<output>/_summary.json`).

    `table`: in-memory input rows (e.g. built from a Kinetics CSV) instead of reading `spec.input`.
    `decoder_cls`: the actor class (a SpecDecoder subclass in tests)."""
    t_start = time.time()
    cfg = spec.decode
    out = locate(spec.output, cfg.s3)
    source = None if table is not None else locate(spec.input, cfg.s3)
    schema, ids = (table.schema, table.column("id")) if table is not None else _scan_input(source)
    check_columns(schema, cfg, spec.input)
    check_ids(ids, spec.input)
    ids = ids.combine_chunks()
    n_input = len(ids)
    if spec.limit is not None:
        ids = ids.slice(0, spec.limit)
    if spec.overwrite:
        clear_output(out)
    state, _ = scan_output(out)
    todo = ids.filter(pc.invert(pc.is_in(ids, value_set=state.ids.cast(ids.type))))
    log.info("job %s -> %s: %d rows, %d already in the output, %d to decode", spec.input, spec.output, len(ids),
             len(ids) - len(todo), len(todo))
    t_run = time.time()
    progress = None
    if len(todo):
        connect_ray()
        tracker = ProgressTracker.remote(len(todo))
        ds = _build(spec, table, source, todo, full=len(todo) == n_input, decoder_cls=decoder_cls, tracker=tracker)
        try:
            with ProgressPrinter(tracker, spec.progress_interval_s):
                ds.write_parquet(out.ray_path, filesystem=out.fs, min_rows_per_file=spec.rows_per_file,
                                 ray_remote_args={"num_cpus": spec.cpus_per_task})
            progress = ray.get(tracker.snapshot.remote())
        except BaseException as e:
            del ds
            release_failed_run(e)
            raise
        finally:
            ray.kill(tracker)
    wall = time.time() - t_run
    _, written = scan_output(out, SUMMARY_COLUMNS)
    summary = summarize(written, ids, todo, wall, _meta(spec, t_start, state.removed), progress)
    write_json(out.child(SUMMARY_NAME), summary)
    log.info(format_summary(summary))
    return summary


def _scan_input(source: Location) -> tuple[pa.Schema, pa.ChunkedArray]:
    dataset = input_dataset(source)
    if "id" not in dataset.schema.names:
        raise ValueError(f"input {source.uri} has no `id` column; every row needs a unique id (resume keys on it)")
    return dataset.schema, dataset.to_table(columns=["id"]).column("id")


def check_columns(schema: pa.Schema, cfg: DecodeConfig, where: str) -> None:
    """Job-level input mistakes fail before anything starts (per-row nulls are row errors instead)."""
    names = set(schema.names)
    clash = sorted(names & set(OUTPUT_COLUMNS + INTERNAL_COLUMNS))
    if clash:
        raise ValueError(f"input {where} already has output column(s) {clash}; is it a previous job's output? "
                         "Drop or rename them")
    if "prompt" not in names and "messages" not in names and cfg.default_prompt is None:
        raise ValueError(f"input {where} has no `prompt` or `messages` column; add one or set a default prompt")
    need = cfg.media.require
    fields = IMAGE_FIELDS if need == "image" else VIDEO_FIELDS if need == "video" else ()
    if fields and not names & set(fields):
        raise ValueError(f"input {where} has no {' / '.join(fields)} column, but this job needs a {need} per row")


def _decode_config(spec: JobSpec, actor_cpus: float) -> DecodeConfig:
    """The actors' config: device resolved from the pool's GPUs, torch threads matched to the actor's CPUs."""
    cfg = spec.decode
    update: dict[str, Any] = {}
    if cfg.device == "auto":
        update["device"] = "cuda" if spec.gpus_per_actor > 0 else "cpu"
    if cfg.torch_threads is None:
        update["torch_threads"] = max(1, int(actor_cpus))
    return cfg.model_copy(update=update)


def _build(spec: JobSpec, table: pa.Table | None, source: Location | None, todo: pa.Array, full: bool,
           decoder_cls: type, tracker: Any = None) -> ray.data.Dataset:
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = spec.progress_bars
    ctx.max_errored_blocks = 0  # rows never raise; a raising block is a real failure, never a silent drop
    check_gpus(spec)
    actor_cpus = plan_actor_cpus(spec)
    cfg = _decode_config(spec, actor_cpus)
    task = {"num_cpus": spec.cpus_per_task}
    if table is not None:
        ds = ray.data.from_arrow(table if full else keep_ids(table, todo))
    else:
        files = parquet_files(source)
        paths = [f"s3://{f}" for f in files] if source.is_s3 else files
        ds = ray.data.read_parquet(paths, filesystem=source.fs, **task)
        if not full:
            ds = ds.map_batches(keep_ids, fn_kwargs={"ids": todo}, batch_format="pyarrow", batch_size=None, **task)
    ds = ds.repartition(target_num_rows_per_block=spec.rows_per_block)
    ds = ds.map_batches(prepare_block, fn_kwargs={"cfg": cfg}, batch_format="pyarrow", batch_size=None, **task)
    return ds.map_batches(
        decoder_cls,
        fn_constructor_kwargs={"config": cfg, "progress": tracker},
        batch_size=spec.rows_per_block,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(min_size=spec.pool_min, max_size=spec.num_actors,
                                           max_tasks_in_flight_per_actor=2),
        num_cpus=actor_cpus,
        num_gpus=spec.gpus_per_actor or None,
        udf_modifying_row_count=False,
    )


def _meta(spec: JobSpec, t_start: float, removed: list[str]) -> dict[str, Any]:
    d = spec.decode
    return {
        "input": spec.input, "output": spec.output,
        "target": d.target, "drafter": d.drafter, "num_actors": spec.num_actors,
        "gpus_per_actor": spec.gpus_per_actor, "max_new_tokens": d.max_new_tokens, "temperature": d.temperature,
        "limit": spec.limit,
        "started_at": datetime.fromtimestamp(t_start, timezone.utc).isoformat(timespec="seconds"),
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "removed_partial_files": [Path(r).name for r in removed],
    }
