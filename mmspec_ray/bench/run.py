"""`mmspec bench`: AR vs our drafters vs the HF peers on one or more workloads (held-out toy prompts, or request
parquets for any checkpoint: bench/workloads.py), same target, same prompts, same max_new_tokens per workload, same
process, methods interleaved per prompt after a warm-up; medians over repeats.

Speedup = AR time per generated token / method time per generated token (per prompt, medians over repeats, then the
median over prompts): at T > 0 the methods' answers differ in length, so whole-answer wall times are not comparable
(at T = 0 both forms agree). Every method's timer covers the same work: encoding the request (processor, media),
prefill and decoding. τ is reported both ways: accepted draft tokens per cycle, and tokens committed per target
forward (accepted + 1). The oracle drafter (proposes the AR answer)
gives the engine-efficiency figure: decode-only speedup / ideal speedup, ideal = (accepted + 1) x AR decode step
time / target verify-forward time per cycle (what a free drafter and free bookkeeping would give). Prefill is
excluded from both sides of that ratio (decode time per token after the first), since the ideal has no prefill term.
How far each figure can be trusted (bench/noise.py): AR runs twice per prompt (`ar_again`, the noise floor), every
speedup has a bootstrap interval over prompts, and a method that drafted nothing or sits within noise is flagged.
"""

from __future__ import annotations

import json
import logging
import platform
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from pydantic import BaseModel

from mmspec_ray.bench import noise
from mmspec_ray.bench.plots import write_plots
from mmspec_ray.bench.report import to_markdown
from mmspec_ray.bench.workloads import Workload
from mmspec_ray.config import SamplingParams
from mmspec_ray.drafters.base import load_drafter, stop_learning
from mmspec_ray.drafters.ngram import NgramDrafter
from mmspec_ray.drafters.oracle import AntiOracleDrafter, OracleDrafter
from mmspec_ray.decoding.calibrate import auto_tree, device_name
from mmspec_ray.decoding.payoff import PayoffGuard
from mmspec_ray.decoding.engine import AREngine, SpecEngine
from mmspec_ray.decoding.tree import TreeConfig
from mmspec_ray.targets.base import Request, VLMTarget

log = logging.getLogger(__name__)


class BenchConfig(BaseModel):
    prompts: int = 12
    max_new_tokens: int = 128
    repeats: int = 3
    temperatures: tuple[float, ...] = (0.0, 1.0)
    tree: TreeConfig = TreeConfig()
    prompt_lookup_tokens: int = 10
    seed: int = 0
    peers: bool = True  # False: AR and the given drafters only (tree sweeps)
    payoff_guard: bool = True  # drafters with a calibrated tree (@auto) run under the payoff guard, as in production
    # also a drafter that is always wrong (drafters/oracle.py, AntiOracleDrafter) on `tree`, without the guard
    # ("anti_oracle") and with it ("anti_oracle_guarded"): the guard's fallback cost against AR
    anti_oracle: bool = False


def _hf_runner(target: VLMTarget, req: Request, max_new_tokens: int, sampling: SamplingParams,
               **extra) -> Callable[[], tuple[int, dict]]:
    """HF `generate` on the request, encoding included in the timed call (as our engines encode inside theirs)."""
    kw = dict(max_new_tokens=max_new_tokens, do_sample=not sampling.greedy, **extra)
    if not sampling.greedy:
        kw.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)  # 0: no top-k,
        # as ours (None would make HF take the config's top-k, 50 by default)

    def run() -> tuple[int, dict]:
        inputs = target.encode(req)
        torch.manual_seed(sampling.seed or 0)
        with torch.inference_mode():
            out = target.model.generate(**inputs, **kw)
        n = inputs["input_ids"].shape[1]
        return out.shape[1] - n, {"token_ids": out[0, n:].tolist()}  # the copy to the host also waits for a GPU

    return run


