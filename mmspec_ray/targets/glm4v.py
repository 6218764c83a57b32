"""GLM-4.1V family (`glm4v`, Glm4vForConditionalGeneration) and its MoE sibling GLM-4.5V (`glm4v_moe`,
Glm4vMoeForConditionalGeneration): a dynamic-resolution ViT downsampled 2x2, native video, and 3-axis M-RoPE over
GLM's partial rotary embedding. Their interface to this engine is Qwen3-VL's; the MoE model differs only inside its
text MLPs, which the engine never touches, so it takes the same adapter under its own model type.

- Media tokens: an image is `<|begin_of_image|>`, one `<|image|>` per merged 2x2 patch, `<|end_of_image|>`. A clip is
  `<|begin_of_video|>`, then per temporal group (two frames) its own `<|begin_of_image|> <|image|>... <|end_of_image|>`
  followed by the group's timestamp in whole seconds as text, then `<|end_of_video|>`. Video positions carry the
  image token too (the config's `video_token_id`, `<|video|>`, is only the chat template's placeholder, gone once the
  processor expands it); the processor's `mm_token_type_ids` (1 image, 2 inside a video) tells the model which is
  which, and `encode` passes everything the processor returns.
- Media pieces: every run of media tokens is one piece, an image or one temporal group of a clip, with or without
  the encoded inputs (begin / end tokens and timestamps separate them).
- Positions: the model computes them at prefill (`Glm4vModel.get_rope_index`, each temporal group laid out as an
  image of its own, the next text position after a group advancing by max(h, w) merged patches) and keeps the rope
  delta (`Glm4vModel.rope_deltas`). Generated tokens are text: all three axes carry `prompt length + rope_delta +
  depth`, as HF's decode step gives them, so tree positions are Qwen2.5-VL's. The text-only rotary halves of each
  head need nothing: the model applies its rotary embedding to the positions it is given.

A clip's frames are the request's frames: the video processor's own frame sampling (2 fps, which needs the clip's
fps) is turned off (`do_sample_frames=False`), as the request's clip is already sampled. The processor then times
the frames at 24 fps, as transformers does for frames without metadata, so short clips read "0" seconds.

Images and a clip in one request are refused: the model finds image and video features both by the image token
(`Glm4vModel.get_placeholder_mask`), so with both kinds present neither count matches and HF's own forward fails.
"""

from __future__ import annotations

from mmspec_ray.targets.base import Request, TargetError
from mmspec_ray.targets.qwen2_5_vl import Qwen25VLTarget
from mmspec_ray.targets.qwen3_vl import Qwen3VLTarget


class Glm4vTarget(Qwen3VLTarget):
    """GLM-4.1V: images and native video (clips of at least two frames), 3-axis M-RoPE with the model's rope delta."""

    family = "glm4v"
    display_name = "GLM-4.1V"
    model_types = ("glm4v",)

    def check_request(self, request: Request) -> None:
        """Qwen2.5-VL's checks (frame sizes, aspect ratio), plus: a clip needs at least one temporal group of
        frames (GLM's video resize refuses shorter clips), and images or video, not both in one request (see the
        module docstring)."""
        Qwen25VLTarget.check_request(self, request)
        need = self._frames_per_group()
        for i, clip in enumerate(request.videos):
            if len(clip) < need:
                raise TargetError(f"video {i} has {len(clip)} frame(s): {self.display_name} takes clips of at least "
                                  f"{need} frames; send more frames, or send a single frame as an image")
        if request.images and request.videos:
            raise TargetError(f"{self.display_name} takes images or video in one request, not both: its model "
                              "places both on the image token and cannot tell them apart; send the clip's frames as "
                              "images, or the images and the clip in separate requests")


class Glm4vMoeTarget(Glm4vTarget):
    """GLM-4.5V (MoE): the GLM-4.1V adapter under its own model type (the sparse text MLPs are inside the model)."""

    family = "glm4v_moe"
    display_name = "GLM-4.5V"
    model_types = ("glm4v_moe",)


ADAPTERS = (Glm4vTarget, Glm4vMoeTarget)
