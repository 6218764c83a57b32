"""ViSpec training forward and loss: each example's compressed drafter sequence (`ViSpecHead.sequence`, the very
function the drafter's prefill runs), one batched decoder-layer pass, outputs scattered back to entry positions,
and the chosen objective on the answer entries (`objective_loss`; by default the paper's soft CE). Stage 2 adds the
multi-token-prediction passes (spec §4.3): pass m feeds entry j the drafter's own pass m-1 prediction of f_j (made
at entry j-1) instead of the target's f_j, with the same token embeddings and media, gradients through every pass,
equal weights."""

from __future__ import annotations

from typing import Literal, get_args

import torch

from mmspec_ray.drafters.layers import causal_pad_mask
from mmspec_ray.drafters.vispec import ViSpecHead
from mmspec_ray.training.losses import distribution_terms, eagle_loss

Objective = Literal["paper", "eagle", "l1_rank"]
OBJECTIVES: tuple[str, ...] = get_args(Objective)
L1_WEIGHT = 10.0  # the authors' code: weight of sum_v |p_draft - p| in stage 2
RANK_WEIGHT = 0.1  # ... and of the Plackett-Luce top-10 ranking (stage 2; inside the CE bracket in stage 1)


def vispec_forward(head: ViSpecHead, emb: torch.Tensor, feat: torch.Tensor, valid: torch.Tensor,
                   spans: list[list[tuple[int, int]]]) -> torch.Tensor:
    """emb, feat [B, T, d] (entry j: embedding of token j+1, feature f_j), valid [B, T], spans: each example's
    media entry ranges -> predicted features [B, T, d] at entry positions (zeros where no drafter row sits)."""
    B, T, d = emb.shape
    seqs = [head.sequence(emb[b, :int(valid[b].sum())], feat[b, :int(valid[b].sum())], spans[b]) for b in range(B)]
    S = max(x.shape[0] for x, _, _ in seqs)
    x = emb.new_zeros(B, S, d)
    pos = torch.zeros(B, S, dtype=torch.long, device=emb.device)
    ok = torch.zeros(B, S, dtype=torch.bool, device=emb.device)
    for b, (xb, pb, _) in enumerate(seqs):
        x[b, :xb.shape[0]], pos[b, :pb.shape[0]], ok[b, :xb.shape[0]] = xb, pb, True
    out = head.layer(x, pos, causal_pad_mask(ok))
    pred = emb.new_zeros(B, T, d)
    for b, (xb, pb, _) in enumerate(seqs):  # compressed rows sit at their piece's last entries; a text row at its own
        pred[b] = pred[b].index_put((pb,), out[b, :xb.shape[0]])
    return pred


def objective_loss(objective: Objective, stage2: bool, pred: torch.Tensor, tgt: torch.Tensor,
                   lm_head_weight: torch.Tensor, mask: torch.Tensor, p_weight: float
                   ) -> tuple[torch.Tensor, dict[str, float]]:
    """One pass's loss under `objective` in stage 1 (text-only EAGLE pre-training) or stage 2, and its parts.
    paper: stage 2 the soft CE alone (Eq. 6), stage 1 EAGLE's loss (every drafter's text foundation); eagle: EAGLE's
    loss in both; l1_rank (the authors' code): stage 2 10 x L1(p_draft, p) + 0.1 x rank, stage 1 smooth-L1 +
    p_weight x (CE + 0.1 x rank). Every objective reports vloss, ploss and top1, so runs compare term by term."""
    if objective == "eagle" or (objective == "paper" and not stage2):
        return eagle_loss(pred, tgt, lm_head_weight, mask, p_weight=p_weight)
    t = distribution_terms(pred, tgt, lm_head_weight, mask, l1_rank=objective == "l1_rank")
    if objective == "paper":
        loss = t["ploss"]
    elif stage2:
        loss = L1_WEIGHT * t["l1"] + RANK_WEIGHT * t["rank"]
    else:
        loss = t["vloss"] + p_weight * (t["ploss"] + RANK_WEIGHT * t["rank"])
    return loss, {k: float(v.detach()) for k, v in t.items()}


def vispec_loss(head: ViSpecHead, batch: dict, lm_head_weight: torch.Tensor, p_weight: float, mtp_steps: int,
                objective: Objective = "paper", stage2: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean over passes 0..mtp_steps of `objective_loss` on answer entries (equal weights, gradients through every
    pass); the parts also carry `objective_<name>` = 1.0, so a run's history says which objective trained it."""
    emb, feat, valid = batch["emb"], batch["feat"], batch["valid"]
    total = torch.zeros((), device=emb.device)
    parts: dict[str, float] = {f"objective_{objective}": 1.0}
    n = mtp_steps + 1
    for m in range(n):
        pred = vispec_forward(head, emb, feat, valid, batch["spans"])
        loss, p = objective_loss(objective, stage2, pred, batch["tgt"], lm_head_weight, batch["loss_mask"], p_weight)
        total = total + loss / n
        for k, v in p.items():
            parts[k] = parts.get(k, 0.0) + v / n
            if n > 1:
                parts[f"{k}_pass{m}"] = v
        feat = torch.cat([feat[:, :1], pred[:, :-1]], 1)  # pass m+1: entry j reads the prediction of f_j
    return total, parts
