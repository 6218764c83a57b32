"""The Ray Data batch pipeline: read parquet -> skip done ids -> small blocks -> decode media (CPU tasks) ->
SpecDecoder actor pool -> write parquet -> summary.

Exactly-once: every input id must be unique; the output directory is the checkpoint (its readable parts list the
ids already done), so a re-run decodes only the rest. Inside one run, a block's output is written only after its
actor call returned, and a crashed actor is restarted by Ray Data with its in-flight calls retried (actor pool
defaults `max_restarts=-1`, `max_task_retries=-1`), so no row is lost or written twice; a row that kills every
actor it reaches is filed as a `crash` error after `max_row_crashes` tries. The job only ever touches output files
it wrote (batch/output.py), and a resume must match the settings recorded there.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray

from mmspec_ray.batch.cluster import check_gpus, check_local_gpus, connect_ray, plan_actor_cpus, release_failed_run
from mmspec_ray.batch.decoder import SpecDecoder
from mmspec_ray.batch.lease import Lease, check_free, hold
from mmspec_ray.batch.output import (MARKER_NAME, Claim, OutputState, PartNames, check_output_dir, claim,
                                     drop_duplicates, drop_rows, new_run_token, read_marker, record_run, seal)
from mmspec_ray.batch.output import scan as scan_output
from mmspec_ray.batch.plan import check_drafter, check_gpu, format_plan, make_plan, probe_gpu, resolve_gpus
from mmspec_ray.batch.progress import ProgressPrinter, ProgressTracker
from mmspec_ray.batch.jobspec import RETRYABLE_KINDS, DecodeConfig, JobSpec
from mmspec_ray.batch.rows import (IMAGE_FIELDS, INTERNAL_COLUMNS, OUTPUT_COLUMNS, VIDEO_FIELDS, prepare_row,
                                   resolve_image_side)
from mmspec_ray.batch.stages import keep_ids, prepare_block
from mmspec_ray.batch.storage import (SUMMARY_NAME, JobInputError, Location, check_disjoint, check_ids, exists,
                                      file_suffixes, input_fingerprints, input_name, locate, parquet_files, scan_input,
                                      write_json)
from mmspec_ray.batch.summary import SUMMARY_COLUMNS, format_summary, summarize

log = logging.getLogger(__name__)


def run_job(spec: JobSpec, table: pa.Table | None = None, decoder_cls: type = SpecDecoder,
            row_fn: Callable[..., Any] = prepare_row, drafter_why: str | None = None,
            dry_run: bool = False) -> dict[str, Any]:
    """Run (or resume) a batch job and return its summary (also written to `<output>/_summary.json`).

    `table`: in-memory input rows (e.g. built from a Kinetics CSV) instead of reading `spec.input`.
    `decoder_cls`: the actor class (a SpecDecoder subclass in tests); `row_fn`: the media stage's per-row function.
    `drafter_why`: why the drafter was chosen (the plan says it). `dry_run`: print the plan and return it, having
    read the input's schema and ids and the checkpoint's headers only: no model loaded, nothing written.
    Job-level mistakes raise `JobInputError` before anything is written."""
    t_start = time.time()
    out = locate(spec.output, spec.decode.s3)
    source = None if table is not None else locate(spec.input, spec.decode.s3)
    if source is not None:
        check_disjoint(source, out)
    schema, ids = (table.schema, table.column("id")) if table is not None else scan_input(source)
    check_columns(schema, spec.decode, spec.input)
    check_ids(ids, spec.input)
    per_file = ids  # one chunk per input file (a parquet input)
    ids = ids.combine_chunks()
    n_input = len(ids)
    if spec.limit is not None:
        ids = ids.slice(0, spec.limit)
    if spec.decode.drafter == "auto":  # callers that did not choose it (the job scripts do, before planning)
        from mmspec_ray.toy.drafter import choose_drafter

        choice = choose_drafter("auto", spec.decode.target, spec.decode.drafter_dirs, spec.input, spec.decode.s3,
                                spec.decode.max_new_tokens)
        spec = spec.model_copy(update={"decode": spec.decode.model_copy(update={"drafter": choice.spec})})
        drafter_why = choice.why
    check_drafter(spec.decode)  # on this driver, before Ray starts or anything is written
    check_local_gpus(spec)
    check_output_dir(out)
    job = dict(out=out, source=source, table=table, ids=ids, per_file=per_file, n_input=n_input,
               drafter_why=drafter_why, decoder_cls=decoder_cls, row_fn=row_fn, t_start=t_start)
    if dry_run:
        check_free(out, spec.decode.s3, spec.break_lease)  # another job running on the output: refused here too
        return _run(spec, **job, dry_run=True, lease=None)
    with hold(out, spec.decode.s3, spec.break_lease) as lease:  # one job per output: a second one stops here
        return _run(spec, **job, dry_run=False, lease=lease)


def _run(spec: JobSpec, out: Location, source: Location | None, table: pa.Table | None, ids: pa.Array,
         per_file: pa.ChunkedArray, n_input: int, drafter_why: str | None, decoder_cls: type,
         row_fn: Callable[..., Any], t_start: float, dry_run: bool, lease: Lease | None) -> dict[str, Any]:
    """The job once its input is checked and (unless a dry run) its output's lease is held: plan, claim the output,
    tidy it (this job's duplicate rows, changed inputs, retried rows), decode the rest, record and summarize."""
    connect_ray()  # resources follow the cluster: GPUs per actor, and the dtype that follows the device
    gpus = resolve_gpus(spec)
    spec = spec.model_copy(update={"gpus_per_actor": gpus})
    check_gpus(spec)
    probe = probe_gpu(gpus) if gpus > 0 else None
    check_gpu(gpus, probe)
    cfg = job_config(spec)
    actor_cpus = plan_actor_cpus(spec)
    # refuses a target that cannot load or fit before anything is written; an existing output's rows are not read
    # yet (a scan tidies torn parts, and a dry run writes nothing)
    resumes = exists(out.child(MARKER_NAME)) and not spec.overwrite  # (the lease alone makes the folder exist)
    plan = make_plan(spec, cfg, gpus, actor_cpus, len(ids), None if resumes else len(ids), drafter_why, probe)
    in_loc = source or locate(spec.input, spec.decode.s3)
    files = parquet_files(source) if source is not None else None
    prints = input_fingerprints(in_loc, files)
    claimed = claim(out, cfg.text_settings(), spec.input, prints, overwrite=spec.overwrite,
                    redecode_changed=spec.redecode_changed, dry_run=dry_run)  # a dry run: the same checks, no write
    if dry_run:
        print(format_plan(plan), flush=True)
        return {"plan": plan, "dry_run": True}
    state, done = scan_output(out, claimed.record, ["error_kind"])
    deduped = drop_duplicates(out, state)
    if deduped:
        state, done = scan_output(out, read_marker(out), ["error_kind"])
    redone = _drop_changed(out, state, claimed, per_file, files, in_loc)
    run = new_run_token()
    # before any part of this run is written (a drop above recorded its rewritten parts in the marker)
    record = record_run(out, read_marker(out) if deduped or redone else claimed.record, run, prints)
    if redone:
        state, done = scan_output(out, record, ["error_kind"])
    # a rewrite records its parts in the marker it is given: the one holding this run's token
    state = dataclasses.replace(state, record=record)
    retried = _drop_retries(out, state, done, ids, spec)
    media_changed = 0
    if spec.fingerprint_media:
        if retried:
            state, done = scan_output(out, read_marker(out), ["error_kind"])
        media_changed = _drop_media_changed(out, state, ids, per_file, spec, table, source, files)
    if retried or media_changed:
        record = read_marker(out)
        state, _ = scan_output(out, record)
    todo = ids.filter(pc.invert(pc.is_in(ids, value_set=state.ids.cast(ids.type))))
    plan["to_decode"] = len(todo)
    print(format_plan(plan), flush=True)
    log.info("job %s -> %s: %d rows, %d already in the output, %d to decode (%d retried)", spec.input, spec.output,
             len(ids), len(ids) - len(todo), len(todo), retried)
    t_run = time.time()
    progress = None
    if len(todo):
        tracker = ProgressTracker.remote(len(todo))
        ds = _build(spec, cfg, table, source, todo, full=len(todo) == n_input, decoder_cls=decoder_cls,
                    tracker=tracker, row_fn=row_fn, actor_cpus=actor_cpus)
        try:
            with ProgressPrinter(tracker, spec.progress_interval_s):
                ds.write_parquet(out.ray_path, filesystem=out.fs, min_rows_per_file=spec.rows_per_file,
                                 filename_provider=PartNames(run), ray_remote_args={"num_cpus": spec.cpus_per_task})
            progress = ray.get(tracker.snapshot.remote())
        except BaseException as e:
            del ds
            release_failed_run(e)
            raise
        finally:
            ray.kill(tracker)
    wall = time.time() - t_run
    end_state, written = scan_output(out, record, SUMMARY_COLUMNS)
    lease.check()  # another job may have written here: its rows are not recorded as this job's
    seal(out, record, end_state)
    meta = _meta(spec, t_start, state.removed + end_state.removed, end_state.foreign, retried)
    meta["duplicates_dropped"] = deduped
    meta["media_changed_rows"] = media_changed  # --fingerprint-media: done rows decoded again, their media changed
    summary = summarize(written, ids, todo, wall, meta, progress)
    summary["retryable_rows"] = sum(summary["all_rows"]["errors_by_kind"].get(k, 0) for k in RETRYABLE_KINDS)
    summary["plan"] = plan
    write_json(out.child(SUMMARY_NAME), summary)
    log.info(format_summary(summary))
    return summary


def _drop_changed(out: Location, state: OutputState, claimed: Claim, per_file: pa.ChunkedArray,
                  files: list[str] | None, in_loc: Location) -> int:
    """With --redecode-changed on an input that changed since the output was made: take out the rows of the new or
    changed input files (decoded again by this run) and the rows no longer in the input at all."""
    if not claimed.changed_files:
        return 0
    changed = set(claimed.changed_files)
    ids = per_file.combine_chunks()  # every input id, --limit or not: a row past the limit is not gone
    if files is None:  # an input read whole (a Kinetics CSV): every row
        redo = ids
    else:
        chunks = [per_file.chunk(i) for i, f in enumerate(files) if input_name(in_loc, f) in changed]
        redo = pa.concat_arrays([c.cast(ids.type) for c in chunks]) if chunks else pa.array([], ids.type)
    gone = state.ids.filter(pc.invert(pc.is_in(state.ids, value_set=ids.cast(state.ids.type))))
    drop = pa.concat_arrays([redo.cast(pa.string()), gone.cast(pa.string())]).unique()
    n = drop_rows(out, state, drop) if len(drop) else 0
    log.warning("the input changed since the output was made (%s): %d rows of the changed files will be decoded "
                "again, %d rows no longer in the input dropped; %d output rows taken out in all",
                "; ".join(claimed.changed[:5]), len(redo), len(gone), n)
    return n


def _drop_media_changed(out: Location, state: OutputState, ids: pa.Array, per_file: pa.ChunkedArray, spec: JobSpec,
                        table: pa.Table | None, source: Location | None, files: list[str] | None) -> int:
    """With --fingerprint-media: fingerprint every row's media URIs now, take the done rows whose media changed
    since the last run recorded them (or that it recorded none for) out of the output, and record the new ones."""
    from mmspec_ray.batch.media_prints import (URI_FIELDS, changed_ids, media_prints, merge_prints, read_prints,
                                               write_prints)

    if table is not None:
        rows = table
    else:
        cols = [c for c in URI_FIELDS if c in pq.read_schema(files[0], filesystem=source.fs).names]
        rows = pa.concat_tables([pq.read_table(f, columns=cols, filesystem=source.fs) for f in files])
        rows = rows.append_column("id", per_file.combine_chunks())  # the input scan's ids, escaped as the output's
    rows = rows.filter(pc.is_in(rows.column("id"), value_set=ids.cast(rows.column("id").type)))
    new = media_prints(rows, spec.decode.s3)
    old = read_prints(out)
    stale = changed_ids(old, new, state.ids)
    dropped = drop_rows(out, state, stale) if len(stale) else 0
    write_prints(out, merge_prints(old, new))
    if dropped:
        log.info("--fingerprint-media: %d rows whose media changed since they were decoded are decoded again",
                 dropped)
    return dropped


def _drop_retries(out: Location, state: OutputState, done: pa.Table | None, ids: pa.Array, spec: JobSpec) -> int:
    """Take this job's rows that failed with a retryable error kind out of the output, so this run decodes them
    again (every other row stays as written)."""
    if done is None:
        return 0
    kinds = sorted(set(RETRYABLE_KINDS) | set(spec.retry_errors))
    hit = pc.and_(pc.is_in(done.column("error_kind"), value_set=pa.array(kinds, pa.string())),
                  pc.is_in(done.column("id"), value_set=ids.cast(done.column("id").type)))
    retry = done.filter(hit).column("id").combine_chunks()
    if not len(retry):
        return 0
    log.info("retrying %d rows that failed with error kinds %s", len(retry), kinds)
    return drop_rows(out, state, retry)


def check_columns(schema: pa.Schema, cfg: DecodeConfig, where: str) -> None:
    """Job-level input mistakes fail before anything starts (per-row nulls are row errors instead)."""
    names = set(schema.names)
    twice = sorted({n for n in schema.names if schema.names.count(n) > 1})
    if twice:
        raise JobInputError(f"input {where} has duplicate column name(s) {twice}; parquet allows it, a table of rows "
                            "does not: rename or drop the copies")
    clash = sorted(names & set(OUTPUT_COLUMNS + INTERNAL_COLUMNS))
    if clash:
        raise JobInputError(f"input {where} already has output column(s) {clash}; is it a previous job's output? "
                            "Drop or rename them")
    if "prompt" not in names and "messages" not in names and cfg.default_prompt is None:
        raise JobInputError(f"input {where} has no `prompt` or `messages` column; add one or set a default prompt")
    need = cfg.media.require
    fields = IMAGE_FIELDS if need == "image" else VIDEO_FIELDS if need == "video" else ()
    if fields and not names & set(fields):
        raise JobInputError(f"input {where} has no {' / '.join(fields)} column, but this job needs "
                            f"{'an' if need == 'image' else 'a'} {need} per row")


def job_config(spec: JobSpec) -> DecodeConfig:
    """The decode config the job records in its output and gives its actors, with nothing left to chance: media
    image side read from the checkpoint, device from the pool's GPUs, dtype from the device (auto: bf16 on cuda,
    float32 on cpu; precision can change the text, so a resume must not change it silently)."""
    cfg = resolve_image_side(spec.decode)
    device = cfg.device if cfg.device != "auto" else ("cuda" if spec.gpus_per_actor > 0 else "cpu")
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    log.info("decoding on %s in %s; media scaled to a %s px processor side", device, dtype, cfg.media.image_side)
    return cfg.model_copy(update={"device": device, "dtype": dtype})


def _actor_config(cfg: DecodeConfig, actor_cpus: float) -> DecodeConfig:
    """torch threads matched to the actor's CPUs."""
    update: dict[str, Any] = {}
    if cfg.torch_threads is None:
        update["torch_threads"] = max(1, int(actor_cpus))
    return cfg.model_copy(update=update)


def _build(spec: JobSpec, cfg: DecodeConfig, table: pa.Table | None, source: Location | None, todo: pa.Array,
           full: bool, decoder_cls: type, tracker: Any, row_fn: Callable[..., Any],
           actor_cpus: float) -> ray.data.Dataset:
    """The job's dataset: its input (the rows still to do) through `decode_stages`."""
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = spec.progress_bars
    ctx.max_errored_blocks = 0  # rows never raise; a raising block is a real failure, never a silent drop
    task = {"num_cpus": spec.cpus_per_task}
    if table is not None:
        ds = ray.data.from_arrow(table if full else keep_ids(table, todo))
    else:
        files = parquet_files(source)
        paths = [f"s3://{f}" for f in files] if source.is_s3 else files
        # every listed file is read: Ray Data drops files whose suffix is not in file_extensions
        ds = ray.data.read_parquet(paths, filesystem=source.fs, file_extensions=file_suffixes(files), **task)
        if not full:
            ds = ds.map_batches(keep_ids, fn_kwargs={"ids": todo}, batch_format="pyarrow", batch_size=None, **task)
    return decode_stages(ds, spec, cfg, decoder_cls, tracker, row_fn, actor_cpus)


def decode_stages(ds: ray.data.Dataset, spec: JobSpec, cfg: DecodeConfig, decoder_cls: type, tracker: Any,
                  row_fn: Callable[..., Any], actor_cpus: float) -> ray.data.Dataset:
    """Input rows -> blocks of `rows_per_block` -> media tasks (`prepare_block`) -> the decoder actor pool: the one
    decoding path of the job and of `build_processor`, so both give every row the same answer or the same error.
    `spec` gives the pool's resources (its input and output are not read here)."""
    cfg = _actor_config(cfg, actor_cpus)
    task = {"num_cpus": spec.cpus_per_task}
    ds = ds.repartition(target_num_rows_per_block=spec.rows_per_block)
    ds = ds.map_batches(prepare_block, fn_kwargs={"cfg": cfg, "tracker": tracker, "row_fn": row_fn,
                                                  "max_row_crashes": spec.max_row_crashes},
                        batch_format="pyarrow", batch_size=None, compute=media_compute(spec), **task)
    return ds.map_batches(
        decoder_cls,
        fn_constructor_kwargs={"config": cfg, "progress": tracker, "max_row_crashes": spec.max_row_crashes},
        batch_size=spec.rows_per_block,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(min_size=spec.pool_min, max_size=spec.num_actors,
                                           max_tasks_in_flight_per_actor=2),
        num_cpus=actor_cpus,
        num_gpus=spec.gpus_per_actor or None,
        udf_modifying_row_count=False,
    )


def media_compute(spec: JobSpec) -> ray.data.TaskPoolStrategy:
    """The media stage as its own tasks, at most 2 x actors + 1 at a time (two blocks ready per decoder, as the pool
    takes two in flight per actor). A cap other than the pool's size also keeps Ray Data from fusing the stage into
    the decoder actors, which it does when both ask for the same CPUs (2 actors on 2 CPUs: 0.5 each): media would
    then decode inside the actors, with no overlap and the media's memory on top of the model's."""
    return ray.data.TaskPoolStrategy(size=2 * spec.num_actors + 1)


def _meta(spec: JobSpec, t_start: float, removed: list[str], foreign: list[str], retried: int) -> dict[str, Any]:
    d = spec.decode
    return {
        "input": spec.input, "output": spec.output,
        "target": d.target, "drafter": d.drafter, "num_actors": spec.num_actors,
        "gpus_per_actor": spec.gpus_per_actor, "max_new_tokens": d.max_new_tokens, "temperature": d.temperature,
        "limit": spec.limit, "settings": d.text_settings(), "speedup_sample": d.speedup_sample,
        "retried_rows": retried,
        "foreign_files": [Path(f).name for f in foreign],
        "started_at": datetime.fromtimestamp(t_start, timezone.utc).isoformat(timespec="seconds"),
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "removed_partial_files": [Path(r).name for r in removed],
    }
