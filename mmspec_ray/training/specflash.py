"""SpecFLASH training data and loss (spec §3.2-3.3): teacher-forced, with the block-diagonal placeholder expansion.

Per example, the drafter's real sequence is what inference builds from the prompt and the answer: entry j =
fc([e_{j+1}; f_j]) at text positions, each image / frame's media entries replaced by its compressed vectors (one
walk, `drafters.specflash.entry_runs`, over the pieces stored with the example).
Every answer base j (an entry that inference can end a context on: n_prompt-1 <= j) then gets its K-1 placeholders
appended after the real sequence, at positions pos(j)+1 .. pos(j)+K-1; placeholder (j, s) attends to the real
entries up to j and to placeholders (j, 1..s). Slot s of base j regresses f_{j+1+s} (smooth L1) and matches
softmax(lm_head(f_{j+1+s})) (soft cross-entropy, weight `p_weight`), valid while token x_{j+2+s} exists. Visual
entries are never targets: the queries learn only through the text predictions that attend to them.
Chained groups (inference on trees deeper than K) are not trained apart: their fed-back entries pair a drafted
token with the drafter's own slot output, as EAGLE's later draft steps do, and the drafter meets them untrained,
as EAGLE does (the feature noise is the only preparation).
Examples are run one at a time (the expansion makes each sequence ~K x its answer long, so a padded batch's
attention would cost K^2 more memory than EAGLE's), and their valid (entry, slot) rows share one loss mean.
"""

from __future__ import annotations

import torch

from mmspec_ray.drafters.specflash import SpecFlashHead, entry_runs
from mmspec_ray.training.shards import FeatureExample
from mmspec_ray.training.losses import eagle_loss

FUSED, COMPRESSED, RAW, PLACEHOLDER = 1, 2, 3, 4  # kinds of drafter inputs


