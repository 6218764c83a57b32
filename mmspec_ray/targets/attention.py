"""Attention statistics of chosen target decoder layers in one forward, whatever the attention kernel.

HF's fused kernels (sdpa, flash) return no attention weights. `probe_attention` wraps the attention function the
decoder layers call (the model's `AttentionInterface` entry, once per process, recording only for the probe active in
the calling thread, so two decoders in one process never see each other's records) and records, for the tracked
layers only, the queries and keys exactly as the kernel receives them (after every family's own RoPE / M-RoPE and
q/k norms), with the mask and scaling; the kernel itself still computes the layer's output, so the forward is unchanged bit for bit. An eager
model returns its weights, which a forward hook reads instead. `reduce_attention` then rebuilds the probabilities
in query chunks (never the whole [H, n, n] at once) and reduces them: the attention each key position receives
from chosen query rows (DREAM's visual token compression) and each query row's entropy (DREAM's layer selection).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

ENTROPY_EPS = 1e-8  # inside the log of the row entropy, as the authors' code


@dataclass
class LayerAttention:
    """One layer's attention inputs (q [B, H, n, hd], k [B, Hkv, n, hd], mask, scaling) or its probabilities."""

    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # bool (True: may attend) or additive float [B, 1|H, n, n]; None: causal
    scaling: float | None = None
    probs: torch.Tensor | None = None  # [B, H, n, n] when the model is eager


def decoder_attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of every decoder layer of the model's language model, in order."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (get_decoder().layers)")
    return [layer.self_attn for layer in layers]


@contextmanager
def probe_attention(model: nn.Module, layers: Iterable[int]) -> Iterator[dict[int, LayerAttention]]:
    """Within the block, each forward of `model` records {layer index: LayerAttention} for `layers` (the last
    forward wins). The model's outputs are untouched."""
    mods = decoder_attention_modules(model)
    wanted = sorted(set(int(i) % len(mods) for i in layers))
    records: dict[int, LayerAttention] = {}
    if not wanted:
        yield records
        return
    impl = getattr(mods[wanted[0]].config, "_attn_implementation", None) or "eager"
    if impl == "eager":
        hooks = [mods[i].register_forward_hook(
            lambda mod, args, out, i=i: records.__setitem__(i, LayerAttention(probs=out[1].detach())))
            for i in wanted]
        try:
            yield records
        finally:
            for h in hooks:
                h.remove()
        return
    _install_recorder(impl)
    token = _ACTIVE.set(({id(mods[i]): i for i in wanted}, records))
    try:
        yield records
    finally:
        _ACTIVE.reset(token)


# The probe of this thread (or task), if any: (id of a tracked attention module -> its layer, the records). The
# recording wrapper is installed once per attention implementation and left in place; it records only for the
# probe active in the calling context, so decoders in other threads are neither recorded nor disturbed.
_ACTIVE: ContextVar[tuple[dict[int, int], dict[int, LayerAttention]] | None] = ContextVar("mmspec_attention_probe",
                                                                                          default=None)
_INSTALLED: set[str] = set()
_INSTALL_LOCK = threading.Lock()


def _install_recorder(impl: str) -> None:
    """Wrap the `impl` attention function (transformers' AttentionInterface entry) with the recorder, once."""
    with _INSTALL_LOCK:
        if impl in _INSTALLED:
            return
        mapping = ALL_ATTENTION_FUNCTIONS._local_mapping if impl in ALL_ATTENTION_FUNCTIONS._local_mapping \
            else type(ALL_ATTENTION_FUNCTIONS)._global_mapping
        original = mapping[impl]

        def recording(module, query, key, value, attention_mask, *args, **kwargs):
            probe = _ACTIVE.get()
            if probe is not None:
                i = probe[0].get(id(module))
                if i is not None:
                    probe[1][i] = LayerAttention(q=query.detach(), k=key.detach(), mask=attention_mask,
                                                 scaling=kwargs.get("scaling"))
            return original(module, query, key, value, attention_mask, *args, **kwargs)

        mapping[impl] = recording
        _INSTALLED.add(impl)


def _chunk_probs(rec: LayerAttention, lo: int, hi: int) -> torch.Tensor:
    """Attention probabilities [H, hi-lo, n] (float32) of query rows lo..hi-1 of batch row 0."""
    if rec.probs is not None:
        return rec.probs[0, :, lo:hi].float()
    q, k = rec.q[0, :, lo:hi].float(), rec.k[0].float()
    if k.shape[0] != q.shape[0]:
        k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
    n_k = k.shape[1]
    scale = rec.scaling if rec.scaling is not None else q.shape[-1] ** -0.5
    logits = q @ k.transpose(-1, -2) * scale
    if rec.mask is None:  # the kernel's causal path (queries aligned to the last keys)
        qpos = torch.arange(lo, hi, device=q.device)[:, None] + (n_k - rec.q.shape[2])
        logits = logits.masked_fill(torch.arange(n_k, device=q.device)[None] > qpos, float("-inf"))
    else:
        m = rec.mask[0, :, lo:hi, :n_k]
        logits = logits.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else logits + m.float()
    return torch.softmax(logits, dim=-1)


def reduce_attention(rec: LayerAttention, query_weights: torch.Tensor | None = None,
                     chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """(received [n_k]: sum over query rows i of w_i x mean over heads of A[h, i, j], with `query_weights` w [n]
    (default: uniform 1/n); entropy [n]: mean over heads of -sum_j A[h, i, j] log(A[h, i, j] + eps) per row)."""
    n = rec.probs.shape[2] if rec.probs is not None else rec.q.shape[2]
    n_k = rec.probs.shape[3] if rec.probs is not None else rec.k.shape[2]
    dev = rec.probs.device if rec.probs is not None else rec.q.device
    w = torch.full((n,), 1.0 / n, device=dev) if query_weights is None else query_weights.to(dev).float()
    received = torch.zeros(n_k, device=dev)
    entropy = torch.zeros(n, device=dev)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        p = _chunk_probs(rec, lo, hi)
        entropy[lo:hi] = -(p * torch.log(p + ENTROPY_EPS)).sum(-1).mean(0)
        received += (p.mean(0) * w[lo:hi, None]).sum(0)
    return received, entropy
