"""SpecFLASH drafter (Zhang et al. 2025, "SpecFLASH: A Latent-Guided Semi-autoregressive Speculative Decoding
Framework for Efficient Multimodal Generation"): EAGLE's fc + one decoder layer, with two changes.

1. Latent-guided visual compression. The target's top features at the N media positions of each image or video
   frame (`TargetOutput.media_segments`, one piece per image / frame in every family) are attention-pooled by C
   learnable queries, Z = softmax(Q F^T) F (one head, no projections, no 1/sqrt(d): spec §2.3), and the C vectors
   replace the N entries in the drafter's sequence. C = round(N x ratio), at least 1, at most the query bank;
   ratio 1 feeds the N features unpooled and ratio 0 drops the visual entries (the paper's C/N sweep ends).
   Drafter positions are contiguous in this compressed sequence, in training and inference alike.
2. Semi-autoregressive head. After the newest real entry u_n = fc([e(x_{n+1}); f_n]) come K-1 placeholder inputs
   (learned vectors pi_s, or u_n + pi_s with `placeholder: "offset"`) at positions pos(n)+1 .. pos(n)+K-1 (causal among themselves): slot 0 (u_n's output) predicts f_{n+1},
   i.e. token x_{n+2}, and placeholder s predicts token x_{n+2+s}. One decoder-layer forward drafts K tokens.

Proposals: the per-slot argmax chain (the paper), or (`draft: "tree"`) the best `total_tokens - 1` nodes of the
tree whose level-s nodes are each the top-k tokens of slot s (scores: summed log-probs). Both are deterministic
proposals verified by the engine's lossless acceptance. The drafter's KV holds only real entries computed from
target features; an accepted path is appended lazily (`observe` queues it) and runs in the next `propose`'s single
forward, together with the placeholders, whose KV slots are scratch.
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from mmspec_ray.drafters.layers import extend_mask
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

    def compress(self, feats: torch.Tensor) -> torch.Tensor:
        """One piece's media features [N, d] -> its C drafter inputs [C, d] (see `compressed_count`)."""
        c = compressed_count(feats.shape[0], self.cfg.ratio, self.cfg.max_queries)
        if c == feats.shape[0] and self.cfg.ratio >= 1.0:
            return feats
        q = self.queries[:c].to(feats.dtype)
        return torch.softmax((q @ feats.T).float(), -1).to(feats.dtype) @ feats

    def sequence(self, nxt: torch.Tensor, feats: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        """The drafter inputs [S, d] of prompt entries: entry j (embedding of token j+1 `nxt[j]`, feature
        `feats[j]`) is fc([nxt_j; f_j]) at text positions (segments[j] < 0); each media piece's entries are
        replaced, at its first position, by its compressed vectors."""
        fused = self.fc(torch.cat([nxt, feats], -1))
        seg = segments.tolist()
        out: list[torch.Tensor] = []
        j, n = 0, len(seg)
        while j < n:
            if seg[j] < 0:
                k = j
                while k < n and seg[k] < 0:
                    k += 1
                out.append(fused[j:k])
            else:
                k = j
                while k < n and seg[k] == seg[j]:
                    k += 1
                out.append(self.compress(feats[j:k]))
            j = k
        return torch.cat(out, 0) if out else fused[:0]


@register_drafter("specflash")
class SpecFlashDrafter(Eagle2Drafter):
    """Per-request SpecFLASH state: compressed prompt context in the drafter's KV, queued real entries, and one
    forward per `propose`. `passes` counts drafter forwards made while proposing (the engine's τ per pass)."""

    head_class = SpecFlashHead

    def __init__(self, head: SpecFlashHead, target: "VLMTarget") -> None:
        super().__init__(head, target)
        self.pending: torch.Tensor | None = None  # [P, d] real entries not yet run (their KV not yet written)
        self.passes = 0

    # ---------- lifecycle ----------
    @torch.inference_mode()
    def begin(self, target: "VLMTarget", prefill: "TargetOutput", root: int) -> None:
        """Compress the prompt's media per image / frame, run every prompt entry but the last (the last, paired with
        `root`, is queued so the first `propose` drafts from it in its one forward)."""
        self.ctx_len, self.last = 0, None
        feats = prefill.hidden[0].to(self.target.dtype)
        nxt = torch.cat([prefill.inputs_embeds[0][1:].to(self.target.dtype), self._embed([root])], 0)
        seg = prefill.media_segments
        if seg is None:  # a TargetOutput built by hand: pieces from the ids alone
            from mmspec_ray.targets.base import segment_ids

            ids = prefill.input_ids[0]
            seg = segment_ids(ids.shape[0], target.media_pieces(ids), ids.device)
        x = self.head.sequence(nxt, feats, seg[0])
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
        k = min(self.head.cfg.group, cfg.depth, cfg.total_tokens - 1)
        if self.pending is None or not self.pending.shape[0] or k < 1:
            return DraftTree.chain([root])
        logp = self.slot_logprobs(k)  # [k, V]: one forward
        if self.head.cfg.draft == "tree":
            return cartesian_tree(root, logp, cfg.top_k, cfg.total_tokens - 1)
        return DraftTree.chain([root] + logp.argmax(-1).tolist())

    @torch.inference_mode()
    def slot_logprobs(self, k: int) -> torch.Tensor:
        """Run [queued entries; k-1 placeholders] in one decoder forward after the context; commit the entries'
        KV (the placeholders' slots are scratch) and return the k slots' draft log-probs [k, V] on the host."""
        P = self.pending.shape[0]
        ph = self.head.placeholders[:k - 1].to(self.target.dtype)
        if self.head.cfg.placeholder == "offset":
            ph = ph + self.pending[-1:]
        x = torch.cat([self.pending, ph], 0)
        out = self._run(x, commit=P)
        self.pending = None
        self.passes += 1
        return torch.log_softmax(self.target.lm_head(out[P - 1:P - 1 + k]).float(), -1).cpu()

    # ---------- internals ----------
    def _run(self, x: torch.Tensor, commit: int | None = None) -> torch.Tensor:
        """Decoder layer over inputs x [T, d] causally after the context (positions continue the compressed
        sequence); the first `commit` (default all) become context. Returns the outputs [T, d]."""
        S, T = self.ctx_len, x.shape[0]
        dev = self.target.device
        self._reserve(S + T)
        mask = extend_mask(S, T, dev)
        pos = torch.arange(S, S + T, device=dev)[None]
        out = self.head.layer(x[None], pos, mask, self.kv, S)[0]
        self.ctx_len = S + (T if commit is None else commit)
        return out


def cartesian_tree(root: int, logp: torch.Tensor, top_k: int, budget: int) -> DraftTree:
    """The best `budget` nodes (by summed log-prob along the path) of the tree whose depth-s nodes each have the
    top_k tokens of slot s-1 as children (the slots' distributions do not depend on earlier draft tokens). Best
    first, so a node's parent is always taken before it (a child never outscores its parent)."""
    vals, idx = torch.topk(logp, min(top_k, logp.shape[-1]), dim=-1)
    vals, idx = vals.tolist(), idx.tolist()
    tokens, parents, scores = [root], [-1], [0.0]
    heap = [(-vals[0][r], 0, r, 0) for r in range(len(idx[0]))]  # (-score, slot, rank, parent node)
    heapq.heapify(heap)
    while heap and len(tokens) - 1 < budget:
        neg, s, r, par = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(idx[s][r])
        parents.append(par)
        scores.append(-neg)
        if s + 1 < len(idx):
            for r2 in range(len(idx[s + 1])):
                heapq.heappush(heap, (neg - vals[s + 1][r2], s + 1, r2, node))
    par = torch.tensor(parents, dtype=torch.long)
    return DraftTree(torch.tensor(tokens, dtype=torch.long), par, depths(par), torch.tensor(scores))
