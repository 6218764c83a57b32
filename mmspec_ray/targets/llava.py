"""LLaVA-1.5 family (and the toy target): CLIP tower + projector; a clip is sent as its frames, one image each."""

from __future__ import annotations

from mmspec_ray.targets.base import VLMTarget


class LlavaTarget(VLMTarget):
    family = "llava"
    model_types = ("llava",)
    video_as_frames = True


ADAPTERS = (LlavaTarget,)
