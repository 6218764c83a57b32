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
from mmspec_ray.decoding.payoff import (BACKOFF, HELD, KIND_MIN, MIN_CYCLES, ONE_TOKEN, PLAIN, PROBE_EVERY, RETRY_CYCLES,
                                        YARDSTICK, KindMemory, PayoffGuard, RequestGuard, ladder, request_kind)
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


def test_a_one_token_tree_is_reported_as_such_not_as_drafted():
    """Calibration may pick a one-token tree (drafting does not pay on this machine): every cycle is plain, and the
    row says so (never `drafted`)."""
    guard = PayoffGuard()
    yardstick(guard)
    r = guard.request(PLAIN, "text/short")
    for n in range(5):
        assert r.next_tree(n) == PLAIN
        r.record(PLAIN, 1, 1.0)
    assert r.outcome == ONE_TOKEN and r.plain[ONE_TOKEN] == 5


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
    kind whose last request ended plain starts drafting again: only `KIND_MIN` losing requests in a row hold it."""
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
    memory.level, memory.gains = r.plain_level, {0: 0.8, 1: 0.9}  # ended plain, the rungs lost: drafts again
    assert guard.request(TREE, "video/short").next_tree(0) != PLAIN


def test_a_retry_that_pays_resets_the_backoff():
    guard = PayoffGuard()
    yardstick(guard)
    mem = KindMemory(level=2, backoff=32)
    mem.payoffs.extend([-1.0] * KIND_MIN)  # held: starts plain
    r = RequestGuard(guard, TREE, mem)
    for _ in range(32):
        assert r.next_tree(0) == PLAIN
        r.record(PLAIN, 1, 1.0)
    assert r.next_tree(0) == ladder(TREE)[1]
    for _ in range(RETRY_CYCLES):
        r.record(ladder(TREE)[1], 2, 1.2)
    assert mem.backoff == BACKOFF[0] and r.next_tree(0) == ladder(TREE)[1]


def test_a_kind_is_held_plain_only_after_several_losing_requests_and_probes_at_random():
    """One request that lost (a noisy one, or a row the drafter cannot guess) holds nothing: only `KIND_MIN` drafted
    requests that all lost hold the kind plain at the start. A held request drafts once its answer reaches the
    kind's usual length; one in PROBE_EVERY, drawn at random, probes at half that length, however long the backoff
    has grown (a wait as long as the answers themselves would silence the drafter for good)."""
    guard = PayoffGuard()
    yardstick(guard)
    for i in range(KIND_MIN):  # answers on which drafting (its prefill included) lost
        r = guard.request(TREE, "video/short")
        assert r.next_tree(0) != PLAIN, i  # not held yet: drafts from the start
        r.record(r.next_tree(0), 1, 2.0, extra_s=0.5)
        r.finish(20)
    mem = guard.kinds["video/short"]
    assert mem.held and mem.pay_s < 0
    mem.backoff = BACKOFF[1]  # far past these answers
    firsts = []
    for _ in range(8 * PROBE_EVERY):
        r = guard.request(TREE, "video/short")
        n = 0
        while n < 20 and r.next_tree(n) == PLAIN:
            r.record(PLAIN, 1, 1.0)
            n += 1
        firsts.append(n)  # the first drafted cycle's answer position (20: none within the usual answer)
        assert r.outcome == HELD and mem.held
        r.finish(20)
    probes = [i for i, n in enumerate(firsts) if n == 10]
    assert set(firsts) == {10, 20} and 3 <= len(probes) <= 3 * 8, firsts
    assert any(i % PROBE_EVERY for i in probes)  # drawn, not every PROBE_EVERY-th request
    assert guard.request(TREE, "text/short").next_tree(0) == TREE  # other kinds are not held back


def test_within_a_request_a_failed_retry_waits_the_doubled_backoff_not_the_half_answer():
    """A long answer in a kind of short ones: after a failed retry the wait is the doubled backoff, so a losing
    drafter is not retried every few tokens for the rest of a long answer."""
    guard = PayoffGuard()
    yardstick(guard)
    mem = guard.kinds.setdefault("image/short", KindMemory())
    mem.answers.extend([4] * 8)  # usual answer: 4 tokens, half of it 2
    r = guard.request(TREE, "image/short")
    drafted = 0
    for n in range(256):
        tree = r.next_tree(n)
        drafted += tree != PLAIN
        r.record(tree, 1, 1.0 if tree == PLAIN else 2.0, generated=n)  # drafting always loses
    assert drafted < 256 // 8, drafted


def test_a_drafter_that_pays_on_some_rows_of_a_kind_is_never_held_plain_for_the_job():
    """The suffix drafter on a job's rows of one kind: it guesses a few rows' answers whole (6 tokens a cycle) and
    nothing of the others'. Whatever order they come in (the first row a hard one, the paying ones never on a
    multiple of EXPLORE_EVERY), every paying row drafts nearly its whole answer and the guard never holds the kind:
    answers at max_new_tokens (128) must not set a wait as long as themselves."""
    from mmspec_ray.decoding.payoff import EXPLORE_EVERY

    guard = PayoffGuard()
    yardstick(guard, 0.01)
    paying = {1, 5, 11, 18, 22, 27, 30, 35, 38}
    assert not any(i % EXPLORE_EVERY == 0 for i in paying)
    drafted_share = {}
    for i in range(40):
        r = guard.request(TREE, "image/short/greedy")
        n = cycles = drafted = 0
        while n < 128:
            tree = r.next_tree(n)
            tokens = 1 if tree == PLAIN else (7 if i in paying else 1)
            seconds = 0.01 if tree == PLAIN else 0.013  # a drafted cycle: a wider verify and the drafter's work
            r.record(tree, tokens, seconds, extra_s=0.002 if not r.drafted and tree != PLAIN else 0.0, generated=n)
            n, cycles, drafted = n + tokens, cycles + 1, drafted + (tree != PLAIN)
        r.finish(128)
        drafted_share[i] = drafted / cycles
        assert not guard.kinds["image/short/greedy"].held or i < min(paying), i
    assert all(drafted_share[i] > 0.9 for i in paying), drafted_share
    assert all(drafted_share[i] < 0.35 for i in set(range(40)) - paying), drafted_share  # the rest fall back


def test_a_held_kind_drafts_again_once_a_probe_pays():
    """A kind held after losing requests: its next requests each probe; the first probe that pays keeps that
    request drafting, and the kind drafts from the start of its next request."""
    guard = PayoffGuard()
    yardstick(guard)
    mem = guard.kinds.setdefault("image/short", KindMemory())
    mem.payoffs.extend([-1.0] * KIND_MIN)
    mem.answers.extend([16] * 4)
    r = guard.request(TREE, "image/short")
    n = 0
    while r.next_tree(n) == PLAIN:
        r.record(PLAIN, 1, 1.0)
        n += 1
    assert n in (8, 16)  # a probe at half the usual answer, or the drafter begun at the usual length
    probe = r.next_tree(n)
    assert probe == ladder(TREE)[1]
    for _ in range(RETRY_CYCLES):
        r.record(probe, 4, 1.2)  # pays
    assert r.next_tree(n + 8) == probe and r.outcome == HELD
    r.finish(n + 16)
    assert not mem.held and guard.request(TREE, "image/short").next_tree(0) != PLAIN


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
