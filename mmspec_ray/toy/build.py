"""`mmspec toy build`: generate the toy data set, train the tokenizer and the toy target, save all with save_pretrained.

Deterministic by seed and idempotent: a finished build leaves a stamp under $MMSPEC_HOME/toy/<name>/ and is reused.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import LlavaForConditionalGeneration

from mmspec_ray.config import mmspec_home  # noqa: F401 (also imported from here)
from mmspec_ray.toy.grow import grow_llava
from mmspec_ray.toy.clips import Clip, sample_clip
from mmspec_ray.toy.media_jobs import encode_media, load_pixels, parallel_map
from mmspec_ray.toy.model import TOY_SIZES, ToySize, build_model, build_processor, tokens_per_image
from mmspec_ray.toy.scenes import Scene, sample_scene
from mmspec_ray.toy.text import clip_examples, scene_examples
from mmspec_ray.toy.tokenizer import IMAGE, train_tokenizer
from mmspec_ray.toy.vocab import ACTIONS, COLOURS, SHAPES, SIZES
from mmspec_ray.toy.train import ClipLabels, make_items, pack_items, pretrain_vision, train_target

log = logging.getLogger(__name__)
SPLITS = ("train", "validation", "test")
BUILD_VERSION = 5  # bump when the data or model recipe changes, to invalidate caches


@dataclass(frozen=True)
class ToyWorld:
    """Paths of a built toy world."""

    root: Path

    @property
    def target(self) -> Path:
        return self.root / "target"

    @property
    def data(self) -> Path:
        return self.root / "data"

    def examples(self, split: str) -> Path:
        return self.data / f"{split}.parquet"

    def kinetics_csv(self, split: str) -> Path:
        return self.data / f"kinetics_{split}.csv"

    @property
    def clips(self) -> Path:
        return self.data / "clips"

    def manifest(self) -> dict:
        return json.loads((self.root / "manifest.json").read_text())


def world_dir(name: str, seed: int, home: Path | None = None) -> Path:
    """Cache folder of a toy world; a grown world's name carries its growth shape (a new shape is a new world)."""
    size = TOY_SIZES.get(name)
    grown = f"-w{size.grow_width}d{size.grow_depth}" if size is not None and size.grown_from else ""
    return (home or mmspec_home()) / "toy" / f"{name}-seed{seed}-v{BUILD_VERSION}{grown}"


def build_toy(name: str = "toy-s", seed: int = 0, home: Path | None = None, force: bool = False) -> ToyWorld:
    """Build (or reuse) the toy world `name`. Returns its paths."""
    if name not in TOY_SIZES:
        raise ValueError(f"unknown toy size {name!r}; choose one of {sorted(TOY_SIZES)}")
    size = TOY_SIZES[name]
    if size.grown_from:
        small = build_toy(size.grown_from, seed, home)
        return grow_world(size, small, seed, world_dir(name, seed, home), force)
    return build_world(size, seed, world_dir(name, seed, home), force)


