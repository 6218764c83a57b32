"""Grow a trained toy target into a wider, deeper one that computes (almost) the same function.

Why: `toy-m` exists so that one AR step costs real model compute (>= 20 ms on a CPU) and speedups are not Python
overhead. Training a model that size from scratch takes many hours on 2 CPU cores, so `toy-m` is grown from the
trained `toy-s` instead (Net2Net / bert2BERT-style function-preserving growth), then perturbed:

- width x k: every residual dimension, attention head (query and key/value) and MLP neuron is repeated k times and
  the weights that read repeated inputs are divided by k, so every hidden state is the old one tiled k times
  (RMSNorm of a tiled vector equals the RMSNorm of the vector); the head size and RoPE are unchanged;
- depth x m: after every trained layer, m - 1 new layers with random attention / MLP inputs and near-zero output
  projections (they read the residual stream and add a small random update to it);
- a small relative noise on every grown weight, so no two rows are copies and the matmuls are dense, generic ones.

The result is a stock LlavaForConditionalGeneration of the new size, saved and loaded like any checkpoint; its
quality is measured by the same gate as toy-s (`mmspec toy gate --size toy-m`).
"""

from __future__ import annotations

import copy

import torch
from transformers import LlavaForConditionalGeneration


def _tile(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """w repeated `rows` times along dim 0 and `cols` times along dim 1 (a vector: along dim 0 only)."""
    return w.repeat(rows) if w.dim() == 1 else w.repeat(rows, cols)


@torch.no_grad()
def grow_llava(small: LlavaForConditionalGeneration, width: int, depth: int, *, noise: float = 0.01,
               new_layer_out_std: float = 1e-3, seed: int = 0) -> LlavaForConditionalGeneration:
    """A LLaVA whose text model is `width` times wider and `depth` times deeper than `small`'s (vision tower kept).

    `noise` is relative (to each weight tensor's RMS); `new_layer_out_std` is the std of the new layers' output
    projections (0 would make them exact no-ops).
    """
    g = torch.Generator().manual_seed(seed)
    k = width
    cfg = copy.deepcopy(small.config)
    t = cfg.text_config
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    t.head_dim = head_dim
    t.hidden_size *= k
    t.intermediate_size *= k
    t.num_attention_heads *= k
    t.num_key_value_heads *= k
    n_small = t.num_hidden_layers
    t.num_hidden_layers = n_small * depth
    if getattr(t, "layer_types", None):
        t.layer_types = [t.layer_types[0]] * t.num_hidden_layers
    big = LlavaForConditionalGeneration(cfg).eval()

    def put(dst: torch.Tensor, src: torch.Tensor) -> None:
        rms = src.float().pow(2).mean().sqrt().clamp_min(1e-8)
        dst.copy_(src + noise * rms * torch.randn(src.shape, generator=g))

    sm, bm = small.model, big.model
    bm.vision_tower.load_state_dict(sm.vision_tower.state_dict())
    sp, bp = sm.multi_modal_projector, bm.multi_modal_projector  # linear_1: vision -> text width, GELU, linear_2
    put(bp.linear_1.weight, _tile(sp.linear_1.weight, k, 1))
    put(bp.linear_1.bias, _tile(sp.linear_1.bias, k, 1))
    put(bp.linear_2.weight, _tile(sp.linear_2.weight, k, k) / k)
    put(bp.linear_2.bias, _tile(sp.linear_2.bias, k, 1))
    put(bm.language_model.embed_tokens.weight, _tile(sm.language_model.embed_tokens.weight, 1, k))
    bm.language_model.norm.weight.copy_(_tile(sm.language_model.norm.weight, k, 1))
    put(big.lm_head.weight, _tile(small.lm_head.weight, 1, k) / k)
    for i, layer in enumerate(bm.language_model.layers):
        if i % depth == 0:
            src = sm.language_model.layers[i // depth]
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                put(getattr(layer.self_attn, name).weight, _tile(getattr(src.self_attn, name).weight, k, k) / k)
            for name in ("gate_proj", "up_proj", "down_proj"):
                put(getattr(layer.mlp, name).weight, _tile(getattr(src.mlp, name).weight, k, k) / k)
            layer.input_layernorm.weight.copy_(_tile(src.input_layernorm.weight, k, 1))
            layer.post_attention_layernorm.weight.copy_(_tile(src.post_attention_layernorm.weight, k, 1))
        else:  # a new layer: random readers, near-zero writers
            for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
                w.copy_(new_layer_out_std * torch.randn(w.shape, generator=g))
    big.generation_config = copy.deepcopy(small.generation_config)
    return big
