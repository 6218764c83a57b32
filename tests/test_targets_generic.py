"""The generic adapter (targets/generic.py) and its self-check: forced onto families that have their own adapter it
passes and decodes losslessly; on a model type with no adapter (a tiny VipLLaVA) `load_target` takes it; where its
assumptions are wrong (Qwen2.5-VL's M-RoPE, positions or masks broken on purpose) the self-check refuses the target
and says which check differed, where and with which ids."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import VipLlavaConfig, VipLlavaForConditionalGeneration

from mmspec_ray.decoding.engine import AREngine, SpecEngine
from mmspec_ray.decoding.tree import TreeConfig
from mmspec_ray.drafters.eagle import Eagle2Drafter
from mmspec_ray.targets import Request, TargetError, load_target, wrap
from mmspec_ray.targets import generic
from mmspec_ray.targets.generic import GenericTarget, SelfCheckFailed, wrap_generic
from mmspec_ray.targets.registry import check_loadable
from families import FAMILIES
from tiny import mute_eos, random_images, seeded_model, tiny_llava

TREE = TreeConfig(top_k=4, depth=4, total_tokens=20)
CHECKS = ("AR decoding (one token per forward)",
          "tree decoding (speculative, random draft trees that hide HF's answer among distractors)",
          "chain decoding (speculative, HF's answer drafted as a chain)")


def check_lossless(target, requests, named=None, new_tokens: int = 32) -> None:
    """HF generate == AR == SpecEngine with a random EAGLE-2 drafter, token for token, on every request (and == the
    family's own adapter's AR answer when `named` is given)."""
    for name, req in requests.items():
        ar = AREngine(target).generate(req, max_new_tokens=new_tokens).token_ids
        assert len(set(ar)) >= 8, (name, ar)
        inputs = target.encode(req)
        with torch.inference_mode():
            hf = target.model.generate(**inputs, do_sample=False, max_new_tokens=new_tokens)
        assert ar == hf[0, inputs["input_ids"].shape[1]:].tolist(), name
        spec = SpecEngine(target, Eagle2Drafter.random(target, seed=1), TREE).generate(req, max_new_tokens=new_tokens)
        assert spec.token_ids == ar, name
        if named is not None:
            assert AREngine(named).generate(req, max_new_tokens=new_tokens).token_ids == ar, name


def passed(target) -> None:
    report = target.self_check
    assert type(target) is GenericTarget and report is not None
    assert report.probe == "text + 1 image(s) (80x64), greedy, up to 16 new tokens"
    assert report.compared == {c: 16 for c in CHECKS}
    assert len(report.answer) == 16 and len(set(report.answer)) >= 4, report.answer
    assert report.tree_paths >= 2 and report.max_logit_diff < 1e-4


@pytest.mark.parametrize("family", ["llava", "idefics3", "gemma3", "mistral3"])
def test_forced_generic_passes_its_self_check_and_decodes_losslessly(family):
    """LLaVA (plain), Idefics3 (tiled images), Gemma3 (sliding-window layers, bidirectional image attention at
    prefill) and Mistral3 (image rows joined by break tokens) need nothing the generic adapter lacks for decoding:
    it passes, and answers as the family's adapter."""
    model, processor = FAMILIES[family].builder()
    named = wrap(model, processor)
    assert type(named) is not GenericTarget and getattr(named, "self_check", None) is None
    target = wrap(model, processor, generic=True)
    passed(target)
    reqs = {k: v for k, v in FAMILIES[family].requests.items() if k in ("text", "image", "two_images")}
    check_lossless(target, reqs, named=named)
    with pytest.raises(TargetError, match="generic targets take no video"):
        target.encode(FAMILIES["llava"].requests["video"])


def test_forced_generic_qwen2_5_vl_is_refused_by_its_self_check():
    """Qwen2.5-VL numbers positions with 3-axis M-RoPE: after an image the next position is not the prompt length.
    The generic adapter does not know that, so its AR answer parts from HF's and the self-check says so."""
    model, processor = FAMILIES["qwen2_5_vl"].builder()
    with pytest.raises(SelfCheckFailed) as e:
        wrap(model, processor, generic=True)
    msg = str(e.value)
    assert msg.startswith("the generic adapter failed its self-check on this qwen2_5_vl model (GenericTarget), so it "
                          "would not decode it losslessly: AR decoding (one token per forward) differs from HF "
                          "generate at answer token "), msg
    assert "HF chose " in msg and ", ours " in msg and "; HF [" in msg
    assert "Probe: text + 1 image(s) (80x64), greedy, up to 16 new tokens." in msg
    assert msg.endswith("To decode it: model type 'qwen2_5_vl' has its own adapter: load it without generic=True")
    assert type(wrap(model, processor)).family == "qwen2_5_vl"  # its own adapter is fine


