"""Stage 1 alone (vision pretraining of a toy-s variant), scored on held-out data: a cheap predictor of the gate.

Trains the stage-1 heads on a built world's train split, then reports on its validation split the heads' accuracy
on object cells (colour, shape, size), the share of scenes whose every object's shape is right (tracks the gate's
shape accuracy: 0.95 here went with 0.950 in the gate), and the clip-action head's accuracy, overall and per
action. ~2-3 minutes per 800 steps at 1 thread instead of ~15-20 for a build + gate.

Usage: python experiments/toy_stage1_probe.py WORLD_DIR '{"vision_steps": 800, "vision_loss_weights": [1, 6, 2, 1]}'
  [--seed 0] [--threads 1]   (WORLD_DIR: a built toy-s world, e.g. ~/.cache/mmspec/toy/toy-s-seed0-v5)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
from transformers import LlavaProcessor

from mmspec_ray.media import load_image, load_video
from mmspec_ray.toy.build import ToyWorld, cell_labels, training_items
from mmspec_ray.toy.model import TOY_SIZES, build_model
from mmspec_ray.toy.train import _features, pretrain_vision
from mmspec_ray.toy.vocab import ACTIONS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("world", type=Path)
    ap.add_argument("overrides", help="JSON object of ToySize fields to change")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    size = dataclasses.replace(TOY_SIZES["toy-s"], **json.loads(args.overrides))
    world = ToyWorld(args.world)
    processor = LlavaProcessor.from_pretrained(world.target)
    _, pixels, labels, scene_rows, clips = training_items(world, size, processor)

    rows = pq.read_table(world.examples("validation")).to_pylist()
    scenes = list({r["media_path"]: r for r in rows if r["media_type"] == "image"}.values())
    videos = list({r["media_path"]: r for r in rows if r["media_type"] == "video"}.values())
    prep = processor.image_processor
    val_pix = prep(images=[load_image(str(world.data / r["media_path"])) for r in scenes],
                   return_tensors="pt")["pixel_values"]
    val_lab = torch.stack([cell_labels(json.loads(r["meta"])["objects"], size) for r in scenes])
    frames = [f for r in videos for f in load_video(str(world.data / r["media_path"]), size.video_frames).frames]
    clip_pix = prep(images=frames, return_tensors="pt")["pixel_values"]
    actions = torch.tensor([ACTIONS.index(json.loads(r["meta"])["action"]) for r in videos])

    torch.manual_seed(args.seed)
    model = build_model(size, processor.tokenizer)
    result: dict[str, float] = {}

    @torch.no_grad()
    def probe(step: int, heads: torch.nn.ModuleList) -> None:
        feats = _features(model, val_pix)
        obj = val_lab[..., 1] > 0
        for k, name in enumerate(("colour", "shape", "size")):
            ok = heads[k](feats).argmax(-1) == val_lab[..., k]
            result[name] = float(ok[obj].float().mean())
            if name == "shape":
                result["scenes_all_shapes_right"] = float((ok | ~obj).all(-1).float().mean())
        clip_feats = _features(model, clip_pix).reshape(len(videos), -1)
        ok = heads[-1](clip_feats).argmax(-1) == actions
        result["action"] = float(ok.float().mean())
        for k, name in enumerate(ACTIONS):  # per action: which ones the tower cannot tell apart
            result[f"action: {name}"] = float(ok[actions == k].float().mean())

    t0 = time.time()
    pretrain_vision(model, pixels[scene_rows], labels, steps=size.vision_steps, batch_size=128, lr=size.lr,
                    seed=args.seed, clips=clips, clip_batch=size.vision_clip_batch,
                    clip_hidden=size.vision_clip_hidden, weights=size.vision_loss_weights, probe=probe)
    print(json.dumps({"overrides": json.loads(args.overrides), "seed": args.seed, "stage1_s": round(time.time() - t0),
                      **{k: round(v, 4) for k, v in result.items()}}))


if __name__ == "__main__":
    main()
