"""What a 7B-class VLM gets from this engine: targets built from published configs with random weights
(bench/scale_models.py), measured section by section, each section's figures written as soon as it ends.

Sections (`--sections`, default all, in this order):
  env       the device, driver, torch and transformers; memory bandwidth measured by a device copy
  costs     per target: AR step and verify of 1-128 chain tokens at 1k / 4k / 16k context, SDPA and eager;
            prefill time, KV bytes and peak memory at those contexts; the step floor (text weight bytes / bandwidth)
  media     per target: encode and prefill time, tokens and peak memory of 1 image, 4 images, a 16-frame clip
  oracle    per target: AR answers, then the oracle drafter (it proposes AR's answer as a chain) at several chain
            lengths: tokens per forward, speedup over AR, efficiency against ideal, bookkeeping per cycle, a
            per-cycle profile; greedy agreement with AR with and without the tie guard
  drafters  per target: one propose (default tree) and the prefill (`begin`) of every drafter head at full size
  graphs    chain verify of 1-64 tokens over a static KV cache, eager and replayed as a CUDA graph per size
  hf        per target: HF generate (dynamic cache), HF assisted generation (a small random model of the family as
            assistant), HF generate with a static cache (compiled by HF) on a text prompt
  actors    rows per second of 1, 2 and 4 decoder processes sharing one device (what Ray actors with fractional
            num_gpus are), AR and oracle, on image requests
`python -m mmspec_ray.bench.gpu_scale --out DIR` (scripts/gpu_scale.sh on a GPU; `--reduced` for the CPU test).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import logging
import platform
import pstats
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mmspec_ray.bench import scale_models as sm
from mmspec_ray.config import SamplingParams
from mmspec_ray.decoding.engine import AREngine, SpecEngine
from mmspec_ray.decoding.tree import TreeConfig
from mmspec_ray.drafters.oracle import OracleDrafter
from mmspec_ray.targets.base import TargetError, VLMTarget

log = logging.getLogger("gpu_scale")
SECTIONS = ("env", "costs", "media", "oracle", "drafters", "graphs", "hf", "actors")
DRAFTERS = ("eagle2", "hivis", "dream", "specflash", "vispec", "msd")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """(seconds, result) of fn(), the device drained before and after."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_mb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def round_mb(mb: float | None) -> float | None:
    return None if mb is None else round(mb)


