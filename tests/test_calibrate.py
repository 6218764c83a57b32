"""Tree calibration (decoding/calibrate.py): what a probe record says about a smaller tree is what that smaller tree
does; the pick follows the cost curve; the engine stays lossless while probing and caches its pick."""

from __future__ import annotations

import json

import pytest
import torch

from mmspec_ray.drafters.eagle import Eagle2Drafter
from mmspec_ray.decoding import calibrate
from mmspec_ray.decoding.calibrate import (TreeCalibrator, accepted_by_size, auto_tree, grown_subset, interpolate,
                                       level_seconds, monotone, pick_tree)
from mmspec_ray.decoding.engine import AREngine, SpecEngine
from mmspec_ray.decoding.tree import DraftTree, TreeConfig, grow_dynamic_tree
from mmspec_ray.targets import Request
from families import build_target
from tiny import random_images

VOCAB = 12


def path_step(root: int, seed: int):
    """A deterministic drafter: a node's next-token log-probs depend only on its token path, so two growths of
    different sizes see the same distribution at the same node."""
    expanded: list[tuple[int, ...]] = []

    def step(tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        out = []
        for tok, par in zip(tokens.tolist(), parents.tolist()):
            p = (expanded[par] if par >= 0 else (root,)) + (tok,)
            expanded.append(p)
            g = torch.Generator().manual_seed(hash((seed,) + p) % (2 ** 31))
            out.append(torch.log_softmax(3 * torch.randn(VOCAB, generator=g), -1))
        return torch.stack(out)

    return step


def grow(seed: int, cfg: TreeConfig) -> DraftTree:
    root_logp = torch.log_softmax(3 * torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)), -1)
    return grow_dynamic_tree(0, root_logp, path_step(0, seed), cfg)


def token_paths(tree: DraftTree, nodes: list[int]) -> set[tuple[int, ...]]:
    par, tok = tree.parents.tolist(), tree.tokens.tolist()

    def path(i: int) -> tuple[int, ...]:
        return () if i == 0 else path(par[i]) + (tok[i],)

    return {path(i) for i in nodes}


def walk(tree: DraftTree, seed: int) -> list[int]:
    """A random root-to-node path through the tree: the 'accepted path' of a made-up target."""
    g = torch.Generator().manual_seed(seed)
    kids, path = tree.children(), [0]
    while kids[path[-1]] and torch.rand(1, generator=g).item() < 0.85:
        k = kids[path[-1]]
        path.append(k[int(torch.randint(0, min(2, len(k)), (1,), generator=g))])
    return path


@pytest.mark.parametrize("seed", range(6))
def test_a_probe_record_gives_the_smaller_trees_exactly(seed):
    """Same top_k, any depth / size: the smaller grown tree is the probe's best-scoring subset (the probe keeps its
    whole candidate pool here), and the accepted prefix read off the record is what the smaller tree holds."""
    k, depth = 3, 4
    probe = grow(seed, TreeConfig(top_k=k, depth=depth, total_tokens=1 + k + depth * k * k))
    path = walk(probe, seed)
    for d in range(1, depth + 1):
        for n in (2, 3, 5, 8, 13, 21):
            small = grow(seed, TreeConfig(top_k=k, depth=d, total_tokens=n))
            sub = grown_subset(probe, k, d)[:n - 1]
            assert token_paths(probe, sub) == token_paths(small, list(range(1, small.size))), (d, n)
            held = token_paths(small, list(range(1, small.size)))
            want = 0
            for j in range(1, len(path)):
                if token_paths(probe, [path[j]]).pop() not in held:
                    break
                want = j
            assert accepted_by_size(probe, path, k, d, 21)[n] == want, (d, n)


def records(n: int = 20) -> list[tuple[DraftTree, list[int]]]:
    """Probe-shaped records whose accepted path takes one of the two best children at random, often deep: a wider
    and deeper tree holds more of it."""
    out = []
    for s in range(n):
        t = grow(100 + s, calibrate.PROBE)
        out.append((t, walk(t, s)))
    return out


