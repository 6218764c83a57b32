"""Prompt lookup (training-free): find the latest earlier occurrence of the last n tokens and propose what followed.

A proposal is worth verifying only when it is likely to be accepted: on a CPU a verify forward of 2-8 tokens costs
1.5-1.7x a one-token step (docs/toy.md, "Cost profile"), so a guess must be accepted ~0.5 tokens on average to
pay. A single-token match (`min_ngram` 1) is accepted far less on the toy workloads (docs/history/benchmarks.md,
n-gram), so the default asks for a match of at least 2 tokens; with no such match the drafter proposes the root
alone and the cycle is a plain AR step (the same one-token forward AREngine runs)."""

from __future__ import annotations

import torch

from mmspec_ray.drafters.base import register_drafter
from mmspec_ray.decoding.tree import DraftTree, TreeConfig


@register_drafter("ngram")
class NgramDrafter:
    def __init__(self, max_ngram: int = 3, min_ngram: int = 2) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram drafter: need 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.context: list[int] = []

    def begin(self, target, prefill, root: int) -> None:
        media = target.media_token_ids
        self.context = [t for t in prefill.input_ids[0].tolist() if t not in media] + [root]

    def propose(self, root: int, cfg: TreeConfig) -> DraftTree:
        """The chain root + what followed the latest earlier match of the longest tail (max_ngram .. min_ngram
        tokens); the root alone when no tail of at least min_ngram tokens occurred before."""
        return DraftTree.chain([root] + self.lookup(min(cfg.depth + 1, cfg.total_tokens - 1)))

    def lookup(self, length: int) -> list[int]:
        """Up to `length` tokens that followed the latest earlier occurrence of the context's longest matching tail."""
        ctx = self.context
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            tail = ctx[-n:]
            for start in range(len(ctx) - n - 1, -1, -1):
                if ctx[start:start + n] == tail:
                    follow = ctx[start + n:start + n + length]
                    if follow:
                        return follow
        return []

    def observe(self, tokens: list[int], hidden: torch.Tensor, bonus: int) -> None:
        self.context += tokens[1:] + [bonus]
