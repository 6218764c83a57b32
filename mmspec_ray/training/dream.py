"""DREAM training pieces: entropy-adaptive intermediate-layer selection (at feature generation), the batch layout
(token stream queries, target-feature memory) and the three-term loss (spec §4).

Layer selection (spec §4.3, A2): per token, among the candidate decoder layers (the authors' window: layers
1 .. floor(0.4 L) - 2, 0-based), the one whose attention row has the lowest entropy (mean over heads); the stored
intermediate feature is that layer's output (the paper's s^{l*}, HF hidden_states[l* + 1]). Computed once per
example when its features are generated, from the target's own q/k (targets/attention.py). The draft feature it
supervises is block 1's output by default (the paper's E^1; `intermed_tap` ca_block: the authors' code's).

Visual token compression (spec §3): the loss cuts each sequence's draft stream as the drafter does at prefill, from
the prompt's last-layer attention stored with the example (`FeatureExample.received`): the same kept positions, at
stream positions 0 .. n'-1, each reading the uncut memory of target features before its own original position.
Examples stored without it (features made before it was) train on the whole stream, with a warning.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmspec_ray.drafters.dream import compress_visual, stream_memory_mask
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
    """Whole sequences, as stored: query i = embedding of token i, predicting the target's feature s_i (and the
    intermediate target at i); memory slot 0 = null, slot j + 1 = s_j (noised). Loss on answer positions i whose
    successor is inside the sequence (as EAGLE's collate). Also each prompt's VTC scores (`score`, `media`,
    `scored`: the example carries them), from which `dream_loss` cuts the draft stream at the head's `vtc_keep`."""
    T = max(examples[i].input_ids.shape[0] for i in idx)
    d = examples[idx[0]].hidden.shape[1]
    B = len(idx)
    emb, mem, tgt, mid = (torch.zeros(B, T, d) for _ in range(4))
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    valid = torch.zeros(B, T, dtype=torch.bool)
    media = torch.zeros(B, T, dtype=torch.bool)
    score = torch.zeros(B, T)
    scored = torch.zeros(B, dtype=torch.bool)
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
        if ex.media is not None:
            media[b, :ex.n_prompt] = ex.media[:ex.n_prompt]  # media sit in prompts only
        if ex.received is not None:
            score[b, :ex.n_prompt] = ex.received.float()
            scored[b] = True
    if noise > 0:
        mem[:, 1:] = mem[:, 1:] + (torch.rand(mem[:, 1:].shape, generator=gen) - 0.5) * noise
    return {"emb": emb, "mem": mem, "tgt": tgt, "mid": mid, "loss_mask": loss_mask, "valid": valid, "media": media,
            "score": score, "scored": scored}


def draft_stream(batch: dict[str, torch.Tensor], keep: float, null_slot: bool = True) -> dict[str, torch.Tensor]:
    """The batch as the drafter reads it (`DreamDrafter.begin` / `observe`): per sequence the kept positions in
    order (every text and answer position, the `keep` share of the prompt's media by its stored score:
    `compress_visual`, the drafter's own rule; all of them where no score is stored or `keep` >= 1) at stream
    positions 0 .. n'-1; queries (emb, tgt, mid, loss_mask, valid) gathered to them, `orig` their original
    positions, `cross` [B, 1, T', M] the memory slots each may attend (`stream_memory_mask`). The memory itself is
    never cut."""
    valid = batch["valid"]
    B, T = valid.shape
    kept = valid.clone()
    if keep < 1.0 and "scored" in batch:
        for b in range(B):
            if bool(batch["scored"][b]) and bool(batch["media"][b].any()):
                n = int(valid[b].sum())
                kept[b, :n] = compress_visual(batch["media"][b, :n], batch["score"][b, :n], keep)
    counts = kept.sum(1)
    Tk = int(counts.max())
    # kept positions first, in their original order (a stable sort of "dropped or padding")
    orig = torch.sort((~kept).to(torch.uint8), dim=1, stable=True).indices[:, :Tk]
    live = torch.arange(Tk, device=valid.device)[None] < counts[:, None]
    orig = torch.where(live, orig, torch.zeros_like(orig))  # padding queries: position 0 (they read the null slot)
    out = {k: torch.gather(batch[k], 1, orig[..., None].expand(-1, -1, batch[k].shape[2]))
           for k in ("emb", "tgt", "mid")}
    out["loss_mask"] = torch.gather(batch["loss_mask"], 1, orig) & live
    out["valid"] = live
    out["orig"] = orig
    M = batch["mem"].shape[1]
    out["cross"] = torch.stack([stream_memory_mask(orig[b], M, null_slot) for b in range(B)])[:, None]
    return out


def dream_forward(head, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor,
                                                                   torch.Tensor]:
    """(the draft stream (`draft_stream` at the head's `vtc_keep`), its final features [B, T', d], the tapped
    intermediate features [B, T', d]: block 1's output, or the cross-attention block's for `intermed_tap`
    ca_block): one teacher-forced forward, stream positions 0 .. n'-1 as when drafting."""
    cfg = head.cfg
    s = draft_stream(batch, cfg.vtc_keep, cfg.null_slot)
    B, T, _ = s["emb"].shape
    pos = torch.arange(T, device=s["emb"].device)[None].expand(B, -1)
    k, v = head.cross.memory(batch["mem"])
    out, e1, f = head(s["emb"], pos, causal_pad_mask(s["valid"]), k, v, s["cross"])
    return s, out, f if cfg.intermed_tap == "ca_block" else e1


def dream_loss(head, batch: dict[str, torch.Tensor], lm_head_weight: torch.Tensor, w_feat: float = 0.2,
               w_mid: float = 0.2, w_kl: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
    """w_feat smooth-L1(final feature, s) + w_mid smooth-L1(tapped draft feature, intermediate target) + w_kl
    KL(target || draft) of the next-token distributions, each a mean over the masked positions (smooth-L1 a mean
    over d, the KL a sum over the vocabulary: the paper's per-token KL). The stream is cut as the drafter cuts it
    at the head's `vtc_keep` (`draft_stream`); the tap is the head's `intermed_tap`."""
    s, out, tap = dream_forward(head, batch)
    m = s["loss_mask"].float()
    denom = m.sum().clamp_min(1.0)

    def smooth(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (F.smooth_l1_loss(x.float(), y.float(), reduction="none").mean(-1) * m).sum() / denom

    feat, mid = smooth(out, s["tgt"]), smooth(tap, s["mid"])
    with torch.no_grad():
        logp_t = torch.log_softmax(s["tgt"].float() @ lm_head_weight.float().T, -1)
    logq = torch.log_softmax(out.float() @ lm_head_weight.float().T, -1)
    kl = ((logp_t.exp() * (logp_t - logq)).sum(-1) * m).sum() / denom
    with torch.no_grad():
        top1 = float(((logq.argmax(-1) == logp_t.argmax(-1)).float() * m).sum() / denom)
    loss = w_feat * feat + (w_mid * mid if w_mid else 0.0) + w_kl * kl
    return loss, {"vloss": float(feat.detach()), "midloss": float(mid.detach()), "ploss": float(kl.detach()),
                  "top1": top1}
