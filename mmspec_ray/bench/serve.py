"""Serve overhead benchmark: the same requests through `SpecEngine` called directly and through the Serve endpoint
(HTTP on loopback, one replica), at 1 and N concurrent clients. Writes JSON + a markdown table.

    RAY_AUTH_MODE=disabled python -m mmspec_ray.bench.serve --target CKPT_DIR --out bench-serve
    RAY_AUTH_MODE=disabled python -m mmspec_ray.bench.serve --random-toy /tmp/toy-random --out bench-serve

`--random-toy DIR` saves (once) an untrained model of the toy-s architecture there: its text is noise, but its
cost per forward is toy-s's, which is what an overhead measurement needs.
"""

# No `from __future__ import annotations`: FastAPI reads the noop route's parameter types at run time.
import argparse
import base64
import io
import json
import os
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


class Engine:
    """SpecEngine through the same SpecDecoder class, in this process; media decoded ahead (not timed)."""

    def __init__(self, settings: Any, reqs: list[dict[str, Any]]) -> None:
        from mmspec_ray.batch.decoder import SpecDecoder
        from mmspec_ray.serve.messages import to_request

        self.dec = SpecDecoder(settings.decode)
        self.max_tokens = reqs[0]["max_tokens"]
        self.prepared = [to_request(r["messages"], settings) for r in reqs]

    def run(self, i: int) -> tuple[float, Any]:
        from mmspec_ray.config import SamplingParams

        t0 = time.perf_counter()
        gen = self.dec.engine.generate(self.prepared[i], SamplingParams(), self.max_tokens)
        return time.perf_counter() - t0, gen


def paired(engine: Engine, url: str, reqs: list[dict[str, Any]]) -> dict[str, Any]:
    """One client: each request through the engine and through Serve back to back (order alternating), so both
    see the same machine load; the overhead is the median of the per-request differences."""
    eng, srv, srv_stream, ttft, diff, prefill, cycle, tokens = [], [], [], [], [], [], [], 0
    ttft_server: list[float] = []
    for i in range(len(reqs)):
        order = (0, 1, 2) if i % 2 == 0 else (2, 1, 0)
        for what in order:
            if what == 0:
                dt, gen = engine.run(i)
                eng.append(dt)
                tokens += len(gen.token_ids)
                prefill.append(gen.stats.prefill_s)
                cycle.append((gen.stats.total_s - gen.stats.prefill_s) / max(1, gen.stats.cycles))
            elif what == 1:
                dt, _, out = _post(url, dict(reqs[i], stream=False))
                srv.append(dt)
            else:
                dt, first, last = _post(url, dict(reqs[i], stream=True))
                srv_stream.append(dt)
                ttft.append(first)
                ttft_server.append(last["spec_stats"]["first_token_s"])
        diff.append(srv[-1] - eng[-1])
    ms = 1e3
    return {"engine": {"p50_ms": pct(eng, 50) * ms, "p99_ms": pct(eng, 99) * ms, "tokens_per_s": tokens / sum(eng),
                       "prefill_p50_ms": pct(prefill, 50) * ms, "cycle_p50_ms": pct(cycle, 50) * ms},
            "serve": {"p50_ms": pct(srv, 50) * ms, "p99_ms": pct(srv, 99) * ms, "tokens_per_s": tokens / sum(srv)},
            "serve_stream": {"p50_ms": pct(srv_stream, 50) * ms, "p99_ms": pct(srv_stream, 99) * ms,
                             "ttft_p50_ms": pct(ttft, 50) * ms, "ttft_p99_ms": pct(ttft, 99) * ms,
                             "ttft_server_p50_ms": pct(ttft_server, 50) * ms,
                             "ttft_server_p99_ms": pct(ttft_server, 99) * ms},
            "overhead_p50_ms": pct(diff, 50) * ms, "overhead_p99_ms": pct(diff, 99) * ms, "n": len(reqs)}


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
    lat, ttft, tokens, engine_s, server_s, queue_s, read_s = [], [], 0, [], [], [], []
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
                read_s.append(out["spec_stats"]["read_s"])

    for body in reqs[:3]:
        one(body)  # warm-up
    for xs in (lat, ttft, engine_s, server_s, queue_s, read_s):
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
        # where a request's time went outside the engine: reading the body (Serve's replica fetches it from the
        # proxy), the replica's own work (parse, media, hand-offs; queue wait excluded), and outside the replica
        # (client, HTTP, the proxy's queue, the Ray hop)
        res["body_read_p50_ms"] = pct(read_s, 50) * 1e3
        res["replica_overhead_p50_ms"] = pct([v - e - q - b for v, e, q, b in zip(server_s, engine_s, queue_s,
                                                                                  read_s)], 50) * 1e3
        res["proxy_http_p50_ms"] = pct([t - v for t, v in zip(lat, server_s)], 50) * 1e3
        res["queue_p50_ms"] = pct(queue_s, 50) * 1e3
    return res


