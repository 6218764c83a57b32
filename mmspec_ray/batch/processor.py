"""`build_processor`: the batch job's decoding (media tasks, then the SpecDecoder actor pool) as one step of the
caller's own Ray Data pipeline, shaped like `ray.data.llm.build_processor`: `ds = build_processor(config)(ds)`.

The same checks before anything runs and the same stages (`pipeline.decode_stages`) as the job, so a row gets the
same answer or the same error columns either way. What the job adds around them (its output folder, resume, the
lease, exactly once, the summary) is not here: the caller reads and writes where it likes (docs/processor.md).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import pyarrow as pa
import ray
from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo

from mmspec_ray.batch.cluster import check_gpus, check_local_gpus, connect_ray, plan_actor_cpus
from mmspec_ray.batch.decoder import SpecDecoder
from mmspec_ray.batch.jobspec import DecodeConfig, JobSpec
from mmspec_ray.batch.pipeline import check_columns, decode_stages, job_config
from mmspec_ray.batch.plan import check_drafter, check_gpu, make_plan, probe_gpu, resolve_gpus
from mmspec_ray.batch.progress import ProgressTracker
from mmspec_ray.batch.rows import prepare_row
from mmspec_ray.batch.storage import JobInputError, check_ids, escape_invalid_utf8

log = logging.getLogger(__name__)

RowHook = Callable[[dict[str, Any]], dict[str, Any]]

WHERE = "to the processor"  # how errors name the rows the decoder reads (after preprocess)
CALLERS_DATASET = "(the caller's dataset)"  # the input and output of the job spec the shared checks read
JOB_ONLY_PLAN_KEYS = ("input", "rows", "to_decode", "output")


def _as_in_job(name: str) -> FieldInfo:
    """The job spec's definition (default, bounds, description) of a pool setting: one definition for both."""
    return copy.copy(JobSpec.model_fields[name])


