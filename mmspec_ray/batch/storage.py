"""Where a job reads and writes: local paths or s3:// URIs through an explicit pyarrow filesystem.

S3 always goes through `pyarrow.fs.S3FileSystem` built from `S3Config` (endpoint override, scheme, region);
credentials come from the standard AWS sources and are never stored or logged. Input files are checked up front
(`scan_input`); what the job may do in its output directory is `batch/output.py`'s business.
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyarrow import fs as pafs

from mmspec_ray.config import S3Config
from mmspec_ray.media.io import filesystem_for

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
    filesystem, path = filesystem_for(uri, s3)
    return Location(uri if uri.startswith("s3://") else path, filesystem, path)


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


def input_fingerprints(loc: Location, files: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """What each input file is now, to tell on a resume whether the input changed: {name: {size, mtime}} (name
    relative to `loc`), or {size, sha256} for a file whose store gives no modification time. `files`: the input's
    parquet files (default: `parquet_files(loc)`; a single file such as a Kinetics CSV is itself)."""
    import hashlib

    paths = files if files is not None else (parquet_files(loc) or [loc.path])
    out: dict[str, dict[str, Any]] = {}
    for path in paths:
        info = loc.fs.get_file_info(path)
        if info.type != pafs.FileType.File:
            continue
        name = input_name(loc, path)
        rec: dict[str, Any] = {"size": info.size}
        if info.mtime_ns is not None:
            rec["mtime"] = datetime.fromtimestamp(info.mtime_ns / 1e9, timezone.utc).isoformat(timespec="microseconds")
        else:
            digest = hashlib.sha256()
            with loc.fs.open_input_stream(path) as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
            rec["sha256"] = digest.hexdigest()
        out[name] = rec
    return out


def input_name(loc: Location, path: str) -> str:
    """An input file's name as fingerprints record it: relative to the input folder (a single file: its name)."""
    return path[len(loc.path):].lstrip("/") or path.rsplit("/", 1)[-1]


def fingerprint_changes(old: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]]) -> list[str]:
    """One line per input file that is new, gone or changed since `old` was recorded (empty: the same input)."""
    out = []
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if a is None:
            out.append(f"{name}: new")
        elif b is None:
            out.append(f"{name}: gone")
        elif a != b:
            what = ", ".join(f"{k} {a.get(k)} -> {b.get(k)}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
            out.append(f"{name}: {what}")
    return out


class JobInputError(ValueError):
    """A job-level mistake (input, output or settings) found before any decoding: one line, naming what to fix."""


def check_disjoint(a: Location, b: Location, what: str = "input", other: str = "output") -> None:
    """Refuse two locations where one lies inside the other (the same path counts): an output inside the input
    would be read back as input on the next run, an input inside the output is the job's to clean."""
    if a.is_s3 != b.is_s3:
        return
    real = (lambda p: p) if a.is_s3 else os.path.realpath  # through symlinks on local disks
    pa_, pb = real(a.path).rstrip("/").split("/"), real(b.path).rstrip("/").split("/")
    n = min(len(pa_), len(pb))
    if pa_[:n] == pb[:n]:
        raise JobInputError(f"{what} {a.uri} and {other} {b.uri} overlap (one lies inside the other); write the "
                            f"{other} to a directory outside the {what}")


def scan_input(loc: Location) -> tuple[pa.Schema, pa.ChunkedArray]:
    """The schema and `id` column (one chunk per file) of an input parquet file or directory, every file checked up
    front: readable, the same columns with the same types in every file, a string or integer `id`, ids non-null
    and unique. Errors name the file."""
    files = parquet_files(loc)
    if not files:
        raise JobInputError(f"no parquet files at {loc.uri}; give a parquet file or a directory of them")

    def schema_of(path: str) -> pa.Schema:
        try:
            return pq.read_schema(path, filesystem=loc.fs)
        except pa.ArrowInvalid as e:
            raise JobInputError(f"input file {_name(loc, path)} is not readable parquet: {_one_line(e)}") from e
        except OSError as e:  # the store, not the file: say so (re-run later), never blame the data
            raise JobInputError(f"cannot read input file {_name(loc, path)} ({_one_line(e)}); check access and "
                                "re-run when the store is reachable") from e

    with ThreadPoolExecutor(max_workers=8) as pool:
        schemas = list(pool.map(schema_of, files))
    first = schemas[0]
    for path, schema in zip(files[1:], schemas[1:]):
        missing = [n for n in first.names if n not in schema.names]
        extra = [n for n in schema.names if n not in first.names]
        if missing or extra:
            raise JobInputError(f"input file {_name(loc, path)} has other columns than {_name(loc, files[0])} "
                                f"(missing {missing}, extra {extra}); every file needs the same columns")
        for field in schema:
            want = first.field(field.name).type
            if field.type != want and not pa.types.is_null(field.type) and not pa.types.is_null(want):
                raise JobInputError(f"input file {_name(loc, path)}: column {field.name!r} is {field.type} but "
                                    f"{want} in {_name(loc, files[0])}; cast it to one type in every file")
    if "id" not in first.names:
        raise JobInputError(f"input {loc.uri} has no `id` column; every row needs a unique id (resume keys on it)")
    for path, schema in zip(files, schemas):
        t = schema.field("id").type
        if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t)):
            raise JobInputError(f"input file {_name(loc, path)}: column 'id' is {t}; ids must be strings or "
                                "integers")

    def ids_of(path: str) -> pa.Array:
        try:
            return pq.read_table(path, columns=["id"], filesystem=loc.fs).column("id").combine_chunks()
        except (pa.ArrowException, OSError) as e:
            raise JobInputError(f"cannot read column 'id' of input file {_name(loc, path)}: {_one_line(e)}") from e

    with ThreadPoolExecutor(max_workers=8) as pool:
        ids = pa.chunked_array(list(pool.map(ids_of, files)), type=first.field("id").type)
    check_ids(ids, loc.uri, [_name(loc, f) for f in files])
    return first, ids


