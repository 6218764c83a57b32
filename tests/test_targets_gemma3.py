"""Gemma3 family on a tiny random-init Gemma3ForConditionalGeneration whose sliding window (6) is far shorter than
every prompt and than the deeper trees: deep tree verify, the window really cutting attention, bidirectional image
prefill, output head / softcapping. The target contract (tree verify == each path, AR == HF generate where HF keeps
a window-sized cache and the adapter keeps all KV and masks by position, commit) runs on every standard request in
test_target_contract.py; test_standard_prompts_outlast_the_window pins down that those prompts exceed the window."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Gemma3ForConditionalGeneration

from mmspec_ray.targets import Request, TargetError, families, wrap
from mmspec_ray.targets.gemma3 import Gemma3Target
from families import FAMILIES, build_target
from target_checks import LOGIT_TOL, path_to
from tiny import random_images
from tiny_gemma3 import LOGIT_SOFTCAP, SLIDING_WINDOW, TOKENS_PER_IMAGE


@pytest.fixture(scope="module")
def target():
    return build_target("gemma3")


REQUESTS = FAMILIES["gemma3"].requests  # the video is sent as its 3 frames


def chain(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones((n, n), dtype=torch.bool).tril(), torch.arange(n)


def test_registry_picks_gemma3_and_reads_the_window(target):
    assert isinstance(target, Gemma3Target)
    assert families()["gemma3"] is Gemma3Target
    assert target.sliding_window == SLIDING_WINDOW
    assert "sliding_attention" in target.layer_types and "full_attention" in target.layer_types


@pytest.mark.parametrize("name", list(REQUESTS))
def test_standard_prompts_outlast_the_window(target, name):
    """The contract checks (test_target_contract.py) run on these prompts: the window cuts every one of them."""
    assert target.encode(REQUESTS[name])["input_ids"].shape[1] > 3 * SLIDING_WINDOW


@pytest.mark.parametrize("name", ["text", "two_images"])
def test_verify_deep_branches_longer_than_the_window(target, name):
    """Two 9-deep branches under one root: deep nodes' windows exclude the root and their shallow ancestors too."""
    k = 9
    assert k + 1 > SLIDING_WINDOW
    parents = [-1] + [0] + list(range(1, k)) + [0] + list(range(k + 1, 2 * k))
    n = len(parents)
    anc = torch.zeros((n, n), dtype=torch.bool)
    depth = torch.zeros(n, dtype=torch.long)
    for i, p in enumerate(parents):
        anc[i, i] = True
        if p >= 0:
            anc[i] |= anc[p]
            depth[i] = depth[p] + 1
    tokens = torch.tensor(np.random.default_rng(5).integers(5, 250, size=n))
    inputs = target.encode(REQUESTS[name])
    target.prefill(inputs)
    tree = target.verify(tokens, anc, depth)
    worst = 0.0
    for leaf in (k, 2 * k):
        path = path_to(leaf, torch.tensor(parents))
        assert len(path) == k + 1
        target.prefill(inputs)
        ref = target.verify(tokens[path], *chain(len(path)))
        for a, b in ((tree.logits[0, path], ref.logits[0]), (tree.hidden[0, path], ref.hidden[0])):
            worst = max(worst, float((a - b).abs().max()))
    assert worst < LOGIT_TOL, worst


def test_sliding_window_really_cuts_attention(target):
    """Were the window ignored (in prefill or in verify), these tests would see different logits."""
    inputs = target.encode(REQUESTS["image"])
    toks = torch.tensor([17, 42, 99, 120, 7, 64, 31, 200, 150, 11])
    base = target.prefill(inputs)
    windowed = target.verify(toks, *chain(len(toks)))
    # verify: the sliding layer given the global mask instead of its window
    wide = wrap(target.model, target.processor)
    wide.sliding_window = None
    wide.prefill(inputs)
    unwindowed = wide.verify(toks, *chain(len(toks)))
    assert float((windowed.logits - unwindowed.logits).abs().max()) > 1e-3
    # prefill: the model itself with a window longer than the prompt
    tc = target.model.config.get_text_config()
    try:
        tc.sliding_window = 10_000
        no_window = target.prefill(inputs)
    finally:
        tc.sliding_window = SLIDING_WINDOW
    assert float((base.logits[0, -1] - no_window.logits[0, -1]).abs().max()) > 1e-3


