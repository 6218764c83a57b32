"""The target's answers to a training job's rows (the feature shards data generation writes), stored once per
(target, data, answer settings) so that every method trained on them reuses them, and what those answers say of the
rows that gave none.

Without `--work`, a job's shards go to `train-data/<key>/`: under $MMSPEC_HOME when the work folder is local, beside
the work folder when it is on S3 (shared storage every node reaches). The key is a digest of the checkpoint's
identity (`targets.layout.checkpoint_identity`, the one drafter discovery matches by) with a digest of its
generation config, tokenizer, chat template and processor files, the input files' content
fingerprints (`batch.storage.input_fingerprints`), the answer recipe (length, temperature, seed, the features
recorded), the settings that shape an answer (device, dtype, media) and the held-out rows. A second method on the
same target, data and settings finds every row answered and answers none again. With `--work` the shards stay in
`<work>/features`, as do shards a run made there before answers were shared."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from typing import TYPE_CHECKING, Any

from mmspec_ray.batch.jobspec import DecodeConfig
from mmspec_ray.training.shards import ShardStore

if TYPE_CHECKING:
    from mmspec_ray.targets.layout import CheckpointLayout

ANSWER_SETTINGS = {"device", "dtype", "tie_margin", "default_prompt", "media"}  # DecodeConfig fields that shape answers
CONTENT_KEYS = ("size", "md5", "sha256", "etag")  # a file's fingerprint without its modification time
FEATURES_FORMAT = 1  # raised when what a stored example holds changes: older stored answers are then not reused


def answers_key(job: Any, cfg: DecodeConfig, held: list[str], layout: "CheckpointLayout") -> str:
    """The digest naming a job's answers: same target, data, answer recipe, answer settings and held-out rows, same
    key (wherever the checkpoint or the data is copied). `job`: a `training.pipeline.TrainJob` (not imported here:
    the pipeline imports this module)."""
    from mmspec_ray.targets.layout import answer_files_digest, checkpoint_identity

    what = {"target": checkpoint_identity(job.target, cfg.s3, layout),
            "answer_files": answer_files_digest(job.target, cfg.s3),  # generation config, tokenizer, template, ...
            "format": FEATURES_FORMAT, "data": data_fingerprint(job.data, cfg),
            "recipe": job.recipe.model_dump(mode="json"), "limit": job.limit,
            "decode": cfg.model_dump(mode="json", include=ANSWER_SETTINGS),
            "held_out": hashlib.sha256("\n".join(sorted(held)).encode()).hexdigest()}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:20]


def data_fingerprint(uri: str, cfg: DecodeConfig) -> dict[str, dict[str, Any]]:
    """The input files' sizes and content hashes (S3: ETags) by name: the data as it is, not where it lies."""
    from mmspec_ray.batch.storage import input_fingerprints, locate

    prints = input_fingerprints(locate(uri, cfg.s3))
    return {name: {k: v for k, v in rec.items() if k in CONTENT_KEYS} for name, rec in sorted(prints.items())}


def answers_root(job: Any) -> str:
    """Where shared answers go: $MMSPEC_HOME/train-data for a local work folder, `train-data` beside an s3:// one."""
    from mmspec_ray.config import mmspec_home

    work = job.work_dir.rstrip("/")
    if work.startswith("s3://"):
        parent = work.rsplit("/", 1)[0]
        return (parent if parent != "s3:/" else work) + "/train-data"  # (a work folder at a bucket's root)
    return str(mmspec_home() / "train-data")


def features_uri(job: Any, cfg: DecodeConfig, held: list[str], layout: "CheckpointLayout") \
        -> tuple[str, str | None]:
    """Where this job's answers (feature shards) are read and written, and their key: `<work>/features` (no key)
    when --work is given or already holds shards, else the shared `train-data/<key>`."""
    own = job.work_dir.rstrip("/") + "/features"
    if job.work or ShardStore(own, cfg.s3).shard_names():
        return own, None
    key = answers_key(job, cfg, held, layout)
    return f"{answers_root(job)}/{key}", key


def answered_rows(uri: str, cfg: DecodeConfig) -> int:
    """Rows already answered (or failed for a reason of their own) in a feature folder: what a run reuses."""
    from mmspec_ray.training.datagen_job import done_ids

    return len(done_ids(ShardStore(uri, cfg.s3)))


def reuse_text(uri: str, done: int, todo: int, shared: bool = True) -> str:
    """Where the answers are stored (`shared`: the key's folder, else --work's) and whether this run reuses some,
    and how many rows are left to answer."""
    if not done:
        return f"{uri} (new: shared with every method on the same target, data and answer settings)" if shared \
            else f"{uri} (new)"
    left = f"{todo} left to answer" if todo else "none left to answer"
    return (f"{uri}: reusing the target's answers to {done} rows done there (a row that failed for a reason of its "
            f"own counts as done; same target, data and answer settings); {left}")


def row_error_kinds(errors: dict[str, dict[str, str]]) -> dict[str, dict[str, Any]]:
    """Row errors by kind, most frequent first: {kind: {"rows": count, "example": a row id, "error": its reason}}."""
    kinds = Counter(e.get("error_kind") or "unknown" for e in errors.values())
    out = {}
    for kind, n in kinds.most_common():
        row, err = next((i, e) for i, e in errors.items() if (e.get("error_kind") or "unknown") == kind)
        out[kind] = {"rows": n, "example": row, "error": err.get("error")}
    return out


def row_error_lines(kinds: dict[str, dict[str, Any]], where: str) -> list[str]:
    """One line per kind of row error (count, an example row id and its reason), then where the manifest lists every
    row's; no lines without errors."""
    if not kinds:
        return []
    total = sum(k["rows"] for k in kinds.values())
    lines = [f"row errors: {total} rows gave no training example"]
    lines += [f"  {kind}: {k['rows']} rows, e.g. row {k['example']!r}: {k['error']}" for kind, k in kinds.items()]
    lines.append(f"  every row's reason: {where.rstrip('/')}/manifest.json")
    return lines
