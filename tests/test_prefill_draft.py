"""An answer's opening drafted from the prompt alone (`prompt_draft`) and verified inside the prefill's own forward:
greedy output token for token AR's and HF `generate`'s on every family, whether the opening is right, half right or
wrong; the prefill's other outputs unchanged; penalties applied per node as AR applies them; a near-tie on the first
token left to AR's own prefill; sampling the target's distribution (chi-square); the suffix drafter's openings."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from mmspec_ray.config import SamplingParams
from mmspec_ray.decoding.engine import AREngine, SpecEngine
from mmspec_ray.decoding.tree import DraftTree, TreeConfig
from mmspec_ray.drafters.suffix import START, SuffixConfig, SuffixDrafter, prompt_marker
from mmspec_ray.targets import Request, wrap
from families import FAMILIES, build_target
from test_accept import chi2_critical, chi2_stat
from test_engine import target_three_token_distribution
from tiny import random_images, tiny_llava

TREE = TreeConfig(top_k=2, depth=4, total_tokens=6)
NEW = 20


class OpeningDrafter:
    """Drafts only from the prompt: `opening(prompt ids)` is the guessed start of the answer; cycles propose the
    root alone (plain steps), so every accepted draft token was accepted inside the prefill."""

    name = "opening"

    def __init__(self, opening) -> None:
        self.opening = opening
        self.asked: list[int] = []  # the depth of each request's prompt_draft call

    def prompt_draft(self, prompt: list[int], depth: int) -> list[int]:
        self.asked.append(depth)
        return self.opening(prompt)

    def begin(self, target, prefill, root: int) -> None:
        pass

    def observe(self, tokens: list[int], hidden: torch.Tensor, bonus: int) -> None:
        pass

    def propose(self, root: int, cfg: TreeConfig) -> DraftTree:
        return DraftTree.chain([root])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_opening_verified_in_the_prefill_is_lossless_on_every_family(family):
    """Right (every token accepted in the prefill: one forward fewer per accepted token), right for one token then
    wrong, and wrong from the first token: each request's greedy answer is AR's, which is HF `generate`'s."""
    target = build_target(family)
    for name, req in FAMILIES[family].requests.items():
        ar = AREngine(target).generate(req, max_new_tokens=NEW)
        inputs = target.encode(req)
        with torch.inference_mode():
            hf = target.model.generate(**inputs, do_sample=False, max_new_tokens=NEW)
        assert ar.token_ids == hf[0, inputs["input_ids"].shape[1]:].tolist(), (family, name)
        a = ar.token_ids
        wrong = (a[1] + 1) % target.vocab_size
        for opening, accepted in ((a[:4], 4), ([a[0], wrong, a[2]], 1), ([(a[0] + 1) % target.vocab_size], 0)):
            g = SpecEngine(target, OpeningDrafter(lambda p, o=opening: o), TREE).generate(req, max_new_tokens=NEW)
            assert g.token_ids == a, (family, name, opening)
            assert (g.stats.prefill_drafted, g.stats.prefill_accepted) == (len(opening), accepted), (family, name)
            assert g.stats.cycles == len(a) - 1 - accepted  # plain cycles after the prefill's accepted + bonus


def test_no_opening_where_a_long_clip_s_positions_run_past_the_last_token():
    """After a 96-frame clip the time axis of Qwen2-VL runs past the text that follows (Qwen2.5-VL's too, at its
    real checkpoints' time scale): the answer starts after the largest position, an appended token would sit right
    after the last one. The engine declines the opening there (the answer stays AR's); with 4 frames it takes it."""
    family = "qwen2_vl"
    target = build_target(family)
    long = Request(prompt="hi", videos=(tuple(random_images(96, seed=3)),))
    pos = target.prompt_positions(target.encode(long))
    assert int(pos[..., -1].max()) < int(pos.max())  # the case: the largest position inside the clip
    short = FAMILIES[family].requests["video"]
    for req, drafted in ((long, 0), (short, 3)):
        ar = AREngine(target).generate(req, max_new_tokens=NEW).token_ids
        g = SpecEngine(target, OpeningDrafter(lambda p, a=ar: a[:3]), TREE).generate(req, max_new_tokens=NEW)
        assert g.token_ids == ar and g.stats.prefill_drafted == drafted, (family, drafted)


