"""LLaVA family (and the AR engine) on a tiny random-init LLaVA: tree verify, commit, AR == HF generate."""

from __future__ import annotations

import pytest
import torch

from mmspec_ray.targets import Request, TargetError, wrap
from target_checks import check_ar_equals_hf, check_commit_then_continue, check_verify_matches_paths
from tiny import random_images, tiny_llava


@pytest.fixture(scope="module")
def target():
    return wrap(*tiny_llava())


REQUESTS = {
    "text": Request(prompt="describe the image"),
    "image": Request(prompt="describe the image", images=tuple(random_images(1, seed=1))),
    "two_images": Request(prompt="what is there", images=tuple(random_images(2, seed=2))),
    "video": Request(prompt="what is happening", videos=(tuple(random_images(4, seed=3)),)),
}


@pytest.mark.parametrize("name", list(REQUESTS))
def test_verify_tree_matches_each_path(target, name):
    for seed in range(3):
        check_verify_matches_paths(target, REQUESTS[name], n=14, seed=seed)


@pytest.mark.parametrize("name", list(REQUESTS))
def test_ar_equals_hf_generate_and_is_varied(target, name):
    ids = check_ar_equals_hf(target, REQUESTS[name], max_new_tokens=32)
    assert len(set(ids)) >= 8, ids


@pytest.mark.parametrize("name", ["image", "video"])
def test_commit_then_continue(target, name):
    check_commit_then_continue(target, REQUESTS[name], steps=16)


def test_prefill_reports_media_mask_and_features(target):
    t = wrap(target.model, target.processor, feature_layers=(1,))
    inputs = t.encode(REQUESTS["two_images"])
    out = t.prefill(inputs)
    assert int(out.media_mask.sum()) == 2 * 9
    assert out.hidden.shape == (1, inputs["input_ids"].shape[1], t.hidden_size)
    assert set(out.layers) == {1} and out.layers[1].shape == out.hidden.shape
    with torch.inference_mode():
        assert torch.allclose(t.lm_head(out.hidden).float(), out.logits, atol=1e-5)
    assert out.inputs_embeds.shape == out.hidden.shape


def test_prompt_longer_than_context_is_refused(target):
    t = wrap(target.model, target.processor)
    with pytest.raises(TargetError, match="exceeds the target's context"):
        t.check_length(t.max_context - 3, 10)


def test_missing_processor_and_template_are_clear_errors(target):
    with pytest.raises(TargetError, match="no processor"):
        wrap(target.model, None)
