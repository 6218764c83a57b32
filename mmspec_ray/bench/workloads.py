"""What `mmspec bench` measures on: named toy workloads (image instructions, video captions, long answers, the
all-task mix) and request parquets (local or s3://, the rows the batch jobs read) for any checkpoint. One workload =
a name, its requests and its answer-length cap."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from mmspec_ray.targets.base import Request

log = logging.getLogger(__name__)

# name -> (toy tasks, max_new_tokens or None for --max-new-tokens). `long` is the long-answer setting of the
# earlier benches (`--tasks detail,video_detail --max-new-tokens 160`).
TOY_WORKLOADS: dict[str, tuple[tuple[str, ...] | None, int | None]] = {
    "all": (None, None),
    "instructions": (("caption", "detail", "question", "instruction"), None),
    "captions": (("video_caption", "video_detail"), None),
    "long": (("detail", "video_detail"), 160),
    "long_images": (("detail",), 160),  # long answers without video (no PyAV needed: e.g. a GPU box without it)
}


@dataclass
class Workload:
    """Requests measured together; `max_new_tokens` None: the bench's. `skipped`: rows that could not be read."""

    name: str
    requests: list[Request]
    max_new_tokens: int | None = None
    source: str = ""
    skipped: list[dict] = field(default_factory=list)


def parse_workloads(spec: str) -> list[tuple[str, str]]:
    """`all,long,mine=s3://b/req.parquet,/data/x.parquet` -> [(name, source)]: a toy workload's name is its own
    source; a parquet is `NAME=URI` or a bare URI (named after its file)."""
    out: list[tuple[str, str]] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, eq, uri = part.partition("=")
        if not eq:
            name, uri = (part, part) if part in TOY_WORKLOADS else (part.rstrip("/").rsplit("/", 1)[-1]
                                                                   .removesuffix(".parquet"), part)
        elif name in TOY_WORKLOADS:
            raise ValueError(f"--workloads: {name!r} names a toy workload; give the parquet another name")
        if name in (n for n, _ in out):
            raise ValueError(f"--workloads: the name {name!r} is given twice; name them NAME=URI")
        out.append((name, uri))
    if not out:
        raise ValueError("--workloads: give at least one (all, instructions, captions, long, long_images, or a "
                         "request parquet)")
    return out


def toy_workload(world, name: str, prompts: int, seed: int, tasks: tuple[str, ...] | None = None) -> Workload:
    """A named toy workload: `prompts` held-out (test split) prompts of its tasks (`tasks` overrides `all`'s)."""
    from mmspec_ray.toy.prompts import toy_requests

    own, max_new = TOY_WORKLOADS[name]
    picked = own if own is not None else tasks
    return Workload(name, list(toy_requests(world, "test", prompts, seed=seed, tasks=picked)), max_new,
                    source=f"toy test split, tasks {','.join(picked) if picked else 'all'}")


def parquet_workload(name: str, uri: str, target: str, prompts: int) -> Workload:
    """The first `prompts` rows of a request parquet (file or directory, local or s3://), read and checked by the
    batch jobs' row code (prompt or messages, image / image_uri / video / video_uri; media scaled for `target`).
    Rows that fail are skipped and kept in `skipped` with the reason, so the bench reports them."""
    from mmspec_ray.batch.rows import RowError, prepare_row, resolve_image_side
    from mmspec_ray.batch.jobspec import DecodeConfig
    from mmspec_ray.batch.storage import locate, parquet_files

    cfg = resolve_image_side(DecodeConfig(target=target))
    src = locate(uri, cfg.s3)
    files = parquet_files(src)
    if not files:
        raise ValueError(f"workload {name}: no parquet files at {uri}")
    requests: list[Request] = []
    skipped: list[dict] = []
    for where, row in _rows(src, files):
        if len(requests) >= prompts:
            break
        try:
            requests.append(prepare_row(row, cfg))
        except RowError as e:
            log.warning("bench workload %s: row %s skipped: %s", name, where, e)
            skipped.append({"row": where, "error": str(e)})
    if not requests:
        raise ValueError(f"workload {name}: none of the rows of {uri} could be read ({len(skipped)} skipped; "
                         f"first: {skipped[0]['error'] if skipped else 'no rows'})")
    return Workload(name, requests, None, source=uri, skipped=skipped)


def _rows(src, files: list[str]) -> Iterator[tuple[str, dict]]:
    """(id or file + row number, row) of every row, file by file, read a batch at a time."""
    for f in files:
        n = 0
        with src.fs.open_input_file(f) as fh:
            for batch in pq.ParquetFile(fh).iter_batches(batch_size=64):
                for row in pa.Table.from_batches([batch]).to_pylist():
                    yield str(row["id"]) if row.get("id") is not None else f"{f} row {n}", row
                    n += 1
