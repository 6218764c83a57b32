"""Tiny random-init Qwen3-VL models (dense `qwen3_vl` and MoE `qwen3_vl_moe`) and their processor, built in-process
for tests (no downloads).

The text models have 2 layers of width 64 (head dim 16) with interleaved M-RoPE (sections 4/2/2 over the 8 rotary
frequencies); the MoE one routes each token to 2 of 4 experts in both layers. The vision tower has 2 blocks of width
32 on 8 px patches merged 2x2, and its first block feeds DeepStack features into the first decoder layer. A 96 px
image becomes 48 px: 9 placeholder tokens; a 4-frame clip becomes 2 temporal groups of 9 tokens, each group after
its `<t seconds>` timestamp text.

The tokenizer, image processor (transformers' PIL backend) and chat template are the tiny Qwen2.5-VL ones. Qwen3-VL's
own video processor needs torchvision, which this project does not install, so the processor gets
`TinyQwen3VideoProcessor`: the numpy/PIL Qwen2-VL stand-in (tests/tiny_qwen2_5_vl.py) with Qwen3-VL's differences:
the pixel budget covers the whole clip, frames are sampled at `fps` when `do_sample_frames` (transformers' own
`Qwen3VLVideoProcessor.sample_frames`), and the clip's metadata (its frame indices, fps) always comes back, because
`Qwen3VLProcessor` reads it for the timestamps.
"""

from __future__ import annotations

import torch
from transformers import (
    Qwen2VLImageProcessorPil,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
    Qwen3VLProcessor,
)
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as video_smart_resize
from transformers.video_utils import make_batched_metadata, make_batched_videos

from tiny import VideoProcessorTypeCheck, mute_eos
from tiny_qwen2_5_vl import (CHAT_TEMPLATE, ENDOFTEXT, IM_END, IMAGE_PAD, MERGE, PATCH, PIXELS, SPECIAL_TOKENS,
                             TEMPORAL, VIDEO_PAD, VISION_END, VISION_START, TinyQwenVideoProcessor,
                             tiny_qwen_tokenizer)

MEAN = STD = [0.5, 0.5, 0.5]  # Qwen3-VL normalises to [-1, 1]
# Qwen3-VL's video budget counts every frame of the clip: 4 frames of 48 x 48 px at most (a 96 px clip -> 48 px)
VIDEO_PIXELS = {"shortest_edge": 32 * 32, "longest_edge": 4 * 48 * 48}
DEEPSTACK = [0]  # vision block 0 feeds decoder layer 0


class TinyQwen3VideoProcessor(TinyQwenVideoProcessor):
    """Qwen3-VL video preprocessing without torchvision (see the module docstring)."""

    fps, min_frames, max_frames = 2, 4, 768  # the stock processor's sampling defaults

    def __init__(self, size: dict[str, int] | None = None, do_sample_frames: bool = True, **kwargs) -> None:
        super().__init__(size=dict(size or VIDEO_PIXELS), **kwargs)
        self.image_mean, self.image_std = list(MEAN), list(STD)
        self.do_sample_frames = do_sample_frames

    def preprocess(self, videos, video_metadata=None, do_sample_frames: bool | None = None,
                   return_metadata: bool = False, return_tensors=None, **kwargs):
        videos = make_batched_videos(videos)
        metadata = make_batched_metadata(videos, video_metadata)
        if self.do_sample_frames if do_sample_frames is None else do_sample_frames:
            sampled = []
            for clip, meta in zip(videos, metadata):
                indices = Qwen3VLVideoProcessor.sample_frames(self, meta)  # sets meta.fps = 24 when unknown
                meta.frames_indices = indices
                sampled.append([clip[i] for i in indices])
            videos = sampled
        out = super().preprocess(videos, video_metadata=metadata, return_tensors=return_tensors)
        if return_metadata:
            out["video_metadata"] = metadata
        return out

    def resized(self, n_frames: int, height: int, width: int) -> tuple[int, int]:
        """Qwen3-VL's video resize: the pixel budget is for the clip's frames together; fewer frames than
        `temporal_patch_size` are refused (ValueError), as the stock processor does."""
        return video_smart_resize(n_frames, height, width, temporal_factor=self.temporal_patch_size,
                                  factor=self.patch_size * self.merge_size, min_pixels=self.size["shortest_edge"],
                                  max_pixels=self.size["longest_edge"])


class TinyQwen3VLProcessor(VideoProcessorTypeCheck, Qwen3VLProcessor):
    """The stock Qwen3-VL processor, accepting a video processor while torchvision is absent."""


def tiny_qwen3_vl_processor() -> Qwen3VLProcessor:
    """Qwen3-VL processor: PIL image processor (8 px patches, 2x2 merge), tiny video processor, tiny tokenizer."""
    image_processor = Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL,
                                               size=dict(PIXELS), image_mean=list(MEAN), image_std=list(STD))
    return TinyQwen3VLProcessor(image_processor=image_processor, tokenizer=tiny_qwen_tokenizer(),
                                video_processor=TinyQwen3VideoProcessor(), chat_template=CHAT_TEMPLATE)


def _configs(tok, init: float, layers: int) -> tuple[dict, dict, dict]:
    """(text, vision, top-level) config kwargs shared by the dense and the MoE model."""
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, initializer_range=init,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                         "mrope_interleaved": True},
        pad_token_id=ids[ENDOFTEXT],
    )
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE,
        temporal_patch_size=TEMPORAL, out_hidden_size=64, num_position_embeddings=16,
        deepstack_visual_indexes=list(DEEPSTACK), initializer_range=init,
    )
    top = dict(image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD], vision_start_token_id=ids[VISION_START],
               vision_end_token_id=ids[VISION_END], tie_word_embeddings=False)
    return text, vision, top


def _finish(model, tok):
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    model.generation_config.eos_token_id = ids[IM_END]
    model.generation_config.pad_token_id = ids[ENDOFTEXT]
    model.generation_config.bos_token_id = None
    mute_eos(model, ids[IM_END])
    return model.eval()


def tiny_qwen3_vl(seed: int = 0, init: float = 0.4, num_hidden_layers: int = 2):
    """(model, processor): dense Qwen3-VL, `num_hidden_layers` text layers of width 64, DeepStack from vision
    block 0 into decoder layer 0."""
    processor = tiny_qwen3_vl_processor()
    text, vision, top = _configs(processor.tokenizer, init, num_hidden_layers)
    config = Qwen3VLConfig(text_config=text, vision_config=vision, **top)
    torch.manual_seed(seed)
    return _finish(Qwen3VLForConditionalGeneration(config), processor.tokenizer), processor


def tiny_qwen3_vl_moe(seed: int = 0, init: float = 0.4, num_hidden_layers: int = 2):
    """(model, processor): Qwen3-VL MoE, every text layer a sparse block routing each token to 2 of 4 experts of
    width 32; otherwise as `tiny_qwen3_vl`."""
    processor = tiny_qwen3_vl_processor()
    text, vision, top = _configs(processor.tokenizer, init, num_hidden_layers)
    text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    config = Qwen3VLMoeConfig(text_config=text, vision_config=vision, **top)
    torch.manual_seed(seed)
    return _finish(Qwen3VLMoeForConditionalGeneration(config), processor.tokenizer), processor
