"""LLaVA family on a tiny random-init LLaVA: media accounting, features, clear errors. The target contract (tree
verify, AR == HF generate, commit) runs for every family in test_target_contract.py."""

from __future__ import annotations

import pytest
import torch

from mmspec_ray.targets import TargetError, wrap
from families import FAMILIES, build_target


@pytest.fixture(scope="module")
def target():
    return build_target("llava")


REQUESTS = FAMILIES["llava"].requests


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