def kv_mb(target: VLMTarget) -> float:
    """Bytes the request's KV cache holds now, in MB."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in target.cache.layers) / 2**20


# ---------------------------------------------------------------- env
def env_info(device: torch.device) -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__,
                            "python": platform.python_version(), "device": str(device)}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=p.name, gpu_memory_gb=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda,
                    multiprocessors=p.multi_processor_count)
        try:
            import subprocess

            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            info["driver"] = f"unknown ({e})"
        info["copy_gb_per_s"] = copy_bandwidth(device)
    else:
        info["cpu"] = platform.processor() or platform.machine()
        info["threads"] = torch.get_num_threads()
    return info


def copy_bandwidth(device: torch.device, mb: int = 1024, repeats: int = 5) -> float:
    """Memory bandwidth in GB/s seen by a device-to-device copy (bytes read + bytes written) / time, the median."""
    a = torch.empty(mb * 2**20, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    times = [timed(lambda: b.copy_(a), device)[0] for _ in range(repeats)]
    return round(2 * a.nbytes / statistics.median(times) / 1e9, 1)


# ---------------------------------------------------------------- costs
def text_inputs(target: VLMTarget, n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A text-only prompt of n ids drawn clear of every special and media id."""
    g = torch.Generator().manual_seed(seed + n)
    ids = torch.randint(1000, min(30000, target.vocab_size), (1, n), generator=g).to(target.device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def set_attention(target: VLMTarget, impl: str) -> None:
    target.model.set_attn_implementation(impl)


def verify_curve(target: VLMTarget, sizes: tuple[int, ...], rounds: int, warmup: int = 2) -> dict[int, float]:
    """{n: median ms of one verify of an n-token chain} after the cache's committed context, sizes interleaved per
    round; the cache is left as it was (each chain dropped by commit([]))."""
    g = torch.Generator().manual_seed(1)
    rec: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(warmup + rounds):
        for n in sizes:
            tokens = torch.randint(1000, 30000, (n,), generator=g)
            anc = torch.tril(torch.ones(n, n, dtype=torch.bool))
            s, _ = timed(lambda: target.verify(tokens, anc, torch.arange(n)), target.device)
            target.commit([])
            if r >= warmup:
                rec[n].append(1e3 * s)
    return {n: round(statistics.median(v), 3) for n, v in rec.items()}


def costs(target: VLMTarget, contexts: tuple[int, ...], sizes: tuple[int, ...], rounds: int,
          impls: tuple[str, ...] = ("sdpa", "eager")) -> dict[str, Any]:
    """Prefill and verify costs at each context; the decode step's floor from the text weights' bytes."""
    out: dict[str, Any] = {"contexts": {}}
    dev = target.device
    for ctx in contexts:
        inputs = text_inputs(target, ctx)
        set_attention(target, "sdpa")
        target.prefill(inputs)  # warm-up
        reset_peak(dev)
        s, _ = timed(lambda: target.prefill(inputs), dev)
        row: dict[str, Any] = {"prefill_ms": round(1e3 * s, 2), "kv_mb": round(kv_mb(target), 3),
                               "prefill_peak_mb": round_mb(peak_mb(dev))}
        for impl in impls:
            set_attention(target, impl)
            row[f"verify_ms_{impl}"] = verify_curve(target, sizes, rounds)
        set_attention(target, "sdpa")
        out["contexts"][ctx] = row
        log.info("costs ctx %d: prefill %.1f ms, AR step %.2f ms, verify %s", ctx, row["prefill_ms"],
                 row["verify_ms_sdpa"][sizes[0]], row["verify_ms_sdpa"])
    weights = sm.text_params(target) * target.model.get_output_embeddings().weight.element_size()
    out["text_weight_gb"] = round(weights / 1e9, 3)
    out["params_total"] = sum(p.numel() for p in target.model.parameters())
    return out


# ---------------------------------------------------------------- media
def media(target: VLMTarget, kinds: tuple[str, ...], max_new_tokens: int = 128) -> dict[str, Any]:
    """Per media request: tokens, encode ms (processor, on the CPU), prefill ms (second of two), KV and peak MB."""
    out: dict[str, Any] = {}
    dev = target.device
    for kind in kinds:
        try:
            req = sm.media_request(kind)
            t0 = time.perf_counter()
            inputs = target.encode(req)
            enc = time.perf_counter() - t0
            n = int(inputs["input_ids"].shape[1])
            target.check_length(n, max_new_tokens)
        except TargetError as e:
            out[kind] = {"skipped": str(e)}
            log.info("media %s skipped: %s", kind, e)
            continue
        target.prefill(inputs)
        reset_peak(dev)
        s, _ = timed(lambda: target.prefill(inputs), dev)
        out[kind] = {"tokens": n, "media_tokens": int(target.media_mask_of(inputs["input_ids"]).sum()),
                     "encode_ms": round(1e3 * enc, 1), "prefill_ms": round(1e3 * s, 2),
                     "kv_mb": round(kv_mb(target), 3), "peak_mb": round_mb(peak_mb(dev))}
        log.info("media %s: %s", kind, out[kind])
    return out


# ---------------------------------------------------------------- oracle
def image_requests(n: int, prompt_words: int = 24) -> list:
    return [sm.media_request("image1", seed=100 + i, prompt_words=prompt_words) for i in range(n)]


def decode_s(g) -> float:
    """A generation's decode time: everything after the prefill's first token."""
    return g.stats.total_s - g.stats.prefill_s


def oracle(target: VLMTarget, requests: list, max_new_tokens: int, chains: tuple[int, ...],
           agree: int, profile: bool = True) -> dict[str, Any]:
    """AR, then the oracle drafter at each chain length, on the same requests (the AR run first warms up)."""
    greedy = SamplingParams()
    ar = AREngine(target)
    ar.generate(requests[0], greedy, max_new_tokens=8)
    gens = [ar.generate(r, greedy, max_new_tokens=max_new_tokens) for r in requests]
    answers = [g.token_ids for g in gens]
    ar_decode = sum(decode_s(g) for g in gens)
    ar_tokens = sum(len(a) - 1 for a in answers)
    step_ms = 1e3 * sum(g.stats.verify_s for g in gens) / sum(g.stats.cycles for g in gens)
    out: dict[str, Any] = {
        "requests": len(requests), "max_new_tokens": max_new_tokens,
        "prompt_tokens": statistics.median(g.stats.prompt_tokens for g in gens),
        "ar": {"decode_ms_per_token": round(1e3 * ar_decode / ar_tokens, 3), "step_ms": round(step_ms, 3),
               "prefill_ms": round(1e3 * statistics.median(g.stats.prefill_s for g in gens), 2),
               "overhead_ms_per_cycle": round(1e3 * sum(g.stats.overhead_s for g in gens)
                                              / sum(g.stats.cycles for g in gens), 3)},
        "chains": {},
    }
    best: tuple[float, int] = (0.0, chains[0])
    for n in chains:
        eng = SpecEngine(target, OracleDrafter([]), TreeConfig(top_k=1, depth=n - 1, total_tokens=n))
        runs = []
        for req, ans in zip(requests, answers):
            eng.drafter = OracleDrafter(ans)
            runs.append(eng.generate(req, greedy, max_new_tokens=max_new_tokens))
        cycles = sum(g.stats.cycles for g in runs)
        tokens = sum(len(g.token_ids) - 1 for g in runs)
        spec_decode = sum(decode_s(g) for g in runs)
        verify_ms = 1e3 * sum(g.stats.verify_s for g in runs) / cycles
        book_ms = 1e3 * sum(g.stats.overhead_s + g.stats.draft_s for g in runs) / cycles
        tpf = tokens / cycles
        speedup = ar_decode / spec_decode
        ideal = tpf * step_ms / verify_ms
        row = {"tokens_per_forward": round(tpf, 3), "speedup": round(speedup, 3),
               "speedup_end_to_end": round(sum(g.stats.total_s for g in gens) / sum(g.stats.total_s for g in runs), 3),
               "verify_ms": round(verify_ms, 3), "bookkeeping_ms_per_cycle": round(book_ms, 3),
               "bookkeeping_share": round(book_ms / (1e3 * spec_decode / cycles), 4),
               "ideal_speedup": round(ideal, 3), "efficiency": round(speedup / ideal, 3),
               "identical": sum(g.token_ids == a for g, a in zip(runs, answers))}
        out["chains"][n] = row
        best = max(best, (speedup, n))
        log.info("oracle chain %d: %s", n, row)
    out["best_chain"] = best[1]
    if profile:
        from mmspec_ray.bench.profile import split

        eng = SpecEngine(target, OracleDrafter(answers[0]), TreeConfig(top_k=1, depth=best[1] - 1,
                                                                         total_tokens=best[1]))
        prof = cProfile.Profile()
        prof.enable()
        g = eng.generate(requests[0], greedy, max_new_tokens=max_new_tokens)
        prof.disable()
        res = split(pstats.Stats(prof))
        out["profile_ms_per_cycle"] = {k: round(1e3 * v / g.stats.cycles, 3) for k, v in res.items() if v > 0}
    if agree:
        out["agreement"] = agreement(target, requests, answers, agree, max_new_tokens, best[1])
    return out


def agreement(target: VLMTarget, requests: list, answers: list, n: int, max_new_tokens: int,
              chain: int) -> dict[str, Any]:
    """How often the engine's greedy answer is AR's, on n image requests (the first ones' AR answers reused), the
    oracle at `chain`, with the dtype's tie guard and without it (tie margin 0)."""
    greedy = SamplingParams()
    reqs = list(requests) + image_requests(n)[len(requests):]
    ar = AREngine(target)
    ans = list(answers) + [ar.generate(r, greedy, max_new_tokens=max_new_tokens).token_ids
                           for r in reqs[len(answers):n]]
    out: dict[str, Any] = {"requests": n, "max_new_tokens": max_new_tokens, "chain": chain}
    tree = TreeConfig(top_k=1, depth=chain - 1, total_tokens=chain)
    for name, margin in (("tie_guard", None), ("no_guard", 0.0)):
        eng = SpecEngine(target, OracleDrafter([]), tree, tie_margin=margin)
        same, ties, first = 0, 0, []
        for req, a in zip(reqs[:n], ans[:n]):
            eng.drafter = OracleDrafter(a)
            g = eng.generate(req, greedy, max_new_tokens=max_new_tokens)
            same += g.token_ids == a
            ties += g.stats.tie_cycles
            if g.token_ids != a:
                first.append(next(i for i, (x, y) in enumerate(zip(g.token_ids + [-1], a + [-1])) if x != y))
        out[name] = {"margin": eng.tie_margin, "identical": same, "tie_cycles": ties,
                     "first_divergence": sorted(first)}
        log.info("agreement %s: %d/%d identical, %d tie cycles", name, same, n, ties)
    return out


# ---------------------------------------------------------------- drafters
def drafter_costs(target: VLMTarget, methods: tuple[str, ...], kinds: tuple[str, ...], tree: TreeConfig,
                  repeats: int) -> dict[str, Any]:
    """Per drafter head (random weights at the target's size): parameters, its prefill (`begin`) on each media
    request, and one propose of `tree` (ms, drafter forwards) after it."""
    from mmspec_ray.drafters.base import drafter_class, target_features

    dev = target.device
    prompts: dict[str, Any] = {}
    for kind in kinds:
        try:
            inputs = target.encode(sm.media_request(kind))
            target.check_length(int(inputs["input_ids"].shape[1]), 128)
            prompts[kind] = inputs
        except TargetError as e:
            log.info("drafters: %s skipped: %s", kind, e)
    out: dict[str, Any] = {"tree": tree.model_dump()}
    for m in methods:
        d = drafter_class(m).random(target)
        row: dict[str, Any] = {"params": sum(p.numel() for p in d.head.parameters())}
        for kind, inputs in prompts.items():
            pre = target.prefill(inputs, logits_to_keep=getattr(d, "prefill_logits", 1),
                                 attention=bool(getattr(d, "prefill_attention", False)))
            root = int(pre.logits[0, -1].argmax())
            last = target_features(d, pre)[0, -1:]
            d.begin(target, pre, root)  # warm-up
            begin_s, _ = timed(lambda: d.begin(target, pre, root), dev)
            d.propose(root, tree)
            p0, obs, prop = d.passes, [], []
            for _ in range(repeats):  # a cycle's drafter work: observe one accepted token, then propose
                obs.append(timed(lambda: d.observe([root], last, root), dev)[0])
                prop.append(timed(lambda: d.propose(root, tree), dev)[0])
            row[kind] = {"begin_ms": round(1e3 * begin_s, 2), "prefill_tokens": int(d.prefill_tokens),
                         "observe_ms": round(1e3 * statistics.median(obs), 3),
                         "propose_ms": round(1e3 * statistics.median(prop), 3),
                         "passes": (d.passes - p0) / repeats}
            del pre
        out[m] = row
        log.info("drafter %s: %s", m, row)
        del d
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------- CUDA graphs
def graph_steps(target: VLMTarget, ctx: int, sizes: tuple[int, ...], rounds: int) -> dict[str, Any]:
    """Chain verify forwards of n tokens over a static KV cache (transformers' StaticCache) at `ctx` context: run
    eagerly, and replayed as one CUDA graph per n (the bucketed trees of gpt-fast and vLLM), with the largest
    logit difference between the two. What launch overhead costs an HF forward at batch size 1. (transformers'
    StaticCache appends at its own device-side fill counter, which each forward resets to ctx.)"""
    from transformers import StaticCache

    model, dev, dtype = target.model, target.device, target.dtype
    max_len = ctx + max(sizes)
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    ids = text_inputs(target, ctx)["input_ids"]
    model(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(ctx, device=dev),
          logits_to_keep=1)
    target.prefill({"input_ids": ids, "attention_mask": torch.ones_like(ids)})  # the engine's own cache, to compare
    out: dict[str, Any] = {"context": ctx}
    for n in sizes:
        tok = torch.randint(1000, 30000, (1, n), device=dev)
        cache_pos = torch.arange(ctx, ctx + n, device=dev)
        pos = cache_pos[None] if target.family != "qwen2_5_vl" else cache_pos.view(1, 1, n).expand(3, 1, n)
        allowed = torch.zeros((n, max_len), dtype=torch.bool, device=dev)
        allowed[:, :ctx] = True
        allowed[:, ctx:ctx + n] = torch.tril(torch.ones(n, n, dtype=torch.bool, device=dev))
        mask = torch.zeros((1, 1, n, max_len), dtype=dtype, device=dev).masked_fill_(~allowed, torch.finfo(dtype).min)

        def fwd():  # the cache's fill counter (a device tensor) back to ctx: every run rewrites the same n slots
            for layer in cache.layers:
                layer.cumulative_length.fill_(ctx)
            return model(input_ids=tok, attention_mask=mask, position_ids=pos, past_key_values=cache,
                         cache_position=cache_pos, use_cache=True).logits

        with torch.inference_mode():
            fwd()
            eager = [timed(fwd, dev)[0] for _ in range(rounds)]
            ref = fwd().float()
            engine = target.verify(tok[0], torch.tril(torch.ones(n, n, dtype=torch.bool)), torch.arange(n)).logits
            target.commit([])
            row: dict[str, Any] = {"eager_ms": round(1e3 * statistics.median(eager), 3),
                                   "vs_engine_max_logit_diff": float((engine - ref).abs().max())}
            if dev.type == "cuda":
                side = torch.cuda.Stream(dev)
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    for _ in range(3):
                        fwd()
                torch.cuda.current_stream(dev).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_logits = fwd()
                graph.replay()
                replay = [timed(graph.replay, dev)[0] for _ in range(rounds)]
                row["graph_ms"] = round(1e3 * statistics.median(replay), 3)
                row["max_logit_diff"] = float((static_logits.float() - ref).abs().max())
                row["same_argmax"] = bool(torch.equal(static_logits.argmax(-1), ref.argmax(-1)))
                del graph, static_logits
        out[n] = row
        log.info("graphs n=%d: %s", n, row)
    return out


# ---------------------------------------------------------------- HF peers
def hf_peers(target: VLMTarget, name: str, requests: list, max_new_tokens: int, reduced: bool,
             static: bool) -> dict[str, Any]:
    """HF generate and HF assisted generation on the same image requests; HF's static-cache generate (which HF
    compiles) on a text prompt, beside its dynamic-cache generate on the same prompt."""
    model, dev = target.model, target.device
    out: dict[str, Any] = {}
    enc = [target.encode(r) for r in requests]

    def gen(inputs, **kw):
        return model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                              do_sample=False, **kw)

    gen(enc[0])
    s = [timed(lambda i=i: gen(i), dev)[0] for i in enc]
    out["generate_ms_per_token"] = round(1e3 * sum(s) / (len(enc) * max_new_tokens), 3)
    small = sm.build_model(sm.reduced_config(sm.MODELS[name].config), dev, target.dtype, seed=1)
    try:
        gen(enc[0], assistant_model=small)
        s = [timed(lambda i=i: gen(i, assistant_model=small), dev)[0] for i in enc]
        out["assisted_ms_per_token"] = round(1e3 * sum(s) / (len(enc) * max_new_tokens), 3)
    except Exception as e:  # an HF limitation for this family: reported, not fatal
        out["assisted_error"] = f"{type(e).__name__}: {e}"[:300]
    del small
    if static:
        text = text_inputs(target, 256)
        dyn = [timed(lambda: gen(text), dev)[0] for _ in range(2)][-1]
        try:
            t0 = time.perf_counter()
            gen(text, cache_implementation="static")
            first = time.perf_counter() - t0
            st = [timed(lambda: gen(text, cache_implementation="static"), dev)[0] for _ in range(2)][-1]
            same = torch.equal(gen(text), gen(text, cache_implementation="static"))
            out["static"] = {"dynamic_ms_per_token": round(1e3 * dyn / max_new_tokens, 3),
                             "static_ms_per_token": round(1e3 * st / max_new_tokens, 3),
                             "first_call_s": round(first, 1), "same_output": bool(same)}
        except Exception as e:
            out["static"] = {"error": f"{type(e).__name__}: {e}"[:300],
                             "dynamic_ms_per_token": round(1e3 * dyn / max_new_tokens, 3)}
    log.info("hf: %s", out)
    return out


