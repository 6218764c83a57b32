"""Progress while a job runs: decoder actors report each block to a tiny tracker actor; the driver logs a line
every few seconds (rows done of total, errors, output tokens/s, mean accepted tokens per cycle, ETA).

Counts are best effort (a block redone after an actor crash is counted twice); the final summary is exact. The
tracker also counts, per row, decodes that started and never finished (the decoder process died), so that a row
that kills every decoder it reaches is filed as an error instead of being retried forever.
"""

from __future__ import annotations

import logging
import threading
import time

import ray

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class ProgressTracker:
    """Running totals of what the decoder actors finished."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.rows = self.errors = self.tokens = self.ok = 0
        self.accepted_sum = self.decode_s = 0.0
        self.t0 = time.time()
        self.first_s: float | None = None  # when the first block was reported (startup ends)
        self.last_s: float | None = None
        self.first_rows = self.first_tokens = 0
        self.unfinished: dict[str, int] = {}  # row id -> decodes of it that started and never finished
        self.samples: list[dict] = []  # rows decoded with AR too: {spec_s, spec_tokens, ar_s, ar_tokens, same}

    def start_row(self, row_id: str) -> int:
        """A decoder starts `row_id`: returns how many earlier decodes of it died unfinished."""
        died = self.unfinished.get(row_id, 0)
        self.unfinished[row_id] = died + 1
        return died

    def finish_row(self, row_id: str) -> None:
        self.unfinished.pop(row_id, None)

    def report(self, rows: int, errors: int, tokens: int, accepted_sum: float, decode_s: float,
               samples: list[dict] = ()) -> None:
        self.samples.extend(samples)
        self.rows += rows
        self.errors += errors
        self.ok += rows - errors
        self.tokens += tokens
        self.accepted_sum += accepted_sum
        self.decode_s += decode_s
        self.last_s = time.time() - self.t0
        if self.first_s is None:
            self.first_s, self.first_rows, self.first_tokens = self.last_s, rows, tokens

    def snapshot(self) -> dict:
        return {"total": self.total, "rows": self.rows, "errors": self.errors, "tokens": self.tokens,
                "mean_accepted": self.accepted_sum / self.ok if self.ok else 0.0,
                "decode_s": self.decode_s, "elapsed_s": time.time() - self.t0,
                "first_report_s": self.first_s, "last_report_s": self.last_s,
                "first_rows": self.first_rows, "first_tokens": self.first_tokens, "speedup_samples": self.samples}


def format_progress(s: dict) -> str:
    done, total, el = s["rows"], s["total"], s["elapsed_s"]
    pct = 100.0 * done / total if total else 100.0
    rate = done / el if el > 0 else 0.0
    eta = f"{(total - done) / rate:.0f} s" if rate > 0 and done < total else "-"
    return (f"progress: {done}/{total} rows ({pct:.0f}%), {s['errors']} errors, "
            f"{s['tokens'] / el if el > 0 else 0.0:.1f} output tok/s, "
            f"{s['mean_accepted']:.2f} accepted/cycle, {el:.0f} s elapsed, ETA {eta}")


class ProgressPrinter:
    """Background thread on the driver that logs the tracker's snapshot every `interval_s`."""

    def __init__(self, tracker, interval_s: float) -> None:
        self.tracker = tracker
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mmspec-progress", daemon=True)

    def __enter__(self) -> "ProgressPrinter":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                log.info(format_progress(ray.get(self.tracker.snapshot.remote(), timeout=10)))
            except Exception:  # never let progress reporting disturb the job
                log.debug("progress snapshot failed", exc_info=True)
