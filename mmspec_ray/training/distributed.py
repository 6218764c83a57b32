"""Data-parallel drafter training on Ray Train (`TorchTrainer`): N workers (CPU or GPU), each streaming its share
of the feature shards (local or s3://), gradients averaged across workers every step, a checkpoint per epoch in the
run's storage (local or s3://), and a restart from the last checkpoint when a worker dies (`max_failures`).

It shares everything but the data loop with the single-process trainer (`trainer.py`): the method's head, collate
and loss, the optimiser and LR schedule (`make_optimizer`) and the step (`train_step`). The target is never loaded
on a worker: the driver hands over the head's config and the target's LM-head weight (`HeadInit`).

Data loop (so that memory per worker is one shard, whatever the data set's size): every epoch the shard order is
drawn from (seed, epoch), identically on every worker; worker r reads shards r, r+W, r+2W ... of that order (its
own, disjoint from the others'), shuffles each shard's examples, and cuts batches of batch_size / W (the batch size
must split; there must be at least W shards). Gradients are averaged by PyTorch DDP (`ray.train.torch.prepare_model`
around the method's loss as a module, `MethodLoss`). Every worker runs the same number of steps, the single-process
trainer's ceil(kept examples / batch_size), so one step consumes one global batch of `batch_size` examples and an
epoch sees about every kept example once (a worker with fewer re-reads some of its own). A two-stage schedule keeps,
per shard, its share r_e * n / N_mm of multimodal and (1 - r_e) * n / N_text of text-only examples (n = min(N_mm,
N_text), rounded per shard, so counts are known from the manifest alone): the single-process schedule's expected mixture (a mixed
schedule keeps every item of both pools). A method's `begin_epoch` hook runs before each epoch, as in the
single-process trainer.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, Field

from mmspec_ray.config import S3Config
from mmspec_ray.training.methods import training_method
from mmspec_ray.training.schedule import StageSchedule
from mmspec_ray.training.shards import FeatureExample, ShardStore
from mmspec_ray.training.trainer import (MethodLoss, TrainConfig, check_resume_config, head_config, make_optimizer,
                                         saved_head_config, stage_schedule, to_device, train_step)

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
HEAD_INIT_FILE = "head_init.safetensors"
SELECTION_FILE = "selection.json"


class DistributedConfig(BaseModel):
    """How Ray Train runs: workers, their resources, where checkpoints go, how many worker failures to survive."""

    num_workers: int = Field(2, ge=1)
    use_gpu: bool = False
    cpus_per_worker: float = Field(1.0, gt=0)
    storage: str = Field(..., description="local directory or s3:// prefix for Ray Train's checkpoints")
    name: str = Field("drafter-train", description="run name: a re-run with the same storage and name resumes")
    max_failures: int = Field(3, ge=0, description="worker-group restarts (from the last checkpoint) before giving up")


class HeadInit(BaseModel):
    """What a worker needs instead of the target: the method, its head config and the LM head (a file path)."""

    method: str
    head_config: dict[str, Any]
    lm_head_path: str  # safetensors with "weight" [V, d]; local path visible to every worker or s3://
    selection_path: str | None = None  # JSON: shard name -> the method's `shard_selection` (methods that `select`)
    method_options: dict[str, Any] = Field(default_factory=dict)  # the method's keyword options (`training_method`)


def selected_manifest(manifest: dict[str, Any], selection: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    """The manifest with each shard's counts as the method's data selection leaves them (so every worker plans its
    steps on the examples it will really read)."""
    if selection is None:
        return manifest
    names = manifest["shards"]
    missing = [n for n in names if n not in selection]
    if missing:
        raise ValueError(f"the data selection has no entry for shard(s) {missing[:3]}: it was made from other "
                         "features; re-run the job to make it again")
    return {**manifest, "examples_per_shard": [len(selection[n]["keep"]) for n in names],
            "multimodal_per_shard": [selection[n]["multimodal"] for n in names]}


def worker_shards(n_shards: int, rank: int, world: int, epoch: int, seed: int) -> list[int]:
    """Shard indices worker `rank` reads in `epoch` (0-indexed): every `world`-th of the epoch's shard order, which
    every worker draws alike from (seed, epoch), so the workers' shards are disjoint and cover every shard."""
    order = np.random.default_rng([seed, epoch, 7]).permutation(n_shards)
    return [int(s) for s in order[rank::world]]


