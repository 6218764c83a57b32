"""Peak memory of preparing one request (decoding its image, then the target's processor: everything before the
model) for hostile image shapes: long thin PNGs of a few hundred bytes that a CLIP-style processor scales up by their
aspect ratio, one just inside the 200:1 limit, and a photo-size JPEG. Through the Serve endpoint's request path
(`to_request`, with the decoder's resolved config as a replica passes it) and a batch row (`prepare_row`, config resolved as a job resolves it), with the
default media limits and with the aspect-ratio limits lifted (what such an image costs unchecked). Each
measurement runs in a fresh process: the target is loaded and warmed up on a small image, its peak RSS reset through
/proc/self/clear_refs, and the growth is the peak (VmHWM) over the RSS before the request.

Usage (writes docs/bench/media-memory.md and the JSON next to it under --out):
    .venv/bin/python experiments/media_bombs.py --random-toy /tmp/mmspec-toy-random
`--random-toy DIR` saves (once) an untrained toy-s-shaped LLaVA there (its 96 px CLIP-style processor is toy-s's);
`--target CKPT` measures another checkpoint instead.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
IMAGES = [("20000x1 PNG", 20000, 1), ("5000x1 PNG", 5000, 1), ("1x20000 PNG", 1, 20000),
          ("19900x100 PNG (199:1)", 19900, 100), ("4032x3024 JPEG (photo)", 4032, 3024)]
LIFTED = {"max_aspect_ratio": 1e12, "max_processed_pixels": 10**15}

PROBE = r"""
import base64, gc, json, sys, time
import torch
torch.set_num_threads(1)
from mmspec_ray.batch.jobspec import DecodeConfig
from mmspec_ray.batch.rows import RowError, prepare_row, resolve_image_side
from mmspec_ray.serve.errors import APIError
from mmspec_ray.serve.messages import to_request
from mmspec_ray.serve.settings import ServeSettings
from mmspec_ray.targets import load_target
target_path, path, image, mime, limits = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
data = open(image, "rb").read()
cfg = DecodeConfig(target=target_path, drafter="none", media={"limits": limits})
target = load_target(target_path)

def prepare(data, mime):
    if path == "serve":
        url = f"data:{mime};base64," + base64.b64encode(data).decode()
        content = [{"type": "text", "text": "Describe it."}, {"type": "image_url", "image_url": {"url": url}}]
        return to_request([{"role": "user", "content": content}], ServeSettings(decode=resolve_image_side(cfg)))
    return prepare_row({"id": "r", "prompt": "Describe it.", "image": data}, resolve_image_side(cfg))

small = open(sys.argv[6], "rb").read()
target.encode(prepare(small, "image/png"))  # warm-up: lazy imports and first allocations are not the image's cost
def status(key):  # kB
    return int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith(key + ":")))

gc.collect()
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS: loading peaked higher
base = status("VmRSS")
t0 = time.perf_counter()
try:
    target.encode(prepare(data, mime))
    outcome = "accepted"
except APIError as e:
    outcome = f"{e.status} {e.code}"
except RowError as e:
    outcome = f"row error {e.kind}"
