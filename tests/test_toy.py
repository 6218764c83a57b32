"""Toy world: determinism, disjoint splits, real media files, answer lengths, save/load through the Auto classes."""

from __future__ import annotations

import csv
import dataclasses
import hashlib
from collections import Counter
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from mmspec_ray.media import load_image, load_video
from mmspec_ray.targets.hf import chat_inputs
from mmspec_ray.toy.build import (BUILD_VERSION, SPLITS, ToyWorld, build_world, corpus, grow_world, sample_splits,
                                   world_dir, write_data)
from mmspec_ray.toy.clips import sample_clip
from mmspec_ray.toy.grow import grow_llava
from mmspec_ray.toy.media_jobs import encode_media, load_media, load_pixels, parallel_map
from mmspec_ray.toy.model import TOY_SIZES, build_model, build_processor
from mmspec_ray.toy.quality import is_degenerate, parse_objects
from mmspec_ray.toy.scenes import sample_scene
from mmspec_ray.toy.text import detailed
from mmspec_ray.toy.tokenizer import train_tokenizer
from mmspec_ray.toy.vocab import ACTIONS, COLOURS, SHAPES

MICRO = dataclasses.replace(
    TOY_SIZES["toy-s"], name="toy-micro", vision_hidden=32, vision_layers=1, text_hidden=64, text_layers=2,
    text_heads=2, text_kv_heads=1, train_scenes=24, train_clips=10, eval_scenes=6, eval_clips=4, epochs=1.0,
    batch_size=8, lr=1e-3, vision_steps=800)


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_data_is_deterministic_by_seed(tmp_path: Path) -> None:
    digests = []
    for k in range(2):
        w = ToyWorld(tmp_path / f"w{k}")
        scenes, clips = sample_splits(MICRO, np.random.default_rng(7))
        write_data(w, scenes, clips, seed=7)
        digests.append(_tree_digest(w.data))
    assert digests[0] == digests[1]
    assert len(digests[0]) > 3 * (6 + 4)  # images, clips, parquet and csv files were written
    other = ToyWorld(tmp_path / "w_other")
    s2, c2 = sample_splits(MICRO, np.random.default_rng(8))
    write_data(other, s2, c2, seed=8)
    assert _tree_digest(other.data) != digests[0]


def test_media_work_in_worker_processes_matches_in_process(tmp_path: Path) -> None:
    """The build renders, encodes and decodes media in 2 spawned workers: the same media as in-process, in order."""
    rng = np.random.default_rng(3)
    jobs = [(sample_scene(rng), "JPEG" if k % 3 == 0 else "PNG", 96) for k in range(100)]
    jobs += [(sample_clip(rng), "mp4", 96) for _ in range(40)]
    assert len(jobs) >= 4 * 32  # large enough for parallel_map to use its workers
    encoded = parallel_map(encode_media, jobs, "encode", "file")
    here = [encode_media(j) for j in jobs]
    assert encoded[:100] == here[:100]  # scenes: the same bytes
    for a, b in zip(encoded[100:], here[100:]):  # clips: the same frames (x264 rarely flips a few bits, docs/toy.md)
        fa, fb = load_video(a).frames, load_video(b).frames
        assert len(fa) == len(fb) and all(np.abs(np.asarray(x, np.int16) - np.asarray(y, np.int16)).mean() < 0.5
                                          for x, y in zip(fa, fb))
    loads = []
    for k, ((_, fmt, _), data) in enumerate(zip(jobs, encoded)):
        path = tmp_path / f"m{k}.{fmt.lower()}"
        path.write_bytes(data)
        loads.append((str(path), "video" if fmt == "mp4" else "image", 4))
    decoded = parallel_map(load_media, loads, "decode", "file")
    assert [len(f) for f in decoded] == [4 if kind == "video" else 1 for _, kind, _ in loads]
    assert all(np.array_equal(np.asarray(a), np.asarray(b))
               for got, job in zip(decoded, loads) for a, b in zip(got, load_media(job), strict=True))
    # the build's variant: decoded and preprocessed by the processor in the workers, the same values as here
    processor = build_processor(TOY_SIZES["toy-s"], train_tokenizer(["a b c"] * 10))
    pixels = parallel_map(partial(load_pixels, processor.image_processor), loads, "decode", "file")
    here = np.stack(processor.image_processor(images=[f for got in decoded for f in got])["pixel_values"])
    assert np.array_equal(np.concatenate(pixels), here) and here.shape == (100 + 40 * 4, 3, 96, 96)