def keep_probabilities(stages: StageSchedule, epoch: int, n_mm: int, n_text: int) -> tuple[float, float]:
    """(share of multimodal, share of text-only examples) used in `epoch` (1-indexed), matching the in-memory
    schedule's expected mixture."""
    if stages.mixed and epoch > stages.text_epochs:  # every item of both pools (HiViS)
        return 1.0, 1.0
    if stages.text_epochs == 0:
        return 1.0, 0.0
    if n_mm == 0 or n_text == 0:
        raise ValueError(f"a two-stage schedule needs text and multimodal examples (got {n_text} text, "
                         f"{n_mm} multimodal); add text-only rows (no media) to the requests or set --text-epochs 0")
    n = min(n_mm, n_text)
    r = stages.ratio(epoch)
    return r * n / n_mm, (1 - r) * n / n_text


def allocate(total: int, counts: list[int]) -> list[int]:
    """`total` items spread over shards in proportion to `counts` (largest remainder, ties to the lower index), so
    the epoch keeps exactly `total` however small the shards."""
    n = sum(counts)
    if n == 0 or total <= 0:
        return [0] * len(counts)
    quota = [total * c / n for c in counts]
    out = [int(q) for q in quota]
    for i in sorted(range(len(counts)), key=lambda i: (out[i] - quota[i], i))[:total - sum(out)]:
        out[i] += 1
    return out


def shard_keeps(manifest: dict[str, Any], stages: StageSchedule, epoch: int) -> list[tuple[int, int]]:
    """Per shard, how many (multimodal, text-only) examples `epoch` (1-indexed) uses: the schedule's shares of each
    pool, spread over the shards by `allocate`, so every worker knows every shard's count from the manifest alone."""
    total = manifest["examples_per_shard"]
    mm = manifest.get("multimodal_per_shard", total)
    text = [t - m for m, t in zip(mm, total)]
    p_mm, p_text = keep_probabilities(stages, epoch, sum(mm), sum(text))
    return list(zip(allocate(round(p_mm * sum(mm)), mm), allocate(round(p_text * sum(text)), text)))


