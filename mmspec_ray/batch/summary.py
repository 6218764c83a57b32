"""The end-of-job summary, computed from what the output really holds (so it is exact after crashes and resumes).

`run` covers the rows this invocation decoded, `all_rows` every row of the job's output; `complete` is true when
the output has each of the job's ids exactly once.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

SUMMARY_COLUMNS = ["error_kind", "num_output_tokens", "accepted_per_cycle", "decode_seconds", "verify_cycles",
                   "guard_plain_cycles", "payoff_guard"]
GUARD_WHY = {"fell_back": "drafting did not pay on the row", "held": "drafting lost on each of the kind's latest rows, "
             "so the row started plain and drafted only to measure it again", "warm_up": "a plain step's time was "
             "still being measured", "one_token_tree": "the calibrated tree is one token (drafting measured not to "
             "pay on this machine)"}


def row_stats(t: pa.Table | None) -> dict[str, Any]:
    """Rows, errors by kind, output tokens, mean accepted tokens per cycle and decode time of a set of rows."""
    if t is None or t.num_rows == 0:
        return {"rows": 0, "ok": 0, "errors": 0, "errors_by_kind": {}, "output_tokens": 0,
                "mean_accepted_per_cycle": None, "decode_seconds": 0.0}
    kinds = t.column("error_kind")
    by_kind = {d["values"]: d["counts"] for d in pc.value_counts(kinds.drop_null()).to_pylist()}
    ok = t.filter(pc.is_null(kinds))
    acc = pc.mean(ok.column("accepted_per_cycle")).as_py() if ok.num_rows else None
    return {
        "rows": t.num_rows,
        "ok": ok.num_rows,
        "errors": t.num_rows - ok.num_rows,
        "errors_by_kind": dict(sorted(by_kind.items())),
        "output_tokens": int(pc.sum(ok.column("num_output_tokens")).as_py() or 0),
        "mean_accepted_per_cycle": acc,  # mean over successful rows of each row's mean (bonus token excluded)
        "decode_seconds": float(pc.sum(ok.column("decode_seconds")).as_py() or 0.0),
        "payoff_guard": guard_stats(ok),
    }


def guard_stats(ok: pa.Table) -> dict[str, Any] | None:
    """What the payoff guard did on successful rows: rows by outcome (drafted throughout, fell back, held, warm-up),
    and the share of their cycles it decoded plainly; None where no row ran under the guard (rows written before
    the columns existed count as none)."""
    if "payoff_guard" not in ok.column_names:
        return None
    guarded = ok.filter(pc.is_valid(ok.column("payoff_guard")))
    if not guarded.num_rows:
        return None
    outcomes = {d["values"]: d["counts"] for d in pc.value_counts(guarded.column("payoff_guard")).to_pylist()}
    cycles = int(pc.sum(guarded.column("verify_cycles")).as_py() or 0)
    plain = int(pc.sum(guarded.column("guard_plain_cycles")).as_py() or 0)
    return {"rows": guarded.num_rows, "rows_by_outcome": dict(sorted(outcomes.items())),
            "plain_cycles": plain, "cycles": cycles, "plain_cycle_share": plain / cycles if cycles else None}


def summarize(output: pa.Table | None, job_ids: pa.Array, run_ids: pa.Array, wall_s: float,
              meta: dict[str, Any], progress: dict[str, Any] | None = None) -> dict[str, Any]:
    """Summary dict of a finished (or resumed) job. `output` holds `id` + SUMMARY_COLUMNS of every written row;
    `progress` is the tracker's last snapshot (adds startup time and steady-state throughput)."""
    total = output.num_rows if output is not None else 0
    if output is not None and len(job_ids):  # rows of other ids (beyond --limit, or gone from the input) apart
        output = output.filter(pc.is_in(output.column("id"), value_set=job_ids.cast(output.column("id").type)))
    written = output.num_rows if output is not None else 0
    out_ids = output.column("id") if output is not None else pa.array([], type=job_ids.type)
    unique = pc.count_distinct(out_ids).as_py() if written else 0
    missing = int(pc.sum(pc.invert(pc.is_in(job_ids, value_set=out_ids))).as_py() or 0) if len(job_ids) else 0
    run = output.filter(pc.is_in(output.column("id"), value_set=run_ids)) if output is not None else None
    run_stats = row_stats(run)
    run_stats.update(
        wall_seconds=wall_s,
        rows_per_s=run_stats["rows"] / wall_s if wall_s > 0 else None,
        output_tokens_per_s=run_stats["output_tokens"] / wall_s if wall_s > 0 else None,
    )
    if progress:
        run_stats.update(steady_state(progress))
    return {
        **meta,
        "rows": len(job_ids),
        "rows_written": written,
        "other_rows": total - written,
        "duplicates": written - unique,
        "missing": missing,
        "complete": missing == 0 and written == unique,
        "skipped_already_done": len(job_ids) - len(run_ids),
        "run": run_stats,
        "all_rows": row_stats(output),
    }


