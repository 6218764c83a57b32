"""Serve metrics through Ray's metrics API (exported on Ray's Prometheus endpoint with a `ray_` prefix):
requests by outcome, latency, time to first token, output tokens/s, accepted tokens per cycle, queue depth, and what
the payoff guard did (requests by its outcome, cycles it decoded plainly and why)."""

from __future__ import annotations

from ray.util import metrics

_LATENCY_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
_TOKENS_PER_S = [1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500]
_ACCEPTED = [0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8]


class ServeMetrics:
    """One set per replica; tag `model` on everything, `status` (HTTP code or "cancelled") on requests."""

    def __init__(self, model: str) -> None:
        tags = ("model",)
        self.model = model
        self.requests = metrics.Counter("mmspec_serve_requests", "chat completion requests by outcome",
                                        tag_keys=("model", "status", "stream"))
        self.output_tokens = metrics.Counter("mmspec_serve_output_tokens", "completion tokens sent", tag_keys=tags)
        self.latency = metrics.Histogram("mmspec_serve_latency_s", "request latency (body read to last byte)",
                                         boundaries=_LATENCY_S, tag_keys=tags)
        self.ttft = metrics.Histogram("mmspec_serve_time_to_first_token_s", "request start to first token",
                                      boundaries=_LATENCY_S, tag_keys=tags)
        self.tokens_per_s = metrics.Histogram("mmspec_serve_tokens_per_s", "output tokens/s of each request",
                                              boundaries=_TOKENS_PER_S, tag_keys=tags)
        self.accepted = metrics.Histogram("mmspec_serve_accepted_per_cycle", "mean accepted draft tokens per "
                                          "verify cycle of each request", boundaries=_ACCEPTED, tag_keys=tags)
        self.queue_depth = metrics.Gauge("mmspec_serve_queue_depth", "requests in this replica waiting for the "
                                         "decoder (Serve's proxy queue: ray_serve_deployment_queued_queries)",
                                         tag_keys=tags)
        self.guard = metrics.Counter("mmspec_serve_guard_requests", "requests by what the payoff guard did: drafted "
                                     "(never held plain), fell_back, held, warm_up", tag_keys=("model", "guard"))
        self.cycles = metrics.Counter("mmspec_serve_cycles", "target forwards after the prefill", tag_keys=tags)
        self.plain_cycles = metrics.Counter("mmspec_serve_guard_plain_cycles", "cycles the payoff guard decoded "
                                            "plainly, by why (fell_back, held, warm_up)", tag_keys=("model", "why"))
        self.active = metrics.Gauge("mmspec_serve_decoding", "requests decoding now (0 or 1)", tag_keys=tags)

    def request(self, status: int | str, stream: bool) -> None:
        self.requests.inc(1, {"model": self.model, "status": str(status), "stream": str(stream).lower()})

    def finished(self, latency_s: float, ttft_s: float | None, tokens: int, decode_s: float,
                 accepted: float) -> None:
        tags = {"model": self.model}
        self.latency.observe(latency_s, tags)
        if ttft_s is not None:
            self.ttft.observe(ttft_s, tags)
        if tokens > 0:
            self.output_tokens.inc(tokens, tags)
        if decode_s > 0:
            self.tokens_per_s.observe(tokens / decode_s, tags)
        self.accepted.observe(accepted, tags)

    def guarded(self, outcome: str | None, cycles: int, plain: dict[str, int]) -> None:
        """One answer's payoff-guard record (nothing for a decoder without a guard)."""
        if cycles > 0:
            self.cycles.inc(cycles, {"model": self.model})
        if outcome is None:
            return
        self.guard.inc(1, {"model": self.model, "guard": outcome})
        for why, n in plain.items():
            if n > 0:
                self.plain_cycles.inc(n, {"model": self.model, "why": why})

    def depth(self, waiting: int, decoding: int) -> None:
        self.queue_depth.set(waiting, {"model": self.model})
        self.active.set(decoding, {"model": self.model})
