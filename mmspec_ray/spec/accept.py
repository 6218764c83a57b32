"""Acceptance: which path of a verified draft tree to keep, and the bonus token. Lossless in both modes.

Greedy: follow the child whose token is the target's argmax; bonus = argmax at the last accepted node.
Sampling (multi-candidate, deterministic proposals as in EAGLE-2's top-k tree, so q(x) = 1): at each node draw from
the *warped* target distribution p by trying children in order — accept child x with probability p(x); on rejection
set p <- normalize(p with x removed) and try the next child; if all fail, the bonus is drawn from the residual p.
The bonus always comes from the warped distribution (temperature, top-k, top-p applied).
"""

from __future__ import annotations

import torch

from mmspec_ray.config import SamplingParams
from mmspec_ray.spec.sampling import sample, warp
from mmspec_ray.spec.tree import DraftTree


def accept_greedy(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """logits [n, V] of the tree's nodes -> (accepted node path from the root, bonus token)."""
    argmax = logits.argmax(-1).tolist()
    tokens = tree.tokens.tolist()
    kids = tree.children()
    path = [0]
    while True:
        want = argmax[path[-1]]
        nxt = next((c for c in kids[path[-1]] if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)


def accept_sampling(tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
                    generator: torch.Generator) -> tuple[list[int], int]:
    """Lossless multi-candidate rejection sampling over the tree (see module docstring)."""
    tokens = tree.tokens.tolist()
    kids = tree.children()
    path = [0]
    while True:
        node = path[-1]
        p = warp(logits[node], params)
        moved = False
        for c in kids[node]:
            x = tokens[c]
            px = float(p[x])
            if px > 0.0 and float(torch.rand((), generator=generator)) < px:
                path.append(c)
                moved = True
                break
            if px > 0.0:
                p[x] = 0.0
                total = float(p.sum())
                if total <= 0.0:  # p was (numerically) all on rejected tokens
                    break
                p = p / total
        if not moved:
            return path, sample(p, generator)


def accept(tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator) -> tuple[list[int], int]:
    if params.greedy:
        return accept_greedy(tree, logits)
    return accept_sampling(tree, logits, params, generator)