def steady_state(p: dict[str, Any]) -> dict[str, Any]:
    """Startup (run start -> first block decoded: actor start, model load, first media) and the throughput after
    it, from the progress tracker's timestamps (blocks after the first one only)."""
    first, last = p.get("first_report_s"), p.get("last_report_s")
    out: dict[str, Any] = {"startup_seconds": first}
    span = (last - first) if first is not None and last is not None else 0.0
    rows, tokens = p["rows"] - p.get("first_rows", 0), p["tokens"] - p.get("first_tokens", 0)
    out["steady_rows_per_s"] = rows / span if span > 0 else None
    out["steady_output_tokens_per_s"] = tokens / span if span > 0 else None
    out["speedup_vs_ar"] = measured_speedup(p.get("speedup_samples") or [])
    return out


def measured_speedup(samples: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The decoders' rows decoded both ways: AR time per token / speculative time per token over all of them,
    and how many greedy ones gave the same answer (None when no row was sampled)."""
    if not samples:
        return None
    spec = sum(s["spec_s"] for s in samples) / max(1, sum(s["spec_tokens"] for s in samples))
    ar = sum(s["ar_s"] for s in samples) / max(1, sum(s["ar_tokens"] for s in samples))
    greedy = [s["same"] for s in samples if s["same"] is not None]
    return {"rows": len(samples), "speedup": ar / spec if spec > 0 else None,
            "greedy_rows": len(greedy), "greedy_identical": sum(greedy)}


def format_summary(s: dict[str, Any]) -> str:
    r, o = s["run"], s["all_rows"]
    acc = o["mean_accepted_per_cycle"]
    kinds = ", ".join(f"{k}={v}" for k, v in o["errors_by_kind"].items()) or "none"
    other = (f"; {s['other_rows']} more rows of ids outside this job's input (beyond --limit, or no longer in "
             "the input)") if s.get("other_rows") else ""
    return (f"summary: {s['rows_written']}/{s['rows']} rows in output ({'complete' if s['complete'] else 'INCOMPLETE'}"
            f", {s['duplicates']} duplicates, {s['missing']} missing{other}); this run {r['rows']} rows "
            f"({s['skipped_already_done']} already done) in {r['wall_seconds']:.1f} s, "
            f"{r['output_tokens_per_s'] or 0.0:.1f} output tok/s; errors: {kinds}; "
            f"mean accepted/cycle {acc if acc is None else round(acc, 3)}" + _speedup_text(r.get("speedup_vs_ar"), s)
            + _deduped_text(s) + guard_text(r.get("payoff_guard")))


def guard_text(g: dict[str, Any] | None) -> str:
    """The payoff guard's part of the summary line: what it held plain, on how many rows, and why."""
    if not g:
        return ""
    by = g["rows_by_outcome"]
    why = "; ".join(f"{by[k]} row{'' if by[k] == 1 else 's'} partly plain, {GUARD_WHY[k]}" for k in ("fell_back", "held", "warm_up", "one_token_tree")
                    if by.get(k))
    share = g["plain_cycle_share"] or 0.0
    return (f"; payoff guard: {by.get('drafted', 0)}/{g['rows']} rows drafted throughout, {share:.0%} of cycles "
            f"decoded plainly" + (f" ({why})" if why else ""))


def _deduped_text(s: dict[str, Any]) -> str:
    n = s.get("duplicates_dropped")
    return (f"; {n} duplicate rows (two jobs wrote into this output) dropped from the job's own parts, one row per "
            "id kept") if n else ""


def _speedup_text(m: dict[str, Any] | None, s: dict[str, Any]) -> str:
    if not m or m["speedup"] is None:
        if s.get("speedup_sample") and s.get("drafter") != "none" and s["run"].get("ok"):
            return ("; no speedup over AR measured this run: its rows decoded while the draft tree was being "
                    "calibrated, which are not timed against AR (the calibration carries over to the next run)")
        return ""
    same = (f"; greedy answers identical to AR on {m['greedy_identical']}/{m['greedy_rows']}"
            if m["greedy_rows"] else "")
    return f"; measured speedup over AR decoding {m['speedup']:.2f}x on {m['rows']} rows decoded both ways{same}"
