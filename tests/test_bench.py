"""The benchmark harness runs every method on the same requests and summarises them. No speed assertions (speed is
measured by `mmspec bench`, never by unit tests): the summary's arithmetic is checked exactly on made-up runs, and a
real run only within bounds no machine should miss."""

from __future__ import annotations

import pytest

from mmspec_ray.bench.run import BenchConfig, _hf_runner, run_bench, summarize, to_markdown
from mmspec_ray.config import SamplingParams
from mmspec_ray.decoding.tree import DraftTree, TreeConfig, depths
from mmspec_ray.targets import Request, wrap
from tiny import random_images, tiny_llava


def test_bench_records_every_method_and_token_counts_agree(tmp_path):
    target = wrap(*tiny_llava())
    reqs = [Request(prompt="describe the image", images=tuple(random_images(1, seed=s))) for s in range(2)]
    cfg = BenchConfig(prompts=2, max_new_tokens=12, repeats=1, temperatures=(0.0, 1.0),
                      tree=TreeConfig(top_k=2, depth=2, total_tokens=6))
    res = run_bench(target, reqs, {"idle": "none"}, cfg)  # "none": a drafter that never proposes a token
    ran = {m for m in ("ar", "ar_again", "hf_generate", "hf_prompt_lookup", "ngram", "oracle", "idle")
           if not any(e["method"] == m and e["temperature"] == 0.0 for e in res.get("errors", []))}
    # HF prompt lookup may copy image placeholder ids out of the prompt and then fail inside HF (reported, not fatal)
    assert ran >= {"ar", "ar_again", "hf_generate", "ngram", "oracle", "idle"}, res.get("errors")
    for m in ran:
        toks = {(r["prompt"], r["tokens"]) for r in res["runs"] if r["temperature"] == 0.0 and r["method"] == m}
        ar = {(r["prompt"], r["tokens"]) for r in res["runs"] if r["temperature"] == 0.0 and r["method"] == "ar"}
        assert toks <= ar, (m, toks, ar)  # same answer lengths as AR on the prompts it ran
    assert set(res["summary"]["0.0"]) >= {"ar", "hf_generate", "ngram", "oracle"}
    assert "oracle" not in res["summary"]["1.0"]
    for m in ran:  # T = 0: the bench checks every run's answer against AR's (float32 on a CPU: all the same)
        row = res["summary"]["0.0"][m]
        assert row["runs"] == 2 and row["identical"] == 2, (m, row)
    assert all("identical" not in r for r in res["runs"] if r["temperature"] == 1.0)
    assert all("token_ids" not in r for r in res["runs"])
    assert "runs whose answer is AR's, token for token: ar 2/2" in to_markdown(res, "tiny")
    oracle = res["summary"]["0.0"]["oracle"]
    assert oracle["tokens_per_forward"] > 2.0
    assert oracle["efficiency"] == pytest.approx(oracle["decode_speedup_median"] / oracle["ideal_speedup"])
    assert 0.02 < oracle["efficiency"] < 2.0, oracle  # a fraction of the ideal, give or take timing noise
    md = to_markdown(res, "tiny")
    assert "| oracle |" in md and "T = 1.0" in md
    # how far to trust each figure: an interval and flags on every row, AR against itself, the flag on a drafter that
    # drafted nothing, and the warning for 2 prompts x 1 repeat (no timing value is asserted: any CPU passes)
    for temp, table in res["summary"].items():
        for m, row in table.items():
            lo, hi = row["speedup_ci95"]
            assert lo <= row["speedup_median"] <= hi and row["measurements"] == 2 and isinstance(row["flags"], list)
        assert table["idle"]["nodraft_share"] == 1.0 and table["idle"]["flags"][0].startswith("drafted nothing")
        assert not table["ar"]["flags"] and not table["ar_again"]["flags"]
        assert "within_noise" in table["ngram"] and "within_noise" not in table["ar_again"]
    assert any("2 prompts x 1 repeat" in w for w in res["warnings"])
    assert "Noise floor: AR timed twice per prompt" in md and "**Too few measurements**" in md
    assert "- **idle " in md and "this is AR's speed, not the drafter's" in md and "**drafted nothing**" in md
    assert "learning_off" not in res and "Learning is off" not in md


