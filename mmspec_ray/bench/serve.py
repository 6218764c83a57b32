"""Serve overhead benchmark: the same requests through `SpecEngine` called directly and through the Serve endpoint
(HTTP on loopback, one replica), at 1 and N concurrent clients. Writes JSON + a markdown table.

    RAY_AUTH_MODE=disabled python -m mmspec_ray.bench.serve --target CKPT_DIR --out bench-serve
    RAY_AUTH_MODE=disabled python -m mmspec_ray.bench.serve --random-toy /tmp/toy-random --out bench-serve

`--random-toy DIR` saves (once) an untrained model of the toy-s architecture there: its text is noise, but its
cost per forward is toy-s's, which is what an overhead measurement needs.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

PROMPTS = ["Describe the image briefly.", "What colour is the large object?", "How many objects are there?",
           "Where is the circle?"]


def random_toy(path: Path) -> str:
    """An untrained toy-s-shaped LLaVA checkpoint at `path` (made once)."""
    if (path / "config.json").exists():
        return str(path)
    import torch

    from mmspec_ray.toy.model import TOY_SIZES, build_model, build_processor
    from mmspec_ray.toy.tokenizer import train_tokenizer

    words = "the a red green blue circle square star large small left right top bottom there is are objects".split()
    rng = np.random.default_rng(0)
    tok = train_tokenizer([" ".join(rng.choice(words, 12)) for _ in range(300)] + PROMPTS, vocab_size=320)
    torch.manual_seed(0)
    model = build_model(TOY_SIZES["toy-s"], tok)
    model.save_pretrained(path)
    build_processor(TOY_SIZES["toy-s"], tok).save_pretrained(path)
    return str(path)


def image_url(seed: int, size: int) -> str:
    arr = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def bodies(n: int, max_tokens: int, size: int) -> list[dict[str, Any]]:
    return [{"model": "bench", "temperature": 0, "max_tokens": max_tokens, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_url(i % 4, size)}},
        {"type": "text", "text": PROMPTS[i % len(PROMPTS)]}]}]} for i in range(n)]


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def engine_direct(settings: Any, reqs: list[dict[str, Any]]) -> dict[str, Any]:
    """SpecEngine through SpecDecoder.stream in this process, one request after another (media decoded first,
    not timed: the Serve figures include it)."""
    from mmspec_ray.batch.decoder import SpecDecoder
    from mmspec_ray.config import SamplingParams
    from mmspec_ray.serve.messages import frames_as_images, to_request

    dec = SpecDecoder(settings.decode)
    lat, tokens, prefill, cycle = [], 0, [], []
    prepared = [frames_as_images(to_request(r["messages"], settings), dec.target.video_as_frames) for r in reqs]
    for i, request in enumerate([prepared[0]] * 3 + prepared):
        t0 = time.perf_counter()
        gen = dec.engine.generate(request, SamplingParams(), reqs[0]["max_tokens"])
        dt = time.perf_counter() - t0
        if i >= 3:  # after warm-up
            lat.append(dt)
            tokens += len(gen.token_ids)
            prefill.append(gen.stats.prefill_s)
            cycle.append((gen.stats.total_s - gen.stats.prefill_s) / max(1, gen.stats.cycles))
    return {"p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3, "tokens_per_s": tokens / sum(lat),
            "prefill_p50_ms": pct(prefill, 50) * 1e3, "cycle_p50_ms": pct(cycle, 50) * 1e3, "n": len(lat)}


def _post(url: str, body: dict[str, Any]) -> tuple[float, float | None, dict[str, Any]]:
    """(latency s, time to first content chunk s or None, final body or last chunk)."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        if not body.get("stream"):
            out = json.loads(r.read())
            return time.perf_counter() - t0, None, out
        first, last = None, {}
        for line in r:
            if line.startswith(b"data: {"):
                last = json.loads(line[6:])
                if first is None and last["choices"] and last["choices"][0]["delta"].get("content"):
                    first = time.perf_counter() - t0
        return time.perf_counter() - t0, first, last


