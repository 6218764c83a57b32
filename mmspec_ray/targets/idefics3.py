"""Idefics3 family (Idefics3-8B-Llama3, SmolVLM v1, both model_type "idefics3"): SigLIP tower + pixel-shuffle
connector + Llama decoder.

The processor splits each image into tiles plus a global view and expands one <image> placeholder into
`<fake_token_around_image><row_i_col_j><image>*k ...<global-img><image>*k<fake_token_around_image>`; only the
<image> positions carry vision features, so the media mask counts exactly those. Positions are plain 1-D and the
decoder is a full-attention Llama, so the generic prefill / tree verify / commit apply unchanged.

Clips are rejected, not sent as frames: Idefics3 has no video input and was not trained on clips, and every
frame would be tiled like a still image (up to 17 x 169 tokens per frame on the released checkpoints).
The caller can pick frames and send them as images if that is really wanted.
"""

from __future__ import annotations

from mmspec_ray.targets.base import Request, TargetError, VLMTarget


class Idefics3Target(VLMTarget):
    """Adapter for `Idefics3ForConditionalGeneration`."""

    family = "idefics3"
    model_types = ("idefics3",)
    takes_video = False
    video_as_frames = False

    def check_request(self, request: Request) -> None:
        if request.videos:
            raise TargetError(
                "idefics3 targets take no video: the model has no video input and each frame would be tiled like a "
                "full image; send a few chosen frames as images, or use a video model (e.g. SmolVLM2, Qwen2.5-VL)")
        super().check_request(request)


ADAPTERS = (Idefics3Target,)
