"""How large the checkpoint's processors make images: the bound the batch media stage scales huge inputs down to.

Read from the saved processor configs (no model load), so the driver can resolve it once per job.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_SIDE_KEYS = ("shortest_edge", "longest_edge", "height", "width")
_PIXELS = 65_536  # a "side" from this up is a pixel count (Qwen2-VL keeps min/max pixels under size.*_edge; Qwen3-VL's
# minimum is exactly 256 x 256 = 65536)


PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")


def max_side_of(configs: list[dict[str, Any]]) -> int | None:
    """The largest side, in pixels, that an image or video processor resizes to (crop, longest edge, anyres grid
    pinpoints, sqrt of a max pixel count), from its saved config dicts; None when none says."""
    return _largest(configs, _sides)


def short_side_of(configs: list[dict[str, Any]]) -> int | None:
    """The short side, in pixels, that an image or video processor resizes every input to before it crops (CLIP-style:
    a `shortest_edge` with no `longest_edge`, or a bare `size`): the long side then grows with the aspect ratio,
    which is what media.limits.max_processed_pixels bounds. None when no processor resizes that way (a fixed height x
    width, a longest edge, a pixel count or anyres tiles bound the processed size by themselves)."""
    return _largest(configs, _short_side)


def _largest(configs: list[dict[str, Any]], sides_of: Callable[[dict[str, Any]], list[int]]) -> int | None:
    """The largest of `sides_of` over every processor config (a processor_config.json nests its image and video
    processors' dicts), or None."""
    sides = [side for d in configs for sub in (d, d.get("image_processor"), d.get("video_processor"))
             if isinstance(sub, dict) for side in sides_of(sub)]
    return max(sides) if sides else None


def _short_side(d: dict[str, Any]) -> list[int]:
    if d.get("image_grid_pinpoints") or isinstance(d.get("max_pixels"), (int, float)):
        return []
    v = d.get("size")
    if isinstance(v, dict) and "longest_edge" not in v and "max_pixels" not in v:
        v = v.get("shortest_edge")
    return [int(v)] if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < _PIXELS else []


def _sides(d: dict[str, Any]) -> list[int]:
    out: list[int] = []
    for key in ("size", "crop_size", "max_image_size"):
        v = d.get(key)
        if isinstance(v, (int, float)):
            out.append(int(v))
        elif isinstance(v, dict):
            out += [int(x) for k, x in v.items() if k in _SIDE_KEYS and isinstance(x, (int, float))]
            if isinstance(v.get("max_pixels"), (int, float)):
                out.append(int(v["max_pixels"]))
    if isinstance(d.get("max_pixels"), (int, float)):
        out.append(int(d["max_pixels"]))
    pins = d.get("image_grid_pinpoints")
    if isinstance(pins, list) and pins:
        out.append(max(int(x) for p in pins for x in p))
    return [int(x ** 0.5) if x >= _PIXELS else x for x in out if x > 0]
