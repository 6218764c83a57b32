"""The suffix drafter: its counts and trees (exact), losslessness on every family (greedy token for token with AR and
HF `generate`, sampling by the chi-square test), learning from decoded answers, and its corpus built by the trainer
(`--method suffix`) and loaded back."""

from __future__ import annotations

import json

import pytest
import torch

from mmspec_ray.config import SamplingParams
from mmspec_ray.decoding.engine import AREngine, SpecEngine
from mmspec_ray.decoding.tree import TreeConfig
from mmspec_ray.drafters.base import load_drafter
from mmspec_ray.drafters.suffix import START, SuffixConfig, SuffixDrafter, SuffixIndex, prompt_marker
from mmspec_ray.targets import Request, wrap
from mmspec_ray.training.datagen import DatagenRecipe, generate_features, load_features
from mmspec_ray.training.trainer import TrainConfig, train_drafter
from families import FAMILIES, build_target
from test_engine import SAMPLED_FLOOR, check_greedy_lossless, check_trained_drafter_samples
from tiny import random_images, tiny_llava


def test_index_counts_every_context_and_finds_the_longest_suffix():
    idx = SuffixIndex(max_context=2)
    idx.add([1, 2, 3, 1, 2, 4])
    assert idx.counts[(2,)] == {3: 1, 4: 1} and idx.counts[(1, 2)] == {3: 1, 4: 1}
    assert idx.counts[(3, 1)] == {2: 1} and (1,) in idx.counts and idx.tokens == 5
    assert idx.longest([9, 3, 1]) == {2: 1}  # (3, 1) seen: its counts
    assert idx.longest([9, 9, 2]) == {3: 1, 4: 1}  # (9, 2) unseen: falls back to (2,)
    assert idx.longest([7]) is None
    other = SuffixIndex(max_context=2)
    other.add([5, 2, 3])
    assert idx.longest([1, 2], other) == {3: 1, 4: 1}  # (1, 2) only in idx: other's (2,) counts are not mixed in
    assert idx.longest([5, 2], other) == {3: 1}  # (5, 2) only in other
    assert idx.longest([9, 2], other) == {3: 2, 4: 1}  # (9, 2) in neither: (2,) in both, summed
    idx.add([0, 2, 9], start=2)  # only position 2 counted, after its own context
    assert idx.counts[(2,)] == {3: 1, 4: 1, 9: 1} and (0,) not in idx.counts


def test_tree_is_best_first_within_its_budget():
    """Corpus: after 1 comes 2 (3 times) or 3 (once); after 2 comes 5; after 3 comes 6. Best first: 2 (3/4), then
    its child 5 (3/4 x 1), then 3 (1/4); top_k, depth and total_tokens bound it; parents precede children."""
    d = SuffixDrafter(SuffixConfig(max_context=1, learn=False), [[1, 2, 5]] * 3 + [[1, 3, 6]])
    d.context, d.request = [1], SuffixIndex(1)
    t = d.propose(1, TreeConfig(top_k=2, depth=3, total_tokens=4))
    assert t.tokens.tolist() == [1, 2, 5, 3] and t.parents.tolist() == [-1, 0, 1, 0]
    assert t.depth.tolist() == [0, 1, 2, 1]
    log = torch.tensor([0.75, 0.25]).log()
    assert torch.allclose(t.scores, torch.stack([torch.tensor(0.0), log[0], log[0], log[1]]))
    assert d.propose(1, TreeConfig(top_k=1, depth=3, total_tokens=8)).tokens.tolist() == [1, 2, 5]  # 5 unseen after
    assert d.propose(1, TreeConfig(top_k=2, depth=1, total_tokens=8)).tokens.tolist() == [1, 2, 3]
    d.context = [7]
    assert d.propose(7, TreeConfig(top_k=2, depth=3, total_tokens=8)).size == 1  # 7 never seen: the root alone


