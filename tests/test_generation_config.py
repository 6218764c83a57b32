"""The checkpoint's generation config is obeyed as HF generate obeys it: every family's tiny
checkpoint, saved with a generation_config.json carrying a repetition penalty, custom eos ids and sampling defaults,
decodes greedy token for token as HF generate; the sampling distribution stays the target's with a penalty on;
settings that cannot be applied losslessly are refused, naming the setting."""

from __future__ import annotations


import pytest
import torch
from transformers import GenerationConfig, RepetitionPenaltyLogitsProcessor

from families import FAMILIES
from mmspec_ray.config import SamplingParams
from mmspec_ray.drafters.eagle import Eagle2Drafter
from mmspec_ray.drafters.ngram import NgramDrafter
from mmspec_ray.drafters.oracle import OracleDrafter
from mmspec_ray.decoding.engine import AREngine, SpecEngine
from mmspec_ray.decoding.processors import UnsupportedGenerationConfig, effective_generation_config, resolve_sampling
from mmspec_ray.decoding.tree import TreeConfig
from mmspec_ray.targets import Request, wrap
from test_engine import perturbed_oracle
from test_engine_paths import check_deep_sampling
from tiny import tiny_llava

TREE = TreeConfig(top_k=4, depth=4, total_tokens=20)
NEW = 32


def _hf(target, request: Request, **kw) -> list[int]:
    inputs = target.encode(request)
    with torch.inference_mode():
        out = target.model.generate(**inputs, max_new_tokens=NEW, **kw)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="module", params=list(FAMILIES))
def penalised(request, tmp_path_factory):
    """(family, plain target, the same checkpoint saved with a generation config: repetition penalty 1.4, an eos
    list naming a token the plain answer emits mid-way, sampling defaults that greedy decoding must ignore)."""
    family = FAMILIES[request.param]
    model, processor = family.builder()
    plain = wrap(model, processor)
    ask = family.requests["image"]
    answer = AREngine(plain).generate(ask, max_new_tokens=NEW).token_ids
    model.generation_config.repetition_penalty = 1.4
    model.generation_config.eos_token_id = [answer[NEW // 2 + 3], processor.tokenizer.eos_token_id]
    model.generation_config.update(do_sample=True, top_k=7, top_p=0.8, temperature=0.7)  # sampling defaults (as
    # Qwen2.5-VL ships them), which an explicit temperature 0 (HF: do_sample=False) must not apply
    path = tmp_path_factory.mktemp(f"gc-{family.name}")
    model.save_pretrained(path)  # the model class reads generation_config.json back (the tiny OneVision's
    return family, plain, wrap(type(model).from_pretrained(path), processor)  # processor is not a saveable class)


def test_greedy_with_a_penalised_generation_config_equals_hf_for_every_drafter(penalised):
    family, plain, target = penalised
    assert target.model.generation_config.repetition_penalty == 1.4  # read back from generation_config.json
    assert resolve_sampling(SamplingParams(), effective_generation_config(target.model)) == SamplingParams(
        temperature=0.7, top_k=7, top_p=0.8, repetition_penalty=1.4)  # no request parameters: the config's
    changed = 0
    for name, req in family.requests.items():
        hf = _hf(target, req, do_sample=False)
        ar = AREngine(target).generate(req, SamplingParams(temperature=0.0), max_new_tokens=NEW)
        assert ar.token_ids == hf, (family.name, name)
        changed += ar.token_ids != AREngine(plain).generate(req, max_new_tokens=NEW).token_ids
        for drafter in (Eagle2Drafter.random(target, seed=1), NgramDrafter(), OracleDrafter(hf),
                        perturbed_oracle(hf, target.vocab_size, seed=3)):
            g = SpecEngine(target, drafter, TREE).generate(req, SamplingParams(temperature=0.0), max_new_tokens=NEW)
            assert g.token_ids == hf, (family.name, name, drafter.name)
    assert changed >= len(family.requests) // 2, "the penalty changed too few answers to test anything"


def test_no_repeat_ngrams_and_min_new_tokens_follow_hf():
    """Two history processors beside the penalty: n-gram bans (checked per tree node with its own ancestors) and a
    minimum answer length that suppresses eos, through oracle and random trees."""
    model, processor = tiny_llava()
    target = wrap(model, processor)
    req = FAMILIES["llava"].requests["image"]
    plain = AREngine(target).generate(req, max_new_tokens=NEW).token_ids
    model.generation_config.update(no_repeat_ngram_size=2, min_new_tokens=12, eos_token_id=plain[4])
    hf = _hf(target, req, do_sample=False)
    assert len(hf) >= 12 and hf != plain[:len(hf)]
    assert len(set(zip(hf, hf[1:]))) == len(hf) - 1  # no bigram twice
    for drafter in (None, Eagle2Drafter.random(target, seed=4), OracleDrafter(hf), perturbed_oracle(hf, target.vocab_size, seed=1)):
        eng = AREngine(target) if drafter is None else SpecEngine(target, drafter, TREE)
        assert eng.generate(req, max_new_tokens=NEW).token_ids == hf


def test_request_parameters_override_the_config_as_in_hf():
    gc = GenerationConfig(do_sample=True, temperature=0.6, top_k=7, top_p=0.8, repetition_penalty=1.1)
    assert resolve_sampling(SamplingParams(), gc) == SamplingParams(
        temperature=0.6, top_k=7, top_p=0.8, repetition_penalty=1.1)
    got = resolve_sampling(SamplingParams(temperature=0.0, top_k=0, repetition_penalty=1.0, seed=3), gc)
    assert got.greedy and got.top_k == 0 and got.top_p == 0.8 and got.repetition_penalty == 1.0 and got.seed == 3
    assert resolve_sampling(SamplingParams(), GenerationConfig()).greedy  # HF's do_sample default: False
    hot = resolve_sampling(SamplingParams(temperature=1.0), effective_generation_config(tiny_llava()[0]))
    assert hot.top_k == 50 and hot.top_p == 1.0  # HF's global defaults where the checkpoint says nothing


@pytest.mark.parametrize("setting", [{"num_beams": 4}, {"bad_words_ids": [[5]]}, {"typical_p": 0.5},
                                     {"forced_eos_token_id": 3}, {"guidance_scale": 1.5}])
def test_settings_that_cannot_be_applied_losslessly_are_refused_by_name(setting):
    model, processor = tiny_llava()
    model.generation_config.update(**setting)
    name = next(iter(setting))
    with pytest.raises(UnsupportedGenerationConfig, match=rf"generation config sets {name}=.*remove"):
        SpecEngine(wrap(model, processor), NgramDrafter())


def test_sampling_with_a_repetition_penalty_keeps_the_targets_distribution():
    """Repetition penalty 1.5 on (T 0.8, top-k 3, top-p 0.9): 5-token answers through 4-deep dynamic trees match
    the exact penalised and warped target distribution (check_deep_sampling: chi-square, 1,500 samples)."""
    params = SamplingParams(temperature=0.8, top_k=3, top_p=0.9, repetition_penalty=1.5)
    check_deep_sampling(wrap(*tiny_llava(init=0.08)), params, process=RepetitionPenaltyLogitsProcessor(1.5))
