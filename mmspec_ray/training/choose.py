"""`--method auto`: which drafter method to train for a data set, from what the rows hold (video, images, text
only), whether answers are sampled, and whether the run is on Ray Train, by the project's own measurements (toy-m
on a 2-core CPU, docs/benchmarks.md): HiViS fastest at temperature 0 on images and long answers (1.76x pooled,
2.20x long), MSD on video captions (1.13x, where HiViS gave 0.94x), ViSpec at temperature 1 (1.57x), EAGLE-2 the
fastest of the methods Ray Train takes (1.30x) and the one for text-only data."""

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
    """Counts of video, image and text-only rows in a request parquet (local or s3://), from the media columns'
    null counts (reads those columns only)."""
    from mmspec_ray.batch.storage import locate, parquet_files

    loc = locate(uri, s3 or S3Config.from_env())
    rows = video = image = text = 0
    for f in parquet_files(loc):
        pf = pq.ParquetFile(f, filesystem=loc.fs)
        names = set(pf.schema_arrow.names)
        cols = [c for c in VIDEO + IMAGE if c in names]
        table = pf.read(columns=cols) if cols else None
        n = pf.metadata.num_rows
        has_video = has_image = None
        for c in cols:
            valid = table.column(c).is_valid()
            if c in VIDEO:
                has_video = valid if has_video is None else has_video.to_numpy() | valid.to_numpy()
            else:
                has_image = valid if has_image is None else has_image.to_numpy() | valid.to_numpy()
        v = _as_bool(has_video, n)
        i = _as_bool(has_image, n) & ~v
        rows += n
        video += int(v.sum())
        image += int(i.sum())
        text += int((~v & ~i).sum())
    return DataMix(rows, video, image, text)


def _as_bool(mask, n: int):
    import numpy as np

    if mask is None:
        return np.zeros(n, dtype=bool)
    return np.asarray(mask.to_numpy(zero_copy_only=False) if hasattr(mask, "to_numpy") else mask, dtype=bool)


def choose_method(mix: DataMix, sampled: bool, ray_train: bool) -> tuple[str, str]:
    """(method, why) for data of this mix; `sampled`: the answers will be sampled (temperature > 0);
    `ray_train`: the run uses Ray Train, which takes only methods that do not read the target while training."""
    from mmspec_ray.training.methods import training_method

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
    if ray_train and training_method(method).reads_target:
        why += f"; {method} needs the target while training, which Ray Train workers do not load, so eagle2, the " \
               "fastest method Ray Train takes (1.30x; toy-m)"
        method = "eagle2"
    return method, f"{facts}; {why}"
