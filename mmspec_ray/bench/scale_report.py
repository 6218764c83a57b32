"""Tables of a `bench.gpu_scale` run, and the projected speedup of each drafter at that scale.

The projection combines what the real-scale run measured (the AR step, the verify cost of n tokens, one drafter
step, the engine's bookkeeping per cycle) with the tokens per forward each drafter reaches on toy-m (a benchmark's
bench.json): speedup = tau x t_AR / (passes x t_pass + t_observe + t_verify(n) + t_book). It is a projection, not a
measurement: a trained drafter's tau on a real 7B target is not known here.
`python -m mmspec_ray.bench.scale_report RESULTS.json [MORE.json] --toy docs/bench/toy-m-matrix-2/bench.json`
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def merge(paths: list[str | Path]) -> dict[str, Any]:
    """One result from several runs' results.json (later runs add sections, never replace one already there)."""
    out: dict[str, Any] = {"models": {}, "errors": {}, "commands": []}
    for p in paths:
        r = json.loads(Path(p).read_text())
        out["commands"].append(r.get("command", ""))
        for k in ("env", "actors", "dtype"):
            if k in r and k not in out:
                out[k] = r[k]
        out["errors"].update(r.get("errors", {}))
        for name, m in r.get("models", {}).items():
            have = out["models"].setdefault(name, {})
            for k, v in m.items():
                have.setdefault(k, v)
    return out


def verify_at(curve: dict[str, float], n: int) -> float:
    """The measured verify ms for n tokens: the smallest measured size >= n (a bigger forward never costs less)."""
    sizes = sorted(int(s) for s in curve)
    return curve[str(next((s for s in sizes if s >= n), sizes[-1]))]


def project(tau: float, step_ms: float, verify_ms: float, draft_ms: float, book_ms: float) -> float:
    """Speedup over AR of a drafter reaching `tau` tokens per forward, each cycle costing draft + verify +
    bookkeeping, against one AR step per token."""
    return tau * step_ms / (draft_ms + verify_ms + book_ms)


