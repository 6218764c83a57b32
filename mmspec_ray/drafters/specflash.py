"""SpecFLASH drafter (Zhang et al. 2025, "SpecFLASH: A Latent-Guided Semi-autoregressive Speculative Decoding
Framework for Efficient Multimodal Generation"): EAGLE's fc + one decoder layer, with two changes.

1. Latent-guided visual compression. The target's top features at the N media positions of each image or video
   frame (`TargetOutput.media_segments`, one piece per image / frame in every family) are attention-pooled by C
   learnable queries, Z = softmax(Q F^T) F (one head, no projections, no 1/sqrt(d): spec §2.3), and the C vectors
   replace the N entries in the drafter's sequence. C = round(N x ratio), at least 1, at most the query bank;
   ratio 1 feeds the N features unpooled and ratio 0 drops the visual entries (the paper's C/N sweep ends).
   Drafter positions are contiguous in this compressed sequence, in training and inference alike.
2. Semi-autoregressive head. After the newest real entry u_n = fc([e(x_{n+1}); f_n]) come K-1 placeholder inputs
   (learned vectors pi_s, or u_n + pi_s with `placeholder: "offset"`) at positions pos(n)+1 .. pos(n)+K-1 (causal
   among themselves): slot 0 (u_n's output) predicts f_{n+1}, i.e. token x_{n+2}, and placeholder s predicts token
   x_{n+2+s}. One decoder-layer forward drafts K tokens.

Proposals: the per-slot argmax chain (the paper), or (`draft: "tree"`) the best `total_tokens - 1` nodes of the
tree whose level-s nodes are each the top-k tokens of slot s (scores: summed log-probs). Both are deterministic
proposals verified by the engine's lossless acceptance. When the tree config asks for more tokens than K
(`chain_groups`, on by default; paper Appendix E), groups are chained: the K drafted tokens, each paired with its
slot's output feature, are fed back as real entries fc([e(d_s); f^_s]) and the next forward drafts the next K, until
the depth is reached (the tree variant hangs each later group under the argmax path only).
The drafter's KV holds only real entries computed from target features; an accepted path is appended lazily
(`observe` queues it) and runs in the next `propose`'s first forward, together with the placeholders, whose KV
slots are scratch, as are those of the drafted entries fed back by a chained group.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch
from torch import nn

from mmspec_ray.drafters.base import register_drafter
from mmspec_ray.drafters.eagle import Eagle2Config, Eagle2Drafter, Eagle2Head
from mmspec_ray.decoding.tree import DraftTree, TreeConfig, depths

if TYPE_CHECKING:
    from mmspec_ray.targets.base import TargetOutput, VLMTarget


class SpecFlashConfig(Eagle2Config):
    """EAGLE-2's sizes plus the compression ratio, the query bank, the group size K and the proposal shape."""

    method: str = "specflash"
    ratio: float = 1 / 9  # C/N per image / frame; 1: no compression, 0: no visual entries
    max_queries: int = 64  # learnable queries (the paper's LLaVA C: 576 / 9); C never exceeds it
    group: int = 4  # K: tokens drafted per forward (slot 0 + K-1 placeholders)
    draft: Literal["chain", "tree"] = "chain"
    # placeholder s's input: "learned" = pi_s alone (spec §2.5's design), "offset" = u_n + pi_s (the authors'
    # later code: the newest real entry's input plus a learned slot offset)
    placeholder: Literal["learned", "offset"] = "learned"
    # paper Appendix E: when the tree depth exceeds K, feed the K drafted tokens back (with their slots' output
    # features) and draft the next K, until the depth is reached; False: one forward, at most K tokens per cycle
    chain_groups: bool = True


def compressed_count(n: int, ratio: float, max_queries: int) -> int:
    """C for a piece of n media tokens: n when uncompressed (ratio >= 1), 0 when dropped, else round(n x ratio)
    clipped to [1, max_queries]."""
    if ratio >= 1.0:
        return n
    if ratio <= 0.0:
        return 0
    return max(1, min(max_queries, int(math.floor(n * ratio + 0.5))))


