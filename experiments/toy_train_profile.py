#!/usr/bin/env python
"""Where a stage-2 step of the toy target's training goes (toy/train.py `train_target`): times the first steps of
the build's own schedule on the built world's data and target (its trained weights: the shapes and the work are
the build's), split into collate / the frozen vision tower / forward / backward / optimizer, then a torch profile
of a few more steps by operator. Why the README's first run is bound by this training (docs/toy.md, "Build time").

    .venv/bin/python experiments/toy_train_profile.py [--size toy-s] [--steps 40]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoProcessor, LlavaForConditionalGeneration

from mmspec_ray.toy.build import build_toy, training_items
from mmspec_ray.toy.model import TOY_SIZES
from mmspec_ray.toy.train import _features, collate, pack_items, schedule


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="toy-s")
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    world, size = build_toy(a.size), TOY_SIZES[a.size]
    processor = AutoProcessor.from_pretrained(world.target)
    items, pixels, *_ = training_items(world, size, processor)
    groups = pack_items(items, processor.tokenizer.convert_tokens_to_ids("<image>"))
    batches = schedule(groups, size.epochs, size.video_epochs, size.batch_size, np.random.default_rng(0))
    model = LlavaForConditionalGeneration.from_pretrained(world.target)
    model.model.vision_tower.requires_grad_(False)  # frozen in stage 2, as train_target does
    model.model.multi_modal_projector.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)  # a small lr: the weights' values do not change the work
    model.train()
    pad = processor.tokenizer.pad_token_id
    parts = dict.fromkeys(("collate", "tower (also inside forward)", "forward", "backward", "optimizer"), 0.0)
    tokens = images = 0
    for idx in batches[:a.steps]:
        t0 = time.perf_counter()
        b = collate(groups, idx, pixels, pad)
        t1 = time.perf_counter()
        with torch.no_grad():
            _features(model, b["pixel_values"])
        t2 = time.perf_counter()
        out = model(**b)
        t3 = time.perf_counter()
        out.loss.backward()
        t4 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t5 = time.perf_counter()
        for k, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            parts[k] += dt
        tokens += b["input_ids"].numel()
        images += b["pixel_values"].shape[0]
    n = min(a.steps, len(batches))
    step = sum(v for k, v in parts.items() if not k.startswith("tower")) / n
    print(f"{a.size}: {len(batches)} stage-2 steps in the schedule; {torch.get_num_threads()} torch threads; "
          f"{n} steps timed: {tokens / n:.0f} token slots and {images / n:.1f} images a step")
    print(f"a step: {1e3 * step:.0f} ms ({len(batches) * step:.0f} s for the stage at this speed)")
    for k, v in parts.items():
        print(f"  {k}: {1e3 * v / n:.1f} ms ({100 * v / n / step:.0f} %)")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for idx in batches[n:n + 10]:
            out = model(**collate(groups, idx, pixels, pad))
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
