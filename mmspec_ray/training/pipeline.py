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
import os
import logging
import shutil
import tempfile
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa
import torch
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from mmspec_ray.batch.jobspec import DecodeConfig
from mmspec_ray.decoding.tree import TreeConfig
from mmspec_ray.targets.base import Request, TargetError
from mmspec_ray.training.datagen import DatagenRecipe
from mmspec_ray.training.datagen_job import DatagenJob, run_datagen
from mmspec_ray.training.distributed import HEAD_INIT_FILE, SELECTION_FILE, DistributedConfig, HeadInit, fit
from mmspec_ray.training.methods import training_method
from mmspec_ray.training.shards import FeatureExample, ShardStore
from mmspec_ray.training.trainer import TrainConfig, heldout_tau, stage_schedule, train_drafter

if TYPE_CHECKING:
    from mmspec_ray.targets.base import VLMTarget
    from mmspec_ray.targets.layout import CheckpointLayout
    from mmspec_ray.training.choose import DataMix

log = logging.getLogger(__name__)
T = TypeVar("T")


class TrainJob(BaseModel):
    """Requests -> features -> a trained drafter checkpoint."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: str = "eagle2"
    method_why: str = Field("given", description="why this method (the plan says it): given, or --method auto's why")
    method_options: dict[str, Any] = Field(default_factory=dict, description="keyword options of the method's class "
                                           "(e.g. hivis: min_answer_words; vispec: mtp_steps), for every trainer")
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
    rows_per_shard: int = Field(32, ge=1, description="rows per feature shard (the unit of resume; Ray Train needs "
                                "at least as many shards as workers)")
    gpus_per_actor: float = Field(0.0, ge=0.0)
    num_workers: int = Field(0, ge=0, description="0: the single-process trainer; N: Ray Train with N workers")
    use_gpu: bool = False
    cpus_per_worker: float = Field(1.0, gt=0)
    max_failures: int = Field(3, ge=0)
    tree: TreeConfig = TreeConfig()
    features: str | None = Field(None, description="where the target's answers (feature shards) are stored; None: "
                                 "resolved by the run (training.answers: shared across methods, or <work>/features)")

    @property
    def work_dir(self) -> str:
        return self.work or self.out.rstrip("/") + ".work"

    @property
    def features_dir(self) -> str:
        """The feature shards' folder: the resolved one, else `<work>/features`."""
        return self.features or self.work_dir.rstrip("/") + "/features"

    def decode_config(self) -> DecodeConfig:
        return DecodeConfig.model_validate({"drafter": "none", **self.decode, "target": self.target,
                                            "max_new_tokens": self.recipe.max_new_tokens})


def input_ids(job: TrainJob, cfg: DecodeConfig) -> pa.Array:
    """The input's ids (after `limit`), as strings."""
    from mmspec_ray.batch.storage import locate, scan_input

    _, ids = scan_input(locate(job.data, cfg.s3))
    ids = ids.combine_chunks().cast(pa.string())
    return ids.slice(0, job.limit) if job.limit is not None else ids


def heldout_ids(job: TrainJob, cfg: DecodeConfig) -> list[str]:
    """The last `heldout` ids of the input (after `limit`), as strings."""
    ids = input_ids(job, cfg)
    if job.heldout >= len(ids):
        raise ValueError(f"--heldout {job.heldout} leaves no training rows of the {len(ids)} in {job.data}")
    return ids.slice(len(ids) - job.heldout).to_pylist() if job.heldout else []


def heldout_requests(job: TrainJob, cfg: DecodeConfig, ids: list[str]) -> list[Request]:
    """The held-out rows as requests (media decoded by the batch jobs' row code); bad rows are skipped, logged."""
    from mmspec_ray.batch.rows import RowError, prepare_row, resolve_image_side
    from mmspec_ray.batch.storage import locate
    from mmspec_ray.batch.storage import parquet_files as parts_of

    if not ids:
        return []
    cfg = resolve_image_side(cfg)
    src = locate(job.data, cfg.s3)
    parts = [pq.read_table(f, filesystem=src.fs, filters=[("id", "in", ids_as(pq.read_schema(f, filesystem=src.fs)
                                                                           .field("id").type, ids))])
             for f in parts_of(src)]
    table = pa.concat_tables(parts)
    out = []
    for row in table.to_pylist():
        try:
            out.append(prepare_row(row, cfg))
        except RowError as e:
            log.warning("held-out row %r skipped: %s", row.get("id"), e)
    return out