def accepted_counts(accepted_per_cycle: list[int]) -> list[int]:
    """counts[n]: cycles that accepted n draft tokens (the accepted-length histogram of one run)."""
    counts = [0] * (max(accepted_per_cycle, default=-1) + 1)
    for n in accepted_per_cycle:
        counts[n] += 1
    return counts


class ProposalCounter:
    """A drafter as the engine sees it, counting the proposals that hold the root alone: cycles that verified no
    draft token although the engine asked for a tree (the engine's `plain_cycles` counts only those it did not ask)."""

    def __init__(self, drafter: object) -> None:
        self.__dict__.update(drafter=drafter, empty=0)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["drafter"], name)

    def __setattr__(self, name: str, value) -> None:
        if name in self.__dict__:
            self.__dict__[name] = value
        else:
            setattr(self.drafter, name, value)

    def propose(self, root: int, cfg: TreeConfig):
        tree = self.drafter.propose(root, cfg)
        self.empty += len(tree.tokens) <= 1
        return tree


def _engine_runner(engine: SpecEngine, req: Request, max_new_tokens: int,
                   sampling: SamplingParams) -> Callable[[], tuple[int, dict]]:
    if not isinstance(engine.drafter, ProposalCounter):
        engine.drafter = ProposalCounter(engine.drafter)
    counter = engine.drafter

    def run() -> tuple[int, dict]:
        counter.empty = 0
        g = engine.generate(req, sampling, max_new_tokens=max_new_tokens)
        st = g.stats
        return len(g.token_ids), {"accepted": sum(st.accepted_per_cycle), "cycles": st.cycles, "prefill_s": st.prefill_s,
                                  "draft_s": st.draft_s, "verify_s": st.verify_s, "overhead_s": st.overhead_s,
                                  "draft_passes": st.draft_passes, "plain_cycles": st.plain_cycles,
                                  "empty_proposals": counter.empty,
                                  "drafter_prefill_s": st.drafter_prefill_s,
                                  "drafter_prefill_tokens": st.drafter_prefill_tokens, "prompt_tokens": st.prompt_tokens,
                                  "accepted_hist": accepted_counts(st.accepted_per_cycle),
                                  "token_ids": list(g.token_ids)}

    return run


def same_answer(a: list[int], b: list[int], eos: set[int]) -> bool:
    """Two answers are the same token for token, a trailing end-of-sequence token aside (HF generate returns it)."""
    def strip(ids: list[int]) -> list[int]:
        ids = list(ids)
        while ids and ids[-1] in eos:
            ids.pop()
        return ids

    return strip(a) == strip(b)


def split_tree(spec: str) -> tuple[str, TreeConfig | str | None]:
    """`DRAFTER@TREE` -> (DRAFTER, tree): TREE is `auto` (calibrated, under the payoff guard), `auto-noguard` (the
    calibrated tree alone) or `kKdDnN` (top_k K, depth D, N tokens); no `@`: (spec, None), the bench's tree."""
    path, _, tree = spec.rpartition("@") if "@" in spec else (spec, "", "")
    if not tree or tree in ("auto", "auto-noguard"):
        return path, tree or None
    m = re.fullmatch(r"k(\d+)d(\d+)n(\d+)", tree)
    if not m:
        raise ValueError(f"drafter {spec!r}: the tree after @ is auto, auto-noguard or kKdDnN (e.g. k4d5n16)")
    return path, TreeConfig(top_k=int(m[1]), depth=int(m[2]), total_tokens=int(m[3]))


def calibrate_tree(target: VLMTarget, drafter, spec: str, requests: list[Request],
                   max_new_tokens: int) -> tuple[TreeConfig, dict]:
    """The calibrated tree for a bench method: from the cache, or by decoding the bench's prompts (greedy, untimed)
    until the engine's calibrator has picked; with what it measured."""
    t0 = time.perf_counter()
    engine = SpecEngine(target, drafter, auto_tree(target, spec, probe=getattr(drafter, "probe_tree", None)))
    calibrator = engine.calibrator
    for req in requests * 8:
        if engine.calibrator is None:
            break
        engine.generate(req, SamplingParams(temperature=0.0), max_new_tokens=max_new_tokens)
    if engine.calibrator is not None:  # too few whole probe cycles in these prompts: pick from what there is
        # (none at all when every answer is too short for a whole probe tree: the calibrator's fallback tree)
        engine.tree = engine.calibrator.pick() if engine.calibrator.records else engine.calibrator.fallback
    info = {"seconds": time.perf_counter() - t0, "cached": calibrator is None}
    if calibrator is not None and calibrator.result is not None:
        info.update(calibrator.result.model_dump(mode="json", exclude={"key"}))
    return engine.tree, info


