"""Mistral3 family on a tiny random-init Mistral3ForConditionalGeneration: the Pixtral token layout (rows of [IMG]
joined by [IMG_BREAK], closed by [IMG_END]), one media piece per image (the mask covering exactly the pieces), 1-D
positions, and the explicit refusals (clips, typed layout tokens, placeholder/image mismatches). The target contract
runs for every family in test_target_contract.py."""

from __future__ import annotations

import re

import pytest
import torch

from mmspec_ray.targets import InvalidRequest, Request, TargetError, families, wrap
from mmspec_ray.targets.base import media_runs, pieces_of
from mmspec_ray.targets.mistral3 import Mistral3Target
from families import FAMILIES, build_target
from tiny import random_images, tiny_fast_tokenizer
from tiny_mistral3 import IMG, IMG_BREAK, IMG_END, build_processor

REQUESTS = FAMILIES["mistral3"].requests
SQUARE, WIDE = REQUESTS["two_images"].images  # 96x96 -> 64x64: 4x4 cells; 96x60 -> 64x40 -> 64x48: 3 rows x 4


@pytest.fixture(scope="module")
def target():
    return build_target("mistral3")


def layout(rows: int, cols: int) -> list[str]:
    """The token layout of one image of rows x cols cells, as PixtralProcessor writes it."""
    out = ([IMG] * cols + [IMG_BREAK]) * rows
    return out[:-1] + [IMG_END]


def test_registry_picks_mistral3(target):
    assert type(target) is Mistral3Target and families()["mistral3"] is Mistral3Target
    assert not target.takes_video and not target.video_as_frames
    assert target.media_token_ids == {target.config.image_token_id, target.tokenizer.convert_tokens_to_ids(IMG_BREAK)}


def test_image_rows_breaks_and_end_and_one_piece_per_image(target):
    inputs = target.encode(REQUESTS["two_images"])
    ids = inputs["input_ids"][0]
    tokens = target.tokenizer.convert_ids_to_tokens(ids.tolist())
    start = tokens.index(IMG)
    assert tokens[start:start + 20 + 15] == layout(4, 4) + layout(3, 4)
    assert inputs["image_sizes"].tolist() == [[64, 64], [48, 64]]
    # pieces: one per image, its rows and inner breaks; the [IMG_END] that closes it stays outside
    square, wide = (start, start + 19), (start + 20, start + 34)
    assert target.media_pieces(ids) == [square, wide]
    assert [tokens[b] for _, b in (square, wide)] == [IMG_END, IMG_END]
    out = target.prefill(inputs)
    assert pieces_of(out.media_segments[0]) == [square, wide]
    # the media mask is [IMG] (where the vision features go) and [IMG_BREAK], and exactly the pieces' positions
    assert torch.equal(out.media_mask[0], out.media_segments[0] >= 0)
    assert [tokens[i] for i in torch.nonzero(out.media_mask[0]).flatten()].count(IMG_BREAK) == 3 + 2
    assert int((ids == target.config.image_token_id).sum()) == 16 + 12
    # [IMG] alone would cut the images at every row
    assert len(media_runs(ids == target.config.image_token_id)) == 4 + 3


def test_prefill_positions_are_one_dimensional_and_images_reach_the_decoder(target):
    inputs = target.encode(REQUESTS["image"])
    out = target.prefill(inputs)
    n = inputs["input_ids"].shape[1]
    assert target.seq_len == target.next_pos == n
    assert target.tree_positions(torch.tensor([0, 1, 1, 2])).tolist() == [[n, n + 1, n + 1, n + 2]]
    with torch.inference_mode():
        assert torch.allclose(target.lm_head(out.hidden[:, -1:]).float(), out.logits, atol=1e-5)
    other = target.prefill(target.encode(Request(prompt="describe the image", images=(random_images(1, seed=9)[0],))))
    assert float((other.logits[0, -1] - out.logits[0, -1]).abs().max()) > 1e-3


def test_clip_is_refused_with_a_clear_error(target):
    clip = tuple(random_images(4, seed=3))
    with pytest.raises(TargetError, match="mistral3 targets take no video.*send a few chosen frames as images"):
        target.encode(Request(prompt="what is happening", videos=(clip,)))
    inputs = target.encode(Request(prompt="what is happening", images=clip[:2]))  # the suggested workaround works
    assert len(target.media_pieces(inputs["input_ids"][0])) == 2


@pytest.mark.parametrize("token", [IMG_BREAK, IMG_END])
def test_typed_layout_tokens_are_refused_naming_the_field(target, token):
    with pytest.raises(InvalidRequest, match=rf"^prompt contains the image layout token '{re.escape(token)}'; remove"):
        target.encode(Request(prompt=f"describe {token} this", images=(WIDE,)))
    parts = [{"type": "image"}, {"type": "text", "text": f"{token}describe"}]
    with pytest.raises(InvalidRequest, match=r"^messages\[0\]\.content\[1\]\.text contains the image layout"):
        target.encode(Request(messages=[{"role": "user", "content": parts}], images=(WIDE,)))


def test_placeholder_image_mismatch_is_a_target_error(target):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "hi"}]}]
    with pytest.raises(TargetError, match=r"name 2 image\(s\) and 0 video\(s\) but the request carries 1 image"):
        target.encode(Request(messages=messages, images=(SQUARE,)))


def test_tokenizer_without_layout_tokens_and_missing_processor_are_clear_errors(target):
    tok = tiny_fast_tokenizer([IMG], extra_special_tokens={"image_token": IMG}, eos_token="</s>")
    with pytest.raises(TargetError, match=r"tokenizer has no \[IMG_BREAK\] / \[IMG_END\] token"):
        wrap(target.model, build_processor(tok))
    with pytest.raises(TargetError, match="no processor"):
        wrap(target.model, None)
