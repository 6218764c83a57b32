"""Pure tree functions: EAGLE-2 growth (top-k by cumulative log-prob, global rerank), masks and depths."""

from __future__ import annotations

import itertools

import pytest
import torch

from mmspec_ray.decoding.tree import DraftTree, TreeConfig, ancestor_mask, depths, grow_dynamic_tree


def random_step(vocab: int, seed: int):
    """A step function with deterministic per-(parent, token) random log-probs; records its calls."""
    calls: list[tuple[list[int], list[int]]] = []

    def step(tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        calls.append((tokens.tolist(), parents.tolist()))
        out = []
        for t in tokens.tolist():
            g = torch.Generator().manual_seed(seed * 100003 + t * 7919 + 31 * len(calls[-1][0]))
            out.append(torch.log_softmax(torch.randn(vocab, generator=g) * 3, -1))
        return torch.stack(out)

    return step, calls


@pytest.mark.parametrize("k,depth,total", [(1, 1, 2), (2, 3, 7), (4, 4, 16), (8, 5, 48), (3, 6, 200)])
def test_grown_tree_is_well_formed(k, depth, total):
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        root_logp = torch.log_softmax(torch.randn(50, generator=g) * 3, -1)
        step, calls = random_step(50, seed)
        tree = grow_dynamic_tree(7, root_logp, step, TreeConfig(top_k=k, depth=depth, total_tokens=total))
        n = tree.size
        assert n == min(total, 1 + k + depth * k * k)
        assert len(calls) == depth and all(len(c[0]) == k for c in calls)  # top_k nodes expanded per level
        assert int(tree.tokens[0]) == 7 and int(tree.parents[0]) == -1
        par = tree.parents.tolist()
        assert all(0 <= par[i] < i for i in range(1, n))  # parents precede children
        assert int(tree.depth.max()) <= depth + 1
        sc = tree.scores.tolist()
        assert all(sc[i] <= sc[par[i]] + 1e-6 for i in range(1, n))  # a child never outscores its parent
        # siblings are distinct tokens (top-k of one distribution)
        for kids in tree.children():
            toks = [int(tree.tokens[c]) for c in kids]
            assert len(toks) == len(set(toks))
        assert torch.equal(tree.depth, depths(tree.parents))


def test_rerank_keeps_the_globally_best_candidates():
    """With depth 1 the candidate pool is exactly root children + their children: the kept set must be the best."""
    vocab, k = 20, 4
    g = torch.Generator().manual_seed(3)
    root_logp = torch.log_softmax(torch.randn(vocab, generator=g) * 2, -1)
    step, _ = random_step(vocab, 3)
    tree = grow_dynamic_tree(0, root_logp, step, TreeConfig(top_k=k, depth=1, total_tokens=9))
    top = torch.topk(root_logp, k)
    pool = list(top.values.tolist())
    child_lp = step(top.indices, torch.full((k,), -1))
    for i in range(k):
        pool += (top.values[i] + torch.topk(child_lp[i], k).values).tolist()
    best = sorted(pool, reverse=True)[:8]
    assert sorted(tree.scores[1:].tolist(), reverse=True) == pytest.approx(best, abs=1e-5)


def test_ancestor_mask_and_chain():
    parents = torch.tensor([-1, 0, 0, 1, 3, 2])
    anc = ancestor_mask(parents)
    expect = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 3, 4}, 5: {0, 2, 5}}
    for i, a in expect.items():
        assert set(torch.nonzero(anc[i]).flatten().tolist()) == a
    assert depths(parents).tolist() == [0, 1, 1, 2, 3, 2]
    c = DraftTree.chain([5, 6, 7])
    assert c.parents.tolist() == [-1, 0, 1] and torch.equal(c.ancestors, torch.ones(3, 3, dtype=torch.bool).tril())


def test_children_are_ordered_by_draft_score():
    t = DraftTree(torch.tensor([1, 2, 3, 4]), torch.tensor([-1, 0, 0, 0]), torch.tensor([0, 1, 1, 1]),
                  torch.tensor([0.0, -3.0, -1.0, -2.0]))
    assert t.children()[0] == [2, 3, 1]
    assert list(itertools.chain(*t.children()[1:])) == []


def test_truncate_keeps_the_shallow_subtree_in_order():
    par = torch.tensor([-1, 0, 0, 1, 3, 2, 4])
    tree = DraftTree(torch.arange(10, 17), par, depths(par), -torch.arange(7.0))
    cut = tree.truncate(2)
    assert cut.tokens.tolist() == [10, 11, 12, 13, 15] and cut.parents.tolist() == [-1, 0, 0, 1, 2]
    assert cut.depth.tolist() == [0, 1, 1, 2, 2] and cut.scores.tolist() == [0, -1, -2, -3, -5]
    assert tree.truncate(0).tokens.tolist() == [10] and tree.truncate(9) is tree


def test_grow_ancestors_marks_each_new_node_with_its_ancestors_and_itself():
    """Root's children a, b; then c under a, d under b, e under a; then f under c: f attends to a, c and itself."""
    from mmspec_ray.decoding.tree import grow_ancestors

    anc = torch.zeros((0, 0), dtype=torch.bool)
    for parents in ([-1, -1], [0, 1, 0], [2]):
        anc = grow_ancestors(anc, torch.tensor(parents))
    want = {0: {0}, 1: {1}, 2: {0, 2}, 3: {1, 3}, 4: {0, 4}, 5: {0, 2, 5}}
    assert {i: set(torch.nonzero(anc[i]).flatten().tolist()) for i in range(6)} == want


def test_ngram_proposes_only_after_a_repeated_bigram():
    """The n-gram drafter's chain: what followed the latest earlier match of the longest tail of >= min_ngram tokens;
    with no such match the root alone (the cycle is then a plain one-token AR step)."""
    from mmspec_ray.drafters.ngram import NgramDrafter

    cfg = TreeConfig(top_k=4, depth=3, total_tokens=16)
    d = NgramDrafter()
    d.context = [5, 6, 7, 8, 9, 1, 2, 6]  # tail (2, 6) never occurred; a unigram (6) did: no proposal
    assert d.propose(6, cfg).tokens.tolist() == [6]
    d.context = [5, 6, 7, 8, 9, 1, 5, 6]  # tail (5, 6) occurred at 0: propose what followed, up to depth + 1
    assert d.propose(6, cfg).tokens.tolist() == [6, 7, 8, 9, 1]
    d.context = [3, 4, 5, 9, 4, 5, 8, 3, 4, 5]  # the longest tail (3, 4, 5) wins over the later (4, 5)
    assert d.propose(5, cfg).tokens.tolist() == [5, 9, 4, 5, 8]
    unigram = NgramDrafter(min_ngram=1)
    unigram.context = [5, 6, 7, 8, 9, 1, 2, 6]
    assert unigram.propose(6, cfg).tokens.tolist() == [6, 7, 8, 9, 1]
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(min_ngram=4)
    from mmspec_ray.drafters.base import load_drafter

    assert (load_drafter("ngram", None).min_ngram, load_drafter("ngram:1", None).min_ngram) == (2, 1)
    assert load_drafter("ngram:4", None).max_ngram == 4
    with pytest.raises(ValueError, match="whole number"):
        load_drafter("ngram:x", None)
