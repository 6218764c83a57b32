"""Load a HF VLM checkpoint through the stock Auto classes and build chat inputs for images and videos.

The toy target and real checkpoints go through exactly this path.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor


def load_hf_vlm(path: str | Path, device: str = "cpu", dtype: torch.dtype | None = None):
    """(model, processor) from a local checkpoint directory; model in eval mode on `device`."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a checkpoint directory (no config.json); build or download it first")
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype or torch.float32)
    return model.to(device).eval(), processor


def video_frames_for(path: str | Path, default: int = 8) -> int:
    """Frames to sample per clip: the toy target records its convention; real checkpoints use `default`."""
    f = Path(path) / "mmspec_toy.json"
    return json.loads(f.read_text())["video_frames"] if f.exists() else default


def chat_inputs(processor, prompt: str, images: list[Image.Image] | None = None) -> dict[str, torch.Tensor]:
    """Tokenised user turn (one image placeholder per image; a clip is passed as its frames) + pixel values."""
    images = images or []
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    if images:
        return dict(processor(text=text, images=images, return_tensors="pt"))
    return dict(processor(text=text, return_tensors="pt"))
