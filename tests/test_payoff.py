"""The payoff guard (decoding/payoff.py): its decisions from given cycle timings, and, in the engine, that whatever
tree it picks cycle by cycle the output is the target's (greedy token for token on every family, sampling by a
chi-square test), and that under a drafter that is always wrong it falls back to plain one-token steps."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest
import torch

from mmspec_ray.config import SamplingParams
from mmspec_ray.decoding.engine import AREngine, SpecEngine
from mmspec_ray.decoding.payoff import (BACKOFF, MIN_CYCLES, PLAIN, RETRY_CYCLES, YARDSTICK, KindMemory, PayoffGuard,
                                        RequestGuard, ladder, request_kind)
from mmspec_ray.decoding.tree import DraftTree, TreeConfig
from mmspec_ray.drafters.eagle import Eagle2Drafter
from mmspec_ray.targets import Request, wrap
from families import FAMILIES, build_target
from test_accept import chi2_critical, chi2_stat
from test_engine import PeekDrafter, requests_for, target_three_token_distribution

TREE = TreeConfig(top_k=4, depth=4, total_tokens=20)


def yardstick(guard: PayoffGuard, seconds: float = 1.0) -> None:
    for _ in range(YARDSTICK):
        guard.plain_step(seconds)


def test_ladder_ends_in_plain_steps():
    assert ladder(TREE) == [TREE, TreeConfig(top_k=2, depth=2, total_tokens=10), PLAIN]
    assert ladder(TreeConfig(top_k=1, depth=1, total_tokens=2)) == [TreeConfig(top_k=1, depth=1, total_tokens=2), PLAIN]
    assert ladder(PLAIN) == [PLAIN]


def test_plain_steps_come_first_until_the_yardstick_is_timed():
    guard = PayoffGuard()
    r = guard.request(TREE, "text/short")
    for i in range(YARDSTICK):
        assert r.next_tree(i) == PLAIN
        r.record(PLAIN, 1, 1.0 + i)
    assert guard.step_s == 2.0 and r.next_tree(YARDSTICK) == TREE


def test_a_losing_tree_steps_down_to_plain_then_retries_with_a_doubling_backoff():
    guard = PayoffGuard()
    yardstick(guard)
    r = guard.request(TREE, "image/short")
    n = 0
    for _ in range(MIN_CYCLES):  # 1 token per 2 s against 1 token per 1 s: a gain of 0.5
        assert r.next_tree(n) == TREE
        r.record(TREE, 1, 2.0, generated=n)
    assert r.next_tree(n) == ladder(TREE)[1]
    for _ in range(MIN_CYCLES):
        r.record(ladder(TREE)[1], 1, 2.0, generated=n)
    assert r.next_tree(n) == PLAIN
    waits = []
    for _ in range(5):  # plain until the backoff is served, then a retry at the smallest tree, which fails again
        w = 0
        while r.next_tree(n) == PLAIN:
            r.record(PLAIN, 1, 1.0)
            w += 1
        waits.append(w)
        assert r.next_tree(n) == ladder(TREE)[1]
        for _ in range(RETRY_CYCLES):
            r.record(ladder(TREE)[1], 1, 2.0)
    assert waits == [BACKOFF[0], 2 * BACKOFF[0], 4 * BACKOFF[0], BACKOFF[1], BACKOFF[1]]


def test_a_paying_tree_is_kept_and_a_shrunk_tree_that_pays_well_grows_back():
    guard = PayoffGuard()
    yardstick(guard)
    r = guard.request(TREE, "text/short")
    for _ in range(20):
        assert r.next_tree(0) == TREE
        r.record(TREE, 3, 2.0)  # gain 1.5
    assert r.moves == []
    r.level = 1
    for _ in range(MIN_CYCLES):
        r.record(ladder(TREE)[1], 3, 2.0)
    assert r.next_tree(0) == TREE


def test_a_hard_stretch_gets_longer_where_the_tree_pays_on_its_kind():
    """Short captions: their first content words are hard to draft, the rest easy. Where the kind's cycles have paid
    at the tree (its running gain over requests >= 1), a request's losing cycles are judged after twice as many
    cycles; a request that keeps losing then steps down all the same (bounded: never slower than AR for long). A
    kind whose last request ended plain starts drafting again while a drafting rung pays on it."""
    guard = PayoffGuard()
    yardstick(guard)
    r = guard.request(TREE, "video/short")
    for _ in range(6):  # the kind learns that the tree pays: 6 tokens per 2 s (gain 3)
        r.record(TREE, 6, 2.0)
    r.finish(36)
    r = guard.request(TREE, "video/short")
    for _ in range(2 * MIN_CYCLES - 1):  # a hard start: 1 token per 2 s (gain 0.5), the kind's gain still >= 1
        assert r.next_tree(0) == TREE
        r.record(TREE, 1, 2.0)
    assert r.next_tree(0) == TREE and r.moves == []
    r.record(TREE, 1, 2.0)  # the 2 x MIN_CYCLES-th losing cycle: judged, and down it goes
    assert r.moves == [(0, 1)] and r.next_tree(0) == ladder(TREE)[1]
    memory = guard.kinds["video/short"]
    memory.level, memory.gains = r.plain_level, {0: 1.5, 1: 1.1}  # ended plain, but the rungs pay on the kind
    assert guard.request(TREE, "video/short").next_tree(0) == TREE
    memory.level, memory.gains = r.plain_level, {0: 0.8, 1: 0.9}  # ended plain and nothing pays: plain first
    assert guard.request(TREE, "video/short").next_tree(0) == PLAIN


def test_a_retry_that_pays_resets_the_backoff():
    guard = PayoffGuard()
    yardstick(guard)
    mem = KindMemory(level=2, backoff=32)
    r = RequestGuard(guard, TREE, mem)
    for _ in range(32):
        assert r.next_tree(0) == PLAIN
        r.record(PLAIN, 1, 1.0)
    assert r.next_tree(0) == ladder(TREE)[1]
    for _ in range(RETRY_CYCLES):
        r.record(ladder(TREE)[1], 2, 1.2)
    assert mem.backoff == BACKOFF[0] and r.next_tree(0) == ladder(TREE)[1]


def test_a_kind_where_drafting_lost_starts_plain_for_its_usual_answer_length():
    guard = PayoffGuard()
    yardstick(guard)
    for answer in (10, 12, 14):  # short answers on which drafting (its prefill included) lost
        r = guard.request(TREE, "video/short")
        assert r.next_tree(0) in (TREE, PLAIN)
        r.record(TREE, 1, 2.0, extra_s=0.5)
        r.finish(answer)
    mem = guard.kinds["video/short"]
    assert mem.pay_s < 0 and mem.defer() == 13
    r = guard.request(TREE, "video/short")
    assert [r.next_tree(n) for n in (0, 12, 13)] == [PLAIN, PLAIN, TREE]
    assert guard.request(TREE, "text/short").next_tree(0) == TREE  # other kinds are not held back


def test_a_deferred_or_plain_kind_is_measured_again_now_and_then():
    """A kind deferred after drafting lost (one noisy request is enough), or ending plain with answers shorter than
    the backoff, never drafts again on its own: every EXPLORE_EVERY-th request drafts from its start, and once that
    pays the kind drafts again."""
    from mmspec_ray.decoding.payoff import EXPLORE_EVERY

    guard = PayoffGuard()
    yardstick(guard)
    r = guard.request(TREE, "video/short")
    r.next_tree(0)
    r.record(TREE, 1, 3.0)  # one request that lost (a noisy cycle)
    r.finish(9)
    firsts = []
    for _ in range(EXPLORE_EVERY):
        r = guard.request(TREE, "video/short")
        firsts.append(r.next_tree(0))
        if firsts[-1] != PLAIN:  # the re-measured request pays: 3 tokens a cycle at a plain step's time
            for n in range(0, 9, 3):
                r.record(r.next_tree(n), 3, 1.0, generated=n)
        else:
            for n in range(9):
                r.record(PLAIN, 1, 1.0)
        r.finish(9)
    assert firsts.count(PLAIN) == EXPLORE_EVERY - 2 and firsts[-1] != PLAIN  # deferred, then measured again
    assert guard.kinds["video/short"].pay_s > 0 and guard.request(TREE, "video/short").next_tree(0) != PLAIN
    other = guard.kinds.setdefault("image/short", KindMemory())
    other.level, other.gains = len(ladder(TREE)) - 1, {0: 0.5}  # ended plain, its rungs lost
    starts = [guard.request(TREE, "image/short").next_tree(0) for _ in range(EXPLORE_EVERY)]
    assert starts.count(PLAIN) == EXPLORE_EVERY - 1 and starts[-1] == ladder(TREE)[-2]


def test_request_kind_by_media_and_prompt_length():
    from tiny import random_images

    img = tuple(random_images(1, seed=0))
    assert request_kind(Request(prompt="a"), 10) == "text/short/greedy"
    assert request_kind(Request(prompt="a", images=img), 900, greedy=False) == "image/medium/sampled"
    assert request_kind(Request(prompt="a", videos=(img,)), 5000) == "video/very-long/greedy"


def test_a_kind_starts_on_its_best_rung_after_trying_each_and_explores_now_and_then():
    """Calibration per kind of request: a kind whose full tree gains little tries the half-size tree on its next
    request, then starts each request on the rung that gained most on it, and every EXPLORE_EVERY-th request on the
    other one (so a rung judged on a few cycles is measured again)."""
    from mmspec_ray.decoding.payoff import EXPLORE_EVERY

    guard = PayoffGuard()
    yardstick(guard)
    half = ladder(TREE)[1]
    r = guard.request(TREE, "video/short/sampled")
    assert r.next_tree(0) == TREE
    r.record(TREE, 2, 1.8)  # gain 1.1: pays, but under GROW
    r.finish(8)
    r = guard.request(TREE, "video/short/sampled")
    assert r.next_tree(0) == half  # not tried yet on this kind
    r.record(half, 2, 1.4)  # gain 1.43
    r.finish(8)
    starts = []
    for _ in range(2 * EXPLORE_EVERY):
        r = guard.request(TREE, "video/short/sampled")
        starts.append(r.next_tree(0))
        r.finish(8)
    assert starts.count(half) == 2 * EXPLORE_EVERY - 2 and starts.count(TREE) == 2  # the best, and now and then not
    assert guard.request(TREE, "text/short/greedy").next_tree(0) == TREE  # another kind starts on the full tree


def test_the_drafted_depth_is_capped_by_the_tokens_left():
    """Near the end of an answer the drafter is asked for no deeper tree than the remaining tokens can use."""
    from tiny import tiny_llava

    target = wrap(*tiny_llava())
    req = Request(prompt="describe the image")
    ar = AREngine(target).generate(req, max_new_tokens=12).token_ids
    seen: list[tuple[int, int]] = []

    class Recording(WrongDrafter):
        def propose(self, root, cfg):
            seen.append((self.pos, cfg.depth))
            return super().propose(root, cfg)

    g = SpecEngine(target, Recording(ar, target.vocab_size), TREE).generate(req, max_new_tokens=12)
    assert g.token_ids == ar
    # a cycle at answer position p (p + 1 tokens emitted) has 12 - p - 1 left: depth at most that - 2, at least 1
    assert seen and all(depth == max(1, min(TREE.depth, 12 - p - 1 - 2)) for p, depth in seen), seen


class ShuffledGuard(PayoffGuard):
    """A guard whose request guards pick each cycle's rung at random (seeded): every tree sequence the real guard
    could produce, plain stretches and a drafter begun late included, must leave the output unchanged."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.rng = random.Random(seed)

    def request(self, tree: TreeConfig, kind: str) -> RequestGuard:
        guard = self

        class Shuffled(RequestGuard):
            def next_tree(self, generated: int) -> TreeConfig:
                return self.ladder[guard.rng.randrange(len(self.ladder))]

        return Shuffled(self, tree, self.kinds.setdefault(kind, KindMemory()))