def test_prefill_image_tokens_attend_bidirectionally(target):
    inputs = target.encode(REQUESTS["two_images"])
    tt = inputs["token_type_ids"][0]
    assert int(tt.sum()) == 2 * TOKENS_PER_IMAGE
    bidir = target.prefill(inputs, logits_to_keep=0)
    causal = target.prefill({k: v for k, v in inputs.items() if k != "token_type_ids"}, logits_to_keep=0)
    first = int(tt.nonzero()[0])
    diff = (bidir.logits[0] - causal.logits[0]).abs().amax(-1)
    assert float(diff[:first].max()) == 0.0  # text before the first image is unaffected
    assert float(diff[first:first + TOKENS_PER_IMAGE - 1].min()) > 1e-4  # earlier image tokens see later ones


def test_media_mask_features_and_output_head(target):
    t = wrap(target.model, target.processor, feature_layers=(1,))
    for name, n_images in (("two_images", 2), ("video", 3)):
        inputs = t.encode(REQUESTS[name])
        out = t.prefill(inputs)
        assert int(out.media_mask.sum()) == n_images * TOKENS_PER_IMAGE
        assert bool((out.media_mask == (inputs["token_type_ids"] == 1)).all())
        assert out.hidden.shape == (1, inputs["input_ids"].shape[1], t.hidden_size)
        assert set(out.layers) == {1} and out.layers[1].shape == out.hidden.shape
        assert out.inputs_embeds.shape == out.hidden.shape
        # hidden_states[-1] is post-norm, and the model does not softcap although the config names a cap
        assert t.logit_softcap is None
        assert float(out.logits.abs().max()) > 1.2 * LOGIT_SOFTCAP  # capping would show
        with torch.inference_mode():
            assert torch.allclose(t.lm_head(out.hidden[:, -1:]).float(), out.logits, atol=1e-5)
            v = t.verify(torch.tensor([17, 42, 99]), *chain(3))
            assert torch.allclose(t.lm_head(v.hidden).float(), v.logits, atol=1e-5)


class _SoftcappedGemma3(Gemma3ForConditionalGeneration):
    """Stands in for a model (or a future transformers) that applies final_logit_softcapping in forward."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        cap = self.config.get_text_config().final_logit_softcapping
        out.logits = torch.tanh(out.logits / cap) * cap
        return out


def test_lm_head_follows_a_softcapping_model(target):
    capped = _SoftcappedGemma3(target.model.config)
    capped.load_state_dict(target.model.state_dict())
    t = wrap(capped.eval(), target.processor)
    out = t.prefill(t.encode(REQUESTS["image"]))
    assert t.logit_softcap == LOGIT_SOFTCAP
    assert float(out.logits.abs().max()) <= LOGIT_SOFTCAP
    with torch.inference_mode():
        assert torch.allclose(t.lm_head(out.hidden[:, -1:]).float(), out.logits, atol=1e-5)


def test_head_that_matches_nothing_is_a_target_error(target):
    class Broken(Gemma3ForConditionalGeneration):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits + 1.0
            return out

    broken = Broken(target.model.config)
    broken.load_state_dict(target.model.state_dict())
    t = wrap(broken.eval(), target.processor)
    with pytest.raises(TargetError, match="does not reproduce the model's logits"):
        t.prefill(t.encode(REQUESTS["text"]))


def test_placeholder_image_mismatch_is_a_target_error(target):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "hi"}]}]
    with pytest.raises(TargetError, match=r"name 2 image\(s\) and 0 video\(s\) but the request carries 1 image"):
        target.encode(Request(messages=messages, images=tuple(random_images(1))))


def test_prompt_longer_than_context_is_refused(target):
    with pytest.raises(TargetError, match="exceeds the target's context"):
        target.check_length(target.max_context - 3, 10)