def run_bench(target: VLMTarget, requests: list[Request] | list[Workload], drafters: dict[str, str] | str | None,
              cfg: BenchConfig, assistant=None) -> dict:
    """Measure every method on every request; returns the raw records and per-method summaries. `drafters`:
    {label: checkpoint dir} (a bare path is labelled eagle2, as before), all run interleaved per prompt.
    `requests`: one list (the workload "all"), or workloads, measured in one run: their prompts are numbered in one
    sequence, each run records its workload, and `results["workloads"]` has each one's summary beside the pooled
    `results["summary"]`."""
    if isinstance(drafters, str):
        drafters = {"eagle2": drafters}
    workloads = (list(requests) if requests and isinstance(requests[0], Workload)
                 else [Workload("all", list(requests))])
    items = [(w.name, req, w.max_new_tokens or cfg.max_new_tokens) for w in workloads for req in w.requests]
    requests = [req for _, req, _ in items]
    results: dict = {"config": cfg.model_dump(), "machine": platform.processor() or platform.machine(),
                     "device": device_name(target.device), "torch": torch.__version__,
                     "torch_threads": torch.get_num_threads(), "dtype": str(target.dtype).removeprefix("torch."),
                     "runs": [], "trees": {},
                     "workload_info": {w.name: {"source": w.source, "prompts": len(w.requests),
                                                "max_new_tokens": w.max_new_tokens or cfg.max_new_tokens,
                                                "skipped": w.skipped} for w in workloads}}
    counts = [(len(items), "")] + [(len(w.requests), f"workload {w.name}: ") for w in workloads if len(workloads) > 1]
    for n, where in counts:  # said before the run starts, and again in bench.md
        if (warning := noise.few_measurements(n, cfg.repeats, where)) is not None:
            log.warning("bench: %s", warning)
            results.setdefault("warnings", []).append(warning)
    loaded, trees, guards = {}, {}, {}
    for label, spec in (drafters or {}).items():
        path, tree = split_tree(spec)
        loaded[label] = load_drafter(path, target)
        if stop_learning(loaded[label]):  # a drafter that learns from the answers it decodes (suffix) would draft a
            # repeated prompt from its own earlier answer: the bench measures its corpus as built
            results.setdefault("learning_off", []).append(label)
        if tree == "auto" and cfg.payoff_guard:  # one per method, kept across its requests (what it learns carries)
            guards[label] = PayoffGuard()
        if tree in ("auto", "auto-noguard"):
            tree, results.setdefault("calibration", {})[label] = calibrate_tree(target, loaded[label], path,
                                                                                requests, cfg.max_new_tokens)
        trees[label] = tree or cfg.tree
        results["trees"][label] = trees[label].model_dump()
    if assistant is not None:  # the HF assisted-generation peer's small model runs in the target's dtype
        assistant = assistant.to(device=target.device, dtype=target.dtype)
    ar = AREngine(target)
    anti_guard = PayoffGuard()  # kept across prompts, as a decoder's is
    for temp in cfg.temperatures:
        sampling = SamplingParams(temperature=temp, top_k=0, top_p=1.0, seed=cfg.seed)
        for pi, (workload, req, max_new) in enumerate(items):
            # warm-up + the greedy answer (the oracle's, and what every T = 0 run must give), greedy even where the
            # checkpoint's generation config samples
            ref = ar.generate(req, SamplingParams(temperature=0.0, top_k=0, top_p=1.0), max_new_tokens=max_new)
            methods: dict[str, Callable[[], tuple[int, dict]]] = {
                "ar": _engine_runner(ar, req, max_new, sampling)}
            if cfg.peers:
                methods["hf_generate"] = _hf_runner(target, req, max_new, sampling)
                methods["hf_prompt_lookup"] = _hf_runner(target, req, max_new, sampling,
                                                         prompt_lookup_num_tokens=cfg.prompt_lookup_tokens)
                methods["ngram"] = _engine_runner(SpecEngine(target, NgramDrafter(), cfg.tree), req, max_new, sampling)
            if assistant is not None and cfg.peers:
                methods["hf_assisted"] = _hf_runner(target, req, max_new, sampling, assistant_model=assistant)
            for label, drafter in loaded.items():
                methods[label] = _engine_runner(SpecEngine(target, drafter, trees[label], guard=guards.get(label, False)),
                                                req, max_new, sampling)
            if cfg.anti_oracle:
                vocab = target.vocab_size
                methods["anti_oracle"] = _engine_runner(
                    SpecEngine(target, AntiOracleDrafter(ref.token_ids, vocab), cfg.tree), req, max_new, sampling)
                methods["anti_oracle_guarded"] = _engine_runner(
                    SpecEngine(target, AntiOracleDrafter(ref.token_ids, vocab), cfg.tree, guard=anti_guard), req,
                    max_new, sampling)
            if temp == 0.0 and cfg.peers:
                methods["oracle"] = _engine_runner(SpecEngine(target, OracleDrafter(ref.token_ids), cfg.tree), req,
                                                   max_new, sampling)
            # AR once more, last in each repeat's order: AR against itself, as far apart as any method is from AR
            methods[noise.NOISE_METHOD] = _engine_runner(ar, req, max_new, sampling)
            for name, fn in list(methods.items()):  # warm-up of each path on this prompt
                try:
                    fn()
                except Exception as e:  # a peer that cannot run this prompt is reported, not fatal
                    log.warning("bench: %s failed on prompt %d: %s", name, pi, e)
                    results.setdefault("errors", []).append({"temperature": temp, "prompt": pi, "workload": workload,
                                                             "method": name,
                                                             "error": f"{type(e).__name__}: {e}"[:300]})
                    del methods[name]
            for rep in range(cfg.repeats):
                for name, fn in methods.items():  # interleaved
                    t0 = time.perf_counter()
                    ntok, extra = fn()
                    seconds = time.perf_counter() - t0
                    ids = extra.pop("token_ids")
                    if temp == 0.0:  # greedy: every method must give AR's answer (the bench's losslessness check)
                        extra["identical"] = same_answer(ids, ref.token_ids, target.eos_token_ids)
                        if not extra["identical"]:
                            log.warning("bench: %s's answer to prompt %d differs from AR's (T = 0, %s)", name, pi,
                                        target.dtype)
                    results["runs"].append({"temperature": temp, "prompt": pi, "workload": workload, "repeat": rep,
                                            "method": name, "seconds": seconds, "tokens": ntok, **extra})
            log.info("bench T=%s prompt %d/%d (%s) done", temp, pi + 1, len(items), workload)
    results["summary"] = summarize(results["runs"])
    if len(workloads) > 1:
        results["workloads"] = {w.name: summarize([r for r in results["runs"] if r["workload"] == w.name])
                                for w in workloads}
    return results


