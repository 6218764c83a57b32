"""Train a drafter head on target features: batches of teacher-forced sequences, EAGLE losses, feature noise,
a checkpoint (config.json + model.safetensors + trainer_state.pt) every epoch, resumable, and a held-out τ
measured each epoch by real speculative decoding on held-out prompts."""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel, Field
from tqdm.auto import tqdm

from mmspec_ray.drafters.eagle import Eagle2Config, Eagle2Drafter, Eagle2Head
from mmspec_ray.spec.engine import SpecEngine
from mmspec_ray.spec.tree import TreeConfig
from mmspec_ray.targets.base import Request, VLMTarget
from mmspec_ray.training.datagen import FeatureExample
from mmspec_ray.training.losses import eagle_loss

log = logging.getLogger(__name__)


class TrainConfig(BaseModel):
    epochs: int = Field(10, ge=1)
    batch_size: int = Field(16, ge=1)
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    noise: float = 0.2  # uniform feature noise amplitude: U(-noise/2, noise/2), as in EAGLE
    grad_clip: float = 0.5
    p_weight: float = 0.1
    seed: int = 0
    eval_max_new_tokens: int = 96


def collate(examples: list[FeatureExample], idx: list[int], noise: float, gen: torch.Generator):
    """Entry j pairs embeds[j+1] with hidden[j] (noised) and predicts hidden[j+1]; loss only where j+1 is an answer
    position whose successor is still inside the sequence."""
    T = max(examples[i].input_ids.shape[0] for i in idx) - 1
    d = examples[idx[0]].hidden.shape[1]
    B = len(idx)
    emb = torch.zeros(B, T, d)
    feat = torch.zeros(B, T, d)
    tgt = torch.zeros(B, T, d)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b, i in enumerate(idx):
        ex = examples[i]
        n = ex.input_ids.shape[0] - 1
        emb[b, :n] = ex.embeds[1:].float()
        feat[b, :n] = ex.hidden[:-1].float()
        tgt[b, :n] = ex.hidden[1:].float()
        valid[b, :n] = True
        loss_mask[b, max(0, ex.n_prompt - 1): max(0, n - 1)] = True
    if noise > 0:
        feat = feat + (torch.rand(feat.shape, generator=gen) - 0.5) * noise
    return emb, feat, tgt, loss_mask, valid


def causal_pad_mask(valid: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool: causal, no attention to padding (padding rows attend to themselves to stay finite)."""
    T = valid.shape[1]
    m = torch.ones(T, T, dtype=torch.bool).tril()[None] & valid[:, None, :]
    m |= torch.eye(T, dtype=torch.bool)[None]
    return m[:, None]


@torch.inference_mode()
def heldout_tau(target: VLMTarget, head: Eagle2Head, requests: list[Request], tree: TreeConfig,
                max_new_tokens: int) -> float:
    """Mean accepted draft tokens per cycle over real greedy speculative decoding of held-out prompts."""
    if not requests:
        return float("nan")
    eng = SpecEngine(target, Eagle2Drafter(copy.deepcopy(head), target), tree)
    acc = cyc = 0
    for r in requests:
        st = eng.generate(r, max_new_tokens=max_new_tokens).stats
        acc += sum(st.accepted_per_cycle)
        cyc += st.cycles
    return acc / max(1, cyc)


def train_eagle2(target: VLMTarget, examples: list[FeatureExample], out_dir: str | Path, cfg: TrainConfig,
                 heldout: list[Request] = (), tree: TreeConfig | None = None, resume: bool = True) -> Path:
    """Train (or resume) an EAGLE-2 head; writes the drafter checkpoint to out_dir after every epoch."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tree = tree or TreeConfig()
    torch.manual_seed(cfg.seed)
    head = Eagle2Head(Eagle2Config.for_target(target)).float().train()
    W = target.model.get_output_embeddings().weight.detach().float()
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    steps_per_epoch = math.ceil(len(examples) / cfg.batch_size)
    total = steps_per_epoch * cfg.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))
    state_path = out / "trainer_state.pt"
    history: list[dict] = []
    start_epoch = 0
    if resume and state_path.exists():
        st = torch.load(state_path, weights_only=False)
        head.load_state_dict(st["head"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        start_epoch, history = st["epoch"], st["history"]
        log.info("resuming drafter training at epoch %d from %s", start_epoch, out)
    gen = torch.Generator().manual_seed(cfg.seed + start_epoch)
    rng = np.random.default_rng(cfg.seed)
    for _ in range(start_epoch):
        rng.permutation(len(examples))
    for epoch in range(start_epoch, cfg.epochs):
        t0 = time.time()
        order = rng.permutation(len(examples)).tolist()
        # length-bucketed batches: sort chunks by length to limit padding
        chunks = [sorted(order[i:i + cfg.batch_size * 8], key=lambda j: examples[j].input_ids.shape[0])
                  for i in range(0, len(order), cfg.batch_size * 8)]
        batches = [c[i:i + cfg.batch_size] for c in chunks for i in range(0, len(c), cfg.batch_size)]
        parts_sum = {"loss": 0.0, "vloss": 0.0, "ploss": 0.0, "top1": 0.0}
        bar = tqdm(batches, desc=f"train drafter epoch {epoch + 1}/{cfg.epochs}", unit="batch")
        for idx in bar:
            emb, feat, tgt, lmask, valid = collate(examples, idx, cfg.noise, gen)
            pos = torch.arange(emb.shape[1])[None].expand(emb.shape[0], -1)
            pred = head(emb, feat, pos, causal_pad_mask(valid))
            loss, parts = eagle_loss(pred, tgt, W, lmask, p_weight=cfg.p_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_value_(head.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            parts_sum["loss"] += float(loss)
            for k, v in parts.items():
                parts_sum[k] += v
            bar.set_postfix(loss=f"{float(loss):.3f}", top1=f"{parts['top1']:.2f}")
        n = max(1, len(batches))
        rec = {"epoch": epoch + 1, **{k: v / n for k, v in parts_sum.items()}, "train_s": time.time() - t0}
        rec["heldout_tau"] = heldout_tau(target, head, list(heldout), tree, cfg.eval_max_new_tokens)
        history.append(rec)
        log.info("drafter epoch %d: %s", epoch + 1, json.dumps(rec))
        head.save(out)
        torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "epoch": epoch + 1, "history": history}, state_path)
        (out / "history.json").write_text(json.dumps(history, indent=2))
    return out
