"""Media in explicit chat messages: every family checks that the parts name exactly the request's media. Clips sent as
their frames (LLaVA, LLaVA-NeXT, Gemma3: families with no video input): explicit chat messages
name a clip with one {'type': 'video'} part, which becomes one image part per frame, and the processor gets images
and frames in the order the parts name them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL import Image

    from mmspec_ray.targets.request import Request


def media_parts(messages: list[dict]) -> list[str]:
    """Kinds of the media parts ({'type': 'image'} / {'type': 'video'}) of chat messages, in reading order."""
    kinds: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) or content is None:
            continue
        kinds += [p["type"] for p in content if isinstance(p, dict) and p.get("type") in ("image", "video")]
    return kinds


def media_count_error(request: Request, family: str) -> str | None:
    """Why explicit messages do not name exactly the request's media (one part per image / per clip), or None."""
    for i, clip in enumerate(request.videos):
        if len(clip) == 0:
            return f"video {i} has no frames; send at least one frame per clip"
    if request.messages is None:
        return None
    kinds = media_parts(request.messages)
    n_img, n_vid = kinds.count("image"), kinds.count("video")
    if n_img != len(request.images) or n_vid != len(request.videos):
        return (f"the messages name {n_img} image(s) and {n_vid} video(s) but the request carries "
                f"{len(request.images)} image(s) and {len(request.videos)} video(s); give one {{'type': 'image'}} "
                f"part per image and one {{'type': 'video'}} part per clip ({family} targets)")
    return None


def expand_video_parts(request: Request) -> list[dict]:
    """The request's messages with each {'type': 'video'} part replaced by one image part per frame of its clip."""
    clips = iter(request.videos)
    out = []
    for message in request.messages or []:
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


def media_in_order(request: Request) -> list[Image.Image]:
    """Images and clip frames in the order their placeholders appear in the prompt."""
    if request.messages is None:  # chat_content puts images first, then clips
        return list(request.images) + [f for clip in request.videos for f in clip]
    images, clips = iter(request.images), iter(request.videos)
    ordered: list[Image.Image] = []
    for kind in media_parts(request.messages):
        ordered += [next(images)] if kind == "image" else list(next(clips))
    return ordered