class OffByOne(GenericTarget):
    """Every generated position one too far."""

    def tree_positions(self, depth: torch.Tensor) -> torch.Tensor:
        return super().tree_positions(depth) + 1


class DepthTwice(GenericTarget):
    """Right for a root alone (AR steps), wrong below it: a node at depth d gets next_pos + 2d."""

    def tree_positions(self, depth: torch.Tensor) -> torch.Tensor:
        return super().tree_positions(2 * depth)


class SiblingsSeeEachOther(GenericTarget):
    """A causal mask over the tree's node order instead of its ancestors: right for a chain, wrong for a tree."""

    def tree_mask(self, ancestors, depth, cached_depth=None):
        return super().tree_mask(torch.ones_like(ancestors).tril(), depth, cached_depth)


@pytest.mark.parametrize("cls,what", [
    (OffByOne, r"AR decoding \(one token per forward\) differs from HF generate at answer token \d+ \(the \d+ before "
               r"it agree\): HF chose \d+ \(.*\), ours \d+ \(.*\); HF \[.*\], ours \[.*\]"),
    (DepthTwice, r"tree decoding \(speculative, random draft trees that hide HF's answer among distractors\) differs "
                 r"from HF generate at answer token \d+"),
    (SiblingsSeeEachOther, r"tree verification differs from running each path alone: node \d+ \(depth \d+\) on the "
                           r"path \[0, .*\] of a random 12-node tree (picks \d+ in the tree and \d+ alone|has logits "
                           r"that differ by up to .* in the tree and alone \(logit scale .*; float32 allows 0.001 of "
                           r"it\)); the tree's attention mask or positions are not what this model needs"),
], ids=["positions-off-by-one", "depth-counted-twice", "siblings-see-each-other"])
def test_a_broken_generic_adapter_is_refused_naming_what_differed(cls, what):
    model, processor = tiny_llava()
    with pytest.raises(SelfCheckFailed, match=rf"^the generic adapter failed its self-check on this llava model "
                                              rf"\({cls.__name__}\), so it would not decode it losslessly: {what}"):
        wrap_generic(model, processor, cls=cls)
    assert wrap_generic(model, processor).self_check is not None  # the same model passes with the real adapter


def test_a_probe_that_cannot_run_is_refused_with_its_error():
    model, processor = tiny_llava()
    broken = copy.copy(processor)
    broken.image_processor = copy.copy(processor.image_processor)
    broken.image_processor.preprocess = None  # calling it raises TypeError inside the processor
    with pytest.raises(SelfCheckFailed, match=r"self-check on this llava model \(GenericTarget\), so it would not "
                                              r"decode it losslessly: the probe could not run: TypeError: "):
        wrap_generic(model, processor=broken)


# ---------------------------------------------------------------- a model type with no adapter: load_target


def tiny_vipllava(seed: int = 0):
    """VipLLaVA (no adapter here): LLaVA-1.5's tiny CLIP tower and Llama with features from two vision layers,
    layer-normed then projected; LLaVA's processor."""
    llava, processor = tiny_llava(seed)
    config = VipLlavaConfig(vision_config=copy.deepcopy(llava.config.vision_config),
                            text_config=copy.deepcopy(llava.config.text_config),
                            image_token_index=llava.config.image_token_id, vision_feature_layer=[0, -1],
                            image_seq_length=9)
    model = seeded_model(VipLlavaForConditionalGeneration, config, seed)
    mute_eos(model, processor.tokenizer.eos_token_id)
    return model.eval(), processor


