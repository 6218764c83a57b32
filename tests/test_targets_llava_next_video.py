"""LLaVA-NeXT-Video family on a tiny random-init model: media accounting and request handling (the target contract
runs for every family in test_target_contract.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from mmspec_ray.targets import Request, TargetError, wrap
from mmspec_ray.targets.llava_next_video import LlavaNextVideoTarget
from families import FAMILIES, build_target
from tiny import anyres_grid
from tiny_llava_next_video import PATCH, PINPOINTS, TILE, TOKENS_PER_FRAME, VIDEO

REQUESTS = FAMILIES["llava_next_video"].requests
(WIDE,) = REQUESTS["image"].images  # 96x60
SQUARE = REQUESTS["image_and_video"].images[0]  # 96x96
CLIP = REQUESTS["video"].videos[0]  # 4 frames


@pytest.fixture(scope="module")
def target():
    return build_target("llava_next_video")


def image_tokens(width: int, height: int) -> int:
    """Anyres tokens of one image, worked out by hand: base tile (CLS dropped) + unpadded grid + one newline per
    grid row."""
    rows, cols = anyres_grid(width, height, PINPOINTS, TILE, PATCH)
    return (TILE // PATCH) ** 2 + rows * cols + rows


def test_registry_picks_llava_next_video(target):
    assert type(target) is LlavaNextVideoTarget
    assert target.takes_video and not target.video_as_frames


def test_media_tokens_and_pieces_per_image_and_frame(target):
    image_id, video_id = target.config.image_token_id, target.config.video_token_id
    wide, square = image_tokens(96, 60), image_tokens(96, 96)
    assert (wide, square) == (70, 88)  # 6x8 grid (2 padded rows cut) + 6 newlines; 8x8 + 8
    clip = len(CLIP) * TOKENS_PER_FRAME  # 2x2-pooled frames, back to back, no separator
    cases = {  # request -> (image tokens, video tokens, media pieces)
        "text": (REQUESTS["text"], 0, 0, []),
        "image": (REQUESTS["image"], wide, 0, [wide]),
        "two_images": (REQUESTS["two_images"], square + wide, 0, [square, wide]),
        "video": (REQUESTS["video"], 0, clip, [TOKENS_PER_FRAME] * len(CLIP)),
        "image_and_video": (Request(prompt="a", images=(SQUARE,), videos=(CLIP,)), square, clip,
                            [square] + [TOKENS_PER_FRAME] * len(CLIP)),
        "two_clips": (Request(prompt="a", videos=(CLIP, CLIP[::-1])), 0, 2 * clip, [TOKENS_PER_FRAME] * 8),
    }
    for name, (req, n_img, n_vid, pieces) in cases.items():
        inputs = target.encode(req)
        ids = inputs["input_ids"]
        assert (int((ids == image_id).sum()), int((ids == video_id).sum())) == (n_img, n_vid), name
        out = target.prefill(inputs)
        assert torch.equal(out.media_mask, (ids == image_id) | (ids == video_id)), name
        spans = target.media_pieces(ids[0], inputs)
        assert [b - a for a, b in spans] == pieces, name
        assert out.media_segments.max().item() == len(pieces) - 1, name
        with torch.inference_mode():
            assert torch.allclose(target.lm_head(out.hidden[:, -1:]).float(), out.logits, atol=1e-5)
    # stored features (no inputs): a clip stays one piece
    ids = target.encode(REQUESTS["video"])["input_ids"][0]
    assert [b - a for a, b in target.media_pieces(ids)] == [clip]


def test_video_goes_through_the_video_path(target):
    inputs = target.encode(REQUESTS["video"])
    assert "pixel_values" not in inputs
    assert inputs["pixel_values_videos"].shape == (1, len(CLIP), 3, TILE, TILE)
    assert VIDEO in target.processor.apply_chat_template(
        target.messages(REQUESTS["video"]), add_generation_prompt=True, tokenize=False)
    both = target.encode(REQUESTS["image_and_video"])
    assert both["pixel_values"].shape[:2] == (1, 5)  # base + 2x2 tiles
    assert both["pixel_values_videos"].shape == (1, 3, 3, TILE, TILE)


def test_a_clip_changes_the_answer(target):
    """The clip's pixels reach the model: a reversed clip (same tokens) gives other logits."""
    a = target.prefill(target.encode(REQUESTS["video"])).logits
    b = target.prefill(target.encode(Request(prompt="what is happening", videos=(CLIP[::-1],)))).logits
    assert not torch.allclose(a, b)


def test_requests_it_cannot_take_are_clear_errors(target):
    with pytest.raises(TargetError, match=r"llava_next_video targets need every clip of a request to have the same "
                                          r"number of frames \(got \[3, 4\]\)"):
        target.encode(Request(prompt="a", videos=(CLIP, CLIP[:3])))
    with pytest.raises(TargetError, match="video 0 has no frames"):
        target.encode(Request(prompt="a", videos=((),)))
    parts = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "a"}]}]
    with pytest.raises(TargetError, match=r"name 0 image\(s\) and 1 video\(s\) but the request carries 1 image"):
        target.encode(Request(messages=parts, images=(WIDE,)))
    no_video = copy.copy(target.processor)
    no_video.video_processor = None
    with pytest.raises(TargetError, match="this llava_next_video target's processor has no video processor"):
        wrap(target.model, no_video).encode(REQUESTS["video"])
    bare = wrap(target.model, target.processor.tokenizer)  # AutoProcessor's fallback without torchvision
    assert torch.equal(bare.encode(REQUESTS["text"])["input_ids"], target.encode(REQUESTS["text"])["input_ids"])
    with pytest.raises(TargetError, match="no image processor"):
        bare.encode(REQUESTS["image"])
