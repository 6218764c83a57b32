"""DREAM drafter (Hu et al. 2025, "DREAM: Drafting with Refined Target Features and Entropy-Adaptive Cross-Attention
Fusion for Multimodal Speculative Decoding"): three blocks, target features read through cross-attention only.

The draft stream is token embeddings (the prompt's merged input embeddings, media included, then accepted tokens):
block 1 (causal self-attention, no input norm) -> a cross-attention block whose keys/values are the target's
last-layer features -> block 3 (causal self-attention) -> final norm -> the target's frozen LM head. No fc fusion.
The cross-attention block (spec §2.2, the authors' code): pre-norm queries, per-head RMSNorm on q and k, no RoPE,
tanh-gated residuals (attention and MLP); the gates start open at `gate_init` (the authors' 0 makes the block start as
the identity, and then its projections get no gradient: see DreamConfig.gate_init).

Alignment (spec A7, the clean version): the query for the token at original position p sees the target features
at positions < p, plus a zero "null" slot every query may attend (row 0 would otherwise see nothing). While
drafting, a tree node also sees the draft's own final features of its ancestors (the root's included), each once,
and nothing of other branches: the tree mask holds inside the cross-attention too. The drafter keeps its own
caches: self-attention KV of blocks 1 and 3 over the draft stream, and the cross-attention K/V of the memory.

Visual token compression (VTC, spec §3): at prefill the target reports the attention each position receives in its
last layer from the text query rows (`TargetOutput.attention_received`); the draft stream keeps all text tokens
and the `vtc_keep` share of media tokens with the highest scores (all images and frames ranked together), in
order, at contiguous draft positions. The cross-attention memory keeps every target feature. The target is never
touched, so VTC changes speed only. Training builds the same stream from the scores stored with each example
(`FeatureExample.received`; training/dream.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from mmspec_ray.drafters.base import register_drafter
from mmspec_ray.drafters.eagle import Eagle2Config, Eagle2Drafter, Eagle2Head
from mmspec_ray.drafters.layers import DecoderLayer, RMSNorm
from mmspec_ray.decoding.tree import TreeConfig, TreeSteps

if TYPE_CHECKING:
    from mmspec_ray.targets.base import TargetOutput, VLMTarget


class DreamConfig(Eagle2Config):
    """EAGLE-2's sizes (the target's width, heads and FFN) plus the VTC share and the intermediate-loss tap."""

    method: str = "dream"
    # share of visual tokens the draft stream keeps (paper default 75 %), in training and drafting alike; 1.0: no VTC
    vtc_keep: float = 0.75
    # which draft feature the intermediate loss supervises (training only): block1, the initial block's output (the
    # paper's E^1), or ca_block, the cross-attention block's output (the authors' released training code)
    intermed_tap: Literal["block1", "ca_block"] = "block1"
    # initial value of the cross-attention block's tanh gates (attention and MLP), read at initialisation only. The
    # authors' code starts them at 0 (the block starts as the identity), but at 0 the block's projections get exactly
    # zero gradient and on the toy schedule the gates never open, so the block goes unused; 1.0 (tanh 0.76) trains
    # it from the first step (docs/drafters/dream.md, "Opening the gates").
    gate_init: float = 1.0
    # the zero "null" memory slot: True (heads trained here), every query may attend it; False (the authors'
    # released heads, trained without one): only a query that sees no target feature (the prompt's first) reads it
    null_slot: bool = True


def compress_visual(media: torch.Tensor, scores: torch.Tensor, keep: float) -> torch.Tensor:
    """[n] bool: every text position, and the round(keep x v) media positions (of v) with the highest `scores`
    (ties: the earlier position), at least one when there is any media and keep > 0."""
    out = ~media.bool()
    idx = torch.nonzero(media).flatten()
    v = idx.numel()
    if v == 0:
        return out
    k = min(v, max(1 if keep > 0 else 0, int(round(keep * v))))
    order = torch.sort(-scores[idx].float(), stable=True).indices[:k]
    out[idx[order]] = True
    return out


def stream_memory_mask(orig: torch.Tensor, mem_len: int, null_slot: bool = True) -> torch.Tensor:
    """[T, mem_len] bool: which memory slots (0: null, 1 + p: the target feature at position p) the stream entries
    at original positions `orig` [T] may attend: the null slot and the features before their own position (the
    null slot only at position 0 when `null_slot` is off). One rule for drafting and training."""
    cross = torch.arange(mem_len, device=orig.device)[None] <= orig[:, None]
    if not null_slot:
        cross[:, 0] = orig == 0
    return cross


class CrossAttention(nn.Module):
    """The DREAM cross-attention block: gated attention of the stream over a feature memory, then a gated MLP."""

    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int, eps: float, gate_init: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.input_norm = RMSNorm(dim, eps)
        self.q_proj = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)
        self.attn_gate = nn.Parameter(torch.full((1,), float(gate_init)))
        self.mlp_gate = nn.Parameter(torch.full((1,), float(gate_init)))
        self.post_norm = RMSNorm(dim, eps)
        self.gate_proj = nn.Linear(dim, ffn, bias=False)
        self.up_proj = nn.Linear(dim, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, dim, bias=False)

    def memory(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (after k_norm) and values [B, kv_heads, M, head_dim] of memory features [B, M, d]."""
        B, M, _ = feats.shape
        k = self.k_norm(self.k_proj(feats).view(B, M, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(feats).view(B, M, self.kv_heads, self.head_dim).transpose(1, 2)
        return k, v

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, d]; k, v [B, kv_heads, M, hd]; mask [B, 1, T, M] bool (True: may attend) -> [B, T, d]."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(self.input_norm(x)).view(B, T, self.heads, self.head_dim)).transpose(1, 2)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        x = x + torch.tanh(self.attn_gate).to(x.dtype) * self.o_proj(att.transpose(1, 2).reshape(B, T, -1))
        h = self.post_norm(x)
        return x + torch.tanh(self.mlp_gate).to(x.dtype) * self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DreamHead(Eagle2Head):
    """Block 1 (self-attention, no input norm), the cross-attention block, block 3, final norm. Embeddings and LM
    head are the target's, passed in, never saved. (Subclasses Eagle2Head for save / load only: no fc, no layer.)"""

    config_class = DreamConfig

    def __init__(self, cfg: DreamConfig) -> None:
        nn.Module.__init__(self)
        self.cfg = cfg
        d, h, kv, ffn = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
        self.block1 = DecoderLayer(d, h, kv, ffn, cfg.rope_theta, cfg.rms_eps, input_norm=False)
        self.cross = CrossAttention(d, h, kv, ffn, cfg.rms_eps, cfg.gate_init)
        self.block3 = DecoderLayer(d, h, kv, ffn, cfg.rope_theta, cfg.rms_eps, input_norm=True)
        self.norm = RMSNorm(d, cfg.rms_eps)

    def forward(self, embeds: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, mem_k: torch.Tensor,
                mem_v: torch.Tensor, cross_mask: torch.Tensor,
                kv: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
                at: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """embeds [B, T, d]; pos [B, T]; mask [B, 1, T, at+T] (self-attention); mem_k / mem_v from
        `cross.memory`; cross_mask [B, 1, T, M]; kv: (block-1, block-3) KV buffers written at [at, at+T) (see
        DecoderLayer). -> (final feature [B, T, d] after the norm, block-1 output, cross-attention block output)."""
        kv1, kv3 = kv if kv is not None else (None, None)
        e1 = self.block1(embeds, pos, mask, kv1, at)
        f = self.cross(e1, mem_k, mem_v, cross_mask)
        return self.norm(self.block3(f, pos, mask, kv3, at)), e1, f


@register_drafter("dream")
class DreamDrafter(Eagle2Drafter):
    """Per-request DREAM drafting state: the stream's self-attention KV (blocks 1 and 3), the cross-attention memory
    K/V (null slot + one target feature per original position before the current root), EAGLE-2 tree growth."""

    head_class = DreamHead

    def __init__(self, head: DreamHead, target: "VLMTarget") -> None:
        super().__init__(head, target)
        self.kv3: tuple[torch.Tensor, torch.Tensor] | None = None
        self.mem: tuple[torch.Tensor, torch.Tensor] | None = None  # cross-attention K/V [1, kv_heads, cap, hd]
        self.mem_len = 0  # slot 0: null; slot 1 + p: target feature at original position p (p < root's)
        self.root_pos = 0  # original position of the stream's newest entry (the current root)

    @property
    def prefill_attention(self) -> bool:
        """Whether the engine asks the target's prefill for `attention_received` (VTC on: vtc_keep < 1)."""
        return self.head.cfg.vtc_keep < 1.0

    @classmethod
    def random(cls, target: "VLMTarget", seed: int = 0, std: float = 0.02) -> "DreamDrafter":
        """An untrained drafter whose gates are open too (random, not 0), so every block changes the output."""
        d = super().random(target, seed, std)
        with torch.no_grad():
            d.head.cross.attn_gate.fill_(0.5)
            d.head.cross.mlp_gate.fill_(0.5)
        return d

    # ---------- lifecycle ----------
    @torch.inference_mode()
    def begin(self, target: "VLMTarget", prefill: "TargetOutput", root: int) -> None:
        """Memory = every prompt feature; stream = the kept prompt entries (VTC) + the root, draft positions
        0 .. n'-1."""
        self.ctx_len, self.mem_len, self.last = 0, 0, None
        embeds, feats = prefill.inputs_embeds[0], prefill.hidden[0]
        n = embeds.shape[0]
        keep = self.kept_positions(prefill)
        self._remember(torch.cat([feats.new_zeros(1, feats.shape[1]), feats], 0))
        self.root_pos = n
        orig = torch.cat([torch.nonzero(keep).flatten(), torch.tensor([n], device=keep.device)])
        self._extend_stream(torch.cat([embeds[keep], self._embed([root])], 0), orig)
        self.prefill_tokens = self.ctx_len

    def kept_positions(self, prefill: "TargetOutput") -> torch.Tensor:
        """[n] bool: the prompt positions the draft stream reads (all of them without media or with vtc_keep 1)."""
        n, keep = prefill.inputs_embeds.shape[1], self.head.cfg.vtc_keep
        dev = prefill.inputs_embeds.device
        if prefill.media_mask is None or keep >= 1.0 or not bool(prefill.media_mask.any()):
            return torch.ones(n, dtype=torch.bool, device=dev)
        if prefill.attention_received is None:
            raise ValueError("DREAM's visual token compression needs the target's attention at prefill "
                             "(prefill(attention=True)); the engine asks for it when the drafter's "
                             "prefill_attention is set")
        return compress_visual(prefill.media_mask[0].to(dev), prefill.attention_received[0].to(dev), keep)

    @torch.inference_mode()
    def observe(self, tokens: list[int], hidden: torch.Tensor, bonus: int) -> None:
        """Memory += the target's features at root .. last accepted; stream += accepted tokens after the root and
        the bonus, each seeing the features before its own position."""
        self._remember(hidden.to(self.target.dtype))
        orig = self.root_pos + 1 + torch.arange(len(tokens), device=self.target.device)
        self._extend_stream(self._embed(tokens[1:] + [bonus]), orig)
        self.root_pos += len(tokens)

    def _propose_setup(self, cfg: TreeConfig) -> None:
        """EAGLE-2's scratch slots (both self-attention caches), and memory slots for the tree: slot M (after the
        committed memory) holds the root's draft feature, every node's ancestor; each level's features follow."""
        super()._propose_setup(cfg)
        self._reserve_memory(self.mem_len + 1 + cfg.top_k * cfg.depth)
        self._write_memory(self.last, self.mem_len)

    def _tree_step(self, tokens: torch.Tensor, parents: torch.Tensor, tree: TreeSteps) -> torch.Tensor:
        """One tree level: a node reads the committed memory, the root's draft feature and its strict ancestors'
        (the tree mask inside the cross-attention); its own draft feature joins the memory for its children."""
        S, M, dev = tree.context, self.mem_len, self.target.device
        n_prev, levels, mask, new = tree.add(parents)
        seen = new[:, :n_prev]  # strict ancestors among the expanded nodes
        cross = torch.cat([torch.ones((tokens.shape[0], M + 1), dtype=torch.bool, device=dev), seen], 1)
        cross[:, 0] = self.head.cfg.null_slot  # (every tree node sees the root's features)
        n_mem = M + 1 + n_prev
        pos = torch.tensor([[S - 1 + lv + self.pos_offset for lv in levels]], device=dev)
        out, _, _ = self.head(self._embed(tokens.tolist())[None], pos, mask[None, None],
                              self.mem[0][:, :, :n_mem], self.mem[1][:, :, :n_mem], cross[None, None],
                              (self.kv, self.kv3), S + n_prev)  # scratch slots, overwritten next cycle
        self._write_memory(out[0], n_mem)  # these nodes' features, for their children
        return out[0]

    # ---------- internals ----------
    def _reserve(self, n: int) -> None:
        """Both self-attention caches (blocks 1 and 3) hold at least n slots."""
        kv1, self.kv = self.kv, self.kv3
        super()._reserve(n)
        self.kv3, self.kv = self.kv, kv1
        super()._reserve(n)

    def _reserve_memory(self, n: int) -> None:
        """The cross-attention K/V buffers hold at least n slots (grown by doubling, committed slots copied)."""
        self.mem = self._grown(self.mem, n, self.mem_len)

    def _write_memory(self, feats: torch.Tensor, at: int) -> None:
        """Project features [T, d] into memory slots [at, at+T)."""
        k, v = self.head.cross.memory(feats[None])
        self.mem[0][:, :, at:at + k.shape[2]] = k
        self.mem[1][:, :, at:at + v.shape[2]] = v

    def _remember(self, feats: torch.Tensor) -> None:
        """Append committed memory entries (target features, [T, d])."""
        self._reserve_memory(self.mem_len + feats.shape[0])
        self._write_memory(feats, self.mem_len)
        self.mem_len += feats.shape[0]

    def _extend_stream(self, embeds: torch.Tensor, orig: torch.Tensor) -> None:
        """Run new stream entries (embeds [T, d] at original positions `orig` [T]) causally after the stream; the
        entry at original position p sees memory slots 0 .. p (null + features before p). Keep their KV."""
        S, mask, pos = self._after_context(embeds.shape[0])
        cross = stream_memory_mask(orig.to(self.target.device), self.mem_len, self.head.cfg.null_slot)
        out, _, _ = self.head(embeds[None], pos, mask, self.mem[0][:, :, :self.mem_len],
                              self.mem[1][:, :, :self.mem_len], cross[None, None], (self.kv, self.kv3), S)
        self.ctx_len = S + embeds.shape[0]
        self.last = out[0, -1:]