def pass_costs(drafters: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """{method: (ms per drafter forward, observe ms)}, the lowest over the media requests measured (the least
    disturbed by the machine); EAGLE-2 and MSD heads share one architecture, so each takes the lower of the two."""
    out: dict[str, tuple[float, float]] = {}
    for m, row in drafters.items():
        if m == "tree" or not isinstance(row, dict):
            continue
        per = [(r["propose_ms"] / max(1.0, r["passes"]), r["observe_ms"]) for k, r in row.items()
               if isinstance(r, dict)]
        if per:
            out[m] = (min(p for p, _ in per), min(o for _, o in per))
    if "eagle2" in out and "msd" in out:
        best = min(out["eagle2"], out["msd"])
        out["eagle2"] = out["msd"] = best
    return out


def projections(model: dict[str, Any], toy: dict[str, Any], context: str = "1024") -> list[dict[str, Any]]:
    """One row per drafter with a toy-m tau and a measured step cost on this model."""
    step = model["oracle"]["ar"]["step_ms"]
    curve = model["costs"]["contexts"][context]["verify_ms_sdpa"]
    scale = step / curve["1"]  # the verify curve's shape at this context, at the engine loop's AR step
    book = min(r["bookkeeping_ms_per_cycle"] for r in model["oracle"]["chains"].values())
    costs = pass_costs(model.get("drafters", {}))
    summary, trees = toy["summary"]["0.0"], toy.get("trees", {})
    rows = []
    for m, (per_pass, observe) in costs.items():
        if m not in summary or "tokens_per_forward" not in summary[m]:
            continue
        s = summary[m]
        n = int(trees.get(m, {}).get("total_tokens", 48))
        passes = float(s.get("passes_per_cycle", 1.0))
        draft = passes * per_pass + observe
        verify = verify_at(curve, n) * scale
        rows.append({"method": m, "toy_tau": round(s["tokens_per_forward"], 3), "tree_tokens": n,
                     "passes": passes, "draft_ms": round(draft, 2), "verify_ms": round(verify, 2),
                     "projected_speedup": round(project(s["tokens_per_forward"], step, verify, draft, book), 2),
                     "toy_measured_speedup": round(s.get("decode_speedup_median", s["speedup_median"]), 2)})
    return rows


def _mb(mb: float | None) -> str:
    return "-" if mb is None else f"{mb:.0f}"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def render(res: dict[str, Any], toy: dict[str, Any] | None = None) -> str:
    """Markdown tables of every section present."""
    parts: list[str] = []
    env = res.get("env", {})
    if env:
        parts.append(f"{env.get('gpu', env.get('cpu', '?'))}, driver {env.get('driver', '-')}, CUDA "
                     f"{env.get('cuda', '-')}, torch {env.get('torch')}, transformers {env.get('transformers')}, "
                     f"{res.get('dtype')}; device copy {env.get('copy_gb_per_s', '-')} GB/s (read + write)")
    for name, m in res["models"].items():
        parts.append(f"### {name}")
        c = m.get("costs")
        if c:
            sizes = list(next(iter(c["contexts"].values()))["verify_ms_sdpa"])
            rows = []
            for ctx, row in c["contexts"].items():
                for impl in ("sdpa", "eager"):
                    if f"verify_ms_{impl}" in row:
                        rows.append([ctx, impl, row["prefill_ms"], row["kv_mb"], _mb(row["prefill_peak_mb"])]
                                    + [row[f"verify_ms_{impl}"][s] for s in sizes])
            parts.append(_table(["context", "attention", "prefill ms", "KV MB", "peak MB"]
                                + [f"verify {s}" for s in sizes], rows))
            bw = env.get("copy_gb_per_s")
            if bw:
                parts.append(f"Step floor: {c['text_weight_gb']} GB of text weights / {bw} GB/s = "
                             f"{1e3 * c['text_weight_gb'] / bw:.2f} ms")
        if m.get("media"):
            parts.append(_table(["request", "tokens", "media tokens", "encode ms", "prefill ms", "KV MB", "peak MB"],
                                [[k, v.get("tokens", "-"), v.get("media_tokens", "-"), v.get("encode_ms", "-"),
                                  v.get("prefill_ms", "-"), v.get("kv_mb", "-"), _mb(v.get("peak_mb"))]
                                 if "skipped" not in v else [k, v["skipped"], "", "", "", "", ""]
                                 for k, v in m["media"].items()]))
        o = m.get("oracle")
        if o:
            parts.append(f"AR: step {o['ar']['step_ms']} ms, {o['ar']['decode_ms_per_token']} ms per token, "
                         f"prefill {o['ar']['prefill_ms']} ms ({o['requests']} image requests, {o['prompt_tokens']} "
                         f"prompt tokens, {o['max_new_tokens']} new)")
            parts.append(_table(["chain", "tokens/forward", "speedup", "ideal", "efficiency", "verify ms",
                                 "bookkeeping ms/cycle", "share", "identical"],
                                [[n, r["tokens_per_forward"], r["speedup"], r["ideal_speedup"], r["efficiency"],
                                  r["verify_ms"], r["bookkeeping_ms_per_cycle"], r["bookkeeping_share"],
                                  f"{r['identical']}/{o['requests']}"] for n, r in o["chains"].items()]))
            if "profile_ms_per_cycle" in o:
                parts.append("Per cycle (cProfile, ms): " + ", ".join(
                    f"{k} {v}" for k, v in o["profile_ms_per_cycle"].items()))
            if "agreement" in o:
                a = o["agreement"]
                parts.append(_table(["mode", "margin", "identical", "tie cycles", "first divergence"],
                                    [[k, a[k]["margin"], f"{a[k]['identical']}/{a['requests']}", a[k]["tie_cycles"],
                                      a[k]["first_divergence"]] for k in ("tie_guard", "no_guard")]))
        d = m.get("drafters")
        if d:
            rows = []
            for meth, row in d.items():
                if meth == "tree":
                    continue
                for kind, r in row.items():
                    if isinstance(r, dict):
                        rows.append([meth, f"{row['params'] / 1e6:.0f} M", kind, r["begin_ms"], r["prefill_tokens"],
                                     r["propose_ms"], r["passes"], r["observe_ms"]])
            parts.append(_table(["drafter", "params", "request", "begin ms", "begin tokens", "propose ms",
                                 "forwards", "observe ms"], rows))
        g = m.get("graphs")
        if g:
            parts.append(_table(["chain tokens", "eager ms", "CUDA graph ms", "graph vs eager max logit diff",
                                 "engine vs static max logit diff"],
                                [[n, r["eager_ms"], r.get("graph_ms", "-"), r.get("max_logit_diff", "-"),
                                  r["vs_engine_max_logit_diff"]] for n, r in g.items() if isinstance(r, dict)]))
        h = m.get("hf")
        if h:
            st = h.get("static", {})
            parts.append(f"HF generate {h['generate_ms_per_token']} ms/token; HF assisted (random small assistant) "
                         f"{h.get('assisted_ms_per_token', h.get('assisted_error'))} ms/token; static cache "
                         f"(compiled by HF) {st.get('static_ms_per_token', st.get('error'))} ms/token against "
                         f"{st.get('dynamic_ms_per_token')} dynamic (first call {st.get('first_call_s')} s, same "
                         f"output: {st.get('same_output')})")
        if toy and m.get("oracle") and m.get("drafters") and m.get("costs"):
            parts.append(_table(["drafter", "toy-m tau", "tree", "forwards", "draft ms", "verify ms",
                                 "projected speedup", "toy-m measured"],
                                [[r["method"], r["toy_tau"], r["tree_tokens"], r["passes"], r["draft_ms"],
                                  r["verify_ms"], r["projected_speedup"], r["toy_measured_speedup"]]
                                 for r in projections(m, toy)]))
    a = res.get("actors")
    if a:
        parts.append(_table(["decoders on one device", "AR rows/s", "oracle rows/s", "identical"],
                            [[k, r.get("ar_rows_per_s", r.get("error")), r.get("oracle_rows_per_s", ""),
                              f"{r.get('identical', '-')}/{r.get('rows', '-')}"] for k, r in a.items()
                             if isinstance(r, dict)]))
    if res.get("errors"):
        parts.append("Errors: " + json.dumps(res["errors"]))
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+")
    p.add_argument("--toy", default=None, help="a toy-m bench.json: its tokens per forward feed the projection")
    a = p.parse_args(argv)
    toy = json.loads(Path(a.toy).read_text()) if a.toy else None
    print(render(merge(a.results), toy), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
