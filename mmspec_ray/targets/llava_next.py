"""LLaVA-NeXT (v1.6) family: CLIP tower + projector with anyres tiling (`image_sizes`, `image_grid_pinpoints`).

Each image becomes a base view plus a grid of tiles picked from the grid pinpoints; the processor expands one
`<image>` placeholder into base + unpadded grid + row-newline tokens, so token counts depend on each image's
aspect ratio. The family has no video input: a clip is sent as its frames, each frame one (tiled) image, in the
order the message parts name them. Text positions are plain 1D RoPE, so tree verification needs no override.
"""

from __future__ import annotations

from typing import Any

from mmspec_ray.targets.base import Request, TargetError, VLMTarget


def check_processor_parts(processor: Any, request: Request, family: str, frames_as_images: bool) -> None:
    """The processor must have the sub-processor each media kind needs. AutoProcessor.from_pretrained silently
    returns a bare tokenizer when a family's processor cannot be built (e.g. OneVision without torchvision)."""
    if (request.images or (request.videos and frames_as_images)) and \
            getattr(processor, "image_processor", None) is None:
        raise TargetError(f"this {family} target's processor has no image processor (a bare tokenizer?); save the "
                          "checkpoint's full processor and install what it needs (torchvision for some families), "
                          "or send text only")
    if request.videos and not frames_as_images and getattr(processor, "video_processor", None) is None:
        raise TargetError(f"this {family} target's processor has no video processor; save the checkpoint's full "
                          "processor and install what it needs (torchvision for video processors), or send the "
                          "clip's frames as images")


def check_equal_clips(request: Request, family: str) -> None:
    """Families that stack every clip of a request into one [videos, frames, C, H, W] tensor need equal frame
    counts."""
    lengths = sorted({len(clip) for clip in request.videos})
    if len(lengths) > 1:
        raise TargetError(f"{family} targets need every clip of a request to have the same number of frames (got "
                          f"{lengths}); sample the clips to equal frame counts or send them one per request")


class LlavaNextTarget(VLMTarget):
    """LLaVA-NeXT adapter: anyres images; clips are sent as frames (one tiled image per frame)."""

    family = "llava_next"
    model_types = ("llava_next",)
    video_as_frames = True

    def check_request(self, request: Request) -> None:
        super().check_request(request)  # media counts of explicit messages: checked there for frame families
        check_processor_parts(self.processor, request, self.family, frames_as_images=True)


ADAPTERS = (LlavaNextTarget,)