def ids_as(kind: pa.DataType, ids: list[str]) -> list:
    """The held-out ids (kept as strings) in the id column's own type, for a parquet read filter."""
    return [int(i) for i in ids] if pa.types.is_integer(kind) else ids


def publish(local: Path, uri: str, s3) -> None:
    """Copy a drafter directory to its destination (local directory or s3:// prefix)."""
    from pyarrow import fs as pafs

    from mmspec_ray.batch.storage import locate

    dest = locate(uri, s3)
    if not dest.is_s3:
        Path(dest.path).mkdir(parents=True, exist_ok=True)
    pafs.copy_files(str(local), dest.path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=dest.fs)


def run_train_job(job: TrainJob, dry_run: bool = False) -> dict[str, Any]:
    """Run (or resume) the whole job; returns a summary (also the drafter's history.json). The plan is printed
    first; `dry_run`: print it and return {"plan": ..., "dry_run": True}, no model loaded, nothing written."""
    from mmspec_ray.batch.cluster import connect_ray
    from mmspec_ray.training.answers import answered_rows, features_uri, row_error_kinds, row_error_lines
    from mmspec_ray.training.choose import data_mix
    from mmspec_ray.training.plan import format_train_plan

    job = absolute_paths(job)
    m = training_method(job.method, job.method_options)
    job = with_method_features(job, m)
    cfg = job.decode_config()
    held = heldout_ids(job, cfg)
    check_plan_early(m, job)
    rows = len(input_ids(job, cfg))
    job = shards_for_workers(job, rows - len(held))
    from mmspec_ray.targets.registry import check_loadable

    try:  # what an actor would die of, said in one line before any actor starts
        layout = check_loadable(job.target, cfg.s3)
    except TargetError as e:
        raise ValueError(f"target: {e}") from e
    features, key = features_uri(job, cfg, held, layout)
    job = job.model_copy(update={"features": features})
    plan = train_plan(job, layout, rows, data_mix(job.data, cfg.s3), answered_rows(features, cfg), bool(key))
    print(format_train_plan(plan), flush=True)
    if dry_run:
        return {"plan": plan, "dry_run": True}
    connect_ray(dashboard=bool(job.num_workers))  # Ray Train's controller polls the state API (the dashboard's)
    check_shared_work(job)
    check_existing_features(features, job, cfg)
    manifest = run_datagen(DatagenJob(input=job.data, output=features, decode=cfg, recipe=job.recipe,
                                      exclude_ids=tuple(held), limit=job.limit, num_actors=job.datagen_actors,
                                      gpus_per_actor=job.gpus_per_actor, rows_per_shard=job.rows_per_shard,
                                      answers_key=key))
    kinds = row_error_kinds(manifest["errors"])
    for line in row_error_lines(kinds, features):
        log.warning("%s", line)
    if not manifest["examples"]:
        raise ValueError(f"data generation gave no training examples ({len(manifest['errors'])} row errors, e.g. "
                         f"{next(iter(manifest['errors'].items()), None)}); see {features}/manifest.json")
    if job.num_workers == 0 or m.corpus_only:  # a corpus-only method fits nothing: one process reads the answers
        history = on_target_node(job, train_single_process, job, features, held)
    else:
        from mmspec_ray.training.distributed import check_plan

        check_plan(manifest, job.train, job.num_workers)
        check_streamable(m, ShardStore(features, cfg.s3), manifest)
        init = on_target_node(job, prepare_head_init, job)
        dist_cfg = DistributedConfig(num_workers=job.num_workers, use_gpu=job.use_gpu,
                                     cpus_per_worker=job.cpus_per_worker, max_failures=job.max_failures,
                                     storage=job.work_dir.rstrip("/") + "/ray-train", name=run_name(job))
        trained = fit(features, init, job.train, dist_cfg, cfg.s3)
        history = json.loads((trained / "history.json").read_text())
        publish(trained, job.out, cfg.s3)
        shutil.rmtree(trained, ignore_errors=True)
    tau, n_held = on_target_node(job, measure_heldout, job, held)
    summary = {"method": m.name, "target": job.target, "data": job.data, "out": job.out,
               "examples": manifest["examples"], "row_errors": len(manifest["errors"]),
               "row_errors_by_kind": kinds, "answers": features,
               "heldout_rows": n_held, "heldout_tau": tau, "trainer": plan["trainer"]["kind"],
               "workers": job.num_workers, "plan": plan, "history": history}
    ShardStore(job.out, cfg.s3).write("history.json", json.dumps(summary, indent=2).encode())
    log.info("drafter %s for %s written to %s: held-out τ %.3f on %d rows", m.name, job.target, job.out, tau, n_held)
    return summary


