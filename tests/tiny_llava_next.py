"""Tiny random-init LLaVA-NeXT (anyres tiling) and its processor, built in-process for tests (no downloads).

Vision tile 32px with 8px patches: 16 patch tokens per tile (+ CLS, dropped by the "default" strategy). Grid
pinpoints up to 2x2 tiles, so a square image costs 16 base + 8x8 grid + 8 newlines = 88 tokens, a wide one fewer
(its padded rows are cut off by the unpadding).

`initializer_range` is 0.3, not 0.5: at 0.5 this model's residual stream reaches rms ~70 (max ~370) after one layer
and float32 rounding alone moves tree-vs-path logits by up to 1.3e-4, past target_checks.LOGIT_TOL (1e-4); at 0.3
the same noise is <= 4e-5 and greedy output is still varied (20+ distinct tokens in 32).
"""

from __future__ import annotations

from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextImageProcessorPil,
    LlavaNextProcessor,
)

from tiny import anyres_decoder, ready, seeded_model, tiny_tokenizer

TILE = 32  # vision tower input size (one anyres tile)
PATCH = 8
PINPOINTS = [[32, 64], [64, 32], [64, 64]]  # (height, width) tile layouts, up to 2x2 tiles

# ChatML like the toy template; every {"type": "image"} part becomes one <image> the processor expands.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<image>\\n' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def build_processor() -> LlavaNextProcessor:
    """CLIP-style anyres image processor + the tiny tokenizer + a chat template that renders image parts."""
    tok = tiny_tokenizer()
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": TILE},
        crop_size={"height": TILE, "width": TILE},
        image_grid_pinpoints=PINPOINTS,
    )
    return LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        chat_template=CHAT_TEMPLATE,
        image_token="<image>",
        num_additional_image_tokens=1,  # CLIP's CLS
    )


def build_model(seed: int = 0, init: float = 0.3) -> LlavaNextForConditionalGeneration:
    """2-layer Llama text model (hidden 64) + 1-layer CLIP tower (hidden 32), weights re-drawn at std `init`."""
    tok = tiny_tokenizer()
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=TILE, patch_size=PATCH, projection_dim=32, initializer_range=init)
    text = LlamaConfig(**anyres_decoder(tok, init))
    config = LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=tok.image_token_id,
                             vision_feature_layer=-1, vision_feature_select_strategy="default",
                             image_grid_pinpoints=PINPOINTS, image_seq_length=(TILE // PATCH) ** 2)
    return ready(seeded_model(LlavaNextForConditionalGeneration, config, seed), tok)


def tiny_llava_next(seed: int = 0, init: float = 0.3):
    """(model, processor) for the tiny LLaVA-NeXT."""
    return build_model(seed, init), build_processor()
