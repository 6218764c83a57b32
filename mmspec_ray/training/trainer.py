"""The one drafter trainer for every method: batches of teacher-forced sequences drawn by the stage schedule
(text-only stage 1, gradual or direct multimodal stage 2, or one multimodal stage), the method's collate and loss,
AdamW with warm-up + cosine, a checkpoint (config.json + model.safetensors + trainer_state.pt) every epoch,
resumable, and a held-out τ measured each epoch by real speculative decoding on held-out prompts.

A method (`training/methods.py`) supplies the head, collate, loss, default stages and the drafter that wraps a
head; this file never names one."""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError
from tqdm.auto import tqdm

from mmspec_ray.decoding.engine import SpecEngine
from mmspec_ray.decoding.tree import TreeConfig
from mmspec_ray.drafters.base import load_drafter, stop_learning
from mmspec_ray.targets.base import Request, VLMTarget
from mmspec_ray.training.datagen import FeatureExample
from mmspec_ray.training.methods import TrainingMethod, training_method
from mmspec_ray.training.schedule import TrainConfig, stage_schedule

log = logging.getLogger(__name__)
__all__ = ["TrainConfig", "train_drafter", "heldout_tau", "stage_schedule", "make_optimizer", "train_step",
           "check_resume_config"]


PROGRESS_EVERY_S = 5.0  # at most one held-out progress line per this many seconds


@torch.inference_mode()
def heldout_tau(target: VLMTarget, drafter, requests: list[Request], tree: TreeConfig, max_new_tokens: int) -> float:
    """Mean accepted draft tokens per cycle over real greedy speculative decoding of held-out prompts; logs its
    progress (rows done, elapsed) at most every `PROGRESS_EVERY_S`, since on a large target this takes minutes."""
    if not requests:
        return float("nan")
    eng = SpecEngine(target, drafter, tree)
    acc = cyc = 0
    t0 = last = time.monotonic()
    log.info("held-out τ: decoding %d rows with the drafter (up to %d new tokens each)", len(requests),
             max_new_tokens)
    for done, r in enumerate(requests, 1):
        st = eng.generate(r, max_new_tokens=max_new_tokens).stats
        acc += sum(st.accepted_per_cycle)
        cyc += st.cycles
        if time.monotonic() - last >= PROGRESS_EVERY_S or done == len(requests):
            last = time.monotonic()
            log.info("held-out τ: %d/%d rows, %.0f s", done, len(requests), last - t0)
    return acc / max(1, cyc)


