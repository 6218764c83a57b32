"""Prompt lookup (training-free): find the latest earlier occurrence of the last n tokens and propose what followed."""

from __future__ import annotations

import torch

from mmspec_ray.drafters.base import register_drafter
from mmspec_ray.spec.tree import DraftTree, TreeConfig


@register_drafter("ngram")
class NgramDrafter:
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.context: list[int] = []

    def begin(self, target, prefill, root: int) -> None:
        media = target.media_token_ids
        self.context = [t for t in prefill.input_ids[0].tolist() if t not in media] + [root]

    def propose(self, root: int, cfg: TreeConfig) -> DraftTree:
        ctx = self.context
        length = min(cfg.depth + 1, cfg.total_tokens - 1)
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            tail = ctx[-n:]
            for start in range(len(ctx) - n - 1, -1, -1):
                if ctx[start:start + n] == tail:
                    follow = ctx[start + n:start + n + length]
                    if follow:
                        return DraftTree.chain([root] + follow)
        return DraftTree.chain([root])

    def observe(self, tokens: list[int], hidden: torch.Tensor, bonus: int) -> None:
        self.context += tokens[1:] + [bonus]