def summarize(runs: list[dict]) -> dict:
    """Per temperature and method: median per-prompt speedup over AR (time per generated token), spread, τ both
    ways, tokens/s."""
    out: dict = {}
    for temp in sorted({r["temperature"] for r in runs}):
        rs = [r for r in runs if r["temperature"] == temp]
        prompts = sorted({r["prompt"] for r in rs})

        def med(method: str, p: int, key: str = "seconds") -> float:
            return statistics.median(r[key] for r in rs if r["method"] == method and r["prompt"] == p)

        def per_token(method: str, p: int) -> float:
            return statistics.median(r["seconds"] / max(1, r["tokens"])
                                     for r in rs if r["method"] == method and r["prompt"] == p)

        def decode_per_token(method: str, p: int) -> float:  # prefill (and the token it picks) left out
            return statistics.median((r["seconds"] - r["prefill_s"]) / max(1, r["tokens"] - 1)
                                     for r in rs if r["method"] == method and r["prompt"] == p)

        table = {}
        for m in dict.fromkeys(r["method"] for r in rs):
            mine = [p for p in prompts if any(r["method"] == m and r["prompt"] == p for r in rs)]
            sp = [per_token("ar", p) / per_token(m, p) for p in mine]
            mr = [r for r in rs if r["method"] == m]
            row = {"prompts": len(mine), "measurements": sum(r["method"] == m for r in rs),
                   "speedup_median": statistics.median(sp), "speedup_ci95": list(noise.median_interval(sp)),
                   "speedup_min": min(sp), "speedup_max": max(sp),
                   "tokens_per_s": sum(r["tokens"] for r in mr) / sum(r["seconds"] for r in mr)}
            if "identical" in mr[0]:  # T = 0: runs whose answer is AR's, token for token
                row.update(identical=sum(r["identical"] for r in mr), runs=len(mr))
            if "cycles" in mr[0]:
                acc = sum(r["accepted"] for r in mr) / max(1, sum(r["cycles"] for r in mr))
                row.update(accepted_per_cycle=acc, tokens_per_forward=acc + 1)
                passes = sum(r.get("draft_passes", 0) for r in mr)
                if passes:  # τ per drafter forward (drafters that count their passes)
                    row["accepted_per_pass"] = sum(r["accepted"] for r in mr) / passes
                    row["passes_per_cycle"] = passes / max(1, sum(r["cycles"] for r in mr))
                ncyc = max(1, sum(r["cycles"] for r in mr))  # draft time includes the drafter's begin (its prefill)
                row["plain_share"] = sum(r.get("plain_cycles", 0) for r in mr) / ncyc
                # cycles that verified no draft token: plain steps and proposals of the root alone
                row["nodraft_share"] = row["plain_share"] + sum(r.get("empty_proposals", 0) for r in mr) / ncyc
                row.update(draft_ms_per_cycle=1e3 * sum(r["draft_s"] for r in mr) / ncyc,
                           verify_ms_per_cycle=1e3 * sum(r["verify_s"] for r in mr) / ncyc,
                           overhead_ms_per_cycle=1e3 * sum(r.get("overhead_s", 0.0) for r in mr) / ncyc,
                           drafter_prefill_ms=1e3 * statistics.mean(r.get("drafter_prefill_s", 0.0) for r in mr),
                           drafter_prefill_tokens=statistics.mean(r.get("drafter_prefill_tokens", 0) for r in mr),
                           prompt_tokens=statistics.mean(r.get("prompt_tokens", 0) for r in mr))
                dec = [decode_per_token("ar", p) / decode_per_token(m, p) for p in mine]
                row["decode_speedup_median"] = statistics.median(dec)
                if m == "oracle":
                    ar_dec_step = {p: (med("ar", p) - med("ar", p, "prefill_s")) / max(1, med("ar", p, "cycles"))
                                   for p in mine}
                    row["ideal_speedup"] = statistics.median(
                        (acc + 1) * ar_dec_step[p] / (med(m, p, "verify_s") / max(1, med(m, p, "cycles")))
                        for p in mine)
                    row["efficiency"] = row["decode_speedup_median"] / row["ideal_speedup"]
            table[m] = row
        noise.annotate(table)
        out[str(temp)] = table
    return out


def write_results(results: dict, out_dir: str | Path, title: str) -> Path:
    """bench.json, bench.md (bench/report.py) and the plots in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(results, indent=1))
    md = to_markdown(results, title)
    plots = write_plots(results, out)
    if plots:
        md += "\nPlots: " + ", ".join(f"[{p.name}]({p.name})" for p in plots) + "\n"
    (out / "bench.md").write_text(md)
    return out
