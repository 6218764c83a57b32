"""Toy-world prompts as engine requests (drafter training data, benchmarks, demos)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mmspec_ray.media import load_image, load_video
from mmspec_ray.targets.base import Request
from mmspec_ray.targets.hf import video_frames_for
from mmspec_ray.toy.build import ToyWorld


def toy_rows(world: ToyWorld, split: str, limit: int | None = None, seed: int = 0,
             tasks: tuple[str, ...] | None = None) -> list[dict]:
    """Example rows of a split (id, media_type, media_path, task, prompt, answer), shuffled by seed, optionally
    filtered to some tasks (caption, detail, question, instruction, video_caption, video_detail, ...)."""
    rows = pq.read_table(world.examples(split)).to_pylist()
    if tasks:
        rows = [r for r in rows if r["task"] in tasks]
    order = np.random.default_rng(seed).permutation(len(rows))
    rows = [rows[i] for i in order]
    return rows[:limit] if limit is not None else rows


def toy_request_table(world: ToyWorld, split: str, limit: int | None = None, seed: int = 0,
                      tasks: tuple[str, ...] | None = None) -> pa.Table:
    """The split's prompts as request rows any job reads (id, task, prompt, image_uri / video_uri as absolute
    paths): e.g. the `--data` of `mmspec train-drafter` for a toy target."""
    rows = toy_rows(world, split, limit, seed, tasks)
    media = [str(world.data / r["media_path"]) for r in rows]
    is_image = [r["media_type"] == "image" for r in rows]
    return pa.table({"id": [str(r["id"]) for r in rows], "task": [r["task"] for r in rows],
                     "prompt": [r["prompt"] for r in rows],
                     "image_uri": pa.array([m if i else None for m, i in zip(media, is_image)], pa.string()),
                     "video_uri": pa.array([None if i else m for m, i in zip(media, is_image)], pa.string())})


def row_request(world: ToyWorld, row: dict, num_frames: int | None = None) -> Request:
    """One toy example row -> Request with its decoded image or sampled clip frames."""
    src = str(world.data / row["media_path"])
    if row["media_type"] == "image":
        return Request(prompt=row["prompt"], images=(load_image(src),))
    frames = load_video(src, num_frames or video_frames_for(world.target)).frames
    return Request(prompt=row["prompt"], videos=(tuple(frames),))


def toy_requests(world: ToyWorld, split: str, limit: int | None = None, seed: int = 0,
                 tasks: tuple[str, ...] | None = None) -> Iterator[Request]:
    for row in toy_rows(world, split, limit, seed, tasks):
        yield row_request(world, row)


DESCRIPTION_TASKS = ("detail", "video_detail")


def toy_text_rows(world: ToyWorld, split: str, limit: int | None = None, seed: int = 0) -> list[dict]:
    """A text-only corpus (MSD's stage 1): each scene's or clip's detailed description written into the prompt,
    followed by one of that media item's other prompts, so the question is answerable from the text alone.
    Rows: id, prompt, answer (the reference answer; drafter datagen lets the target answer instead)."""
    rows = pq.read_table(world.examples(split)).to_pylist()
    desc = {r["media_path"]: r["answer"] for r in rows if r["task"] in DESCRIPTION_TASKS}
    noun = {"image": "picture", "video": "video"}
    out = [{"id": f"text-{r['id']}", "answer": r["answer"],
            "prompt": f"Here is a description of a {noun.get(r['media_type'], 'picture')}: "
                      f"{desc[r['media_path']]} {r['prompt']}"}
           for r in rows if r["task"] not in DESCRIPTION_TASKS and r["media_path"] in desc]
    order = np.random.default_rng(seed).permutation(len(out))
    out = [out[i] for i in order]
    return out[:limit] if limit is not None else out


def toy_text_requests(world: ToyWorld, split: str, limit: int | None = None, seed: int = 0) -> Iterator[Request]:
    """Text-only requests (no media) of `toy_text_rows`."""
    for row in toy_text_rows(world, split, limit, seed):
        yield Request(prompt=row["prompt"])


def at_length(row: dict) -> dict:
    """ViSpec's "answer at length" rewrite in the toy world: the row's prompt replaced by its media's detailed-
    description prompt (the toy target's in-distribution way to ask for a long answer; the paper's appended
    "Please answer with at least 1000 words." is out of its vocabulary and shortens or garbles its answers)."""
    import zlib

    from mmspec_ray.toy.text import DETAIL_PROMPTS, VIDEO_DETAIL_PROMPTS

    prompts = DETAIL_PROMPTS if row["media_type"] == "image" else VIDEO_DETAIL_PROMPTS
    pick = zlib.crc32(str(row["id"]).encode()) % len(prompts)  # stable per row, whatever the process
    return {**row, "prompt": prompts[pick]}


def toy_long_requests(world: ToyWorld, split: str, limit: int | None = None, seed: int = 0) -> Iterator[Request]:
    """The same media as `toy_requests(world, split, limit, seed)`, each prompt rewritten by `at_length`."""
    for row in toy_rows(world, split, limit, seed):
        yield row_request(world, at_length(row))