def to_device(obj: Any, device: torch.device) -> Any:
    """A method's batch (tensors in dicts and lists, e.g. SpecFLASH's per-example items) moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def make_optimizer(head: torch.nn.Module, cfg: TrainConfig, total_steps: int):
    """AdamW (0.9, 0.95) with linear warm-up then cosine decay over `total_steps` (shared by both trainers)."""
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    total = max(1, total_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))
    return opt, sched


class MethodLoss(torch.nn.Module):
    """A method's loss on its head as a module's forward (batch -> (loss, parts)): what data-parallel training wraps
    in DDP, so every use of the head's parameters, however many passes the method's loss makes, is inside the
    forward DDP tracks."""

    def __init__(self, m: TrainingMethod, head: torch.nn.Module, W: torch.Tensor, p_weight: float) -> None:
        super().__init__()
        self.m, self.head, self.p_weight = m, head, p_weight
        self.W = [W]  # the target's LM head: not a parameter or buffer (DDP would broadcast it every step)

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        return self.m.loss(self.head, batch, self.W[0], self.p_weight)


def train_step(m: TrainingMethod, head: torch.nn.Module, batch: dict[str, torch.Tensor], W: torch.Tensor,
               cfg: TrainConfig, opt, sched, loss_fn: Callable[[dict], tuple[torch.Tensor, dict]] | None = None
               ) -> tuple[float, dict[str, float]]:
    """One optimiser step on one batch: the method's loss (through `loss_fn` when given: a DDP-wrapped
    `MethodLoss`, whose backward averages the gradients across workers), backward, value clipping, AdamW and the
    LR schedule. Returns (loss, the loss's parts)."""
    loss, parts = loss_fn(batch) if loss_fn is not None else m.loss(head, batch, W, cfg.p_weight)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_value_(head.parameters(), cfg.grad_clip)
    opt.step()
    sched.step()
    return float(loss.detach()), parts


def head_config(head: torch.nn.Module) -> dict[str, Any] | None:
    """The head's config as saved in its config.json (JSON types), or None for a head without one."""
    cfg = getattr(head, "cfg", None)
    return None if cfg is None else cfg.model_dump(mode="json")


def saved_head_config(state: dict[str, Any], folder: Path) -> dict[str, Any] | None:
    """The head config a run was trained with: the one its checkpoint state records, else the config.json saved
    beside it (runs checkpointed before the state recorded it); None when neither exists."""
    if state.get("config") is not None:
        return state["config"]
    path = Path(folder) / "config.json"
    return json.loads(path.read_text()) if path.exists() else None


def resume_config_conflicts(method: str, saved: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Fields present in both head configs whose values differ: name -> (saved, new). A ViSpec config saved
    without its `objective` was trained with EAGLE's loss (the only one before the option), so it reads as eagle."""
    saved = dict(saved)
    if method == "vispec" and saved.get("objective") is None:
        saved["objective"] = "eagle"

    def norm(v: Any) -> Any:
        return json.loads(json.dumps(v))  # tuples as lists, as config.json stores them

    return {k: (saved[k], new[k]) for k in sorted(saved.keys() & new.keys()) if norm(saved[k]) != norm(new[k])}


def check_resume_config(method: str, saved: dict[str, Any] | None, head: torch.nn.Module, where: Any) -> None:
    """Refuse to resume a run whose saved head config differs from the one `head` was built with (other method
    options, or defaults changed since): loading its weights would silently continue under another configuration.
    The saved config is read as the head would load it (a field saved before it existed takes its default)."""
    cfg = getattr(head, "cfg", None)
    if saved is None or cfg is None:
        return
    try:
        saved = type(cfg).model_validate(saved).model_dump(mode="json")
    except ValidationError:
        pass  # compared as saved
    diff = resume_config_conflicts(method, saved, head_config(head))
    if diff:
        said = ", ".join(f"{k} {a!r} (saved) vs {b!r} (now)" for k, (a, b) in diff.items())
        raise ValueError(f"{where} holds a {method} training run with another head config: {said}; resume with the "
                         "options it was trained with, or start over: --force starts over (toy worlds; with --data "
                         "give a new --work and --out)")


def build_corpus(m: TrainingMethod, target: VLMTarget, examples: list[FeatureExample], out: Path,
                 heldout: list[Request], tree: TreeConfig, cfg: TrainConfig) -> Path:
    """A corpus-only method (the suffix drafter): write its checkpoint from the examples in one pass, and a
    one-record history with the held-out τ, as an epoch of a trained method would."""
    t0 = time.time()
    m.build(target, examples, out)
    rec = {"epoch": 1, "examples": len(examples), "corpus_tokens": sum(int(e.input_ids.shape[0] - e.n_prompt)
                                                                       for e in examples),
           "train_s": time.time() - t0}
    drafter = load_drafter(str(out), target)
    stop_learning(drafter)  # τ of the corpus as built, not of the held-out answers it would learn on the way
    rec["heldout_tau"] = heldout_tau(target, drafter, list(heldout), tree, cfg.eval_max_new_tokens)
    (out / "history.json").write_text(json.dumps([rec], indent=2))
    log.info("%s drafter corpus: %s", m.name, json.dumps(rec))
    return out


def train_drafter(method: str | TrainingMethod, target: VLMTarget, examples: list[FeatureExample],
                  out_dir: str | Path, cfg: TrainConfig, heldout: list[Request] = (), tree: TreeConfig | None = None,
                  resume: bool = True, text_examples: list[FeatureExample] = ()) -> Path:
    """Train (or resume) a drafter head of `method` on multimodal `examples` (+ text-only `text_examples` for a
    two-stage schedule); writes the drafter checkpoint to out_dir after every epoch."""
    m = training_method(method) if isinstance(method, str) else method
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tree = tree or TreeConfig()
    text_examples = list(text_examples)
    m.check(list(examples))
    m.check(text_examples)
    if m.corpus_only:
        return build_corpus(m, target, list(examples) + text_examples, out, heldout, tree, cfg)
    given = len(examples)
    n_mm, n_text = len(examples), len(text_examples)
    examples, text_examples = m.select(target, list(examples), text_examples)
    if (len(examples), len(text_examples)) != (n_mm, n_text):
        log.info("%s data selection keeps %d of %d multimodal and %d of %d text-only examples", m.name,
                 len(examples), n_mm, len(text_examples), n_text)
    if given and not examples:
        raise ValueError(f"{m.name} keeps none of the {given} multimodal examples (hivis trains on answers longer "
                         "than its min_answer_words); give data with longer answers or choose another --method")
    stages = stage_schedule(m, cfg)
    pool = list(examples) + text_examples  # text items are indexed after the multimodal ones
    n_mm = len(examples)
    torch.manual_seed(cfg.seed)
    W = target.model.get_output_embeddings().weight.detach().float()
    head = m.head(target, pool).float().to(W.device).train()  # trains where the target sits (its LM head is in the loss)
    steps_per_epoch = math.ceil(stages.items_per_epoch(n_mm, len(text_examples)) / cfg.batch_size)
    opt, sched = make_optimizer(head, cfg, steps_per_epoch * cfg.epochs)
    state_path = out / "trainer_state.pt"
    history: list[dict] = []
    start_epoch = 0
    if resume and state_path.exists():
        st = torch.load(state_path, weights_only=False)
        if st.get("method", m.name) != m.name:
            raise ValueError(f"{out} holds a {st['method']} training run, not {m.name}; use another directory "
                             "or start over (--force)")
        check_resume_config(m.name, saved_head_config(st, out), head, out)
        head.load_state_dict(st["head"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        start_epoch, history = st["epoch"], st["history"]
        log.info("resuming %s drafter training at epoch %d from %s", m.name, start_epoch, out)
    for epoch in range(start_epoch, cfg.epochs):
        t0 = time.time()
        m.begin_epoch(head, epoch + 1, cfg)
        rng = np.random.default_rng([cfg.seed, epoch])  # per epoch, so a resumed run draws what a straight one does
        gen = torch.Generator().manual_seed(cfg.seed * 100_003 + epoch)
        items = stages.items(epoch + 1, n_mm, len(text_examples), rng)
        order = [i if mm else n_mm + i for mm, i in items]
        # length-bucketed batches: sort chunks by length to limit padding
        span = cfg.batch_size * cfg.bucket_batches
        chunks = [sorted(order[i:i + span], key=lambda j: pool[j].input_ids.shape[0])
                  for i in range(0, len(order), span)]
        batches = [c[i:i + cfg.batch_size] for c in chunks for i in range(0, len(c), cfg.batch_size)]
        parts_sum = {"loss": 0.0, "vloss": 0.0, "ploss": 0.0, "top1": 0.0}
        bar = tqdm(batches, desc=f"train {m.name} drafter epoch {epoch + 1}/{cfg.epochs}", unit="batch")
        for idx in bar:
            batch = to_device(m.collate(pool, idx, cfg.noise, gen), W.device)
            loss, parts = train_step(m, head, batch, W, cfg, opt, sched)
            parts_sum["loss"] += loss
            for k, v in parts.items():
                parts_sum[k] = parts_sum.get(k, 0.0) + v
            bar.set_postfix(loss=f"{loss:.3f}", top1=f"{parts.get('top1', float('nan')):.2f}")
        n = max(1, len(batches))
        rec = {"epoch": epoch + 1, **{k: v / n for k, v in parts_sum.items()}, "train_s": time.time() - t0,
               "multimodal_share": sum(mm for mm, _ in items) / max(1, len(items)) if stages.mixed
               else stages.ratio(epoch + 1),
               "items": {"multimodal": sum(mm for mm, _ in items), "text": sum(not mm for mm, _ in items)}}
        if (epoch + 1) % cfg.eval_every == 0 or epoch + 1 == cfg.epochs:
            rec["heldout_tau"] = heldout_tau(target, m.drafter(copy.deepcopy(head), target), list(heldout), tree,
                                             cfg.eval_max_new_tokens)
        history.append(rec)
        log.info("%s drafter epoch %d: %s", m.name, epoch + 1, json.dumps(rec))
        head.save(out)
        torch.save({"method": m.name, "config": head_config(head), "head": head.state_dict(),
                    "opt": opt.state_dict(), "sched": sched.state_dict(), "epoch": epoch + 1, "history": history,
                    "stages": stages.model_dump()}, state_path)
        (out / "history.json").write_text(json.dumps(history, indent=2))
    return out

