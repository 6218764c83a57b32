"""Row format: input columns -> a `Request` (with decoded media), and the output columns every row gets.

Input (docs/batch.md): `id`, `prompt` (or `messages`), media as `image` (bytes) / `image_uri` / `video` (bytes) /
`video_uri` (s3:// or local). A media cell may also hold a list (several images or clips). Anything wrong with one
row raises `RowError` naming the field; the pipeline turns it into that row's `error` and goes on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from mmspec_ray.batch.jobspec import DecodeConfig
from mmspec_ray.batch.storage import escape_invalid_utf8
from mmspec_ray.config import S3Config
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
    ("verify_cycles", pa.int32()),  # target forwards after the prefill
    ("guard_plain_cycles", pa.int32()),  # of those, decoded plainly by the payoff guard (decoding/payoff.py)
    # what the payoff guard did: drafted, fell_back, held, warm_up, one_token_tree; null: no guard
    ("payoff_guard", pa.string()),
    ("error", pa.string()),  # null on success; "<field>: <what was wrong>" otherwise
    ("error_kind", pa.string()),  # null on success; e.g. media.corrupt, null_field, too_long, internal
])
OUTPUT_COLUMNS = tuple(OUTPUT_SCHEMA.names)

# Internal columns between the media stage and the decoder actors (never written).
REQUEST_COL = "__mmspec_request"
ERROR_COL = "__mmspec_error"
ERROR_KIND_COL = "__mmspec_error_kind"
INTERNAL_COLUMNS = (REQUEST_COL, ERROR_COL, ERROR_KIND_COL)

MESSAGE_ROLES = ("system", "user", "assistant")
MEDIA_PARTS = {"image": "image", "video": "video"}


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


def readable_block(batch: pa.Table) -> tuple[pa.Table, list[RowError | None]]:
    """`batch` with every text value that is not valid UTF-8 made readable, and per row the error of its first such
    value (kind `invalid`), or None. A string column keeps the value with its invalid bytes as \\xNN escapes (so a
    non-UTF-8 `id` is written that way); in a nested column (a list of URIs...) the cell becomes null. Why: Arrow
    reads such bytes, but turning the block into Python rows would fail every row of it."""
    errors: list[RowError | None] = [None] * batch.num_rows
    for i, name in enumerate(batch.column_names):
        column = batch.column(i)
        if not _holds_text(column.type):
            continue
        fixed, bad = escape_invalid_utf8(column) if _is_text(column.type) else _null_invalid(column)
        if not bad:
            continue
        batch = batch.set_column(i, batch.field(i), fixed)
        for r in bad:
            errors[r] = errors[r] or RowError(name, "invalid", _not_utf8(name, column, r, fixed))
    return batch, errors


def _not_utf8(name: str, column: pa.ChunkedArray, row: int, fixed: pa.ChunkedArray) -> str:
    if not _is_text(column.type):
        return "holds text that is not valid UTF-8 (written as null); write it as UTF-8 strings"
    shown = fixed[row].as_py()
    shown = shown if len(shown) <= 60 else shown[:60] + "..."
    what = "the row's id is written as" if name == "id" else "invalid bytes written as \\xNN escapes:"
    return (f"is not valid UTF-8 text ({what} '{shown}'); write text columns as UTF-8, or bytes in a binary "
            "column")


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _holds_text(t: pa.DataType) -> bool:
    """Whether a column type is or contains strings (a list or struct of them...)."""
    return _is_text(t) or any(_holds_text(t.field(j).type) for j in range(t.num_fields))


def _null_invalid(column: pa.ChunkedArray) -> tuple[pa.ChunkedArray, list[int]]:
    """A nested column with each cell holding non-UTF-8 text set to null, and those cells' row indices."""
    try:
        column.validate(full=True)
        return column, []
    except pa.ArrowInvalid:
        pass
    values, bad = [], []
    for r in range(len(column)):
        try:
            values.append(column[r].as_py())
        except UnicodeDecodeError:
            values.append(None)
            bad.append(r)
    return pa.chunked_array([pa.array(values, type=column.type)], type=column.type), bad


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
    if messages is not None:
        messages = place_media(messages, len(images), len(videos))
    return Request(prompt=prompt, messages=messages, images=tuple(images), videos=tuple(videos))