class ProcessorConfig(BaseModel):
    """What a processor decodes with: the job's decode settings and its actor pool's resources, nothing about
    input or output."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    decode: DecodeConfig
    num_actors: int = _as_in_job("num_actors")
    min_actors: int | None = _as_in_job("min_actors")
    gpus_per_actor: Annotated[float, Field(ge=0.0)] | Literal["auto"] = _as_in_job("gpus_per_actor")
    cpus_per_actor: float = _as_in_job("cpus_per_actor")
    cpus_per_task: float = _as_in_job("cpus_per_task")
    rows_per_block: int = _as_in_job("rows_per_block")
    max_row_crashes: int = _as_in_job("max_row_crashes")

    def job_spec(self) -> JobSpec:
        """These settings as a job spec, for the checks and stages the job and the processor share (its input and
        output name the caller's dataset; nothing reads them)."""
        return JobSpec(input=CALLERS_DATASET, output=CALLERS_DATASET, decode=self.decode,
                       **self.model_dump(exclude={"decode"}))


@dataclass(frozen=True)
class Processor:
    """A checked config and the caller's hooks; `processor(ds)` returns `ds` decoded (lazily, like any Dataset)."""

    spec: JobSpec  # the pool's resources, resolved (GPUs per actor a number)
    config: DecodeConfig  # what every actor decodes with (drafter, device, dtype, media sizes resolved)
    actor_cpus: float  # CPUs per actor, lowered where the pool would take every CPU
    plan: dict[str, Any] = field(default_factory=dict)  # the job's plan of these settings (memory, device, drafter)
    preprocess: RowHook | None = None
    postprocess: RowHook | None = None

    def __call__(self, ds: ray.data.Dataset) -> ray.data.Dataset:
        """preprocess -> the job's checks on each block -> media tasks -> decoder actors -> postprocess."""
        task = {"num_cpus": self.spec.cpus_per_task}
        if self.preprocess is not None:
            ds = ds.map(self.preprocess, **task)
        ds = ds.map_batches(check_rows, fn_kwargs={"cfg": self.config}, batch_format="pyarrow", batch_size=None,
                            **task)
        # per row, decodes that never finished: a row that kills every decoder is filed as `crash`, as in the job
        tracker = ProgressTracker.remote(0)
        ds = decode_stages(ds, self.spec, self.config, SpecDecoder, tracker, prepare_row, self.actor_cpus)
        if self.postprocess is not None:
            ds = ds.map(self.postprocess, **task)
        return ds


def build_processor(config: ProcessorConfig | Mapping[str, Any], preprocess: RowHook | None = None,
                    postprocess: RowHook | None = None) -> Processor:
    """Check `config` as the job checks its spec before anything runs (drafter files against the target, GPUs,
    the target loads and fits) and return the processor; connects to Ray (or starts it) as the job does.
    `preprocess(row)` returns the row the decoder reads (`id`, `prompt` or `messages`, media columns);
    `postprocess(row)` gets it back with the output columns and returns the caller's row."""
    cfg = config if isinstance(config, ProcessorConfig) else ProcessorConfig.model_validate(config)
    decode, drafter_why = _resolve_names(cfg.decode)
    spec = cfg.model_copy(update={"decode": decode}).job_spec()
    check_drafter(decode)  # before Ray starts
    check_local_gpus(spec)
    connect_ray()
    gpus = resolve_gpus(spec)
    spec = spec.model_copy(update={"gpus_per_actor": gpus})
    check_gpus(spec)
    probe = probe_gpu(gpus) if gpus > 0 else None
    check_gpu(gpus, probe)
    # no summary reads the AR speed sample here: the actors spend no time on it
    decode = job_config(spec).model_copy(update={"speedup_sample": 0})
    actor_cpus = plan_actor_cpus(spec)
    plan = make_plan(spec, decode, gpus, actor_cpus, 0, 0, drafter_why, probe)  # refuses a target that cannot fit
    plan = {k: v for k, v in plan.items() if k not in JOB_ONLY_PLAN_KEYS}
    log.info("processor: %s", plan)
    return Processor(spec=spec, config=decode, actor_cpus=actor_cpus, plan=plan, preprocess=preprocess,
                     postprocess=postprocess)


def _resolve_names(cfg: DecodeConfig) -> tuple[DecodeConfig, str | None]:
    """The target and drafter made concrete on the driver as the job scripts do (a toy world name becomes its
    checkpoint, built on first use; drafter `auto` the drafter it picks, and why), so every actor loads the same."""
    from mmspec_ray.batch.cli import check_drafter_dirs
    from mmspec_ray.toy.drafter import choose_drafter
    from mmspec_ray.toy.resolve import resolve_target

    cfg = cfg.model_copy(update={"target": resolve_target(cfg.target)})
    if cfg.drafter != "auto":
        return cfg, None
    check_drafter_dirs(cfg.drafter_dirs, cfg.s3)
    choice = choose_drafter("auto", cfg.target, cfg.drafter_dirs, None, cfg.s3, cfg.max_new_tokens)
    return cfg.model_copy(update={"drafter": choice.spec}), choice.why


def check_rows(batch: pa.Table, cfg: DecodeConfig) -> pa.Table:
    """The job's input checks on one block of the rows the decoder reads: a string or integer `id`, non-null and
    unique in the block; a `prompt` or `messages` column; no output column names. A failure is a mistake of the
    caller's code, not of one row, so it stops the pipeline with a line naming the field."""
    if batch.num_rows == 0:
        return batch
    if "id" not in batch.column_names:
        raise JobInputError(f"input {WHERE} has no `id` column; every row needs an id (a string or an integer, "
                            "unique: it seeds the row's sampling and names it in errors): set row['id'] in "
                            "preprocess, e.g. from a key column of your own")
    check_ids(escape_invalid_utf8(batch.column("id"))[0], WHERE)
    t = batch.schema.field("id").type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t)):
        raise JobInputError(f"input {WHERE}: column 'id' is {t}; ids must be strings or integers")
    check_columns(batch.schema, cfg, WHERE)
    return batch
