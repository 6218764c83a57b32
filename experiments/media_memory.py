"""Peak memory of hostile-but-legal media in the batch pipeline: the media stage (a Ray Data task) and the decoder
actor that receives the prepared request. Each measurement runs in a fresh process (peak RSS via getrusage).

Inputs (made here): a 7,990 x 7,990 PNG (~0.2 MB of file) and a 1,200-frame 1280 x 720 MKV with no frame count in
its container. Usage (writes JSON + a markdown table):
    .venv/bin/python experiments/media_memory.py --target /path/to/checkpoint --out out/media_memory
`--image-side none` measures with scaling off (what the pipeline did before it scaled huge media down).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

STAGE = r"""
import json, pickle, resource, sys
from mmspec_ray.batch.rows import prepare_row
from mmspec_ray.batch.jobspec import DecodeConfig
try:
    from mmspec_ray.batch.rows import resolve_image_side
except ImportError:  # a checkout from before media scaling existed
    resolve_image_side = lambda cfg: cfg
kind, path, target, side, out = sys.argv[1:6]
media = {"num_frames": 8} | ({} if side == "auto" else {"image_side": None if side == "none" else int(side)})
cfg = resolve_image_side(DecodeConfig(target=target, media=media))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
req = prepare_row({"id": "r", "prompt": "Describe it.", kind: open(path, "rb").read()}, cfg)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
blob = pickle.dumps(req)
open(out, "wb").write(blob)
print(json.dumps({"stage_growth_mb": (peak - base) / 1024, "request_mb": len(blob) / 2**20,
                  "image_side": getattr(cfg.media, "image_side", None)}))
"""

ACTOR = r"""
import json, pickle, resource, sys, torch
torch.set_num_threads(1)
from mmspec_ray.batch.decoder import SpecDecoder
target, blob = sys.argv[1:3]
dec = SpecDecoder({"target": target, "drafter": "ngram", "max_new_tokens": 8})
loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = dec.generate(pickle.loads(open(blob, "rb").read()), "r")
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"actor_loaded_mb": loaded / 1024, "actor_peak_mb": peak / 1024,
                  "actor_growth_mb": (peak - loaded) / 1024, "error": out["error"]}))
"""


def make_inputs(d: Path) -> dict[str, Path]:
    import av
    import numpy as np
    from PIL import Image

    png = d / "huge.png"
    if not png.exists():
        Image.new("RGB", (7990, 7990), (30, 120, 200)).save(png, "PNG")
    mkv = d / "long.mkv"
    if not mkv.exists():
        with av.open(str(mkv), "w", format="matroska") as c:
            s = c.add_stream("mpeg4", rate=30)
            s.width, s.height, s.pix_fmt = 1280, 720, "yuv420p"
            for i in range(1200):
                frame = np.full((720, 1280, 3), (i * 3) % 256, np.uint8)
                for p in s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    c.mux(p)
            for p in s.encode():
                c.mux(p)
    return {"image": png, "video": mkv}


def run(code: str, *args: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=900)
    if r.returncode:
        raise SystemExit(f"measurement failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="checkpoint directory (the decoder actor loads it)")
    ap.add_argument("--image-side", default="auto", help="auto (the processor's size), none, or pixels")
    ap.add_argument("--out", default="out/media_memory")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    inputs = make_inputs(out)
    results = []
    for kind, path in inputs.items():
        blob = out / f"{kind}.request.pkl"
        row = {"input": kind, "file_mb": path.stat().st_size / 2**20,
               **run(STAGE, kind, str(path), a.target, a.image_side, str(blob)), **run(ACTOR, a.target, str(blob))}
        results.append(row)
        print(json.dumps(row))
    (out / f"media_memory_{a.image_side}.json").write_text(json.dumps(results, indent=2))
    lines = ["| input | file MB | image_side | media stage peak growth MB | request MB | actor after load MB | "
             "actor peak MB | actor growth MB |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['input']} | {r['file_mb']:.1f} | {r['image_side']} | {r['stage_growth_mb']:.0f} | "
                     f"{r['request_mb']:.1f} | {r['actor_loaded_mb']:.0f} | {r['actor_peak_mb']:.0f} | "
                     f"{r['actor_growth_mb']:.0f} |")
    (out / f"media_memory_{a.image_side}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
