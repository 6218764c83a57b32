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
        assert torch.allclose(t.lm_head(out.hidden[:, -1:]).float(), out.logits, atol=1e-5)
    assert out.inputs_embeds.shape == out.hidden.shape


def test_prompt_longer_than_context_is_refused(target):
    t = wrap(target.model, target.processor)
    with pytest.raises(TargetError, match="exceeds the target's context"):
        t.check_length(t.max_context - 3, 10)


def test_missing_processor_and_template_are_clear_errors(target):
    with pytest.raises(TargetError, match="no processor"):
        wrap(target.model, None)


def test_prefill_computes_only_the_logits_asked_for(target):
    """A long prompt's [L, V] logits are never materialised: the last position by default, k or all on request."""
    inputs = target.encode(REQUESTS["two_images"])
    L, V = inputs["input_ids"].shape[1], target.vocab_size
    with torch.inference_mode():
        full = target.model(**inputs).logits.float()
    last = target.prefill(inputs)
    assert last.logits.shape == (1, 1, V) and last.hidden.shape[1] == L
    assert torch.allclose(last.logits[0, -1], full[0, -1], atol=1e-5)
    assert target.prefill(inputs, logits_to_keep=3).logits.shape == (1, 3, V)
    assert torch.allclose(target.prefill(inputs, logits_to_keep=0).logits, full, atol=1e-5)


def test_commit_compacts_in_place_without_copying_the_context(target):
    """A non-chain commit moves only the accepted slots: the cache tensors keep their storage (no [L + n] copy)
    and hold exactly the prefix plus the accepted nodes' KV."""
    inputs = target.encode(REQUESTS["image"])
    target.prefill(inputs)
    L = target.seq_len
    tokens = torch.tensor([17, 42, 99, 120, 7])
    parents = [-1, 0, 0, 2, 1]  # keep root -> node 2 -> node 3: not a chain prefix
    anc = torch.eye(5, dtype=torch.bool)
    for i in range(1, 5):
        anc[i] |= anc[parents[i]]
    target.verify(tokens, anc, torch.tensor([0, 1, 1, 2, 2]))
    layer = target.cache.layers[0]
    before = layer.keys.clone()
    ptrs = [(lay.keys.data_ptr(), lay.values.data_ptr()) for lay in target.cache.layers]
    target.commit([0, 2, 3])
    assert [(lay.keys.data_ptr(), lay.values.data_ptr()) for lay in target.cache.layers] == ptrs
    assert target.seq_len == L + 3 and layer.keys.shape[-2] == L + 3
    assert torch.equal(layer.keys[..., :L, :], before[..., :L, :])
    assert torch.equal(layer.keys[..., L:, :], before[..., [L, L + 2, L + 3], :])
