#!/usr/bin/env python
"""Why small video frames decode and convert on one thread (media/video.py THREADED_VIDEO_PIXELS, toy/clips.py):
times colour conversion (swscale) and decoding on the toy world's 96 px clips, threaded against one thread, checks
that both give the same bytes, and re-encodes clips to compare with the world's files.

    .venv/bin/python experiments/media_thread_costs.py [--clips 200]     # docs/toy.md, "Build time"
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import av
import numpy as np

from mmspec_ray.toy.build import build_toy, sample_splits
from mmspec_ray.toy.clips import render_clip
from mmspec_ray.toy.media_jobs import encode_media
from mmspec_ray.toy.model import TOY_SIZES


def best_ms(fn: Callable, items: list, reps: int = 3) -> float:
    """Fastest of `reps` passes over `items`, in ms per item (the pass least disturbed by other work)."""
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for x in items:
            fn(x)
        out.append((time.perf_counter() - t) / len(items) * 1e3)
    return min(out)


def decoded_frames(path: str, threaded: bool) -> list[av.VideoFrame]:
    with av.open(path) as c:
        s = c.streams.video[0]
        if threaded:
            s.thread_type = "AUTO"
        else:
            s.codec_context.thread_count = 1
        return list(c.decode(s))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clips", type=int, default=200)
    a = p.parse_args()
    world = build_toy("toy-s")
    _, clips = sample_splits(TOY_SIZES["toy-s"], np.random.default_rng(0))
    train = clips["train"][:a.clips]
    paths = [str(world.clips / "train" / c.filename) for c in train]
    images = [f for c in train[:20] for f in render_clip(c, 96)]
    frames = [f for x in paths[:20] for f in decoded_frames(x, False)]

    def to_yuv(t: int) -> Callable:
        return lambda im: av.VideoFrame.from_image(im).reformat(format="yuv420p", threads=t)

    same = all(bytes(x) == bytes(y) for im in images for x, y in zip(to_yuv(0)(im).planes, to_yuv(1)(im).planes))
    print(f"RGB -> yuv420p a frame: threaded {best_ms(to_yuv(0), images):.3f} ms, one thread "
          f"{best_ms(to_yuv(1), images):.3f} ms; same bytes: {same} ({len(images)} frames)")
    same = all(f.to_image(threads=0).tobytes() == f.to_image(threads=1).tobytes() for f in frames)
    print(f"yuv420p -> RGB a frame: threaded {best_ms(lambda f: f.to_image(threads=0), frames):.3f} ms, one thread "
          f"{best_ms(lambda f: f.to_image(threads=1), frames):.3f} ms; same bytes: {same} ({len(frames)} frames)")
    same = all([f.to_ndarray().tobytes() for f in decoded_frames(x, True)]
               == [f.to_ndarray().tobytes() for f in decoded_frames(x, False)] for x in paths)
    print(f"decode a clip (all frames, no conversion): threaded {best_ms(lambda x: decoded_frames(x, True), paths):.2f}"
          f" ms, one thread {best_ms(lambda x: decoded_frames(x, False), paths):.2f} ms; same frames: {same} "
          f"({len(paths)} clips)")
    t = time.perf_counter()
    same_files = sum(encode_media((c, "mp4", 96)) == (world.clips / "train" / c.filename).read_bytes() for c in train)
    print(f"encode a clip as the build does: {(time.perf_counter() - t) / len(train) * 1e3:.2f} ms; "
          f"{same_files} of {len(train)} byte-identical to the world's files ({world.root.name})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
