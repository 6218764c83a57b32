"""Engine paths the family-wide first-law tests do not reach: eos inside an accepted path, trees cut to what can still
be emitted, acceptance that leaves the logits on the device, the prefill logits a drafter asks for, and the output
distribution of deep trees at T > 0."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

from mmspec_ray.config import SamplingParams
from mmspec_ray.drafters.eagle import Eagle2Drafter
from mmspec_ray.drafters.oracle import OracleDrafter
from mmspec_ray.decoding.engine import AREngine, SpecEngine
from mmspec_ray.decoding.sampling import warp
from mmspec_ray.decoding.tree import DraftTree, TreeConfig, grow_dynamic_tree
from mmspec_ray.targets import PromptTooLong, Request, load_target, wrap
from test_accept import chi2_critical, chi2_stat
from tiny import let_eos_win_where, random_images, tiny_llava

REQ = Request(prompt="describe the image", images=tuple(random_images(1, seed=11)))
TREE = TreeConfig(top_k=4, depth=4, total_tokens=20)


@pytest.fixture(scope="module")
def target():
    return wrap(*tiny_llava())


def test_eos_inside_an_accepted_path_ends_the_answer_like_hf(monkeypatch):
    """Give eos back its voice so greedy decoding ends mid-answer; drafters that propose the greedy continuation
    *through* eos (so eos is accepted with more accepted tokens after it) must stop exactly where HF generate does."""
    model, processor = tiny_llava()
    target = wrap(model, processor)
    eos = processor.tokenizer.eos_token_id
    muted = AREngine(target).generate(REQ, max_new_tokens=40).token_ids
    j = next(i for i in range(6, 40) if muted[i] not in muted[:i])  # a token first emitted mid-answer
    let_eos_win_where(model, eos, muted[j])
    inputs = target.encode(REQ)
    with torch.inference_mode():
        hf = target.model.generate(**inputs, do_sample=False, max_new_tokens=40)[0, inputs["input_ids"].shape[1]:]
    hf = hf.tolist()
    assert hf[-1] == eos and 4 <= len(hf) < 40, hf  # the answer really ends on eos, mid-way
    with monkeypatch.context() as m:  # the greedy continuation through eos (what a perfect drafter proposes)
        m.setattr(type(target), "eos_token_ids", property(lambda self: set()))
        through = AREngine(target).generate(REQ, max_new_tokens=len(hf) + 8).token_ids
    assert through[:len(hf)] == hf
    after_eos = []  # per run: draft tokens accepted after eos in the cycle that accepted eos (-1: eos was a bonus)
    for n in range(1, 6):  # proposal lengths 1..5 put eos at different places in a cycle's accepted path
        g = SpecEngine(target, OracleDrafter(through, accept_len=n), TREE).generate(REQ, max_new_tokens=40)
        assert g.token_ids == hf and g.finish_reason == "stop", n
        end = 1 + sum(a + 1 for a in g.stats.accepted_per_cycle)  # tokens the last cycle would have emitted uncut
        after_eos.append(end - len(hf) - 1)
    assert max(after_eos) >= 2 and sum(a >= 0 for a in after_eos) >= 2, after_eos


def test_trees_are_cut_to_what_can_still_be_emitted(target, monkeypatch):
    """With r tokens left to generate, nodes deeper than r - 1 could never be emitted: they are not verified."""
    ar = AREngine(target).generate(REQ, max_new_tokens=12).token_ids
    seen: list[tuple[int, int]] = []  # (tree size, deepest node) per verify
    verify = target.verify

    def spy(tokens, ancestors, depth):
        seen.append((int(tokens.shape[0]), int(depth.max())))
        return verify(tokens, ancestors, depth)

    monkeypatch.setattr(target, "verify", spy)
    g = SpecEngine(target, OracleDrafter(ar), TREE).generate(REQ, max_new_tokens=4)
    assert g.token_ids == ar[:4] and seen == [(3, 2)]  # the oracle's 5-deep chain cut: 2 drafts + bonus = 3 left
    seen.clear()
    g = SpecEngine(target, OracleDrafter(ar), TREE).generate(REQ, max_new_tokens=8)
    assert g.token_ids == ar[:8] and seen == [(6, 5), (1, 0)]  # one token left: only the root is verified


def test_near_the_end_of_the_context_the_tree_shrinks_and_output_equals_hf(monkeypatch):
    """A prompt + max_new_tokens that exactly fill the context is answered (as HF generate answers it), with every
    verified tree cut to the cache slots left; one token more is refused before any forward."""
    model, processor = tiny_llava()
    target = wrap(model, processor)
    inputs = target.encode(REQ)
    n_prompt, new = inputs["input_ids"].shape[1], 24
    model.config.text_config.max_position_embeddings = n_prompt + new
    assert target.max_context == n_prompt + new
    with torch.inference_mode():
        hf = model.generate(**inputs, do_sample=False, max_new_tokens=new)[0, n_prompt:].tolist()
    ends: list[int] = []  # cache slots in use after each verify
    verify = target.verify

    def spy(tokens, ancestors, depth):
        ends.append(target.seq_len + int(tokens.shape[0]))
        return verify(tokens, ancestors, depth)

    monkeypatch.setattr(target, "verify", spy)
    tree = TreeConfig(top_k=8, depth=5, total_tokens=48)
    for drafter in (OracleDrafter(hf, accept_len=5), Eagle2Drafter.random(target, seed=3)):
        ends.clear()
        g = SpecEngine(target, drafter, tree).generate(REQ, max_new_tokens=new)
        assert g.token_ids == hf and len(hf) == new
        assert max(ends) <= target.max_context, ends
    assert max(ends) == target.max_context, ends  # the random drafter's wide trees were cut to the slots left
    with pytest.raises(PromptTooLong, match="exceeds the target's context"):
        SpecEngine(target, OracleDrafter(hf), tree).generate(REQ, max_new_tokens=new + 1)


class HostCopies(TorchFunctionMode):
    """Records every device-to-host move (cpu, to, tolist, numpy) of a vocabulary-wide tensor (last dim `vocab`)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.moves = vocab, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("cpu", "to", "tolist", "numpy") and isinstance(args[0], torch.Tensor):
            if args[0].dim() and args[0].shape[-1] == self.vocab:
                self.moves.append((name, tuple(args[0].shape)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.9, seed=1)],
                         ids=["greedy", "sampling"])