def epoch_steps(manifest: dict[str, Any], stages: StageSchedule, epoch: int, world: int, local_bs: int,
                seed: int) -> int:
    """Optimiser steps of `epoch` (0-indexed), the same on every worker: the single-process trainer's
    ceil(kept examples / global batch), so both trainers take the same steps whatever the shards' balance (a worker
    whose shards hold fewer examples reads them again, reshuffled; one with more leaves its last few for the next
    epoch's draw); 0 when some worker has none."""
    keeps = shard_keeps(manifest, stages, epoch + 1)
    n = len(keeps)
    per_worker = [sum(sum(keeps[s]) for s in worker_shards(n, r, world, epoch, seed)) for r in range(world)]
    if min(per_worker) == 0:
        return 0
    return -(-sum(per_worker) // (local_bs * world))


def check_plan(manifest: dict[str, Any], cfg: TrainConfig, world: int) -> None:
    """Refuse a data plan that cannot be data-parallel: fewer shards than workers, a batch that does not split."""
    n = len(manifest["shards"])
    if n < world:
        raise ValueError(f"{n} feature shard(s) for {world} workers: every worker needs its own shards; regenerate "
                         "the features with fewer rows per shard (a new --work: answers already stored are reused as "
                         "they were cut) or use fewer workers")
    if cfg.batch_size % world:
        raise ValueError(f"batch size {cfg.batch_size} does not split over {world} workers; use a multiple of it")


def local_batches(load: Callable[[str], list[FeatureExample]], manifest: dict[str, Any], stages: StageSchedule,
                  cfg: TrainConfig, epoch: int, rank: int, world: int,
                  local_bs: int) -> Iterator[tuple[list[FeatureExample], list[int]]]:
    """Endless (pool, batch indices) of this worker in `epoch` (0-indexed), one shard in memory at a time (`load`:
    shard name -> its examples, as the method's selection keeps them): its own shards in order (again, reshuffled,
    only if it runs out before the epoch's last step)."""
    keeps = shard_keeps(manifest, stages, epoch + 1)
    mine = [s for s in worker_shards(len(keeps), rank, world, epoch, cfg.seed) if sum(keeps[s])]
    if not mine:
        return
    for pass_no in itertools.count():
        for s in mine:
            rng = np.random.default_rng([cfg.seed, epoch, s, pass_no, rank])
            pool = load(manifest["shards"][s])
            mm = [i for i, ex in enumerate(pool) if ex.multimodal]
            text = [i for i, ex in enumerate(pool) if not ex.multimodal]
            k_mm, k_text = keeps[s]
            chosen = [int(i) for i in rng.permutation(mm)[:k_mm]] + [int(i) for i in rng.permutation(text)[:k_text]]
            keep = [chosen[i] for i in rng.permutation(len(chosen))]
            # length-bucketed, as the single-process trainer: sort chunks by length to limit padding
            span = local_bs * cfg.bucket_batches
            for c0 in range(0, len(keep), span):
                chunk = sorted(keep[c0:c0 + span], key=lambda j: pool[j].input_ids.shape[0])
                for b0 in range(0, len(chunk), local_bs):
                    yield pool, chunk[b0:b0 + local_bs]


def read_file(path: str, s3: S3Config) -> bytes:
    """A file the driver wrote for the workers (local path visible to every worker, or s3://)."""
    parent, name = path.rsplit("/", 1)
    return ShardStore(parent, s3).read(name)


def read_selection(path: str | None, s3: S3Config) -> dict[str, dict[str, Any]] | None:
    return None if path is None else json.loads(read_file(path, s3))


def _load_lm_head(path: str, s3: S3Config, device: torch.device) -> torch.Tensor:
    from safetensors.torch import load

    return load(read_file(path, s3))["weight"].float().to(device)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """The Ray Train worker function: resume from the last checkpoint if any, then train epoch by epoch."""
    import ray.train
    import ray.train.torch
    import torch.distributed as dist
    from ray.train import Checkpoint

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    cfg = TrainConfig.model_validate(config["train"])
    init = HeadInit.model_validate(config["init"])
    s3 = S3Config.model_validate(config["s3"])
    if config.get("torch_threads"):
        torch.set_num_threads(int(config["torch_threads"]))
    device = torch.device("cuda", torch.cuda.current_device()) if config["use_gpu"] else torch.device("cpu")
    m = training_method(init.method, init.method_options)
    store = ShardStore(config["data"], s3)
    selection = read_selection(init.selection_path, s3)
    manifest = selected_manifest(store.manifest(), selection)

    def load(name: str) -> list[FeatureExample]:
        pool = store.load_shard(name)
        return pool if selection is None else m.apply_selection(pool, selection[name])
    stages = stage_schedule(m, cfg)
    check_plan(manifest, cfg, world)
    local_bs = cfg.batch_size // world
    steps_of = [epoch_steps(manifest, stages, e, world, local_bs, cfg.seed) for e in range(cfg.epochs)]
    torch.manual_seed(cfg.seed)
    head = m.head_from_config(init.head_config).float().to(device).train()
    W = _load_lm_head(init.lm_head_path, s3, device)
    # DDP through Ray Train: gradients averaged across workers in backward, the same start on every worker (DDP
    # broadcasts rank 0's parameters when it wraps); unused parameters allowed (a stage may leave some idle)
    loss_fn = ray.train.torch.prepare_model(MethodLoss(m, head, W, cfg.p_weight), move_to_device=False,
                                            parallel_strategy_kwargs={"find_unused_parameters": True})
    opt, sched = make_optimizer(head, cfg, sum(steps_of))
    history: list[dict[str, Any]] = []
    starts: list[int] = []
    start_epoch = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            st = torch.load(Path(d) / STATE_FILE, weights_only=False, map_location=device)
            saved = saved_head_config(st, Path(d))
        if st.get("method", m.name) != m.name:
            raise ValueError(f"the Ray Train run's checkpoint holds a {st['method']} training run, not {m.name}; "
                             "give a new --work and --out to start over")
        check_resume_config(m.name, saved, head, "the Ray Train run's checkpoint")
        head.load_state_dict(st["head"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        start_epoch, history, starts = st["epoch"], st["history"], st.get("starts", [])
        log.info("worker %d/%d: resuming %s training at epoch %d", rank, world, m.name, start_epoch)
    starts.append(start_epoch)
    for epoch in range(start_epoch, cfg.epochs):
        t0 = time.time()
        m.begin_epoch(head, epoch + 1, cfg)
        gen = torch.Generator().manual_seed(cfg.seed * 100_003 + epoch * 1_009 + rank)
        sums: dict[str, float] = {"loss": 0.0}
        batches = local_batches(load, manifest, stages, cfg, epoch, rank, world, local_bs)
        steps = steps_of[epoch]
        if not steps:
            log.warning("epoch %d: some worker has no examples this epoch (tiny data set); no step taken", epoch + 1)
        for _ in range(steps):
            pool, idx = next(batches)
            batch = to_device(m.collate(pool, idx, cfg.noise, gen), device)
            loss, parts = train_step(m, head, batch, W, cfg, opt, sched, loss_fn=loss_fn)
            sums["loss"] += loss
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v
        mean = torch.tensor([sums[k] / max(1, steps) for k in sorted(sums)], dtype=torch.float64, device=device)
        dist.all_reduce(mean)  # report the mean over workers
        rec = {"epoch": epoch + 1, **{k: float(v) / world for k, v in zip(sorted(sums), mean.tolist())},
               "train_s": time.time() - t0, "steps": steps, "workers": world,
               "multimodal_share": stages.ratio(epoch + 1)}
        history.append(rec)
        with tempfile.TemporaryDirectory() as d:
            checkpoint = None
            if rank == 0:
                head.save(d)
                torch.save({"method": m.name, "config": head_config(head), "head": head.state_dict(),
                            "opt": opt.state_dict(), "sched": sched.state_dict(), "epoch": epoch + 1,
                            "history": history, "starts": starts}, Path(d) / STATE_FILE)
                (Path(d) / "history.json").write_text(json.dumps({"history": history, "starts": starts}, indent=2))
                checkpoint = Checkpoint.from_directory(d)
                log.info("%s drafter epoch %d/%d (%d workers): %s", m.name, epoch + 1, cfg.epochs, world,
                         json.dumps(rec))
            ray.train.report(rec, checkpoint=checkpoint)


def fit(data: str, init: HeadInit, cfg: TrainConfig, dist_cfg: DistributedConfig, s3: S3Config | None = None,
        torch_threads: int | None = None) -> Path:
    """Run the Ray Train job (connecting to / starting Ray as the batch jobs do) and return a local directory
    holding the final checkpoint: the drafter (config.json + model.safetensors) and `history.json`."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from mmspec_ray.batch.cluster import connect_ray
    from mmspec_ray.batch.storage import locate

    s3 = s3 or S3Config.from_env()
    connect_ray()
    storage = locate(dist_cfg.storage, s3)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"data": data, "init": init.model_dump(), "train": cfg.model_dump(),
                           "s3": s3.model_dump(mode="json"), "use_gpu": dist_cfg.use_gpu,
                           "torch_threads": torch_threads or max(1, int(dist_cfg.cpus_per_worker))},
        scaling_config=ScalingConfig(num_workers=dist_cfg.num_workers, use_gpu=dist_cfg.use_gpu,
                                     resources_per_worker={"CPU": dist_cfg.cpus_per_worker}),
        run_config=RunConfig(name=dist_cfg.name, storage_path=storage.path if storage.is_s3 else storage.uri,
                             storage_filesystem=storage.fs if storage.is_s3 else None,
                             failure_config=FailureConfig(max_failures=dist_cfg.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
    )
    result = trainer.fit()
    if result.error is not None:
        raise result.error
    if result.checkpoint is None:
        raise RuntimeError("Ray Train finished without a checkpoint")
    out = Path(tempfile.mkdtemp(prefix="mmspec-drafter-"))
    result.checkpoint.to_directory(str(out))
    os.remove(out / STATE_FILE)  # optimiser state stays in the run's storage; the drafter is what ships
    return out
