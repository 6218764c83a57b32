"""The steps of scripts/gpu_ray.sh that are Python: inputs it makes, the Serve client, and what it records.

    inputs WORK [--world DIR] [--tiny] ...                      all of the below the run reads, in one process
    target DIR --model NAME [--reduced] --device D --dtype T   a 7B-config random-weight checkpoint (scale_models)
    rows OUT --n N --size WxH                                   instruct rows: photo-sized images, word prompts
    world DIR --scenes N --clips N                              a small toy-style world (the CPU dry run's inputs)
    requests WORLD SPLIT OUT [--limit N] [--images-only]        a world split's prompts as request rows (--data)
    serve-config OUT --base YAML --target T --port P ...        the GPU Serve config, pointed at a target
    client --port P --out serve.json ...                        plain and streamed answers, a replica killed
    memory GPU_CSV APPS_CSV --out JSON                          peak GPU memory per process from nvidia-smi samples
    summary PATH [--memory JSON]                                a batch job's _summary.json in one line; exit 1
                                                                unless every row is answered
    collect WORK --out results.json                             every stage's record in one file
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import shutil
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

GIB = 1 << 30


# ------------------------------------------------------------------------------------------------ inputs
def save_target(out: Path, model: str, reduced: bool, device: str, dtype: str, seed: int = 0) -> dict[str, Any]:
    """A published config with random weights saved as a checkpoint (model + processor): what the batch jobs and
    Serve load like any checkpoint. On a GPU the weights are drawn there and written in `dtype`."""
    import torch

    from mmspec_ray.bench import scale_models as sm

    t0 = time.perf_counter()
    spec = sm.MODELS[model]
    config = sm.reduced_config(spec.config) if reduced else spec.config
    m = sm.build_model(config, device, getattr(torch, dtype), seed)
    built = time.perf_counter() - t0
    params = sum(p.numel() for p in m.parameters())
    partial = out.with_name(out.name + ".partial")  # renamed when complete: a cut-off save is never taken
    if partial.exists():
        shutil.rmtree(partial)
    m.save_pretrained(partial)
    sm.build_processor(spec).save_pretrained(partial)
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)
    del m
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return {"model": model, "reduced": reduced, "dtype": dtype, "parameters": params, "bytes": size,
            "build_s": round(built, 1), "total_s": round(time.perf_counter() - t0, 1), "path": str(out)}


def rows(out: Path, n: int, size: tuple[int, int], words: int = 24) -> None:
    """`n` instruct rows (id, prompt, image as JPEG bytes): photo-sized pictures and prompts of vocabulary words
    (the random targets' word tokenizers read them as words; any tokenizer reads them as text)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mmspec_ray.bench.scale_models import picture, words as prompt_words

    images = []
    for i in range(n):
        buf = io.BytesIO()
        picture(size[0], size[1], i).save(buf, "JPEG", quality=90)
        images.append(buf.getvalue())
    pq.write_table(pa.table({"id": [f"row{i:04d}" for i in range(n)],
                             "prompt": [prompt_words(words, i) for i in range(n)],
                             "image": pa.array(images, pa.binary())}), out)


def world(root: Path, scenes: int, clips: int, seed: int = 0) -> None:
    """A small world in the toy layout (data/<split>.parquet, kinetics_<split>.csv, images/, clips/ as mp4) with
    `scenes` scenes and `clips` clips in the validation and test splits and none in train: the CPU dry run's
    stand-in for the toy-s world."""
    import numpy as np

    from mmspec_ray.toy.build import ToyWorld, _unique, write_data
    from mmspec_ray.toy.clips import sample_clip
    from mmspec_ray.toy.scenes import sample_scene

    rng = np.random.default_rng(seed)
    seen: set = set()
    sc = {"train": [], "validation": _unique(lambda: sample_scene(rng), scenes, seen),
          "test": _unique(lambda: sample_scene(rng), scenes, seen)}
    cl = {"train": [], "validation": _unique(lambda: sample_clip(rng), clips, seen),
          "test": _unique(lambda: sample_clip(rng), clips, seen)}
    write_data(ToyWorld(root), sc, cl, seed)


IMAGE_TASKS = ("caption", "detail", "question", "instruction")


def requests(root: Path, split: str, out: Path, limit: int | None, images_only: bool = False) -> int:
    """A world split's prompts as request rows (`mmspec toy requests`, for any world folder); `images_only`: the
    image tasks alone (rows an instruct job takes)."""
    import pyarrow.parquet as pq

    from mmspec_ray.toy.build import ToyWorld
    from mmspec_ray.toy.prompts import toy_request_table

    t = toy_request_table(ToyWorld(root), split, limit, seed=1, tasks=IMAGE_TASKS if images_only else None)
    pq.write_table(t, out)
    return t.num_rows


def inputs(work: Path, world_dir: Path | None, big_model: str, reduced: bool, device: str, dtype: str, n_rows: int,
           size: tuple[int, int], train_rows: int, decode_rows: int, tiny: bool) -> dict[str, Any]:
    """Everything the run reads, made in one process: the small world (`world_dir` None: made under work/world),
    a small target for the CPU run (`tiny`: work/tiny-target, a random toy-s-shaped checkpoint), the 7B-config
    target (work/big-target), its instruct rows (work/rows.parquet), the training rows (the world's validation
    split) and the image rows the trained drafter decodes (its test split)."""
    rec: dict[str, Any] = {}
    t = time.perf_counter()
    if world_dir is None:
        world_dir = work / "world"
        if not (world_dir / "data" / "test.parquet").exists():
            world(world_dir, 4, 4)
        rec["world_s"] = round(time.perf_counter() - t, 1)
    if tiny and not (work / "tiny-target" / "config.json").exists():
        from mmspec_ray.bench.serve import random_toy

        t = time.perf_counter()
        random_toy(work / "tiny-target")
        rec["tiny_target_s"] = round(time.perf_counter() - t, 1)
    if not (work / "big-target" / "config.json").exists():
        rec["big_target"] = save_target(work / "big-target", big_model, reduced, device, dtype)
    t = time.perf_counter()
    rows(work / "rows.parquet", n_rows, size)
    rec["train_rows"] = requests(world_dir, "validation", work / "train-rows.parquet", train_rows)
    rec["decode_rows"] = requests(world_dir, "test", work / "decode-rows.parquet", decode_rows, images_only=True)
    rec["rows_s"] = round(time.perf_counter() - t, 1)
    rec["world"] = str(world_dir)
    return rec


def serve_config(base: Path, target: str, port: int, gpus: float, cpus: float, device: str, dtype: str,
                 key_env: str, max_tokens: int = 4096, drafter: str = "auto") -> dict[str, Any]:
    """`base` (deployments/gpu.yaml) pointed at `target` on one machine: loopback HTTP on `port`, one replica of
    `gpus` GPUs and `cpus` CPUs, no S3, no media fetching, the bearer key read from `key_env`."""
    import yaml

    cfg = yaml.safe_load(base.read_text())
    cfg["proxy_location"] = "HeadOnly"
    cfg["http_options"] = {**cfg.get("http_options", {}), "host": "127.0.0.1", "port": port}
    app = cfg["applications"][0]
    args = app["args"]
    args["model_name"] = "gpu-ray"
    args["api_key_env"] = key_env
    args["decode"] = {**args["decode"], "target": target, "drafter": drafter, "device": device, "dtype": dtype}
    args["decode"].pop("s3", None)
    args["limits"] = {**args.get("limits", {}), "max_tokens": max_tokens}
    args["fetch"] = {"allow_hosts": [], "allow_s3_buckets": []}
    dep = app["deployments"][0]
    dep.pop("autoscaling_config", None)
    dep["num_replicas"] = 1
    dep["ray_actor_options"] = {"num_gpus": gpus, "num_cpus": cpus}
    dep["graceful_shutdown_timeout_s"] = 5
    return cfg


# ------------------------------------------------------------------------------------------------ Serve client
def _post(port: int, key: str, body: dict[str, Any], timeout: float) -> tuple[int, Any, bytes]:
    """POST a chat completion: status, headers (case-insensitive `get`), body."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def _body(image: bytes, max_tokens: int, stream: bool = False) -> dict[str, Any]:
    url = "data:image/jpeg;base64," + base64.b64encode(image).decode()
    return {"model": "gpu-ray", "temperature": 0, "max_tokens": max_tokens, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "w1001 w1002 w1003 w1004"}]}]}


def wait_ready(port: int, key: str, timeout: float) -> float:
    """Seconds until GET /v1/models answers 200 (raises TimeoutError)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models",
                                         headers={"Authorization": f"Bearer {key}"})
            with urllib.request.urlopen(req, timeout=10) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    raise TimeoutError(f"the endpoint did not answer on port {port} within {timeout:.0f} s")


