"""Qwen2-VL family: Qwen2.5-VL's predecessor, the same interface to this engine: dynamic-resolution ViT with 2x2 patch
merging, native video, 3-axis M-RoPE with the rope delta the model computes at prefill (`Qwen2VLModel.rope_deltas`).
Its vision tower differs (no window attention, a LayerNorm MLP), which the engine never touches, so the adapter is
Qwen2.5-VL's under its own model type.
"""

from __future__ import annotations

from mmspec_ray.targets.qwen2_5_vl import Qwen25VLTarget


class Qwen2VLTarget(Qwen25VLTarget):
    """Qwen2-VL: images and native video, M-RoPE positions as Qwen2.5-VL."""

    family = "qwen2_vl"
    display_name = "Qwen2-VL"
    model_types = ("qwen2_vl",)


ADAPTERS = (Qwen2VLTarget,)
