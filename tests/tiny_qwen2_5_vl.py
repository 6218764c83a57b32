"""A tiny random-init Qwen2.5-VL and its processor, built in-process for tests (no downloads).

The text model has 2 layers of width 64 and 3-axis M-RoPE; the vision tower uses 8 px patches merged 2x2, and the
image/video processors resize a 96 px frame to 48 px, so an image becomes 9 placeholder tokens and a 4-frame clip 18.
Weights use `initializer_range` 0.5 so greedy output is varied rather than one repeated token.

transformers' own Qwen2-VL video processor needs torchvision, which this project does not install, so the processor
gets `TinyQwenVideoProcessor`: a numpy/PIL stand-in that emits the same outputs (`pixel_values_videos` in the vision
tower's patch layout, `video_grid_thw`, per-clip metadata) for clips given as lists of frames.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    BatchFeature,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessorPil,
)
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.video_processing_utils import VideoProcessorMixin
from transformers.video_utils import make_batched_metadata, make_batched_videos

from mmspec_ray.bench.scale_models import QWEN_TEMPLATE
from tiny import VideoProcessorTypeCheck, mute_eos, tiny_corpus

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]

PATCH, MERGE, TEMPORAL = 8, 2, 2
PIXELS = {"shortest_edge": 32 * 32, "longest_edge": 48 * 48}  # a 96 px square becomes 48 px: 6x6 patches, 9 tokens

# Qwen-style ChatML: an image part renders as <|vision_start|><|image_pad|><|vision_end|> (the processor expands the
# pad to one token per merged patch), a video part likewise with <|video_pad|>.
CHAT_TEMPLATE = QWEN_TEMPLATE


@lru_cache(maxsize=1)
def tiny_qwen_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE over the tiny test vocabulary, with Qwen's special tokens first (ids 0..6)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(tiny_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
                                   chat_template=CHAT_TEMPLATE, padding_side="left", model_max_length=4096)


class TinyQwenVideoProcessor(VideoProcessorMixin):
    """Qwen2-VL video preprocessing without torchvision: resize each clip's frames to one size on the patch grid,
    normalise, repeat the last frame up to a multiple of `temporal_patch_size`, and flatten into the tower's layout
    (per temporal group, 2x2 merge blocks in raster order; inside a patch: channel, time, row, column)."""

    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self, patch_size: int = PATCH, merge_size: int = MERGE, temporal_patch_size: int = TEMPORAL,
                 size: dict[str, int] | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.patch_size, self.merge_size, self.temporal_patch_size = patch_size, merge_size, temporal_patch_size
        self.size = dict(size or PIXELS)
        self.image_mean, self.image_std = list(OPENAI_CLIP_MEAN), list(OPENAI_CLIP_STD)

    def preprocess(self, videos, video_metadata=None, return_metadata: bool = False, return_tensors=None,
                   **kwargs) -> BatchFeature:
        videos = make_batched_videos(videos)
        metadata = make_batched_metadata(videos, video_metadata)
        patches, grids = [], []
        for clip in videos:
            flat, grid = self._clip([f if isinstance(f, Image.Image) else Image.fromarray(np.asarray(f)) for f in clip])
            patches.append(flat)
            grids.append(grid)
        data = {"pixel_values_videos": np.concatenate(patches), "video_grid_thw": np.array(grids, dtype=np.int64)}
        out = BatchFeature(data, tensor_type=return_tensors)
        if return_metadata:
            out["video_metadata"] = metadata
        return out

    def resized(self, n_frames: int, height: int, width: int) -> tuple[int, int]:
        """(height, width) every frame of an `n_frames` clip is resized to: Qwen2-VL's per-frame pixel budget."""
        return smart_resize(height, width, factor=self.patch_size * self.merge_size,
                            min_pixels=self.size["shortest_edge"], max_pixels=self.size["longest_edge"])

    def _clip(self, frames: list[Image.Image]) -> tuple[np.ndarray, list[int]]:
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        w0, h0 = frames[0].size
        h, w = self.resized(len(frames), h0, w0)
        arr = np.stack([np.asarray(f.convert("RGB").resize((w, h), Image.BICUBIC), dtype=np.float32) for f in frames])
        arr = (arr / 255.0 - np.array(self.image_mean, np.float32)) / np.array(self.image_std, np.float32)
        arr = arr.transpose(0, 3, 1, 2)  # [T, C, H, W]
        if pad := -len(arr) % tp:
            arr = np.concatenate([arr, np.repeat(arr[-1:], pad, axis=0)])
        gt, gh, gw = len(arr) // tp, h // p, w // p
        c = arr.shape[1]
        x = arr.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
        # -> (t, block row, block col, row in block, col in block, C, time in group, patch row, patch col)
        x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return x.reshape(gt * gh * gw, c * tp * p * p), [gt, gh, gw]


class TinyQwen2_5_VLProcessor(VideoProcessorTypeCheck, Qwen2_5_VLProcessor):
    """The stock processor, accepting a video processor while torchvision is absent (see VideoProcessorTypeCheck)."""


def tiny_qwen2_5_vl_processor() -> Qwen2_5_VLProcessor:
    """Qwen2.5-VL processor: PIL image processor (8 px patches, 2x2 merge), tiny video processor, tiny tokenizer."""
    tok = tiny_qwen_tokenizer()
    image_processor = Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL,
                                               size=dict(PIXELS))
    return TinyQwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tok,
                               video_processor=TinyQwenVideoProcessor(), chat_template=CHAT_TEMPLATE)


def tiny_qwen2_5_vl(seed: int = 0, init: float = 0.5):
    """(model, processor): 2 text layers of width 64 (head dim 16, M-RoPE sections 2/3/3), a 2-block vision tower
    of width 32 (one windowed block, one full-attention block)."""
    processor = tiny_qwen2_5_vl_processor()
    tok = processor.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, initializer_range=init,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=None, eos_token_id=ids[IM_END], pad_token_id=ids[ENDOFTEXT],
    )
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE,
        temporal_patch_size=TEMPORAL, window_size=2 * PATCH * MERGE, fullatt_block_indexes=[1], out_hidden_size=64,
        initializer_range=init,
    )
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END], tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = ids[IM_END]
    model.generation_config.pad_token_id = ids[ENDOFTEXT]
    model.generation_config.bos_token_id = None
    mute_eos(model, ids[IM_END])
    return model.eval(), processor
