"""LLaVA-OneVision family on a tiny random-init model: media accounting and request handling (the target contract
runs for every family in test_target_contract.py).

Covers OneVision's three visual regimes: one anyres image, several base-view images, and native video.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from mmspec_ray.targets import Request, TargetError, wrap
from mmspec_ray.targets.llava_onevision import LlavaOnevisionTarget
from families import FAMILIES, build_target
from tiny import anyres_grid
from tiny_llava_onevision import ASPECT, PATCH, PINPOINTS, TILE, VIDEO


@pytest.fixture(scope="module")
def target():
    return build_target("llava_onevision")


REQUESTS = FAMILIES["llava_onevision"].requests
SQUARE, WIDE = REQUESTS["two_images"].images  # 96x96 and 96x60; the "image" request is WIDE alone
CLIP = REQUESTS["video"].videos[0]


def expected_single_image_tokens(width: int, height: int) -> int:
    """Anyres tokens for a lone image, worked out by hand: base tile + unpadded grid (shrunk to the anyres_max
    budget) + one newline per grid row."""
    side = TILE // PATCH
    rows, cols = anyres_grid(width, height, PINPOINTS, TILE, PATCH)
    ratio = math.sqrt(rows * cols / (int(ASPECT.removeprefix("anyres_max_")) * side * side))
    if ratio > 1.1:
        rows, cols = int(rows // ratio), int(cols // ratio)
    return side * side + rows * cols + rows


def test_registry_picks_llava_onevision(target):
    assert type(target) is LlavaOnevisionTarget
    assert target.takes_video and not target.video_as_frames

def test_media_mask_counts_image_and_video_tokens(target):
    t = wrap(target.model, target.processor, feature_layers=(1,))
    image_id, video_id = t.config.image_token_id, t.config.video_token_id
    wide, square = expected_single_image_tokens(96, 60), expected_single_image_tokens(96, 96)
    assert (wide, square) == (76, 88)  # 8x12 grid -> 6x9 under the 4-tile budget; 12x12 -> 8x8
    base_view = (TILE // PATCH) ** 2 + 1  # several images: base view + newline each
    clip = len(CLIP) * math.ceil(TILE // PATCH / 2) ** 2 + 1  # 2x2-pooled frames + one newline
    cases = {
        "text": (0, 0),
        "image": (wide, 0),
        "square": (square, 0),
        "two_images": (2 * base_view, 0),
        "video": (0, clip),
        "image_and_video": (wide, clip),
    }
    requests = {**REQUESTS, "square": Request(prompt="a", images=(SQUARE,)),
                "image_and_video": Request(prompt="a", images=(WIDE,), videos=(CLIP,))}
    for name, (n_img, n_vid) in cases.items():
        inputs = t.encode(requests[name])
        ids = inputs["input_ids"]
        out = t.prefill(inputs)
        assert (int((ids == image_id).sum()), int((ids == video_id).sum())) == (n_img, n_vid), name
        assert int(out.media_mask.sum()) == n_img + n_vid, name
        assert torch.equal(out.media_mask, (ids == image_id) | (ids == video_id))
        assert out.hidden.shape == (1, ids.shape[1], t.hidden_size)
        assert set(out.layers) == {1} and out.layers[1].shape == out.hidden.shape
        assert out.inputs_embeds.shape == out.hidden.shape
        with torch.inference_mode():
            assert torch.allclose(t.lm_head(out.hidden[:, -1:]).float(), out.logits, atol=1e-5)


def test_video_goes_through_the_video_path(target):
    inputs = target.encode(REQUESTS["video"])
    assert "pixel_values" not in inputs
    assert inputs["pixel_values_videos"].shape == (1, len(CLIP), 3, TILE, TILE)
    assert VIDEO in target.processor.apply_chat_template(
        target.messages(REQUESTS["video"]), add_generation_prompt=True, tokenize=False)
    two = target.encode(Request(prompt="a", videos=(CLIP, CLIP[::-1])))
    assert two["pixel_values_videos"].shape == (2, len(CLIP), 3, TILE, TILE)


def test_several_images_are_one_multi_image_group(target):
    inputs = target.encode(REQUESTS["two_images"])
    assert inputs["batch_num_images"].tolist() == [2]
    assert inputs["pixel_values"].shape[:2] == (2, 1)  # base views only, no anyres tiles
    one = target.encode(REQUESTS["image"])
    assert one["batch_num_images"].tolist() == [1] and one["pixel_values"].shape[:2] == (1, 7)  # base + 2x3 tiles


def test_requests_it_cannot_take_are_clear_errors(target):
    with pytest.raises(TargetError, match=r"same number of frames \(got \[3, 4\]\)"):
        target.encode(Request(prompt="a", videos=(CLIP, CLIP[:3])))
    with pytest.raises(TargetError, match="video 0 has no frames"):
        target.encode(Request(prompt="a", videos=((),)))
    parts = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "a"}]}]
    with pytest.raises(TargetError, match=r"name 0 image\(s\) and 1 video\(s\) but the request carries 1 image"):
        target.encode(Request(messages=parts, images=(WIDE,)))
    no_video = copy.copy(target.processor)
    no_video.video_processor = None
    with pytest.raises(TargetError, match="no video processor"):
        wrap(target.model, no_video).encode(REQUESTS["video"])
    with pytest.raises(TargetError, match="exceeds the target's context"):
        target.check_length(target.max_context - 3, 10)


def test_bare_tokenizer_processor_takes_text_only(target):
    """Without torchvision, AutoProcessor.from_pretrained of a OneVision checkpoint returns a bare tokenizer: text
    still works, media is refused with what to do."""
    bare = wrap(target.model, target.processor.tokenizer)
    text = REQUESTS["text"]
    assert torch.equal(bare.encode(text)["input_ids"], target.encode(text)["input_ids"])
    with pytest.raises(TargetError, match="no image processor"):
        bare.encode(REQUESTS["image"])
    with pytest.raises(TargetError, match="no video processor"):
        bare.encode(REQUESTS["video"])