DRAFT_S = 0.002  # the always-wrong drafter's cost per proposal: ~4 tiny-target steps, far above timing noise


class WrongDrafter:
    """Knows the answer and proposes, at the full tree size, a chain that is wrong from its first token (each the
    true token's id + 1): every cycle wastes its drafting and its wider verify."""

    name = "wrong"

    def __init__(self, answer: list[int], vocab: int) -> None:
        self.answer, self.vocab, self.pos = answer, vocab, 0

    def begin(self, target, prefill, root: int) -> None:
        self.pos = 0

    def propose(self, root: int, cfg: TreeConfig) -> DraftTree:
        time.sleep(DRAFT_S)  # a drafter's forwards cost something: a drafted cycle is surely slower than a plain step
        true = (self.answer + [0] * cfg.total_tokens)[self.pos + 1:self.pos + cfg.total_tokens]
        return DraftTree.chain([root] + [(t + 1) % self.vocab for t in true])

    def observe(self, tokens: list[int], hidden: torch.Tensor, bonus: int) -> None:
        self.pos += len(tokens)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_target(request):
    torch.manual_seed(0)
    return request.param, build_target(request.param)


def test_any_tree_sequence_the_guard_picks_is_lossless_on_every_family(family_target):
    family, target = family_target
    for name, req in requests_for(family).items():
        ar = AREngine(target).generate(req, max_new_tokens=32).token_ids
        for seed in range(2):
            eng = SpecEngine(target, Eagle2Drafter.random(target, seed=1), TREE, guard=ShuffledGuard(seed))
            g = eng.generate(req, max_new_tokens=32)
            assert g.token_ids == ar, (family, name, seed)
            assert 0 < g.stats.plain_cycles < g.stats.cycles, (family, name, seed)  # both kinds of cycle ran