def grow_world(size: ToySize, small: ToyWorld, seed: int, root: Path, force: bool = False) -> ToyWorld:
    """A toy world whose target is `small`'s target grown by toy.grow (same data, tokenizer and processor)."""
    world = ToyWorld(root)
    if (root / ".complete").exists() and not force:
        log.info("toy world %s already built at %s", size.name, root)
        return world
    if root.exists():
        shutil.rmtree(root)
    tmp = root.with_name(root.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    t0 = time.time()
    shutil.copytree(small.data, tmp / "data")
    model = LlavaForConditionalGeneration.from_pretrained(small.target).eval()
    big = grow_llava(model, size.grow_width, size.grow_depth, seed=seed)
    big.save_pretrained(tmp / "target")
    for f in small.target.iterdir():  # processor, tokenizer, chat template, mmspec_toy.json
        if not (tmp / "target" / f.name).exists():
            shutil.copy2(f, tmp / "target" / f.name)
    manifest = {"name": size.name, "seed": seed, "build_version": BUILD_VERSION, "size": asdict(size),
                "grown_from": str(small.root), "timings": {"total_s": time.time() - t0},
                "params": sum(p.numel() for p in big.parameters()), "torch": torch.__version__}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
    (tmp / ".complete").write_text("ok\n")
    tmp.rename(root)
    log.info("grew %s from %s in %.0f s at %s", size.name, small.root.name, manifest["timings"]["total_s"], root)
    return world


def build_world(size: ToySize, seed: int, root: Path, force: bool = False) -> ToyWorld:
    """Build a toy world of any size into `root` (atomically: staged in a .partial folder, then renamed)."""
    name = size.name
    world = ToyWorld(root)
    if (root / ".complete").exists() and not force:
        log.info("toy world %s already built at %s", name, root)
        return world
    if root.exists():
        shutil.rmtree(root)
    tmp = root.with_name(root.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    t0 = time.time()
    timings: dict[str, float] = {}
    staged = ToyWorld(tmp)
    rng = np.random.default_rng(seed)
    scenes, clips = sample_splits(size, rng)
    write_data(staged, scenes, clips, seed, size.train_questions, size.image_size)
    timings["data_s"] = time.time() - t0
    t1 = time.time()
    tokenizer = train_tokenizer(corpus(staged))
    processor = build_processor(size, tokenizer)
    torch.manual_seed(seed)
    model = build_model(size, tokenizer)
    items, pixels, cell_labels, scene_rows, clip_labels = training_items(staged, size, processor)
    timings["prepare_s"] = time.time() - t1
    t2 = time.time()
    vision_acc = pretrain_vision(model, pixels[scene_rows], cell_labels, steps=size.vision_steps,
                                 batch_size=128, lr=size.lr, seed=seed, clips=clip_labels,
                                 clip_batch=size.vision_clip_batch, clip_hidden=size.vision_clip_hidden,
                                 weights=size.vision_loss_weights)
    timings["vision_s"] = time.time() - t2
    t3 = time.time()
    groups = pack_items(items, tokenizer.convert_tokens_to_ids(IMAGE))
    losses = train_target(model, groups, pixels, epochs=size.epochs, video_epochs=size.video_epochs,
                          batch_size=size.batch_size, lr=size.lr, seed=seed, pad_id=tokenizer.pad_token_id)
    timings["train_s"] = time.time() - t3
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(staged.target)
    processor.save_pretrained(staged.target)
    (staged.target / "mmspec_toy.json").write_text(json.dumps({"video_frames": size.video_frames}))
    timings["total_s"] = time.time() - t0
    manifest = {
        "name": name, "seed": seed, "build_version": BUILD_VERSION, "size": asdict(size), "timings": timings,
        "train_examples": len(items), "vision_pretrain_cell_acc": vision_acc, "train_steps": len(losses), "final_loss": float(np.mean(losses[-20:])),
        "params": sum(p.numel() for p in model.parameters()), "torch": torch.__version__,
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
    (tmp / ".complete").write_text("ok\n")
    tmp.rename(root)
    log.info("built %s in %.0f s at %s", name, timings["total_s"], root)
    return world


def sample_splits(size: ToySize, rng: np.random.Generator) -> tuple[dict[str, list[Scene]], dict[str, list[Clip]]]:
    """Draw scenes and clips for every split; no scene or clip content is shared between splits."""
    want_s = {"train": size.train_scenes, "validation": size.eval_scenes, "test": size.eval_scenes}
    want_c = {"train": size.train_clips, "validation": size.eval_clips, "test": size.eval_clips}
    seen: set = set()
    scenes: dict[str, list[Scene]] = {}
    clips: dict[str, list[Clip]] = {}
    for split in SPLITS:
        scenes[split] = _unique(lambda: sample_scene(rng), want_s[split], seen)
        clips[split] = _unique(lambda: sample_clip(rng), want_c[split], seen)
    return scenes, clips


def _unique(draw, n: int, seen: set) -> list:
    out = []
    while len(out) < n:
        x = draw()
        if x.key() not in seen:
            seen.add(x.key())
            out.append(x)
    return out


def write_data(world: ToyWorld, scenes: dict[str, list[Scene]], clips: dict[str, list[Clip]], seed: int,
               train_questions: int = 2, image_size: int = 96) -> None:
    """Images as PNG/JPEG, clips as mp4, examples as parquet, clip annotations as a Kinetics-style CSV.

    `train_questions`: questions / instructions per train scene (held-out splits always get 2);
    `image_size`: rendered side in pixels (the target's input size, so nothing is lost to resampling).
    The text is drawn in order from one rng per split; rendering + encoding runs in two worker processes."""
    jobs: list[tuple[Scene | Clip, str, int]] = []
    paths: list[Path] = []
    tables: dict[str, tuple[list[dict], list[str]]] = {}
    for split in SPLITS:
        rng = np.random.default_rng([seed, SPLITS.index(split)])
        rows: list[dict] = []
        (world.data / "images" / split).mkdir(parents=True, exist_ok=True)
        (world.clips / split).mkdir(parents=True, exist_ok=True)
        for i, sc in enumerate(scenes[split]):
            fmt = "JPEG" if rng.random() < 0.3 else "PNG"
            rel = f"images/{split}/scene{i:05d}.{'jpg' if fmt == 'JPEG' else 'png'}"
            jobs.append((sc, fmt, image_size))
            paths.append(world.data / rel)
            meta = json.dumps({"objects": [asdict(o) for o in sc.objects], "background": sc.background,
                               "tone": sc.tone})
            for j, ex in enumerate(scene_examples(sc, rng, train_questions if split == "train" else 2)):
                rows.append({"id": f"{split}-s{i:05d}-{j}", "media_type": "image", "media_path": rel,
                             "task": ex.task, "prompt": ex.prompt, "answer": ex.answer, "meta": meta})
        csv = ["label,youtube_id,time_start,time_end,split"]
        for i, cl in enumerate(clips[split]):
            rel = f"clips/{split}/{cl.filename}"
            jobs.append((cl, "mp4", image_size))
            paths.append(world.data / rel)
            csv.append(f'"{cl.action}",{cl.youtube_id},{cl.time_start},{cl.time_end},{split}')
            meta = json.dumps(asdict(cl))
            for j, ex in enumerate(clip_examples(cl, rng)):
                rows.append({"id": f"{split}-c{i:05d}-{j}", "media_type": "video", "media_path": rel,
                             "task": ex.task, "prompt": ex.prompt, "answer": ex.answer, "meta": meta})
        tables[split] = rows, csv
    for path, data in zip(paths, parallel_map(encode_media, jobs, "render scenes and clips", "file")):
        path.write_bytes(data)
    for split, (rows, csv) in tables.items():
        pq.write_table(pa.Table.from_pylist(rows), world.examples(split))
        world.kinetics_csv(split).write_text("\n".join(csv) + "\n")


def corpus(world: ToyWorld) -> list[str]:
    """Text the tokenizer is trained on: every train prompt and answer, and the chat roles."""
    t = pq.read_table(world.examples("train"), columns=["prompt", "answer"]).to_pydict()
    return ["user\nassistant\nsystem\n"] * 50 + t["prompt"] + t["answer"]


def training_items(world: ToyWorld, size: ToySize, processor):
    """Tokenise the train split and preprocess each distinct image/clip once into a shared pixel bank.

    Also returns, for vision pretraining, per-cell labels [num_scenes, patches, 3] (colour, shape, size; 0 = empty)
    for the scene images, their rows in the pixel bank, and each clip's frame rows and action.
    """
    t = pq.read_table(world.examples("train")).to_pylist()
    firsts: dict[str, dict] = {}  # each distinct media's first row, in order
    for r in t:
        firsts.setdefault(r["media_path"], r)
    first = list(firsts.values())
    # Decoded and preprocessed by the processor in the workers (stacked there, as its return_tensors="pt" copies
    # array by array, 2x slower); the same values as preprocessing all frames here in one call.
    decoded = parallel_map(partial(load_pixels, processor.image_processor),
                           [(str(world.data / r["media_path"]), r["media_type"], size.video_frames) for r in first],
                           "decode media", "file")
    bank: dict[str, list[int]] = {}
    n = 0
    labels: list[torch.Tensor] = []
    scene_rows: list[int] = []
    clip_rows: list[list[int]] = []
    actions: list[int] = []
    for row, px in zip(first, decoded):
        bank[row["media_path"]] = list(range(n, n + len(px)))
        if row["media_type"] == "image":
            scene_rows.append(n)
            labels.append(cell_labels(json.loads(row["meta"])["objects"], size))
        else:
            clip_rows.append(bank[row["media_path"]])
            actions.append(ACTIONS.index(json.loads(row["meta"])["action"]))
        n += len(px)
    # Channels-last in memory, the layout of the processor's own arrays (CHW views of HWC images) that v5's weights
    # were trained on: the convolutions round differently in the other layout, which changes every weight.
    pixels = torch.from_numpy(np.concatenate(decoded)).contiguous(memory_format=torch.channels_last)
    items = make_items(processor, tokens_per_image(size), [
        (r["prompt"], r["answer"], tuple(bank[r["media_path"]]), r["media_type"] == "video") for r in t])
    clips = ClipLabels(pixels, torch.tensor(clip_rows), torch.tensor(actions))
    return items, pixels, torch.stack(labels), torch.tensor(scene_rows), clips


def cell_labels(objects: list[dict], size: ToySize) -> torch.Tensor:
    """[patches, 3] class ids of the object covering each patch (colour, shape, size; 0 = nothing there)."""
    side = size.image_size // size.patch_size
    per_cell = side // 3  # patches along one grid cell
    lab = torch.zeros(side * side, 3, dtype=torch.long)
    colours, sizes = list(COLOURS), list(SIZES)
    for o in objects:
        row, col = divmod(o["cell"], 3)
        for pr in range(row * per_cell, (row + 1) * per_cell):
            for pc in range(col * per_cell, (col + 1) * per_cell):
                lab[pr * side + pc] = torch.tensor([colours.index(o["colour"]) + 1, SHAPES.index(o["shape"]) + 1,
                                                    sizes.index(o["size"]) + 1])
    return lab