def _text(row: Mapping[str, Any], cfg: DecodeConfig) -> tuple[str | None, list[dict] | None]:
    messages = row.get("messages")
    if messages is not None:
        if isinstance(messages, str):
            try:
                messages = json.loads(messages)
            except json.JSONDecodeError as e:
                raise RowError("messages", "invalid", f"not valid JSON ({e})") from e
        return None, check_messages(messages)
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
        if by_uri and item.startswith("s3://"):
            bucket, _, key = item[len("s3://"):].partition("/")
            if not bucket or not key or key.endswith("/"):
                raise RowError(where, "invalid", f"{item!r} names no object: an s3:// URI needs a bucket and an "
                               "object key (s3://bucket/path/file.png)")
        src = item if by_uri else bytes(item)
        side = cfg.media.image_side if isinstance(cfg.media.image_side, int) else None
        short = cfg.media.short_side if isinstance(cfg.media.short_side, int) else None  # ("auto": resolve first)
        try:
            if field.startswith("image"):
                out.append(load_image(src, limits=cfg.media.limits, s3=cfg.s3, max_side=side, short_side=short))
            else:
                clip = load_video(src, num_frames=cfg.media.num_frames, fps=cfg.media.fps,
                                  limits=cfg.media.limits, s3=cfg.s3, max_side=side, short_side=short)
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
    empty = [f for f in present if isinstance(row[f], (list, tuple)) and not row[f]]
    if empty:
        return RowError(empty[-1], "null_field", f"is an empty list; this job needs a {kind} per row")
    return RowError(present[-1], "null_field", f"is null; this job needs a {kind} per row")


def check_messages(messages: Any) -> list[dict]:
    """OpenAI-style messages -> a list of {role, content: [parts]}; a plain-string content becomes its text part.
    Raises RowError naming the first bad element (`messages[1].content[0].type` ...)."""
    if not isinstance(messages, list) or not messages:
        raise RowError("messages", "invalid", "expected a non-empty list of {role, content} messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise RowError(where, "invalid", f"expected a {{role, content}} object, got {type(m).__name__}")
        if m.get("role") not in MESSAGE_ROLES:
            raise RowError(f"{where}.role", "invalid", f"is {m.get('role')!r}; expected one of {list(MESSAGE_ROLES)}")
        content = m.get("content")
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, list) and content:
            parts = [_check_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]
        else:
            raise RowError(f"{where}.content", "invalid", "expected a string or a non-empty list of parts")
        out.append({"role": m["role"], "content": parts})
    return out


def _check_part(part: Any, where: str) -> dict:
    if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
        raise RowError(where, "invalid", "expected a part like {\"type\": \"text\", \"text\": ...}")
    kind = part["type"]
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise RowError(f"{where}.text", "invalid", "a text part needs a string `text`")
        return {"type": "text", "text": part["text"]}
    if kind in MEDIA_PARTS:
        return {"type": kind}
    raise RowError(f"{where}.type", "invalid", f"part type {kind!r} is not supported in batch rows; use text, image "
                   "or video parts and put the media itself in the image / image_uri / video / video_uri columns")


def place_media(messages: list[dict], n_images: int, n_videos: int) -> list[dict]:
    """Messages whose media parts match the row's media: when they name none, the row's images then clips go at
    the start of the last user message (where a bare prompt puts them); otherwise the counts must agree."""
    named = [p["type"] for m in messages for p in m["content"] if p["type"] in MEDIA_PARTS]
    if not named:
        if not n_images and not n_videos:
            return messages
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            raise RowError("messages", "invalid", "the row carries media but the messages have no user turn")
        last = users[-1]
        media = [{"type": "image"}] * n_images + [{"type": "video"}] * n_videos
        return [dict(m, content=media + m["content"]) if i == last else m for i, m in enumerate(messages)]
    if named.count("image") != n_images or named.count("video") != n_videos:
        raise RowError("messages", "invalid", f"the messages name {named.count('image')} image and "
                       f"{named.count('video')} video part(s) but the row carries {n_images} image(s) and "
                       f"{n_videos} video(s); name one part per item, or none to put them all first")
    return messages


def resolve_image_side(cfg: DecodeConfig) -> DecodeConfig:
    """`cfg` with media.image_side and media.short_side "auto" replaced by the target's processor sizes, read from the
    checkpoint's processor configs (local or s3://, a few small JSON files; never the weights); None when they say
    nothing."""
    media = cfg.media
    if media.image_side != "auto" and media.short_side != "auto":
        return cfg
    from mmspec_ray.targets.media_size import max_side_of, short_side_of

    configs = processor_configs(cfg.target, cfg.s3)
    update = {k: f(configs) for k, f in (("image_side", max_side_of), ("short_side", short_side_of))
              if getattr(media, k) == "auto"}
    return cfg.model_copy(update={"media": media.model_copy(update=update)})


def processor_configs(target: str, s3: S3Config) -> list[dict]:
    """The target checkpoint's saved processor config dicts (those present). Raises JobInputError when one exists
    but cannot be read: sizing media must never be turned off silently by a failed read."""
    from mmspec_ray.batch.storage import JobInputError, exists, locate, read_json
    from mmspec_ray.targets.media_size import PROCESSOR_FILES

    root = locate(target, s3)
    configs = []
    for name in PROCESSOR_FILES:
        f = root.child(name)
        try:
            if not exists(f):
                continue
            configs.append(read_json(f))
        except (OSError, ValueError) as e:
            raise JobInputError(f"cannot read {root.child(name).uri} to size media for the target ({e}); set "
                                "media.image_side and media.short_side explicitly, or re-run when it is readable"
                                ) from e
    return configs