def test_bench_methods_take_their_own_tree_or_a_calibrated_one(tmp_path, monkeypatch):
    from mmspec_ray.bench.run import split_tree

    monkeypatch.setenv("MMSPEC_CALIBRATION_DIR", str(tmp_path / "calibration"))
    assert split_tree("/a/b@k4d5n16") == ("/a/b", TreeConfig(top_k=4, depth=5, total_tokens=16))
    assert split_tree("eagle2@auto") == ("eagle2", "auto") and split_tree("/x/y") == ("/x/y", None)
    with pytest.raises(ValueError, match="kKdDnN"):
        split_tree("ngram@big")
    target = wrap(*tiny_llava())
    reqs = [Request(prompt="describe the image", images=tuple(random_images(1, seed=s))) for s in range(2)]
    cfg = BenchConfig(prompts=2, max_new_tokens=12, repeats=1, temperatures=(0.0,), peers=False)
    res = run_bench(target, reqs, {"ng-auto": "ngram:1@auto", "ng-k2": "ngram:1@k2d2n6", "sfx": "suffix@k2d2n6"}, cfg)
    assert set(res["summary"]["0.0"]) == {"ar", "ng-auto", "ng-k2", "sfx", "ar_again"}  # no peers
    assert res["learning_off"] == ["sfx"]  # the suffix drafter decodes with its corpus as built, and bench.md says so
    assert "Learning is off during the bench for sfx" in to_markdown(res, "tiny")
    assert res["trees"]["ng-k2"] == {"top_k": 2, "depth": 2, "total_tokens": 6}
    cal = res["calibration"]["ng-auto"]
    assert res["trees"]["ng-auto"] == cal["tree"] and cal["probe_cycles"] >= 1 and not cal["cached"]
    assert list((tmp_path / "calibration").glob("*.json"))  # the pick is cached for later engines
    from mmspec_ray.bench.run import calibrate_tree
    from mmspec_ray.drafters.ngram import NgramDrafter
    from mmspec_ray.decoding.calibrate import FALLBACK

    short, info = calibrate_tree(target, NgramDrafter(), "ngram-short", reqs, max_new_tokens=6)
    assert short == FALLBACK and not info["cached"]  # answers too short for a whole probe tree: the fallback


def test_cost_profile_measures_ar_steps_and_each_tree_size_and_leaves_the_target_clean():
    from mmspec_ray.bench.costs import ar_step_seconds, verify_seconds
    from mmspec_ray.config import SamplingParams
    from mmspec_ray.decoding.engine import AREngine

    target = wrap(*tiny_llava())
    req = Request(prompt="describe the image", images=tuple(random_images(1, seed=0)))
    before = AREngine(target).generate(req, SamplingParams(), max_new_tokens=6).token_ids
    steps = ar_step_seconds(target, [req], new_tokens=4)
    costs = verify_seconds(target, target.encode(req), (1, 3, 5), repeats=3)
    assert len(steps) == 1 and steps[0] > 0
    assert sorted(costs) == [1, 3, 5] and all(v > 0 for v in costs.values())
    assert costs[1] <= costs[3] <= costs[5]  # made non-decreasing in size
    # the profile's verify forwards are rolled back: the target still decodes the same answer afterwards
    assert AREngine(target).generate(req, SamplingParams(), max_new_tokens=6).token_ids == before


def _run(method: str, temp: float, seconds: float, tokens: int, **engine) -> dict:
    return {"temperature": temp, "prompt": 0, "repeat": 0, "method": method, "seconds": seconds, "tokens": tokens,
            **engine}