def test_an_opening_stops_before_a_media_placeholder_id():
    """A drafted image placeholder id would be counted as media by the prefill (a feature-count mismatch): the
    opening is cut before it, and the answer is AR's."""
    target = build_target("llava")
    req = FAMILIES["llava"].requests["image"]
    ar = AREngine(target).generate(req, max_new_tokens=NEW).token_ids
    image_id = next(iter(target.media_token_ids))
    g = SpecEngine(target, OpeningDrafter(lambda p: [ar[0], image_id, ar[2]]), TREE).generate(req, max_new_tokens=NEW)
    assert g.token_ids == ar and (g.stats.prefill_drafted, g.stats.prefill_accepted) == (1, 1)


def test_the_prefill_outputs_are_the_prompt_s_with_or_without_a_draft():
    """The prompt's logits, hidden states and media mask are the plain prefill's; the draft part holds the last
    prompt position and each drafted one, and the cache awaits a commit from the last prompt token."""
    target = build_target("llava")
    req = FAMILIES["llava"].requests["image"]
    inputs = target.encode(req)
    plain = target.prefill(inputs, logits_to_keep=2)
    n, pos = target.seq_len, target.next_pos
    full = target.prefill(inputs, logits_to_keep=2, draft=[5, 6, 7])
    assert torch.allclose(full.logits, plain.logits, atol=1e-5) and full.logits.shape == plain.logits.shape
    assert torch.allclose(full.hidden, plain.hidden, atol=1e-5) and torch.equal(full.media_mask, plain.media_mask)
    assert full.draft.logits.shape[1] == 4 and full.draft.input_ids[0].tolist()[1:] == [5, 6, 7]
    assert torch.allclose(full.draft.logits[0, 0], plain.logits[0, -1], atol=1e-5)
    assert (target.seq_len, target.next_pos) == (n - 1, pos - 1)
    target.commit([0, 1])  # the last prompt token and the first drafted one
    assert (target.seq_len, target.next_pos) == (n + 1, pos + 1)
    with pytest.raises(ValueError, match="no attention probes"):
        target.prefill(inputs, attention=True, draft=[5])


def test_penalties_apply_to_the_opening_as_ar_applies_them():
    """Repetition penalty, no-repeat bigrams and a minimum answer length: an opening of the penalised answer is
    accepted whole, one of the unpenalised answer (which the penalties change) is not, and both decode HF's answer."""
    model, processor = tiny_llava()
    target = wrap(model, processor)
    req = FAMILIES["llava"].requests["image"]
    plain = AREngine(target).generate(req, max_new_tokens=NEW).token_ids
    model.generation_config.update(repetition_penalty=1.4, no_repeat_ngram_size=2, min_new_tokens=6)
    inputs = target.encode(req)
    with torch.inference_mode():
        hf = target.model.generate(**inputs, max_new_tokens=NEW)[0, inputs["input_ids"].shape[1]:].tolist()
    assert hf != plain[:len(hf)]
    for opening in (hf[:4], plain[:4]):
        g = SpecEngine(target, OpeningDrafter(lambda p, o=opening: o), TREE).generate(req, max_new_tokens=NEW)
        assert g.token_ids == hf
        cut = next((i for i, (x, y) in enumerate(zip(opening, hf)) if x != y), len(opening))
        assert g.stats.prefill_accepted == cut


def test_a_minimum_answer_length_counts_the_opening_as_answer_tokens():
    """min_new_tokens 3 with eos the token the plain answer emits third: eos stays suppressed at the opening's third
    node (two answer tokens before it, not three), as in HF `generate`."""
    model, processor = tiny_llava()
    target = wrap(model, processor)
    req = FAMILIES["llava"].requests["image"]
    plain = AREngine(target).generate(req, max_new_tokens=NEW).token_ids
    model.generation_config.update(min_new_tokens=3, eos_token_id=plain[2])
    inputs = target.encode(req)
    with torch.inference_mode():
        hf = target.model.generate(**inputs, max_new_tokens=NEW)[0, inputs["input_ids"].shape[1]:].tolist()
    assert hf[:2] == plain[:2] and hf[2] != plain[2]
    g = SpecEngine(target, OpeningDrafter(lambda p: hf[:4]), TREE).generate(req, max_new_tokens=NEW)
    assert g.token_ids == hf and g.stats.prefill_accepted == min(4, len(hf) - 1)


