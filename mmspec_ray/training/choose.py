"""`--method auto`: the one rule for which drafter method to train (`choose_method`), from the target's depth, what
the request rows hold (video, images, text only) and whether answers are sampled, by the project's own measurements
(toy worlds on a 2-core CPU, docs/benchmarks.md and docs/drafters.md; docs/training.md, "Which method", states it).
The rule never picks a method the data cannot train: HiViS and MSD need text-only rows, every network method needs
rows with media."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow.parquet as pq

from mmspec_ray.config import S3Config

if TYPE_CHECKING:
    from mmspec_ray.targets.layout import CheckpointLayout

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


def decoder_layers(layout: "CheckpointLayout") -> int | None:
    """The language model's decoder layers, from the checkpoint's config (None where it does not say): how much a
    drafter step costs against a target forward."""
    full = layout.full_config()
    layers = (full.get("text_config") or full).get("num_hidden_layers")
    return int(layers) if isinstance(layers, int) and layers > 0 else None


# At most this many decoder layers: a drafter step (one decoder layer of the target's width) costs about 1 / layers
# of a target forward, too much for a network drafter to repay. Measured at 4 layers (toy-s: a trained EAGLE-2 at AR
# speed, suffix 1.74x) and 24 (toy-m: trained drafters ahead); the line between is this rule's.
SHALLOW_LAYERS = 8
# At least this share of text-only rows for the methods that train on them (HiViS mixes them into every epoch, MSD's
# first stage is text only). Measured with none (HiViS below EAGLE-2) and with half the rows (HiViS ahead); the line
# between is this rule's.
MIN_TEXT_SHARE = 0.2


def choose_method(mix: DataMix, sampled: bool, layers: int | None = None) -> tuple[str, str]:
    """(method, why) for data of this mix; `sampled`: answers sampled (temperature > 0); `layers`: the target's
    decoder layers (None: unknown). First match wins: a shallow target or no rows with media -> suffix; too few
    text-only rows -> eagle2 (greedy) or suffix (sampled); mostly video -> msd; otherwise hivis."""
    share = (lambda k: k / mix.rows if mix.rows else 0.0)
    facts = f"{mix.rows} rows: {share(mix.video):.0%} video, {share(mix.image):.0%} image, {share(mix.text):.0%} text"
    method, why = _rule(mix, sampled, layers, share(mix.video), share(mix.text))
    return method, f"{facts}; {why}"


def _rule(mix: DataMix, sampled: bool, layers: int | None, video: float, text: float) -> tuple[str, str]:
    """`choose_method`'s rule on the shares, as (method, the measured reason)."""
    if layers is not None and layers <= SHALLOW_LAYERS:
        return "suffix", (f"a {layers}-layer target: a drafter layer costs about 1/{layers} of a target forward, too "
                          "much to repay (toy-s, 4 layers: a trained EAGLE-2 at AR speed, suffix well ahead; "
                          "docs/benchmarks.md); suffix drafts without a model and trains nothing")
    if not mix.video + mix.image:
        return "suffix", ("no rows with media: the network methods train on image and video rows (eagle2 leaves "
                          "text-only rows out); suffix builds its corpus from every answer and trains nothing")
    if text < MIN_TEXT_SHARE:
        if sampled:
            return "suffix", ("too few text-only rows for hivis or msd, and sampled answers: suffix measured ahead of "
                              "eagle2 at T = 1 (toy-m; docs/benchmarks.md) and trains nothing")
        return "eagle2", ("too few text-only rows for hivis or msd (HiViS without them measured below EAGLE-2: "
                          "lower held-out τ; toy-m): eagle2 measured fastest of the rest at T = 0 (toy-m; "
                          "docs/benchmarks.md)")
    if video >= 0.5:
        return "msd", ("mostly video, with text-only rows for its first stage: MSD measured fastest on short video "
                       "captions at T = 0 (toy-m; docs/benchmarks.md)")
    return "hivis", ("images or video with text-only rows to mix in: HiViS measured the fastest trained drafter at "
                     "T = 0 and 1 (toy-m; docs/benchmarks.md)")
