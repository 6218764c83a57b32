"""Qwen3-VL family, dense (`qwen3_vl`) and MoE (`qwen3_vl_moe`): Qwen2.5-VL's interface to this engine with three
differences the adapter sees.

- Positions: interleaved M-RoPE, applied inside the model's rotary embedding; it takes the same 3-axis position ids
  [3, 1, n] and the rope delta the model computes at prefill (`Qwen3VLModel.rope_deltas`), so tree positions are
  Qwen2.5-VL's (`next_pos + depth` on all three axes).
- DeepStack: features from some vision blocks are added to the first decoder layers' hidden states at the media
  positions, during the forward that carries the pixel values (the prefill). Their effect is in the KV cache from then
  on, so tree verification (text only) needs nothing more.
- Video: the processor writes each temporal group of a clip as its own run of video tokens after a `<t seconds>`
  timestamp, so every run of media tokens is one piece (an image or one temporal group). The model needs the
  processor's `mm_token_type_ids` with media; `encode` passes everything the processor returns.

A clip's frames are the request's frames: the video processor's own frame sampling (2 fps, at least 4 frames, on
frames it assumes to be 24 fps) is turned off (`do_sample_frames=False`), as the request's clip is already sampled.
The timestamps then count the frames at 24 fps, as transformers does for frames without metadata.
"""

from __future__ import annotations

from typing import Any

import torch

from mmspec_ray.targets.base import Request, TargetError, media_runs
from mmspec_ray.targets.qwen2_5_vl import Qwen25VLTarget


class Qwen3VLTarget(Qwen25VLTarget):
    """Qwen3-VL (dense and MoE): images and native video, 3-axis interleaved M-RoPE, DeepStack at prefill."""

    family = "qwen3_vl"
    display_name = "Qwen3-VL"
    model_types = ("qwen3_vl",)
    clips_as_sent = True  # the video processor's own frame sampling off: the request's clip is already sampled

    def check_request(self, request: Request) -> None:
        """Qwen2.5-VL's checks, plus: a clip needs at least `temporal_patch_size` frames (the Qwen3-VL video
        processor refuses shorter clips)."""
        super().check_request(request)
        need = self._frames_per_group()
        for i, clip in enumerate(request.videos):
            if len(clip) < need:
                raise TargetError(f"video {i} has {len(clip)} frame(s): Qwen3-VL takes clips of at least {need} "
                                  "frames; send more frames, or send a single frame as an image")

    def _frames_per_group(self) -> int:
        video = getattr(self.processor, "video_processor", None)
        n = getattr(video, "temporal_patch_size", None) or self.config.vision_config.temporal_patch_size
        return int(n)

    def media_pieces(self, ids: torch.Tensor, inputs: dict[str, Any] | None = None) -> list[tuple[int, int]]:
        """Every run of media tokens is one piece: an image, or one temporal group of a clip (the processor puts a
        timestamp and vision start / end tokens between groups), with or without `inputs`."""
        return media_runs(self.media_mask_of(ids))


class Qwen3VLMoeTarget(Qwen3VLTarget):
    """Qwen3-VL MoE: the dense adapter under its own model type (the sparse text MLPs are inside the model)."""

    family = "qwen3_vl_moe"
    display_name = "Qwen3-VL"
    model_types = ("qwen3_vl_moe",)


ADAPTERS = (Qwen3VLTarget, Qwen3VLMoeTarget)
