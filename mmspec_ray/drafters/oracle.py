"""Oracle drafter (tests and benchmarks only): proposes the known AR answer as a chain, to fix τ and measure
how much the engine itself wastes (measured speedup / ideal speedup)."""

from __future__ import annotations

import torch

from mmspec_ray.drafters.base import register_drafter
from mmspec_ray.decoding.tree import DraftTree, TreeConfig


@register_drafter("oracle")
class OracleDrafter:
    def __init__(self, answer: list[int], accept_len: int | None = None) -> None:
        self.answer = list(answer)
        self.accept_len = accept_len  # propose at most this many tokens (None: depth + 1)
        self.pos = 0  # index in `answer` of the current root

    def begin(self, target, prefill, root: int) -> None:
        self.pos = 0

    def propose(self, root: int, cfg: TreeConfig) -> DraftTree:
        n = min(cfg.depth + 1, cfg.total_tokens - 1)
        if self.accept_len is not None:
            n = min(n, self.accept_len)
        return DraftTree.chain([root] + self.answer[self.pos + 1:self.pos + 1 + n])

    def observe(self, tokens: list[int], hidden: torch.Tensor, bonus: int) -> None:
        self.pos += len(tokens)


class AntiOracleDrafter(OracleDrafter):
    """The opposite (tests and benchmarks only): a chain as long as the tree allows whose every token is wrong (the
    AR answer's token id + 1), so no draft is ever accepted: what the payoff guard must fall back from."""

    def __init__(self, answer: list[int], vocab: int) -> None:
        super().__init__(answer)
        self.vocab = vocab

    def propose(self, root: int, cfg: TreeConfig) -> DraftTree:
        true = (self.answer + [0] * cfg.total_tokens)[self.pos + 1:self.pos + cfg.total_tokens]
        return DraftTree.chain([root] + [(t + 1) % self.vocab for t in true])
