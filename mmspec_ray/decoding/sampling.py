"""Logit warping (temperature, top-k, top-p, min-p) and seeded sampling, shared by every decoder so they agree
exactly."""

from __future__ import annotations

import torch

from mmspec_ray.config import SamplingParams


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities over the last axis after temperature, then top-k, then top-p, then min-p (HF's order).

    Greedy (temperature 0) gives a one-hot at the argmax, so acceptance code can treat both modes alike.
    Temperature divides the logits minus their max (the same softmax), so a tiny temperature (1e-40, which
    overflows `logits / T` to inf and the softmax to nan, in HF too) gives its limit: all mass on the argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    top = logits.max(-1, keepdim=True).values
    logits = torch.where(logits == top, 0.0, (logits - top) / params.temperature)  # 0 / T: no 0/0 when T -> 0
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p is not None and params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
        drop_sorted = before >= params.top_p  # keep the smallest prefix whose mass reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if params.min_p:  # HF's MinPLogitsWarper: keep tokens with at least min_p x the top probability
        probs = probs.masked_fill(probs < params.min_p * probs.max(-1, keepdim=True).values, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if params.seed is not None:
        g.manual_seed(params.seed)
    else:
        g.seed()
    return g


def uniform(generator: torch.Generator) -> float:
    """One U[0, 1) draw from `generator`, made on the generator's device (only the scalar leaves it)."""
    return float(torch.rand((), generator=generator, device=generator.device))


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token id from a 1-D vector of non-negative weights (normalised or not), drawn on its device."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Next token from 1-D logits: argmax when greedy, else a warped sample."""
    if params.greedy:
        return int(logits.argmax().item())
    return sample(warp(logits, params), generator)
