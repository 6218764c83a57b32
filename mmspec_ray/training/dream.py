"""DREAM training pieces: entropy-adaptive intermediate-layer selection (at feature generation), the batch layout
(token stream queries, target-feature memory) and the three-term loss (spec §4).

Layer selection (spec §4.3, A2): per token, among the candidate decoder layers (the authors' window: layers
1 .. floor(0.4 L) - 2, 0-based), the one whose attention row has the lowest entropy (mean over heads); the stored
intermediate feature is that layer's output (the paper's s^{l*}, HF hidden_states[l* + 1]). Computed once per
example when its features are generated, from the target's own q/k (targets/attention.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmspec_ray.drafters.layers import causal_pad_mask
from mmspec_ray.training.shards import FeatureExample


def entropy_candidates(num_layers: int) -> tuple[int, ...]:
    """0-based decoder layers searched for the intermediate target: 1 .. floor(0.4 L) - 2 (the authors' code), at
    least layer 1 (or 0 for a one-layer model)."""
    hi = max(2, int(0.4 * num_layers) - 1)
    return tuple(range(1, min(hi, num_layers))) or (0,)


def select_layers(entropy: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    """[n] long: per position, the layer of `layers` whose entropy ([len(layers), n]) is lowest (ties: the first)."""
    return torch.tensor(layers, device=entropy.device)[entropy.argmin(0)]


def intermediate_features(entropy: dict[int, torch.Tensor], outputs: dict[int, torch.Tensor]) -> tuple[torch.Tensor,
                                                                                                       torch.Tensor]:
    """(features [n, d], chosen layer [n]): per position, the output of its lowest-entropy layer. `entropy`:
    {layer: [n]}; `outputs`: {layer: [n, d]} that layer's output hidden states."""
    layers = tuple(sorted(entropy))
    chosen = select_layers(torch.stack([entropy[i] for i in layers]), layers)
    stacked = torch.stack([outputs[i] for i in layers])  # [C, n, d]
    which = torch.searchsorted(torch.tensor(layers, device=chosen.device), chosen)
    return stacked[which, torch.arange(chosen.shape[0], device=chosen.device)], chosen


def dream_collate(examples: list[FeatureExample], idx: list[int], noise: float,
                  gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Query i = embedding of token i, predicting the target's feature s_i (and the intermediate target at i);
    memory slot 0 = null, slot j + 1 = s_j (noised); query i sees slots 0 .. i. Loss on answer positions i whose
    successor is inside the sequence (as EAGLE's collate)."""
    T = max(examples[i].input_ids.shape[0] for i in idx)
    d = examples[idx[0]].hidden.shape[1]
    B = len(idx)
    emb, mem, tgt, mid = (torch.zeros(B, T, d) for _ in range(4))
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b, i in enumerate(idx):
        ex = examples[i]
        n = ex.input_ids.shape[0]
        emb[b, :n] = ex.embeds.float()
        mem[b, 1:n] = ex.hidden[:-1].float()
        tgt[b, :n] = ex.hidden.float()
        if ex.mid is not None:
            mid[b, :n] = ex.mid.float()
        valid[b, :n] = True
        loss_mask[b, ex.n_prompt: max(ex.n_prompt, n - 1)] = True
    if noise > 0:
        mem[:, 1:] = mem[:, 1:] + (torch.rand(mem[:, 1:].shape, generator=gen) - 0.5) * noise
    return {"emb": emb, "mem": mem, "tgt": tgt, "mid": mid, "loss_mask": loss_mask, "valid": valid}


def dream_loss(head, batch: dict[str, torch.Tensor], lm_head_weight: torch.Tensor, w_feat: float = 0.2,
               w_mid: float = 0.2, w_kl: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
    """w_feat smooth-L1(final feature, s) + w_mid smooth-L1(tapped draft feature, intermediate target) + w_kl
    KL(target || draft) of the next-token distributions, each a mean over the masked positions (smooth-L1 a mean
    over d, the KL a sum over the vocabulary: the paper's per-token KL)."""
    emb, valid = batch["emb"], batch["valid"]
    B, T, _ = emb.shape
    pos = torch.arange(T, device=emb.device)[None].expand(B, -1)
    k, v = head.cross.memory(batch["mem"])
    cross = torch.ones(T, T, dtype=torch.bool, device=emb.device).tril()[None, None].expand(B, 1, T, T)
    out, e1, f = head(emb, pos, causal_pad_mask(valid), k, v, cross)
    tap = f if head.cfg.intermed_tap == "ca_block" else e1
    m = batch["loss_mask"].float()
    denom = m.sum().clamp_min(1.0)

    def smooth(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (F.smooth_l1_loss(x.float(), y.float(), reduction="none").mean(-1) * m).sum() / denom

    feat, mid = smooth(out, batch["tgt"]), smooth(tap, batch["mid"])
    with torch.no_grad():
        logp_t = torch.log_softmax(batch["tgt"].float() @ lm_head_weight.float().T, -1)
    logq = torch.log_softmax(out.float() @ lm_head_weight.float().T, -1)
    kl = ((logp_t.exp() * (logp_t - logq)).sum(-1) * m).sum() / denom
    with torch.no_grad():
        top1 = float(((logq.argmax(-1) == logp_t.argmax(-1)).float() * m).sum() / denom)
    loss = w_feat * feat + (w_mid * mid if w_mid else 0.0) + w_kl * kl
    return loss, {"vloss": float(feat.detach()), "midloss": float(mid.detach()), "ploss": float(kl.detach()),
                  "top1": top1}
