"""ViSpec drafter (Kang et al., NeurIPS 2025, "ViSpec: Accelerating Vision-Language Models with Vision-Aware
Speculative Decoding"): EAGLE-2's fc + one decoder layer, made vision-aware by a small vision adaptor.

1. Compression. Per image (or video frame: one piece of `TargetOutput.media_segments`), one learnable-query
   cross-attention (n_c + 1 queries; keys/values = the piece's merged input embeddings, i.e. the projector output)
   emits n_c compressed tokens and one global vector g. The piece's drafter entries are replaced by the n_c
   tokens, which take the position ids of the piece's last n_c entries; every text entry keeps its original
   (uncompressed) position id, so the drafter's 1-D RoPE sees the target's distances whatever the family (1-D RoPE
   and M-RoPE targets alike).
2. Global feature. Every text entry after a media run, up to the next one, fuses img_fc([f; g]) instead of f
   (the paper's f + W_g g; img_fc starts as [I | 0], so f is unchanged at first): fc([e; img_fc([f; g])]). Before
   the first image, and in text-only requests, g = 0. A run of back-to-back pieces (a video's frames; in families
   that send clips as frames also images placed back to back) uses the mean of their g (the paper's video rule).
   Tree nodes and accepted tokens use the g of the latest run (`ViSpecHead.glob`).

Entries follow EAGLE: entry j pairs the embedding of token j+1 with the target feature f_j, so a piece of media
tokens [a, b) covers entries [a-1, b-1). The drafter's KV holds the compressed prefix; KV slot s has position id
s + `pos_offset`. Tree growth, scratch KV and acceptance are EAGLE-2's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from mmspec_ray.drafters.base import register_drafter
from mmspec_ray.drafters.eagle import Eagle2Config, Eagle2Drafter, Eagle2Head
from mmspec_ray.drafters.layers import rms_normalise
from mmspec_ray.targets.base import prefill_pieces

if TYPE_CHECKING:
    from mmspec_ray.targets.base import TargetOutput, VLMTarget


class ViSpecConfig(Eagle2Config):
    """EAGLE-2's sizes plus the number of compressed tokens per image / frame and how a run's g is pooled."""

    method: str = "vispec"
    compressed: int = 1  # n_c: the paper's final setting (its Table 2 sweeps 1, 4, 16, 64)
    global_pool: Literal["mean", "last"] = "mean"  # g of a run of back-to-back pieces: mean (video) or the last's
    # RMS-normalise each media row before the adaptor (layers.rms_normalise). Unnormalised, a projector output of
    # hundreds of times the text embeddings' size makes one AdamW step on img_fc's g half move the fused feature by
    # |g| x lr per weight, and training diverges. New heads set it (for_target); a config saved without the field
    # loads as it was trained (False).
    media_norm: bool = False
    adaptor_bias: bool = False  # the adaptor's k / v projections with a bias (the authors' heads of Qwen targets)
    # The training objective the head was fitted with (`training.vispec.objective_loss`), kept with the checkpoint so
    # runs can be told apart; drafting ignores it. None: not recorded (heads saved before it was, or built by hand).
    objective: str | None = None

    @classmethod
    def for_target(cls, target: "VLMTarget") -> "ViSpecConfig":
        return super().for_target(target).model_copy(update={"media_norm": True})


class VisionAdaptor(nn.Module):
    """One multi-head cross-attention from learnable queries onto a piece's media embeddings, then o_proj: no MLP,
    norm, residual or positional encoding (spec §2.2, confirmed by the paper's parameter counts)."""

    def __init__(self, dim: int, heads: int, queries: int, media_norm: bool = False, bias: bool = False) -> None:
        super().__init__()
        self.heads, self.head_dim, self.media_norm = heads, dim // heads, media_norm
        self.queries = nn.Parameter(torch.randn(queries, heads, self.head_dim) * self.head_dim ** -0.5)
        self.k_proj = nn.Linear(dim, dim, bias=bias)
        self.v_proj = nn.Linear(dim, dim, bias=bias)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, media: torch.Tensor) -> torch.Tensor:
        """media [N, d] -> [queries, d]: rows 0..n_c-1 the compressed tokens, the last row the global vector."""
        n = media.shape[0]
        if self.media_norm:  # scale-free keys and values whatever the projector's output scale
            media = rms_normalise(media)
        k = self.k_proj(media).view(n, self.heads, self.head_dim).transpose(0, 1)
        v = self.v_proj(media).view(n, self.heads, self.head_dim).transpose(0, 1)
        q = self.queries.to(media.dtype).transpose(0, 1)  # [H, Q, hd]
        att = F.scaled_dot_product_attention(q, k, v)  # [H, Q, hd], non-causal
        return self.o_proj(att.transpose(0, 1).reshape(q.shape[1], -1))


