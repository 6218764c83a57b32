"""Synthetic Kinetics-style clips: one object performing one of ten actions, encoded as real H.264 mp4."""

from __future__ import annotations

import io
import math
import string
from dataclasses import dataclass

import av
import numpy as np
from PIL import Image, ImageDraw

from mmspec_ray.toy.scenes import draw_object, render_background
from mmspec_ray.toy.vocab import ACTIONS, BACKGROUND_TONES, COLOURS, SHAPES, SIZES

_ID_CHARS = string.ascii_letters + string.digits + "-_"


@dataclass(frozen=True)
class Clip:
    shape: str
    colour: str
    colour2: str  # the colour it turns into ("changing colour" only; else == colour)
    action: str
    num_frames: int
    tone: str
    seed: int
    youtube_id: str  # Kinetics-style annotation fields
    time_start: int
    time_end: int

    def key(self) -> tuple:
        return (self.shape, self.colour, self.colour2, self.action, self.tone, self.seed)

    @property
    def filename(self) -> str:
        return f"{self.youtube_id}_{self.time_start:06d}_{self.time_end:06d}.mp4"


def sample_clip(rng: np.random.Generator) -> Clip:
    action = ACTIONS[int(rng.integers(len(ACTIONS)))]
    shapes = [s for s in SHAPES if not (action == "spinning" and s == "circle")]  # a spinning circle looks still
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    colour2 = colour
    if action == "changing colour":
        others = [c for c in COLOURS if c != colour]
        colour2 = others[int(rng.integers(len(others)))]
    start = int(rng.integers(0, 600))
    return Clip(
        shape=shapes[int(rng.integers(len(shapes)))],
        colour=colour,
        colour2=colour2,
        action=action,
        num_frames=int(rng.integers(8, 17)),
        tone=list(BACKGROUND_TONES)[int(rng.integers(len(BACKGROUND_TONES)))],
        seed=int(rng.integers(2**31)),
        youtube_id="".join(_ID_CHARS[int(i)] for i in rng.integers(len(_ID_CHARS), size=11)),
        time_start=start,
        time_end=start + 10,
    )


def render_clip(clip: Clip, size: int = 96) -> list[Image.Image]:
    """Frames of the clip; motion is a function of normalised time u in [0, 1]."""
    rng = np.random.default_rng(clip.seed)
    bg = render_background("plain", clip.tone, size, clip.seed)
    lo, hi = size * 0.2, size * 0.8
    base_r = SIZES["medium"] * size / 6
    fx, fy = rng.uniform(lo + 4, hi - 4, 2).tolist()
    frames = []
    for i in range(clip.num_frames):
        u = i / max(1, clip.num_frames - 1)
        cx, cy, r, angle, colour, visible = fx, fy, base_r, 0.0, clip.colour, True
        a = clip.action
        if a == "moving left":
            cx = hi - u * (hi - lo)
        elif a == "moving right":
            cx = lo + u * (hi - lo)
        elif a == "moving up":
            cy = hi - u * (hi - lo)
        elif a == "moving down":
            cy = lo + u * (hi - lo)
        elif a == "spinning":
            angle = u * math.pi * 0.75
        elif a == "growing":
            r = base_r * (0.45 + 1.1 * u)
        elif a == "shrinking":
            r = base_r * (1.55 - 1.1 * u)
        elif a == "bouncing":
            cy = hi - abs(math.sin(u * 2 * math.pi)) * (hi - lo)
        elif a == "changing colour":
            colour = clip.colour if u < 0.5 else clip.colour2
        elif a == "blinking":
            visible = int(min(u * 4, 3.999)) % 2 == 0
        img = bg.copy()
        if visible:
            draw_object(ImageDraw.Draw(img), clip.shape, COLOURS[colour], cx, cy, r, angle)
        frames.append(img)
    return frames


def encode_mp4(frames: list[Image.Image], fps: int = 8) -> bytes:
    """H.264 (yuv420p) mp4 bytes, muxed in memory (index at the end, the muxer's default, as cameras write it).

    Frames go to x264 with zeroed row padding (see _yuv420_frame), explicit timestamps and one encoder thread,
    lookahead included (the build encodes in 2 worker processes instead). With x264's default threads and PyAV's
    frames, a busy machine got 2-9 different byte strings for one clip in 30-40 encodes; with these settings mostly
    one, but x264 still rarely changes a few bits of a clip (docs/toy.md, "Clips and determinism")."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"
        stream.codec_context.thread_count = 1
        stream.options = {"crf": "16", "preset": "fast", "x264-params": "threads=1:lookahead-threads=1"}
        for i, img in enumerate(frames):
            frame = _yuv420_frame(img)
            frame.pts = i
            for pkt in stream.encode(frame):
                out.mux(pkt)
        for pkt in stream.encode():
            out.mux(pkt)
    return buf.getvalue()


def _yuv420_frame(img: Image.Image) -> av.VideoFrame:
    """`img` as a yuv420p frame whose row padding is zeros. A 96 px frame's 48 px chroma rows are padded to 64
    bytes, and PyAV leaves that padding uninitialised, which x264 reads."""
    # one swscale thread: the same bytes, ~9x faster on 96 px frames (experiments/media_thread_costs.py)
    src = av.VideoFrame.from_image(img).reformat(format="yuv420p", threads=1)
    out = av.VideoFrame(img.width, img.height, "yuv420p")
    for s, d in zip(src.planes, out.planes):
        rows = np.zeros((d.height, d.line_size), np.uint8)
        rows[:, :s.width] = np.frombuffer(bytes(s), np.uint8).reshape(s.height, s.line_size)[:, :s.width]
        d.update(rows.tobytes())
    return out
