"""OpenAI chat messages -> a `Request`: media parts are fetched to bytes here, then the batch layer's
`prepare_row` validates the messages and decodes the media (same limits, frame sampling and scaling as batch)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from mmspec_ray.batch.rows import RowError, prepare_row
from mmspec_ray.serve.errors import APIError, from_row_error
from mmspec_ray.serve.fetch import fetch_media
from mmspec_ray.serve.protocol import check_shape
from mmspec_ray.serve.settings import ServeSettings
from mmspec_ray.targets import Request

# OpenAI part type -> (the batch layer's placeholder part, the key holding {"url": ...})
MEDIA_PART_TYPES = {"image_url": "image", "video_url": "video"}
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
_INDEXED = re.compile(r"^(image|video)\[(\d+)\]")


def to_request(messages: list[Any], settings: ServeSettings, max_chars: int | None = None) -> Request:
    """Check, fetch and decode one chat request's messages. Raises APIError (400 / 413) naming the element. The
    shape, the text's length (`max_chars`, before any tokenizing) and the media count are checked before any media
    is fetched, so a refused request costs no reads."""
    limits = settings.limits
    check_shape(messages)
    chars = sum(len(t) for t in _texts(messages))
    if max_chars is not None and chars > max_chars:
        raise APIError(400, f"messages: {chars} characters of text; this server takes at most {max_chars} per "
                       "request (its context at a few characters per token: limits.max_prompt_chars)",
                       param="messages", code="context_length_exceeded")
    n_media = sum(1 for _, part in _parts(messages) if part["type"] in MEDIA_PART_TYPES)
    if n_media > limits.max_media_parts:
        raise APIError(400, f"messages: {n_media} image/video parts; this server takes at most "
                       f"{limits.max_media_parts} per request", param="messages", code="too_many_media_parts")
    media: dict[str, list[bytes]] = {"image": [], "video": []}
    where_of: dict[str, list[str]] = {"image": [], "video": []}
    rows: list[Any] = []
    for i, m in enumerate(messages):
        m = {k: v for k, v in m.items() if k in ("role", "content")}
        m["role"] = ROLE_ALIASES.get(m.get("role"), m.get("role"))
        if isinstance(m.get("content"), list):
            parts = []
            for j, part in enumerate(m["content"]):
                parts.append(_part(part, f"messages[{i}].content[{j}]", settings, media, where_of))
            m["content"] = parts
        rows.append(m)
    row = {"messages": rows, "image": media["image"] or None, "video": media["video"] or None}
    try:
        return prepare_row(row, settings.decode)
    except RowError as e:
        err = from_row_error(e)
        hit = _INDEXED.match(e.field)
        if hit:  # "image[1]: corrupt ..." -> the part it came from
            err.param = where_of[hit.group(1)][int(hit.group(2))]
            err.message = err.message.replace(e.field, err.param, 1)
        raise err from e


def _parts(messages: list[Any]) -> list[tuple[Mapping, Mapping]]:
    """(message, part) for every content part of shape-checked messages."""
    return [(m, p) for m in messages if isinstance(m.get("content"), list) for p in m["content"]]


def _texts(messages: list[Any]) -> list[str]:
    """Every text of shape-checked messages: string contents and the text of text parts."""
    out = [m["content"] for m in messages if isinstance(m.get("content"), str)]
    return out + [p["text"] for _, p in _parts(messages) if p["type"] == "text" and isinstance(p.get("text"), str)]


def remote_media(messages: list[Any]) -> bool:
    """True when some media part has a URL other than data: (fetching it is I/O). Safe on any JSON."""
    for m in messages:
        content = m.get("content") if isinstance(m, Mapping) else None
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, Mapping) else None
            if isinstance(kind, str) and kind in MEDIA_PART_TYPES:
                ref = part.get(kind)
                url = ref.get("url") if isinstance(ref, Mapping) else ref
                if not (isinstance(url, str) and url.startswith("data:")):
                    return True
    return False


def _part(part: Any, where: str, settings: ServeSettings, media: dict[str, list[bytes]],
          where_of: dict[str, list[str]]) -> Any:
    """One content part: text passes through (checked by the batch layer), media is fetched, others refused."""
    kind = part["type"]  # (shape checked by check_shape)
    if kind == "text":
        return dict(part)
    if kind not in MEDIA_PART_TYPES:
        raise APIError(400, f"{where}.type: unsupported content part type {kind!r}; this server takes text, "
                       "image_url and video_url parts", param=f"{where}.type", code="unsupported_content_type")
    ref = part.get(kind)
    url = ref.get("url") if isinstance(ref, Mapping) else ref
    media_kind = MEDIA_PART_TYPES[kind]
    limit = settings.limits.max_image_bytes if media_kind == "image" else settings.limits.max_video_bytes
    loc = f"{where}.{kind}"
    media[media_kind].append(fetch_media(url, media_kind, limit, loc, settings.decode.s3, settings.fetch))
    where_of[media_kind].append(loc)
    return {"type": media_kind}