def save(model, processor, path):
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def test_a_model_type_without_an_adapter_loads_generic_after_its_self_check(tmp_path):
    model, processor = tiny_vipllava()
    path = save(model, processor, tmp_path / "vipllava")
    assert check_loadable(str(path)).model_type == "vipllava"  # a job's plan accepts it
    target = load_target(path)
    passed(target)
    assert target.checkpoint == str(path)
    check_lossless(target, {k: FAMILIES["llava"].requests[k] for k in ("text", "image", "two_images")})


def tiny_paligemma(seed: int = 0):
    """PaliGemma (no adapter here): a 1-layer SigLIP tower at 32 px (4 patches), a 2-layer Gemma; its processor
    returns `labels` with every encoding."""
    from transformers import (PaliGemmaConfig, PaliGemmaForConditionalGeneration, PaliGemmaProcessor,
                              SiglipImageProcessor)
    from tiny import tiny_fast_tokenizer

    tok = tiny_fast_tokenizer(["<image>", "<bos>", "<eos>", "<pad>"], bos_token="<bos>", eos_token="<eos>",
                              pad_token="<pad>")
    images = SiglipImageProcessor(size={"height": 32, "width": 32})
    images.image_seq_length = 4
    template = ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}"
                "{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}")
    processor = PaliGemmaProcessor(image_processor=images, tokenizer=tok, chat_template=template)
    config = PaliGemmaConfig(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=16, projection_dim=64),
        text_config=dict(model_type="gemma", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
        image_token_index=tok.convert_tokens_to_ids("<image>"), projection_dim=64)
    model = seeded_model(PaliGemmaForConditionalGeneration, config, seed)
    mute_eos(model, tok.eos_token_id)
    return model.eval(), processor


def test_a_processors_labels_never_reach_the_forward(tmp_path):
    """PaliGemma's processor returns `labels`; passed to the forward they made it compute a loss over logits cut to
    the last positions, and the self-check refused the model for a batch-size error that was not its own. Dropped,
    the model is judged on what it decodes: here it passes, and decodes as HF generate does."""
    model, processor = tiny_paligemma()
    path = save(model, processor, tmp_path / "paligemma")
    target = load_target(path)
    assert type(target) is GenericTarget and target.self_check is not None
    req = Request(prompt="describe the image", images=tuple(random_images(1, seed=3, size=32)))
    assert "labels" not in target.encode(req)
    other = Request(prompt="red blue circle", images=tuple(random_images(1, seed=4, size=32)))
    for name, request in {"image": req, "other image": other}.items():  # (PaliGemma's processor wants an image)
        ar = AREngine(target).generate(request, max_new_tokens=16).token_ids
        inputs = target.encode(request)
        with torch.inference_mode():
            hf = target.model.generate(**inputs, do_sample=False, max_new_tokens=16)
        assert ar == hf[0, inputs["input_ids"].shape[1]:].tolist(), name
        spec = SpecEngine(target, Eagle2Drafter.random(target, seed=1), TREE).generate(request, max_new_tokens=16)
        assert spec.token_ids == ar, name


def test_named_families_skip_the_self_check_and_generic_true_forces_it(tmp_path, monkeypatch):
    model, processor = tiny_llava()
    path = save(model, processor, tmp_path / "llava")
    calls = []
    real = generic.self_check
    monkeypatch.setattr(generic, "self_check", lambda t, *a, **k: calls.append(t) or real(t, *a, **k))
    assert type(load_target(path)).family == "llava" and calls == []
    forced = load_target(path, generic=True)
    assert calls == [forced]
    passed(forced)


def test_the_generic_path_needs_a_chat_template_and_an_image_text_to_text_model(tmp_path):
    model, processor = tiny_vipllava()
    processor = copy.deepcopy(processor)  # the tiny tokenizer is shared: never mutate it
    processor.chat_template = None
    processor.tokenizer.chat_template = None
    path = save(model, processor, tmp_path / "no-template")
    with pytest.raises(TargetError, match=r"checkpoint .*no-template: the generic adapter needs a chat template, and "
                                          r"the LlavaProcessor saved there has none; save one with the processor"):
        load_target(path)
    text_only = type("M", (), {"config": type("C", (), {"model_type": "llama"})()})()
    with pytest.raises(TargetError, match=r"model type 'llama' has no target adapter; supported: \[.*\]; nor can the "
                                          r"generic adapter take it: it loads image-text-to-text models only"):
        wrap(text_only, processor, generic=True)
