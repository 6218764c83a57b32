"""LLaVA-NeXT-Video family: LLaVA-NeXT's CLIP tower, projector and anyres images, plus native video
(`pixel_values_videos`).

- Images: as LLaVA-NeXT (base view + unpadded tile grid + row newlines; token count depends on `image_sizes`).
- Video: each clip goes to the video processor as its list of frames (resized and cropped to the tower's input
  size); every frame's patch features are pooled by `spatial_pool_stride` (2x2 by default) and the frames sit back
  to back in one run of `<video>` tokens, with no separator. All clips of a request form one
  [videos, frames, C, H, W] tensor, so they must have the same number of frames.
Text positions are plain 1-D RoPE, so tree verification needs no override.
"""

from __future__ import annotations

from typing import Any

import torch

from mmspec_ray.targets.base import Request, VLMTarget, media_runs, split_run
from mmspec_ray.targets.llava_next import check_equal_clips, check_processor_parts


class LlavaNextVideoTarget(VLMTarget):
    """LLaVA-NeXT-Video adapter: anyres images and clips as native video."""

    family = "llava_next_video"
    model_types = ("llava_next_video",)
    takes_video = True

    def check_request(self, request: Request) -> None:
        super().check_request(request)
        check_processor_parts(self.processor, request, self.family, frames_as_images=False)
        check_equal_clips(request, self.family)

    def media_pieces(self, ids: torch.Tensor, inputs: dict[str, Any] | None = None) -> list[tuple[int, int]]:
        """A clip is one run of video tokens: its frames' equal pooled grids back to back, one piece per frame.
        Images: one run each. Without `inputs` (stored features) the frame count is unknown and a clip stays one
        piece."""
        frames = inputs.get("pixel_values_videos") if inputs else None
        video = ids == self.config.video_token_id
        out: list[tuple[int, int]] = []
        for a, b in media_runs(self.media_mask_of(ids)):
            n = int(frames.shape[1]) if frames is not None and bool(video[a]) else 1
            out += split_run(a, b, n) if n > 1 and (b - a) % n == 0 else [(a, b)]
        return out


ADAPTERS = (LlavaNextVideoTarget,)
