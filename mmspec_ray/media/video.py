"""Decode a video (bytes, path or URI) with PyAV and sample frames uniformly or at a fixed fps."""

from __future__ import annotations

import io
import os
import struct
from dataclasses import dataclass

import av
import numpy as np
from PIL import Image

from mmspec_ray.config import MediaLimits, S3Config
from mmspec_ray.media.errors import MediaError
from mmspec_ray.media.image import check_shape, shrink
from mmspec_ray.media.io import read_bytes

_VIDEO_MAGIC_AT0 = (b"\x1a\x45\xdf\xa3", b"RIFF", b"FLV", b"OggS", b"\x00\x00\x01\xba", b"\x00\x00\x01\xb3")


DEFAULT_NUM_FRAMES = 8  # uniform frames when neither num_frames nor fps is given
# Threaded decoding (FFmpeg's "AUTO") and colour conversion (swscale) from this frame size up. Below it, starting
# the threads costs more than they save: a 96 px toy clip decodes in 1.0 ms on one thread against 3.7 ms threaded,
# and a frame converts to RGB in 0.13 ms against 0.29 ms (experiments/media_thread_costs.py; docs/toy.md, "Build
# time"). The frames are the same.
THREADED_VIDEO_PIXELS = 640 * 360


@dataclass(frozen=True)
class VideoClip:
    """Sampled frames of one video."""

    frames: list[Image.Image]  # [num_sampled] RGB frames, in time order
    timestamps: list[float]  # [num_sampled] seconds from the start of the stream
    total_frames: int  # frames in the stream (decoded count when the container did not say)
    duration: float  # seconds; 0.0 when unknown
    source_fps: float  # average frame rate of the stream; 0.0 when unknown


def load_video(
    source: bytes | str | os.PathLike,
    num_frames: int | None = None,
    fps: float | None = None,
    limits: MediaLimits | None = None,
    s3: S3Config | None = None,
    max_side: int | None = None,
    short_side: int | None = None,
) -> VideoClip:
    """Decode `source` and sample `num_frames` frames uniformly (default 8), or one frame every 1/`fps` s.
    `max_side`: scale huge frames down as they are decoded (see `media.image.prescale_size`); `short_side`: the
    frames' shape is checked as an image's (`media.image.check_shape`)."""
    limits = limits or MediaLimits()
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    label = source if isinstance(source, str) else None
    data = read_bytes(source, limits, s3) if isinstance(source, str) else bytes(source)
    return decode_video_bytes(data, num_frames=num_frames, fps=fps, limits=limits, label=label, max_side=max_side,
                              short_side=short_side)


