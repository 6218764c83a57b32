"""LLaVA-NeXT family on a tiny random-init anyres model: tree verify, commit, AR == HF generate, media accounting.

A clip is sent as its frames (each frame one anyres image); the tests pin that down.
"""

from __future__ import annotations

import pytest
import torch

from mmspec_ray.targets import Request, TargetError, wrap
from mmspec_ray.targets.llava_next import LlavaNextTarget
from target_checks import check_ar_equals_hf, check_commit_then_continue, check_verify_matches_paths
from tiny import random_images
from tiny_llava_next import PATCH, PINPOINTS, TILE, random_image, tiny_llava_next


@pytest.fixture(scope="module")
def target():
    return wrap(*tiny_llava_next())


WIDE = random_image(96, 60, seed=5)  # 8x8 grid of patch rows/cols, unpadded to 6 rows
FRAMES = tuple(random_images(3, seed=3))

REQUESTS = {
    "text": Request(prompt="describe the image"),
    "image": Request(prompt="describe the image", images=tuple(random_images(1, seed=1))),
    "two_images": Request(prompt="what is there", images=(WIDE, random_images(1, seed=2)[0])),
    "video": Request(prompt="what is happening", videos=(FRAMES,)),
}


def expected_image_tokens(width: int, height: int) -> int:
    """Anyres token count worked out by hand: base tile + unpadded grid + one newline per grid row (no CLS)."""
    side = TILE // PATCH
    best, best_key = None, None
    for ph, pw in PINPOINTS:  # the pinpoint keeping the most pixels, then wasting the least
        scale = min(pw / width, ph / height)
        eff = min(int(width * scale) * int(height * scale), width * height)
        key = (eff, -(ph * pw - eff))
        if best_key is None or key > best_key:
            best, best_key = (ph, pw), key
    rows, cols = best[0] // TILE * side, best[1] // TILE * side
    if width / height > cols / rows:
        new_rows = int(round(height * cols / width, 7))
        rows -= (rows - new_rows) // 2 * 2
    else:
        new_cols = int(round(width * rows / height, 7))
        cols -= (cols - new_cols) // 2 * 2
    return side * side + rows * cols + rows


def test_registry_picks_llava_next(target):
    assert type(target) is LlavaNextTarget


@pytest.mark.parametrize("name", list(REQUESTS))
def test_verify_tree_matches_each_path(target, name):
    for seed in range(3):
        check_verify_matches_paths(target, REQUESTS[name], n=14, seed=seed)


@pytest.mark.parametrize("name", list(REQUESTS))
def test_ar_equals_hf_generate_and_is_varied(target, name):
    ids = check_ar_equals_hf(target, REQUESTS[name], max_new_tokens=32)
    assert len(set(ids)) >= 8, ids


@pytest.mark.parametrize("name", ["image", "two_images", "video"])
def test_commit_then_continue(target, name):
    check_commit_then_continue(target, REQUESTS[name], steps=16)


def test_media_mask_counts_anyres_tokens(target):
    t = wrap(target.model, target.processor, feature_layers=(1,))
    square = expected_image_tokens(96, 96)
    wide = expected_image_tokens(96, 60)
    assert (square, wide) == (88, 70)  # 16 base + 8x8 grid + 8 newlines; the wide image loses 2 padded rows
    for name, n in (("text", 0), ("image", square), ("two_images", wide + square), ("video", 3 * square)):
        inputs = t.encode(REQUESTS[name])
        out = t.prefill(inputs)
        assert int(out.media_mask.sum()) == n, name
        assert out.media_mask.shape == inputs["input_ids"].shape
        assert out.hidden.shape == (1, inputs["input_ids"].shape[1], t.hidden_size)
        assert set(out.layers) == {1} and out.layers[1].shape == out.hidden.shape
        assert out.inputs_embeds.shape == out.hidden.shape
        with torch.inference_mode():
            assert torch.allclose(t.lm_head(out.hidden).float(), out.logits, atol=1e-5)
    assert inputs["image_sizes"].tolist() == [[96, 96]] * 3


def test_clip_is_sent_as_its_frames(target):
    as_video = target.encode(REQUESTS["video"])
    as_images = target.encode(Request(prompt="what is happening", images=FRAMES))
    assert torch.equal(as_video["input_ids"], as_images["input_ids"])
    assert torch.equal(as_video["pixel_values"], as_images["pixel_values"])
    assert as_video["pixel_values"].shape[:2] == (3, 5)  # 3 frames x (base + 2x2 tiles)


def test_messages_media_follow_part_order(target):
    """A video part before an image part: frames fill the first placeholders, the image the last one."""
    img = random_images(1, seed=9)[0]
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "image"}, {"type": "text", "text": "a"}]}]
    got = target.encode(Request(messages=messages, images=(img,), videos=(FRAMES,)))
    want = target.encode(Request(prompt="a", images=FRAMES + (img,)))
    assert torch.equal(got["input_ids"], want["input_ids"])
    assert torch.equal(got["pixel_values"], want["pixel_values"])


def test_requests_it_cannot_take_are_clear_errors(target):
    img = tuple(random_images(1, seed=1))
    two_parts = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "a"}]}]
    with pytest.raises(TargetError, match=r"name 2 image\(s\) and 0 video\(s\) but the request carries 1 image"):
        target.encode(Request(messages=two_parts, images=img))
    with pytest.raises(TargetError, match="video 0 has no frames"):
        target.encode(Request(prompt="a", videos=((),)))
    with pytest.raises(TargetError, match="exceeds the target's context"):
        target.check_length(target.max_context - 3, 10)


def test_bare_tokenizer_processor_takes_text_only(target):
    """AutoProcessor falls back to a bare tokenizer when a processor cannot be built: text works, media is refused."""
    bare = wrap(target.model, target.processor.tokenizer)
    text = REQUESTS["text"]
    assert torch.equal(bare.encode(text)["input_ids"], target.encode(text)["input_ids"])
    for name in ("image", "video"):
        with pytest.raises(TargetError, match="no image processor"):
            bare.encode(REQUESTS[name])
