"""Where a job reads and writes: local paths or s3:// URIs through an explicit pyarrow filesystem.

S3 always goes through `pyarrow.fs.S3FileSystem` built from `S3Config` (endpoint override, scheme, region);
credentials come from the standard AWS sources and are never stored or logged. Input files are checked up front
(`scan_input`); what the job may do in its output directory is `batch/output.py`'s business.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
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
    """Local path / file:// URI / s3://bucket/key -> Location (S3 with the explicit endpoint from `s3`; empty key
    segments, as in s3://b//in, dropped)."""
    if uri.startswith("s3://"):
        uri = canonical_uri(uri) + ("/" if uri.endswith("/") else "")
    filesystem, path = filesystem_for(uri, s3)
    return Location(uri if uri.startswith("s3://") else path, filesystem, path)


def exists(loc: Location) -> bool:
    return loc.fs.get_file_info(loc.path).type != pafs.FileType.NotFound


PARQUET_SUFFIXES = (".parquet", ".parq", ".pq")  # the files of an input folder that are read, in any case


def parquet_files(loc: Location) -> list[str]:
    """Sorted parquet files at `loc`: a file (whatever its name), or every file of a directory searched recursively
    (`_` / `.` names skipped) named *.parquet / *.parq / *.pq in any case. Refuses (JobInputError) a directory
    holding any other file, naming it: no file of the input is skipped silently."""
    info = loc.fs.get_file_info(loc.path)
    if info.type == pafs.FileType.File:
        return [loc.path]
    if info.type == pafs.FileType.NotFound:
        return []
    infos = loc.fs.get_file_info(pafs.FileSelector(loc.path, recursive=True))
    named, other = [], []
    for i in infos:
        rel = i.path[len(loc.path):].lstrip("/")
        if i.type != pafs.FileType.File or any(part.startswith(("_", ".")) for part in rel.split("/")):
            continue
        (named if i.path.lower().endswith(PARQUET_SUFFIXES) else other).append(i.path)
    if other:
        sample = ", ".join(_name(loc, p) for p in sorted(other)[:3])
        raise JobInputError(f"input {loc.uri} holds {len(other)} file(s) not named *.parquet, *.parq or *.pq (e.g. "
                            f"{sample}); the job reads only those (any case) of an input folder, skipping names that "
                            "start with _ or . : rename parquet files to *.parquet, and move other files out or "
                            "rename them to start with _")
    return sorted(named)


def file_suffixes(files: list[str]) -> list[str]:
    """The suffixes (lower case, no dot) of `files`, for a reader that picks files by suffix (Ray Data's
    read_parquet): every listed file is read. Refuses a file without one (only a single file given by name can be)."""
    out = set()
    for path in files:
        name = path.rsplit("/", 1)[-1]
        if "." not in name.lstrip("."):
            raise JobInputError(f"input file {name} has no file suffix; name it *.parquet")
        out.add(name.rsplit(".", 1)[-1].lower())
    return sorted(out)


