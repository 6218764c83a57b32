"""Supervised training of the toy target VLM on toy prompt/answer pairs (loss on answer tokens only)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import LlavaForConditionalGeneration, LlavaProcessor

from mmspec_ray.toy.vocab import ACTIONS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainItem:
    """One tokenised example; `media` indexes rows of the shared pixel tensor."""

    input_ids: list[int]  # [L] prompt (image tokens expanded) + answer + eos
    n_prompt: int  # how many leading ids are prompt (no loss)
    media: tuple[int, ...]  # indices into the pixel bank, one per <image> placeholder, in order
    video: bool = False  # the media are a clip's frames


def encode_prompt(processor: LlavaProcessor, n_images: int, prompt: str) -> str:
    """The chat-templated user turn with `n_images` image placeholders, ending at the assistant header."""
    content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": prompt}]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


def make_items(processor: LlavaProcessor, tokens_per_image: int,
               examples: list[tuple[str, str, tuple[int, ...], bool]]) -> list[TrainItem]:
    """Tokenise (prompt, answer, media, video) examples like the processor does (each <image> expanded to
    tokens_per_image ids), plus the answer and eos. The chat template is rendered once per distinct (number of
    images, prompt) and the texts are tokenised in batches."""
    tok = processor.tokenizer
    templated: dict[tuple[int, str], str] = {}
    for prompt, _, media, _ in examples:
        if (len(media), prompt) not in templated:
            text = encode_prompt(processor, len(media), prompt)
            templated[len(media), prompt] = text.replace(tok.image_token, tok.image_token * tokens_per_image)
    prompts = tok([templated[len(m), p] for p, _, m, _ in examples], add_special_tokens=False)["input_ids"]
    answers = tok([a for _, a, _, _ in examples], add_special_tokens=False)["input_ids"]
    return [TrainItem(p + a + [tok.eos_token_id], len(p), media, video)
            for p, a, (_, _, media, video) in zip(prompts, answers, examples)]


@dataclass(frozen=True)
class PackedItem:
    """All examples of one image or clip as one training row: the shared prefix (chat header + image tokens) once,
    then each example's remainder as a branch that attends to the prefix and to itself only, at the positions it
    would have alone. The loss is exactly the sum of the unpacked examples' losses, for fewer tokens (a clip's 36
    image tokens are computed once for its 3 examples instead of 3 times)."""

    prefix: list[int]
    branches: tuple[tuple[list[int], int], ...]  # (ids after the prefix, how many of them are prompt)
    media: tuple[int, ...]
    video: bool

    def __len__(self) -> int:
        return len(self.prefix) + sum(len(b) for b, _ in self.branches)


def pack_items(items: list[TrainItem], image_token_id: int) -> list[PackedItem]:
    """Group the examples that share media (in first-seen order) into PackedItems."""
    groups: dict[tuple[int, ...], list[TrainItem]] = {}
    for it in items:
        groups.setdefault(it.media, []).append(it)
    packed = []
    for media, its in groups.items():
        cut = max(j for j, t in enumerate(its[0].input_ids) if t == image_token_id) + 1
        prefix = its[0].input_ids[:cut]
        for it in its:
            if it.input_ids[:cut] != prefix or it.n_prompt <= cut:
                raise ValueError("examples of the same media must share the prompt up to the last image token")
        packed.append(PackedItem(prefix, tuple((it.input_ids[cut:], it.n_prompt - cut) for it in its), media,
                                 its[0].video))
    return packed


def schedule(groups: list[PackedItem], epochs: float, video_epochs: float, batch_size: int,
             rng: np.random.Generator) -> list[list[int]]:
    """Batches of group indices for the whole run, epoch after epoch: scene groups for `epochs` passes, clip groups
    for `video_epochs` (a fractional last pass takes a random part). Length-bucketed (little padding), about
    `batch_size` examples per batch, in random order within each pass."""
    out: list[list[int]] = []
    for e in range(math.ceil(max(epochs, video_epochs))):
        frac = np.array([min(1.0, (video_epochs if g.video else epochs) - e) for g in groups])
        take = np.flatnonzero(rng.random(len(groups)) < frac)
        take = take[rng.permutation(len(take))].tolist()
        batches: list[list[int]] = []
        for c in range(0, len(take), 128):
            batch: list[int] = []
            n = 0
            for i in sorted(take[c:c + 128], key=lambda i: len(groups[i])):
                batch.append(i)
                n += len(groups[i].branches)
                if n >= batch_size:
                    batches.append(batch)
                    batch, n = [], 0
            if batch:
                batches.append(batch)
        out += [batches[i] for i in rng.permutation(len(batches))]
    return out


def collate(groups: list[PackedItem], idx: list[int], pixels: torch.Tensor, pad_id: int,
            dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Model inputs for packed rows: ids, labels (answer tokens only), position ids and the additive tree mask
    [B, 1, L, L]. Labels at a branch's first token are prompt (-100), so HF's in-row label shift never makes one
    branch predict the next."""
    B, L = len(idx), max(len(groups[i]) for i in idx)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    labels = torch.full((B, L), -100, dtype=torch.long)
    pos = torch.zeros((B, L), dtype=torch.long)
    allowed = torch.eye(L, dtype=torch.bool).repeat(B, 1, 1)  # padding sees itself (no all-masked rows)
    media: list[int] = []
    for r, i in enumerate(idx):
        g = groups[i]
        P = len(g.prefix)
        ids[r, :P] = torch.tensor(g.prefix)
        pos[r, :P] = torch.arange(P)
        allowed[r, :P, :P] = torch.ones(P, P, dtype=torch.bool).tril()
        s = P
        for branch, n_prompt in g.branches:
            n = len(branch)
            ids[r, s:s + n] = torch.tensor(branch)
            labels[r, s + n_prompt:s + n] = ids[r, s + n_prompt:s + n]
            pos[r, s:s + n] = torch.arange(P, P + n)
            allowed[r, s:s + n, :P] = True
            allowed[r, s:s + n, s:s + n] = torch.ones(n, n, dtype=torch.bool).tril()
            s += n
        media += list(g.media)
    mask = torch.zeros((B, 1, L, L), dtype=dtype).masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "labels": labels,
            "pixel_values": pixels[media]}


