"""Draft trees: the frozen DraftTree record and EAGLE-2 dynamic tree growth as a pure function of a step callback."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field


class TreeConfig(BaseModel):
    """EAGLE-2 growth: expand `top_k` best nodes per level for `depth` levels, keep the best `total_tokens`."""

    model_config = ConfigDict(frozen=True)

    top_k: int = Field(8, ge=1)
    depth: int = Field(5, ge=1, description="drafter steps: nodes reach depth + 1 levels below the root (the first "
                       "level comes from the distribution the drafter already holds for the root)")
    total_tokens: int = Field(48, ge=1, description="tree size including the root; 1: no drafting, plain AR steps "
                              "(what calibration picks where no tree pays)")


@dataclass(frozen=True)
class DraftTree:
    """A token tree rooted at the last committed token (not yet in the target's KV). Parents precede children."""

    tokens: torch.Tensor  # [n] long; node 0 is the root
    parents: torch.Tensor  # [n] long; -1 for the root
    depth: torch.Tensor  # [n] long; root 0
    scores: torch.Tensor  # [n] float; cumulative draft log-prob along the path (root 0)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def ancestors(self) -> torch.Tensor:
        """[n, n] bool; row i marks i and all of its ancestors (the tree attention mask)."""
        return ancestor_mask(self.parents)

    def children(self) -> list[list[int]]:
        """children[i]: node i's children, best draft score first (the order acceptance tries them)."""
        kids: list[list[int]] = [[] for _ in range(self.size)]
        par = self.parents.tolist()
        for i in range(1, self.size):
            kids[par[i]].append(i)
        sc = self.scores.tolist()
        for k in kids:
            k.sort(key=lambda j: -sc[j])
        return kids

    def truncate(self, max_depth: int) -> "DraftTree":
        """The subtree of nodes at depth <= max_depth (self when nothing is deeper). Node order is kept, so parents
        still precede children; the engine cuts what could never be emitted before `max_new_tokens`."""
        keep = torch.nonzero(self.depth <= max_depth).flatten()
        if keep.numel() == self.size:
            return self
        index = torch.full((self.size,), -1, dtype=torch.long)
        index[keep] = torch.arange(keep.numel())
        par = self.parents[keep]
        par = torch.where(par >= 0, index[par.clamp(min=0)], par)
        return DraftTree(self.tokens[keep], par, self.depth[keep], self.scores[keep])

    def head(self, n: int) -> "DraftTree":
        """The first n nodes (self when it has no more). Parents precede children, so any prefix is a tree rooted
        at node 0; the engine cuts a tree to the cache slots left before the target's context ends."""
        if n >= self.size:
            return self
        return DraftTree(self.tokens[:n], self.parents[:n], self.depth[:n], self.scores[:n])

    @staticmethod
    def chain(tokens: list[int]) -> "DraftTree":
        """A single path (n-gram and semi-autoregressive drafters): a chain is a tree."""
        n = len(tokens)
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.arange(-1, n - 1, dtype=torch.long),
                         torch.arange(n, dtype=torch.long), torch.zeros(n))


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[n, n] bool ancestor-or-self matrix from parent pointers (parents precede children)."""
    n = parents.shape[0]
    anc = torch.eye(n, dtype=torch.bool)
    par = parents.tolist()
    for i in range(1, n):
        anc[i] |= anc[par[i]]
    return anc


def depths(parents: torch.Tensor) -> torch.Tensor:
    par = parents.tolist()
    d = [0] * len(par)
    for i in range(1, len(par)):
        d[i] = d[par[i]] + 1
    return torch.tensor(d, dtype=torch.long)


# step(tokens [k], parents [k]) -> log-probs [k, V] for the next token after each node.
# `parents` index the previously expanded nodes (in call order, across calls), -1 for the root.
StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def grow_dynamic_tree(root_token: int, root_logp: torch.Tensor, step: StepFn, cfg: TreeConfig) -> DraftTree:
    """EAGLE-2 growth. Candidates: top_k children of every expanded node, scored by cumulative log-prob; each
    level expands the top_k candidates of the previous level; the final tree keeps the best total_tokens - 1
    candidates (a child never outscores its parent, so the kept set is connected), in creation order."""
    k = cfg.top_k
    top = torch.topk(root_logp.float(), k)
    # candidate pool, in creation order: token, parent candidate (-1 = root), cumulative score
    cand_tok: list[torch.Tensor] = [top.indices]
    cand_par: list[torch.Tensor] = [torch.full((k,), -1, dtype=torch.long)]
    cand_score: list[torch.Tensor] = [top.values]
    frontier = torch.arange(k)  # candidate ids to expand next
    n_cand = k
    expanded: list[int] = []  # candidate id of each expanded node, in step-call order
    for _ in range(cfg.depth):
        ftok = torch.cat(cand_tok)[frontier]
        fscore = torch.cat(cand_score)[frontier]
        fpar_cand = torch.cat(cand_par)[frontier]
        exp_index = {c: i for i, c in enumerate(expanded)}
        step_parents = torch.tensor([exp_index.get(int(p), -1) for p in fpar_cand], dtype=torch.long)
        expanded += frontier.tolist()
        logp = step(ftok, step_parents).float()  # [k', V]
        ctop = torch.topk(logp, k, dim=-1)
        cum = fscore[:, None] + ctop.values  # [k', k]
        cand_tok.append(ctop.indices.reshape(-1))
        cand_par.append(frontier.repeat_interleave(k))
        cand_score.append(cum.reshape(-1))
        best = torch.topk(cum.reshape(-1), min(k, cum.numel())).indices
        frontier = n_cand + best
        n_cand += cum.numel()
    all_tok, all_par, all_score = torch.cat(cand_tok), torch.cat(cand_par), torch.cat(cand_score)
    keep = torch.topk(all_score, min(cfg.total_tokens - 1, all_score.numel())).indices.sort().values
    keep = _close_under_parents(keep, all_par)
    pos = {int(c): i + 1 for i, c in enumerate(keep.tolist())}
    parents = torch.tensor([0 if int(all_par[c]) < 0 else pos[int(all_par[c])] for c in keep.tolist()],
                           dtype=torch.long)
    tokens = torch.cat([torch.tensor([root_token]), all_tok[keep]])
    parents = torch.cat([torch.tensor([-1]), parents])
    scores = torch.cat([torch.zeros(1), all_score[keep]])
    return DraftTree(tokens, parents, depths(parents), scores)


def _close_under_parents(keep: torch.Tensor, par: torch.Tensor) -> torch.Tensor:
    """Add any missing ancestor (possible only with tied scores) so every kept node's parent is kept."""
    kept = set(keep.tolist())
    for c in keep.tolist():
        p = int(par[c])
        while p >= 0 and p not in kept:
            kept.add(p)
            p = int(par[p])
    return torch.tensor(sorted(kept), dtype=torch.long)


