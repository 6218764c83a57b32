"""A tiny random-init Qwen2-VL, built in-process for tests (no downloads): Qwen2.5-VL's tiny text model and processor
(same tokenizer, image and video processing, chat template) on Qwen2-VL's vision tower (2 blocks of width 32, no
window attention) and Qwen2-VL's config and model classes."""

from __future__ import annotations

import torch
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

from tiny import VideoProcessorTypeCheck, mute_eos
from tiny_qwen2_5_vl import (CHAT_TEMPLATE, ENDOFTEXT, IM_END, IMAGE_PAD, MERGE, PATCH, SPECIAL_TOKENS, TEMPORAL,
                             VIDEO_PAD, VISION_END, VISION_START, tiny_qwen2_5_vl_processor)


class TinyQwen2VLProcessor(VideoProcessorTypeCheck, Qwen2VLProcessor):
    """The stock Qwen2-VL processor, accepting a video processor while torchvision is absent."""


def tiny_qwen2_vl(seed: int = 0, init: float = 0.4):
    """(model, processor): 2 text layers of width 64 (head dim 16, M-RoPE sections 2/3/3), a 2-block vision tower.
    `init` 0.4, not 0.5: at 0.5 float32 rounding alone moves tree-vs-path logits past target_checks.LOGIT_TOL."""
    base = tiny_qwen2_5_vl_processor()
    processor = TinyQwen2VLProcessor(image_processor=base.image_processor, tokenizer=base.tokenizer,
                                     video_processor=base.video_processor, chat_template=CHAT_TEMPLATE)
    tok = processor.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, initializer_range=init,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=None, eos_token_id=ids[IM_END], pad_token_id=ids[ENDOFTEXT],
    )
    vision = dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, initializer_range=init)
    config = Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END], tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = ids[IM_END]
    model.generation_config.pad_token_id = ids[ENDOFTEXT]
    model.generation_config.bos_token_id = None
    mute_eos(model, ids[IM_END])
    return model.eval(), processor
