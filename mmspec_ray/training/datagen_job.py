"""Drafter training data as a Ray Data job: parquet / S3 request rows -> media decoded in CPU tasks -> an actor pool
of targets answering each prompt and recording the features every drafter method trains on -> safetensors shards
on local disk or S3 plus `manifest.json` (format: `training/shards.py`).

Rows are the batch jobs' rows (`id`, `prompt` or `messages`, `image` / `image_uri` / `video` / `video_uri`), read
and checked by the same code. Each actor call writes one shard named by the ids it covers, and the shard's header
lists those ids and the errors of the rows that gave no example: a re-run skips every id already in a shard
(resume), a bad row is recorded in the manifest's `errors` and never stops the job.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import time
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import torch
from pydantic import BaseModel, ConfigDict, Field

from mmspec_ray.batch.decoder import resolve_device
from mmspec_ray.batch.rows import ERROR_COL, ERROR_KIND_COL, REQUEST_COL
from mmspec_ray.batch.jobspec import DecodeConfig
from mmspec_ray.targets import InvalidRequest, PromptTooLong, TargetError, load_target
from mmspec_ray.training.datagen import MEDIA_IN_ANSWER, DatagenRecipe, answer_and_featurize
from mmspec_ray.training.shards import FeatureExample, ShardStore

log = logging.getLogger(__name__)

STATUS_SCHEMA = pa.schema([("id", pa.string()), ("shard", pa.string()),
                           ("error", pa.string()), ("error_kind", pa.string())])


class DatagenJob(BaseModel):
    """Requests in, feature shards out."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    input: str = Field(..., description="parquet file or directory of request rows, local or s3://")
    output: str = Field(..., description="shard directory, local or s3://; a re-run resumes into it")
    decode: DecodeConfig = Field(..., description="the target, device, dtype and media settings (drafter unused)")
    recipe: DatagenRecipe = DatagenRecipe()
    exclude_ids: tuple[str, ...] = Field((), description="ids not to answer (held out for evaluation)")
    limit: int | None = Field(None, ge=1, description="only the first N input rows")
    num_actors: int = Field(1, ge=1)
    gpus_per_actor: float = Field(0.0, ge=0.0)
    cpus_per_actor: float = Field(1.0, gt=0.0)
    cpus_per_task: float = Field(0.5, gt=0.0)
    rows_per_shard: int = Field(32, ge=1, description="rows per actor call = per shard (the unit of resume)")
    answers_key: str | None = Field(None, description="the key of shared answers (training.answers): a resume with "
                                    "the same key is the same job, wherever the target and the data lie now")


def shard_name(ids: list[str]) -> str:
    """Deterministic in the ids it covers, so a retried block rewrites its own shard instead of adding one."""
    return f"shard-{hashlib.sha1(chr(10).join(ids).encode()).hexdigest()[:20]}.safetensors"


class FeatureWriter:
    """Ray Data actor: one target; each block of prepared rows becomes one shard (+ a status row per input row)."""

    def __init__(self, config: DecodeConfig | Mapping[str, Any], recipe: DatagenRecipe | Mapping[str, Any],
                 output: str) -> None:
        self.cfg = cfg = config if isinstance(config, DecodeConfig) else DecodeConfig.model_validate(config)
        self.recipe = recipe if isinstance(recipe, DatagenRecipe) else DatagenRecipe.model_validate(recipe)
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        device, dtype = resolve_device(cfg)
        self.target = load_target(cfg.target, device, dtype, s3=cfg.s3)
        self.store = ShardStore(output, cfg.s3)

    def featurize(self, row_id: str, request: Any) -> tuple[FeatureExample | None, dict[str, str] | None]:
        """The row's example, or its error (never raises for one bad row)."""
        recipe = self.recipe
        if recipe.temperature > 0:  # a per-row seed from (seed, id): a retried row samples what it did before
            digest = hashlib.sha256(f"{recipe.seed}\x00{row_id}".encode()).digest()
            recipe = recipe.model_copy(update={"seed": int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)})
        try:
            ex = answer_and_featurize(self.target, request, recipe)
        except PromptTooLong as e:
            return None, {"error": f"prompt: too long: {e}", "error_kind": "too_long"}
        except InvalidRequest as e:
            return None, {"error": str(e), "error_kind": "invalid"}
        except TargetError as e:
            return None, {"error": f"request: {e}", "error_kind": "target"}
        except Exception as e:  # one row's failure must not end a long generation job
            log.exception("row %r failed", row_id)
            return None, {"error": f"internal: {type(e).__name__}: {e}", "error_kind": "internal"}
        if ex is None:
            return None, dict(MEDIA_IN_ANSWER)
        return ex, None

    def __call__(self, batch: pa.Table) -> pa.Table:
        ids = [str(i) for i in batch.column("id").to_pylist()]
        blobs = batch.column(REQUEST_COL).to_pylist()
        errs = batch.column(ERROR_COL).to_pylist()
        kinds = batch.column(ERROR_KIND_COL).to_pylist()
        examples: list[FeatureExample] = []
        errors: dict[str, dict[str, str]] = {}
        for row_id, blob, err, kind in zip(ids, blobs, errs, kinds):
            if err is not None:
                errors[row_id] = {"error": err, "error_kind": kind}
                continue
            ex, e = self.featurize(row_id, pickle.loads(blob))
            if e is not None:
                errors[row_id] = e
            else:
                examples.append(ex)
        name = shard_name(ids)
        self.store.write_shard(name, examples, ids, errors)
        return pa.table({"id": ids, "shard": [name] * len(ids),
                         "error": [errors.get(i, {}).get("error") for i in ids],
                         "error_kind": [errors.get(i, {}).get("error_kind") for i in ids]}, schema=STATUS_SCHEMA)


