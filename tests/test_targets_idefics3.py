"""Idefics3 / SmolVLM family on a tiny random-init Idefics3: media mask, image splitting, and the clear refusal of
clips (Idefics3 has no video input). The target contract runs for every family in test_target_contract.py."""

from __future__ import annotations

import pytest
import torch

from mmspec_ray.targets import Request, TargetError, families, wrap
from mmspec_ray.targets.idefics3 import Idefics3Target
from families import FAMILIES, build_target
from tiny import random_images
from tiny_idefics3 import ROW_COL, TOKENS_PER_SUB_IMAGE


@pytest.fixture(scope="module")
def target():
    return build_target("idefics3")


REQUESTS = FAMILIES["idefics3"].requests
SQUARE, WIDE = REQUESTS["two_images"].images  # 96x96 -> 2x2 tiles + global view; 96x48 -> 1x2 tiles + global view


def test_registry_picks_idefics3(target):
    assert isinstance(target, Idefics3Target)
    assert families()["idefics3"] is Idefics3Target

def test_images_are_split_and_media_mask_counts_image_tokens(target):
    t = wrap(target.model, target.processor, feature_layers=(1,))
    inputs = t.encode(REQUESTS["two_images"])
    ids = inputs["input_ids"][0].tolist()
    tok = t.tokenizer
    # square: 4 tiles + global, wide: 2 tiles + global; every tile and global view gives TOKENS_PER_SUB_IMAGE
    assert inputs["pixel_values"].shape[:2] == (1, 5 + 3)
    n_image = (5 + 3) * TOKENS_PER_SUB_IMAGE
    tiles = [tok.convert_ids_to_tokens(i) for i in ids if tok.convert_ids_to_tokens(i) in ROW_COL]
    assert tiles == ["<row_1_col_1>", "<row_1_col_2>", "<row_2_col_1>", "<row_2_col_2>",
                     "<row_1_col_1>", "<row_1_col_2>"]
    assert ids.count(tok.convert_tokens_to_ids("<global-img>")) == 2
    out = t.prefill(inputs)
    assert int(out.media_mask.sum()) == n_image == ids.count(t.config.image_token_id)
    # only the <image> slots are media; the wrapper tokens (fake/row-col/global) are text
    assert not bool(out.media_mask[0, [i for i, x in enumerate(ids) if x != t.config.image_token_id]].any())
    assert out.hidden.shape == (1, len(ids), t.hidden_size)
    assert set(out.layers) == {1} and out.layers[1].shape == out.hidden.shape
    with torch.inference_mode():
        assert torch.allclose(t.lm_head(out.hidden[:, -1:]).float(), out.logits, atol=1e-4)
    assert out.inputs_embeds.shape == out.hidden.shape
    # the image features really reach the decoder: another image changes the prompt's last logits
    other = t.prefill(t.encode(Request(prompt="what is there", images=(random_images(1, seed=9)[0], WIDE))))
    assert float((other.logits[0, -1] - out.logits[0, -1]).abs().max()) > 1e-3


def test_clip_is_refused_with_a_clear_error(target):
    clip = tuple(random_images(4, seed=3))
    with pytest.raises(TargetError, match="idefics3 targets take no video.*send a few chosen frames as images"):
        target.encode(Request(prompt="what is happening", videos=(clip,)))
    # the suggested workaround works: the same frames as images
    inputs = target.encode(Request(prompt="what is happening", images=clip[:2]))
    assert int((inputs["input_ids"] == target.config.image_token_id).sum()) == 2 * 5 * TOKENS_PER_SUB_IMAGE


def test_placeholder_image_mismatch_is_a_target_error(target):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "hi"}]}]
    with pytest.raises(TargetError, match=r"name 2 image\(s\) and 0 video\(s\) but the request carries 1 image"):
        target.encode(Request(messages=messages, images=(SQUARE,)))


def test_missing_processor_is_a_clear_error(target):
    with pytest.raises(TargetError, match="no processor"):
        wrap(target.model, None)
