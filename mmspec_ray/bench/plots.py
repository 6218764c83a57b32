"""Plots of a `mmspec bench` result (PNG beside bench.json): speedup over AR per method and workload, the accepted-length
histogram per method, and a verify cycle's time split into draft / verify / bookkeeping. Read from the result's
summary and raw runs only, so an old bench.json can be re-plotted (`python -m mmspec_ray.bench.plots DIR`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

PEERS = ("ar", "ar_again", "hf_generate", "hf_prompt_lookup", "hf_assisted")  # methods with no drafts of ours


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display on servers and CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def accepted_histogram(runs: list[dict], temperature: float, method: str) -> list[float]:
    """Share of verify cycles that accepted 0, 1, 2, ... draft tokens, over every run of `method` at `temperature`
    (runs recorded before the histogram was kept give an empty list)."""
    counts: list[int] = []
    for r in runs:
        if r["method"] != method or r["temperature"] != temperature:
            continue
        for n, c in enumerate(r.get("accepted_hist", [])):
            counts += [0] * (n + 1 - len(counts))
            counts[n] += c
    total = sum(counts)
    return [c / total for c in counts] if total else []


def _per_temperature(results: dict, path: Path, draw: Callable[[Any, str], bool], width: float = 6) -> Path | None:
    """One panel per temperature of the summary, each filled by draw(ax, temperature) -> whether it drew
    anything; saved to `path` when some panel did (else None)."""
    plt = _pyplot()
    temps = list(results["summary"])
    fig, axes = plt.subplots(1, len(temps), figsize=(width * len(temps), 4), squeeze=False)
    drew = [draw(ax, temp) for ax, temp in zip(axes[0], temps)]
    if any(drew):
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return path if any(drew) else None


def plot_speedup(results: dict, path: Path) -> Path | None:
    """Median per-prompt speedup over AR per method, one bar per workload (or one bar, min-max over prompts as error
    bars, for a single workload), one panel per T."""
    groups = results.get("workloads") or {"": results["summary"]}

    def draw(ax, temp: str) -> bool:
        names = list(results["summary"][temp])
        width = 0.8 / len(groups)
        for gi, (wname, summary) in enumerate(groups.items()):
            table = summary.get(temp, {})
            xs = [i + gi * width for i, m in enumerate(names) if m in table]
            med = [table[m]["speedup_median"] for m in names if m in table]
            err = None
            if len(groups) == 1:
                err = [[v - table[m]["speedup_min"] for m, v in zip(names, med)],
                       [table[m]["speedup_max"] - v for m, v in zip(names, med)]]
            ax.bar(xs, med, width=width, yerr=err, capsize=3, label=wname or None)
            for x, v in zip(xs, med):
                ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=6 if len(groups) > 1 else 8)
        ax.set_xticks([i + width * (len(groups) - 1) / 2 for i in range(len(names))], names)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_title(f"T = {temp}: speedup over AR per token (median" + (", min-max)" if len(groups) == 1 else ")"))
        ax.tick_params(axis="x", rotation=45)
        if len(groups) > 1:
            ax.legend(fontsize=8, title="workload")
        return bool(names)

    methods = max(len(t) for t in results["summary"].values())
    return _per_temperature(results, path, draw, width=max(6.0, 0.35 * methods * len(groups)))


def plot_accepted(results: dict, path: Path) -> Path | None:
    """Accepted draft tokens per cycle, as a share of cycles, per drafter and temperature (None: nothing recorded)."""

    def draw(ax, temp: str) -> bool:
        hists = {m: accepted_histogram(results["runs"], float(temp), m) for m in results["summary"][temp]
                 if m not in PEERS}
        drawn = {m: h for m, h in hists.items() if h}
        width = 0.8 / max(1, len(drawn))
        for i, (m, h) in enumerate(drawn.items()):
            ax.bar([n + i * width for n in range(len(h))], h, width=width, label=m)
        ax.set_xlabel("accepted draft tokens in a cycle")
        ax.set_ylabel("share of cycles")
        ax.set_title(f"T = {temp}: accepted length")
        if drawn:
            ax.legend(fontsize=8)
        return bool(drawn)

    return _per_temperature(results, path, draw)


def plot_cycle(results: dict, path: Path) -> Path | None:
    """Milliseconds per verify cycle split into draft, verify and bookkeeping, per method, one panel per T."""

    def draw(ax, temp: str) -> bool:
        rows = {m: r for m, r in results["summary"][temp].items() if "verify_ms_per_cycle" in r}
        names = list(rows)
        bottom = [0.0] * len(names)
        for key, colour in (("draft", "tab:orange"), ("verify", "tab:blue"), ("overhead", "tab:grey")):
            vals = [rows[m].get(f"{key}_ms_per_cycle", 0.0) for m in names]
            ax.bar(names, vals, bottom=bottom, color=colour, label="bookkeeping" if key == "overhead" else key)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_ylabel("ms per verify cycle")
        ax.set_title(f"T = {temp}: where a cycle's time goes")
        ax.tick_params(axis="x", rotation=45)
        ax.legend(fontsize=8)
        return bool(names)

    return _per_temperature(results, path, draw)


def write_plots(results: dict, out_dir: str | Path) -> list[Path]:
    """speedup.png, accepted.png and cycle.png in out_dir (the last two only when the result has the data)."""
    out = Path(out_dir)
    made = [plot_speedup(results, out / "speedup.png"), plot_accepted(results, out / "accepted.png"),
            plot_cycle(results, out / "cycle.png")]
    return [p for p in made if p is not None]


def main(argv: list[str] | None = None) -> int:
    """Re-plot a bench directory from its bench.json."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("bench_dir", type=Path)
    a = p.parse_args(argv)
    for path in write_plots(json.loads((a.bench_dir / "bench.json").read_text()), a.bench_dir):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