def test_a_near_tie_on_the_first_token_is_left_to_ar_s_own_prefill():
    """A tie margin wider than any logit gap: no decision of a multi-token forward stands, so the first token comes
    from a plain prefill and the answer is AR's; nothing was accepted from the opening."""
    target = build_target("llava")
    req = FAMILIES["llava"].requests["image"]
    ar = AREngine(target).generate(req, max_new_tokens=NEW).token_ids
    g = SpecEngine(target, OpeningDrafter(lambda p: ar[:3]), TREE, tie_margin=1e9).generate(req, max_new_tokens=NEW)
    assert g.token_ids == ar and g.stats.prefill_accepted == 0


def test_no_opening_when_the_tree_does_not_draft_or_the_answer_has_no_room():
    target = build_target("llava")
    req = FAMILIES["llava"].requests["text"]
    d = OpeningDrafter(lambda p: [1, 2, 3])
    SpecEngine(target, d, TreeConfig(top_k=1, depth=1, total_tokens=1)).generate(req, max_new_tokens=NEW)
    SpecEngine(target, d, TREE).generate(req, max_new_tokens=1)
    assert d.asked == []
    SpecEngine(target, d, TREE).generate(req, max_new_tokens=3)
    assert d.asked == [2]  # depth min(4, 3 - 1): the bonus after a whole opening is still an answer token


def test_sampled_answers_with_an_opening_follow_the_target_distribution():
    """3-token answers (T 0.8, top-k 4, top-p 0.9) drafted from the prompt with the distribution's likeliest answer
    follow the exact warped target distribution (chi-square at p = 1e-4 over 1,500 samples), with the opening
    accepted often enough to test acceptance."""
    target = wrap(*tiny_llava(init=0.08))  # flatter logits: several tokens per step carry real mass
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    req = Request(prompt="describe the image")
    probs = target_three_token_distribution(target, req, params)
    assert len(probs) >= 8
    likeliest = list(max(probs, key=probs.get))
    eng = SpecEngine(target, OpeningDrafter(lambda p: likeliest), TreeConfig(top_k=3, depth=2, total_tokens=8))
    n, samples, accepted = 1500, Counter(), 0
    for s in range(n):
        g = eng.generate(req, SamplingParams(temperature=0.8, top_k=4, top_p=0.9, seed=s), max_new_tokens=3)
        samples[tuple(g.token_ids)] += 1
        accepted += g.stats.prefill_accepted
    assert accepted > n // 4, accepted
    stat, df = chi2_stat(samples, probs, n)
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} > {chi2_critical(df):.1f} (df {df})"


def test_the_suffix_drafter_drafts_the_opening_of_answers_to_the_same_prompt():
    """Openings of the corpus after START; once an answer to a prompt was decoded here, that prompt's opening wins;
    the chain stops where its share of the openings falls below `opening_share`, or where its context is unseen."""
    d = SuffixDrafter(SuffixConfig(max_context=3, opening_share=0.3), [[1, 2, 3, 4]] * 3 + [[5, 6]] * 2)
    assert d.corpus.counts[(START,)] == {1: 3, 5: 2} and d.corpus.counts[(START, 1, 2)] == {3: 3}
    assert d.prompt_draft([9, 9], depth=6) == [1, 2, 3, 4]  # 3/5 of openings; (3,) -> 4 from the corpus itself
    assert d.prompt_draft([9, 9], depth=2) == [1, 2]
    d.cfg = d.cfg.model_copy(update={"opening_share": 0.7})
    assert d.prompt_draft([9, 9], depth=6) == []  # 3/5 < 0.7
    d.prompt_draft([7, 8], depth=6)
    d.finish([5, 6, 7])  # an answer to prompt [7, 8] decoded here
    assert d.corpus.counts[(prompt_marker([7, 8]),)] == {5: 1}
    assert d.prompt_draft([7, 8], depth=6) == [5, 6, 7]  # its own opening, share 1
    assert d.marker == prompt_marker([7, 8]) != prompt_marker([8, 7])
    assert SuffixDrafter().prompt_draft([1], depth=4) == []  # an empty corpus: nothing
    d.cfg = d.cfg.model_copy(update={"openings": False})
    assert d.prompt_draft([7, 8], depth=6) == []
