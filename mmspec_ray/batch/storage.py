"""Where a job reads and writes: local paths or s3:// URIs through an explicit pyarrow filesystem.

S3 always goes through `pyarrow.fs.S3FileSystem` built from `S3Config` (endpoint override, scheme, region);
credentials come from the standard AWS sources and are never stored or logged. The output directory is also the
resume checkpoint: the ids in its readable parquet files are the rows already done.
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq
from pyarrow import fs as pafs

from mmspec_ray.config import S3Config
from mmspec_ray.media.io import s3_filesystem

log = logging.getLogger(__name__)

SUMMARY_NAME = "_summary.json"


@dataclass(frozen=True)
class Location:
    """A file or directory: `uri` as the user wrote it, `path` as `fs` names it."""

    uri: str
    fs: pafs.FileSystem
    path: str

    @property
    def is_s3(self) -> bool:
        return self.uri.startswith("s3://")

    @property
    def ray_path(self) -> str:
        """The path to give Ray Data together with `filesystem=self.fs`."""
        return self.uri if self.is_s3 else self.path

    def child(self, name: str) -> "Location":
        return Location(f"{self.uri.rstrip('/')}/{name}", self.fs, f"{self.path.rstrip('/')}/{name}")


def locate(uri: str, s3: S3Config) -> Location:
    """Local path / file:// URI / s3://bucket/key -> Location (S3 with the explicit endpoint from `s3`)."""
    if uri.startswith("s3://"):
        key = uri[len("s3://"):].rstrip("/")
        if not key:
            raise ValueError(f"{uri!r} names no bucket")
        return Location(uri, s3_filesystem(s3), key)
    path = uri[len("file://"):] if uri.startswith("file://") else uri
    path = os.path.abspath(os.path.expanduser(path))
    return Location(path, pafs.LocalFileSystem(), path)


def exists(loc: Location) -> bool:
    return loc.fs.get_file_info(loc.path).type != pafs.FileType.NotFound


def parquet_files(loc: Location) -> list[str]:
    """Sorted parquet files at `loc` (a file, or a directory searched recursively); `_` / `.` names skipped."""
    info = loc.fs.get_file_info(loc.path)
    if info.type == pafs.FileType.File:
        return [loc.path]
    if info.type == pafs.FileType.NotFound:
        return []
    infos = loc.fs.get_file_info(pafs.FileSelector(loc.path, recursive=True))
    out = []
    for i in infos:
        rel = i.path[len(loc.path):].lstrip("/")
        if i.type != pafs.FileType.File or not i.path.endswith(".parquet"):
            continue
        if any(part.startswith(("_", ".")) for part in rel.split("/")):
            continue
        out.append(i.path)
    return sorted(out)


def input_dataset(loc: Location) -> pads.Dataset:
    files = parquet_files(loc)
    if not files:
        raise FileNotFoundError(f"no parquet files at {loc.uri}")
    return pads.dataset(files, filesystem=loc.fs, format="parquet")


def check_ids(ids: pa.ChunkedArray | pa.Array, where: str) -> None:
    """Ids must be non-null and unique: the output and the resume logic key on them."""
    nulls = ids.null_count
    if nulls:
        first = pc.index(pc.is_null(ids), True).as_py()
        raise ValueError(f"input {where} has {nulls} rows with a null id (first at row {first}); give every row a "
                         "unique id")
    counts = pc.value_counts(ids)
    dup = counts.filter(pc.greater(counts.field("counts"), 1))
    if len(dup):
        sample = [d["values"] for d in dup.to_pylist()[:5]]
        raise ValueError(f"input {where} has {len(dup)} duplicated ids, e.g. {sample}; ids must be unique")


@dataclass(frozen=True)
class OutputState:
    """What an output directory already holds."""

    files: list[str]
    ids: pa.Array  # ids of rows already written (duplicates kept, so they can be reported)
    removed: list[str]  # unreadable parts (a write cut off mid-file) that were deleted


def scan_output(loc: Location, columns: list[str] | None = None) -> tuple[OutputState, pa.Table | None]:
    """Read the output's ids (and `columns`); delete parquet parts that cannot be read, which only a write cut off
    by a crash leaves behind (S3 never shows a partial object), so that their rows are simply done again."""
    files = parquet_files(loc)
    cols = ["id"] + [c for c in (columns or []) if c != "id"]

    def read(path: str) -> pa.Table | None:
        try:
            return pq.read_table(path, columns=cols, filesystem=loc.fs)
        except (pa.ArrowInvalid, OSError) as e:
            if loc.fs.get_file_info(path).type == pafs.FileType.NotFound:
                raise
            log.warning("output part %s is unreadable (%s): deleting it; its rows will be decoded again", path, e)
            loc.fs.delete_file(path)
            return None

    with ThreadPoolExecutor(max_workers=8) as pool:
        tables = list(pool.map(read, files))
    good = [f for f, t in zip(files, tables) if t is not None]
    removed = [f for f, t in zip(files, tables) if t is None]
    parts = [t for t in tables if t is not None]
    table = pa.concat_tables(parts, promote_options="permissive") if parts else None
    ids = table.column("id").combine_chunks() if table is not None else pa.array([], type=pa.string())
    return OutputState(good, ids, removed), table


def clear_output(loc: Location) -> None:
    """Delete an output directory's contents (`--overwrite`)."""
    if exists(loc):
        loc.fs.delete_dir_contents(loc.path, missing_dir_ok=True)


def write_json(loc: Location, obj: dict) -> None:
    data = json.dumps(obj, indent=2, sort_keys=False, default=str).encode()
    parent = loc.path.rsplit("/", 1)[0]
    if not loc.is_s3:
        loc.fs.create_dir(parent, recursive=True)
    with loc.fs.open_output_stream(loc.path) as f:
        f.write(data)


def read_json(loc: Location) -> dict:
    with loc.fs.open_input_stream(loc.path) as f:
        return json.loads(f.read())
