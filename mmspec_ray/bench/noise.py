"""How far to trust a `mmspec bench` figure: the noise floor (AR timed twice per prompt, interleaved with the
methods: `ar_again`), a bootstrap interval on each method's median speedup, the methods that drafted nothing, and
too few measurements. Pure functions over summary rows (bench/run.py `summarize`), so they are tested on made-up
numbers; nothing here times anything.

A method's speedup is *within noise* when its 95 % interval overlaps the interval of AR against itself (or, in a
result without `ar_again`, contains 1.0): the run cannot tell it from AR's own run-to-run difference.
"""

from __future__ import annotations

import random
import statistics

NOISE_METHOD = "ar_again"  # AR timed a second time per prompt: its speedup over "ar" is AR against itself
NODRAFT_SHARE = 0.95  # a method with at least this share of cycles that verified no draft token drafted nothing
MIN_MEASUREMENTS = 12  # timed runs per method (prompts x repeats) below which a median is a first reading at best
BOOTSTRAP_RESAMPLES = 2000


def median_interval(values: list[float], confidence: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
                    seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of the median of `values` (per-prompt speedups), resampling prompts with a fixed
    seed: how far the median over prompts could move with other prompts of the same kind, the same every run."""
    if not values:
        raise ValueError("median_interval of no values")
    if len(values) == 1:
        return values[0], values[0]
    rng = random.Random(seed)
    n = len(values)
    meds = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1.0 - confidence) / 2
    return meds[round(tail * (resamples - 1))], meds[round((1.0 - tail) * (resamples - 1))]


def noise_band(table: dict) -> tuple[float, float] | None:
    """The 95 % interval of AR's median speedup over itself in one summary table (None: no `ar_again` in it)."""
    row = table.get(NOISE_METHOD)
    return tuple(row["speedup_ci95"]) if row and "speedup_ci95" in row else None


def within_noise(interval: tuple[float, float], band: tuple[float, float] | None) -> bool:
    """Whether a speedup interval overlaps AR against itself (no band: whether it holds 1.0), i.e. the run cannot
    tell that method from AR."""
    lo, hi = band if band is not None else (1.0, 1.0)
    return interval[0] <= hi and interval[1] >= lo


def flags(name: str, row: dict, band: tuple[float, float] | None) -> list[str]:
    """The warnings a reader of one method's figure needs: it drafted nothing (so it measured AR), or its speedup
    is within noise. AR and `ar_again` (the references) get none."""
    if name in ("ar", NOISE_METHOD):
        return []
    out = []
    share = row.get("nodraft_share")
    if share is not None and share >= NODRAFT_SHARE:
        out.append(f"drafted nothing in {share:.0%} of cycles: this is AR's speed, not the drafter's")
    if "speedup_ci95" in row and within_noise(tuple(row["speedup_ci95"]), band):
        lo, hi = row["speedup_ci95"]
        out.append(f"within noise: its 95 % interval {lo:.2f}-{hi:.2f}x " + (
            f"overlaps AR against itself, which spans {band[0]:.2f}-{band[1]:.2f}x here" if band is not None
            else "holds 1.00x (this result has no AR-against-AR timing)"))
    return out


def annotate(table: dict) -> None:
    """Add `within_noise` and `flags` to every row of one summary table (one temperature), in place."""
    band = noise_band(table)
    for name, row in table.items():
        if "speedup_ci95" in row and name not in ("ar", NOISE_METHOD):
            row["within_noise"] = within_noise(tuple(row["speedup_ci95"]), band)
        row["flags"] = flags(name, row, band)


def short_flags(row: dict) -> str:
    """The table cell for a row's flags: a few words each ('' when none)."""
    words = [w for w in ("drafted nothing", "within noise") if any(f.startswith(w) for f in row.get("flags", []))]
    return "; ".join(f"**{w}**" if w == "drafted nothing" else w for w in words)


def noise_line(table: dict) -> str | None:
    """One sentence on the noise floor of a summary table, for bench.md (None: the result has no `ar_again`)."""
    row = table.get(NOISE_METHOD)
    if row is None:
        return None
    lo, hi = row["speedup_ci95"] if "speedup_ci95" in row else (row["speedup_min"], row["speedup_max"])
    return (f"Noise floor: AR timed twice per prompt, interleaved with the methods ({NOISE_METHOD}): AR against "
            f"itself {row['speedup_median']:.2f}x (median over {row['prompts']} prompts; 95 % interval {lo:.2f}-"
            f"{hi:.2f}x; per prompt {row['speedup_min']:.2f}-{row['speedup_max']:.2f}x). A speedup whose interval "
            "overlaps it is within noise: not a finding.")


def reading_lines(table: dict) -> list[str]:
    """Every flag of a summary table as a sentence beside its method's figure, for bench.md."""
    return [f"- **{m} {row['speedup_median']:.2f}x**: " + "; ".join(row["flags"]) for m, row in table.items()
            if row.get("flags")]


def few_measurements(prompts: int, repeats: int, where: str = "", minimum: int = MIN_MEASUREMENTS) -> str | None:
    """The warning for too few timed runs per method (prompts x repeats under `minimum`), else None: a median of a
    handful of timings can land far from the method's speed."""
    n = prompts * repeats
    if n >= minimum:
        return None
    counted = f"{prompts} prompt{'s' * (prompts != 1)} x {repeats} repeat{'s' * (repeats != 1)}"
    return (f"{where}only {n} timed runs per method and temperature ({counted}): with fewer than {minimum} a "
            "median speedup can land far from the method's speed; run more --prompts or --repeats (e.g. --prompts 12 "
            "--repeats 3)")


def learning_off_line(labels: list[str]) -> str:
    """What the bench does to drafters that learn from the answers they decode (the suffix drafter's `learn`), in
    words for bench.md: their figure is that of the corpus they were saved with."""
    return (f"Learning is off during the bench for {', '.join(labels)}: no answer decoded here joins the drafter's "
            "corpus, so it drafts only from its saved corpus (none for a bare `suffix`) and the request's own "
            "tokens, as a fresh decoder does before it has learnt from any answer (every prompt is decoded several "
            "times here: learning would draft a repeat from its own earlier answer). A job that keeps learning may "
            "draft its later rows better than measured here.")
