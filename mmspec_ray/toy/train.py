"""Supervised training of the toy target VLM on toy prompt/answer pairs (loss on answer tokens only)."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import LlavaForConditionalGeneration, LlavaProcessor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainItem:
    """One tokenised example; `media` indexes rows of the shared pixel tensor."""

    input_ids: list[int]  # [L] prompt (image tokens expanded) + answer + eos
    n_prompt: int  # how many leading ids are prompt (no loss)
    media: tuple[int, ...]  # indices into the pixel bank, one per <image> placeholder, in order


def encode_prompt(processor: LlavaProcessor, n_images: int, prompt: str) -> str:
    """The chat-templated user turn with `n_images` image placeholders, ending at the assistant header."""
    content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": prompt}]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


def make_item(processor: LlavaProcessor, tokens_per_image: int, prompt: str, answer: str,
              media: tuple[int, ...]) -> TrainItem:
    """Tokenise like the processor does (each <image> expanded to tokens_per_image ids), plus the answer."""
    tok = processor.tokenizer
    text = encode_prompt(processor, len(media), prompt)
    text = text.replace(tok.image_token, tok.image_token * tokens_per_image)
    p = tok(text, add_special_tokens=False)["input_ids"]
    a = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return TrainItem(p + a, len(p), media)


def _batches(items: list[TrainItem], batch_size: int, rng: np.random.Generator) -> list[list[int]]:
    """Length-bucketed batches (little padding), in random order."""
    order = rng.permutation(len(items))
    chunks = [order[i:i + batch_size * 16] for i in range(0, len(order), batch_size * 16)]
    batches = []
    for ch in chunks:
        ch = sorted(ch.tolist(), key=lambda i: len(items[i].input_ids))
        batches += [ch[i:i + batch_size] for i in range(0, len(ch), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def collate(items: list[TrainItem], idx: list[int], pixels: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
    L = max(len(items[i].input_ids) for i in idx)
    ids = torch.full((len(idx), L), pad_id, dtype=torch.long)
    labels = torch.full((len(idx), L), -100, dtype=torch.long)
    mask = torch.zeros((len(idx), L), dtype=torch.long)
    media: list[int] = []
    for r, i in enumerate(idx):
        it = items[i]
        n = len(it.input_ids)
        ids[r, :n] = torch.tensor(it.input_ids)
        labels[r, it.n_prompt:n] = ids[r, it.n_prompt:n]
        mask[r, :n] = 1
        media += list(it.media)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "pixel_values": pixels[media]}


def train_target(model: LlavaForConditionalGeneration, items: list[TrainItem], pixels: torch.Tensor, *,
                 epochs: float, batch_size: int, lr: float, seed: int, pad_id: int,
                 warmup: int = 50) -> list[float]:
    """AdamW + linear warm-up + cosine decay; returns the per-step losses."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    n_per_epoch = math.ceil(len(items) / batch_size)
    total = max(1, int(n_per_epoch * epochs))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))
    model.train()
    losses: list[float] = []
    step, t0 = 0, time.time()
    bar = tqdm(total=total, desc="train toy target", unit="step")
    while step < total:
        for idx in _batches(items, batch_size, rng):
            if step >= total:
                break
            out = model(**collate(items, idx, pixels, pad_id))
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(out.loss))
            step += 1
            bar.update(1)
            if step % 20 == 0:
                bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
    bar.close()
    model.eval()
    log.info("trained %d steps in %.0f s, final loss %.4f", total, time.time() - t0, np.mean(losses[-20:]))
    return losses
