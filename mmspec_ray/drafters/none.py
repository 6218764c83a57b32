"""The null drafter: proposes only the root, so the spec engine degenerates to plain autoregressive decoding."""

from __future__ import annotations

import torch

from mmspec_ray.drafters.base import register_drafter
from mmspec_ray.decoding.tree import DraftTree, TreeConfig


@register_drafter("none")
class NoDrafter:
    def begin(self, target, prefill, root: int) -> None:
        pass

    def propose(self, root: int, cfg: TreeConfig) -> DraftTree:
        return DraftTree.chain([root])

    def observe(self, tokens: list[int], hidden: torch.Tensor, bonus: int) -> None:
        pass
