"""The markdown of a `mmspec bench` result (bench.md): the method x workload table, one table per temperature with
each speedup's interval and flags, the noise floor and the warnings (bench/noise.py)."""

from __future__ import annotations

from mmspec_ray.bench import noise


def matrix_markdown(results: dict) -> list[str]:
    """Speedup over AR (median per prompt) per method (rows) and workload (columns), one table per temperature."""
    lines: list[str] = []
    by_w = results["workloads"]
    for temp in results["summary"]:
        names = list(by_w)
        lines += [f"Speedup over AR per token (median over prompts), T = {temp}", "",
                  "| method | " + " | ".join(names) + " | every workload |", "|---" * (len(names) + 2) + "|"]
        for m in results["summary"][temp]:
            cells = [_cell(by_w[w][temp][m]) if m in by_w[w].get(temp, {}) else "-" for w in names]
            lines.append(f"| {m} | " + " | ".join(cells) + f" | {_cell(results['summary'][temp][m])} |")
        lines += ["", "(each figure with its 95 % interval over prompts, and its flags: the tables below say more)", ""]
    return lines


def _cell(row: dict) -> str:
    """A speedup with its interval and flags, for the method x workload table."""
    ci = f" ({row['speedup_ci95'][0]:.2f}-{row['speedup_ci95'][1]:.2f})" if "speedup_ci95" in row else ""
    flags = noise.short_flags(row)
    return f"{row['speedup_median']:.2f}x{ci}" + (f" {flags}" if flags else "")


def summary_markdown(summary: dict) -> list[str]:
    """One table per temperature: every method's speedup, τ and cycle split."""
    lines: list[str] = []
    for temp, table in summary.items():
        lines += [f"T = {temp}", "",
                  "| method | prompts | speedup vs AR per token (median) | 95 % interval | read with care | min-max | "
                  "decode-only speedup | tokens/s | accepted/cycle | tokens/forward | draft ms/cycle | verify ms/cycle | "
                  "drafter prefill ms/request | drafter prefill tokens/request (of the prompt's) |",
                  "|---" * 14 + "|"]
        for m, r in table.items():
            acc = f"{r['accepted_per_cycle']:.2f}" if "accepted_per_cycle" in r else "-"
            tpf = f"{r['tokens_per_forward']:.2f}" if "tokens_per_forward" in r else "-"

            def ms(kind: str, r=r) -> str:
                return f"{r[kind + '_ms_per_cycle']:.1f}" if kind + "_ms_per_cycle" in r else "-"

            dec = f"{r['decode_speedup_median']:.2f}x" if "decode_speedup_median" in r else "-"
            ci = f"{r['speedup_ci95'][0]:.2f}-{r['speedup_ci95'][1]:.2f}" if "speedup_ci95" in r else "-"
            lines.append(f"| {m} | {r['prompts']} | {r['speedup_median']:.2f}x | {ci} | {noise.short_flags(r)} | "
                         f"{r['speedup_min']:.2f}-{r['speedup_max']:.2f} | "
                         f"{dec} | {r['tokens_per_s']:.1f} | {acc} | {tpf} | {ms('draft')} | {ms('verify')} | "
                         + (f"{r['drafter_prefill_ms']:.1f} |" if "drafter_prefill_ms" in r else "- |")
                         + (f" {r['drafter_prefill_tokens']:.0f} ({r['prompt_tokens']:.0f}) |"
                            if "drafter_prefill_tokens" in r else " - |"))
            if r.get("efficiency") is not None:
                lines.append(f"| (oracle: ideal {r['ideal_speedup']:.2f}x, efficiency {r['efficiency']:.0%} of it, decode-only) |"
                             " | | | | | | | | | | | | |")
        same = [f"{m} {r['identical']}/{r['runs']}" for m, r in table.items() if "identical" in r]
        if same:
            lines += ["", "runs whose answer is AR's, token for token: " + ", ".join(same)]
        per_pass = [f"{m} {r['accepted_per_pass']:.2f} ({r['passes_per_cycle']:.2f} passes/cycle)"
                    for m, r in table.items() if "accepted_per_pass" in r]
        if per_pass:
            lines += ["", "accepted draft tokens per drafter forward: " + ", ".join(per_pass)]
        plain = [f"{m} {r.get('nodraft_share', r['plain_share']):.0%}" for m, r in table.items()
                 if r.get("nodraft_share", r.get("plain_share")) and m not in ("ar", noise.NOISE_METHOD)]
        if plain:
            lines += ["", "cycles that drafted nothing (plain one-token steps: payoff guard, 1-token tree, near-ties; "
                      "or a proposal of no draft token): " + ", ".join(plain)]
        if (line := noise.noise_line(table)) is not None:
            lines += ["", line]
        if reading := noise.reading_lines(table):
            lines += ["", "Read with care:"] + reading
        lines.append("")
    return lines


def to_markdown(results: dict, title: str) -> str:
    """bench.md: warnings and notes first, then the tables (per workload and pooled), then what was not measured."""
    lines = [f"### {title}", ""]
    if "device" in results:  # older results have none
        lines += [f"Device: {results['device']}; {results['dtype']}; torch {results.get('torch', '?')}.", ""]
    notes = [f"- **Too few measurements**: {w}." for w in results.get("warnings", [])]
    if results.get("learning_off"):
        notes.append("- " + noise.learning_off_line(results["learning_off"]))
    lines += notes + [""] * bool(notes)
    if "workloads" in results:
        lines += matrix_markdown(results)
        for name, summary in results["workloads"].items():
            info = results["workload_info"][name]
            lines += [f"#### workload {name}: {info['prompts']} prompts ({info['source']}), max_new_tokens "
                      f"{info['max_new_tokens']}", ""] + summary_markdown(summary)
        lines += ["#### every workload pooled", ""]
    lines += summary_markdown(results["summary"])
    for name, info in results.get("workload_info", {}).items():
        for sk in info["skipped"]:
            lines.append(f"- workload {name}: row {sk['row']} not read: {sk['error']}")
    for e in results.get("errors", []):
        lines.append(f"- not measured: {e['method']} at T={e['temperature']} on prompt {e['prompt']}"
                     + (f" ({e['workload']})" if "workload" in e else "") + f": {e['error']}")
    return "\n".join(lines)