def train_target(model: LlavaForConditionalGeneration, groups: list[PackedItem], pixels: torch.Tensor, *,
                 epochs: float, batch_size: int, lr: float, seed: int, pad_id: int, video_epochs: float | None = None,
                 warmup: int = 50, freeze_vision: bool = True) -> list[float]:
    """AdamW + linear warm-up + cosine decay over the packed examples (`video_epochs`: passes over the clips'
    examples, default `epochs`); returns the per-step losses.

    With `freeze_vision` (the default) the vision tower and the projector keep their stage-1 weights and only the
    language model learns (Adam's per-parameter steps of ~lr also scramble the rescaled projector). Trained end to
    end at this learning rate, the language model's gradients wreck the tower's per-cell features within a few
    hundred steps and the model falls back to the text prior.
    """
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    batches = schedule(groups, epochs, epochs if video_epochs is None else video_epochs, batch_size, rng)
    total = max(1, len(batches))
    if freeze_vision:
        model.model.vision_tower.requires_grad_(False)
        model.model.multi_modal_projector.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))
    model.train()
    losses: list[float] = []
    t0 = time.time()
    bar = tqdm(batches, desc="train toy target", unit="step")
    for step, idx in enumerate(bar, 1):
        out = model(**collate(groups, idx, pixels, pad_id, model.dtype))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(out.loss.detach()))
        if step % 20 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
    bar.close()
    model.requires_grad_(True)
    model.eval()
    log.info("trained %d steps in %.0f s, final loss %.4f", total, time.time() - t0, np.mean(losses[-20:]))
    return losses


