"""GLM-4.1V family (GLM-4.1V and the GLM-4.5V MoE) on tiny random-init models: the media token layout (images and
per-group video blocks, all on the image token), M-RoPE positions and rope-delta bookkeeping checked against the
model's own, one media piece per image or temporal group, the request's frames kept as sent, and the refusals (the
target contract runs for every family in test_target_contract.py)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from families import FAMILIES, build_target
from mmspec_ray.targets import Request, TargetError
from mmspec_ray.targets.glm4v import Glm4vMoeTarget, Glm4vTarget
from target_checks import check_ar_equals_hf, check_verify_matches_paths
from tiny import random_images
from tiny_glm4v import BOI, BOV, EOI, EOV, IMAGE, VIDEO

TOKENS_PER_IMAGE = 9  # 96 px -> 48 px -> 6x6 patches of 8 px -> 3x3 after the 2x2 downsample
TOKENS_PER_GROUP = 9  # a temporal group of 2 frames, 48 px each
REQUESTS = FAMILIES["glm4v"].requests  # the MoE family's are the same
ADAPTERS = {"glm4v": Glm4vTarget, "glm4v_moe": Glm4vMoeTarget}


@pytest.fixture(scope="module", params=list(ADAPTERS))
def target(request):
    return build_target(request.param)


def _id(target, token: str) -> int:
    return target.tokenizer.convert_tokens_to_ids(token)


def test_registry_picks_the_family_adapter(target):
    family = target.config.model_type
    assert type(target) is ADAPTERS[family] and target.family == family and target.takes_video
    assert target.media_token_ids == {_id(target, IMAGE), _id(target, VIDEO)}


def test_token_layout_of_images_and_clips(target):
    """An image: begin, 9 image tokens, end. A 4-frame clip: begin of video, then per temporal group its own image
    block of 9 image tokens and a timestamp, then end of video; the clip's positions carry the image token (no
    <|video|> survives expansion), and mm_token_type_ids tells them apart (1 image, 2 video, 0 text)."""
    boi, eoi, image = _id(target, BOI), _id(target, EOI), _id(target, IMAGE)
    inputs = target.encode(REQUESTS["two_images"])
    ids = inputs["input_ids"][0].tolist()
    block = [boi] + [image] * TOKENS_PER_IMAGE + [eoi]
    start = ids.index(boi)
    assert ids[start:start + 2 * len(block)] == block * 2
    types = inputs["mm_token_type_ids"][0]
    assert torch.equal(types == 1, target.media_mask_of(inputs["input_ids"][0])) and not (types == 2).any()

    inputs = target.encode(REQUESTS["video"])
    ids = inputs["input_ids"][0]
    assert inputs["video_grid_thw"].tolist() == [[2, 6, 6]] and "video_metadata" not in inputs
    assert _id(target, VIDEO) not in ids.tolist()
    text = target.tokenizer.decode(ids)
    group = BOI + IMAGE * TOKENS_PER_GROUP + EOI + "0"  # 4 frames at the default 24 fps: both groups at 0 s
    assert BOV + group * 2 + EOV in text
    types = inputs["mm_token_type_ids"][0]
    assert torch.equal(types == 2, target.media_mask_of(ids)) and not (types == 1).any()


def test_each_image_and_temporal_group_is_one_media_piece(target):
    """Two images: one piece each; a 4-frame clip: 2 groups of 9 tokens, each its own piece, with the encoded inputs
    at prefill and from the ids alone."""
    two = target.encode(REQUESTS["two_images"])["input_ids"][0]
    assert [b - a for a, b in target.media_pieces(two)] == [TOKENS_PER_IMAGE] * 2
    inputs = target.encode(REQUESTS["video"])
    ids = inputs["input_ids"][0]
    pieces = target.media_pieces(ids, inputs)
    assert [b - a for a, b in pieces] == [TOKENS_PER_GROUP] * 2 and pieces == target.media_pieces(ids)
    out = target.prefill(inputs)
    assert out.media_segments[0].max() == 1 and int((out.media_segments[0] >= 0).sum()) == 2 * TOKENS_PER_GROUP


@pytest.mark.parametrize("name", ["text", "image", "two_images", "video"])
def test_prefill_position_is_hf_rope_index(target, name):
    """next_pos after prefill == 1 + the largest M-RoPE position HF assigns to the prompt; tree positions are 3
    rows (temporal, height, width) of next_pos + depth."""
    inputs = target.encode(REQUESTS[name])
    n = inputs["input_ids"].shape[1]
    target.prefill(inputs)
    if "image_grid_thw" in inputs or "video_grid_thw" in inputs:
        keys = ("image_grid_thw", "video_grid_thw", "attention_mask")
        pos, _ = target.model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                   **{k: inputs.get(k) for k in keys})
        expected = int(pos.max()) + 1
        assert expected < n
    else:
        expected = n
    assert target.seq_len == n and target.next_pos == expected and target.rope_delta == expected - n
    ids = target.tree_positions(torch.tensor([0, 1, 1, 2]))
    assert ids.shape == (3, 1, 4) and (ids == torch.tensor([0, 1, 1, 2]) + expected).all()


@pytest.mark.parametrize("name", ["image", "video"])
def test_chain_positions_are_the_models_own(target, name):
    """A chain verified at our positions scores as the model's own decode step, which numbers the continuation
    from its cached rope delta (no position ids given)."""
    inputs = target.encode(REQUESTS[name])
    tokens = torch.tensor([17, 42, 99, 120, 7])
    n = len(tokens)
    target.prefill(inputs)
    ours = target.verify(tokens, torch.ones((n, n), dtype=torch.bool).tril(), torch.arange(n)).logits
    target.prefill(inputs)
    with torch.inference_mode():
        theirs = target.model(input_ids=tokens.view(1, n), past_key_values=target.cache, use_cache=True).logits
    assert float((ours - theirs.float()).abs().max()) < 1e-4


def test_text_prefill_after_media_ignores_the_stale_rope_delta(target):
    target.prefill(target.encode(REQUESTS["video"]))
    assert target.rope_delta < 0
    inputs = target.encode(REQUESTS["text"])
    target.prefill(inputs)
    assert target.rope_delta == 0 and target.next_pos == inputs["input_ids"].shape[1]


def test_a_clip_keeps_every_frame_it_was_sent(target):
    """The request's clip is already sampled: 8 frames are 4 temporal groups, each its own run of image tokens. The
    video processor's own sampling would need the clip's fps, which frames alone do not carry."""
    inputs = target.encode(Request(prompt="what is happening", videos=(tuple(random_images(8, seed=4)),)))
    assert inputs["video_grid_thw"][0, 0] == 4
    assert len(target.media_pieces(inputs["input_ids"][0])) == 4
    with pytest.raises(ValueError, match="no video metadata"):
        target.processor(text=BOV + VIDEO + EOV, videos=[random_images(8, seed=4)], return_tensors="pt")


def test_two_clips_in_one_prompt(target):
    """Two clips (video features of both merged in prompt order): one piece per temporal group, tree verify == each
    path, AR == HF generate, varied."""
    req = Request(prompt="compare them", videos=(tuple(random_images(4, seed=6)), tuple(random_images(2, seed=7))))
    inputs = target.encode(req)
    assert inputs["video_grid_thw"].tolist() == [[2, 6, 6], [1, 8, 8]]  # the 2-frame clip: the budget of 4 at 64 px
    assert [b - a for a, b in target.media_pieces(inputs["input_ids"][0], inputs)] == [9, 9, 16]
    check_verify_matches_paths(target, req, n=14)
    assert len(set(check_ar_equals_hf(target, req, max_new_tokens=32))) >= 8


def test_images_and_a_clip_together_are_refused_as_the_model_fails_on_them(target):
    """The stock model finds image and video features both by the image token, so with both kinds in one prompt its
    own forward fails (what HF generate would do); the adapter refuses the request up front, saying what to send."""
    req = Request(prompt="compare them", images=tuple(random_images(1, seed=6)),
                  videos=(tuple(random_images(4, seed=7)),))
    with pytest.raises(TargetError, match=rf"{target.display_name} takes images or video in one request, not "
                                          r"both.*send the clip's frames as images"):
        target.encode(req)
    inputs = dict(target.processor(text=BOI + IMAGE + EOI + BOV + VIDEO + EOV, images=list(req.images),
                                   videos=[list(req.videos[0])], do_sample_frames=False, return_tensors="pt"))
    with pytest.raises(ValueError, match="Image features and image tokens do not match"), torch.inference_mode():
        target.model(**inputs)
    frames = Request(prompt="compare them", images=req.images + req.videos[0])  # the fix it names works
    assert len(set(check_ar_equals_hf(target, frames, max_new_tokens=16))) >= 4


def test_refusals_name_the_fix(target):
    name = target.display_name
    with pytest.raises(TargetError, match=rf"video 0 has 1 frame\(s\): {name} takes clips of at least 2 frames"):
        target.encode(Request(prompt="what", videos=(tuple(random_images(1, seed=5)),)))
    with pytest.raises(TargetError, match=rf"image 0 is 201x1: {name} takes images with an aspect ratio up to 200"):
        target.encode(Request(prompt="what", images=(Image.new("RGB", (201, 1)),)))
    with pytest.raises(TargetError, match=r"video 0 mixes frame sizes"):
        target.encode(Request(prompt="what", videos=((random_images(1)[0], random_images(1, size=64)[0]),)))