def through_serve(url: str, reqs: list[dict[str, Any]], clients: int, stream: bool) -> dict[str, Any]:
    lat, ttft, tokens, engine_s, server_s, queue_s = [], [], 0, [], [], []
    lock = threading.Lock()

    def one(body: dict[str, Any]) -> None:
        nonlocal tokens
        dt, first, out = _post(url, dict(body, stream=stream))
        with lock:
            lat.append(dt)
            if first is not None:
                ttft.append(first)
            if not stream:
                tokens += out["usage"]["completion_tokens"]
                engine_s.append(out["spec_stats"]["decode_s"])
                server_s.append(out["spec_stats"]["server_s"])
                queue_s.append(out["spec_stats"]["queue_s"])

    for body in reqs[:3]:
        one(body)  # warm-up
    for xs in (lat, ttft, engine_s, server_s, queue_s):
        xs.clear()
    tokens = 0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, reqs))
    wall = time.perf_counter() - t0
    res = {"clients": clients, "stream": stream, "n": len(lat), "p50_ms": pct(lat, 50) * 1e3,
           "p99_ms": pct(lat, 99) * 1e3, "wall_s": wall}
    if stream:
        res["ttft_p50_ms"], res["ttft_p99_ms"] = pct(ttft, 50) * 1e3, pct(ttft, 99) * 1e3
    else:
        res["tokens_per_s"] = tokens / wall
        res["engine_in_replica_p50_ms"] = pct(engine_s, 50) * 1e3
        # where a request's time went outside the engine: in the replica (parse, media, hand-offs; queue wait
        # excluded) and outside it (client, HTTP proxy, Ray hop)
        res["replica_overhead_p50_ms"] = pct([v - e - q for v, e, q in zip(server_s, engine_s, queue_s)], 50) * 1e3
        res["proxy_http_p50_ms"] = pct([t - v for t, v in zip(lat, server_s)], 50) * 1e3
        res["queue_p50_ms"] = pct(queue_s, 50) * 1e3
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--target", help="checkpoint directory (or a toy world name, built on first use)")
    src.add_argument("--random-toy", type=Path, help="make/use an untrained toy-s-shaped checkpoint here")
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--requests", type=int, default=40, help="requests per measurement")
    ap.add_argument("--clients", type=int, default=4, help="N of the concurrent measurement")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1, help="torch threads, engine and replica alike")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--out", type=Path, default=Path("bench-serve"))
    a = ap.parse_args(argv)

    import ray
    from ray import serve

    from mmspec_ray.serve.app import build_app
    from mmspec_ray.serve.settings import ServeSettings

    target = random_toy(a.random_toy) if a.random_toy else a.target
    args = {"decode": {"target": target, "drafter": a.drafter, "device": "cpu", "torch_threads": a.threads},
            "model_name": "bench", "limits": {"max_body_bytes": 64 << 20},
            "deployment": {"ray_actor_options": {"num_cpus": 1}, "max_ongoing_requests": 2,
                           "max_queued_requests": 4 * a.clients + 8}}
    settings = ServeSettings.model_validate(args)
    reqs = bodies(a.requests, a.max_tokens, a.image_size)
    import torch

    torch.set_num_threads(a.threads)
    results: dict[str, Any] = {"target": target, "drafter": a.drafter, "max_tokens": a.max_tokens,
                               "requests": a.requests, "threads": a.threads, "cpus": os.cpu_count()}
    results["engine_before"] = engine_direct(settings, reqs)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": a.port})
        serve.run(build_app(args), name="bench", route_prefix="/")
        url = f"http://127.0.0.1:{a.port}/v1/chat/completions"
        results["serve"] = [through_serve(url, reqs, c, s) for c in (1, a.clients) for s in (False, True)]
    finally:
        serve.shutdown()
        ray.shutdown()
    results["engine_after"] = engine_direct(settings, reqs)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "serve.json").write_text(json.dumps(results, indent=2))
    (a.out / "serve.md").write_text(table(results))
    print(table(results))


def table(r: dict[str, Any]) -> str:
    eng = [r["engine_before"], r["engine_after"]]
    e50 = statistics.mean(e["p50_ms"] for e in eng)
    lines = ["| path | clients | p50 ms | p99 ms | tokens/s | TTFT p50 / p99 ms |", "|---|---|---|---|---|---|"]
    for name, e in zip(("engine direct (before)", "engine direct (after)"), eng):
        lines.append(f"| {name} | 1 (sequential) | {e['p50_ms']:.1f} | {e['p99_ms']:.1f} | {e['tokens_per_s']:.1f} "
                     f"| prefill {e['prefill_p50_ms']:.1f}, one cycle {e['cycle_p50_ms']:.1f} |")
    for s in r["serve"]:
        kind = "Serve, streamed" if s["stream"] else "Serve"
        tps = f"{s['tokens_per_s']:.1f}" if "tokens_per_s" in s else "-"
        ttft = f"{s['ttft_p50_ms']:.1f} / {s['ttft_p99_ms']:.1f}" if s["stream"] else "-"
        lines.append(f"| {kind} | {s['clients']} | {s['p50_ms']:.1f} | {s['p99_ms']:.1f} | {tps} | {ttft} |")
    one = next(s for s in r["serve"] if s["clients"] == 1 and not s["stream"])
    lines.append("")
    lines.append(f"Serve overhead at 1 client, p50: {one['p50_ms'] - e50:+.1f} ms over the engine alone "
                 f"(engine p50 {e50:.1f} ms; the replica's own engine time p50 "
                 f"{one['engine_in_replica_p50_ms']:.1f} ms).")
    lines.append("")
    lines.append("| clients | engine in replica p50 ms | replica overhead p50 ms | proxy + HTTP p50 ms "
                 "| queue wait p50 ms |")
    lines.append("|---|---|---|---|---|")
    for s in r["serve"]:
        if not s["stream"]:
            lines.append(f"| {s['clients']} | {s['engine_in_replica_p50_ms']:.1f} "
                         f"| {s['replica_overhead_p50_ms']:.1f} | {s['proxy_http_p50_ms']:.1f} "
                         f"| {s['queue_p50_ms']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
