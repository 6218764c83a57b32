"""Decode an image (bytes, path or URI) to an RGB PIL image: EXIF orientation applied, alpha on white."""

from __future__ import annotations

import io
import os
import re
import warnings

from PIL import Image, ImageOps, UnidentifiedImageError

from mmspec_ray.config import MediaLimits, S3Config
from mmspec_ray.media.errors import MediaError
from mmspec_ray.media.io import read_bytes

# Signatures of the formats we expect; used only to tell "corrupt" from "not an image at all".
_IMAGE_MAGIC = (
    b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"BM", b"II*\x00", b"MM\x00*", b"RIFF",
)


def load_image(source: bytes | str | os.PathLike, limits: MediaLimits | None = None,
               s3: S3Config | None = None, max_side: int | None = None, short_side: int | None = None) -> Image.Image:
    """Decode `source` (raw bytes, a local path, file:// or s3:// URI). Raises MediaError on any bad input.
    `max_side`: scale huge images down first (see `prescale_size`); `short_side`: see `check_shape`."""
    limits = limits or MediaLimits()
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    label = source if isinstance(source, str) else None
    data = read_bytes(source, limits, s3) if isinstance(source, str) else bytes(source)
    return decode_image_bytes(data, limits, label, max_side, short_side)


def prescale_size(w: int, h: int, side: int | None) -> tuple[int, int] | None:
    """The smaller size to give a processor whose largest working side is `side` (a crop / shortest edge, the
    largest anyres pinpoint, or sqrt of a max pixel count), or None to keep (w, h): only an image whose short edge
    exceeds `side` shrinks, to a short edge of `side` (aspect kept). The processor never needs more: a 336 px CLIP
    processor resizes the short edge to 336 itself; an 8k photo for Qwen2.5-VL (max 12.8 M pixels) becomes 3,584 px
    a side, what its own resize would keep."""
    if not side or min(w, h) <= side:
        return None
    s = side / min(w, h)
    return max(side, round(w * s)), max(side, round(h * s))


def processed_size(w: int, h: int, short_side: int) -> tuple[int, int]:
    """The size a shortest-edge processor (CLIP-style) resizes a w x h image to before it crops: the short side
    becomes `short_side` and the long side grows with the aspect ratio (a 20000 x 1 PNG at 96 px: 1,920,000 x 96)."""
    if w <= h:
        return short_side, max(short_side, int(h * short_side / w))
    return max(short_side, int(w * short_side / h)), short_side


def check_shape(w: int, h: int, limits: MediaLimits, short_side: int | None = None, label: str | None = None,
                what: str = "image") -> None:
    """Refuse, before any pixel is decoded, an aspect ratio past `limits.max_aspect_ratio` and an image that the
    target's processor would blow up past `limits.max_processed_pixels` when it scales the short side up to
    `short_side` (None: the processor does not resize that way): a few bytes of PNG must not cost gigabytes."""
    if w < 1 or h < 1:
        return
    ratio = max(w, h) / min(w, h)
    if ratio > limits.max_aspect_ratio:
        raise MediaError("aspect_ratio", f"{w}x{h} {what}: aspect ratio {_ratio(ratio)}:1 > limit "
                         f"{_ratio(limits.max_aspect_ratio)}:1 (media.limits.max_aspect_ratio); crop or pad it "
                         "nearer to square", label)
    if short_side:
        pw, ph = processed_size(w, h, short_side)
        if pw * ph > limits.max_processed_pixels:
            raise MediaError("aspect_ratio", f"{w}x{h} {what}: the target's processor scales its short side to "
                             f"{short_side} px, making it {pw}x{ph} = {pw * ph} pixels > limit "
                             f"{limits.max_processed_pixels} (media.limits.max_processed_pixels); crop or pad it "
                             f"nearer to square (aspect ratio {_ratio(ratio)}:1)", label)


def _ratio(r: float) -> str:
    """An aspect ratio as people write it: 20000, 199, 200.5, 1.8."""
    return f"{r:.1f}".rstrip("0").rstrip(".")


def shrink(img: Image.Image, side: int | None) -> Image.Image:
    """`img` resized to `prescale_size` (bicubic, as CLIP-style processors resize), or `img` itself."""
    size = prescale_size(img.width, img.height, side)
    return img.resize(size, Image.Resampling.BICUBIC) if size else img


def decode_image_bytes(data: bytes, limits: MediaLimits | None = None, label: str | None = None,
                       max_side: int | None = None, short_side: int | None = None) -> Image.Image:
    """Decode image bytes fully (no lazy loading), so that every error surfaces here; with `max_side`, huge
    images are scaled down (JPEG already while decoding) before they are kept. The shape is checked from the
    header, before decoding (`check_shape`)."""
    limits = limits or MediaLimits()
    if not data:
        raise MediaError("empty", "image has 0 bytes", label)
    if len(data) > limits.max_bytes:
        raise MediaError("too_large", f"{len(data)} bytes > limit {limits.max_bytes}", label)
    known = data.startswith(_IMAGE_MAGIC)
    if Image.MAX_IMAGE_PIXELS is not None and Image.MAX_IMAGE_PIXELS < limits.max_image_pixels:
        Image.MAX_IMAGE_PIXELS = limits.max_image_pixels  # Pillow's guard never below the job's limit
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            if w * h > limits.max_image_pixels:
                raise MediaError("too_large", f"{w}x{h} pixels > limit {limits.max_image_pixels}", label)
            check_shape(w, h, limits, short_side, label)
            small = prescale_size(w, h, max_side)
            if small and img.format == "JPEG":
                img.draft("RGB", small)  # decode at 1/2, 1/4 or 1/8 scale: never the full-size bitmap
            img.load()
    except MediaError:
        raise
    except UnidentifiedImageError as e:
        kind = "corrupt" if known else "unsupported"
        raise MediaError(kind, "not a decodable image (PNG, JPEG, GIF, WebP, BMP, TIFF expected)", label) from e
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:  # Pillow's own guard, at open
        size = re.search(r"\((\d+) pixels\)", str(e))
        raise MediaError("too_large", f"{size[1] + ' pixels' if size else 'the image'} > limit "
                         f"{limits.max_image_pixels} (media.limits.max_image_pixels)", label) from e
    except (OSError, SyntaxError, ValueError) as e:
        msg = str(e)
        kind = "truncated" if "truncated" in msg.lower() or "premature end" in msg.lower() else "corrupt"
        raise MediaError(kind, f"image data is damaged: {msg}", label) from e
    try:
        ImageOps.exif_transpose(img, in_place=True)  # in place: no second full-size copy
    except Exception:  # a broken EXIF block must not lose an otherwise good image
        pass
    return shrink(to_rgb(img), max_side)


def to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode -> RGB; transparent pixels are composited on white (what a viewer shows)."""
    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        bg = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(bg, rgba).convert("RGB")
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16/32-bit greyscale: scale to 8 bits instead of clipping.
        import numpy as np

        arr = np.asarray(img, dtype=np.float64)
        hi = arr.max() if arr.size and arr.max() > 0 else 1.0
        return Image.fromarray((arr / hi * 255.0).astype("uint8")).convert("RGB")
    return img.convert("RGB")
