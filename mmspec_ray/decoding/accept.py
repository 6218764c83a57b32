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
from mmspec_ray.decoding.sampling import sample, uniform, warp
from mmspec_ray.decoding.tree import DraftTree


def accept_greedy(tree: DraftTree, logits: torch.Tensor, tie_margin: float = 0.0) -> tuple[list[int], int | None]:
    """logits [n, V] of the tree's nodes -> (accepted node path from the root, bonus token).

    tie_margin > 0 (half precision): a multi-node forward rounds differently from the one-token forward AR decoding
    makes, which can flip a near-tie. A decision whose top-2 logit gap is below tie_margin x max(1, |top logit|) is
    not taken from such a forward: the walk stops at that node and the bonus is None, so the engine decides that
    token with a one-token forward. Trees of one node are one-token forwards: never guarded."""
    unsure: list[bool] | None = None
    if tie_margin > 0 and tree.size > 1:
        top = torch.topk(logits, 2, dim=-1).values  # [n, 2], on the logits' device
        unsure = ((top[:, 0] - top[:, 1]) < tie_margin * top[:, 0].abs().clamp_min(1.0)).tolist()
    argmax = logits.argmax(-1).tolist()
    tokens = tree.tokens.tolist()
    kids = tree.children()
    path = [0]
    while True:
        if unsure is not None and unsure[path[-1]]:
            return path, None
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


def accept(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
           tie_margin: float = 0.0) -> tuple[list[int], int | None]:
    """(path, bonus); bonus None only when greedy acceptance stopped at a near-tie (see accept_greedy)."""
    if params.greedy:
        return accept_greedy(tree, logits, tie_margin)
    return accept_sampling(tree, logits, params, generator)
