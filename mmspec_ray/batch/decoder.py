"""`SpecDecoder`: one target + one drafter, decoding rows one at a time.

Ray Data runs it as a callable class in an actor pool (`__call__` on a pyarrow block); a Ray Serve deployment, a
benchmark or a test calls `decode(row)` directly. Both go through the same `generate`, so batch and online share
every line of decoding code. A bad row never raises: it comes back with `error` set.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Generator, Mapping
from typing import Any

import pyarrow as pa
import torch

from mmspec_ray.batch.rows import (ERROR_COL, ERROR_KIND_COL, INTERNAL_COLUMNS, OUTPUT_SCHEMA, REQUEST_COL,
                                   RowError, error_output, prepare_row, readable_block,
                                   resolve_image_side)
from mmspec_ray.batch.jobspec import DecodeConfig
from mmspec_ray.config import SamplingParams
from mmspec_ray.drafters.base import load_drafter
from mmspec_ray.decoding.calibrate import auto_tree
from mmspec_ray.decoding.engine import AREngine, SpecEngine
from mmspec_ray.decoding.output import Generation
from mmspec_ray.targets import InvalidRequest, PromptTooLong, Request, TargetError, load_target
from mmspec_ray.targets.registry import resolve_device_name, resolve_dtype

log = logging.getLogger(__name__)

SAMPLE_STRIDE = 4  # the speedup sample takes every this many settled rows


def resolve_device(cfg: DecodeConfig) -> tuple[str, torch.dtype]:
    """(device, dtype) for this process: "auto" picks cuda when a GPU is visible (bf16 there, fp32 on CPU)."""
    device = resolve_device_name(cfg.device)
    return device, resolve_dtype(cfg.dtype, device)


class SpecDecoder:
    """Holds one target and one drafter; `decode(row)` -> output columns, `__call__(block)` -> block + outputs."""

    def __init__(self, config: DecodeConfig | Mapping[str, Any], progress: Any = None,
                 max_row_crashes: int | None = None) -> None:
        cfg = config if isinstance(config, DecodeConfig) else DecodeConfig.model_validate(config)
        if cfg.drafter == "auto":  # the batch jobs resolve it on the driver; Serve and direct use land here
            from mmspec_ray.toy.drafter import resolve_auto_drafter

            cfg = cfg.model_copy(update={"drafter": resolve_auto_drafter(cfg.drafter, cfg.target, cfg.drafter_dirs,
                                                                         cfg.s3)})
        self.config = cfg = resolve_image_side(cfg)
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        self.device, self.dtype = resolve_device(cfg)
        t0 = time.perf_counter()
        self.target = load_target(cfg.target, self.device, self.dtype, s3=cfg.s3)
        self.drafter = load_drafter(cfg.drafter, self.target, device=self.device)
        tree = (auto_tree(self.target, cfg.drafter, probe=getattr(self.drafter, "probe_tree", None))
                if cfg.tree == "auto" else cfg.tree)
        guard = cfg.tree == "auto" if cfg.payoff_guard is None else cfg.payoff_guard
        self.engine = SpecEngine(self.target, self.drafter, tree, tie_margin=cfg.tie_margin, guard=guard)
        self.progress = progress  # optional ProgressTracker actor handle
        self.ar_left = cfg.speedup_sample  # rows still to decode with AR too (the summary's measured speedup)
        self.samples: list[dict[str, Any]] = []  # those rows' timings, not yet reported
        self.settled_rows = 0  # rows decoded with the tree settled (calibrated) after the decoder's first
        self.rows_done = 0  # rows this decoder has decoded (or tried to)
        self.max_row_crashes = max_row_crashes  # with `progress`: file a row that killed this many decoders
        self.load_seconds = time.perf_counter() - t0
        log.info("decoder ready: target %s (%s, %s), drafter %s, %.1f s", cfg.target, self.device, self.dtype,
                 cfg.drafter, self.load_seconds)

    # ---------- one row ----------
    def decode(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """Decode one input row (media still encoded) into its output columns; never raises for a bad row."""
        try:
            request = prepare_row(row, self.config)
        except RowError as e:
            return error_output(str(e), e.kind)
        return self.generate(request, row.get("id"))

    def generate(self, request: Request, row_id: Any = None) -> dict[str, Any]:
        """Run the speculative engine on a prepared request; errors become the row's `error`."""
        died = self._start(row_id)
        if died:
            return error_output(f"decoder: the decoder process died {died} times while decoding this row (out of "
                                "memory or a crash in native code; see the actor logs); filed as an error so the "
                                "job can finish. Retry with --retry-errors crash", "crash")
        out = self._generate(request, row_id)
        if self.progress is not None and self.max_row_crashes:
            self.progress.finish_row.remote(str(row_id))
        return out

    def stream(self, request: Request, sampling: SamplingParams, max_new_tokens: int,
               stop: tuple[str, ...] = ()) -> Generator[list[int], None, Generation]:
        """Online decoding (the Serve deployment): the engine's streaming form with the caller's sampling and
        limits, yielding the tokens each step commits. Unlike `generate`, errors raise (PromptTooLong,
        TargetError ...): the caller maps them onto its protocol."""
        return self.engine.stream(request, sampling, max_new_tokens, stop)

    def _start(self, row_id: Any) -> int:
        """Record that this row starts; the number of earlier decoders it killed once that reaches the cap, else 0."""
        if self.progress is None or not self.max_row_crashes:
            return 0
        import ray

        died = ray.get(self.progress.start_row.remote(str(row_id)))
        return died if died >= self.max_row_crashes else 0

    def _generate(self, request: Request, row_id: Any) -> dict[str, Any]:
        cfg = self.config
        # a row that calibrates the tree, or the decoder's first (cold caches, lazy inits), is no fair speed sample
        settled = self.engine.calibrator is None and self.rows_done > 0
        self.rows_done += 1
        if settled:
            self.settled_rows += 1
        # every SAMPLE_STRIDE-th settled row: the sample spans the job's early rows, not only the first few, where
        # the payoff guard and a learning drafter (suffix) are still learning the job's requests
        sample = self.ar_left > 0 and settled and (self.settled_rows - 1) % SAMPLE_STRIDE == 0
        # every other sampled row runs its AR decode first: the second decode of a request finds warm caches
        taken = self.config.speedup_sample - self.ar_left  # rows sampled so far (`samples` empties at each report)
        ar_first = self._ar_decode(request, row_id) if sample and taken % 2 else None
        try:
            gen = self.engine.generate(request, cfg.sampling_for(row_id), cfg.max_new_tokens, cfg.stop)
        except PromptTooLong as e:
            return error_output(f"prompt: too long: {e}", "too_long")
        except InvalidRequest as e:  # the row's own content (e.g. a typed <image>), named by field
            return error_output(str(e), "invalid")
        except TargetError as e:
            return error_output(f"request: {e}", "target")
        except Exception as e:  # a bug or a device error on one row must not end the job
            log.exception("row %r failed", row_id)
            return error_output(f"internal: {type(e).__name__}: {e}", "internal")
        if sample:
            self._sample_ar(request, row_id, gen, ar_first)
        return {
            "output_text": gen.text,
            "output_token_ids": list(gen.token_ids),
            "finish_reason": gen.finish_reason,
            "num_output_tokens": len(gen.token_ids),
            "accepted_per_cycle": float(gen.stats.mean_accepted),
            "decode_seconds": float(gen.stats.total_s),
            "verify_cycles": gen.stats.cycles,
            "guard_plain_cycles": sum(gen.stats.guard_plain_cycles.values()) if gen.stats.guard else None,
            "payoff_guard": gen.stats.guard,
            "error": None,
            "error_kind": None,
        }

    def _ar_decode(self, request: Request, row_id: Any) -> Generation | None:
        """The row decoded with plain AR decoding (the same engine loop, no drafter); None if that failed (the
        sample is best effort; the row's answer is made apart)."""
        cfg = self.config
        try:
            return AREngine(self.target).generate(request, cfg.sampling_for(row_id), cfg.max_new_tokens, cfg.stop)
        except Exception:
            log.warning("speedup sample of row %r failed", row_id, exc_info=True)
            return None

    def _sample_ar(self, request: Request, row_id: Any, gen: Generation, ar: Generation | None = None) -> None:
        """Keep the row's speculative and AR timings (`ar`: its AR decode when it ran first, else decoded now); at
        temperature 0 the answers must be equal (float32; docs/design.md, Precision)."""
        cfg = self.config
        self.ar_left -= 1
        ar = ar or self._ar_decode(request, row_id)
        if ar is None:
            return
        same = ar.token_ids == gen.token_ids if cfg.temperature == 0.0 else None
        if same is False:
            log.warning("row %r: the AR answer differs from the speculative one (dtype %s)", row_id, self.dtype)
        self.samples.append({"spec_s": gen.stats.total_s, "spec_tokens": len(gen.token_ids),
                             "ar_s": ar.stats.total_s, "ar_tokens": len(ar.token_ids), "same": same})

    # ---------- one Ray Data block ----------
    def __call__(self, batch: pa.Table) -> pa.Table:
        """Decode every row of a block. Rows the media stage already prepared carry a pickled `Request`
        (or their media error); raw rows are prepared here."""
        prepared = REQUEST_COL in batch.column_names
        outputs: list[dict[str, Any]] = []
        if prepared:
            ids = batch.column("id").to_pylist() if "id" in batch.column_names else [None] * batch.num_rows
            blobs = batch.column(REQUEST_COL).to_pylist()
            errors = batch.column(ERROR_COL).to_pylist()
            kinds = batch.column(ERROR_KIND_COL).to_pylist()
            for row_id, blob, err, kind in zip(ids, blobs, errors, kinds):
                if err is not None:
                    outputs.append(error_output(err, kind))
                else:
                    outputs.append(self.generate(pickle.loads(blob), row_id))
        else:
            batch, unreadable = readable_block(batch)
            outputs = [error_output(str(bad), bad.kind) if bad is not None else self.decode(row)
                       for row, bad in zip(batch.to_pylist(), unreadable)]
        self._report(outputs)
        return attach_outputs(batch, outputs)

    def _report(self, outputs: list[dict[str, Any]]) -> None:
        if self.progress is None:
            return
        ok = [o for o in outputs if o["error"] is None]
        try:
            self.progress.report.remote(
                rows=len(outputs), errors=len(outputs) - len(ok),
                tokens=sum(o["num_output_tokens"] for o in ok),
                accepted_sum=sum(o["accepted_per_cycle"] for o in ok),
                decode_s=sum(o["decode_seconds"] for o in ok), samples=self.samples)
            self.samples = []
        except Exception:  # progress is best effort
            log.debug("progress report failed", exc_info=True)


def attach_outputs(batch: pa.Table, outputs: list[dict[str, Any]]) -> pa.Table:
    """The block without internal columns, plus the typed output columns."""
    keep = [c for c in batch.column_names if c not in INTERNAL_COLUMNS]
    table = batch.select(keep)
    for field in OUTPUT_SCHEMA:
        table = table.append_column(field, pa.array([o[field.name] for o in outputs], type=field.type))
    return table