class SpecFlashHead(Eagle2Head):
    """fc + one decoder layer (EAGLE-2's, same parameter names), plus the query bank Q [max_queries, d] and the
    placeholder inputs [K-1, d]. Embeddings and LM head are the target's, never saved."""

    config_class = SpecFlashConfig

    def __init__(self, cfg: SpecFlashConfig) -> None:
        super().__init__(cfg)
        if cfg.group < 1:
            raise ValueError(f"group (K) must be >= 1, got {cfg.group}")
        d = cfg.hidden_size
        self.queries = nn.Parameter(torch.randn(cfg.max_queries, d) * 0.02)  # spec §2.3: N(0, 0.02^2)
        # placeholders are inputs, not weights: drawn at unit scale, about that of the fc-fused inputs (rms 0.5 on
        # toy-s), so their queries can select context from the first steps (at 0.02 their attention starts uniform
        # and slots 1..K-1 stayed near unigram accuracy for ~200 steps on toy-s; docs/drafters/specflash.md)
        self.placeholders = nn.Parameter(torch.randn(max(1, cfg.group - 1), d))

    def compress(self, feats: torch.Tensor, c: int | None = None) -> torch.Tensor:
        """One piece's media features [N, d] -> its c pooled vectors softmax(Q_c F^T) F [c, d] (c: default
        `compressed_count(N)`; the N features themselves when uncompressed)."""
        c = compressed_count(feats.shape[0], self.cfg.ratio, self.cfg.max_queries) if c is None else c
        if self.cfg.ratio >= 1.0:
            return feats
        q = self.queries[:c].to(feats.dtype)
        return torch.softmax((q @ feats.T).float(), -1).to(feats.dtype) @ feats

    def sequence(self, nxt: torch.Tensor, feats: torch.Tensor, pieces: list[tuple[int, int]]) -> torch.Tensor:
        """The drafter inputs [S, d] of prompt entries: entry j (embedding of token j+1 `nxt[j]`, feature
        `feats[j]`) is fc([nxt_j; f_j]) in text runs; each media piece (start, end) is replaced, at its place, by
        its compressed vectors (`entry_runs`, the cut training uses too)."""
        fused = self.fc(torch.cat([nxt, feats], -1))
        out: list[torch.Tensor] = []
        for run in entry_runs(feats.shape[0], pieces, self.cfg.ratio, self.cfg.max_queries):
            if run.kind == "text":
                out.append(fused[run.start:run.end])
            elif run.count:
                out.append(self.compress(feats[run.start:run.end], run.count))
        return torch.cat(out, 0) if out else fused[:0]


class Run(NamedTuple):
    """A run of prompt entries [start, end) and what the drafter's sequence holds for it: `kind` "text" (each
    entry fused by fc), "raw" (a media piece's features, uncompressed) or "pooled" (a media piece's `count` query
    vectors; 0: dropped); `count` is the number of drafter inputs it becomes."""

    start: int
    end: int
    kind: Literal["text", "raw", "pooled"]
    count: int


def entry_runs(n: int, pieces: list[tuple[int, int]], ratio: float, max_queries: int) -> list[Run]:
    """Entries [0, n) cut into text runs and media pieces (start, end), in order; pieces are clipped to n, and C is
    `compressed_count` of the clipped length. The one walk of media that inference (`SpecFlashHead.sequence`) and
    training (`training.specflash.expand_example`) share, so both cut and compress the same entries."""
    runs: list[Run] = []
    j = 0
    for a, b in sorted(pieces):
        b = min(b, n)
        if a >= b:
            continue
        if a < j:
            raise ValueError(f"media pieces overlap: {sorted(pieces)}")
        if j < a:
            runs.append(Run(j, a, "text", a - j))
        runs.append(Run(a, b, "raw" if ratio >= 1.0 else "pooled", compressed_count(b - a, ratio, max_queries)))
        j = b
    if j < n:
        runs.append(Run(j, n, "text", n - j))
    return runs