class TreeSteps:
    """What a drafter's dynamic-tree expansion keeps across its steps (the one copy EAGLE-2 and DREAM share): each
    expanded node's level (root's children: 1) and the ancestor-or-self matrix among the expanded nodes."""

    def __init__(self, context: int, device: torch.device | str) -> None:
        self.context = context  # cached context entries every draft node sees
        self.levels: list[int] = []
        self.anc = torch.zeros((0, 0), dtype=torch.bool, device=device)

    def add(self, parents: torch.Tensor) -> tuple[int, list[int], torch.Tensor, torch.Tensor]:
        """Register the new nodes of one step (`parents` [k] among the expanded nodes, -1: the root). Returns
        (nodes expanded before, the new nodes' levels, their attention mask [k, context + expanded] over the
        context and their ancestors-or-self, their rows of the ancestor matrix [k, expanded])."""
        before, k = self.anc.shape[0], parents.shape[0]
        levels = [1 if p < 0 else self.levels[p] + 1 for p in parents.tolist()]
        self.anc = grow_ancestors(self.anc, parents)
        new = self.anc[before:]
        mask = torch.cat([torch.ones((k, self.context), dtype=torch.bool, device=new.device), new], 1)
        self.levels.extend(levels)
        return before, levels, mask, new


def grow_ancestors(anc: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """One expansion step of a drafter's tree: `anc` [n, n] ancestor-or-self among the n nodes expanded so far,
    `parents` [k] the new nodes' parents among them (-1: the root). Returns the grown [n + k, n + k] matrix; its last
    k rows are the new nodes' attention over the expanded nodes (strict ancestors, then themselves)."""
    n, k = anc.shape[0], parents.shape[0]
    p = parents.to(anc.device)
    seen = anc[p.clamp(min=0)] & (p >= 0)[:, None] if n else anc.new_zeros((k, 0))
    new = torch.cat([seen, torch.eye(k, dtype=torch.bool, device=anc.device)], 1)
    return torch.cat([torch.nn.functional.pad(anc, (0, k)), new], 0)