def _name(loc: Location, path: str) -> str:
    return f"s3://{path}" if loc.is_s3 else path


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def check_ids(ids: pa.ChunkedArray | pa.Array, where: str, files: list[str] | None = None) -> None:
    """Ids must be non-null and unique: the output and the resume logic key on them. `files`: the file each chunk
    of `ids` came from (one chunk per file), named in the error."""
    chunks = ids.chunks if isinstance(ids, pa.ChunkedArray) else [ids]
    named = files is not None and len(files) == len(chunks)
    nulls = ids.null_count
    if nulls:
        i = next(i for i, c in enumerate(chunks) if c.null_count)
        row = pc.index(pc.is_null(chunks[i]), True).as_py() + sum(len(c) for c in chunks[:i]) * (not named)
        at = f"first in {files[i]}, row {row}" if named else f"first at row {row}"
        raise JobInputError(f"input {where}: column 'id' has {nulls} rows with a null id ({at}); give every row a "
                            "unique id")
    counts = pc.value_counts(ids)
    dup = counts.filter(pc.greater(counts.field("counts"), 1))
    if len(dup):
        sample = [d["values"] for d in dup.to_pylist()[:5]]
        msg = f"input {where}: column 'id' has {len(dup)} duplicated ids, e.g. {sample}"
        if named:
            holders = [f for f, c in zip(files, chunks) if pc.any(pc.equal(c, sample[0])).as_py()]
            msg += f" ({sample[0]!r} is in {', '.join(holders)})"
        raise JobInputError(msg + "; ids must be unique")


def write_whole(loc: Location, data: bytes) -> None:
    """Write a file whole, so no reader and no crash ever leaves half of it: on a local disk through a temporary
    name and a rename, on S3 in one PUT (S3 never shows a partial object)."""
    parent, name = loc.path.rsplit("/", 1)
    if loc.is_s3:
        with loc.fs.open_output_stream(loc.path) as f:
            f.write(data)
        return
    loc.fs.create_dir(parent, recursive=True)
    tmp = f"{parent}/.{name}.partial"
    with loc.fs.open_output_stream(tmp) as f:
        f.write(data)
    loc.fs.move(tmp, loc.path)


def write_json(loc: Location, obj: dict) -> None:
    """A JSON file (the job marker, the summary), written whole."""
    write_whole(loc, json.dumps(obj, indent=2, sort_keys=False, default=str).encode())


def read_json(loc: Location) -> dict:
    with loc.fs.open_input_stream(loc.path) as f:
        return json.loads(f.read())
