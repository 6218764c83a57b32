"""Drafter losses, masked to answer positions: EAGLE's (smooth-L1 regression onto the target's next feature + soft
cross-entropy through the target's frozen LM head, so the drafter's token distribution matches the target's), and
the terms other objectives combine (`distribution_terms`: the L1 distance between the two distributions and a
Plackett-Luce ranking of the target's top-k, which ViSpec's released heads were trained on)."""

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


def plackett_luce_rank(logits: torch.Tensor, p_target: torch.Tensor, k: int = 10) -> torch.Tensor:
    """Per position, the Plackett-Luce negative log-likelihood of the target's top-k order under the draft's logits
    (-sum_j [s_j - logsumexp(s_j..s_k)] over the target's k likeliest tokens, most likely first): it asks the
    draft to rank the target's candidates as the target does, which is what a top-k draft tree expands."""
    top = torch.topk(p_target, min(k, p_target.shape[-1]), dim=-1).indices  # sorted, most likely first
    s = logits.gather(-1, top)
    tail = torch.logcumsumexp(s.flip(-1), -1).flip(-1)  # logsumexp(s_j, ..., s_k) for every j
    return -(s - tail).sum(-1)


def distribution_terms(pred: torch.Tensor, target_feat: torch.Tensor, lm_head_weight: torch.Tensor,
                       mask: torch.Tensor, l1_rank: bool = False, k: int = 10) -> dict[str, torch.Tensor]:
    """The terms drafter objectives combine, each a mean over the masked positions: `vloss` smooth-L1 onto the
    target's next feature, `ploss` soft CE -sum p log p_draft through the frozen LM head, `top1` agreement (no
    grad); with `l1_rank` also `l1` = sum_v |p_draft - p| (twice the total-variation distance, whose complement is
    the speculative-sampling acceptance rate) and `rank` (`plackett_luce_rank` over the target's top-k)."""
    m = mask.float()
    denom = m.sum().clamp_min(1.0)

    def mean(x: torch.Tensor) -> torch.Tensor:
        return (x * m).sum() / denom

    out = {"vloss": mean(F.smooth_l1_loss(pred.float(), target_feat.float(), reduction="none").mean(-1))}
    with torch.no_grad():
        p_target = torch.softmax(target_feat.float() @ lm_head_weight.float().T, -1)
    logits = pred.float() @ lm_head_weight.float().T
    logq = torch.log_softmax(logits, -1)
    out["ploss"] = mean(-(p_target * logq).sum(-1))
    with torch.no_grad():
        out["top1"] = mean((logq.argmax(-1) == p_target.argmax(-1)).float())
    if l1_rank:
        out["l1"] = mean((logq.exp() - p_target).abs().sum(-1))
        out["rank"] = mean(plackett_luce_rank(logits, p_target, k))
    return out
