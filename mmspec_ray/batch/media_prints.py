"""`--fingerprint-media`: what each row's media URIs were when the job ran, so that a resume decodes again the rows
whose media changed behind an unchanged `image_uri` / `video_uri` (the input's own fingerprints cannot see that).

A URI's fingerprint is its ETag on S3 (size + modification time where the store gives none) and size +
modification time elsewhere; a row's is those of its URIs in order. They are taken on the driver when a run starts
(threads; one HEAD or stat per URI) and kept in the output as `_mmspec_media.parquet` (id, fingerprint), a file of
the job's own. Taken before decoding, so a change while the run decodes is seen by the next resume at worst."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyarrow import fs as pafs

from mmspec_ray.batch.output import MEDIA_PRINTS_NAME
from mmspec_ray.batch.rows import MEDIA_FIELDS
from mmspec_ray.batch.storage import Location, exists
from mmspec_ray.config import S3Config
from mmspec_ray.media.io import filesystem_for

URI_FIELDS = tuple(f for f in MEDIA_FIELDS if f.endswith("_uri"))
THREADS = 16


def uri_print(uri: str, s3: S3Config) -> str:
    """One media URI as it is now: `etag:<etag>`, `stat:<size>:<mtime ns>`, or `missing`."""
    try:
        filesystem, path = filesystem_for(uri, s3)
        info = filesystem.get_file_info(path)
        if info.type != pafs.FileType.File:
            return "missing"
        if uri.startswith("s3://"):
            with filesystem.open_input_file(path) as f:
                etag = f.metadata().get("ETag")
            if etag:
                return f"etag:{etag.decode().strip(chr(34)).lower()}"
        return f"stat:{info.size}:{info.mtime_ns}"
    except (OSError, ValueError) as e:
        return f"unreadable:{type(e).__name__}"


def row_uris(row: dict[str, Any]) -> list[str]:
    """A row's media URIs in column order (a list cell contributes each of its strings)."""
    out: list[str] = []
    for field in URI_FIELDS:
        value = row.get(field)
        items = value if isinstance(value, (list, tuple)) else [value]
        out += [v for v in items if isinstance(v, str) and v]
    return out


def media_prints(rows: pa.Table, s3: S3Config) -> pa.Table:
    """(id, fingerprint) for every row of `rows` (ids and URI columns) that names media by URI."""
    fields = [f for f in URI_FIELDS if f in rows.column_names]
    if not fields:
        return pa.table({"id": pa.array([], rows.schema.field("id").type), "fingerprint": pa.array([], pa.string())})
    listed = rows.select(["id", *fields]).to_pylist()
    uris = sorted({u for r in listed for u in row_uris(r)})
    with ThreadPoolExecutor(max_workers=THREADS) as pool:
        now = dict(zip(uris, pool.map(lambda u: uri_print(u, s3), uris)))
    keep = [(r["id"], "|".join(f"{u}={now[u]}" for u in row_uris(r))) for r in listed if row_uris(r)]
    digest = [hashlib.sha256(p.encode()).hexdigest()[:32] for _, p in keep]
    return pa.table({"id": pa.array([k for k, _ in keep], rows.schema.field("id").type),
                     "fingerprint": pa.array(digest, pa.string())})


def read_prints(out: Location) -> pa.Table | None:
    """The fingerprints the last run recorded, or None where no run recorded any."""
    loc = out.child(MEDIA_PRINTS_NAME)
    return pq.read_table(loc.path, filesystem=loc.fs) if exists(loc) else None


def write_prints(out: Location, prints: pa.Table) -> None:
    loc = out.child(MEDIA_PRINTS_NAME)
    with loc.fs.open_output_stream(loc.path) as f:
        pq.write_table(prints, f)


def merge_prints(old: pa.Table | None, new: pa.Table) -> pa.Table:
    """`new` plus the recorded fingerprints of ids it does not cover (rows past a run's --limit keep theirs)."""
    if old is None or not old.num_rows:
        return new
    rest = old.filter(pc.invert(pc.is_in(old.column("id"), value_set=new.column("id").cast(old.column("id").type))))
    return pa.concat_tables([new, rest.cast(new.schema)])


def changed_ids(old: pa.Table | None, new: pa.Table, done: pa.Array) -> pa.Array:
    """Ids in `done` (rows already in the output) whose media fingerprint differs from the recorded one, or that
    none was recorded for (decoded before fingerprints were kept): their answers may be stale."""
    mine = new.filter(pc.is_in(new.column("id"), value_set=done.cast(new.column("id").type)))
    if old is None or not old.num_rows:
        return mine.column("id").combine_chunks()
    joined = mine.join(old.rename_columns(["id", "before"]), "id", join_type="left outer")
    stale = pc.or_kleene(pc.is_null(joined.column("before")),
                         pc.not_equal(joined.column("fingerprint"), joined.column("before")))
    return joined.filter(pc.fill_null(stale, True)).column("id").combine_chunks()
