"""LLaVA-NeXT (v1.6) family: CLIP tower + projector with anyres tiling (`image_sizes`, `image_grid_pinpoints`).

Each image becomes a base view plus a grid of tiles picked from the grid pinpoints; the processor expands one
`<image>` placeholder into base + unpadded grid + row-newline tokens, so token counts depend on each image's
aspect ratio. The family has no video input: a clip is sent as its frames, each frame one (tiled) image, in the
order the message parts name them. Text positions are plain 1D RoPE, so tree verification needs no override.
"""

from __future__ import annotations

from typing import Any

from PIL import Image

from mmspec_ray.targets.base import Request, TargetError, VLMTarget


def media_parts(messages: list[dict]) -> list[str]:
    """Kinds of the media parts ({'type': 'image'} / {'type': 'video'}) of chat messages, in reading order."""
    kinds: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) or content is None:
            continue
        kinds += [p["type"] for p in content if isinstance(p, dict) and p.get("type") in ("image", "video")]
    return kinds


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


def check_media_counts(request: Request, family: str) -> None:
    """Explicit `messages` must name exactly the media the request carries (one part per image / per clip)."""
    for i, clip in enumerate(request.videos):
        if len(clip) == 0:
            raise TargetError(f"video {i} has no frames; send at least one frame per clip")
    if request.messages is None:
        return
    kinds = media_parts(request.messages)
    n_img, n_vid = kinds.count("image"), kinds.count("video")
    if n_img != len(request.images) or n_vid != len(request.videos):
        raise TargetError(
            f"the messages name {n_img} image(s) and {n_vid} video(s) but the request carries "
            f"{len(request.images)} image(s) and {len(request.videos)} video(s); give one {{'type': 'image'}} part "
            f"per image and one {{'type': 'video'}} part per clip ({family} targets)")


class LlavaNextTarget(VLMTarget):
    """LLaVA-NeXT adapter: anyres images; clips are sent as frames (one tiled image per frame)."""

    family = "llava_next"
    model_types = ("llava_next",)
    video_as_frames = True

    def check_request(self, request: Request) -> None:
        super().check_request(request)
        check_media_counts(request, self.family)
        check_processor_parts(self.processor, request, self.family, frames_as_images=True)

    def messages(self, request: Request) -> list[dict]:
        """Explicit messages get each {'type': 'video'} part replaced by one image part per frame of its clip."""
        if request.messages is None:
            return super().messages(request)
        clips = iter(request.videos)
        out = []
        for message in request.messages:
            content = message.get("content")
            if isinstance(content, str) or content is None:
                out.append(message)
                continue
            parts: list[dict] = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "video":
                    parts += [{"type": "image"} for _ in next(clips)]
                else:
                    parts.append(part)
            out.append({**message, "content": parts})
        return out

    def media_in_order(self, request: Request) -> list[Image.Image]:
        """Images and clip frames in the order their placeholders appear in the prompt."""
        if request.messages is None:  # chat_content puts images first, then clips
            return list(request.images) + [f for clip in request.videos for f in clip]
        images, clips = iter(request.images), iter(request.videos)
        ordered: list[Image.Image] = []
        for kind in media_parts(request.messages):
            if kind == "image":
                ordered.append(next(images))
            else:
                ordered += list(next(clips))
        return ordered

    def processor_inputs(self, text: str, request: Request) -> dict[str, Any]:
        kw: dict[str, Any] = {"text": text, "return_tensors": "pt"}
        images = self.media_in_order(request)
        if images:
            kw["images"] = images
        return dict(self.processor(**kw))


ADAPTERS = (LlavaNextTarget,)
