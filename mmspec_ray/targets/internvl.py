"""InternVL family (InternVL3 and later in transformers' format, model_type "internvl",
`InternVLForConditionalGeneration`): InternViT tower + pixel-shuffle projector + Qwen2 decoder.

How a request is laid out:

- Images: the GotOCR2 image processor crops each image to tiles of the tower's input size on the grid closest to its
  aspect ratio (`crop_to_patches`, between `min_patches` and `max_patches` tiles), plus a thumbnail of the whole image
  when that makes more than one tile. The processor expands the image placeholder to
  `<img>` + `<IMG_CONTEXT>` * (image_seq_length * tiles) + `</img>`: the tiles' tokens back to back in one run.
- Video: each clip goes to the video processor as its list of frames (each resized to one tile, never cropped); the
  video placeholder becomes one `Frame{i}: <img>` + `<IMG_CONTEXT>` * image_seq_length + `</img>` line per frame.
  Frames reach the model as images: the processor merges every image's tiles and every frame into one
  `pixel_values` in prompt order, and frames use the same `<IMG_CONTEXT>` token (the config has no video token).
  All clips of a request are stacked into one [videos, frames, C, H, W] tensor, so they need equal frame counts.

Only the `<IMG_CONTEXT>` positions carry vision features, so they are the media mask; `<img>` / `</img>` and the
frame labels are text. Media pieces: every run of `<IMG_CONTEXT>` is one piece, which is one image (all its tiles
and its thumbnail) or one video frame, with or without the encoded inputs.

Positions are plain 1-D RoPE (a Qwen2 decoder, full attention), so the generic prefill, tree verify and commit apply
unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from mmspec_ray.targets.base import Request, VLMTarget, media_runs
from mmspec_ray.targets.llava_next import check_equal_clips, check_processor_parts


class InternVLTarget(VLMTarget):
    """Adapter for `InternVLForConditionalGeneration`: tiled images and clips through the video processor."""

    family = "internvl"
    model_types = ("internvl",)
    takes_video = True
    clips_as_sent = True  # no second frame sampling, whatever the saved video processor config says

    def check_request(self, request: Request) -> None:
        super().check_request(request)
        check_processor_parts(self.processor, request, self.family, frames_as_images=False)
        check_equal_clips(request, self.family)

    def media_pieces(self, ids: torch.Tensor, inputs: dict[str, Any] | None = None) -> list[tuple[int, int]]:
        """Every run of `<IMG_CONTEXT>` tokens is one piece: an image (its tiles and thumbnail back to back) or one
        video frame (frames are separated by `</img>`, a newline and the next frame's label)."""
        return media_runs(self.media_mask_of(ids))


ADAPTERS = (InternVLTarget,)