def train_plan(job: TrainJob, layout: "CheckpointLayout", rows: int, mix: "DataMix", answered: int = 0,
               shared: bool = False) -> dict[str, Any]:
    """The plan as a dict (also the summary's `plan`); `rows`: input rows after --limit; `mix`: their kinds;
    `answered`: training rows whose answers are already stored (reused, not answered again); `shared`: they are
    stored in the shared answers folder (training.answers), not in --work."""
    m = training_method(job.method, job.method_options)
    stages = stage_schedule(m, job.train)
    dtype = job.decode.get("dtype", "auto")
    if dtype == "auto":
        dtype = "bfloat16" if job.use_gpu else "float32"
    temp = job.recipe.temperature
    return {
        "target": job.target, "family": layout.model_type, "parameters": layout.parameters,
        "data": job.data, "rows": rows, "train_rows": rows - job.heldout, "heldout_rows": job.heldout,
        "mix": {"rows": mix.rows, "video": mix.video, "image": mix.image, "text": mix.text},  # of the whole input
        "method": m.name, "method_why": job.method_why,
        "datagen": {"actors": job.datagen_actors, "gpus_per_actor": job.gpus_per_actor, "dtype": dtype,
                    "answers": "greedy" if temp == 0 else f"sampled at T = {temp:g}",
                    "max_new_tokens": job.recipe.max_new_tokens, "stored": job.features_dir,
                    "reused_rows": answered, "shared": shared},
        "trainer": {"kind": "corpus" if m.corpus_only else "ray-train" if job.num_workers else "single-process",
                    "workers": job.num_workers,
                    "gpu": job.use_gpu, "cpus_per_worker": job.cpus_per_worker, "epochs": job.train.epochs,
                    "text_epochs": stages.text_epochs, "batch_size": job.train.batch_size},
        "work": job.work_dir, "out": job.out,
    }


def on_target_node(job: TrainJob, fn: Callable[..., T], *args: Any) -> T:
    """Run `fn` (work that loads the target) here, or with --use-gpu as a Ray task holding one GPU: under `ray job
    submit` this process is the driver on the head node, which has no GPU (and no room for a large target)."""
    if not job.use_gpu:
        return fn(*args)
    import ray

    task = ray.remote(num_cpus=job.cpus_per_worker, num_gpus=1)(fn)
    return ray.get(task.remote(*args))


def load_job_target(job: TrainJob) -> "VLMTarget":
    from mmspec_ray.batch.decoder import resolve_device
    from mmspec_ray.targets import load_target

    cfg = job.decode_config()
    device, dtype = resolve_device(cfg)
    return load_target(job.target, device, dtype, s3=cfg.s3)