def answers_of(target, reqs: dict[str, Request], n: int = 24) -> list[list[int]]:
    return [AREngine(target).generate(r, max_new_tokens=n).token_ids for r in reqs.values()]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_suffix_drafter_is_lossless_on_every_family(family):
    """Greedy output equals AR and HF `generate` with a corpus of the target's own answers (most drafts accepted),
    with a corpus of unrelated token runs (most rejected), and learning from nothing."""
    torch.manual_seed(0)
    target = build_target(family)
    reqs = FAMILIES[family].requests
    own = SuffixDrafter(SuffixConfig(learn=False), answers_of(target, reqs))
    g = torch.Generator().manual_seed(1)
    noise = SuffixDrafter(SuffixConfig(learn=False),
                          [torch.randint(0, target.vocab_size, (40,), generator=g).tolist() for _ in range(20)])
    accepted = check_greedy_lossless(target, reqs, lambda: [("own", own), ("noise", noise),
                                                            ("learning", SuffixDrafter())], family)
    assert accepted > 0, family


def test_suffix_drafter_samples_the_target_distribution():
    target = wrap(*tiny_llava(init=0.08))  # flatter logits: several tokens per step carry real mass
    req = Request(prompt="describe the image", images=tuple(random_images(1, seed=7)))
    with torch.inference_mode():  # a corpus of the target's likely continuations: samples of its own answers
        eng = AREngine(target)
        corpus = [eng.generate(req, SamplingParams(temperature=0.8, top_k=4, top_p=0.9, seed=s),
                               max_new_tokens=3).token_ids for s in range(60)]
    check_trained_drafter_samples(target, SuffixDrafter(SuffixConfig(learn=False), corpus), req,
                                  min_accepted=SAMPLED_FLOOR)


def test_it_learns_the_answers_it_decodes():
    """With `learn`, a request's answer joins the corpus at the next request: the same prompt again is drafted from
    it (far fewer cycles), identically; without `learn` nothing is added."""
    target = wrap(*tiny_llava(init=0.3))
    req = Request(prompt="describe the image", images=tuple(random_images(1, seed=3)))
    tree = TreeConfig(top_k=2, depth=6, total_tokens=10)
    for learn in (True, False):
        d = SuffixDrafter(SuffixConfig(learn=learn))
        eng = SpecEngine(target, d, tree)
        first = eng.generate(req, max_new_tokens=24)
        assert d.corpus.tokens == (len(first.token_ids) - 1 if learn else 0)  # every token after the first
        second = eng.generate(req, max_new_tokens=24)
        assert first.token_ids == second.token_ids == AREngine(target).generate(req, max_new_tokens=24).token_ids
        if learn:
            assert second.stats.cycles <= len(second.token_ids) // 3 < first.stats.cycles


def test_the_trainer_builds_the_corpus_and_it_loads_back(tmp_path):
    """`--method suffix`: the corpus is the target's answers to the training prompts, written as a checkpoint (one
    pass, a history with the held-out τ); `load_drafter` reads it back for this target and refuses another."""
    target = wrap(*tiny_llava(init=0.3))
    reqs = [Request(prompt="describe the image", images=tuple(random_images(1, seed=i))) for i in range(6)]
    feats = load_features(generate_features(target, reqs, DatagenRecipe(max_new_tokens=12), tmp_path / "f"))
    held = [Request(prompt="describe the image", images=tuple(random_images(1, seed=50)))]
    out = train_drafter("suffix", target, feats, tmp_path / "d", TrainConfig(epochs=3), heldout=held)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["method"] == "suffix" and cfg["target_vocab_size"] == target.vocab_size
    hist = json.loads((out / "history.json").read_text())
    assert len(hist) == 1 and hist[0]["examples"] == len(feats) and hist[0]["heldout_tau"] >= 0
    d = load_drafter(str(out), target)
    want = SuffixIndex(4)
    for ex in feats:
        want.add(ex.input_ids[ex.n_prompt:].tolist())
        want.add_opening(START, ex.input_ids[ex.n_prompt:].tolist())
    assert isinstance(d, SuffixDrafter) and d.corpus.counts == want.counts and want.tokens > 0
    (out / "config.json").write_text(json.dumps({**cfg, "target_vocab_size": target.vocab_size + 1}))
    with pytest.raises(ValueError, match="answers of another target"):  # a corpus of another vocabulary's ids
        load_drafter(str(out), target)