@register_drafter("specflash")
class SpecFlashDrafter(Eagle2Drafter):
    """Per-request SpecFLASH state: compressed prompt context in the drafter's KV, queued real entries, and one
    forward per group of K drafted tokens in `propose`. `passes` counts drafter forwards made while proposing (the
    engine's τ per pass)."""

    head_class = SpecFlashHead

    def __init__(self, head: SpecFlashHead, target: "VLMTarget") -> None:
        super().__init__(head, target)
        self.pending: torch.Tensor | None = None  # [P, d] real entries not yet run (their KV not yet written)
        self.passes = 0

    # ---------- lifecycle ----------
    @torch.inference_mode()
    def begin(self, target: "VLMTarget", prefill: "TargetOutput", root: int) -> None:
        """Compress the prompt's media per image / frame, run every prompt entry but the last (the last, paired with
        `root`, is queued so the first `propose` drafts from it in its first forward)."""
        from mmspec_ray.targets.base import prefill_pieces

        self.ctx_len, self.last = 0, None
        feats = prefill.hidden[0].to(self.target.dtype)
        nxt = torch.cat([prefill.inputs_embeds[0][1:].to(self.target.dtype), self._embed([root])], 0)
        x = self.head.sequence(nxt, feats, prefill_pieces(prefill, target))
        self.prefill_tokens = x.shape[0]  # the compressed prompt's length (the engine reports it per request)
        self.pending = x[-1:]
        if x.shape[0] > 1:
            self._run(x[:-1])

    @torch.inference_mode()
    def observe(self, tokens: list[int], hidden: torch.Tensor, bonus: int) -> None:
        """Queue the accepted path's entries (target features at root..last accepted, each paired with the next
        token's embedding, the last with `bonus`); they run in the next `propose`."""
        new = self.head.fc(torch.cat([self._embed(tokens[1:] + [bonus]), hidden.to(self.target.dtype)], -1))
        self.pending = new if self.pending is None or not self.pending.shape[0] else torch.cat([self.pending, new])

    @torch.inference_mode()
    def propose(self, root: int, cfg: TreeConfig) -> DraftTree:
        """Draft `min(depth + 1, total_tokens - 1)` tokens (the tree's depth + 1 levels, as every drafter and the
        calibrator count them; at most K without `chain_groups`): one forward per group of K, as a chain or the
        per-slot top-k tree."""
        n = min(cfg.depth + 1, cfg.total_tokens - 1)
        if not self.head.cfg.chain_groups:
            n = min(n, self.head.cfg.group)
        if self.pending is None or not self.pending.shape[0] or n < 1:
            return DraftTree.chain([root])
        if self.head.cfg.draft != "tree":
            return DraftTree.chain([root] + self.draft_logprobs(n)[1])
        K, budget = self.head.cfg.group, cfg.total_tokens - 1

        def tree(logp: torch.Tensor, spine: list[int]) -> DraftTree:
            return cartesian_tree(root, logp, cfg.top_k, budget, K, spine)

        # a later group hangs under the argmax path's end: draft it only while that node is among the best nodes
        # (a node never outscores its parent, so once the path's end is out, nothing below it can come in)
        return tree(*self.draft_logprobs(n, lambda logp, spine: holds_path(tree(logp, spine), spine)))

    @torch.inference_mode()
    def draft_logprobs(self, n: int, more: "Callable[[torch.Tensor, list[int]], bool] | None" = None
                       ) -> tuple[torch.Tensor, list[int]]:
        """The draft log-probs [m, V] (host) of m <= n slots and their argmax tokens. The first forward runs [queued
        entries; K-1 placeholders] after the context and commits the entries' KV; while fewer than n tokens are
        drafted (and `more(log-probs so far, tokens so far)`, when given, says so), the last group's tokens d_s
        with their slots' outputs f^_s are fed back as real entries fc([e(d_s); f^_s]) (at the positions the
        group's slots held) with the next placeholders. The fed entries' KV is scratch: the context ends where the
        first forward left it."""
        K = self.head.cfg.group
        x, commit = self.pending, self.pending.shape[0]
        self.pending = None
        logps: list[torch.Tensor] = []
        spine: list[int] = []
        context = None  # the committed context length, once the queued entries have run
        try:
            while True:
                out = self._group(x, min(K, n - len(spine)), commit)
                if context is None:
                    context = self.ctx_len
                logp = self.logprobs(out)
                tokens = logp.argmax(-1)
                logps.append(logp.cpu())
                spine += tokens.tolist()
                if len(spine) >= n or (more is not None and not more(torch.cat(logps), spine)):
                    break
                x = self.head.fc(torch.cat([self.target.embed_tokens(tokens).to(self.target.dtype), out], -1))
                commit = x.shape[0]  # context for the next group only (restored below)
        finally:
            if context is not None:
                self.ctx_len = context
        return torch.cat(logps), spine

    def _group(self, x: torch.Tensor, k: int, commit: int) -> torch.Tensor:
        """One forward of real entries x [P, d] and k-1 placeholders after the context, the first `commit` rows'
        KV kept as context: the k slot outputs [k, d] (slot 0: x's last row's output)."""
        ph = self.head.placeholders[:k - 1].to(self.target.dtype)
        if self.head.cfg.placeholder == "offset":
            ph = ph + x[-1:]
        P = x.shape[0]
        out = self._run(torch.cat([x, ph], 0), commit=commit)
        self.passes += 1
        return out[P - 1:P - 1 + k]

    # ---------- internals ----------
    def _run(self, x: torch.Tensor, commit: int | None = None) -> torch.Tensor:
        """Decoder layer over inputs x [T, d] causally after the context (positions continue the compressed
        sequence); the first `commit` (default all) become context. Returns the outputs [T, d]."""
        S, mask, pos = self._after_context(x.shape[0])
        out = self.head.layer(x[None], pos, mask, self.kv, S)[0]
        self.ctx_len = S + (x.shape[0] if commit is None else commit)
        return out


