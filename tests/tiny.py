"""Tiny random-init VLMs of each supported family, built in-process for tests (no downloads).

`initializer_range` is large so that greedy output is varied, not one repeated token.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import numpy as np
import torch
from PIL import Image

from mmspec_ray.toy.model import TOY_SIZES, build_model, build_processor
from mmspec_ray.toy.tokenizer import train_tokenizer

WORDS = ("red green blue circle square star large small top left right bottom center the a is there image "
         "describe what happening video objects one two three").split()


@lru_cache(maxsize=1)
def tiny_tokenizer():
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, size=12)) for _ in range(400)] + ["user\nassistant\n"] * 20
    return train_tokenizer(texts, vocab_size=300)


def tiny_llava(seed: int = 0, init: float = 0.5):
    """(model, processor) for a 2-layer LLaVA with a 96px, 9-patch CLIP tower."""
    size = dataclasses.replace(TOY_SIZES["toy-s"], vision_hidden=32, vision_layers=1, text_hidden=64,
                               text_layers=2, text_heads=4, text_kv_heads=2)
    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    model = build_model(size, tok)
    model.config.text_config.initializer_range = init
    model.config.vision_config.initializer_range = init
    torch.manual_seed(seed)
    model.apply(model._init_weights)  # re-init with the larger range
    mute_eos(model, tok.eos_token_id)
    return model.eval(), build_processor(size, tok)


def mute_eos(model, eos_id: int) -> None:
    """Zero eos's output row (logit 0 never wins among hundreds), so greedy tests run their full length."""
    with torch.no_grad():
        model.get_output_embeddings().weight[eos_id].zero_()


def random_images(n: int, seed: int = 0, size: int = 96) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]