def noop_floor(port: int, reqs: list[dict[str, Any]]) -> float:
    """p50 ms of the same request bodies sent to a FastAPI Serve app that only parses them: Serve's own floor
    on this machine (HTTP, proxy, the Ray hop, JSON)."""
    from fastapi import FastAPI, Request
    from ray import serve

    api = FastAPI()

    @serve.deployment(ray_actor_options={"num_cpus": 0.5})
    @serve.ingress(api)
    class Noop:
        @api.post("/v1/chat/completions")
        async def chat(self, request: Request) -> dict:
            body = await request.json()
            return {"choices": [{"message": {"content": ""}}], "n": len(body["messages"])}

    serve.run(Noop.bind(), name="noop", route_prefix="/noop")
    url = f"http://127.0.0.1:{port}/noop/v1/chat/completions"
    lat = [_post(url, body)[0] for body in (reqs[:3] + reqs)][3:]
    serve.delete("noop")
    return pct(lat, 50) * 1e3


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
    engine = Engine(settings, reqs)
    for i in range(3):
        engine.run(i)  # warm-up
    from mmspec_ray.batch.cluster import start_local_ray

    start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": a.port})
        serve.run(build_app(args), name="bench", route_prefix="/")
        url = f"http://127.0.0.1:{a.port}/v1/chat/completions"
        for body in reqs[:3]:
            _post(url, body)  # warm-up
        results["one_client"] = paired(engine, url, reqs)
        results["serve"] = [through_serve(url, reqs, c, s) for c in (1, a.clients) for s in (False, True)]
        results["noop_p50_ms"] = noop_floor(a.port, reqs)
    finally:
        serve.shutdown()
        ray.shutdown()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "serve.json").write_text(json.dumps(results, indent=2))
    (a.out / "serve.md").write_text(table(results))
    print(table(results))


def table(r: dict[str, Any]) -> str:
    one = r["one_client"]
    e, sv, st = one["engine"], one["serve"], one["serve_stream"]
    lines = [f"One client, each request through the engine and through Serve back to back ({one['n']} requests):", "",
             "| path | p50 ms | p99 ms | tokens/s | first token p50 / p99 ms |", "|---|---|---|---|---|",
             f"| engine direct | {e['p50_ms']:.1f} | {e['p99_ms']:.1f} | {e['tokens_per_s']:.1f} | prefill "
             f"{e['prefill_p50_ms']:.1f} (+ one cycle {e['cycle_p50_ms']:.1f}) |",
             f"| Serve | {sv['p50_ms']:.1f} | {sv['p99_ms']:.1f} | {sv['tokens_per_s']:.1f} | - |",
             f"| Serve, streamed | {st['p50_ms']:.1f} | {st['p99_ms']:.1f} | - | {st['ttft_p50_ms']:.1f} / "
             f"{st['ttft_p99_ms']:.1f} |", "",
             f"Serve minus engine, same request: p50 {one['overhead_p50_ms']:+.1f} ms, "
             f"p99 {one['overhead_p99_ms']:+.1f} ms.", "",
             f"Serve's own floor here (a FastAPI app that only parses the same bodies): p50 {r['noop_p50_ms']:.1f} ms.",
             "",
             f"Streamed first token inside the replica (request read -> first token committed): p50 "
             f"{st['ttft_server_p50_ms']:.1f} ms, p99 {st['ttft_server_p99_ms']:.1f} ms.", "",
             "Serve alone, by concurrent clients (one replica):", "",
             "| clients | stream | p50 ms | p99 ms | tokens/s | TTFT p50 / p99 ms | engine in replica p50 ms "
             "| body read p50 ms | replica work p50 ms | outside the replica p50 ms | replica queue p50 ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in r["serve"]:
        if s["stream"]:
            lines.append(f"| {s['clients']} | yes | {s['p50_ms']:.1f} | {s['p99_ms']:.1f} | - | "
                         f"{s['ttft_p50_ms']:.1f} / "
                         f"{s['ttft_p99_ms']:.1f} | - | - | - | - | - |")
        else:
            lines.append(f"| {s['clients']} | no | {s['p50_ms']:.1f} | {s['p99_ms']:.1f} | "
                         f"{s['tokens_per_s']:.1f} | - "
                         f"| {s['engine_in_replica_p50_ms']:.1f} | {s['body_read_p50_ms']:.1f} "
                         f"| {s['replica_overhead_p50_ms']:.1f} "
                         f"| {s['proxy_http_p50_ms']:.1f} | {s['queue_p50_ms']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