def test_summary_compares_time_per_token_and_computes_the_oracle_efficiency_exactly():
    """At T > 0 answers differ in length: 20 tokens in 1 s is twice as fast as 10 tokens in 1 s (not equal)."""
    eng = dict(prefill_s=0.1, draft_s=0.0, overhead_s=0.0)
    runs = [_run("ar", 0.0, 1.0, 10, accepted=0, cycles=9, verify_s=0.8, **eng),
            _run("oracle", 0.0, 0.4, 10, accepted=6, cycles=3, verify_s=0.27, **eng),
            _run("ar", 1.0, 1.0, 10, accepted=0, cycles=9, verify_s=0.8, **eng),
            _run("ngram", 1.0, 1.0, 20, accepted=10, cycles=9, verify_s=0.8, **eng),
            _run("hf_generate", 1.0, 0.5, 5)]
    s = summarize(runs)
    assert s["1.0"]["ngram"]["speedup_median"] == pytest.approx(2.0)
    assert s["1.0"]["hf_generate"]["speedup_median"] == pytest.approx(1.0)
    assert s["1.0"]["ngram"]["decode_speedup_median"] == pytest.approx((0.9 / 9) / (0.9 / 19))
    o = s["0.0"]["oracle"]
    assert o["speedup_median"] == pytest.approx(2.5) and o["decode_speedup_median"] == pytest.approx(3.0)
    # ideal: (2 accepted + 1) x AR step 0.1 s / verify 0.09 s per cycle; efficiency = 3.0 / ideal
    assert o["ideal_speedup"] == pytest.approx(10 / 3) and o["efficiency"] == pytest.approx(0.9)


def test_hf_peers_encode_inside_the_timed_call(monkeypatch):
    target = wrap(*tiny_llava())
    calls = []
    encode = target.encode
    monkeypatch.setattr(target, "encode", lambda req: calls.append(req) or encode(req))
    run = _hf_runner(target, Request(prompt="describe the image"), 3, SamplingParams())
    assert calls == []  # nothing done outside the timer
    assert run()[0] == 3 and len(calls) == 1


def test_bench_seed_flag_reaches_the_config():
    from mmspec_ray.cli import bench_config, build_parser

    assert bench_config(build_parser().parse_args(["bench", "--seed", "7"])).seed == 7
    assert bench_config(build_parser().parse_args(["bench"])).seed == 0


def test_scale_profile_times_every_stage_and_its_old_commit_reference_matches_commit():
    import torch

    from mmspec_ray.bench.scale import copy_commit, cycle_costs, deepest_path, prompt, scale_target

    target = scale_target(vocab=512, max_context=256)
    costs = cycle_costs(target, (16, 48), cycles=3, warmup=1)
    assert set(costs) == {16, 48}
    for c in costs.values():
        assert set(c) == {"draft", "verify", "accept_greedy", "accept_sampling", "commit"} and min(c.values()) > 0
    par = torch.tensor([-1, 0, 0, 2, 1, 3])
    tree = DraftTree(torch.arange(6), par, depths(par), torch.zeros(6))
    assert deepest_path(tree) == [0, 2, 3, 5]
    caches = []
    for commit in (lambda t, keep: t.commit(keep), copy_commit):  # the reference equals the in-place commit
        target.prefill(prompt(40, vocab=512))
        target.verify(tree.tokens, tree.ancestors, tree.depth)
        commit(target, deepest_path(tree))
        caches.append([(lay.keys.clone(), lay.values.clone()) for lay in target.cache.layers])
    assert all(torch.equal(a, b) for x, y in zip(*caches) for a, b in zip(x, y))


