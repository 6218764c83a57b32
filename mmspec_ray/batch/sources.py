"""Input adapters that turn other layouts into pipeline rows (`id`, `prompt`, `image_uri` / `video_uri` ...).

- A Kinetics annotation CSV (`label,youtube_id,time_start,time_end,split`, the test split has no label) plus a clip
  root holding `<youtube_id>_<time_start:06d>_<time_end:06d>.mp4` (local or s3://).
- The embedded toy world's example parquet (`media_type`, `media_path` relative to the world's data folder).
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from mmspec_ray.batch.storage import JobInputError, locate
from mmspec_ray.config import S3Config

KINETICS_COLUMNS = ("label", "youtube_id", "time_start", "time_end", "split")


def clip_name(youtube_id: str, time_start: int, time_end: int) -> str:
    """The Kinetics clip file name convention."""
    return f"{youtube_id}_{int(time_start):06d}_{int(time_end):06d}.mp4"


def kinetics_rows(csv_uri: str, clip_root: str, prompt: str, s3: S3Config | None = None) -> pa.Table:
    """One row per annotation: the CSV's columns plus `id` (the clip's file stem), `video_uri` and `prompt`."""
    s3 = s3 or S3Config.from_env()
    loc = locate(csv_uri, s3)
    # Read as text, then convert the time columns one by one: a bad value is reported by column name and row
    # (pyarrow's own conversion error gives only the column's index), and an empty one is an error, not a null.
    opts = pacsv.ConvertOptions(column_types={c: pa.string() for c in KINETICS_COLUMNS})
    try:
        with loc.fs.open_input_stream(loc.path) as f:
            t = pacsv.read_csv(f, convert_options=opts)
    except (pa.ArrowException, OSError) as e:
        raise JobInputError(f"annotation CSV {csv_uri}: {' '.join(str(e).split())}") from e
    missing = [c for c in ("youtube_id", "time_start", "time_end") if c not in t.column_names]
    if missing:
        raise JobInputError(f"{csv_uri} is not a Kinetics annotation CSV: missing column(s) {missing} "
                         f"(expected {','.join(KINETICS_COLUMNS)})")
    for name in ("time_start", "time_end"):
        t = t.set_column(t.column_names.index(name), name, _seconds(t.column(name), name, csv_uri))
    for row, (start, end) in enumerate(zip(t.column("time_start").to_pylist(), t.column("time_end").to_pylist()), 1):
        if start < 0 or end < start:
            raise JobInputError(f"annotation CSV {csv_uri}: row {row} (after the header): time_start {start}, "
                                f"time_end {end}: a clip needs 0 <= time_start <= time_end")
    root = clip_root.rstrip("/") if clip_root.startswith("s3://") else locate(clip_root, s3).path
    names = [clip_name(y, s, e) for y, s, e in zip(t.column("youtube_id").to_pylist(),
                                                   t.column("time_start").to_pylist(),
                                                   t.column("time_end").to_pylist())]
    ids = pa.array([n[: -len(".mp4")] for n in names], type=pa.string())
    uris = pa.array([f"{root}/{n}" for n in names], type=pa.string())
    t = t.add_column(0, "id", ids)
    t = t.append_column("video_uri", uris)
    return t.append_column("prompt", pa.array([prompt] * t.num_rows, type=pa.string()))


def _seconds(column: pa.ChunkedArray, name: str, csv_uri: str) -> pa.ChunkedArray:
    """A CSV text column of whole seconds as int64; the first value that is not one stops the job, naming the file,
    the column and the row."""
    try:
        return pc.cast(pc.utf8_trim_whitespace(column), pa.int64())
    except pa.ArrowInvalid:
        pass
    for row, value in enumerate(column.to_pylist(), start=1):
        try:
            pc.cast(pa.array([(value or "").strip()]), pa.int64())
        except pa.ArrowInvalid:
            raise JobInputError(f"annotation CSV {csv_uri}: column {name!r}, row {row} (after the header): {value!r} "
                                "is not a whole number of seconds") from None
    raise AssertionError("unreachable: the column failed to convert as a whole")


def toy_rows(examples_parquet: str, data_root: str, media_type: str) -> pa.Table:
    """The toy world's examples of one media type as pipeline rows: `image_uri` / `video_uri` absolute paths;
    `id`, `task`, `prompt`, `answer` kept (the reference answer stays next to the model's output)."""
    t = pq.read_table(examples_parquet)
    t = t.filter(pc.equal(t.column("media_type"), media_type))
    col = "image_uri" if media_type == "image" else "video_uri"
    uris = pa.array([f"{data_root.rstrip('/')}/{p}" for p in t.column("media_path").to_pylist()], type=pa.string())
    return t.select(["id", "task", "prompt", "answer"]).append_column(col, uris)