def test_acceptance_moves_only_token_ids_to_the_host(target, sampling):
    """The [n, V] tree logits stay where the target computed them; acceptance moves only ids and scalars."""
    ar = AREngine(target).generate(REQ, max_new_tokens=16).token_ids
    engine = SpecEngine(target, OracleDrafter(ar), TREE)
    with HostCopies(target.vocab_size) as spy:
        g = engine.generate(REQ, sampling, max_new_tokens=16)
    assert g.stats.cycles >= 2 and spy.moves == []


def test_a_drafter_gets_the_prefill_logits_it_asks_for(target):
    class Wants(OracleDrafter):
        prefill_logits = 0  # every prompt position

        def begin(self, target, prefill, root):
            self.shape = tuple(prefill.logits.shape)
            super().begin(target, prefill, root)

    n_prompt = target.encode(REQ)["input_ids"].shape[1]
    d = Wants([0] * 8)
    SpecEngine(target, d, TREE).generate(REQ, max_new_tokens=2)
    assert d.shape == (1, n_prompt, target.vocab_size)
    d.prefill_logits = 1
    SpecEngine(target, d, TREE).generate(REQ, max_new_tokens=2)
    assert d.shape == (1, 1, target.vocab_size)


class DeepPeek:
    """Test drafter for T > 0: an EAGLE-2 dynamic tree (grow_dynamic_tree) scored by the target's own next-token
    log-probs, made hotter and noisy so its ranking sometimes disagrees with the target: deep paths are accepted and
    rejected at every depth."""

    name = "deep-peek"

    def __init__(self, target, seed: int = 0) -> None:
        self.target, self.g = target, torch.Generator().manual_seed(seed)
        self.ids: list[int] = []

    def _logp(self, seqs: list[list[int]]) -> torch.Tensor:
        with torch.inference_mode():
            logits = self.target.model(input_ids=torch.tensor(seqs)).logits[:, -1].float()
        noise = 0.1 * torch.randn(logits.shape, generator=self.g)
        return torch.log_softmax(logits / 1.5 + noise, -1)

    def begin(self, target, prefill, root: int) -> None:
        self.ids = prefill.input_ids[0].tolist() + [root]

    def propose(self, root: int, cfg: TreeConfig) -> DraftTree:
        expanded: list[list[int]] = []  # token sequence of each expanded node, in step-call order

        def step(tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
            seqs = [(self.ids if p < 0 else expanded[p]) + [t] for t, p in zip(tokens.tolist(), parents.tolist())]
            expanded.extend(seqs)
            return self._logp(seqs)

        return grow_dynamic_tree(root, self._logp([self.ids])[0], step, cfg)

    def observe(self, tokens: list[int], hidden: torch.Tensor, bonus: int) -> None:
        self.ids += tokens[1:] + [bonus]


def check_deep_sampling(target, params: SamplingParams, process=None, n: int = 1500) -> None:
    """5-token answers through 4-deep dynamic trees (top-k 2 per node) vs the exact distribution of the target's
    logits after `process(ids, logits)` (default: none) and `warp`, chi-square at p = 1e-4 over `n` samples."""
    req = Request(prompt="describe the image")
    prompt = target.encode(req)["input_ids"][0].tolist()
    probs: dict[tuple[int, ...], float] = {}

    def walk(prefix: list[int], p: float) -> None:
        if len(prefix) == 5:
            probs[tuple(prefix)] = p
            return
        ids = torch.tensor([prompt + prefix])
        with torch.inference_mode():
            logits = target.model(input_ids=ids).logits[:, -1].float()
        w = warp((process(ids, logits) if process else logits)[0], params)
        for t in torch.nonzero(w).flatten().tolist():
            walk(prefix + [t], p * float(w[t]))

    walk([], 1.0)
    assert len(probs) >= 30  # the test distribution is not degenerate
    samples, deep = Counter(), 0
    eng = SpecEngine(target, DeepPeek(target), TreeConfig(top_k=2, depth=3, total_tokens=10))
    for s in range(n):
        g = eng.generate(req, params.model_copy(update={"seed": s}), max_new_tokens=5)
        samples[tuple(g.token_ids)] += 1
        deep += max(g.stats.accepted_per_cycle) >= 2
    assert deep > n // 5  # paths of two or more draft tokens were really accepted (about half the runs)
    stat, df = chi2_stat(samples, probs, n)
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} > {chi2_critical(df):.1f} (df {df})"


