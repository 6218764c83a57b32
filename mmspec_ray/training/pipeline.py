"""Train a drafter of any method for any target from a parquet of requests: the path `mmspec train-drafter --target
DIR|s3:// --data PARQUET|s3://` and `jobs/train_drafter.py` take.

1. Hold out the last `heldout` rows (for the final τ). 2. Data generation on Ray Data (`datagen_job.py`): the target
answers every other row and its features go to shards under `<work>/features`. 3. Training: the single-process
trainer (`num_workers` 0, data in memory) or Ray Train (`distributed.py`, data streamed from the shards, checkpoints
under `<work>/ray-train`). 4. The drafter (config.json + model.safetensors + history.json with the held-out τ) is
written to `out`, local or s3://, and loads with `--drafter <out>`.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from pydantic import BaseModel, ConfigDict, Field

from mmspec_ray.batch.spec import DecodeConfig
from mmspec_ray.spec.tree import TreeConfig
from mmspec_ray.targets.base import Request
from mmspec_ray.training.datagen import DatagenRecipe
from mmspec_ray.training.datagen_job import DatagenJob, run_datagen
from mmspec_ray.training.distributed import HEAD_INIT_FILE, DistributedConfig, HeadInit, fit
from mmspec_ray.training.methods import training_method
from mmspec_ray.training.shards import ShardStore
from mmspec_ray.training.trainer import TrainConfig, heldout_tau, stage_schedule, train_drafter

log = logging.getLogger(__name__)


class TrainJob(BaseModel):
    """Requests -> features -> a trained drafter checkpoint."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: str = "eagle2"
    target: str = Field(..., description="checkpoint directory or s3:// prefix")
    data: str = Field(..., description="parquet file or directory of request rows, local or s3://")
    out: str = Field(..., description="drafter checkpoint directory or s3:// prefix")
    work: str | None = Field(None, description="features + Ray Train checkpoints (default: <out>.work); a re-run "
                             "with the same work directory resumes both")
    heldout: int = Field(16, ge=0, description="last N rows held out: the trained drafter's τ is measured on them")
    limit: int | None = Field(None, ge=1, description="only the first N rows (held-out rows included)")
    train: TrainConfig = TrainConfig(epochs=8, batch_size=16, lr=2e-3)
    recipe: DatagenRecipe = DatagenRecipe()
    decode: dict[str, Any] = Field(default_factory=dict, description="DecodeConfig fields for datagen (device, dtype, "
                                   "media ...); `target` is filled in")
    datagen_actors: int = Field(1, ge=1)
    gpus_per_actor: float = Field(0.0, ge=0.0)
    num_workers: int = Field(0, ge=0, description="0: the single-process trainer; N: Ray Train with N workers")
    use_gpu: bool = False
    cpus_per_worker: float = Field(1.0, gt=0)
    max_failures: int = Field(3, ge=0)
    tree: TreeConfig = TreeConfig()

    @property
    def work_dir(self) -> str:
        return self.work or self.out.rstrip("/") + ".work"

    def decode_config(self) -> DecodeConfig:
        return DecodeConfig.model_validate({"drafter": "none", **self.decode, "target": self.target,
                                            "max_new_tokens": self.recipe.max_new_tokens})


def heldout_ids(job: TrainJob, cfg: DecodeConfig) -> list[str]:
    """The last `heldout` ids of the input (after `limit`), as strings."""
    from mmspec_ray.batch.storage import locate, scan_input

    _, ids = scan_input(locate(job.data, cfg.s3))
    ids = ids.combine_chunks().cast(pa.string())
    if job.limit is not None:
        ids = ids.slice(0, job.limit)
    if job.heldout >= len(ids):
        raise ValueError(f"--heldout {job.heldout} leaves no training rows of the {len(ids)} in {job.data}")
    return ids.slice(len(ids) - job.heldout).to_pylist() if job.heldout else []


def heldout_requests(job: TrainJob, cfg: DecodeConfig, ids: list[str]) -> list[Request]:
    """The held-out rows as requests (media decoded by the batch jobs' row code); bad rows are skipped, logged."""
    from mmspec_ray.batch.rows import RowError, prepare_row, resolve_image_side
    from mmspec_ray.batch.storage import locate, parquet_files

    if not ids:
        return []
    cfg = resolve_image_side(cfg)
    src = locate(job.data, cfg.s3)
    table = pq.read_table(parquet_files(src), filesystem=src.fs)
    table = table.filter(pc.is_in(table.column("id").cast(pa.string()), value_set=pa.array(ids, pa.string())))
    out = []
    for row in table.to_pylist():
        try:
            out.append(prepare_row(row, cfg))
        except RowError as e:
            log.warning("held-out row %r skipped: %s", row.get("id"), e)
    return out


def publish(local: Path, uri: str, s3) -> None:
    """Copy a drafter directory to its destination (local directory or s3:// prefix)."""
    from pyarrow import fs as pafs

    from mmspec_ray.batch.storage import locate

    dest = locate(uri, s3)
    if not dest.is_s3:
        Path(dest.path).mkdir(parents=True, exist_ok=True)
    pafs.copy_files(str(local), dest.path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=dest.fs)


