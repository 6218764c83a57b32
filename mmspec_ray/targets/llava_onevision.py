"""LLaVA-OneVision family: SigLIP tower + projector, anyres images and native video (`pixel_values_videos`).

The processor's three visual regimes, which the adapter picks by how it hands media over:
- one image: anyres tiling (base view + unpadded tile grid, shrunk to the `anyres_max_N` budget) + row newlines;
- several images in one request: one group (`batch_num_images` = n), so each image is its base view + one newline,
  as OneVision was trained for multi-image input;
- each clip: its frames through the video processor, 2x2-pooled per frame, plus one trailing newline.
Text positions are plain 1D RoPE, so tree verification needs no override.
"""

from __future__ import annotations

from typing import Any

import torch

from mmspec_ray.targets.base import Request, VLMTarget, media_runs, split_run
from mmspec_ray.targets.llava_next import check_equal_clips, check_processor_parts


class LlavaOnevisionTarget(VLMTarget):
    """LLaVA-OneVision adapter: images (single: anyres, several: base views) and clips as native video."""

    family = "llava_onevision"
    model_types = ("llava_onevision",)
    takes_video = True

    def check_request(self, request: Request) -> None:
        super().check_request(request)
        check_processor_parts(self.processor, request, self.family, frames_as_images=False)
        check_equal_clips(request, self.family)

    def processor_inputs(self, text: str, request: Request) -> dict[str, Any]:
        kw: dict[str, Any] = {"text": text, "return_tensors": "pt"}
        if len(request.images) == 1:
            kw["images"] = list(request.images)
        elif request.images:
            kw["images"] = [list(request.images)]  # one sample's group: OneVision's multi-image regime
        if request.videos:
            kw["videos"] = [list(clip) for clip in request.videos]
        return dict(self.processor(**kw))

    def media_pieces(self, ids: torch.Tensor, inputs: dict[str, Any] | None = None) -> list[tuple[int, int]]:
        """A clip is one run of video tokens: its frames (equal pooled grids) back to back, then one newline
        token, which joins the last frame. Images: one run each. Without `inputs` (stored features) the frame
        count is unknown and a clip stays one piece."""
        frames = inputs.get("pixel_values_videos") if inputs else None
        video = ids == self.config.video_token_id
        out: list[tuple[int, int]] = []
        for a, b in media_runs(self.media_mask_of(ids)):
            n = int(frames.shape[1]) if frames is not None and bool(video[a]) else 1
            out += split_run(a, b, n) if n > 1 and (b - a - 1) % n == 0 else [(a, b)]
        return out


ADAPTERS = (LlavaOnevisionTarget,)
