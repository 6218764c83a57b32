"""Finish conditions shared by every engine: eos ids, stop strings, max tokens; and the Generation record."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length"]


@dataclass
class GenerationStats:
    """Where the time went and how much each target forward produced."""

    prompt_tokens: int = 0
    cycles: int = 0  # target forwards after prefill
    accepted_per_cycle: list[int] = field(default_factory=list)  # accepted draft tokens per cycle (bonus excluded)
    draft_passes: int = 0  # drafter forwards while proposing (a drafter's `passes` counter; 0: it keeps none)
    tie_cycles: int = 0  # cycles that ended at a half-precision near-tie, without a bonus (decoding/accept.py)
    plain_cycles: int = 0  # cycles that drafted nothing: one-token forwards (payoff guard, 1-token tree, near-tie)
    guard_moves: list[tuple[int, int]] = field(default_factory=list)  # (answer tokens, new ladder rung) per move
    guard: str | None = None  # what the payoff guard did (decoding/payoff.py RequestGuard.outcome); None: no guard
    guard_plain_cycles: dict[str, int] = field(default_factory=dict)  # cycles the guard decoded plainly, by why
    prefill_drafted: int = 0  # answer tokens guessed from the prompt and verified in the prefill's forward
    prefill_accepted: int = 0  # of those, accepted
    prefill_s: float = 0.0  # encoding, the prompt's draft and the prefill forward, to the first token
    draft_s: float = 0.0  # the drafter's time: its begin (drafter_prefill_s) + proposing + observing
    drafter_prefill_s: float = 0.0  # the drafter's begin: its own pass over the prompt, once per request
    drafter_prefill_tokens: int = 0  # entries the drafter's begin read (its `prefill_tokens`; 0: none)
    verify_s: float = 0.0
    overhead_s: float = 0.0  # acceptance, cache commit, bookkeeping
    total_s: float = 0.0

    @property
    def mean_accepted(self) -> float:
        """τ as accepted draft tokens per cycle."""
        return sum(self.accepted_per_cycle) / max(1, len(self.accepted_per_cycle))

    @property
    def accepted_per_pass(self) -> float | None:
        """τ as accepted draft tokens per drafter forward (the SpecFLASH paper's τ); None when not counted."""
        return sum(self.accepted_per_cycle) / self.draft_passes if self.draft_passes else None

    @property
    def tokens_per_forward(self) -> float:
        """τ as tokens committed per target forward (accepted + 1; a cycle ended at a near-tie has no bonus)."""
        n = len(self.accepted_per_cycle)
        return (sum(self.accepted_per_cycle) + n - self.tie_cycles) / max(1, n) if n else 1.0


@dataclass
class Generation:
    token_ids: list[int]  # generated ids, eos included when it ended the answer (as HF generate returns them)
    text: str
    finish_reason: FinishReason
    stats: GenerationStats


class OutputTracker:
    """Accumulates committed tokens and decides when to stop."""

    def __init__(self, tokenizer, eos_ids: set[int], max_new_tokens: int, stop: tuple[str, ...] = ()) -> None:
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_new_tokens = max_new_tokens
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.finish: FinishReason | None = None
        self.stop_at: int | None = None  # character offset where a stop string begins

    def add(self, tokens: list[int]) -> bool:
        """Append tokens in order until a finish condition fires; returns True when generation is over."""
        for t in tokens:
            self.ids.append(t)
            if t in self.eos_ids:
                self.finish = "stop"
                return True
            if self.stop and self._hit_stop():
                self.finish = "stop"
                return True
            if len(self.ids) >= self.max_new_tokens:
                self.finish = "length"
                return True
        return False

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.ids)

    def _hit_stop(self) -> bool:
        tail = self.tokenizer.decode(self.ids[-64:], skip_special_tokens=True)
        return any(s in tail for s in self.stop)

    def text(self) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = [text.find(s) for s in self.stop if s in text]
        return text[: min(cut)] if cut else text

    def result(self, stats: GenerationStats) -> Generation:
        return Generation(list(self.ids), self.text(), self.finish or "length", stats)