def test_deep_tree_sampling_output_distribution_equals_the_target():
    """T 0.8, top-k 3, top-p 0.9 through deep dynamic trees (check_deep_sampling)."""
    target = wrap(*tiny_llava(init=0.08))  # flatter logits: several tokens per step carry real mass
    check_deep_sampling(target, SamplingParams(temperature=0.8, top_k=3, top_p=0.9))


def test_near_ties_left_to_one_token_forwards_keep_the_answer(target):
    """The half-precision tie guard's engine path, forced in float32 by a large margin: cycles that stop at a
    near-tie (also at the root, committing nothing) and re-verify that token alone still give AR's answer exactly;
    the drafter keeps observing consistent context (the random EAGLE-2 drafter reads its own KV)."""
    ar = AREngine(target).generate(REQ, max_new_tokens=30)
    for drafter in (OracleDrafter(ar.token_ids), Eagle2Drafter.random(target, seed=3)):
        g = SpecEngine(target, drafter, TREE, tie_margin=0.05).generate(REQ, max_new_tokens=30)
        assert g.token_ids == ar.token_ids and g.text == ar.text
        assert 0 < g.stats.tie_cycles < g.stats.cycles
        if isinstance(drafter, OracleDrafter):
            assert max(g.stats.accepted_per_cycle) >= 2  # paths were still accepted between near-ties
            assert g.stats.tokens_per_forward == pytest.approx(len(ar.token_ids[1:]) / g.stats.cycles)
    assert SpecEngine(target, OracleDrafter(ar.token_ids), TREE).tie_margin == 0.0  # float32: off by default


def test_a_tiny_temperature_decodes_as_greedy(target):
    """T=1e-40 used to fail with "probability tensor contains inf/nan"; its limit is the greedy answer."""
    ar = AREngine(target).generate(REQ, max_new_tokens=12).token_ids
    for drafter in (OracleDrafter(ar), Eagle2Drafter.random(target, seed=2)):
        g = SpecEngine(target, drafter, TREE).generate(REQ, SamplingParams(temperature=1e-40, seed=0), 12)
        assert g.token_ids == ar


def test_stops_on_the_generation_configs_eos_ids_like_hf(tmp_path):
    """HF generate stops on the generation config's eos ids only (generation_config.json when the checkpoint has
    one); a text-config eos outside them must not end the answer (it did: we stopped on the union)."""
    model, processor = tiny_llava()
    ar = AREngine(wrap(model, processor)).generate(REQ, max_new_tokens=40).token_ids
    early = next(i for i in range(3, 40) if ar[i] not in ar[:i])  # tokens first emitted at these indices
    late = next(i for i in range(early + 4, 40) if ar[i] not in ar[:i])
    model.config.text_config.eos_token_id = ar[early]
    model.generation_config.eos_token_id = [ar[late], processor.tokenizer.eos_token_id]
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    target = load_target(tmp_path)
    assert target.model.generation_config.eos_token_id == [ar[late], processor.tokenizer.eos_token_id]
    assert target.text_config.eos_token_id == ar[early]
    inputs = target.encode(REQ)
    with torch.inference_mode():
        hf = target.model.generate(**inputs, do_sample=False, max_new_tokens=40)[0, inputs["input_ids"].shape[1]:]
    assert hf.tolist() == ar[:late + 1]
    for drafter in (OracleDrafter(ar), Eagle2Drafter.random(target, seed=1)):
        g = SpecEngine(target, drafter, TREE).generate(REQ, max_new_tokens=40)
        assert g.token_ids == hf.tolist() and g.finish_reason == "stop"