def decode_video_bytes(
    data: bytes,
    num_frames: int | None = None,
    fps: float | None = None,
    limits: MediaLimits | None = None,
    label: str | None = None,
    max_side: int | None = None,
    short_side: int | None = None,
) -> VideoClip:
    """Decode video bytes, keeping only the sampled frames (memory bounded by them, never by the clip's length).
    Raises MediaError (empty, too_large, aspect_ratio, truncated, corrupt, unsupported) on bad input."""
    limits = limits or MediaLimits()
    if num_frames is not None and fps is not None:
        raise ValueError("give num_frames or fps, not both")
    if num_frames is None and fps is None:
        num_frames = DEFAULT_NUM_FRAMES
    if num_frames is not None and num_frames < 1:
        raise ValueError("num_frames must be >= 1")
    if fps is not None and fps <= 0:
        raise ValueError("fps must be > 0")
    if not data:
        raise MediaError("empty", "video has 0 bytes", label)
    if len(data) > limits.max_bytes:
        raise MediaError("too_large", f"{len(data)} bytes > limit {limits.max_bytes}", label)
    overrun = mp4_box_overrun(data)
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except av.FFmpegError as e:
        raise _open_error(data, overrun, e, label) from e
    with container:
        fmt = container.format.name or ""
        if fmt.endswith("_pipe") or fmt == "image2":
            raise MediaError("unsupported", f"an image ({fmt}) was given where a video was expected", label)
        if not container.streams.video:
            if overrun:  # the stream table itself was cut off
                raise MediaError("truncated", "the file is cut short before its video stream is described", label)
            raise MediaError("unsupported", "no video stream in the container (audio-only or data file?)", label)
        stream = container.streams.video[0]
        rate = float(stream.average_rate) if stream.average_rate else 0.0
        duration = _duration(container, stream)
        if duration > limits.max_video_seconds:
            raise MediaError("too_large", f"{duration:.1f} s > limit {limits.max_video_seconds:.0f} s", label)
        cc = stream.codec_context  # None when the stream table is damaged: then decoding reports it
        w, h = (cc.width or 0, cc.height or 0) if cc is not None else (0, 0)
        if w * h > limits.max_image_pixels:  # checked before any frame is decoded at full size
            raise MediaError("too_large", f"{w}x{h} frames > limit {limits.max_image_pixels} pixels", label)
        check_shape(w, h, limits, short_side, label, "frames")  # from the stream header, before any frame decodes
        if w * h >= THREADED_VIDEO_PIXELS:
            stream.thread_type = "AUTO"
        elif cc is not None:
            cc.thread_count = 1
        declared = int(stream.frames or 0)
        if declared > limits.max_video_frames:
            raise MediaError("too_large", f"{declared} frames > limit {limits.max_video_frames}", label)
        exact = declared > 0 or num_frames is None
        if not exact:  # no frame count in the container (MKV, WebM ...): count packets first, decoding nothing
            declared = count_packets(data)
        try:
            return _sample(container, stream, declared, duration, rate, num_frames, fps, limits, overrun, label,
                           (max_side, short_side), exact)
        except _Recount as rc:  # fewer frames decoded than packets counted: sample again over the real count
            with av.open(io.BytesIO(data), mode="r") as again:
                s2 = again.streams.video[0]
                return _sample(again, s2, rc.count, duration, rate, num_frames, fps, limits, overrun, label,
                               (max_side, short_side), True)


class _Recount(Exception):
    def __init__(self, count: int) -> None:
        self.count = count


def count_packets(data: bytes) -> int:
    """Frames of the first video stream by demuxing alone (one packet per frame; no decoding, no pixels)."""
    try:
        with av.open(io.BytesIO(data), mode="r") as c:
            return sum(1 for p in c.demux(c.streams.video[0]) if p.size)
    except (av.FFmpegError, OSError, ValueError, IndexError):
        return 0


def _sample(container, stream, declared, duration, rate, num_frames, fps, limits, overrun, label, sides,
            exact) -> VideoClip:
    """One decoding pass that keeps only the sampled frames: the indices picked from the frame count (declared by
    the container, or counted from packets when `exact` is False), or one frame every 1/fps s. `sides`: (max_side,
    short_side) of the target's processor."""
    max_side, short_side = sides
    wanted: set[int] | None = None
    if num_frames is not None and declared > 0:
        wanted = set(uniform_indices(declared, num_frames))
    picked: list[tuple[float, Image.Image]] = []
    pixels = 0
    next_t = 0.0
    count = 0
    error: Exception | None = None

    def keep(t: float, frame) -> None:
        nonlocal pixels
        check_shape(frame.width, frame.height, limits, short_side, label, "frame")  # a stream may change size
        img = shrink(frame.to_image(threads=0 if frame.width * frame.height >= THREADED_VIDEO_PIXELS else 1), max_side)
        pixels += img.width * img.height
        if pixels > limits.max_video_pixels:
            raise MediaError("too_large", f"the {len(picked) + 1} frames sampled so far hold {pixels} pixels > "
                             f"limit {limits.max_video_pixels}; sample fewer frames (--num-frames, a lower --fps)",
                             label)
        picked.append((t, img))

    try:
        for frame in container.decode(stream):
            t = float(frame.time) if frame.time is not None else count / (rate or 1.0)
            if wanted is not None:
                if count in wanted:
                    keep(t, frame)
            elif fps is not None and t + 1e-6 >= next_t:
                keep(t, frame)
                next_t += 1.0 / fps
                while next_t <= t:
                    next_t += 1.0 / fps
            count += 1
            if count > limits.max_video_frames:
                raise MediaError("too_large", f"more than {limits.max_video_frames} frames", label)
            if wanted is not None and len(picked) == len(wanted):
                break
    except MediaError:
        raise
    except (av.FFmpegError, OSError, ValueError) as e:
        error = e
    got_all = len(picked) == len(wanted) if wanted is not None else fps is not None
    if not exact and not got_all and error is None and count:
        raise _Recount(count)
    if count == 0:
        kind = "truncated" if overrun else "corrupt"
        raise MediaError(kind, f"no decodable frame{' (' + _ffmpeg_reason(error) + ')' if error else ''}", label)
    # A cut-off file must not pass as a shorter clip: in fps mode (or without a declared count) `got_all` is
    # always true, so also fail when the file is provably cut and fewer frames decoded than the container lists.
    if not got_all or (overrun and (error is not None or declared > count)):
        kind = "truncated" if (overrun or declared > count) else "corrupt"
        raise MediaError(kind, f"stream ended after {count} of {declared or '?'} frames", label)
    total = max(declared, count)
    frames = [img.convert("RGB") if img.mode != "RGB" else img for _, img in picked]
    return VideoClip(frames, [t for t, _ in picked], total, duration, rate)


