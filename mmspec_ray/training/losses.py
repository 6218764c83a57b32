"""EAGLE losses: smooth-L1 regression onto the target's next feature + soft cross-entropy through the target's
frozen LM head (the drafter's token distribution should match the target's), masked to answer positions."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def eagle_loss(pred: torch.Tensor, target_feat: torch.Tensor, lm_head_weight: torch.Tensor, mask: torch.Tensor,
               v_weight: float = 1.0, p_weight: float = 0.1, k_weight: float = 0.0,
               k: int = 10) -> tuple[torch.Tensor, dict[str, float]]:
    """pred, target_feat [B, T, d]; lm_head_weight [V, d]; mask [B, T] bool. Returns (loss, parts for logging).
    `k_weight` > 0 adds HASS's top-K distillation term (HiViS stage 2): -sum over the target's top-k tokens of
    p_target * log p_draft, not renormalised, with the same reduction as the other two terms."""
    m = mask.float()
    denom = m.sum().clamp_min(1.0)
    vloss = (F.smooth_l1_loss(pred.float(), target_feat.float(), reduction="none").mean(-1) * m).sum() / denom
    with torch.no_grad():
        p_target = torch.softmax(target_feat.float() @ lm_head_weight.float().T, -1)
    logq = torch.log_softmax(pred.float() @ lm_head_weight.float().T, -1)
    ploss = (-(p_target * logq).sum(-1) * m).sum() / denom
    with torch.no_grad():
        acc = (((logq.argmax(-1) == p_target.argmax(-1)).float() * m).sum() / denom).item()
    loss = v_weight * vloss + p_weight * ploss
    parts = {"vloss": float(vloss.detach()), "ploss": float(ploss.detach()), "top1": acc}
    if k_weight > 0:
        top = torch.topk(p_target, min(k, p_target.shape[-1]), dim=-1)
        kloss = (-(top.values * logq.gather(-1, top.indices)).sum(-1) * m).sum() / denom
        loss = loss + k_weight * kloss
        parts["kloss"] = float(kloss.detach())
    return loss, parts