def expand_example(ex: FeatureExample, pieces: list[tuple[int, int]], ratio: float, max_queries: int, group: int,
                   noise: float, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One example's training sequence (see the module docstring) as tensors: `kind` [T] (FUSED: fc of `emb`,
    `feat`; COMPRESSED: query `aux` of piece `piece`; RAW: `feat` itself, ratio 1; PLACEHOLDER: slot `aux` of the
    real row `base`), `pos`
    [T], `mask` [T, T] bool, `tgt` [T, d], `loss_mask` [T], and the pieces' noised features `pieces` [P, Nmax, d]
    with `piece_len` [P]."""
    L = ex.input_ids.shape[0]
    n = L - 1  # entries: j pairs embeds[j+1] with hidden[j]
    hidden = ex.hidden.float()
    feat_all = hidden[:n]
    if noise > 0:
        feat_all = feat_all + (torch.rand(feat_all.shape, generator=gen) - 0.5) * noise
    emb_all = ex.embeds[1:].float()
    kind, aux, piece, src = [], [], [], []  # per real row; src: the entry j of a FUSED row, else -1
    piece_feats: list[torch.Tensor] = []
    for run in entry_runs(n, pieces, ratio, max_queries):  # the walk inference's `SpecFlashHead.sequence` makes
        if run.kind == "text":
            for t in range(run.start, run.end):
                kind.append(FUSED); aux.append(t); piece.append(-1); src.append(t)
        elif run.kind == "raw":
            for t in range(run.start, run.end):
                kind.append(RAW); aux.append(t); piece.append(-1); src.append(-1)
        elif run.count:
            for q in range(run.count):
                kind.append(COMPRESSED); aux.append(q); piece.append(len(piece_feats)); src.append(-1)
            piece_feats.append(feat_all[run.start:run.end])
    R = len(kind)
    bases = [(i, s) for i, s in enumerate(src) if s >= ex.n_prompt - 1 and s + 2 <= L - 2] if group > 1 else []
    T = R + (group - 1) * len(bases)
    pos = torch.zeros(T, dtype=torch.long)
    pos[:R] = torch.arange(R)
    mask = torch.zeros(T, T, dtype=torch.bool)
    mask[:R, :R] = torch.ones(R, R, dtype=torch.bool).tril()
    d = hidden.shape[1]
    tgt = torch.zeros(T, d)
    loss_mask = torch.zeros(T, dtype=torch.bool)
    for i, s in enumerate(src):  # slot 0: the real entry's own output predicts f_{j+1}
        if s >= ex.n_prompt - 1 and s + 1 <= L - 2:
            tgt[i] = hidden[s + 1]
            loss_mask[i] = True
    base = [-1] * R
    for b, (i, s) in enumerate(bases):
        r0 = R + b * (group - 1)
        for k in range(1, group):
            r = r0 + k - 1
            kind.append(PLACEHOLDER); aux.append(k - 1); piece.append(-1); base.append(i)
            pos[r] = i + k
            mask[r, :i + 1] = True
            mask[r, r0:r + 1] = True
            if s + 1 + k <= L - 2:
                tgt[r] = hidden[s + 1 + k]
                loss_mask[r] = True
    kind_t, aux_t = torch.tensor(kind), torch.tensor(aux)
    fused_rows = kind_t == FUSED
    raw_rows = kind_t == RAW
    emb = torch.zeros(T, d)
    feat = torch.zeros(T, d)
    emb[fused_rows] = emb_all[aux_t[fused_rows]]
    feat[fused_rows | raw_rows] = feat_all[aux_t[fused_rows | raw_rows]]
    nmax = max((p.shape[0] for p in piece_feats), default=0)
    pf = torch.zeros(len(piece_feats), nmax, d)
    for p, f in enumerate(piece_feats):
        pf[p, :f.shape[0]] = f
    return {"kind": kind_t, "aux": aux_t, "piece": torch.tensor(piece), "base": torch.tensor(base), "pos": pos,
            "mask": mask, "emb": emb, "feat": feat, "tgt": tgt, "loss_mask": loss_mask, "pieces": pf,
            "piece_len": torch.tensor([p.shape[0] for p in piece_feats], dtype=torch.long)}


def layer_inputs(head: SpecFlashHead, item: dict[str, torch.Tensor]) -> torch.Tensor:
    """The decoder-layer inputs [T, d] of an expanded example, through the head's trainable fc, queries and
    placeholders (what `SpecFlashHead.sequence` and the drafter's propose build at inference)."""
    kind, aux = item["kind"], item["aux"]
    x = torch.where((kind == RAW)[:, None], item["feat"], head.fc(torch.cat([item["emb"], item["feat"]], -1)))
    comp = kind == COMPRESSED
    if comp.any():
        f = item["pieces"]  # [P, Nmax, d]
        valid = torch.arange(f.shape[1], device=f.device)[None] < item["piece_len"][:, None]
        logits = torch.einsum("cd,pnd->pcn", head.queries, f).masked_fill(~valid[:, None], float("-inf"))
        z = torch.einsum("pcn,pnd->pcd", torch.softmax(logits, -1), f)  # [P, Q, d]
        x = torch.where(comp[:, None], z[item["piece"].clamp(min=0), aux.clamp(0, z.shape[1] - 1)], x)
    ph = kind == PLACEHOLDER
    if ph.any():
        slot = head.placeholders[aux.clamp(0, head.placeholders.shape[0] - 1)]
        if head.cfg.placeholder == "offset":  # u_n + pi_s: the base's real input (placeholders follow every real row)
            slot = slot + x[item["base"].clamp(min=0)]
        x = torch.where(ph[:, None], slot, x)
    return x


def specflash_loss(head: SpecFlashHead, items: list[dict[str, torch.Tensor]], lm_head_weight: torch.Tensor,
                   p_weight: float) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE's smooth-L1 + p_weight x soft CE, averaged over every valid (entry, slot) row of the batch; `top1`
    also per slot (`top1_slot0` ...: how often the draft's argmax is the target's, slot by slot)."""
    preds, tgts, slots = [], [], []
    for it in items:
        x = layer_inputs(head, it)
        out = head.layer(x[None], it["pos"][None], it["mask"][None, None])[0]
        m = it["loss_mask"]
        preds.append(out[m])
        tgts.append(it["tgt"][m])
        slots.append(torch.where(it["kind"] == PLACEHOLDER, it["aux"] + 1, torch.zeros_like(it["aux"]))[m])
    pred, tgt, slot = torch.cat(preds)[None], torch.cat(tgts)[None], torch.cat(slots)
    loss, parts = eagle_loss(pred, tgt, lm_head_weight, torch.ones(pred.shape[:2], dtype=torch.bool),
                             p_weight=p_weight)
    with torch.no_grad():
        W = lm_head_weight.float()
        hit = (pred[0].float() @ W.T).argmax(-1) == (tgt[0].float() @ W.T).argmax(-1)
        for s in range(int(slot.max()) + 1 if slot.numel() else 0):
            sel = slot == s
            if sel.any():
                parts[f"top1_slot{s}"] = float(hit[sel].float().mean())
    return loss, parts