def uniform_indices(total: int, n: int) -> list[int]:
    """`n` frame indices spread evenly over `total` frames (the HF / LLaVA-NeXT-Video convention)."""
    if total <= 0:
        return []
    return np.linspace(0, total - 1, num=n).round().astype(int).tolist()


def _duration(container, stream) -> float:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000
    return 0.0


def mp4_box_overrun(data: bytes) -> bool:
    """True when an MP4/MOV file's top-level boxes claim more bytes than the file has (a cut-off download)."""
    if len(data) < 8 or data[4:8] != b"ftyp":
        return False
    off = 0
    while off + 8 <= len(data):
        size, _kind = struct.unpack(">I4s", data[off:off + 8])
        if size == 1:
            if off + 16 > len(data):
                return True
            size = struct.unpack(">Q", data[off + 8:off + 16])[0]
        elif size == 0:
            return False
        if size < 8:
            return False
        if off + size > len(data):
            return True
        off += size
    return off != len(data)


def _mp4_lacks_moov(data: bytes) -> bool:
    """True for an MP4/MOV whose top-level boxes include no `moov` index (cut at a box boundary, or never finished)."""
    if len(data) < 8 or data[4:8] != b"ftyp":
        return False
    off = 0
    while off + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[off:off + 8])
        if kind == b"moov":
            return False
        if size == 1 and off + 16 <= len(data):
            size = struct.unpack(">Q", data[off + 8:off + 16])[0]
        if size < 8:  # 0 = "to the end of the file"; anything else is not a box
            break
        off += size
    return True


def _open_error(data: bytes, overrun: bool, e: Exception, label: str | None) -> MediaError:
    """What the user can act on, not FFmpeg's errno text (kept on the exception chain for the logs)."""
    if overrun or _mp4_lacks_moov(data):
        return MediaError("truncated", "the file is cut short (its MP4 index is missing or incomplete: an "
                          "interrupted upload or download?); upload the whole file again", label)
    if data[4:8] == b"ftyp" or data.startswith(_VIDEO_MAGIC_AT0):
        return MediaError("corrupt", f"video container is damaged ({_ffmpeg_reason(e)}); re-encode the file", label)
    return MediaError("unsupported", "not a recognised video container (MP4, MKV, WebM, AVI, MOV ... expected)",
                      label)


def _ffmpeg_reason(e: Exception) -> str:
    """FFmpeg's message without its errno number and the '<none>' file name PyAV adds for in-memory input."""
    return getattr(e, "strerror", None) or str(e)
