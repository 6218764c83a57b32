"""Acceptance is lossless: a pure simulation with a deterministic fake target over a 6-token vocabulary.

Greedy: the emitted tokens equal the target's argmax chain for any tree. Sampling: the distribution of the first
three emitted tokens equals the exact product of the *warped* target distributions (temperature, top-p, top-k),
by a chi-square test at p = 1e-4 over 12,000 samples; the same test rejects the classic bug (bonus drawn from the
unwarped distribution), so it has the power to see a wrong sampler.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest
import torch

import mmspec_ray.decoding.accept as accept_mod
from mmspec_ray.config import SamplingParams
from mmspec_ray.decoding.accept import accept, accept_greedy
from mmspec_ray.decoding.sampling import warp
from mmspec_ray.decoding.tree import DraftTree, depths

V = 6
N_TOKENS = 3


def fake_logits(prefix: tuple[int, ...]) -> torch.Tensor:
    """The fake target: fixed random logits per prefix."""
    g = torch.Generator().manual_seed(hash(prefix) % (2**31))
    return torch.randn(V, generator=g) * 1.5


def random_tree(root: int, rng: np.random.Generator) -> DraftTree:
    """A random tree with distinct sibling tokens; parents precede children."""
    n = int(rng.integers(1, 9))
    parents, tokens, used = [-1], [root], {0: set()}
    for i in range(1, n):
        p = int(rng.integers(0, i))
        free = [t for t in range(V) if t not in used[p]]
        if not free:
            continue
        t = int(rng.choice(free))
        used[p].add(t)
        used[len(tokens)] = set()
        parents.append(p)
        tokens.append(t)
    par = torch.tensor(parents)
    return DraftTree(torch.tensor(tokens), par, depths(par), -torch.rand(len(tokens)).sort(descending=True).values)


def node_logits(tree: DraftTree, emitted: tuple[int, ...]) -> torch.Tensor:
    par = tree.parents.tolist()
    tok = tree.tokens.tolist()
    rows = []
    for i in range(tree.size):
        path = []
        j = i
        while j > 0:
            path.append(tok[j])
            j = par[j]
        rows.append(fake_logits(emitted + tuple(reversed(path))))
    return torch.stack(rows)


def run(params: SamplingParams, rng: np.random.Generator, gen: torch.Generator) -> tuple[int, ...]:
    """Speculative loop on the fake target until N_TOKENS are emitted. The first token comes from the target."""
    from mmspec_ray.decoding.sampling import pick

    emitted = (pick(fake_logits(()), params, gen),)
    while len(emitted) < N_TOKENS:
        tree = random_tree(emitted[-1], rng)
        path, bonus = accept(tree, node_logits(tree, emitted), params, gen)
        emitted += tuple(int(tree.tokens[i]) for i in path[1:]) + (bonus,)
    return emitted[:N_TOKENS]


def exact(params: SamplingParams) -> dict[tuple[int, ...], float]:
    out = {}
    for seq in itertools.product(range(V), repeat=N_TOKENS):
        p = 1.0
        for i in range(N_TOKENS):
            p *= float(warp(fake_logits(seq[:i]), params)[seq[i]])
        if p > 0:
            out[seq] = p
    return out


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.719 is p = 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_stat(samples: Counter, probs: dict, n: int) -> tuple[float, int]:
    """Pearson statistic with cells of expected count < 5 pooled; samples outside the support are an error."""
    assert set(samples) <= set(probs), f"sampled outside the target's support: {set(samples) - set(probs)}"
    stat, df, pool_o, pool_e = 0.0, 0, 0.0, 0.0
    for seq, p in probs.items():
        e, o = p * n, samples.get(seq, 0)
        if e < 5:
            pool_o, pool_e = pool_o + o, pool_e + e
        else:
            stat, df = stat + (o - e) ** 2 / e, df + 1
    if pool_e > 0:
        stat, df = stat + (pool_o - pool_e) ** 2 / pool_e, df + 1
    return stat, df - 1


SAMPLING = {
    "T=1": SamplingParams(temperature=1.0),
    "T=0.7,top_p=0.8": SamplingParams(temperature=0.7, top_p=0.8),
    "T=1.3,top_k=3": SamplingParams(temperature=1.3, top_k=3),
}
N = 12_000


def sample_counts(params: SamplingParams, seed: int = 0) -> Counter:
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    return Counter(run(params, rng, gen) for _ in range(N))


@pytest.mark.parametrize("name", list(SAMPLING))
def test_sampling_acceptance_preserves_the_warped_target_distribution(name):
    params = SAMPLING[name]
    stat, df = chi2_stat(sample_counts(params), exact(params), N)
    assert stat < chi2_critical(df), f"{name}: chi2 {stat:.1f} > critical {chi2_critical(df):.1f} (df {df})"


def test_the_chi_square_test_catches_an_unwarped_bonus(monkeypatch):
    """Power check: the bug four seed codebases carry (bonus from the unwarped distribution) fails the same test."""
    params = SAMPLING["T=0.7,top_p=0.8"]
    real = accept_mod.accept_sampling

    def buggy(tree, logits, p, generator):
        path, _ = real(tree, logits, p, generator)
        raw = torch.softmax(logits[path[-1]].float(), -1)
        return path, int(torch.multinomial(raw, 1, generator=generator))

    monkeypatch.setattr(accept_mod, "accept_sampling", buggy)
    samples = sample_counts(params, seed=1)
    probs = exact(params)
    outside = set(samples) - set(probs)
    stat, df = chi2_stat(Counter({k: v for k, v in samples.items() if k in probs}), probs, N) if not outside else (
        math.inf, 1)
    assert stat > chi2_critical(df)


def test_greedy_acceptance_follows_the_target_argmax_chain():
    rng = np.random.default_rng(0)
    params = SamplingParams()
    gen = torch.Generator().manual_seed(0)
    want = []
    for _ in range(N_TOKENS):
        want.append(int(fake_logits(tuple(want)).argmax()))
    for _ in range(300):
        assert run(params, rng, gen) == tuple(want)


def test_greedy_picks_the_matching_branch_and_bonus():
    # root 0 with children 3 (score -1) and 4 (score -0.5); 4 has child 5
    tree = DraftTree(torch.tensor([0, 3, 4, 5]), torch.tensor([-1, 0, 0, 2]), torch.tensor([0, 1, 1, 2]),
                     torch.tensor([0.0, -1.0, -0.5, -0.7]))
    logits = torch.full((4, V), -5.0)
    logits[0, 4] = 1  # target wants 4 after root
    logits[2, 5] = 1  # then 5
    logits[3, 2] = 1  # then 2 (bonus)
    assert accept_greedy(tree, logits) == ([0, 2, 3], 2)
    logits[2, 5], logits[2, 1] = -5, 1  # now the target wants 1 after 4: stop there, bonus 1
    assert accept_greedy(tree, logits) == ([0, 2], 1)


def test_greedy_stops_at_a_near_tie_when_a_tie_margin_is_set():
    """Half precision: a decision whose top-2 gap is under tie_margin x max(1, |top|) is not taken from a multi-node
    forward; the walk stops there with no bonus. A one-node tree (a one-token forward) is never guarded."""
    tree = DraftTree(torch.tensor([0, 4, 5]), torch.tensor([-1, 0, 1]), torch.tensor([0, 1, 2]),
                     torch.tensor([0.0, -0.5, -0.7]))
    logits = torch.full((3, V), -5.0)
    logits[0, 4] = 8.0  # 4 after the root, by a wide margin
    logits[1, 5], logits[1, 2] = 8.0, 7.95  # 5 after 4, but 2 is within 0.05 (relative gap 0.0063)
    logits[2, 1] = 3.0
    assert accept_greedy(tree, logits) == ([0, 1, 2], 1)  # no margin: as before
    assert accept_greedy(tree, logits, tie_margin=2 ** -8) == ([0, 1, 2], 1)  # gap above the margin
    assert accept_greedy(tree, logits, tie_margin=2 ** -5) == ([0, 1], None)  # stop after 4: decide by one token
    logits[0, 3] = 8.0  # an exact tie at the root itself
    assert accept_greedy(tree, logits, tie_margin=2 ** -5) == ([0], None)
    single = DraftTree.chain([0])
    assert accept_greedy(single, logits[:1], tie_margin=2 ** -5) == ([0], 3)  # first of tied ids, as argmax


def test_a_child_holding_all_the_leftover_mass_is_accepted_not_a_crash(monkeypatch):
    """Rounding leaves a node's weights summing to 1 - 2^-24, all on the one drafted child, and the uniform draw
    lands at the top of [0, 1): the child must be accepted (it holds all the mass), not rejected into an all-zero
    residual that the bonus draw cannot sample from."""
    top = 1.0 - 2.0 ** -24  # the largest float32 below 1
    w = torch.zeros(V)
    w[3] = top

    monkeypatch.setattr(accept_mod, "warp", lambda logits, params: w.clone())
    monkeypatch.setattr(accept_mod, "uniform", lambda generator: top)
    tree = DraftTree.chain([0, 3])
    path, bonus = accept(tree, torch.zeros(2, V), SamplingParams(temperature=1.0), torch.Generator())
    assert path == [0, 1] and bonus == 3


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324])
def test_tiny_temperatures_warp_to_the_argmax_not_nan(temperature):
    """HF's TemperatureLogitsWarper takes any positive float and divides, so T=1e-40 overflows to inf/nan; the warp
    works relative to the max, so a tiny T is the limit it should be: all mass on the argmax (split across ties)."""
    params = SamplingParams(temperature=temperature)
    logits = torch.tensor([[0.3, 2.5, -1.0, float("-inf"), 2.4], [7.0, 7.0, 1.0, 0.0, -3.0]])
    probs = warp(logits, params)
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0, 0.0]]))
    assert torch.equal(warp(logits, SamplingParams(temperature=temperature, top_k=2, top_p=0.9)), probs)


def test_sampling_params_refuse_non_finite_temperatures():
    for bad in (float("inf"), float("nan"), -1e-9):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=bad)
