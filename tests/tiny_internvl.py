"""A tiny random-init InternVL3 (`InternVLForConditionalGeneration`: InternViT tower + pixel-shuffle projector + Qwen2
decoder) and its processor, built in-process for tests (no downloads).

Vision tile 32 px with 4 px patches: 8x8 patches (+ CLS, dropped by the "default" strategy), pixel-shuffled 0.5 to
4x4 = 16 `<IMG_CONTEXT>` tokens per tile (`TOKENS_PER_TILE`).
- an image: GotOCR2 cropping to at most `MAX_TILES` tiles of the closest aspect ratio, plus a thumbnail when it
  makes more than one tile; `<img>` + 16 * tiles `<IMG_CONTEXT>` + `</img>`;
- a clip: each frame resized to one tile: `Frame{i}: <img>` + 16 `<IMG_CONTEXT>` + `</img>`, frames joined by
  newlines.
The text model is a 2-layer Qwen2 of width 64 (1-D RoPE).

transformers' InternVLVideoProcessor needs torchvision, which this project does not install, and the stock
InternVLProcessor cannot type-check a video processor without it (tiny.VideoProcessorTypeCheck). So the processor is
the stock one with that check resolved, its image processor transformers' PIL backend (`GotOcr2ImageProcessorPil`),
and its video processor `TinyInternVLVideoProcessor`, a numpy/PIL stand-in doing the stock steps (resize each frame
to `size`, rescale, normalise) and returning `pixel_values_videos` [videos, frames, 3, H, W].
"""

from __future__ import annotations

import numpy as np
from PIL import Image
from transformers import (
    BatchFeature,
    GotOcr2ImageProcessorPil,
    InternVLConfig,
    InternVLForConditionalGeneration,
    InternVLProcessor,
    PreTrainedTokenizerFast,
)
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.video_processing_utils import VideoProcessorMixin
from transformers.video_utils import make_batched_videos

from tiny import VideoProcessorTypeCheck, mute_eos, seeded_model, tiny_fast_tokenizer

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
START_IMAGE, END_IMAGE, CONTEXT, VIDEO = "<img>", "</img>", "<IMG_CONTEXT>", "<video>"

TILE = 32  # vision tower input size: one crop tile, the thumbnail, one video frame
PATCH = 4
TOKENS_PER_TILE = (TILE // PATCH // 2) ** 2  # 8x8 patches pixel-shuffled by 0.5 -> 4x4
MAX_TILES = 4

# InternVL3's ChatML: an image part renders as <IMG_CONTEXT> and a video part as <video>, each followed by a newline;
# the processor expands them (see the module docstring).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<IMG_CONTEXT>\\n' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<video>\\n' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def internvl_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny BPE with InternVL's special tokens, named as the processor reads them off the tokenizer."""
    return tiny_fast_tokenizer(
        [ENDOFTEXT, IM_START, IM_END, START_IMAGE, END_IMAGE, CONTEXT, VIDEO], eos_token=IM_END, pad_token=ENDOFTEXT,
        extra_special_tokens={"start_image_token": START_IMAGE, "end_image_token": END_IMAGE,
                              "context_image_token": CONTEXT, "video_token": VIDEO},
        chat_template=CHAT_TEMPLATE)


class TinyInternVLVideoProcessor(VideoProcessorMixin):
    """Torchvision-free stand-in for InternVLVideoProcessor: per frame, resize to `size` x `size` (bicubic), rescale
    to [0, 1], normalise with CLIP's mean and std. The request's clip is taken as sampled (the stock default too)."""

    model_input_names = ["pixel_values_videos"]

    def __init__(self, size: int = TILE, **kwargs) -> None:
        super().__init__(**kwargs)
        self.size = size

    def frame(self, pixels: np.ndarray) -> np.ndarray:
        """[H, W, 3] uint8 -> [3, size, size] float32."""
        img = Image.fromarray(pixels).convert("RGB").resize((self.size, self.size), Image.BICUBIC)
        x = np.asarray(img, dtype=np.float32).transpose(2, 0, 1) / 255.0
        mean = np.array(OPENAI_CLIP_MEAN, dtype=np.float32)[:, None, None]
        std = np.array(OPENAI_CLIP_STD, dtype=np.float32)[:, None, None]
        return (x - mean) / std

    def preprocess(self, videos, return_tensors=None, **kwargs) -> BatchFeature:
        clips = [np.stack([self.frame(np.asarray(f)) for f in video]) for video in make_batched_videos(videos)]
        return BatchFeature({"pixel_values_videos": np.stack(clips)}, tensor_type=return_tensors)


class TinyInternVLProcessor(VideoProcessorTypeCheck, InternVLProcessor):
    """Stock InternVLProcessor whose `video_processor` type check works without torchvision."""


def build_processor() -> TinyInternVLProcessor:
    """GotOCR2 PIL image processor (32 px tiles, up to `MAX_TILES` + thumbnail), stand-in video processor,
    tokenizer, InternVL3-style chat template."""
    image_processor = GotOcr2ImageProcessorPil(size={"height": TILE, "width": TILE}, crop_to_patches=True,
                                               min_patches=1, max_patches=MAX_TILES)
    return TinyInternVLProcessor(image_processor=image_processor, tokenizer=internvl_tokenizer(),
                                 video_processor=TinyInternVLVideoProcessor(), image_seq_length=TOKENS_PER_TILE,
                                 chat_template=CHAT_TEMPLATE)


def tiny_internvl(seed: int = 0, init: float = 0.4, num_hidden_layers: int = 2):
    """(model, processor): a Qwen2 decoder of `num_hidden_layers` layers of width 64 (4 heads, 2 KV) and a 1-layer
    InternViT of width 32, every weight re-drawn at std `init`."""
    processor = build_processor()
    tok = processor.tokenizer
    ids = tok.convert_tokens_to_ids
    text = dict(model_type="qwen2", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=4096, initializer_range=init, bos_token_id=None, eos_token_id=ids(IM_END),
                pad_token_id=ids(ENDOFTEXT), tie_word_embeddings=False)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=TILE, patch_size=PATCH, initializer_range=init, layer_scale_init_value=1.0)
    config = InternVLConfig(text_config=text, vision_config=vision, image_token_id=ids(CONTEXT),
                            image_seq_length=TOKENS_PER_TILE, downsample_ratio=0.5, vision_feature_layer=-1,
                            vision_feature_select_strategy="default", tie_word_embeddings=False)
    model = seeded_model(InternVLForConditionalGeneration, config, seed)
    model.generation_config.eos_token_id = ids(IM_END)
    model.generation_config.pad_token_id = ids(ENDOFTEXT)
    model.generation_config.bos_token_id = None
    mute_eos(model, ids(IM_END))
    return model.eval(), processor