def pretrain_vision(model: LlavaForConditionalGeneration, pixels: torch.Tensor, labels: torch.Tensor, *,
                    steps: int, batch_size: int, lr: float, seed: int, warmup: int = 30,
                    clips: ClipLabels | None = None, clip_batch: int = 32, clip_hidden: int = 0,
                    weights: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0),
                    probe: Callable[[int, torch.nn.ModuleList], None] | None = None) -> float:
    """Stage 1: teach the vision tower to see (per-cell colour / shape / size) before the language model is trained.

    `labels` is [num_images, num_patches, 3] with class ids (0 = empty cell). The heads are thrown away; only the
    tower (and projector) keep what they learnt; train_target then keeps the tower frozen. With `clips`, a second
    head classifies each clip's action from its frames' features (all tokens of all frames, concatenated; `clip_batch`
    clips per step), so the frozen features also carry what changes between frames (angle, size, colour, place).
    `clip_hidden` > 0 makes that head an MLP: "the colour / the angle changed" is a comparison between frames, which
    a linear head cannot express (it reads spinning and colour changes far worse than motion, docs/toy.md).
    Without this stage a toy-sized LLaVA learns the text prior and ignores the pixels. Warm-up + cosine decay +
    gradient clipping: at a constant 2e-3 the per-cell loss spikes and shape accuracy collapses midway. `weights`
    scale the colour, shape, size and clip-action losses: shape is learnt last and slowest (colour is near perfect
    within 400 steps), so weighting it up gives features the language model can bind without errors in the same
    number of steps (docs/toy.md). `probe(step, heads)` is called after the last step, before the projector
    rescale (held-out head accuracy, experiments/toy_stage1_probe.py). Returns the min per-attribute accuracy on the
    last batches (empty cells included, so it overstates shape accuracy).
    """
    torch.manual_seed(seed)
    tower = model.model.vision_tower
    projector = model.model.multi_modal_projector
    d = model.config.text_config.hidden_size
    n_cls = [int(labels[..., k].max()) + 1 for k in range(labels.shape[-1])]
    heads = torch.nn.ModuleList(torch.nn.Linear(d, n) for n in n_cls)
    if clips is not None:
        n_frames, n_patch = clips.rows.shape[1], labels.shape[1]
        n_in = n_frames * n_patch * d
        heads.append(torch.nn.Linear(n_in, len(ACTIONS)) if not clip_hidden else torch.nn.Sequential(
            torch.nn.Linear(n_in, clip_hidden), torch.nn.GELU(), torch.nn.Linear(clip_hidden, len(ACTIONS))))
    params = list(tower.parameters()) + list(projector.parameters()) + list(heads.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    g = torch.Generator().manual_seed(seed)
    side = math.isqrt(labels.shape[1])
    mirror = torch.arange(side * side).view(side, side).flip(-1).flatten()  # patch index after a left-right flip
    tower.train()
    accs: list[float] = []
    for step in tqdm(range(steps), desc="pretrain vision", unit="step"):
        idx = torch.randint(0, pixels.shape[0], (batch_size,), generator=g)
        x, y = pixels[idx], labels[idx]
        # Mirror half the batch left-right (every toy shape is left-right symmetric): twice the scenes, less
        # overfitting of the shape head to the train scenes.
        flip = torch.rand(batch_size, generator=g) < 0.5
        x[flip] = x[flip].flip(-1)  # x is a copy (advanced indexing)
        y = torch.where(flip[:, None, None], y[:, mirror], y)
        feats = _features(model, x)
        loss = sum(weights[k] * torch.nn.functional.cross_entropy(heads[k](feats).flatten(0, 1), y[..., k].flatten())
                   for k in range(len(n_cls)))
        if clips is not None:
            loss = loss + weights[3] * _clip_action_loss(model, heads[-1], clips, clip_batch, g)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            accs.append(float(torch.stack([(heads[k](feats).argmax(-1) == y[..., k]).float().mean()
                                           for k in range(len(n_cls))]).min()))
    tower.eval()
    if probe is not None:
        probe(steps, heads)
    # Bring the image tokens to unit RMS per dimension (the stage-1 features are ~100x larger). Not down to the
    # text embeddings' initial norm (~0.3): those grow tenfold within a few hundred steps, and image tokens that
    # small are drowned in the residual stream.
    with torch.no_grad():
        img_norm = _features(model, pixels[:256]).norm(dim=-1).mean()
        scale = float(math.sqrt(d) / img_norm)
        projector.linear_2.weight.mul_(scale)
        projector.linear_2.bias.mul_(scale)
    acc = float(np.mean(accs[-10:]))
    log.info("vision pretraining: %d steps, min per-attribute cell accuracy %.3f, projector scaled by %.4f",
             steps, acc, scale)
    return acc


@dataclass(frozen=True)
class ClipLabels:
    """Stage-1 clip supervision: the pixel-bank rows of each clip's frames and its action id."""

    pixels: torch.Tensor  # the pixel bank the rows index
    rows: torch.Tensor  # [num_clips, frames] long
    actions: torch.Tensor  # [num_clips] long, indices into ACTIONS


def _clip_action_loss(model: LlavaForConditionalGeneration, head: torch.nn.Module, clips: ClipLabels, n: int,
                      g: torch.Generator) -> torch.Tensor:
    """Cross-entropy of the action head on `n` random clips, half mirrored left-right (a mirrored clip is a new
    clip: "moving left" becomes "moving right" and back)."""
    idx = torch.randint(0, clips.rows.shape[0], (n,), generator=g)
    rows, y = clips.rows[idx], clips.actions[idx]
    x = clips.pixels[rows.flatten()]
    flip = (torch.rand(n, generator=g) < 0.5).repeat_interleave(rows.shape[1])
    x[flip] = x[flip].flip(-1)  # x is a copy (advanced indexing)
    feats = _features(model, x)  # [n * frames, patches, d]
    swap = torch.tensor([ACTIONS.index("moving right"), ACTIONS.index("moving left")])
    flip_clip = flip.view(n, -1)[:, 0]
    lr_move = (y == swap[1]) | (y == swap[0])
    y = torch.where(flip_clip & lr_move, swap[0] + swap[1] - y, y)
    return torch.nn.functional.cross_entropy(head(feats.reshape(n, -1)), y)


def _features(model: LlavaForConditionalGeneration, pixels: torch.Tensor) -> torch.Tensor:
    """[B, patches, d_text] projected image features, exactly as LLaVA feeds them to its language model."""
    out = model.model.get_image_features(pixel_values=pixels)
    return torch.stack(list(out.pooler_output))