def media_runs_of(spans: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Spans grouped into runs of back-to-back spans (one image alone, or a clip's frames), in order."""
    runs: list[list[tuple[int, int]]] = []
    for s, e in sorted(spans):
        if runs and runs[-1][-1][1] == s:
            runs[-1].append((s, e))
        else:
            runs.append([(s, e)])
    return runs


def entry_spans(pieces: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Media pieces in token positions [a, b) -> the drafter entries they cover, [a-1, b-1) (entry j holds the
    embedding of token j+1); a piece at token 0 loses its first token (no entry holds it)."""
    return [(max(0, a - 1), b - 1) for a, b in pieces if b - 1 > max(0, a - 1)]


class ViSpecHead(Eagle2Head):
    """fc + one decoder layer (EAGLE-2's names), plus the vision adaptor and img_fc. `glob` [1, d] is per-request
    decoding state (the g in effect for new entries), set by the drafter; None means g = 0."""

    config_class = ViSpecConfig

    def __init__(self, cfg: ViSpecConfig) -> None:
        super().__init__(cfg)
        if cfg.compressed < 1:
            raise ValueError(f"compressed (n_c) must be >= 1, got {cfg.compressed}")
        d = cfg.hidden_size
        self.adaptor = VisionAdaptor(d, cfg.num_heads, cfg.compressed + 1, cfg.media_norm, cfg.adaptor_bias)
        self.img_fc = nn.Linear(2 * d, d, bias=True)
        with torch.no_grad():  # [I | 0], bias 0: starts as f_aug = f (authors' code)
            self.img_fc.weight.zero_()
            self.img_fc.weight[:, :d] = torch.eye(d)
            self.img_fc.bias.zero_()
        self.glob: torch.Tensor | None = None

    def fuse(self, embeds: torch.Tensor, feats: torch.Tensor, glob: torch.Tensor | None) -> torch.Tensor:
        """fc([e; img_fc([f; g])]) for embeds, feats [..., d] and g broadcastable to them (None: g = 0)."""
        g = feats.new_zeros(()).expand_as(feats) if glob is None else glob.to(feats.dtype).expand_as(feats)
        return self.fc(torch.cat([embeds, self.img_fc(torch.cat([feats, g], -1))], -1))

    def inputs(self, embeds: torch.Tensor, feats: torch.Tensor, visual: torch.Tensor | None) -> torch.Tensor:
        """Decoding entries (accepted tokens, tree nodes): every one is text after the latest media run."""
        return self.fuse(embeds, feats, self.glob)

    def sequence(self, nxt: torch.Tensor, feats: torch.Tensor, spans: list[tuple[int, int]]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The compressed drafter sequence of n entries (nxt [n, d]: embedding of token j+1; feats [n, d]: f_j) with
        media `spans` (entry ranges, one per image / frame): (inputs [S, d], position ids [S], the g in effect after
        the last entry or None). Text entries keep position j; a span [s, e)'s n_c tokens take e-n_c .. e-1."""
        n, nc = nxt.shape[0], self.cfg.compressed
        run_of = torch.full((n,), -1, dtype=torch.long, device=nxt.device)  # the run whose g entry j fuses
        globs: list[torch.Tensor] = []
        xs: list[torch.Tensor] = []
        ps: list[torch.Tensor] = []
        keep = torch.ones(n, dtype=torch.bool, device=nxt.device)
        for r, run in enumerate(media_runs_of(spans)):
            outs = [self.adaptor(nxt[s:e]) for s, e in run]
            gs = torch.stack([o[-1] for o in outs])
            globs.append(gs.mean(0) if self.cfg.global_pool == "mean" else gs[-1])
            run_of[run[-1][1]:] = r
            for (s, e), o in zip(run, outs):
                keep[s:e] = False
                xs.append(o[:-1])
                ps.append(torch.arange(e - nc, e, device=nxt.device).clamp_min(0))
        table = torch.stack([feats.new_zeros(feats.shape[1])] + [g.to(feats.dtype) for g in globs])
        fused = self.fuse(nxt, feats, table[run_of + 1])
        pos_all = torch.arange(n, device=nxt.device)
        x = torch.cat([fused[keep]] + [c.to(fused.dtype) for c in xs])
        pos = torch.cat([pos_all[keep]] + ps)
        order = torch.sort(pos, stable=True).indices
        return x[order], pos[order], (globs[-1][None] if globs else None)


@register_drafter("vispec")
class ViSpecDrafter(Eagle2Drafter):
    """EAGLE-2 drafting state around a ViSpec head: `begin` builds the compressed prompt and sets the global
    feature; `observe` / `propose` are EAGLE-2's (the head fuses g, positions continue the uncompressed count)."""

    head_class = ViSpecHead

    @torch.inference_mode()
    def begin(self, target: "VLMTarget", prefill: "TargetOutput", root: int) -> None:
        self.ctx_len, self.last = 0, None
        dt = self.target.dtype
        feats = prefill.hidden[0].to(dt)
        nxt = torch.cat([prefill.inputs_embeds[0][1:].to(dt), self._embed([root])], 0)
        x, pos, glob = self.head.sequence(nxt, feats, entry_spans(prefill_pieces(prefill, target)))
        self.head.glob = glob
        self._append(x, pos)
        self.pos_offset = nxt.shape[0] - self.ctx_len  # next slot ctx_len has position n (uncompressed count)
        self.prefill_tokens = self.ctx_len

    def _append(self, x: torch.Tensor, pos: torch.Tensor) -> None:
        """Run ready layer inputs x [T, d] at position ids pos [T] causally after the context; keep their KV."""
        S, mask, pos = self._after_context(x.shape[0], pos)
        out = self.head.layer(x[None], pos, mask, self.kv, S)
        self.ctx_len = S + x.shape[0]
        self.last = out[0, -1:]
