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

from mmspec_ray.targets.base import Request, TargetError, VLMTarget
from mmspec_ray.targets.llava_next import check_processor_parts


class LlavaOnevisionTarget(VLMTarget):
    """LLaVA-OneVision adapter: images (single: anyres, several: base views) and clips as native video."""

    family = "llava_onevision"
    model_types = ("llava_onevision",)
    takes_video = True

    def check_request(self, request: Request) -> None:
        super().check_request(request)
        check_processor_parts(self.processor, request, self.family, frames_as_images=False)
        lengths = sorted({len(clip) for clip in request.videos})
        if len(lengths) > 1:  # the model takes all clips of a request as one [videos, frames, C, H, W] tensor
            raise TargetError(f"{self.family} targets need every clip of a request to have the same number of "
                              f"frames (got {lengths}); sample the clips to equal frame counts or send them one "
                              "per request")

    def processor_inputs(self, text: str, request: Request) -> dict[str, Any]:
        kw: dict[str, Any] = {"text": text, "return_tensors": "pt"}
        if len(request.images) == 1:
            kw["images"] = list(request.images)
        elif request.images:
            kw["images"] = [list(request.images)]  # one sample's group: OneVision's multi-image regime
        if request.videos:
            kw["videos"] = [list(clip) for clip in request.videos]
        return dict(self.processor(**kw))


ADAPTERS = (LlavaOnevisionTarget,)