def test_bench_plots_show_the_summary_the_histogram_and_the_cycle_split(tmp_path):
    """write_results draws speedup / accepted-length / cycle-split PNGs from the summary and the raw runs, and the
    accepted-length shares are computed exactly from each run's histogram."""
    from mmspec_ray.bench.plots import accepted_histogram
    from mmspec_ray.bench.run import accepted_counts, write_results

    assert accepted_counts([0, 2, 2, 1, 2]) == [1, 1, 3] and accepted_counts([]) == []
    eng = dict(prefill_s=0.1, draft_s=0.05, overhead_s=0.01)
    runs = [_run("ar", 0.0, 1.0, 10, accepted=0, cycles=9, verify_s=0.8, accepted_hist=[9], **eng),
            _run("ngram", 0.0, 0.8, 10, accepted=3, cycles=6, verify_s=0.6, accepted_hist=[4, 1, 1], **eng),
            _run("ngram", 0.0, 0.8, 10, accepted=4, cycles=6, verify_s=0.6, accepted_hist=[3, 2, 0, 0, 1], **eng)]
    assert accepted_histogram(runs, 0.0, "ngram") == pytest.approx([7 / 12, 3 / 12, 1 / 12, 0.0, 1 / 12])
    res = {"summary": summarize(runs), "runs": runs}
    assert res["summary"]["0.0"]["ngram"]["overhead_ms_per_cycle"] == pytest.approx(1e3 * 0.02 / 12)
    out = write_results(res, tmp_path / "b", "made up")
    for name in ("speedup.png", "accepted.png", "cycle.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"({name})" in (out / "bench.md").read_text()


def test_cycle_profile_splits_generate_into_forwards_and_the_engines_own_work():
    from mmspec_ray.bench.profile import profile
    from mmspec_ray.drafters.eagle import Eagle2Drafter
    from mmspec_ray.decoding.engine import SpecEngine

    target = wrap(*tiny_llava())
    reqs = [Request(prompt="describe the image", images=tuple(random_images(1, seed=s))) for s in range(2)]
    engine = SpecEngine(target, Eagle2Drafter.random(target, seed=1), TreeConfig(top_k=2, depth=2, total_tokens=6))
    res = profile(engine, reqs, max_new_tokens=12)
    total = res["generate (total)"]
    assert total > 0 and all(v >= 0 for v in res.values())
    for part in ("target verify forward", "target prefill", "drafter propose (its forwards + tree growth)",
                 "drafter observe", "acceptance", "KV commit"):
        assert 0 < res[part] < total, part
    assert res["target verify forward"] + res["target prefill"] + res["drafter propose (its forwards + tree growth)"] \
        <= total
    assert res["tree growth's own Python"] < res["drafter propose (its forwards + tree growth)"]


def test_same_answer_ignores_only_a_trailing_end_of_sequence():
    from mmspec_ray.bench.run import same_answer

    assert same_answer([5, 6, 2], [5, 6], {2}) and same_answer([5, 6], [5, 6, 2, 2], {2})
    assert not same_answer([5, 6, 2], [5, 7, 2], {2}) and not same_answer([2, 5], [5], {2})


def test_bench_device_flag(monkeypatch):
    """`mmspec bench --device`: cpu by default; auto (resolved where every target is loaded) follows the GPU."""
    import torch

    from mmspec_ray.cli import build_parser
    from mmspec_ray.targets.registry import resolve_device_name

    assert build_parser().parse_args(["bench"]).device == "cpu"
    assert build_parser().parse_args(["bench", "--device", "cuda:1"]).device == "cuda:1"
    assert resolve_device_name("cuda:1") == "cuda:1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device_name("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device_name("auto") == "cuda"


def test_weights_digest_reads_tensors_not_file_bytes(tmp_path):
    """scripts/weights_digest.py (the GPU bench's check that a regrown toy-m is the measured one): the same tensors
    written with other metadata give the same digest; one changed value gives another."""
    import importlib.util
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    script = Path(__file__).parents[1] / "scripts" / "weights_digest.py"
    spec = importlib.util.spec_from_file_location("weights_digest", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    t = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    save_file(t, str(tmp_path / "x.safetensors"), metadata={"format": "pt"})
    save_file(dict(reversed(list(t.items()))), str(tmp_path / "y.safetensors"), metadata={"other": "1"})
    t["a"][1, 2] = 7.0
    save_file(t, str(tmp_path / "z.safetensors"))
    x, y, z = (mod.digest(tmp_path / f"{n}.safetensors") for n in "xyz")
    assert x == y != z


def test_noise_interval_flags_and_warnings_on_made_up_runs():
    """bench/noise.py on made-up numbers: the bootstrap interval is seeded and holds the median; a method flags
    'drafted nothing' from 95 % of its cycles and 'within noise' when its interval overlaps AR against itself; too
    few timed runs are warned of; bench.md says all of it in words."""
    from mmspec_ray.bench import noise

    vals = [0.9, 1.1, 1.4, 2.0, 0.7, 1.2]
    lo, hi = noise.median_interval(vals)
    assert (lo, hi) == noise.median_interval(vals) and lo <= 1.15 <= hi and min(vals) <= lo and hi <= max(vals)
    assert noise.median_interval([1.3]) == (1.3, 1.3) and noise.median_interval([2.0] * 5) == (2.0, 2.0)
    with pytest.raises(ValueError):
        noise.median_interval([])
    assert noise.within_noise((0.9, 1.3), (0.95, 1.05)) and noise.within_noise((1.04, 1.2), (0.95, 1.05))
    assert not noise.within_noise((1.1, 1.3), (0.95, 1.05)) and not noise.within_noise((0.5, 0.9), (0.95, 1.05))
    assert noise.within_noise((0.8, 1.2), None) and not noise.within_noise((1.2, 1.5), None)  # no band: holds 1.0?
    band = (0.9, 1.1)
    assert noise.flags("x", {"nodraft_share": 0.95, "speedup_ci95": [1.5, 2.0]}, band) == [
        "drafted nothing in 95% of cycles: this is AR's speed, not the drafter's"]
    assert noise.flags("x", {"nodraft_share": 0.94, "speedup_ci95": [1.5, 2.0]}, band) == []
    assert noise.flags("x", {"speedup_ci95": [1.0, 1.6]}, band) == [
        "within noise: its 95 % interval 1.00-1.60x overlaps AR against itself, which spans 0.90-1.10x here"]
    assert noise.flags("ar", {"nodraft_share": 1.0, "speedup_ci95": [1.0, 1.0]}, band) == []
    assert noise.flags("ar_again", {"nodraft_share": 1.0, "speedup_ci95": [1.0, 1.0]}, band) == []
    assert noise.few_measurements(12, 1) is None and noise.few_measurements(4, 3) is None
    warn = noise.few_measurements(6, 1, "workload w: ")
    assert warn.startswith("workload w: only 6 timed runs per method") and "(6 prompts x 1 repeat)" in warn
    assert "--prompts" in warn and "--repeats" in warn

    eng = dict(prefill_s=0.1, draft_s=0.01, overhead_s=0.0, verify_s=0.5)
    runs = []
    for p in range(4):  # ar_again 0.9-1.2x of AR; "idle" plain steps only at AR's pace; "fast" 2x with drafts
        for m, sec, extra in (("ar", 1.0, dict(accepted=0, cycles=9, plain_cycles=9)),
                              ("idle", 1.0, dict(accepted=0, cycles=9, plain_cycles=3, empty_proposals=6)),
                              ("fast", 0.5, dict(accepted=6, cycles=3, plain_cycles=0)),
                              ("ar_again", (0.9, 1.0, 1.1, 1.2)[p], dict(accepted=0, cycles=9, plain_cycles=9))):
            runs.append({**_run(m, 0.0, sec, 10, **eng, **extra), "prompt": p})
    s = summarize(runs)["0.0"]
    assert s["idle"]["nodraft_share"] == pytest.approx(1.0) and s["idle"]["plain_share"] == pytest.approx(1 / 3)
    assert s["idle"]["within_noise"] and [f.split(":")[0] for f in s["idle"]["flags"]] == [
        "drafted nothing in 100% of cycles", "within noise"]
    assert s["fast"]["speedup_ci95"] == [2.0, 2.0] and not s["fast"]["within_noise"] and s["fast"]["flags"] == []
    assert s["ar_again"]["flags"] == [] and s["ar"]["measurements"] == 4
    assert noise.short_flags(s["idle"]) == "**drafted nothing**; within noise" and noise.short_flags(s["fast"]) == ""
    res = {"summary": {"0.0": s}, "runs": runs, "warnings": [noise.few_measurements(4, 1)], "learning_off": ["sfx"]}
    md = to_markdown(res, "made up")
    assert "- **Too few measurements**: only 4 timed runs per method" in md
    assert "Learning is off during the bench for sfx" in md and "saved corpus" in md
    assert "Noise floor: AR timed twice per prompt" in md and f"AR against itself {s['ar_again']['speedup_median']:.2f}x (median over 4 prompts" in md
    assert "| idle | 4 | 1.00x | 1.00-1.00 | **drafted nothing**; within noise |" in md
    assert "| fast | 4 | 2.00x | 2.00-2.00 |  |" in md
    assert "- **idle 1.00x**: drafted nothing in 100% of cycles: this is AR's speed, not the drafter's; within noise" in md
    info = {"a": {"source": "x", "prompts": 4, "max_new_tokens": 8, "skipped": []}}
    md = to_markdown({**res, "workloads": {"a": {"0.0": s}}, "workload_info": info}, "one workload")
    assert "| idle | 1.00x (1.00-1.00) **drafted nothing**; within noise |" in md  # the method x workload table