def test_the_pick_follows_the_cost_of_a_verify_forward():
    recs = records()
    flat = {n: 0.010 for n in calibrate.COST_SIZES}  # a GPU-like verify: size is free
    steep = {n: 0.010 * n ** 1.5 for n in calibrate.COST_SIZES}  # each token costs over a step: no tree pays
    cpu = {n: 0.010 * (1 + n / 12) for n in calibrate.COST_SIZES}  # in between
    big, small, mid = (pick_tree(recs, c, draft_s_per_level=0.0005) for c in (flat, steep, cpu))
    assert small.tree.total_tokens == 1 and small.predicted_speedup == 1.0  # no tree pays: no drafting
    assert big.tree.total_tokens > mid.tree.total_tokens >= 3 and big.tree.top_k >= 2
    assert big.tokens_per_forward > mid.tokens_per_forward > 1.0
    assert big.predicted_speedup > mid.predicted_speedup > 1.0
    costly_draft = pick_tree(recs, flat, draft_s_per_level=0.02)  # a drafter level costs 2 verifies: go shallow
    assert costly_draft.tree.depth < big.tree.depth


def test_the_engine_stays_lossless_while_it_calibrates_and_caches_its_pick(tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CALIBRATION_DIR", str(tmp_path / "calibration"))
    monkeypatch.setattr(calibrate, "PROBE", TreeConfig(top_k=4, depth=4, total_tokens=24))  # small: a fast test
    torch.manual_seed(0)
    target = build_target("llava")
    reqs = [Request(prompt=p, images=tuple(random_images(1, seed=s))) for s, p in
            enumerate(["describe the image", "what is shown", "list the objects", "the colours?"])]
    ar = AREngine(target)
    want = [ar.generate(r, max_new_tokens=32).token_ids for r in reqs]

    def calibrator() -> TreeCalibrator:
        c = auto_tree(target, "eagle2-random-test")
        assert isinstance(c, TreeCalibrator)
        c.probe, c.cycles, c.per_request, c.every = calibrate.PROBE, 7, 3, 2
        return c

    first = calibrator()
    engine = SpecEngine(target, Eagle2Drafter.random(target, seed=1), first)
    assert engine.generate(reqs[0], max_new_tokens=32).token_ids == want[0]
    assert len(first.records) == 3 and engine.calibrator is first  # a request's share recorded, not yet done
    again = calibrator()  # a new process resumes the records
    assert len(again.records) == 3 and again.costs == first.costs and again.steps == first.steps
    assert again.requests == first.requests == 1  # the next request's probe phase follows on
    assert [(t.tokens.tolist(), p) for t, p in again.records] == [(t.tokens.tolist(), p) for t, p in first.records]
    engine = SpecEngine(target, Eagle2Drafter.random(target, seed=1), again)
    got = [engine.generate(r, max_new_tokens=32).token_ids for r in reqs[1:]]
    assert got == want[1:]  # probing, the provisional and the final tree: the output is AR's
    assert engine.calibrator is None and again.result is not None and engine.tree == again.result.tree
    assert again.result.probe_cycles == 7 and set(again.costs) == {1, 2, 4, 8, 12, 16, 24}
    assert all(a <= b for a, b in zip(list(again.costs.values()), list(again.costs.values())[1:]))
    assert auto_tree(target, "eagle2-random-test") == again.result.tree  # a later engine: the cache, no probing
    saved = json.loads((tmp_path / "calibration").joinpath(
        calibrate._cache_path(again.key).name).read_text())
    assert saved["key"]["drafter"] == "eagle2-random-test" and not list((tmp_path / "calibration").glob("*.partial*"))
    assert isinstance(auto_tree(target, "eagle2-random-test", recalibrate=True), TreeCalibrator)
    assert isinstance(auto_tree(target, "other-drafter"), TreeCalibrator)  # keyed by drafter
    assert auto_tree(target, "none") == TreeConfig(top_k=1, depth=1, total_tokens=1)


def test_each_request_probes_at_another_phase_so_answer_starts_are_not_over_sampled():
    """With a fixed phase every answer's first cycle was probed: on short toy answers those easy starts were 39 % of
    the records and inflated the predicted tokens per forward (docs/design.md, "Tree calibration")."""
    cal = TreeCalibrator({"drafter": "phase-test"}, cycles=10 ** 6, per_request=10 ** 6, every=3)
    cal.costs = {1: 1.0, 2: 1.5}  # measured already: start_request needs no target
    probed = []
    for _ in range(4):
        cal.start_request(None, {})
        probed.append([c for c in range(9) if cal.next_cycle(whole=True)[1]])
    assert probed == [[0, 3, 6], [1, 4, 7], [2, 5, 8], [0, 3, 6]]


def test_a_drafter_step_is_charged_by_the_top_k_it_expands():
    steps = {8: [0.0052 * 40, 40], 2: [0.0046 * 30, 30], 1: [0.0038 * 4, 4]}  # {top_k: [seconds, steps]}
    charged = [level_seconds(steps, k) for k in range(1, 10)]  # top-k 1 has too few steps to count
    assert charged == pytest.approx([0.0046, 0.0046, 0.0047, 0.0048, 0.0049, 0.0050, 0.0051, 0.0052, 0.0052])
    assert level_seconds({1: [0.0038 * 4, 4], 8: [0.0052 * 2, 2]}, 1) == pytest.approx(0.0038)  # none has enough
    assert level_seconds({8: [0.05, 10]}, 2) == pytest.approx(0.005)  # one top_k timed: its mean for all
    assert level_seconds({}, 3) == 0.0
    assert level_seconds({1: [0.09, 10], 8: [0.04, 10]}, 4) == pytest.approx(0.0065)  # never falls with top_k
    concave = {1: [0.00346 * 20, 20], 2: [0.00446 * 1000, 1000], 8: [0.00513 * 300, 300]}  # toy-m's shape
    line = [level_seconds(concave, k) for k in range(1, 9)]
    assert all(a <= b for a, b in zip(line, line[1:]))
    # a top-8 step that costs more than a verify: charged to every tree, it leaves only a shallow one, or none;
    # charged by top-k, narrow steps are cheap and the pick drafts deeper, for more
    recs, flat = records(), {n: 0.010 for n in calibrate.COST_SIZES}
    by_k, probe_step = pick_tree(recs, flat, lambda k: 0.002 * k), pick_tree(recs, flat, 0.016)
    assert probe_step.tree.total_tokens == 1 and by_k.tree.total_tokens > 1 and by_k.predicted_speedup > 1.5
    assert by_k.draft_ms_per_level == pytest.approx(2.0 * by_k.tree.top_k)
    wide = pick_tree(recs, flat, lambda k: 0.0005 * k)
    assert wide.predicted_speedup > pick_tree(recs, flat, 0.004).predicted_speedup


def test_a_size_between_measured_ones_costs_what_the_next_measured_size_does():
    """CPU verify costs rise in steps (toy-m: 5 tokens cost what 8 do), so a size between two measured ones is
    priced at the larger, never below it; beyond the largest, in proportion."""
    costs = {1: 1.0, 2: 1.4, 4: 1.5, 8: 2.0}
    assert [interpolate(costs, n) for n in range(1, 9)] == [1.0, 1.4, 1.5, 1.5, 2.0, 2.0, 2.0, 2.0]
    assert interpolate(costs, 16) == pytest.approx(4.0)


def test_measured_costs_never_fall_with_size():
    assert monotone({1: 5.0, 2: 8.0, 4: 7.0, 8: 9.0}) == {1: 5.0, 2: 7.5, 4: 7.5, 8: 9.0}
    assert monotone({1: 3.0, 2: 2.0, 4: 1.0}) == {1: 2.0, 2: 2.0, 4: 2.0}
    assert monotone({1: 1.0, 4: 2.0}) == {1: 1.0, 4: 2.0}


class Refuses:
    """A drafter that must never be asked: a 1-token tree is a plain AR step."""

    def begin(self, target, prefill, root):
        pass

    def propose(self, root, cfg):
        raise AssertionError("propose called for a 1-token tree")

    def observe(self, tokens, hidden, bonus):
        raise AssertionError("observe called for a 1-token tree")


def test_a_one_token_tree_decodes_as_ar_without_the_drafter():
    torch.manual_seed(0)
    target = build_target("llava")
    req = Request(prompt="describe the image", images=tuple(random_images(1, seed=4)))
    want = AREngine(target).generate(req, max_new_tokens=20)
    got = SpecEngine(target, Refuses(), TreeConfig(top_k=1, depth=1, total_tokens=1)).generate(req, max_new_tokens=20)
    assert got.token_ids == want.token_ids and got.stats.cycles == want.stats.cycles


def test_between_probe_cycles_the_drafter_keeps_up_even_when_the_pick_so_far_is_no_drafting():
    """The oracle tracks its place through observe: every probe cycle accepts its whole chain only if the drafter
    was told about the cycles that used the 1-token tree in between."""
    from mmspec_ray.drafters.oracle import OracleDrafter

    torch.manual_seed(0)
    target = build_target("llava")
    req = Request(prompt="describe the image", images=tuple(random_images(1, seed=5)))
    answer = AREngine(target).generate(req, max_new_tokens=48).token_ids
    cal = TreeCalibrator({"drafter": "oracle-test"}, probe=TreeConfig(top_k=1, depth=3, total_tokens=8),
                         cycles=10 ** 6, per_request=10 ** 6, every=3)
    cal.costs = {1: 1.0, 2: 3.0, 8: 24.0}  # every tree costs more than it can save: the pick so far is no drafting
    got = SpecEngine(target, OracleDrafter(answer), cal).generate(req, max_new_tokens=48)
    assert got.token_ids == answer
    assert len(cal.records) >= 3 and cal.provisional == TreeConfig(top_k=1, depth=1, total_tokens=1)
    assert all(len(path) == tree.size for tree, path in cal.records)  # every probe chain accepted whole


def test_records_saved_by_the_previous_version_resume_with_their_probe_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CALIBRATION_DIR", str(tmp_path))
    key = {"drafter": "old-partial"}
    tree = grow(3, TreeConfig(top_k=2, depth=2, total_tokens=5))
    calibrate._write(calibrate._cache_path(key, ".partial.json"), json.dumps({
        "key": key, "probe": calibrate.PROBE.model_dump(), "costs": {"1": 0.01, "2": 0.02}, "propose_s": 0.4,
        "observe_s": 0.1, "book_s": 0.0, "levels": 80,
        "records": [[tree.tokens.tolist(), tree.parents.tolist(), tree.scores.tolist(), [0, 1]]]}))
    cal = TreeCalibrator.resume(key)
    assert len(cal.records) == 1 and cal.steps == {calibrate.PROBE.top_k: [0.4, 80]} and cal.costs == {1: 0.01, 2: 0.02}


def test_the_drafted_cycles_between_probes_are_timed_too():
    """What a drafter step costs is measured on every drafted cycle while calibrating (the probe's and the pick so
    far's), per top_k."""
    from mmspec_ray.drafters.oracle import OracleDrafter

    torch.manual_seed(0)
    target = build_target("llava")
    req = Request(prompt="describe the image", images=tuple(random_images(1, seed=5)))
    answer = AREngine(target).generate(req, max_new_tokens=48).token_ids
    probe = TreeConfig(top_k=2, depth=3, total_tokens=8)
    cal = TreeCalibrator({"drafter": "oracle-test"}, probe=probe, cycles=10 ** 6, per_request=10 ** 6, every=3)
    cal.costs = {1: 1.0, 2: 1.0, 8: 1.0}  # verifies cost the same whatever their size: drafting pays
    timed: list[TreeConfig] = []
    timed_fn = cal.timed
    cal.timed = lambda tree, s, passes: (timed.append(tree), timed_fn(tree, s, passes))  # type: ignore[method-assign]
    assert SpecEngine(target, OracleDrafter(answer), cal).generate(req, max_new_tokens=48).token_ids == answer
    between = [t for t in timed if t != probe]  # the pick so far, its depth cut where few tokens are left
    assert timed.count(probe) >= len(cal.records) >= 2 and cal.provisional in between
    assert all(t.top_k == cal.provisional.top_k and t.depth <= cal.provisional.depth for t in between)
    assert set(cal.steps) == {t.top_k for t in timed} and all(s > 0 and n > 0 for s, n in cal.steps.values())


def test_a_slow_target_measures_fewer_rounds_of_the_cost_curve():
    from mmspec_ray.decoding.calibrate import verify_seconds

    torch.manual_seed(0)
    target = build_target("llava")
    inputs = target.encode(Request(prompt="describe the image", images=tuple(random_images(1, seed=6))))
    calls: list[int] = []
    verify = target.verify
    target.verify = lambda tokens, *a: calls.append(int(tokens.shape[0])) or verify(tokens, *a)
    try:
        verify_seconds(target, inputs, (1, 4), repeats=9, warmup=2, budget_s=0.0)  # no time: the floor of 3
        assert calls == [1, 4] * 5
        calls.clear()
        costs = verify_seconds(target, inputs, (1, 4), repeats=9, warmup=2, budget_s=None)  # no budget: all 9
        assert calls == [1, 4] * 11 and costs[1] <= costs[4]
    finally:
        del target.verify


def test_weights_stamp_follows_the_weights_of_a_drafter_or_a_draft_model(tmp_path):
    """A checkpoint retrained in the same folder gets a new calibration key: the stamp reads its weights, through a
    draft-model: prefix and for a sharded checkpoint's index; a method name has none."""
    from mmspec_ray.decoding.calibrate import weights_stamp

    one, sharded = tmp_path / "one", tmp_path / "sharded"
    one.mkdir(), sharded.mkdir()
    (one / "model.safetensors").write_bytes(b"x" * 10)
    (sharded / "model.safetensors.index.json").write_text("{}")
    assert weights_stamp(str(one)).startswith("10:") and weights_stamp(f"draft-model:{one}") == weights_stamp(str(one))
    assert weights_stamp(str(sharded)).startswith("2:")
    assert weights_stamp("ngram") == "" and weights_stamp(str(tmp_path)) == ""
    before = weights_stamp(str(one))
    (one / "model.safetensors").write_bytes(b"y" * 12)
    assert weights_stamp(str(one)) != before


def test_a_drafter_may_ask_for_a_deeper_probe_tree(tmp_path, monkeypatch):
    """auto_tree(probe=...): the calibrator probes with the drafter's own largest tree, under a key of its own (a
    default-probe calibration of the same drafter is another entry), and resumes only records of that probe."""
    from types import SimpleNamespace

    from mmspec_ray.decoding import calibrate

    monkeypatch.setenv("MMSPEC_CALIBRATION_DIR", str(tmp_path))
    target = SimpleNamespace(model=SimpleNamespace(name_or_path="t"), device=torch.device("cpu"), dtype=torch.float32)
    deep = TreeConfig(top_k=4, depth=16, total_tokens=64)
    cal = calibrate.auto_tree(target, "draft-model:x", probe=deep)
    assert isinstance(cal, calibrate.TreeCalibrator) and cal.probe == deep and cal.key["probe"] == "k4d16n64"
    plain = calibrate.auto_tree(target, "draft-model:x")
    assert plain.probe == calibrate.PROBE and "probe" not in plain.key
    cal.costs = {1: 1.0}
    cal.end_request()
    assert calibrate.auto_tree(target, "draft-model:x", probe=deep).costs == {1: 1.0}
    assert calibrate.TreeCalibrator.resume(cal.key).costs is None  # saved under another probe: not resumed
