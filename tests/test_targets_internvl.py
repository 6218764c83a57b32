"""InternVL family on a tiny random-init model: the tiled image and per-frame video token layouts, one media piece per
image and per frame, pixels in prompt order, and the refusals (the target contract runs for every family in
test_target_contract.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from families import FAMILIES, build_target
from mmspec_ray.targets import Request, TargetError, wrap
from mmspec_ray.targets.internvl import InternVLTarget
from tiny import random_image
from tiny_internvl import CONTEXT, END_IMAGE, START_IMAGE, TILE, TOKENS_PER_TILE, VIDEO

REQUESTS = FAMILIES["internvl"].requests
(WIDE,) = REQUESTS["image"].images  # 96x60: 2x1 tiles + thumbnail
SQUARE = REQUESTS["two_images"].images[0]  # 96x96: 2x2 tiles + thumbnail
CLIP = REQUESTS["video"].videos[0]  # 4 frames


@pytest.fixture(scope="module")
def target():
    return build_target("internvl")


def test_registry_picks_internvl(target):
    assert type(target) is InternVLTarget
    assert target.takes_video and not target.video_as_frames
    assert target.media_token_ids == {target.tokenizer.convert_tokens_to_ids(CONTEXT)}  # no video token id


def test_media_tokens_and_pieces_per_image_and_frame(target):
    """An image is one run of tiles * 16 context tokens (thumbnail included); a clip is one run per frame."""
    wide, square, frame = 3 * TOKENS_PER_TILE, 5 * TOKENS_PER_TILE, TOKENS_PER_TILE
    cases = {  # request -> (context tokens, <img> runs, media pieces)
        "text": (REQUESTS["text"], []),
        "image": (REQUESTS["image"], [wide]),
        "two_images": (REQUESTS["two_images"], [square, wide]),
        "video": (REQUESTS["video"], [frame] * len(CLIP)),
        "image_and_video": (Request(prompt="a", images=(SQUARE,), videos=(CLIP,)), [square] + [frame] * len(CLIP)),
        "two_clips": (Request(prompt="a", videos=(CLIP, CLIP[::-1])), [frame] * 2 * len(CLIP)),
        "small_image": (Request(prompt="a", images=(random_image(20, 20, seed=6),)), [frame]),  # 1 tile, no thumbnail
    }
    start, end = (target.tokenizer.convert_tokens_to_ids(t) for t in (START_IMAGE, END_IMAGE))
    for name, (req, pieces) in cases.items():
        inputs = target.encode(req)
        ids = inputs["input_ids"]
        assert int(target.media_mask_of(ids).sum()) == sum(pieces), name
        assert int((ids == start).sum()) == int((ids == end).sum()) == len(pieces), name  # one <img> run per piece
        assert inputs.get("pixel_values", torch.zeros(0)).shape[0] * TOKENS_PER_TILE == sum(pieces), name
        out = target.prefill(inputs)
        spans = target.media_pieces(ids[0], inputs)
        assert [b - a for a, b in spans] == pieces and spans == target.media_pieces(ids[0]), name
        for a, b in spans:  # each piece is exactly the inside of one <img> ... </img>
            assert int(ids[0, a - 1]) == start and int(ids[0, b]) == end, name
        assert int(out.media_segments.max()) == len(pieces) - 1, name
        with torch.inference_mode():
            assert torch.allclose(target.lm_head(out.hidden[:, -1:]).float(), out.logits, atol=1e-5)


def test_video_frames_are_labelled_images(target):
    """The clip goes through the video processor (one tile per frame, never cropped) and reaches the model as
    `pixel_values` after the image tiles, in prompt order; the prompt labels each frame."""
    text = target.processor.apply_chat_template(target.messages(REQUESTS["video"]), add_generation_prompt=True,
                                                tokenize=False)
    assert VIDEO in text
    inputs = target.encode(Request(prompt="a", images=(SQUARE,), videos=(CLIP,)))
    assert "pixel_values_videos" not in inputs and inputs["pixel_values"].shape == (5 + len(CLIP), 3, TILE, TILE)
    decoded = target.tokenizer.decode(inputs["input_ids"][0])
    assert all(f"Frame{i + 1}: {START_IMAGE}" in decoded for i in range(len(CLIP)))
    assert decoded.index(START_IMAGE) < decoded.index("Frame1:")  # the image first, as the parts name them
    frames = target.processor.video_processor(videos=[list(CLIP)], return_tensors="pt")["pixel_values_videos"]
    assert torch.equal(inputs["pixel_values"][5:], frames[0])


def test_explicit_order_reaches_the_model(target):
    """A video part before an image part: the frames' pixels come first, so the answer differs from the reverse."""
    def parts(*kinds: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": k} for k in kinds] + [{"type": "text", "text": "a"}]}]

    video_first = target.encode(Request(messages=parts("video", "image"), images=(SQUARE,), videos=(CLIP,)))
    image_first = target.encode(Request(messages=parts("image", "video"), images=(SQUARE,), videos=(CLIP,)))
    assert torch.equal(video_first["pixel_values"][:len(CLIP)], image_first["pixel_values"][5:])
    assert not torch.allclose(target.prefill(video_first).logits, target.prefill(image_first).logits)


def test_a_clip_changes_the_answer(target):
    """The clip's pixels reach the model: a reversed clip (same tokens) gives other logits."""
    a = target.prefill(target.encode(REQUESTS["video"])).logits
    b = target.prefill(target.encode(Request(prompt="what is happening", videos=(CLIP[::-1],)))).logits
    assert not torch.allclose(a, b)


def test_requests_it_cannot_take_are_clear_errors(target):
    with pytest.raises(TargetError, match=r"internvl targets need every clip of a request to have the same number "
                                          r"of frames \(got \[3, 4\]\)"):
        target.encode(Request(prompt="a", videos=(CLIP, CLIP[:3])))
    with pytest.raises(TargetError, match="video 0 has no frames"):
        target.encode(Request(prompt="a", videos=((),)))
    parts = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "a"}]}]
    with pytest.raises(TargetError, match=r"name 0 image\(s\) and 1 video\(s\) but the request carries 1 image"):
        target.encode(Request(messages=parts, images=(WIDE,)))
    with pytest.raises(TargetError, match=r"prompt contains the image placeholder token '<IMG_CONTEXT>'"):
        target.encode(Request(prompt=f"a {CONTEXT} b", images=(WIDE,)))
    no_video = copy.copy(target.processor)
    no_video.video_processor = None
    with pytest.raises(TargetError, match="this internvl target's processor has no video processor"):
        wrap(target.model, no_video).encode(REQUESTS["video"])
    bare = wrap(target.model, target.processor.tokenizer)  # AutoProcessor's fallback without torchvision
    assert torch.equal(bare.encode(REQUESTS["text"])["input_ids"], target.encode(REQUESTS["text"])["input_ids"])
    with pytest.raises(TargetError, match="no image processor"):
        bare.encode(REQUESTS["image"])