seconds = time.perf_counter() - t0
peak = status("VmHWM")
print(json.dumps({"outcome": outcome, "growth_mb": (peak - base) / 1024, "seconds": seconds}))
"""


def make_images(d: Path) -> dict[str, tuple[Path, str]]:
    """The test images (flat colour for the thin ones: a few hundred bytes; a gradient with noise for the photo)."""
    d.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, w, h in IMAGES:
        jpeg = "JPEG" in name
        f = d / f"{w}x{h}.{'jpg' if jpeg else 'png'}"
        if not f.exists():
            if jpeg:
                rng = np.random.default_rng(0)
                grad = np.linspace(0, 255, w, dtype=np.float32)[None, :, None] * np.ones((h, 1, 3), np.float32)
                arr = np.clip(grad + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(arr).save(f, "JPEG", quality=90)
            else:
                Image.new("RGB", (w, h), (30, 120, 200)).save(f, "PNG")
        out[name] = (f, "image/jpeg" if jpeg else "image/png")
    small = d / "warmup.png"
    Image.new("RGB", (96, 96), (200, 30, 30)).save(small, "PNG")
    out["warmup"] = (small, "image/png")
    return out


def measure(target: str, path: str, image: Path, mime: str, limits: dict, warmup: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", PROBE, target, path, str(image), mime, json.dumps(limits),
                        str(warmup)], capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"measurement failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    head = ("| image | bytes | path | default limits | RSS growth | time | limits lifted | RSS growth | time |\n"
            "|---|---:|---|---|---:|---:|---|---:|---:|\n")
    body = "".join(
        f"| {r['image']} | {r['bytes']:,} | {r['path']} | {r['default']['outcome']} | "
        f"{r['default']['growth_mb']:,.0f} MB | {r['default']['seconds']:.2f} s | {r['lifted']['outcome']} | "
        f"{r['lifted']['growth_mb']:,.0f} MB | {r['lifted']['seconds']:.2f} s |\n" for r in rows)
    return head + body


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--target", help="a checkpoint directory (a built toy world's target/, or yours)")
    src.add_argument("--random-toy", type=Path, help="make/use an untrained toy-s-shaped checkpoint here")
    p.add_argument("--out", type=Path, default=Path("out/media_bombs"), help="images and JSON go here")
    p.add_argument("--doc", type=Path, default=ROOT / "docs/bench/media-memory.md", help="the markdown table")
    a = p.parse_args(argv)
    from mmspec_ray.bench.serve import random_toy

    target = random_toy(a.random_toy) if a.random_toy else a.target
    images = make_images(a.out / "images")
    warmup = images.pop("warmup")[0]
    rows = []
    t0 = time.perf_counter()
    for name, (f, mime) in images.items():
        for path in ("serve", "batch"):
            row = {"image": name, "bytes": f.stat().st_size, "path": path,
                   "default": measure(target, path, f, mime, {}, warmup),
                   "lifted": measure(target, path, f, mime, LIFTED, warmup)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    (a.out / "media_bombs.json").write_text(json.dumps(rows, indent=1))
    command = " ".join(["OMP_NUM_THREADS=1 .venv/bin/python experiments/media_bombs.py"] + (argv or sys.argv[1:]))
    a.doc.parent.mkdir(parents=True, exist_ok=True)
    a.doc.write_text(doc(table(rows), command, target, time.perf_counter() - t0))
    print(f"wrote {a.doc}")


def doc(tab: str, command: str, target: str, seconds: float) -> str:
    return f"""# Media memory: aspect-ratio bombs

Peak RSS growth of preparing one request (decoding its image, then the target's processor: everything a replica or a
decoder actor does before the model) on an untrained toy-s-shaped LLaVA, whose CLIP-style processor scales the short
side to 96 px and then crops. `serve`: the endpoint's request path (`to_request` from a data: URL, with the
decoder's resolved media settings as a replica passes them); `batch`: a batch row (`prepare_row`, settings resolved
as a job resolves them). Both scale a large image down before keeping it, a JPEG already while decoding.
"Limits lifted": `max_aspect_ratio` and `max_processed_pixels` set out of reach (what such an image costs
unchecked). Each cell is a fresh process, after a warm-up request with a 96 px image; one torch thread; shared 2-core
CPU, so the times are rough.

{tab}
A processor with a larger short side costs proportionally more for the same file: 336 px is 3.5 x the long side of
96 px and 3.5 x the short side, ~12 x the pixels. The defaults refuse past 200:1 (`media.limits.max_aspect_ratio`)
and past 25 M processed pixels (`media.limits.max_processed_pixels`: ~10 bytes a pixel while processing), both from
the image header before anything is decoded.

Made by this command ({seconds:.0f} s on the shared 2-core development CPU; target `{target}`):

```bash
{command}
```
"""


if __name__ == "__main__":
    main()
