"""Toy target training: packed rows (one media prefix, one branch per example) give exactly the unpacked losses,
and the schedule gives scenes and clips their own number of passes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmspec_ray.toy.tokenizer import IMAGE
from mmspec_ray.toy.train import collate, make_items, pack_items, schedule
from tests.tiny import tiny_llava

ANSWERS = ("a large red circle at the top left", "there is one small blue star", "two objects",
           "the red square is moving left and the blue star is at the center of the image")


def _items(processor, n_media: int, frames: int, rng: np.random.Generator, start: int = 0):
    """3 examples per media item (random prompts and answers from the tiny vocabulary)."""
    examples = []
    for m in range(n_media):
        media = tuple(range(start + m * frames, start + (m + 1) * frames))
        for _ in range(3):
            prompt = " ".join(rng.choice(["describe", "what", "is", "the", "image", "video"], size=rng.integers(1, 6)))
            examples.append((prompt, ANSWERS[rng.integers(len(ANSWERS))], media, frames > 1))
    return make_items(processor, 9, examples)


def _answer_nll(model, batch) -> torch.Tensor:
    """Summed negative log-likelihood of the labelled tokens (HF's in-row shift: logits[i] predict labels[i+1])."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logp = torch.log_softmax(model(**inputs).logits[:, :-1].float(), -1)
    tgt = batch["labels"][:, 1:]
    m = tgt != -100
    return -logp[m, tgt[m]].sum()


def test_packed_rows_give_exactly_the_unpacked_losses() -> None:
    model, processor = tiny_llava(seed=3)
    rng = np.random.default_rng(0)
    items = _items(processor, 2, 1, rng) + _items(processor, 2, 4, rng, start=2)
    pixels = torch.randn(10, 3, 96, 96)
    pad = processor.tokenizer.pad_token_id
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE)
    groups = pack_items(items, image_id)
    assert [len(g.branches) for g in groups] == [3, 3, 3, 3] and [g.video for g in groups] == [0, 0, 1, 1]
    assert sum(len(g) for g in groups) < sum(len(it.input_ids) for it in items)  # the shared prefixes count once
    with torch.no_grad():
        packed = _answer_nll(model, collate(groups, [0, 1, 2, 3], pixels, pad))  # padded rows of unequal length
        single = sum(_answer_nll(model, collate(pack_items([it], image_id), [0], pixels, pad)) for it in items)
    n_answer = sum(len(it.input_ids) - it.n_prompt for it in items)
    assert n_answer > 40
    torch.testing.assert_close(packed, single, rtol=1e-5, atol=1e-4)


def test_examples_of_one_media_must_share_the_prefix() -> None:
    _, processor = tiny_llava()
    a, b = make_items(processor, 9, [("describe", "red", (0,), False)] * 2)
    b = type(b)(b.input_ids[:3] + [b.input_ids[3] + 1] + b.input_ids[4:], b.n_prompt, b.media)
    with pytest.raises(ValueError, match="share the prompt"):
        pack_items([a, b], processor.tokenizer.convert_tokens_to_ids(IMAGE))


def test_schedule_gives_clips_their_own_passes() -> None:
    _, processor = tiny_llava()
    rng = np.random.default_rng(1)
    groups = pack_items(_items(processor, 40, 1, rng) + _items(processor, 20, 4, rng, start=40),
                        processor.tokenizer.convert_tokens_to_ids(IMAGE))
    batches = schedule(groups, epochs=2.0, video_epochs=3.0, batch_size=8, rng=np.random.default_rng(0))
    seen = np.bincount([i for b in batches for i in b], minlength=len(groups))
    assert (seen[:40] == 2).all() and (seen[40:] == 3).all()
    assert all(sum(len(groups[i].branches) for i in b) <= 8 + 2 for b in batches)
    half = schedule(groups, epochs=1.5, video_epochs=1.0, batch_size=8, rng=np.random.default_rng(0))
    seen = np.bincount([i for b in half for i in b], minlength=len(groups))
    assert (seen[40:] == 1).all() and set(seen[:40]) <= {1, 2} and 5 < (seen[:40] == 2).sum() < 35