# ---------------------------------------------------------------- actors per device
def _actor(name: str, reduced: bool, device: str, dtype: str, n_req: int, max_new_tokens: int, chain: int,
           barrier, queue) -> None:
    """One decoder process: build the target, then AR on its requests, then the oracle, each phase started with
    every other process (barrier)."""
    try:
        torch.set_num_threads(1)
        target = sm.build(name, device, getattr(torch, dtype), reduced)
        reqs = image_requests(n_req)
        greedy = SamplingParams()
        ar = AREngine(target)
        ar.generate(reqs[0], greedy, max_new_tokens=4)
        barrier.wait()
        t0 = time.perf_counter()
        answers = [ar.generate(r, greedy, max_new_tokens=max_new_tokens).token_ids for r in reqs]
        t_ar = time.perf_counter() - t0
        barrier.wait()
        eng = SpecEngine(target, OracleDrafter([]), TreeConfig(top_k=1, depth=chain - 1, total_tokens=chain))
        t0 = time.perf_counter()
        same = 0
        for r, a in zip(reqs, answers):
            eng.drafter = OracleDrafter(a)
            same += eng.generate(r, greedy, max_new_tokens=max_new_tokens).token_ids == a
        queue.put({"ar_s": t_ar, "oracle_s": time.perf_counter() - t0, "identical": same})
    except BaseException as e:  # the parent must hear of it, not wait forever
        barrier.abort()
        queue.put({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-800:]})


