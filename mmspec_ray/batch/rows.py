"""Row format: input columns -> a `Request` (with decoded media), and the output columns every row gets.

Input (DESIGN §4): `id`, `prompt` (or `messages`), media as `image` (bytes) / `image_uri` / `video` (bytes) /
`video_uri` (s3:// or local). A media cell may also hold a list (several images or clips). Anything wrong with one
row raises `RowError` naming the field; the pipeline turns it into that row's `error` and goes on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from mmspec_ray.batch.spec import DecodeConfig
from mmspec_ray.media import MediaError, load_image, load_video
from mmspec_ray.targets.base import Request

IMAGE_FIELDS = ("image", "image_uri")
VIDEO_FIELDS = ("video", "video_uri")
MEDIA_FIELDS = IMAGE_FIELDS + VIDEO_FIELDS

# Columns appended to every input row (typed, so that all-error blocks have the same schema as good ones).
OUTPUT_SCHEMA = pa.schema([
    ("output_text", pa.string()),
    ("output_token_ids", pa.list_(pa.int32())),
    ("finish_reason", pa.string()),
    ("num_output_tokens", pa.int32()),
    ("accepted_per_cycle", pa.float64()),  # mean accepted draft tokens per verify cycle (bonus token excluded)
    ("decode_seconds", pa.float64()),  # generation wall time of this row (media decoding excluded)
    ("error", pa.string()),  # null on success; "<field>: <what was wrong>" otherwise
    ("error_kind", pa.string()),  # null on success; e.g. media.corrupt, null_field, too_long, internal
])
OUTPUT_COLUMNS = tuple(OUTPUT_SCHEMA.names)

# Internal columns between the media stage and the decoder actors (never written).
REQUEST_COL = "__mmspec_request"
ERROR_COL = "__mmspec_error"
ERROR_KIND_COL = "__mmspec_error_kind"
INTERNAL_COLUMNS = (REQUEST_COL, ERROR_COL, ERROR_KIND_COL)


class RowError(ValueError):
    """One row cannot be decoded. `field` names the column, `kind` is machine-readable, the message says why."""

    def __init__(self, field: str, kind: str, message: str) -> None:
        self.field = field
        self.kind = kind
        super().__init__(f"{field}: {message}")


def error_output(message: str, kind: str) -> dict[str, Any]:
    """The output columns of a row that failed."""
    out: dict[str, Any] = {name: None for name in OUTPUT_COLUMNS}
    out.update(error=message, error_kind=kind)
    return out


def prepare_row(row: Mapping[str, Any], cfg: DecodeConfig) -> Request:
    """Validate a row and decode its media into a `Request`. Raises `RowError` naming the bad field."""
    prompt, messages = _text(row, cfg)
    _check_exclusive(row, IMAGE_FIELDS)
    _check_exclusive(row, VIDEO_FIELDS)
    images = [img for field in IMAGE_FIELDS for img in _media(row, field, cfg)]
    videos = [clip for field in VIDEO_FIELDS for clip in _media(row, field, cfg)]
    need = cfg.media.require
    if need == "image" and not images:
        raise _missing_media(row, IMAGE_FIELDS, "image")
    if need == "video" and not videos:
        raise _missing_media(row, VIDEO_FIELDS, "video")
    return Request(prompt=prompt, messages=messages, images=tuple(images), videos=tuple(videos))


def _text(row: Mapping[str, Any], cfg: DecodeConfig) -> tuple[str | None, list[dict] | None]:
    messages = row.get("messages")
    if messages is not None:
        if isinstance(messages, str):
            try:
                messages = json.loads(messages)
            except json.JSONDecodeError as e:
                raise RowError("messages", "invalid", f"not valid JSON ({e})") from e
        if not isinstance(messages, list) or not messages:
            raise RowError("messages", "invalid", "expected a non-empty list of {role, content} messages")
        return None, messages
    if "prompt" not in row:
        if cfg.default_prompt is None:
            raise RowError("prompt", "missing_field", "no prompt column (and no messages); add one or set "
                           "decode.default_prompt")
        return cfg.default_prompt, None
    prompt = row["prompt"]
    if prompt is None:
        raise RowError("prompt", "null_field", "is null; every row needs a prompt (or messages)")
    if not isinstance(prompt, str):
        raise RowError("prompt", "invalid", f"expected a string, got {type(prompt).__name__}")
    return prompt, None


def _media(row: Mapping[str, Any], field: str, cfg: DecodeConfig) -> list:
    """Decoded images (PIL) or clips (tuple of PIL frames) of one media column; [] when null or absent."""
    value = row.get(field)
    if value is None:
        return []
    is_list = isinstance(value, (list, tuple))
    items = list(value) if is_list else [value]
    by_uri = field.endswith("_uri")
    out = []
    for i, item in enumerate(items):
        where = f"{field}[{i}]" if is_list else field
        if item is None:
            raise RowError(where, "null_field", "is null")
        if by_uri and not isinstance(item, str):
            raise RowError(where, "invalid", f"expected a path or s3:// URI string, got {type(item).__name__}")
        if not by_uri and not isinstance(item, (bytes, bytearray, memoryview)):
            raise RowError(where, "invalid", f"expected encoded bytes, got {type(item).__name__}; put paths and "
                           f"URIs in {field}_uri")
        if by_uri and not item:
            raise RowError(where, "invalid", "is an empty string")
        src = item if by_uri else bytes(item)
        try:
            if field.startswith("image"):
                out.append(load_image(src, limits=cfg.media.limits, s3=cfg.s3))
            else:
                clip = load_video(src, num_frames=cfg.media.num_frames, fps=cfg.media.fps,
                                  limits=cfg.media.limits, s3=cfg.s3)
                out.append(tuple(clip.frames))
        except MediaError as e:
            raise RowError(where, f"media.{e.kind}", str(e)) from e
    return out


def _check_exclusive(row: Mapping[str, Any], fields: tuple[str, str]) -> None:
    if all(row.get(f) is not None for f in fields):
        raise RowError(fields[0], "invalid", f"give {fields[0]} or {fields[1]}, not both")


def _missing_media(row: Mapping[str, Any], fields: tuple[str, str], kind: str) -> RowError:
    present = [f for f in fields if f in row]
    if not present:
        return RowError(fields[1], "missing_field", f"this job needs a {kind} per row: add a {fields[0]} (bytes) "
                        f"or {fields[1]} column")
    return RowError(present[-1], "null_field", f"is null; this job needs a {kind} per row")
