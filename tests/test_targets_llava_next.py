"""LLaVA-NeXT family on a tiny random-init anyres model: media accounting and request handling (the target contract
runs for every family in test_target_contract.py).

A clip is sent as its frames (each frame one anyres image); the tests pin that down.
"""

from __future__ import annotations

import pytest
import torch

from mmspec_ray.targets import Request, TargetError, wrap
from mmspec_ray.targets.llava_next import LlavaNextTarget
from families import FAMILIES, build_target
from tiny import anyres_grid, random_images
from tiny_llava_next import PATCH, PINPOINTS, TILE


@pytest.fixture(scope="module")
def target():
    return build_target("llava_next")


REQUESTS = FAMILIES["llava_next"].requests  # two_images: a 96x60 image (8x8 grid, unpadded to 6 rows), a square
FRAMES = REQUESTS["video"].videos[0]


def expected_image_tokens(width: int, height: int) -> int:
    """Anyres token count worked out by hand: base tile + unpadded grid + one newline per grid row (no CLS)."""
    side = TILE // PATCH
    rows, cols = anyres_grid(width, height, PINPOINTS, TILE, PATCH)
    return side * side + rows * cols + rows


def test_registry_picks_llava_next(target):
    assert type(target) is LlavaNextTarget

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
            assert torch.allclose(t.lm_head(out.hidden[:, -1:]).float(), out.logits, atol=1e-5)
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