def done_ids(store: ShardStore) -> set[str]:
    """Ids a re-run skips: answered, or failed for a reason of the row itself. Rows that failed transiently (an S3
    outage while reading media, an internal error) are answered again."""
    from mmspec_ray.batch.jobspec import RETRYABLE_KINDS

    retry = set(RETRYABLE_KINDS) | {"internal"}
    done: set[str] = set()
    for name in store.shard_names():
        info = store.shard_info(name)
        done |= {i for i in info.ids if info.errors.get(i, {}).get("error_kind") not in retry}
    return done


def run_datagen(job: DatagenJob, progress_every_s: float = 30.0) -> dict[str, Any]:
    """Run (or resume) the job; returns the manifest (also written to `<output>/manifest.json`)."""
    import ray

    from mmspec_ray.batch.cluster import connect_ray
    from mmspec_ray.batch.pipeline import job_config
    from mmspec_ray.batch.jobspec import JobSpec
    from mmspec_ray.batch.stages import prepare_block
    from mmspec_ray.batch.storage import file_suffixes, locate, parquet_files, scan_input

    t0 = time.time()
    spec = JobSpec(input=job.input, output=job.output, decode=job.decode, num_actors=job.num_actors,
                   gpus_per_actor=job.gpus_per_actor, cpus_per_actor=job.cpus_per_actor,
                   cpus_per_task=job.cpus_per_task, rows_per_block=job.rows_per_shard, limit=job.limit)
    cfg = job_config(spec)
    source = locate(job.input, cfg.s3)
    _, ids = scan_input(source)
    ids = ids.combine_chunks().cast(pa.string())
    if job.limit is not None:
        ids = ids.slice(0, job.limit)
    store = ShardStore(job.output, cfg.s3)
    check_resume(store, job)
    skip = done_ids(store) | set(job.exclude_ids)
    todo = ids.filter(pc.invert(pc.is_in(ids, value_set=pa.array(sorted(skip), pa.string()))))
    log.info("datagen %s -> %s: %d rows, %d done or held out, %d to answer", job.input, job.output, len(ids),
             len(ids) - len(todo), len(todo))
    if len(todo):
        connect_ray()
        from mmspec_ray.batch.cluster import plan_actor_cpus

        actor_cpus = plan_actor_cpus(spec)
        actor_cfg = cfg.model_copy(update={"torch_threads": cfg.torch_threads or max(1, int(actor_cpus))})
        task = {"num_cpus": job.cpus_per_task}
        files = parquet_files(source)
        ds = ray.data.read_parquet([f"s3://{f}" for f in files] if source.is_s3 else files, filesystem=source.fs,
                                   file_extensions=file_suffixes(files), **task)  # every listed file read
        ds = ds.map_batches(_keep_as_str, fn_kwargs={"ids": todo}, batch_format="pyarrow", batch_size=None, **task)
        ds = ds.repartition(target_num_rows_per_block=job.rows_per_shard)
        ds = ds.map_batches(prepare_block, fn_kwargs={"cfg": actor_cfg}, batch_format="pyarrow", batch_size=None,
                            **task)
        ds = ds.map_batches(FeatureWriter, fn_constructor_kwargs={"config": actor_cfg, "recipe": job.recipe,
                                                                  "output": job.output},
                            batch_size=job.rows_per_shard, batch_format="pyarrow",
                            compute=ray.data.ActorPoolStrategy(size=job.num_actors),
                            num_cpus=actor_cpus, num_gpus=job.gpus_per_actor or None)
        rows = errors = 0
        last = time.time()
        for part in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            rows += part.num_rows
            errors += part.num_rows - part.column("error").null_count
            if time.time() - last > progress_every_s:
                log.info("datagen: %d/%d rows answered (%d errors), %.0f s", rows, len(todo), errors,
                         time.time() - t0)
                last = time.time()
    manifest = store.write_manifest({"input": job.input, "target": job.decode.target,
                                     "recipe": job.recipe.model_dump(), "writer": "ray-data",
                                     "held_out": list(job.exclude_ids), "rows_per_shard": job.rows_per_shard,
                                     **({"answers_key": job.answers_key} if job.answers_key else {})})
    log.info("datagen done: %d examples from %d rows in %d shards, %d row errors, %.0f s", manifest["examples"],
             manifest["rows"], len(manifest["shards"]), len(manifest["errors"]), time.time() - t0)
    return manifest


def check_resume(store: ShardStore, job: DatagenJob) -> None:
    """A resume must be the same job: another target, data set, answer recipe or held-out split would mix features
    of two jobs (ids collide across data sets, and rows trained on could land in the held-out set). Shared answers
    with the same key are the same job by construction."""
    if not store.exists("manifest.json"):
        return
    old = store.manifest()
    if job.answers_key and old.get("answers_key") == job.answers_key:
        return  # the key covers the target's identity and the data's content, not where they lie
    now = {"target": job.decode.target, "input": job.input, "recipe": job.recipe.model_dump(),
           "held_out": sorted(job.exclude_ids)}
    was = {"target": old.get("target"), "input": old.get("input"), "recipe": old.get("recipe"),
           "held_out": sorted(old.get("held_out", []))}
    diff = [k for k in now if was[k] is not None and was[k] != now[k]]
    if diff:
        raise ValueError(f"{store.uri} holds features of another job (different {', '.join(diff)}: was "
                         f"{ {k: was[k] for k in diff} }); use another --work directory, or delete this one")


def _keep_as_str(batch: pa.Table, ids: pa.Array) -> pa.Table:
    """Rows whose id (as a string) is in `ids`."""
    return batch.filter(pc.is_in(batch.column("id").cast(pa.string()), value_set=ids))
