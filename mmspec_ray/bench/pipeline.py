"""Pipeline overhead benchmark: the Ray Data pipeline with one decoder actor vs calling `SpecDecoder.decode` directly
on the same rows, in the same process session, interleaved, same torch thread count. Writes JSON + a markdown table.

    python jobs/bench_batch.py                          # toy-s world: Kinetics-style captions + image instructions

Figures: rows/s and output tokens/s of (a) direct decoding (model already loaded, one warm-up row excluded),
(b) the pipeline end to end (actor start, model load, media decoding, writes included) and (c) the pipeline in
steady state (after its first block). Overhead = direct tok/s / pipeline tok/s - 1. Greedy outputs of the two
paths are compared token for token.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from mmspec_ray.batch.decoder import SpecDecoder
from mmspec_ray.batch.jobspec import CAPTION_PROMPT, DEFAULT_DRAFTER, DecodeConfig, JobSpec
from mmspec_ray.toy.drafter import resolve_auto_drafter

log = logging.getLogger("mmspec.bench.batch")


def wait_for_toy(name: str, timeout_s: float = 3 * 3600):
    """The toy world `name`, waiting for a build another process is running (never starting a second one)."""
    from mmspec_ray.toy.build import ToyWorld, build_toy, world_dir

    root = world_dir(name, 0)
    partial = root.with_name(root.name + ".partial")
    deadline = time.time() + timeout_s
    while not (root / ".complete").exists() and partial.exists():
        if time.time() > deadline:
            raise TimeoutError(f"toy world {root} still building after {timeout_s:.0f} s")
        log.info("waiting for the toy world build at %s", partial)
        time.sleep(30)
    return ToyWorld(root) if (root / ".complete").exists() else build_toy(name)


def workload(job: str, world, split: str, limit: int | None) -> tuple[pa.Table, dict[str, Any]]:
    """Rows and the media settings of one job kind on the toy world."""
    from mmspec_ray.batch.sources import kinetics_rows, toy_rows
    from mmspec_ray.targets.hf import video_frames_for

    if job == "caption":
        table = kinetics_rows(str(world.kinetics_csv(split)), str(world.clips / split), CAPTION_PROMPT)
        media = {"require": "video", "num_frames": video_frames_for(world.target)}
    else:
        table = toy_rows(str(world.examples(split)), str(world.data), "image")
        media = {"require": "image"}
    return (table.slice(0, limit) if limit else table), media


def run_direct(cfg: DecodeConfig, table: pa.Table) -> dict[str, Any]:
    t0 = time.perf_counter()
    decoder = SpecDecoder(cfg)
    load_s = time.perf_counter() - t0
    rows = table.to_pylist()
    decoder.decode(rows[0])  # warm-up (not timed)
    t1 = time.perf_counter()
    outs = {r["id"]: decoder.decode(r) for r in rows}
    wall = time.perf_counter() - t1
    tokens = sum(o["num_output_tokens"] or 0 for o in outs.values())
    gen_s = sum(o["decode_seconds"] or 0.0 for o in outs.values())
    return {"rows": len(rows), "output_tokens": tokens, "wall_s": wall, "load_s": load_s, "generate_s": gen_s,
            "rows_per_s": len(rows) / wall, "output_tokens_per_s": tokens / wall,
            "errors": sum(o["error"] is not None for o in outs.values()),
            "token_ids": {k: o["output_token_ids"] for k, o in outs.items()}}


def run_pipeline(cfg: DecodeConfig, table: pa.Table, out_dir: str, rows_per_block: int) -> dict[str, Any]:
    from mmspec_ray.batch.pipeline import run_job
    from mmspec_ray.batch.output import read_marker
    from mmspec_ray.batch.output import scan as scan_output
    from mmspec_ray.batch.storage import locate

    spec = JobSpec(input="(bench rows)", output=out_dir, decode=cfg, num_actors=1, overwrite=True,
                   progress_bars=False, progress_interval_s=60, rows_per_block=rows_per_block)
    s = run_job(spec, table=table)
    out = locate(out_dir, cfg.s3)
    _, written = scan_output(out, read_marker(out), ["output_token_ids"])
    r = s["run"]
    return {"rows": r["rows"], "output_tokens": r["output_tokens"], "wall_s": r["wall_seconds"],
            "generate_s": r["decode_seconds"],
            "rows_per_s": r["rows_per_s"], "output_tokens_per_s": r["output_tokens_per_s"],
            "startup_s": r.get("startup_seconds"), "steady_rows_per_s": r.get("steady_rows_per_s"),
            "steady_output_tokens_per_s": r.get("steady_output_tokens_per_s"), "errors": r["errors"],
            "complete": s["complete"],
            "token_ids": dict(zip(written.column("id").to_pylist(), written.column("output_token_ids").to_pylist()))}


def _med(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def bench_job(job: str, world, a: argparse.Namespace, tmp: str) -> dict[str, Any]:
    table, media = workload(job, world, a.split, a.limit.get(job))
    cfg = DecodeConfig(target=str(world.target), drafter=a.resolved_drafter, max_new_tokens=a.max_new_tokens,
                       default_prompt=CAPTION_PROMPT, media=media, torch_threads=a.torch_threads, device="cpu")
    reps: list[dict[str, Any]] = []
    for i in range(a.repeats):
        direct = run_direct(cfg, table)
        pipe = run_pipeline(cfg, table, os.path.join(tmp, f"{job}-{i}"), a.rows_per_block)
        same = direct.pop("token_ids") == pipe.pop("token_ids")
        reps.append({"direct": direct, "pipeline": pipe, "outputs_identical": same})
        log.info("%s rep %d: direct %.1f tok/s, pipeline %.1f tok/s (steady %s), identical=%s", job, i,
                 direct["output_tokens_per_s"], pipe["output_tokens_per_s"], pipe["steady_output_tokens_per_s"],
                 same)
    d_tps = _med([r["direct"]["output_tokens_per_s"] for r in reps])
    p_tps = _med([r["pipeline"]["output_tokens_per_s"] for r in reps])
    s_tps = _med([r["pipeline"]["steady_output_tokens_per_s"] for r in reps])
    return {
        "job": job, "rows": table.num_rows, "repeats": reps,
        "median": {
            "direct_rows_per_s": _med([r["direct"]["rows_per_s"] for r in reps]),
            "direct_output_tokens_per_s": d_tps,
            "direct_load_s": _med([r["direct"]["load_s"] for r in reps]),
            "pipeline_rows_per_s": _med([r["pipeline"]["rows_per_s"] for r in reps]),
            "pipeline_output_tokens_per_s": p_tps,
            "pipeline_startup_s": _med([r["pipeline"]["startup_s"] for r in reps]),
            "pipeline_steady_rows_per_s": _med([r["pipeline"]["steady_rows_per_s"] for r in reps]),
            "pipeline_steady_output_tokens_per_s": s_tps,
            "overhead_end_to_end": d_tps / p_tps - 1 if d_tps and p_tps else None,
            "overhead_steady": d_tps / s_tps - 1 if d_tps and s_tps else None,
            "output_tokens": reps[0]["direct"]["output_tokens"],
            # time inside SpecEngine.generate summed over rows: if the actor's is higher than direct's, the gap is
            # CPU contention on the model itself, not pipeline machinery
            "direct_generate_s": _med([r["direct"]["generate_s"] for r in reps]),
            "pipeline_generate_s": _med([r["pipeline"]["generate_s"] for r in reps]),
        },
        "outputs_identical": all(r["outputs_identical"] for r in reps),
    }


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    def f(x, nd=1):
        return "-" if x is None else f"{x:.{nd}f}"

    def pct(x):
        return "-" if x is None else f"{100 * x:+.1f}%"

    lines = [f"Batch pipeline vs direct decoding, {meta['world']} ({meta['drafter']} drafter, greedy, "
             f"max_new_tokens {meta['max_new_tokens']}, {meta['torch_threads']} torch thread(s), medians of "
             f"{meta['repeats']} interleaved runs, load average {meta['loadavg_start']} -> {meta['loadavg_end']})",
             "",
             "| job | rows | output tokens | mode | rows/s | output tok/s | overhead vs direct | generate s |",
             "|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in results:
        m = r["median"]
        head = f"| {r['job']} | {r['rows']} | {m['output_tokens']} "
        lines.append(head + f"| direct `decode(row)` (model loaded, {f(m['direct_load_s'])} s load not counted) | "
                     f"{f(m['direct_rows_per_s'], 2)} | {f(m['direct_output_tokens_per_s'])} | - | "
                     f"{f(m['direct_generate_s'])} |")
        lines.append(head + f"| pipeline, 1 actor, end to end (startup {f(m['pipeline_startup_s'])} s included) | "
                     f"{f(m['pipeline_rows_per_s'], 2)} | {f(m['pipeline_output_tokens_per_s'])} | "
                     f"{pct(m['overhead_end_to_end'])} | {f(m['pipeline_generate_s'])} |")
        lines.append(head + f"| pipeline, 1 actor, steady state (after the first block) | "
                     f"{f(m['pipeline_steady_rows_per_s'], 2)} | {f(m['pipeline_steady_output_tokens_per_s'])} | "
                     f"{pct(m['overhead_steady'])} | |")
    ident = all(r["outputs_identical"] for r in results)
    lines += ["", f"Outputs of the two paths identical token for token: {'yes' if ident else 'NO'}."]
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="jobs/bench_batch.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--toy", default="toy-s")
    p.add_argument("--split", default="test")
    p.add_argument("--jobs", default="caption,instruct", help="comma list of caption, instruct")
    p.add_argument("--caption-limit", type=int, default=None, help="rows of the caption job (default: all)")
    p.add_argument("--instruct-limit", type=int, default=200)
    p.add_argument("--drafter", default=DEFAULT_DRAFTER)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows-per-block", type=int, default=4)
    p.add_argument("--torch-threads", type=int, default=1, help="same in the actor and in direct decoding")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray instance (default: all)")
    p.add_argument("--out", default="out/bench_batch", help="folder for bench_batch.json and bench_batch.md")
    a = p.parse_args(argv)
    a.limit = {"caption": a.caption_limit, "instruct": a.instruct_limit}
    return a


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    a = parse(argv)
    import torch

    from mmspec_ray.batch.cluster import connect_ray

    torch.set_num_threads(a.torch_threads)
    world = wait_for_toy(a.toy)
    a.resolved_drafter = resolve_auto_drafter(a.drafter, str(world.target))
    connect_ray(a.num_cpus)
    load0 = " ".join(f"{x:.1f}" for x in os.getloadavg())
    weights = Path(world.target) / "model.safetensors"
    stamp0 = weights.stat().st_mtime_ns
    tmp = tempfile.mkdtemp(prefix="mmspec-bench-batch-")
    try:
        results = [bench_job(job, world, a, tmp) for job in a.jobs.split(",")]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    drafter = a.drafter if a.drafter == a.resolved_drafter else f"{a.drafter} ({a.resolved_drafter})"
    meta = {"world": f"{a.toy} ({world.root.name}, {a.split} split)", "drafter": drafter,
            "max_new_tokens": a.max_new_tokens, "torch_threads": a.torch_threads, "repeats": a.repeats,
            "rows_per_block": a.rows_per_block, "cpus": os.cpu_count(), "platform": platform.platform(),
            "torch": torch.__version__, "loadavg_start": load0,
            "loadavg_end": " ".join(f"{x:.1f}" for x in os.getloadavg()),
            "command": "python jobs/bench_batch.py " + " ".join(argv if argv is not None else []),
            # another process rebuilding the toy world in place mid-run would make the two paths disagree
            "target_rewritten_during_run": weights.stat().st_mtime_ns != stamp0}
    if meta["target_rewritten_during_run"]:
        log.warning("the target checkpoint %s was rewritten during the benchmark: figures and the output "
                    "comparison are not valid; run again", weights)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_batch.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    md = markdown(results, meta)
    (out / "bench_batch.md").write_text(md)
    print(md)
    return 0 if all(r["outputs_identical"] for r in results) else 1