def cartesian_tree(root: int, logp: torch.Tensor, top_k: int, budget: int, group: int | None = None,
                   spine: list[int] | None = None) -> DraftTree:
    """The best `budget` nodes (by summed log-prob along the path) of the tree whose depth-s nodes each have the
    top_k tokens of slot s-1 as children (a group's slots do not depend on its earlier draft tokens). With chained
    groups of `group` slots, slots from `group` on were drafted after the argmax path `spine`, so a group's first
    slot hangs only under the node that ends that path. Best first, so a node's parent is always taken before it
    (a child never outscores its parent)."""
    vals, idx = torch.topk(logp, min(top_k, logp.shape[-1]), dim=-1)
    vals, idx = vals.tolist(), idx.tolist()
    tokens, parents, scores, on_spine = [root], [-1], [0.0], [True]
    heap = [(-vals[0][r], 0, r, 0) for r in range(len(idx[0]))]  # (-score, slot, rank, parent node)
    heapq.heapify(heap)
    while heap and len(tokens) - 1 < budget:
        neg, s, r, par = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(idx[s][r])
        parents.append(par)
        scores.append(-neg)
        on_spine.append(on_spine[par] and spine is not None and s < len(spine) and idx[s][r] == spine[s])
        nxt = s + 1
        if nxt < len(idx) and (not group or nxt % group or on_spine[node]):
            for r2 in range(len(idx[nxt])):
                heapq.heappush(heap, (neg - vals[nxt][r2], nxt, r2, node))
    par = torch.tensor(parents, dtype=torch.long)
    return DraftTree(torch.tensor(tokens, dtype=torch.long), par, depths(par), torch.tensor(scores))


def holds_path(tree: DraftTree, path: list[int]) -> bool:
    """Whether `tree` has a node whose tokens from the root's child down are `path`."""
    node, kids = 0, tree.children()
    tokens = tree.tokens.tolist()
    for t in path:
        node = next((c for c in kids[node] if tokens[c] == t), -1)
        if node < 0:
            return False
    return True
