"""Toy target VLM: a stock transformers LLaVA (CLIP vision tower + Llama text model) at toy sizes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from transformers import (
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)

from mmspec_ray.toy.tokenizer import IMAGE


@dataclass(frozen=True)
class ToySize:
    """Everything that differs between toy-s and toy-m: data volume, model width/depth, training length."""

    name: str
    image_size: int
    patch_size: int
    vision_hidden: int
    vision_layers: int
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    train_scenes: int
    train_clips: int
    eval_scenes: int
    eval_clips: int
    epochs: float
    batch_size: int
    lr: float
    vision_steps: int = 600  # stage-1 vision pretraining steps (per-cell attribute classification)
    vision_loss_weights: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0)  # stage 1: colour, shape, size, clip action
    vision_clip_batch: int = 32  # stage 1: clips per step for the clip-action head (beside 128 scenes)
    vision_clip_hidden: int = 0  # stage 1: hidden width of the clip-action head (0: linear)
    video_epochs: float | None = None  # stage-2 passes over the clips' examples (None: `epochs`)
    video_frames: int = 4  # frames the target sees per clip (uniformly sampled)
    train_questions: int = 2  # questions / instructions per train scene (besides its caption and description)
    grown_from: str = ""  # if set: not trained, but grown from this (trained) size by toy.grow (same data)
    grow_width: int = 1
    grow_depth: int = 1


TOY_SIZES: dict[str, ToySize] = {
    "toy-s": ToySize("toy-s", image_size=96, patch_size=32, vision_hidden=128, vision_layers=2,
                     text_hidden=192, text_layers=4, text_heads=4, text_kv_heads=2,
                     train_scenes=4000, train_clips=2400, eval_scenes=200, eval_clips=100,
                     epochs=2.0, batch_size=32, lr=2e-3, vision_steps=1200,
                     vision_loss_weights=(1.0, 12.0, 4.0, 6.0), vision_clip_batch=16, vision_clip_hidden=256,
                     video_epochs=3.0),
}
# toy-m: toy-s grown 3x wider and 6x deeper (toy/grow.py): d = 576, 24 layers, ~90 M parameters, an AR step of
# >= 20 ms on a CPU core. Deep and narrow on purpose: an EAGLE drafter is one decoder layer of the target's width,
# so its cost relative to the target is about 1 / (number of target layers); 24 layers puts that ratio (~5%) where
# real VLMs have it (LLaVA-1.5-7B: 32 layers, Qwen2.5-VL-7B: 28), while the first toy-m (d = 768, 12 layers) made a
# draft level cost twice as much relative to the target. Trained from scratch at this size the build would take
# many hours on 2 CPU cores.
TOY_SIZES["toy-m"] = dataclasses.replace(TOY_SIZES["toy-s"], name="toy-m", grown_from="toy-s", grow_width=3,
                                         grow_depth=6, text_hidden=576, text_layers=24, text_heads=12,
                                         text_kv_heads=6)


def tokens_per_image(size: ToySize) -> int:
    return (size.image_size // size.patch_size) ** 2


def build_processor(size: ToySize, tokenizer: PreTrainedTokenizerFast) -> LlavaProcessor:
    """CLIP-style preprocessing (resize, centre crop, normalise) + the tokenizer + the chat template."""
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": size.image_size},
        crop_size={"height": size.image_size, "width": size.image_size},
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=size.patch_size,
        vision_feature_select_strategy="default",
        chat_template=tokenizer.chat_template,
        image_token=IMAGE,
        num_additional_image_tokens=1,
    )


def build_model(size: ToySize, tokenizer: PreTrainedTokenizerFast) -> LlavaForConditionalGeneration:
    """A randomly initialised LLaVA of the given size (trained by toy.train)."""
    vision = CLIPVisionConfig(
        hidden_size=size.vision_hidden,
        intermediate_size=size.vision_hidden * 4,
        num_hidden_layers=size.vision_layers,
        num_attention_heads=max(2, size.vision_hidden // 64),
        image_size=size.image_size,
        patch_size=size.patch_size,
        projection_dim=size.vision_hidden,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=size.text_hidden,
        intermediate_size=int(size.text_hidden * 8 / 3) // 32 * 32,
        num_hidden_layers=size.text_layers,
        num_attention_heads=size.text_heads,
        num_key_value_heads=size.text_kv_heads,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
        initializer_range=0.02,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        image_seq_length=tokens_per_image(size),
        projector_hidden_act="gelu",
    )
    return LlavaForConditionalGeneration(config)
