"""Mistral3 family (`Mistral3ForConditionalGeneration`, model_type "mistral3": Mistral Small 3.1 / 3.2 and the
other checkpoints of that class): Pixtral vision tower (2-D RoPE over the patch grid, any image size) + patch merger
(`spatial_merge_size`) + projector + Mistral decoder.

Media tokens. `PixtralProcessor` expands one `[IMG]` placeholder into the image's merged patch grid, row by row:
each row is `[IMG] * cols` followed by `[IMG_BREAK]`, and the last row ends with `[IMG_END]` instead. The model
scatters the vision features into the `[IMG]` positions (`config.image_token_id`); breaks and ends keep their token
embeddings. The media tokens here are `[IMG]` and `[IMG_BREAK]`:

* `[IMG_BREAK]` is the row separator inside an image, the role LLaVA-NeXT's image-newline feature plays (a media
  position there). Counting it as media makes each image one contiguous run, from its first `[IMG]` to its
  `[IMG_END]`: one media piece per image (the base's `media_pieces`), which is what per-image compression (SpecFlash,
  ViSpec) summarises, and the media mask covers exactly the pieces, as the drafters expect. Counting `[IMG]` alone
  would cut every image into one piece per row.
* `[IMG_END]` stays text, like Gemma3's end-of-image token: it closes the image, so two images back to back are two
  runs.

Positions: the decoder uses plain 1-D RoPE (the 2-D RoPE is inside the vision tower), so the generic prefill, tree
positions, verify and commit apply unchanged; a text config with a sliding window is handled by the base mask.

No video input: a clip is refused, not sent as frames, as every frame would be a full-resolution image (up to
1540 px on the released checkpoints: thousands of tokens each). Pick a few frames and send them as images.
"""

from __future__ import annotations

from mmspec_ray.targets.base import InvalidRequest, Request, TargetError, VLMTarget
from mmspec_ray.targets.placeholders import typed_placeholder

BREAK, END = "[IMG_BREAK]", "[IMG_END]"


class Mistral3Target(VLMTarget):
    """Adapter for `Mistral3ForConditionalGeneration` with a `PixtralProcessor`."""

    family = "mistral3"
    model_types = ("mistral3",)
    takes_video = False
    video_as_frames = False

    def __init__(self, model, processor, feature_layers: tuple[int, ...] = ()) -> None:
        super().__init__(model, processor, feature_layers)
        self.break_token = getattr(processor, "image_break_token", BREAK)
        self.end_token = getattr(processor, "image_end_token", END)
        ids = [self.tokenizer.convert_tokens_to_ids(t) for t in (self.break_token, self.end_token)]
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if any(i is None or i == unk for i in ids):
            raise TargetError(f"mistral3: the tokenizer has no {self.break_token} / {self.end_token} token; use the "
                              "checkpoint's own tokenizer and PixtralProcessor")
        self.break_id, self.end_id = ids

    @property
    def media_token_ids(self) -> set[int]:
        """`[IMG]` (vision features) and `[IMG_BREAK]` (an image's row separator): see the module docstring."""
        return super().media_token_ids | {self.break_id}

    def check_request(self, request: Request) -> None:
        if request.videos:
            raise TargetError(
                "mistral3 targets take no video: the model has no video input and each frame would be a "
                "full-resolution image; send a few chosen frames as images, or use a video model (e.g. Qwen2.5-VL)")
        typed = typed_placeholder(request.prompt, request.messages,
                                  {self.break_token: "image", self.end_token: "image"})
        if typed:  # would end or split an image in the prompt's layout
            field, kind, token = typed
            raise InvalidRequest(f"{field} contains the {kind} layout token {token!r}; remove it: the processor "
                                 "writes each image's row breaks and end itself")
        super().check_request(request)


ADAPTERS = (Mistral3Target,)