def input_fingerprints(loc: Location, files: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """What each input file is now, to tell on a resume whether the input changed: {name: fingerprint} (name relative
    to `loc`; `file_fingerprint`). `files`: the input's parquet files (default: `parquet_files(loc)`; a single file
    such as a Kinetics CSV is itself)."""
    paths = files if files is not None else (parquet_files(loc) or [loc.path])
    with ThreadPoolExecutor(max_workers=8) as pool:
        records = list(pool.map(lambda p: file_fingerprint(loc, p), paths))
    return {input_name(loc, p): rec for p, rec in zip(paths, records) if rec is not None}


def file_fingerprint(loc: Location, path: str) -> dict[str, Any] | None:
    """One input file's size, modification time and content identity (None if it is not a file): on S3 its ETag,
    plus `md5` where the ETag is one (a single-part upload); elsewhere an md5 of its bytes (cheap next to decoding
    them; catches a file replaced with the same size and mtime), plus a sha256 where the store gives no mtime."""
    info = loc.fs.get_file_info(path)
    if info.type != pafs.FileType.File:
        return None
    rec: dict[str, Any] = {"size": info.size}
    if info.mtime_ns is not None:
        rec["mtime"] = datetime.fromtimestamp(info.mtime_ns / 1e9, timezone.utc).isoformat(timespec="microseconds")
    etag = _etag(loc.fs, path) if loc.is_s3 else None
    if etag:
        rec["etag"] = etag
        if re.fullmatch(r"[0-9a-f]{32}", etag):
            rec["md5"] = etag
        return rec
    rec.update(_content_hashes(loc.fs, path, sha256=info.mtime_ns is None))
    return rec


def _etag(fs: pafs.FileSystem, path: str) -> str | None:
    """An S3 object's ETag, unquoted (one HEAD request); None where the store gives none."""
    with fs.open_input_file(path) as f:
        raw = f.metadata().get("ETag")
    return raw.decode().strip('"').lower() if raw else None


def _content_hashes(fs: pafs.FileSystem, path: str, sha256: bool = False) -> dict[str, str]:
    """md5 (and with `sha256`, sha256) of a file's bytes, read in one pass."""
    digests = {"md5": hashlib.md5(usedforsecurity=False)}
    if sha256:
        digests["sha256"] = hashlib.sha256()
    with fs.open_input_stream(path) as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            for d in digests.values():
                d.update(chunk)
    return {k: d.hexdigest() for k, d in digests.items()}


def input_name(loc: Location, path: str) -> str:
    """An input file's name as fingerprints record it: relative to the input folder (a single file: its name)."""
    return path[len(loc.path):].lstrip("/") or path.rsplit("/", 1)[-1]


CONTENT_KEYS = ("md5", "sha256", "etag")  # a file's content identity, in the order compared


def fingerprint_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The fields on which two fingerprints of one file differ: its size, then the content hashes both carry (they
    decide, whatever the mtimes: a copy or a `touch` is no change), else its modification time. Fields only one
    carries (a marker of an earlier version has no hashes) are not compared."""
    hashes = [k for k in CONTENT_KEYS if k in a and k in b]
    if "md5" in hashes and "etag" in hashes:  # an ETag that is an md5 is recorded as `md5` too: say it once
        hashes.remove("etag")
    return [k for k in ["size", *(hashes or ["mtime"])] if k in a and k in b and a[k] != b[k]]


def changed_names(old: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]]) -> list[str]:
    """Names of the input files that are new, gone or changed since `old` was recorded (sorted)."""
    return [n for n in sorted(set(old) | set(new))
            if n not in old or n not in new or fingerprint_diff(old[n], new[n])]


def fingerprint_changes(old: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]]) -> list[str]:
    """One line per input file that is new, gone or changed since `old` was recorded (empty: the same input)."""
    out = []
    for name in changed_names(old, new):
        a, b = old.get(name), new.get(name)
        if a is None:
            out.append(f"{name}: new")
        elif b is None:
            out.append(f"{name}: gone")
        else:
            out.append(f"{name}: " + ", ".join(f"{k} {a[k]} -> {b[k]}" for k in fingerprint_diff(a, b)))
    return out


def canonical_uri(uri: str) -> str:
    """One spelling per input: s3://bucket/key without empty segments or a trailing slash; a local path or file://
    URI as an absolute, normalised path (relative to the current directory)."""
    if uri.startswith("s3://"):
        return "s3://" + "/".join(p for p in uri[len("s3://"):].split("/") if p)
    path = uri[len("file://"):] if uri.startswith("file://") else uri
    return os.path.abspath(os.path.expanduser(path))


def same_input(old_uri: str | None, old: dict[str, dict[str, Any]] | None, uri: str,
               new: dict[str, dict[str, Any]] | None, copy_changed: bool = False) -> bool:
    """Whether an input read as `uri` (files `new`) is the one recorded as `old_uri` (files `old`): the same URI in
    any spelling, or files with the same names and fingerprints elsewhere (a copy, an S3 input and its local copy).
    With `copy_changed` (--redecode-changed) a copy some of whose files changed counts too, if at least half of the
    recorded files are in it unchanged: a shared file name alone (two datasets' `train.parquet`) is not enough, or
    the rows of another dataset's answers would be dropped as gone."""
    if old_uri is not None and canonical_uri(old_uri) == canonical_uri(uri):
        return True
    if not old or not new:
        return False
    changed = changed_names(old, new)
    if not changed:
        return True
    unchanged = (set(old) & set(new)) - set(changed)
    return copy_changed and bool(unchanged) and 2 * len(unchanged) >= len(old)


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
    and unique. Errors name the file. A string id that is not UTF-8 comes back as the output writes it
    (`escape_invalid_utf8`), so that resumes compare like with like."""
    files = parquet_files(loc)
    if not files:
        raise JobInputError(f"no parquet files at {loc.uri}; give a parquet file or a directory of them")
    file_suffixes(files)  # the reader must be able to pick each one

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
            ids = pq.read_table(path, columns=["id"], filesystem=loc.fs).column("id").combine_chunks()
            return escape_invalid_utf8(ids)[0]  # as the output writes them: a non-UTF-8 id is that row's error
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


def escape_invalid_utf8(values: pa.Array | pa.ChunkedArray) -> tuple[pa.Array | pa.ChunkedArray, list[int]]:
    """A string column with each value that is not valid UTF-8 made readable (invalid bytes as \\xNN escapes, the
    rest of the value as is), and those values' row indices; any other column unchanged. So one binary value fails
    its own row (and keeps a readable id), never the whole column."""
    if isinstance(values, pa.ChunkedArray):
        chunks, bad, start = [], [], 0
        for chunk in values.chunks:
            fixed, rows = escape_invalid_utf8(chunk)
            chunks.append(fixed)
            bad += [start + r for r in rows]
            start += len(chunk)
        return pa.chunked_array(chunks, type=values.type), bad
    t = values.type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
        return values, []
    try:
        values.validate(full=True)
        return values, []
    except pa.ArrowInvalid:
        pass
    raw = values.cast(pa.large_binary() if pa.types.is_large_string(t) else pa.binary()).to_pylist()
    bad = [i for i, v in enumerate(raw) if v is not None and not _is_utf8(v)]
    text = [v.decode("utf-8", "backslashreplace") if v is not None else None for v in raw]
    return pa.array(text, type=t), bad


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


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
