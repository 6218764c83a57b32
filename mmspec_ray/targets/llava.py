"""LLaVA-1.5 family (and the toy target): CLIP tower + projector; a clip is sent as its frames, one image each."""

from __future__ import annotations

from typing import Any

import torch

from mmspec_ray.targets.base import VLMTarget, media_runs, split_run


class LlavaTarget(VLMTarget):
    family = "llava"
    model_types = ("llava",)
    video_as_frames = True

    def tokens_per_image(self) -> int:
        """Media tokens of one image: the vision tower's patch grid (+ the CLS feature when it is kept)."""
        vc = self.config.vision_config
        full = getattr(self.config, "vision_feature_select_strategy", "default") == "full"
        return (vc.image_size // vc.patch_size) ** 2 + int(full)

    def media_pieces(self, ids: torch.Tensor, inputs: dict[str, Any] | None = None) -> list[tuple[int, int]]:
        """Images and a clip's frames sit back to back (one run of placeholders): cut each run into images of
        `tokens_per_image` tokens (a run that is no whole number of images stays one piece)."""
        per = self.tokens_per_image()
        return [p for a, b in media_runs(self.media_mask_of(ids))
                for p in (split_run(a, b, (b - a) // per) if (b - a) % per == 0 else [(a, b)])]


ADAPTERS = (LlavaTarget,)