def actors(name: str, reduced: bool, device: str, dtype: str, counts: tuple[int, ...], n_req: int,
           max_new_tokens: int, chain: int, timeout_s: float = 240.0) -> dict[str, Any]:
    """Rows per second on one device for each number of decoder processes: each decodes `n_req` image requests,
    all start together; rows/s = all rows / the slowest process's time."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out: dict[str, Any] = {"requests_per_actor": n_req, "max_new_tokens": max_new_tokens, "chain": chain}
    for k in counts:
        barrier, queue = ctx.Barrier(k, timeout=timeout_s), ctx.Queue()
        procs = [ctx.Process(target=_actor, args=(name, reduced, device, dtype, n_req, max_new_tokens, chain,
                                                  barrier, queue), daemon=True) for _ in range(k)]
        for p in procs:
            p.start()
        res = [queue.get(timeout=timeout_s) for _ in procs]
        for p in procs:
            p.join(timeout=30)
        errors = [r["error"] for r in res if "error" in r]
        if errors:
            out[k] = {"error": errors[0]}
            log.warning("actors %d: %s", k, next(r["trace"] for r in res if "error" in r))
            continue
        rows = k * n_req
        out[k] = {"ar_rows_per_s": round(rows / max(r["ar_s"] for r in res), 3),
                  "oracle_rows_per_s": round(rows / max(r["oracle_s"] for r in res), 3),
                  "identical": sum(r["identical"] for r in res), "rows": rows}
        log.info("actors %d: %s", k, out[k])
    return out


# ---------------------------------------------------------------- driver
def ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen2_5_vl_7b,llava_next_mistral_7b")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--reduced", action="store_true", help="shrunk widths and depths (CPU test of the same path)")
    p.add_argument("--contexts", default="1024,4096,16384")
    p.add_argument("--sizes", default="1,2,4,8,16,32,64,128")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--attn", default="sdpa,eager", help="attention implementations timed for verify")
    p.add_argument("--media", default="image1,image4,clip16")
    p.add_argument("--requests", type=int, default=4, help="image requests of the oracle and HF runs")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--chains", default="4,16")
    p.add_argument("--agree", type=int, default=8, help="requests of the agreement check (0: none)")
    p.add_argument("--drafters", default=",".join(DRAFTERS))
    p.add_argument("--static", action="store_true", help="also HF generate with a static (compiled) cache")
    p.add_argument("--full", default="qwen2_5_vl_7b", help="the model that also gets the agreement check, the "
                   "drafter heads and the HF peers (the others: costs, media, oracle)")
    p.add_argument("--actor-max-new-tokens", type=int, default=64)
    p.add_argument("--graph-sizes", default="1,8,16,32,64")
    p.add_argument("--actors", default="1,2,4")

    p.add_argument("--actor-requests", type=int, default=2)
    p.add_argument("--out", required=True, help="folder: results.json (rewritten after every section)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    sections = set(a.sections.split(","))
    res: dict[str, Any] = {"command": " ".join(sys.argv), "reduced": a.reduced, "dtype": a.dtype, "models": {},
                           "errors": {}}

    def save() -> None:
        (out / "results.json").write_text(json.dumps(res, indent=1, default=str))

    def run(key: str, where: dict, fn: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        try:
            where[key] = fn()
        except Exception as e:  # one section's failure is recorded; the next section runs
            res["errors"][f"{where.get('name', '')}/{key}"] = f"{type(e).__name__}: {e}"
            log.error("section %s failed:\n%s", key, traceback.format_exc())
        log.info("section %s took %.1f s", key, time.perf_counter() - t0)
        save()

    if "env" in sections:
        run("env", res, lambda: env_info(dev))
    tree = TreeConfig()
    models = a.models.split(",")

    def measure(name: str, wanted: set[str]) -> None:
        """One model's sections (the HF peers last: HF's static-cache compile is the slowest and least sure)."""
        if not wanted:
            return
        m: dict[str, Any] = res["models"].setdefault(name, {"name": name})
        t0 = time.perf_counter()
        target = sm.build(name, dev, dtype, a.reduced)
        sync(dev)
        m.setdefault("build_s", round(time.perf_counter() - t0, 1))
        m["family"] = target.family
        reqs = image_requests(a.requests)
        if "costs" in wanted:
            run("costs", m, lambda: costs(target, ints(a.contexts), ints(a.sizes), a.rounds,
                                          tuple(a.attn.split(","))))
        if "media" in wanted:
            run("media", m, lambda: media(target, tuple(a.media.split(",")), a.max_new_tokens))
        if "oracle" in wanted:
            run("oracle", m, lambda: oracle(target, reqs, a.max_new_tokens, ints(a.chains),
                                            a.agree if name == a.full else 0))
        if "drafters" in wanted and a.drafters and name == a.full:
            run("drafters", m, lambda: drafter_costs(target, tuple(a.drafters.split(",")),
                                                     tuple(a.media.split(",")), tree, a.rounds))
        if "graphs" in wanted and name == a.full:
            run("graphs", m, lambda: graph_steps(target, 1024, ints(a.graph_sizes), max(a.rounds, 10)))
        if "hf" in wanted and name == a.full:
            run("hf", m, lambda: hf_peers(target, name, reqs[:2], a.max_new_tokens, a.reduced, a.static))
        del target
        gc.collect()  # the model's memory back before the next one (or the actor processes) is built
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    for name in models:
        measure(name, sections & {"costs", "media", "oracle", "drafters", "graphs"})
    if "actors" in sections:  # the oracle at the chain that was fastest for this model, where measured
        chain = res["models"].get(a.full, {}).get("oracle", {}).get("best_chain", 8)
        run("actors", res, lambda: actors(a.full, a.reduced, a.device, a.dtype, ints(a.actors),
                                          a.actor_requests, a.actor_max_new_tokens, chain))
    if a.full in models:
        measure(a.full, sections & {"hf"})
    save()
    log.info("done; errors: %s", res["errors"] or "none")
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