def test_a_drafter_that_is_always_wrong_falls_back_to_plain_steps(family_target):
    family, target = family_target
    req = requests_for(family)["image"]
    ar = AREngine(target).generate(req, max_new_tokens=48).token_ids
    eng = SpecEngine(target, WrongDrafter(ar, target.vocab_size), TREE, guard=True)
    plain = cycles = 0
    for _ in range(2):  # the second request starts where the first one's kind ended: plain, retrying after a wait
        g = eng.generate(req, max_new_tokens=48)
        assert g.token_ids == ar and sum(g.stats.accepted_per_cycle) == 0, family
        plain, cycles = plain + g.stats.plain_cycles, cycles + g.stats.cycles
    assert plain > 0.75 * cycles, (family, plain, cycles, g.stats.guard_moves)


def test_sampling_under_a_shuffling_guard_keeps_the_target_distribution():
    """As test_engine's chi-square test (3-token answers, T 0.8, top-k 4, top-p 0.9, 1,500 samples, p = 1e-4),
    with each cycle's tree picked at random between the drafter's tree and plain steps."""
    from tiny import tiny_llava

    target = wrap(*tiny_llava(init=0.08))
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    req = Request(prompt="describe the image")
    probs = target_three_token_distribution(target, req, params)
    n = 1500
    eng = SpecEngine(target, PeekDrafter(target), TreeConfig(top_k=3, depth=1, total_tokens=4),
                     guard=ShuffledGuard(0))
    samples, accepted, plain = Counter(), 0, 0
    for s in range(n):
        g = eng.generate(req, SamplingParams(temperature=0.8, top_k=4, top_p=0.9, seed=s), max_new_tokens=3)
        samples[tuple(g.token_ids)] += 1
        accepted += sum(g.stats.accepted_per_cycle)
        plain += g.stats.plain_cycles
    assert accepted > n // 8 and plain > n // 4  # drafts accepted, and plain steps taken
    stat, df = chi2_stat(samples, probs, n)
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} > {chi2_critical(df):.1f} (df {df})"
