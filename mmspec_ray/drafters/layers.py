"""Small transformer pieces for drafter heads: RMSNorm, rotary embeddings and one pre-norm decoder layer whose
KV is passed in and out explicitly, so drafters can attend to accepted context plus a tree of pending nodes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def mrope_axes(half: int, section: list[int], interleaved: bool = False) -> torch.Tensor:
    """[half] long: which M-RoPE axis (0 temporal, 1 height, 2 width) drives each rotary frequency. Chunked
    (Qwen2-VL / Qwen2.5-VL): consecutive blocks of `section` frequencies, axis = block index mod 3. Interleaved
    (Qwen3-VL): height at f % 3 == 1 below 3 x section[1], width at f % 3 == 2 below 3 x section[2], else temporal."""
    if sum(section) != half:
        raise ValueError(f"mrope_section {section} sums to {sum(section)}, not the head's {half} rotary frequencies")
    if interleaved:
        f = torch.arange(half)
        axes = torch.zeros(half, dtype=torch.long)
        axes[(f % 3 == 1) & (f < 3 * section[1])] = 1
        axes[(f % 3 == 2) & (f < 3 * section[2])] = 2
        return axes
    return torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(section)])


def rotary(x: torch.Tensor, pos: torch.Tensor, theta: float, axes: torch.Tensor | None = None) -> torch.Tensor:
    """Apply rotary position embedding (half-split convention). x [B, H, T, hd]; pos [B, T] long, or [3, B, T]
    M-RoPE position ids with `axes` ([hd/2], `mrope_axes`) naming the axis of each frequency. 1-D ids are M-RoPE
    ids with three equal axes, so [B, T] serves both kinds of head."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    if pos.dim() == 3:
        if axes is None:
            raise ValueError("3-axis position ids need the head's M-RoPE sections")
        ang = pos.to(torch.float32).permute(1, 2, 0)[..., axes][:, None] * inv  # [B, 1, T, hd/2]
    else:
        ang = pos.to(torch.float32)[:, None, :, None] * inv  # [B, 1, T, hd/2]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP. `input_norm=False` skips the attention input norm (EAGLE's first layer
    takes the fc output directly). `in_dim` (default dim): the width q/k/v read (EAGLE-3: 2 x dim);
    `head_dim` (default dim // heads); `qkv_bias`: q/k/v with a bias (Qwen2-style heads); `mrope`: (section,
    interleaved) for a head that takes 3-axis M-RoPE position ids (`mrope_axes`)."""

    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int, rope_theta: float = 10000.0,
                 eps: float = 1e-6, input_norm: bool = False, in_dim: int | None = None, head_dim: int | None = None,
                 qkv_bias: bool = False, mrope: tuple[list[int], bool] | None = None) -> None:
        super().__init__()
        if heads % kv_heads or (head_dim is None and dim % heads):
            raise ValueError(f"dim {dim}, heads {heads}, kv_heads {kv_heads}: heads must divide dim and kv_heads heads")
        self.heads, self.kv_heads, self.theta = heads, kv_heads, rope_theta
        self.head_dim = head_dim or dim // heads
        # moves with the layer's device (no copy per forward); not saved: it follows from the config
        self.register_buffer("axes", None if not mrope else mrope_axes(self.head_dim // 2, list(mrope[0]), mrope[1]),
                             persistent=False)
        in_dim = in_dim or dim
        self.input_norm = RMSNorm(dim, eps) if input_norm else nn.Identity()
        self.q_proj = nn.Linear(in_dim, heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(in_dim, kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(in_dim, kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.post_norm = RMSNorm(dim, eps)
        self.gate_proj = nn.Linear(dim, ffn, bias=False)
        self.up_proj = nn.Linear(dim, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None, at: int = 0) -> torch.Tensor:
        """x [B, T, d]; pos [B, T] (or [3, B, T] M-RoPE ids: `mrope`); mask [B, 1, T, at+T] bool (True = may attend).
        Without `kv` the T positions attend among themselves (training). With `kv` (preallocated buffers
        [B, kv_heads, capacity, head_dim]) the new keys/values are written in place at [at, at+T) and the
        positions attend to buffer slots [0, at+T): no copy of the existing KV per call."""
        return self.block(x, self.input_norm(x), pos, mask, kv, at)

    def block(self, residual: torch.Tensor, h: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
              kv: tuple[torch.Tensor, torch.Tensor] | None = None, at: int = 0) -> torch.Tensor:
        """Attention over `h` (what q/k/v read, [B, T, in_dim]) added to `residual` [B, T, d], then the MLP."""
        B, T, _ = h.shape
        q = self.q_proj(h).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotary(q, pos, self.theta, self.axes), rotary(k, pos, self.theta, self.axes)
        if kv is not None:
            kv[0][:, :, at:at + T] = k
            kv[1][:, :, at:at + T] = v
            k, v = kv[0][:, :, :at + T], kv[1][:, :, :at + T]
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        x = residual + self.o_proj(att.transpose(1, 2).reshape(B, T, -1))
        h = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def extend_mask(S: int, T: int, device: torch.device | str) -> torch.Tensor:
    """[1, 1, T, S + T] bool: T new entries appended after S context entries see all of the context and, causally,
    each other (how every drafter runs new entries after its cached context)."""
    mask = torch.ones((T, S + T), dtype=torch.bool, device=device)
    mask[:, S:] = torch.ones((T, T), dtype=torch.bool, device=device).tril()
    return mask[None, None]


def causal_pad_mask(valid: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool: causal, no attention to padding (padding rows attend to themselves to stay finite)."""
    T = valid.shape[1]
    m = torch.ones(T, T, dtype=torch.bool, device=valid.device).tril()[None] & valid[:, None, :]
    m |= torch.eye(T, dtype=torch.bool, device=valid.device)[None]
    return m[:, None]


def rms_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x [..., d] scaled to unit root-mean-square per row, no weights (computed in float32, returned in x's dtype).
    Drafters that feed the target's media embeddings in directly (MSD's raw visual entries, ViSpec's adaptor) use it:
    projector outputs can be hundreds of times the size of text embeddings (tiny LLaVA: 838 against 4), and then
    training diverges."""
    f = x.float()
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
