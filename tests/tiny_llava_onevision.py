"""Tiny random-init LLaVA-OneVision (SigLIP tower + Qwen2, anyres images, native video) and its processor.

Vision tile 32px with 8px patches: 16 patch tokens per tile ("full" strategy, SigLIP has no CLS).
- one image: anyres over up to 3x3 tiles, shrunk to at most `anyres_max_4` tiles' worth of grid features
  (a square image: 16 base + 8x8 grid + 8 newlines = 88 tokens);
- several images: base view only, 16 + 1 newline = 17 tokens each;
- a clip: each frame 2x2-pooled to 4 tokens, plus one newline: 4 * frames + 1 tokens.

Without torchvision (absent here, and nothing can be installed) transformers 5.23 can build neither
LlavaOnevisionVideoProcessor (ImportError) nor any LlavaOnevisionProcessor: its sub-processor type check looks
`VideoProcessorMixin` up on the top-level `transformers` module, which exports it only when torchvision is installed
(AttributeError on the dummy VIDEO_PROCESSOR_MAPPING). So the tests use two stand-ins:
- `TinyVideoProcessor`: the same resize -> rescale -> CLIP-normalise steps on PIL frames, returning
  `pixel_values_videos` [videos, frames, 3, H, W];
- `TinyOnevisionProcessor`: the stock LlavaOnevisionProcessor with only that type check resolved directly.
Everything else on the processor's video path (placeholder validation and expansion, kwargs merging) is stock.
"""

from __future__ import annotations

import copy

import numpy as np
from PIL import Image
from transformers import (
    BatchFeature,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionImageProcessorPil,
    LlavaOnevisionProcessor,
    Qwen2Config,
    SiglipVisionConfig,
)
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.video_processing_utils import VideoProcessorMixin
from transformers.video_utils import make_batched_videos

from tiny import VideoProcessorTypeCheck, anyres_decoder, ready, seeded_model, tiny_tokenizer

TILE = 32  # vision tower input size (one anyres tile, one video frame)
PATCH = 8
PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64], [64, 96], [96, 64], [96, 96]]  # (height, width), up to 3x3
ASPECT = "anyres_max_4"
VIDEO = "<video>"

# ChatML like the toy template; image / video parts become one <image> / <video> the processor expands.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<image>\\n' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<video>\\n' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


class TinyVideoProcessor(VideoProcessorMixin):
    """Torchvision-free stand-in for LlavaOnevisionVideoProcessor: resize each frame to `size`, rescale, normalise."""

    model_input_names = ["pixel_values_videos"]

    def __init__(self, size: int = TILE, **kwargs) -> None:
        super().__init__(**kwargs)
        self.frame_size = size

    def preprocess(self, videos, return_tensors=None, **kwargs) -> BatchFeature:
        mean = np.array(OPENAI_CLIP_MEAN, dtype=np.float32)[:, None, None]
        std = np.array(OPENAI_CLIP_STD, dtype=np.float32)[:, None, None]
        out = []
        for video in make_batched_videos(videos):  # each [T, H, W, 3] uint8
            frames = []
            for frame in np.asarray(video):
                img = Image.fromarray(frame).convert("RGB").resize((self.frame_size,) * 2, Image.BICUBIC)
                x = np.asarray(img, dtype=np.float32).transpose(2, 0, 1) / 255.0
                frames.append((x - mean) / std)
            out.append(np.stack(frames))
        return BatchFeature({"pixel_values_videos": out}, tensor_type=return_tensors)


class TinyOnevisionProcessor(VideoProcessorTypeCheck, LlavaOnevisionProcessor):
    """Stock LlavaOnevisionProcessor whose `video_processor` type check works without torchvision (see above)."""


def onevision_tokenizer():
    """The shared tiny tokenizer (copied, never mutated) plus a <video> special token."""
    tok = copy.deepcopy(tiny_tokenizer())
    tok.add_tokens([VIDEO], special_tokens=True)
    return tok


def build_processor() -> TinyOnevisionProcessor:
    """Anyres image processor + stand-in video processor + tokenizer + a template that renders image/video parts."""
    tok = onevision_tokenizer()
    image_processor = LlavaOnevisionImageProcessorPil(size={"height": TILE, "width": TILE},
                                                      image_grid_pinpoints=PINPOINTS)
    return TinyOnevisionProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=TinyVideoProcessor(),
        num_image_tokens=(TILE // PATCH) ** 2,
        vision_feature_select_strategy="full",
        chat_template=CHAT_TEMPLATE,
        image_token="<image>",
        video_token=VIDEO,
        vision_aspect_ratio=ASPECT,
    )


def build_model(seed: int = 0, init: float = 0.3, **text: object) -> LlavaOnevisionForConditionalGeneration:
    """2-layer Qwen2 text model (hidden 64) + 1-layer SigLIP tower (hidden 32), weights re-drawn at std `init`.

    `init` is 0.3 rather than 0.5 for the reason given in tiny_llava_next (float32 noise vs LOGIT_TOL); `text`
    overrides Qwen2Config fields (e.g. sliding-window attention)."""
    tok = onevision_tokenizer()
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=TILE, patch_size=PATCH, vision_use_head=False, initializer_range=init)
    text = Qwen2Config(**{**anyres_decoder(tok, init), **text})
    config = LlavaOnevisionConfig(vision_config=vision, text_config=text, image_token_index=tok.image_token_id,
                                  video_token_index=tok.convert_tokens_to_ids(VIDEO), vision_feature_layer=-1,
                                  vision_feature_select_strategy="full", image_grid_pinpoints=PINPOINTS,
                                  vision_aspect_ratio=ASPECT)
    return ready(seeded_model(LlavaOnevisionForConditionalGeneration, config, seed), tok)


def tiny_llava_onevision(seed: int = 0, init: float = 0.3, **text: object):
    """(model, processor) for the tiny LLaVA-OneVision (`text`: Qwen2Config overrides)."""
    return build_model(seed, init, **text), build_processor()