def test_splits_share_no_scene_or_clip() -> None:
    size = dataclasses.replace(MICRO, train_scenes=400, train_clips=200, eval_scenes=100, eval_clips=50)
    scenes, clips = sample_splits(size, np.random.default_rng(0))
    for a in SPLITS:
        for b in SPLITS:
            if a < b:
                assert not {s.key() for s in scenes[a]} & {s.key() for s in scenes[b]}
                assert not {c.key() for c in clips[a]} & {c.key() for c in clips[b]}
    train = scenes["train"]
    assert {len(s.objects) for s in train} == {1, 2, 3, 4}
    assert {o.shape for s in train for o in s.objects} == set(SHAPES)
    assert {o.colour for s in train for o in s.objects} == set(COLOURS)
    assert {o.size for s in train for o in s.objects} == {"small", "medium", "large"}
    assert {o.cell for s in train for o in s.objects} == set(range(9))
    assert {c.action for c in clips["train"]} == set(ACTIONS)
    assert all(8 <= c.num_frames <= 16 for c in clips["train"])


def test_written_media_and_annotations_are_real(tmp_path: Path) -> None:
    w = ToyWorld(tmp_path)
    scenes, clips = sample_splits(MICRO, np.random.default_rng(1))
    write_data(w, scenes, clips, seed=1)
    rows = pq.read_table(w.examples("test")).to_pylist()
    assert {r["task"] for r in rows} >= {"caption", "detail", "video_caption", "video_detail"}
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids))
    img_row = next(r for r in rows if r["media_type"] == "image")
    img = load_image(str(w.data / img_row["media_path"]))
    assert img.size == (96, 96) and img.mode == "RGB"
    with open(w.kinetics_csv("test")) as f:
        ann = list(csv.DictReader(f))
    assert list(ann[0]) == ["label", "youtube_id", "time_start", "time_end", "split"]
    assert len(ann) == MICRO.eval_clips and all(a["label"] in ACTIONS and a["split"] == "test" for a in ann)
    a = ann[0]
    clip_path = w.clips / "test" / f"{a['youtube_id']}_{int(a['time_start']):06d}_{int(a['time_end']):06d}.mp4"
    clip = load_video(str(clip_path), num_frames=4)
    assert len(clip.frames) == 4 and 8 <= clip.total_frames <= 16


def test_media_are_rendered_at_the_targets_image_size(tmp_path: Path) -> None:
    """A target that sees 48 px gets 48 px images and clips (nothing resampled on the way in)."""
    w = ToyWorld(tmp_path)
    scenes, clips = sample_splits(MICRO, np.random.default_rng(1))
    write_data(w, scenes, clips, seed=1, image_size=48)
    rows = pq.read_table(w.examples("test")).to_pylist()
    img = load_image(str(w.data / next(r for r in rows if r["media_type"] == "image")["media_path"]))
    clip = load_video(str(w.data / next(r for r in rows if r["media_type"] == "video")["media_path"]), num_frames=2)
    assert img.size == (48, 48) and clip.frames[0].size == (48, 48)


def test_detailed_descriptions_are_long_and_tokenizer_is_deterministic(tmp_path: Path) -> None:
    w = ToyWorld(tmp_path)
    scenes, clips = sample_splits(MICRO, np.random.default_rng(2))
    write_data(w, scenes, clips, seed=2)
    t1, t2 = train_tokenizer(corpus(w)), train_tokenizer(corpus(w))
    assert t1.get_vocab() == t2.get_vocab()
    rng = np.random.default_rng(0)
    big = dataclasses.replace(MICRO, train_scenes=300)
    lens = [len(t1(detailed(s, rng))["input_ids"]) for s in sample_splits(big, np.random.default_rng(3))[0]["train"]]
    assert 60 <= min(lens) and max(lens) <= 200, (min(lens), max(lens))


def test_parse_objects_and_degeneracy() -> None:
    got = parse_objects("A large red circle at the top, a small blue star on the left and a medium white cross.")
    assert got == [("red", "circle"), ("blue", "star"), ("white", "cross")]
    assert is_degenerate([5, 6] + [7] * 8) and not is_degenerate([5, 6, 7, 8, 9, 10, 11, 12, 2])


