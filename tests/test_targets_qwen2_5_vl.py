"""Qwen2.5-VL family on a tiny random-init model: 3-axis M-RoPE positions and rope-delta bookkeeping, media mask
and request checks (the target contract runs for every family in test_target_contract.py)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from mmspec_ray.targets import Request, TargetError, wrap
from mmspec_ray.targets.qwen2_5_vl import Qwen25VLTarget
from families import FAMILIES, build_target
from tiny import random_images

TOKENS_PER_IMAGE = 9  # 96 px -> 48 px -> 6x6 patches of 8 px -> 3x3 after the 2x2 merge
TOKENS_PER_CLIP = 18  # 4 frames -> 2 temporal patches x 3x3


@pytest.fixture(scope="module")
def target():
    return build_target("qwen2_5_vl")


REQUESTS = FAMILIES["qwen2_5_vl"].requests


def test_registry_picks_the_qwen_adapter(target):
    assert type(target) is Qwen25VLTarget and target.takes_video

@pytest.mark.parametrize("name", list(REQUESTS))
def test_prefill_position_is_hf_rope_index(target, name):
    """next_pos after prefill == 1 + the largest M-RoPE position HF assigns to the prompt, on every axis."""
    inputs = target.encode(REQUESTS[name])
    n = inputs["input_ids"].shape[1]
    target.prefill(inputs)
    if "image_grid_thw" in inputs or "video_grid_thw" in inputs:
        keys = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts", "attention_mask", "mm_token_type_ids")
        pos, _ = target.model.model.get_rope_index(inputs["input_ids"], **{k: inputs.get(k) for k in keys})
        expected = int(pos.max()) + 1
        assert expected < n  # media tokens share positions, so the delta is negative
    else:
        expected = n
    assert target.seq_len == n and target.next_pos == expected
    assert target.rope_delta == expected - n
    ids = target.tree_positions(torch.tensor([0, 1, 1, 2]))
    assert ids.shape == (3, 1, 4)
    assert (ids == torch.tensor([0, 1, 1, 2]) + expected).all()


def test_commit_keeps_next_pos_at_seq_len_plus_delta(target):
    target.prefill(target.encode(REQUESTS["two_images"]))
    delta = target.rope_delta
    assert delta < 0
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    target.verify(torch.tensor([10, 11, 12, 13]), anc, torch.tensor([0, 1, 1, 2]))
    target.commit([0, 2, 3])  # root, then the second branch (not a chain prefix)
    assert target.next_pos == target.seq_len + delta
    assert target.cache.get_seq_length() == target.seq_len
    target.verify(torch.tensor([14]), torch.ones((1, 1), dtype=torch.bool), torch.tensor([0]))
    target.commit([0])
    assert target.next_pos == target.seq_len + delta


def test_text_prefill_after_media_ignores_the_stale_rope_delta(target):
    target.prefill(target.encode(REQUESTS["video"]))
    assert target.rope_delta < 0
    inputs = target.encode(REQUESTS["text"])
    target.prefill(inputs)
    assert target.rope_delta == 0 and target.next_pos == inputs["input_ids"].shape[1]


@pytest.mark.parametrize("name,image_tokens,video_tokens", [
    ("image", TOKENS_PER_IMAGE, 0), ("two_images", 2 * TOKENS_PER_IMAGE, 0), ("video", 0, TOKENS_PER_CLIP),
])
def test_prefill_media_mask_counts_pad_tokens(target, name, image_tokens, video_tokens):
    t = wrap(target.model, target.processor, feature_layers=(1,))
    inputs = t.encode(REQUESTS[name])
    out = t.prefill(inputs)
    ids = inputs["input_ids"]
    assert int((ids == t.config.image_token_id).sum()) == image_tokens
    assert int((ids == t.config.video_token_id).sum()) == video_tokens
    assert int(out.media_mask.sum()) == image_tokens + video_tokens
    assert out.media_mask[ids == t.config.vision_start_token_id].sum() == 0
    assert out.hidden.shape == (1, ids.shape[1], t.hidden_size)
    assert set(out.layers) == {1} and out.layers[1].shape == out.hidden.shape
    with torch.inference_mode():
        assert torch.allclose(t.lm_head(out.hidden[:, -1:]).float(), out.logits, atol=1e-5)
    assert out.inputs_embeds.shape == out.hidden.shape


def test_bad_requests_are_clear_errors(target):
    thin = Image.new("RGB", (1000, 4))
    with pytest.raises(TargetError, match="aspect ratio up to 200:1"):
        target.encode(Request(prompt="what", images=(thin,)))
    frames = tuple(random_images(2, seed=5)) + (Image.new("RGB", (64, 48)),)
    with pytest.raises(TargetError, match="mixes frame sizes"):
        target.encode(Request(prompt="what", videos=(frames,)))
    with pytest.raises(TargetError, match="no frames"):
        target.encode(Request(prompt="what", videos=((),)))
    with pytest.raises(TargetError, match="no processor"):
        wrap(target.model, None)


def test_tiny_video_processor_matches_the_image_layout(target):
    """The torchvision-free video stand-in is faithful: a still clip (one frame twice, one temporal patch) gives
    exactly the pixels and grid of the stock image processor, which repeats a still image over time itself."""
    image = random_images(1, seed=7)[0]
    still = target.processor.image_processor([image], return_tensors="pt")
    clip = target.processor.video_processor([[image, image]], return_tensors="pt")
    assert torch.equal(still["image_grid_thw"], clip["video_grid_thw"])
    assert torch.equal(still["pixel_values"], clip["pixel_values_videos"])
