"""Toy-world media work (render + encode, decode) in worker processes: the build's only work that is
single-threaded Python + C, so a second core halves it. Light imports on purpose: spawned workers import this."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

import numpy as np
from PIL import Image
from tqdm.auto import tqdm

from mmspec_ray.media import load_image, load_video
from mmspec_ray.toy.clips import Clip, encode_mp4, render_clip
from mmspec_ray.toy.scenes import Scene, encode_image, render_scene

T = TypeVar("T")
R = TypeVar("R")


def parallel_map(fn: Callable[[T], R], items: list[T], desc: str, unit: str, chunksize: int = 32) -> list[R]:
    """`[fn(x) for x in items]` in up to 2 worker processes, in order, with a progress bar. Spawned, not forked:
    the parent may already run torch's thread pool. `fn` must be a top-level function of a light module."""
    workers = min(2, os.cpu_count() or 1)
    if workers < 2 or len(items) < 4 * chunksize:
        return [fn(x) for x in tqdm(items, desc=desc, unit=unit)]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(tqdm(pool.map(fn, items, chunksize=chunksize), total=len(items), desc=desc, unit=unit))


def encode_media(job: tuple[Scene | Clip, str, int]) -> bytes:
    """(scene, "PNG" | "JPEG", side) -> image file bytes; (clip, "mp4", side) -> mp4 bytes."""
    obj, fmt, side = job
    if fmt == "mp4":
        return encode_mp4(render_clip(obj, side))
    return encode_image(render_scene(obj, side), fmt)


def load_media(job: tuple[str, str, int]) -> list[Image.Image]:
    """(path, "image" | "video", frames) -> the RGB frames: one image, or a clip's `frames` uniform samples."""
    src, media_type, frames = job
    return [load_image(src)] if media_type == "image" else load_video(src, frames).frames


def load_pixels(image_processor, job: tuple[str, str, int]) -> np.ndarray:
    """`load_media`, then the processor's own preprocessing: [frames, 3, H, W] pixel values. In the workers, so the
    preprocessing runs on both cores too (bind the processor with functools.partial)."""
    return np.stack(image_processor(images=load_media(job))["pixel_values"])