def test_save_load_round_trip_with_auto_classes(tmp_path: Path) -> None:
    tok = train_tokenizer(["user assistant a red circle", "Describe the image briefly."] * 20)
    proc = build_processor(MICRO, tok)
    torch.manual_seed(0)
    model = build_model(MICRO, tok).eval()
    model.save_pretrained(tmp_path)
    proc.save_pretrained(tmp_path)
    model2 = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    proc2 = AutoProcessor.from_pretrained(tmp_path)
    assert type(model2) is type(model)
    img = load_image_from_array(np.random.default_rng(0).integers(0, 255, (96, 96, 3), dtype=np.uint8))
    a, b = chat_inputs(proc, "Describe the image briefly.", [img]), chat_inputs(proc2, "Describe the image briefly.", [img])
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["pixel_values"], b["pixel_values"])
    assert int((a["input_ids"] == model.config.image_token_id).sum()) == 9
    with torch.no_grad():
        assert torch.equal(model(**a).logits, model2(**b).logits)


def load_image_from_array(arr: np.ndarray):
    from PIL import Image

    return Image.fromarray(arr)


def test_build_world_is_idempotent_and_deterministic(tmp_path: Path) -> None:
    w1 = build_world(MICRO, seed=3, root=tmp_path / "a")
    stamp = (w1.root / ".complete").stat().st_mtime_ns
    again = build_world(MICRO, seed=3, root=tmp_path / "a")
    assert (again.root / ".complete").stat().st_mtime_ns == stamp  # reused, not rebuilt
    w2 = build_world(MICRO, seed=3, root=tmp_path / "b")
    m = w1.manifest()
    assert m["train_steps"] > 0 and m["train_examples"] == MICRO.train_scenes * 4 + MICRO.train_clips * 3
    d1, d2 = _tree_digest(w1.target), _tree_digest(w2.target)
    assert d1 == d2, "same seed must give byte-identical weights and processor files"
    model = AutoModelForImageTextToText.from_pretrained(w1.target)
    assert model.config.model_type == "llava"


def test_grow_preserves_the_function_and_adds_real_width_and_depth(tmp_path: Path) -> None:
    """toy-m is grown from toy-s: at zero noise the grown model's logits equal the small one's; with the default
    noise the weights are no longer copies (full-rank blocks) and greedy choices stay the same on real inputs."""
    w = build_world(MICRO, seed=3, root=tmp_path / "s")
    small = AutoModelForImageTextToText.from_pretrained(w.target).eval()
    proc = AutoProcessor.from_pretrained(w.target)
    img = load_image(str(next((w.data / "images" / "test").iterdir())))
    inputs = chat_inputs(proc, "Describe the image briefly.", [img])
    exact = grow_llava(small, 3, 2, noise=0.0, new_layer_out_std=0.0)
    t = exact.config.text_config
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads) == (3 * 64, 2 * 2, 3 * 2)
    with torch.no_grad():
        ref = small(**inputs).logits
        assert torch.allclose(exact(**inputs).logits, ref, atol=1e-4, rtol=0)
        noisy = grow_llava(small, 3, 2)
        got = noisy(**inputs).logits
    assert not torch.allclose(got, ref, atol=1e-4, rtol=0)  # the noise is really there
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    q = noisy.model.language_model.layers[0].self_attn.q_proj.weight
    assert torch.linalg.matrix_rank(q).item() > 2 * 64  # tiled copies alone have rank <= 64

    big_size = dataclasses.replace(MICRO, name="toy-micro-m", grown_from="toy-micro", grow_width=2, grow_depth=2)
    m = grow_world(big_size, w, 3, tmp_path / "m")
    assert (m.root / ".complete").exists() and m.examples("test").exists()
    loaded = AutoModelForImageTextToText.from_pretrained(m.target)
    assert loaded.config.text_config.hidden_size == 128 and loaded.config.text_config.num_hidden_layers == 4
    assert AutoProcessor.from_pretrained(m.target)(text="a red circle")["input_ids"]


def test_a_grown_world_is_cached_under_its_growth_shape(tmp_path: Path) -> None:
    """Changing toy-m's growth shape must not reuse a world grown with another shape."""
    m, s = world_dir("toy-m", 0, tmp_path), world_dir("toy-s", 0, tmp_path)
    size = TOY_SIZES["toy-m"]
    assert m.name.endswith(f"-w{size.grow_width}d{size.grow_depth}") and s.name == f"toy-s-seed0-v{BUILD_VERSION}"
    assert size.text_hidden == TOY_SIZES["toy-s"].text_hidden * size.grow_width
    assert size.text_layers == TOY_SIZES["toy-s"].text_layers * size.grow_depth