def train_single_process(job: TrainJob, features: str, held: list[str]) -> list[dict[str, Any]]:
    """The single-process trainer on every example, in a run directory kept under $MMSPEC_HOME (a re-run resumes
    from its trainer_state.pt); the drafter is then published to `job.out`. Returns the per-epoch history."""
    from mmspec_ray.toy.build import mmspec_home
    from mmspec_ray.training.datagen import load_features

    m = training_method(job.method, job.method_options)
    target = load_job_target(job)
    examples = load_features(features)
    mm = [e for e in examples if e.multimodal]
    text = ([e for e in examples if not e.multimodal] if stage_schedule(m, job.train).uses_text or m.corpus_only
            else [])  # a corpus takes every answer
    run = mmspec_home() / "train-runs" / run_name(job)
    train_drafter(m, target, mm, run, job.train, heldout=heldout_requests(job, job.decode_config(), held),
                  tree=job.tree, text_examples=text)
    out = Path(tempfile.mkdtemp(prefix="mmspec-drafter-"))
    for name in ("config.json", "model.safetensors", "history.json"):
        shutil.copy(run / name, out / name)
    publish(out, job.out, job.decode_config().s3)
    shutil.rmtree(out, ignore_errors=True)
    return json.loads((run / "history.json").read_text())


def ids_only(ex: FeatureExample) -> FeatureExample:
    """An example stripped to its token ids and prompt length (what a head fitted to the data's tokens reads)."""
    empty = torch.zeros(0)
    return FeatureExample(ex.input_ids, empty, empty, ex.n_prompt)


def with_method_features(job: TrainJob, m) -> TrainJob:
    """The job with the features its method needs switched on in the data recipe (DREAM's intermediate layer,
    EAGLE-3's three layers); a recipe that asks for more keeps it."""
    r = job.recipe
    update = {"mid_features": r.mid_features or "mid" in m.needs, "aux_features": r.aux_features or "aux" in m.needs}
    return job.model_copy(update={"recipe": r.model_copy(update=update)})


def prepare_head_init(job: TrainJob) -> HeadInit:
    """What Ray Train workers start from (they never load the target): the head init, and for a method that selects
    its data with the target, its choice per feature shard."""
    m = training_method(job.method, job.method_options)
    target = load_job_target(job)
    s3 = job.decode_config().s3
    examples = None
    if m.head_needs_examples(target):  # e.g. EAGLE-3's draft vocabulary from the answers' token counts: the ids
        store = ShardStore(job.features_dir, s3)  # only, a shard at a time
        examples = [ids_only(ex) for name in store.manifest()["shards"] for ex in store.load_shard(name)]
    init = write_head_init(m, target, job.work_dir.rstrip("/") + "/init", s3, examples).model_copy(
        update={"method_options": job.method_options})
    if not m.selects:
        return init
    features = ShardStore(job.features_dir, s3)
    manifest = features.manifest()
    selection = {n: m.shard_selection(target, features.load_shard(n)) for n in manifest["shards"]}
    if not sum(v["multimodal"] for v in selection.values()):
        raise ValueError(f"{m.name} data selection keeps no multimodal example of the {manifest['examples']} "
                         "generated (e.g. every answer too short for its filter); raise --max-new-tokens or use "
                         "another method")
    log.info("%s data selection keeps %d of %d examples (%d marked for the later stage to leave out)", m.name,
             sum(len(v["keep"]) for v in selection.values()), manifest["examples"],
             sum(len(v["marked"]) for v in selection.values()))
    store = ShardStore(job.work_dir.rstrip("/") + "/init", s3)
    store.write(SELECTION_FILE, json.dumps(selection).encode())
    return init.model_copy(update={"selection_path": f"{store.loc.uri.rstrip('/')}/{SELECTION_FILE}"})


def measure_heldout(job: TrainJob, held: list[str]) -> tuple[float, int]:
    """The published drafter's τ on the held-out rows (greedy, the job's tree), and how many rows it ran on."""
    from mmspec_ray.drafters.base import load_drafter, stop_learning

    target = load_job_target(job)
    requests = heldout_requests(job, job.decode_config(), held)
    drafter = load_drafter(job.out, target, s3=job.decode_config().s3)
    stop_learning(drafter)  # a learning drafter (suffix) is measured as published, not on held-out answers it learnt
    return heldout_tau(target, drafter, requests, job.tree, job.train.eval_max_new_tokens), len(requests)


def absolute_paths(job: TrainJob) -> TrainJob:
    """Local paths made absolute here, on the driver: Ray Train workers and datagen actors run in working
    directories of their own, where a relative --out or --work would name another folder."""
    def fix(p: str | None) -> str | None:
        if p is None or "://" in p:
            return p
        return os.path.abspath(os.path.expanduser(p))

    return job.model_copy(update={"out": fix(job.out), "work": fix(job.work), "data": fix(job.data),
                                  "target": fix(job.target) if os.path.exists(os.path.expanduser(job.target))
                                  else job.target})


