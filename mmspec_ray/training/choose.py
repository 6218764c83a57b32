"""`--method auto`: which drafter method to train for a data set, from what the rows hold (video, images, text
only) and whether answers are sampled, by the project's own measurements (toy-m on a 2-core CPU,
docs/benchmarks.md): HiViS fastest at temperature 0 on images and long answers (1.76x pooled, 2.20x long), MSD on
video captions (1.13x, where HiViS gave 0.94x), ViSpec at temperature 1 (1.57x), EAGLE-2 for text-only data. Every
method trains on both trainers (single-process and Ray Train)."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow.parquet as pq

from mmspec_ray.config import S3Config

VIDEO = ("video", "video_uri")
IMAGE = ("image", "image_uri")


@dataclass(frozen=True)
class DataMix:
    rows: int
    video: int  # rows with a clip
    image: int  # rows with an image and no clip
    text: int  # rows with neither


def data_mix(uri: str, s3: S3Config | None = None) -> DataMix:
    """Counts of video, image and text-only rows in a request parquet (local or s3://). The URI columns are read
    (small); the inline media columns' nulls come from the row groups' statistics, so no media bytes are loaded
    (where only statistics are known, a row with both an inline image and a clip may count as an image too)."""
    import numpy as np

    from mmspec_ray.batch.storage import locate, parquet_files

    loc = locate(uri, s3 or S3Config.from_env())
    rows = video = image = 0
    for f in parquet_files(loc):
        pf = pq.ParquetFile(f, filesystem=loc.fs)
        names = pf.schema_arrow.names
        n = pf.metadata.num_rows
        masks: dict[str, np.ndarray | int] = {}
        for col in [c for c in VIDEO + IMAGE if c in names]:
            nulls = _null_count(pf, names.index(col)) if col in ("image", "video") else None
            if nulls is not None:
                masks[col] = n - nulls
            else:
                masks[col] = np.asarray(pf.read(columns=[col]).column(col).is_valid().to_numpy(zero_copy_only=False),
                                        dtype=bool)
        v = _union([m for c, m in masks.items() if c in VIDEO], n)
        i = _union([m for c, m in masks.items() if c in IMAGE], n)
        v_rows = int(v.sum()) if isinstance(v, np.ndarray) else v
        i_rows = int((i & ~v).sum()) if isinstance(i, np.ndarray) and isinstance(v, np.ndarray) else \
            max(0, min(n - v_rows, int(i.sum()) if isinstance(i, np.ndarray) else i))
        rows, video, image = rows + n, video + v_rows, image + i_rows
    return DataMix(rows, video, image, rows - video - image)


def _null_count(pf: pq.ParquetFile, col: int) -> int | None:
    """Nulls of column `col` over every row group, from the statistics; None where a row group has none."""
    total = 0
    for g in range(pf.metadata.num_row_groups):
        stats = pf.metadata.row_group(g).column(col).statistics
        if stats is None or not stats.has_null_count:
            return None
        total += stats.null_count
    return total


def _union(masks: list, n: int):
    """Rows with any of the given columns set: a bool array when every mask is one, else a row count."""
    import numpy as np

    if not masks:
        return np.zeros(n, dtype=bool)
    if all(isinstance(m, np.ndarray) for m in masks):
        return np.logical_or.reduce(masks)
    return max(int(m.sum()) if isinstance(m, np.ndarray) else m for m in masks)


def choose_method(mix: DataMix, sampled: bool) -> tuple[str, str]:
    """(method, why) for data of this mix; `sampled`: the answers will be sampled (temperature > 0)."""
    share = (lambda k: k / mix.rows if mix.rows else 0.0)
    facts = f"{mix.rows} rows: {share(mix.video):.0%} video, {share(mix.image):.0%} image, {share(mix.text):.0%} text"
    if share(mix.text) >= 0.5:
        method, why = "eagle2", "mostly text-only rows: the media-aware drafters have little to use"
    elif share(mix.video) >= 0.5:
        method, why = "msd", "mostly video: MSD measured fastest on video captions (1.13x, HiViS 0.94x; toy-m)"
    elif sampled:
        method, why = "vispec", "sampled answers: ViSpec measured fastest at temperature 1 (1.57x; toy-m)"
    else:
        method, why = "hivis", "images at temperature 0: HiViS measured fastest (1.76x pooled, 2.20x on long answers; " \
                               "toy-m)"
    return method, f"{facts}; {why}"