def plain(port: int, key: str, image: bytes, max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    status, _, raw = _post(port, key, _body(image, max_tokens), 600)
    out: dict[str, Any] = {"status": status, "seconds": round(time.perf_counter() - t0, 3)}
    if status == 200:
        r = json.loads(raw)
        out.update(text=r["choices"][0]["message"]["content"], finish_reason=r["choices"][0]["finish_reason"],
                   usage=r.get("usage"))
    else:
        out["body"] = raw[:500].decode(errors="replace")
    return out


def streamed(port: int, key: str, image: bytes, max_tokens: int) -> dict[str, Any]:
    """A streamed request read as server-sent events: chunks, time to the first one, the joined text."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(_body(image, max_tokens, stream=True)).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    t0 = time.perf_counter()
    first, parts, chunks, usage, done = None, [], 0, None, False
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            status = r.status
            for line in r:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                msg = json.loads(data)
                if first is None:
                    first = time.perf_counter() - t0
                chunks += 1
                usage = msg.get("usage") or usage
                for c in msg.get("choices") or []:
                    parts.append((c.get("delta") or {}).get("content") or "")
    except urllib.error.HTTPError as e:
        return {"status": e.code, "body": e.read()[:500].decode(errors="replace")}
    return {"status": status, "seconds": round(time.perf_counter() - t0, 3),
            "first_chunk_s": None if first is None else round(first, 3), "chunks": chunks, "done": done,
            "text": "".join(parts), "usage": usage}


def killed_replica(port: int, key: str, image: bytes, max_tokens: int, after_s: float,
                   recover_s: float) -> dict[str, Any]:
    """A long request in flight while the decoder replica is killed (ray.kill, Serve replaces it): what the client
    got, then how long until the endpoint answered 200 again and what it answered meanwhile."""
    import ray

    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False)
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "ChatCompletions" in a["name"]]
    if not names:
        return {"error": "no ChatCompletions replica found among the named actors"}
    got: list[Any] = []

    def long_request() -> None:
        t = time.perf_counter()
        status, headers, raw = _post(port, key, _body(image, max_tokens), 600)
        got.append((status, headers.get("Retry-After"), raw, time.perf_counter() - t))

    th = threading.Thread(target=long_request)
    th.start()
    time.sleep(after_s)
    killed_at = time.perf_counter()
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=False)
    th.join(600)
    status, retry, raw, seconds = got[0] if got else (None, None, b"", None)
    out: dict[str, Any] = {"replica": names[0], "killed_after_s": after_s, "status": status, "retry_after": retry,
                           "request_s": None if seconds is None else round(seconds, 3)}
    try:
        out["error"] = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        out["body"] = raw[:300].decode(errors="replace")
    seen: dict[str, int] = {}
    while time.perf_counter() - killed_at < recover_s:
        st, _, _ = _post(port, key, _body(image, 4), 120)
        seen[str(st)] = seen.get(str(st), 0) + 1
        if st == 200:
            out["recovered_s"] = round(time.perf_counter() - killed_at, 2)
            break
        time.sleep(1)
    out["answers_while_replaced"] = seen
    out["ok"] = bool(status == 503 and retry and out.get("recovered_s") is not None)
    ray.shutdown()
    return out


def client(port: int, key: str, out: Path, size: tuple[int, int], max_tokens: int, long_tokens: int,
           kill_after_s: float, ready_s: float, recover_s: float, wait_only: bool = False) -> int:
    """The endpoint's checks (`wait_only`: until it answers, no more), recorded in `out`; 0 when all passed."""
    from mmspec_ray.bench.scale_models import picture

    res: dict[str, Any] = {"ready_s": round(wait_ready(port, key, ready_s), 1)}
    print(f"serve: ready after {res['ready_s']} s", flush=True)
    if wait_only:
        out.write_text(json.dumps(res, indent=2))
        return 0
    buf = io.BytesIO()
    picture(size[0], size[1], 7).save(buf, "JPEG", quality=90)
    image = buf.getvalue()
    res["plain"] = plain(port, key, image, max_tokens)
    print(f"serve: plain {res['plain']['status']} in {res['plain']['seconds']} s", flush=True)
    res["stream"] = streamed(port, key, image, max_tokens)
    res["stream"]["same_text_as_plain"] = res["stream"].get("text") == res["plain"].get("text")
    print(f"serve: streamed {res['stream']['status']}, {res['stream'].get('chunks')} chunks, first after "
          f"{res['stream'].get('first_chunk_s')} s, same text as plain: {res['stream']['same_text_as_plain']}",
          flush=True)
    res["kill"] = killed_replica(port, key, image, long_tokens, kill_after_s, recover_s)
    print(f"serve: replica killed mid-request -> {res['kill'].get('status')} (Retry-After "
          f"{res['kill'].get('retry_after')}), answering again after {res['kill'].get('recovered_s')} s", flush=True)
    res["ok"] = bool(res["plain"]["status"] == 200 and res["stream"].get("status") == 200
                     and res["stream"].get("done") and res["kill"].get("ok"))
    out.write_text(json.dumps(res, indent=2))
    return 0 if res["ok"] else 1


# ------------------------------------------------------------------------------------------------ records
def memory(gpu_csv: Path, apps_csv: Path) -> dict[str, Any]:
    """Peak GPU memory of each process (nvidia-smi --query-compute-apps samples: pid, name, MiB) and of the device
    (--query-gpu samples: MiB used, MiB total, utilization %)."""
    per: dict[str, float] = {}
    if apps_csv.is_file():
        for line in apps_csv.read_text().splitlines():
            parts = [x.strip() for x in line.split(",")]
            if len(parts) >= 3 and parts[-1].replace(".", "", 1).isdigit():
                per[parts[0]] = max(per.get(parts[0], 0.0), float(parts[-1]))
    used, total, util = [], None, []
    if gpu_csv.is_file():
        for line in gpu_csv.read_text().splitlines():
            parts = [x.strip() for x in line.split(",")]
            try:
                used.append(float(parts[0]))
                total = float(parts[1])
                util.append(float(parts[2]))
            except (ValueError, IndexError):
                continue
    big = sorted((v for v in per.values() if v >= 1024), reverse=True)  # decoders (a probe's context is smaller)
    return {"per_process_peak_mib": per, "decoder_processes": len(big),
            "peak_per_decoder_gib": round(big[0] / 1024, 2) if big else None,
            "device_peak_used_gib": round(max(used) / 1024, 2) if used else None,
            "device_total_gib": round(total / 1024, 2) if total else None,
            "mean_utilization_pct": round(sum(util) / len(util), 1) if util else None, "samples": len(used)}


def summary_line(path: Path, mem: dict[str, Any] | None = None) -> tuple[str, bool, dict[str, Any]]:
    """A batch job's `_summary.json` as one line and a record: rows answered, rate, memory per actor against the
    plan's estimate, the speedup sample; ok when the output holds every row once and none failed."""
    s = json.loads(path.read_text())
    run, plan = s["run"], s.get("plan") or {}
    mpa = plan.get("memory_per_actor") or {}
    rec = {"rows": s["rows"], "rows_written": s["rows_written"], "complete": s["complete"],
           "errors": s["all_rows"]["errors"], "errors_by_kind": s["all_rows"]["errors_by_kind"],
           "wall_s": run.get("wall_seconds"), "rows_per_s": run.get("rows_per_s"),
           "steady_rows_per_s": run.get("steady_rows_per_s"), "startup_s": run.get("startup_seconds"),
           "output_tokens_per_s": run.get("output_tokens_per_s"),
           "mean_accepted_per_cycle": s["all_rows"]["mean_accepted_per_cycle"],
           "speedup_vs_ar": run.get("speedup_vs_ar"), "gpus_per_actor": plan.get("gpus_per_actor"),
           "actors": plan.get("actors"), "device": plan.get("device"), "drafter": plan.get("drafter"),
           "estimate_need_gib": mpa.get("need_gib"), "estimate_share_gib": mpa.get("device_share_gib")}
    if mem:
        rec["measured_peak_per_decoder_gib"] = mem.get("peak_per_decoder_gib")
        rec["measured_decoder_processes"] = mem.get("decoder_processes")
        rec["device_peak_used_gib"] = mem.get("device_peak_used_gib")
    ok = bool(s["complete"] and s["all_rows"]["errors"] == 0 and s["rows_written"] == s["rows"])
    sp = rec["speedup_vs_ar"] or {}
    speed = f"{sp['speedup']:.2f}x on {sp['rows']} rows" if sp.get("speedup") else "none measured"
    rate = f"{rec['rows_per_s']:.3f}" if rec["rows_per_s"] else "?"
    mem_txt = (f"; measured peak {rec['measured_peak_per_decoder_gib']} GiB per decoder x "
               f"{rec['measured_decoder_processes']}" if mem and mem.get("peak_per_decoder_gib") else "")
    line = (f"{rec['rows_written']}/{rec['rows']} rows, {rec['errors']} errors, complete {rec['complete']}; "
            f"{rate} rows/s ({rec['actors']} actor(s), {rec['gpus_per_actor']} GPU each); estimate "
            f"{rec['estimate_need_gib']} GiB per actor of {rec['estimate_share_gib']}{mem_txt}; speedup sample "
            f"{speed}")
    return line, ok, rec


def collect(work: Path, seconds: float | None = None) -> dict[str, Any]:
    """Every stage's record (work/records/*.json) and the environment in one object; `failed` names each step
    that failed or was not reached and each record that is not ok (a job with rows unanswered, the Serve client's
    checks)."""
    out: dict[str, Any] = {"seconds": seconds, "failed": [], "stages": {}, "records": {}}
    rec = work / "records"
    for f in sorted(rec.glob("stage-*.json")):
        s = json.loads(f.read_text())
        out["stages"][s["name"]] = s
    for f in sorted(rec.glob("*.json")):
        if not f.name.startswith("stage-"):
            out["records"][f.stem] = json.loads(f.read_text())
    env = rec / "env.txt"
    out["env"] = env.read_text() if env.is_file() else None
    out["failed"] = [n for n, s in out["stages"].items() if s.get("rc") != 0]
    out["failed"] += [n for n, r in out["records"].items()
                      if isinstance(r, dict) and r.get("ok") is False and n not in out["failed"]]
    return out


def size_arg(s: str) -> tuple[int, int]:
    w, h = s.lower().split("x")
    return int(w), int(h)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmspec_ray.bench.gpu_ray", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("target")
    s.add_argument("out")
    s.add_argument("--model", default="llava_next_mistral_7b")
    s.add_argument("--reduced", action="store_true")
    s.add_argument("--device", default="cpu")
    s.add_argument("--dtype", default="float32")
    s.add_argument("--record")
    s = sub.add_parser("inputs")
    s.add_argument("work")
    s.add_argument("--world", help="the world folder (default: make a small one under WORK/world)")
    s.add_argument("--tiny", action="store_true", help="also a random toy-s-shaped target under WORK/tiny-target")
    s.add_argument("--big-model", default="llava_next_mistral_7b")
    s.add_argument("--reduced", action="store_true")
    s.add_argument("--device", default="cpu")
    s.add_argument("--dtype", default="float32")
    s.add_argument("--rows", type=int, default=8)
    s.add_argument("--size", type=size_arg, default=(1024, 768))
    s.add_argument("--train-rows", type=int, default=48)
    s.add_argument("--decode-rows", type=int, default=16)
    s = sub.add_parser("rows")
    s.add_argument("out")
    s.add_argument("--n", type=int, required=True)
    s.add_argument("--size", type=size_arg, default=(1024, 768))
    s = sub.add_parser("world")
    s.add_argument("root")
    s.add_argument("--scenes", type=int, default=4)
    s.add_argument("--clips", type=int, default=4)
    s = sub.add_parser("requests")
    s.add_argument("root")
    s.add_argument("split")
    s.add_argument("out")
    s.add_argument("--limit", type=int)
    s.add_argument("--images-only", action="store_true")
    s = sub.add_parser("serve-config")
    s.add_argument("out")
    s.add_argument("--base", required=True)
    s.add_argument("--target", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--gpus", type=float, required=True)
    s.add_argument("--cpus", type=float, default=1.0)
    s.add_argument("--device", default="auto")
    s.add_argument("--dtype", default="auto")
    s.add_argument("--key-env", default="MMSPEC_API_KEY")
    s = sub.add_parser("client")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--key-env", default="MMSPEC_API_KEY")
    s.add_argument("--out", required=True)
    s.add_argument("--size", type=size_arg, default=(1024, 768))
    s.add_argument("--max-tokens", type=int, default=32)
    s.add_argument("--long-tokens", type=int, default=2000)
    s.add_argument("--kill-after", type=float, default=2.0)
    s.add_argument("--ready-timeout", type=float, default=240.0)
    s.add_argument("--recover-timeout", type=float, default=180.0)
    s.add_argument("--wait-only", action="store_true", help="only wait until the endpoint answers")
    s = sub.add_parser("memory")
    s.add_argument("gpu_csv")
    s.add_argument("apps_csv")
    s.add_argument("--out", required=True)
    s = sub.add_parser("summary")
    s.add_argument("path")
    s.add_argument("--memory")
    s.add_argument("--record")
    s = sub.add_parser("collect")
    s.add_argument("work")
    s.add_argument("--seconds", type=float)
    s.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.cmd == "target":
        r = save_target(Path(a.out), a.model, a.reduced, a.device, a.dtype)
        print(json.dumps(r))
        if a.record:
            Path(a.record).write_text(json.dumps(r, indent=2))
    elif a.cmd == "inputs":
        work = Path(a.work)
        r = inputs(work, Path(a.world) if a.world else None, a.big_model, a.reduced, a.device, a.dtype, a.rows,
                   a.size, a.train_rows, a.decode_rows, a.tiny)
        print(json.dumps(r, indent=2))
        (work / "records").mkdir(parents=True, exist_ok=True)
        (work / "records" / "inputs.json").write_text(json.dumps(r, indent=2))
    elif a.cmd == "rows":
        rows(Path(a.out), a.n, a.size)
    elif a.cmd == "world":
        world(Path(a.root), a.scenes, a.clips)
    elif a.cmd == "requests":
        print(f"{requests(Path(a.root), a.split, Path(a.out), a.limit, a.images_only)} rows -> {a.out}")
    elif a.cmd == "serve-config":
        import yaml

        cfg = serve_config(Path(a.base), a.target, a.port, a.gpus, a.cpus, a.device, a.dtype, a.key_env)
        Path(a.out).write_text(yaml.safe_dump(cfg, sort_keys=False))
    elif a.cmd == "client":
        return client(a.port, os.environ[a.key_env], Path(a.out), a.size, a.max_tokens, a.long_tokens,
                      a.kill_after, a.ready_timeout, a.recover_timeout, a.wait_only)
    elif a.cmd == "memory":
        r = memory(Path(a.gpu_csv), Path(a.apps_csv))
        Path(a.out).write_text(json.dumps(r, indent=2))
        print(f"memory: peak {r['peak_per_decoder_gib']} GiB per decoder process x {r['decoder_processes']}, "
              f"device peak {r['device_peak_used_gib']} of {r['device_total_gib']} GiB")
    elif a.cmd == "summary":
        mem = json.loads(Path(a.memory).read_text()) if a.memory and Path(a.memory).is_file() else None
        line, ok, rec = summary_line(Path(a.path), mem)
        print(("ok: " if ok else "NOT ALL ROWS ANSWERED: ") + line)
        if a.record:
            Path(a.record).write_text(json.dumps(rec | {"ok": ok}, indent=2))
        return 0 if ok else 1
    elif a.cmd == "collect":
        r = collect(Path(a.work), a.seconds)
        Path(a.out).write_text(json.dumps(r, indent=2))
        print(f"=== done in {a.seconds} s; " + (f"failed or not reached: {', '.join(r['failed'])}" if r["failed"]
                                                else "every step ok"))
        return 1 if r["failed"] else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
