"""Synthetic scenes: 1-4 coloured shapes on a 3x3 grid over a textured background, rendered with Pillow."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from mmspec_ray.toy.vocab import BACKGROUND_TONES, BACKGROUNDS, COLOURS, POSITIONS, SHAPES, SIZES


@dataclass(frozen=True)
class ToyObject:
    shape: str
    colour: str
    size: str
    cell: int  # index into POSITIONS (row-major 3x3)

    @property
    def position(self) -> str:
        return POSITIONS[self.cell]


@dataclass(frozen=True)
class Scene:
    objects: tuple[ToyObject, ...]  # sorted by cell (reading order)
    background: str
    tone: str
    seed: int  # texture / jitter seed

    def key(self) -> tuple:
        """Identity of a scene's content, used to keep splits disjoint."""
        return (self.objects, self.background, self.tone)


def sample_scene(rng: np.random.Generator, max_objects: int = 4) -> Scene:
    """Draw a random scene; objects occupy distinct cells."""
    n = int(rng.integers(1, max_objects + 1))
    cells = sorted(rng.choice(9, size=n, replace=False).tolist())
    objs = tuple(
        ToyObject(
            shape=SHAPES[int(rng.integers(len(SHAPES)))],
            colour=list(COLOURS)[int(rng.integers(len(COLOURS)))],
            size=list(SIZES)[int(rng.integers(len(SIZES)))],
            cell=c,
        )
        for c in cells
    )
    return Scene(
        objects=objs,
        background=BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))],
        tone=list(BACKGROUND_TONES)[int(rng.integers(len(BACKGROUND_TONES)))],
        seed=int(rng.integers(2**31)),
    )


def render_background(kind: str, tone: str, size: int, seed: int) -> Image.Image:
    """A low-contrast texture so that objects, not the background, carry the signal."""
    base = np.array(BACKGROUND_TONES[tone], dtype=np.float32)
    img = np.broadcast_to(base, (size, size, 3)).copy()
    yy, xx = np.mgrid[0:size, 0:size]
    if kind == "striped":
        img += ((yy // 4) % 2)[..., None] * 18.0 - 9.0
    elif kind == "checkered":
        img += (((yy // 8) + (xx // 8)) % 2)[..., None] * 18.0 - 9.0
    elif kind == "noisy":
        img += np.random.default_rng(seed).normal(0, 9.0, (size, size, 1))
    elif kind == "dotted":
        img += (((yy % 6) < 2) & ((xx % 6) < 2))[..., None] * 22.0
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def shape_polygon(shape: str, cx: float, cy: float, r: float, angle: float = 0.0) -> list[tuple[float, float]] | None:
    """Vertices of a polygonal shape of half-size r centred on (cx, cy); None for a circle."""
    def rot(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
        ca, sa = math.cos(angle), math.sin(angle)
        return [(cx + x * ca - y * sa, cy + x * sa + y * ca) for x, y in points]

    if shape == "circle":
        return None
    if shape == "square":
        return rot([(-r, -r), (r, -r), (r, r), (-r, r)])
    if shape == "triangle":
        return rot([(0, -r), (r, r * 0.8), (-r, r * 0.8)])
    if shape == "diamond":
        return rot([(0, -r), (r * 0.75, 0), (0, r), (-r * 0.75, 0)])
    if shape == "cross":
        t = r * 0.36
        return rot([(-t, -r), (t, -r), (t, -t), (r, -t), (r, t), (t, t), (t, r), (-t, r), (-t, t), (-r, t), (-r, -t), (-t, -t)])
    if shape == "star":
        pts = []
        for i in range(10):
            rad = r if i % 2 == 0 else r * 0.45
            a = -math.pi / 2 + i * math.pi / 5
            pts.append((rad * math.cos(a), rad * math.sin(a)))
        return rot(pts)
    raise ValueError(f"unknown shape {shape!r}")


def draw_object(draw: ImageDraw.ImageDraw, shape: str, rgb: tuple[int, int, int], cx: float, cy: float, r: float,
                angle: float = 0.0) -> None:
    poly = shape_polygon(shape, cx, cy, r, angle)
    if poly is None:
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=rgb)
    else:
        draw.polygon(poly, fill=rgb)


def render_scene(scene: Scene, size: int = 96) -> Image.Image:
    """Render a scene to an RGB image of size x size pixels."""
    img = render_background(scene.background, scene.tone, size, scene.seed)
    draw = ImageDraw.Draw(img)
    cell = size / 3
    jit = np.random.default_rng(scene.seed + 1)
    for o in scene.objects:
        row, col = divmod(o.cell, 3)
        r = SIZES[o.size] * cell / 2
        slack = max(0.0, cell / 2 - r - 1)
        dx, dy = (jit.uniform(-1, 1, 2) * min(slack, cell * 0.08)).tolist()
        draw_object(draw, o.shape, COLOURS[o.colour], (col + 0.5) * cell + dx, (row + 0.5) * cell + dy, r)
    return img


def encode_image(img: Image.Image, fmt: str) -> bytes:
    """PNG or JPEG bytes of an image."""
    buf = io.BytesIO()
    if fmt == "JPEG":
        img.save(buf, format="JPEG", quality=92)
    else:
        img.save(buf, format="PNG")
    return buf.getvalue()
