"""Qwen3-VL family (dense and MoE) on tiny random-init models: interleaved M-RoPE positions and rope-delta bookkeeping,
DeepStack at prefill, one media piece per temporal group, the request's frames kept as sent, and the refusals (the
target contract runs for every family in test_target_contract.py)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from families import FAMILIES, build_target
from mmspec_ray.targets import Request, TargetError
from mmspec_ray.targets.base import media_runs
from mmspec_ray.targets.qwen3_vl import Qwen3VLMoeTarget, Qwen3VLTarget
from target_checks import check_ar_equals_hf, check_verify_matches_paths
from tiny import random_images

TOKENS_PER_IMAGE = 9  # 96 px -> 48 px -> 6x6 patches of 8 px -> 3x3 after the 2x2 merge
TOKENS_PER_GROUP = 9  # a temporal group of 2 frames, 48 px each
ADAPTERS = {"qwen3_vl": Qwen3VLTarget, "qwen3_vl_moe": Qwen3VLMoeTarget}


@pytest.fixture(scope="module", params=list(ADAPTERS))
def target(request):
    return build_target(request.param)


def test_registry_picks_the_family_adapter(target):
    family = target.config.model_type
    assert type(target) is ADAPTERS[family] and target.family == family and target.takes_video


@pytest.mark.parametrize("name", ["text", "image", "two_images", "video"])
def test_prefill_position_is_hf_rope_index(target, name):
    """next_pos after prefill == 1 + the largest M-RoPE position HF assigns to the prompt; tree positions are 3
    rows (temporal, height, width), never the 4-row form with a text axis."""
    inputs = target.encode(FAMILIES["qwen3_vl"].requests[name])
    assert "mm_token_type_ids" in inputs and "video_metadata" not in inputs
    n = inputs["input_ids"].shape[1]
    target.prefill(inputs)
    if "image_grid_thw" in inputs or "video_grid_thw" in inputs:
        keys = ("image_grid_thw", "video_grid_thw", "attention_mask", "mm_token_type_ids")
        pos, _ = target.model.model.get_rope_index(inputs["input_ids"], **{k: inputs.get(k) for k in keys})
        expected = int(pos.max()) + 1
        assert expected < n
    else:
        expected = n
    assert target.seq_len == n and target.next_pos == expected and target.rope_delta == expected - n
    ids = target.tree_positions(torch.tensor([0, 1, 1, 2]))
    assert ids.shape == (3, 1, 4) and (ids == torch.tensor([0, 1, 1, 2]) + expected).all()


def test_text_prefill_after_media_ignores_the_stale_rope_delta(target):
    target.prefill(target.encode(FAMILIES["qwen3_vl"].requests["video"]))
    assert target.rope_delta < 0
    inputs = target.encode(FAMILIES["qwen3_vl"].requests["text"])
    target.prefill(inputs)
    assert target.rope_delta == 0 and target.next_pos == inputs["input_ids"].shape[1]


def test_each_temporal_group_is_one_media_piece(target):
    """A 4-frame clip: 2 groups of 9 video tokens, each its own run after a timestamp, each its own piece (with the
    encoded inputs at prefill and from the ids alone); two images: one piece each."""
    req = FAMILIES["qwen3_vl"].requests
    inputs = target.encode(req["video"])
    ids = inputs["input_ids"][0]
    assert inputs["video_grid_thw"].tolist() == [[2, 6, 6]]
    assert "seconds>" in target.tokenizer.decode(ids)
    pieces = target.media_pieces(ids, inputs)
    assert [b - a for a, b in pieces] == [TOKENS_PER_GROUP] * 2 and pieces == target.media_pieces(ids)
    out = target.prefill(inputs)
    assert out.media_segments[0].max() == 1 and int((out.media_segments[0] >= 0).sum()) == 2 * TOKENS_PER_GROUP
    two = target.encode(req["two_images"])["input_ids"][0]
    assert [b - a for a, b in target.media_pieces(two)] == [TOKENS_PER_IMAGE] * 2


def test_a_clip_keeps_every_frame_it_was_sent(target):
    """The request's clip is already sampled: 8 frames are 4 temporal groups, not the 4 frames the video
    processor's own 2 fps sampling would keep."""
    inputs = target.encode(Request(prompt="what is happening", videos=(tuple(random_images(8, seed=4)),)))
    assert inputs["video_grid_thw"][0, 0] == 4
    assert len(media_runs(target.media_mask_of(inputs["input_ids"][0]))) == 4
    sampled = target.processor(text="<|video_pad|>", videos=[random_images(8, seed=4)], return_tensors="pt")
    assert sampled["video_grid_thw"][0, 0] == 2  # what sampling would have done


def test_deepstack_features_reach_the_prefill(target):
    """The tiny model exercises DeepStack: without the vision tower's DeepStack merger the prefill's hidden states
    change at the image positions only (and so every later position), but not at the text before the image."""
    inputs = target.encode(FAMILIES["qwen3_vl"].requests["image"])
    first = int(target.media_mask_of(inputs["input_ids"][0]).nonzero()[0])
    with_ds = target.prefill(inputs).hidden
    merger = target.model.model.visual.deepstack_merger_list[0].linear_fc2
    saved = merger.weight.detach().clone(), merger.bias.detach().clone()
    try:
        with torch.no_grad():
            merger.weight.zero_()
            merger.bias.zero_()
        without = target.prefill(inputs).hidden
    finally:
        with torch.no_grad():
            merger.weight.copy_(saved[0])
            merger.bias.copy_(saved[1])
    assert torch.equal(with_ds[0, :first], without[0, :first])
    assert not torch.allclose(with_ds[0, first], without[0, first])


def test_an_image_and_a_clip_together(target):
    """Both media kinds in one prompt (DeepStack features of both merged by position): tree verify == each path,
    AR == HF generate, varied."""
    req = Request(prompt="compare them", images=tuple(random_images(1, seed=6)),
                  videos=(tuple(random_images(4, seed=7)),))
    inputs = target.encode(req)
    assert "image_grid_thw" in inputs and "video_grid_thw" in inputs
    check_verify_matches_paths(target, req, n=14)
    assert len(set(check_ar_equals_hf(target, req, max_new_tokens=32))) >= 8


def test_refusals_name_the_fix(target):
    with pytest.raises(TargetError, match=r"video 0 has 1 frame\(s\): Qwen3-VL takes clips of at least 2 frames"):
        target.encode(Request(prompt="what", videos=(tuple(random_images(1, seed=5)),)))
    with pytest.raises(TargetError, match=r"image 0 is 201x1: Qwen3-VL takes images with an aspect ratio up to 200"):
        target.encode(Request(prompt="what", images=(Image.new("RGB", (201, 1)),)))
    with pytest.raises(TargetError, match=r"video 0 mixes frame sizes"):
        target.encode(Request(prompt="what", videos=((random_images(1)[0], random_images(1, size=64)[0]),)))