def shards_for_workers(job: TrainJob, rows: int) -> TrainJob:
    """With Ray Train, rows per feature shard lowered so every worker gets at least one shard of the `rows`
    training rows (a small data set would otherwise make fewer shards than workers)."""
    if not job.num_workers or rows <= 0:
        return job
    fit = max(1, rows // job.num_workers)
    if job.rows_per_shard <= fit:
        return job
    log.info("rows per shard %d -> %d: %d training rows over %d Ray Train workers", job.rows_per_shard, fit, rows,
             job.num_workers)
    return job.model_copy(update={"rows_per_shard": fit})


def check_existing_features(features: str, job: TrainJob, cfg: DecodeConfig) -> None:
    """Features already generated in the work folder are reused as they are: say so when this run asks for
    another shard size than they were cut with (a new --work regenerates them)."""
    store = ShardStore(features, cfg.s3)
    try:
        manifest = json.loads(store.read("manifest.json"))
    except (OSError, ValueError, FileNotFoundError):
        return
    had = manifest.get("rows_per_shard")
    if had is not None and had != job.rows_per_shard:
        log.warning("features in %s were cut at %d rows per shard; rows per shard %d applies to new rows only (give "
                    "a new --work to regenerate them all)", features, had, job.rows_per_shard)


def check_plan_early(m, job: TrainJob) -> None:
    """Mistakes that would otherwise surface after hours of data generation, refused before any work."""
    if job.num_workers:
        if job.train.batch_size % job.num_workers:
            raise ValueError(f"batch size {job.train.batch_size} does not split over {job.num_workers} workers; "
                             "use a multiple of --num-workers")


def check_shared_work(job: TrainJob) -> None:
    """On a multi-node cluster the work directory must be shared storage: shards are written by actors on any
    node, and Ray Train's checkpoints and head init are read on every node."""
    import ray

    if not job.work_dir.startswith("s3://") and len([n for n in ray.nodes() if n.get("Alive")]) > 1:
        raise ValueError(f"--work {job.work_dir} is a local path on a multi-node Ray cluster; give an s3:// one")


def check_streamable(m, store: ShardStore, manifest: dict[str, Any]) -> None:
    """Ray Train workers stream shards and never load the target: a method that cuts media into images / frames
    needs the segments data generation stores with each example (features made before they were are refused)."""
    if not m.cuts_media:
        return
    old = [n for n, mm in zip(manifest["shards"], manifest.get("multimodal_per_shard", manifest["shards"]))
           if mm and "segments" not in store.shard_info(n).fields]
    if old:
        raise ValueError(f"{m.name} on Ray Train needs the media segments stored with each example, which "
                         f"{len(old)} shard(s) in {store.uri} lack (made by an earlier version, e.g. {old[0]}); give a "
                         "new --work to generate them again, or train with --num-workers 0")


def run_name(job: TrainJob) -> str:
    """Ray Train's run name: one per (method, out, training settings), so a re-run of the same job resumes its
    checkpoints and a different job sharing the work directory (other seed, other method) starts its own."""
    import hashlib

    settings = job.train.model_dump(mode="json", exclude_defaults=True)  # a new setting's default renames nothing
    key = json.dumps([job.method, job.out, settings] + ([job.method_options] if job.method_options else []),
                     sort_keys=True)
    return f"{job.method}-drafter-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


def write_head_init(m, target, uri: str, s3, examples: list | None = None) -> HeadInit:
    """The head config and LM-head weight Ray Train workers build their head from (they never load the target)."""
    from safetensors.torch import save

    head_config = m.head(target, examples).cfg.model_dump(mode="json")
    store = ShardStore(uri, s3)
    W = target.model.get_output_embeddings().weight.detach().float().cpu().contiguous()
    store.write(HEAD_INIT_FILE, save({"weight": W}))
    return HeadInit(method=m.name, head_config=head_config, lm_head_path=f"{store.loc.uri.rstrip('/')}/{HEAD_INIT_FILE}")
