"""Qwen2.5-VL family: dynamic-resolution ViT with 2x2 patch merging, native video, and 3-axis M-RoPE.

Under M-RoPE a prompt's media tokens share positions (an image of h x w merged tokens advances the position by only
max(h, w)), so after prefill the next position id is `prompt length + rope_delta`, with rope_delta <= 0 computed by
the model (`Qwen2_5_VLModel.rope_deltas`). Generated tokens are text: all three axes (temporal, height, width) carry
the same id, `seq_len + rope_delta + depth`, which is what HF's own decode step feeds the rotary embedding.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from mmspec_ray.targets.base import Request, TargetError, TargetOutput, VLMTarget, media_runs, split_run

# transformers' smart_resize refuses frames whose long side is more than this many times the short side.
MAX_ASPECT_RATIO = 200


class Qwen25VLTarget(VLMTarget):
    """Qwen2.5-VL: images and native video (a clip goes to the video processor as its list of frames)."""

    family = "qwen2_5_vl"
    display_name = "Qwen2.5-VL"  # how refusals name the family
    model_types = ("qwen2_5_vl",)
    takes_video = True

    def __init__(self, model, processor, feature_layers: tuple[int, ...] = ()) -> None:
        super().__init__(model, processor, feature_layers)
        self.rope_delta = 0  # next_pos - seq_len for this request: fixed at prefill, unchanged by commits

    def check_request(self, request: Request) -> None:
        """Refuse, with the fix, what the Qwen processor would reject with an opaque error deep inside."""
        super().check_request(request)
        for i, image in enumerate(request.images):
            self._check_frame(image.size, f"image {i}")
        for i, clip in enumerate(request.videos):
            if not clip:
                raise TargetError(f"video {i} has no frames; send at least one frame per clip")
            sizes = {frame.size for frame in clip}
            if len(sizes) > 1:
                raise TargetError(f"video {i} mixes frame sizes {sorted(sizes)}; resize its frames to one size")
            self._check_frame(clip[0].size, f"video {i}")

    @classmethod
    def _check_frame(cls, size: tuple[int, int], what: str) -> None:
        w, h = size
        if min(w, h) < 1 or max(w, h) / min(w, h) > MAX_ASPECT_RATIO:
            raise TargetError(f"{what} is {w}x{h}: {cls.display_name} takes images with an aspect ratio up to "
                              f"{MAX_ASPECT_RATIO}:1; crop or pad it")

    @torch.inference_mode()
    def prefill(self, inputs: dict[str, Any], logits_to_keep: int = 1, **probes: Any) -> TargetOutput:
        """Clear the model's cached rope_deltas first: a text-only prompt leaves the attribute untouched, so a
        stale value from an earlier media request (or an HF `generate`) would otherwise be read back."""
        self._mrope_model().rope_deltas = None
        return super().prefill(inputs, logits_to_keep, **probes)

    def media_pieces(self, ids: torch.Tensor, inputs: dict[str, Any] | None = None) -> list[tuple[int, int]]:
        """A clip is one run of video tokens: `video_grid_thw` t temporal groups (two frames each) of h x w / 4
        merged tokens, back to back; each group is one piece (the per-frame unit of this family). Images: one run
        each. Without `inputs` (stored features) the group count is unknown and a clip stays one piece."""
        grids = iter((inputs or {}).get("video_grid_thw", torch.zeros(0, 3)).tolist())
        video = ids == self.config.video_token_id
        out: list[tuple[int, int]] = []
        for a, b in media_runs(self.media_mask_of(ids)):
            n = int(next(grids, [1])[0]) if inputs is not None and bool(video[a]) else 1
            out += split_run(a, b, n) if n > 1 and (b - a) % n == 0 else [(a, b)]
        return out

    def after_prefill_position(self, inputs: dict[str, Any]) -> int:
        """Prompt length + the rope delta the model computed in this prefill (0 for a text-only prompt)."""
        deltas = self._mrope_model().rope_deltas
        self.rope_delta = 0 if deltas is None else int(deltas.reshape(-1)[0])
        return inputs["input_ids"].shape[1] + self.rope_delta

    def prompt_positions(self, inputs: dict[str, Any]) -> torch.Tensor | None:
        """[3, 1, n] the M-RoPE position ids the model gives the prompt (its own `get_rope_index`, called with the
        encoded inputs it takes); None for a text-only prompt, whose three axes all read i at position i."""
        if not any(k in inputs for k in ("image_grid_thw", "video_grid_thw")):
            return None
        model = self._mrope_model()
        params = inspect.signature(model.get_rope_index).parameters
        if "mm_token_type_ids" in params and "mm_token_type_ids" not in inputs:
            return None  # the model itself cannot place media by 3-axis ids without them
        with torch.inference_mode():
            pos, _ = model.get_rope_index(**{k: v for k, v in inputs.items() if k in params})
        return pos[-3:].long()

    def tree_positions(self, depth: torch.Tensor) -> torch.Tensor:
        """[3, 1, n] M-RoPE position ids (temporal, height, width), all equal to `next_pos + depth`.

        Three axes, not the four (text + 3) that HF's `generate` builds: the text axis only feeds mask construction
        and flash-attention packing, and we pass a ready 4D tree mask, so it would be ignored at best and misread
        as packed sequences (depths repeat across siblings) at worst."""
        pos = (self.next_pos + depth).view(1, 1, -1)
        return pos.expand(3, 1, -1)

    def _mrope_model(self):
        """The inner model (`Qwen2_5_VLModel`, ...) inside the ForConditionalGeneration wrapper; it owns `rope_deltas`
        and `get_rope_index`."""
        inner = getattr(self.model, "model", None)
        if inner is None or not hasattr(inner, "rope_deltas"):
            raise TargetError(f"{type(self.model).__name__} is not a {self.display_name} ForConditionalGeneration model; "
                              "load the checkpoint with AutoModelForImageTextToText")
        return inner


ADAPTERS = (Qwen25VLTarget,)