def run_train_job(job: TrainJob) -> dict[str, Any]:
    """Run (or resume) the whole job; returns a summary (also the `heldout` part of the drafter's history.json)."""
    from mmspec_ray.batch.decoder import resolve_device
    from mmspec_ray.drafters.base import load_drafter
    from mmspec_ray.targets import load_target

    from mmspec_ray.batch.cluster import connect_ray

    m = training_method(job.method)
    cfg = job.decode_config()
    held = heldout_ids(job, cfg)
    if job.num_workers:
        check_streamable(m)  # before any work
        connect_ray(dashboard=True)  # a local cluster with the state API Ray Train's controller polls
    features = job.work_dir.rstrip("/") + "/features"
    manifest = run_datagen(DatagenJob(input=job.data, output=features, decode=cfg, recipe=job.recipe,
                                      exclude_ids=tuple(held), limit=job.limit, num_actors=job.datagen_actors,
                                      gpus_per_actor=job.gpus_per_actor))
    if not manifest["examples"]:
        raise ValueError(f"data generation gave no training examples ({len(manifest['errors'])} row errors, e.g. "
                         f"{next(iter(manifest['errors'].items()), None)}); see {features}/manifest.json")
    device, dtype = resolve_device(cfg)
    target = load_target(job.target, device, dtype, s3=cfg.s3)
    requests = heldout_requests(job, cfg, held)
    local = Path(tempfile.mkdtemp(prefix="mmspec-drafter-"))
    if job.num_workers == 0:
        from mmspec_ray.training.datagen import load_features

        examples = load_features(features)
        mm = [e for e in examples if e.multimodal]
        text = [e for e in examples if not e.multimodal] if stage_schedule(m, job.train).uses_text else []
        train_drafter(m, target, mm, local, job.train, heldout=requests, tree=job.tree, text_examples=text)
        history = json.loads((local / "history.json").read_text())
        (local / "trainer_state.pt").unlink()
    else:
        init = write_head_init(m, target, job.work_dir.rstrip("/") + "/init", cfg.s3)
        dist_cfg = DistributedConfig(num_workers=job.num_workers, use_gpu=job.use_gpu,
                                     cpus_per_worker=job.cpus_per_worker, max_failures=job.max_failures,
                                     storage=job.work_dir.rstrip("/") + "/ray-train", name=run_name(job))
        trained = fit(features, init, job.train, dist_cfg, cfg.s3)
        shutil.copytree(trained, local, dirs_exist_ok=True)
        history = json.loads((local / "history.json").read_text())
    drafter = load_drafter(str(local), target)
    tau = heldout_tau(target, drafter, requests, job.tree, job.train.eval_max_new_tokens)
    summary = {"method": m.name, "target": job.target, "data": job.data, "out": job.out,
               "examples": manifest["examples"], "row_errors": len(manifest["errors"]),
               "heldout_rows": len(requests), "heldout_tau": tau, "trainer": "ray-train" if job.num_workers else
               "single-process", "workers": job.num_workers, "history": history}
    (local / "history.json").write_text(json.dumps(summary, indent=2))
    publish(local, job.out, cfg.s3)
    shutil.rmtree(local, ignore_errors=True)
    log.info("drafter %s for %s written to %s: held-out τ %.3f on %d rows", m.name, job.target, job.out, tau,
             len(requests))
    return summary


def check_streamable(m) -> None:
    """Ray Train workers stream shards and never load the target: a method that needs the target while training
    (`reads_target`: HiViS's answer filter, SpecFLASH's per-frame media cuts) runs on the single-process trainer."""
    if m.reads_target:
        raise ValueError(f"{m.name} needs the target while training, which Ray Train workers do not load; train it "
                         "with --num-workers 0 (the single-process trainer)")


def run_name(job: TrainJob) -> str:
    """Ray Train's run name: one per (method, out, training settings), so a re-run of the same job resumes its
    checkpoints and a different job sharing the work directory (other seed, other method) starts its own."""
    import hashlib

    settings = job.train.model_dump(mode="json", exclude_defaults=True)  # a new setting's default renames nothing
    key = json.dumps([job.method, job.out, settings], sort_keys=True)
    return f"{job.method}-drafter-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


def write_head_init(m, target, uri: str, s3) -> HeadInit:
    """The head config and LM-head weight Ray Train workers build their head from (they never load the target)."""
    from safetensors.torch import save

    torch.manual_seed(0)
    head_config = m.head(target).cfg.model_dump(mode="json")
    store = ShardStore(uri, s3)
    W = target.model.get_output_embeddings().weight.detach().float().cpu().contiguous()
    store.write(HEAD_INIT_FILE, save({"weight": W}))
    return HeadInit(method=m.name, head_config=head_config, lm_head_path=f"{store.loc.uri.rstrip('/')}/{HEAD_INIT_FILE}")
