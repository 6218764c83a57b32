"""Acceptance: which path of a verified draft tree to keep, and the bonus token. Lossless in both modes.

Greedy: follow the child whose token is the target's argmax; bonus = argmax at the last accepted node.
Sampling (multi-candidate, deterministic proposals as in EAGLE-2's top-k tree, so q(x) = 1): at each node draw from
the *warped* target distribution p by trying children in order — accept child x with probability p(x); on rejection
set p <- normalize(p with x removed) and try the next child; if all fail, the bonus is drawn from the residual p.
The bonus always comes from the warped distribution (temperature, top-k, top-p applied). The residual is kept as
unnormalised weights w and x accepted with probability w(x) / sum(w): the same law, but a child that holds all the
leftover mass is accepted surely (ratio exactly 1), so a rejection always leaves mass to draw the bonus from.

Logits stay on the target's device: greedy moves only the n argmax ids to the host, sampling only scalars.
"""

from __future__ import annotations

import torch

from mmspec_ray.config import SamplingParams
from mmspec_ray.spec.sampling import sample, uniform, warp
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
    """Lossless multi-candidate rejection sampling over the tree (see module docstring). `generator` lives on the
    logits' device."""
    tokens = tree.tokens.tolist()
    kids = tree.children()
    path = [0]
    while True:
        w = warp(logits[path[-1]], params)  # residual weights at this node, unnormalised after a rejection
        nxt = None
        for c in kids[path[-1]]:
            wx = float(w[tokens[c]])
            if wx <= 0.0:
                continue
            if uniform(generator) * float(w.sum()) < wx:
                nxt = c
                break
            w[tokens[c]] = 0.0
        if nxt is None:
            return path, sample(w, generator)
        path.append(nxt)


def accept(tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator) -> tuple[list[int], int]:
    if params.greedy:
        return accept_greedy(tree, logits)
    return accept_sampling(tree, logits, params, generator)
