"""ViSpec training forward and loss: each example's compressed drafter sequence (`ViSpecHead.sequence`, the very
function the drafter's prefill runs), one batched decoder-layer pass, outputs scattered back to entry positions,
and EAGLE's loss on the answer entries. Stage 2 adds the multi-token-prediction passes (spec §4.3): pass m feeds
entry j the drafter's own pass m-1 prediction of f_j (made at entry j-1) instead of the target's f_j, with the same
token embeddings and media, gradients through every pass, equal weights."""

from __future__ import annotations

import torch

from mmspec_ray.drafters.layers import causal_pad_mask
from mmspec_ray.drafters.vispec import ViSpecHead
from mmspec_ray.training.losses import eagle_loss


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


def vispec_loss(head: ViSpecHead, batch: dict, lm_head_weight: torch.Tensor, p_weight: float,
                mtp_steps: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean over passes 0..mtp_steps of EAGLE's loss (smooth-L1 feature + p_weight x soft CE) on answer entries."""
    emb, feat, valid = batch["emb"], batch["feat"], batch["valid"]
    total = torch.zeros((), device=emb.device)
    parts: dict[str, float] = {}
    n = mtp_steps + 1
    for m in range(n):
        pred = vispec_forward(head, emb, feat, valid, batch["spans"])
        loss, p = eagle_loss(pred, batch["tgt"], lm_head_weight, batch["loss_mask"], p_weight=p_weight)
        total = total + loss / n
        for k, v in p.items():
            parts[k] = parts.get(k, 0.0) + v / n
            if n > 1:
                parts[f"{k}_pass{m}"] = v
        feat = torch.cat([feat[:, :1], pred[:, :-1]], 1)  # pass m+1: entry j reads the prediction of f_j
    return total, parts
