"""The real-scale measurement (scripts/gpu_scale.sh) runs its whole code path on a CPU at reduced width and depth:
the same published configs' vocabularies and media settings, so the same token counts, every section, and in float32
every answer AR's. Its report and projection are checked on the committed GPU results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmspec_ray.bench import gpu_scale, scale_models, scale_report

DOCS = Path(__file__).resolve().parent.parent / "docs" / "bench" / "gpu-scale"


@pytest.fixture(scope="module")
def reduced_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu-scale")
    rc = gpu_scale.main(["--device", "cpu", "--dtype", "float32", "--reduced", "--contexts", "64,256",
                         "--sizes", "1,4,16", "--rounds", "2", "--requests", "2", "--max-new-tokens", "16",
                         "--chains", "4,8", "--agree", "3", "--actors", "1,2", "--actor-requests", "1",
                         "--actor-max-new-tokens", "8", "--static", "--graph-sizes", "1,8", "--out", str(out)])
    res = json.loads((out / "results.json").read_text())
    assert rc == 0 and res["errors"] == {}, res["errors"]
    return res


def test_every_section_runs_and_media_have_the_published_token_counts(reduced_run):
    qwen, llava = reduced_run["models"]["qwen2_5_vl_7b"], reduced_run["models"]["llava_next_mistral_7b"]
    for m in (qwen, llava):
        for ctx in ("64", "256"):
            row = m["costs"]["contexts"][ctx]
            assert set(row["verify_ms_sdpa"]) == set(row["verify_ms_eager"]) == {"1", "4", "16"}
            assert all(v > 0 for v in row["verify_ms_sdpa"].values())
            assert row["kv_mb"] > 0
    # a 1024 x 768 photo: Qwen2.5-VL resizes to 1036 x 756 (28 px multiples), 37 x 27 merged tokens; LLaVA-NeXT
    # tiles it 2 x 2 at 336 px, unpads to 48 x 36 patches + 36 row newlines, plus the 576-token base view
    assert qwen["media"]["image1"]["media_tokens"] == 37 * 27
    assert qwen["media"]["image4"]["media_tokens"] == 4 * 37 * 27
    assert llava["media"]["image1"]["media_tokens"] == 576 + 48 * 36 + 36
    assert "exceeds the target's context of 32768" in llava["media"]["clip16"]["skipped"]  # 16 tiled frames
    assert {"eagle2", "hivis", "dream", "specflash", "vispec", "msd"} <= set(qwen["drafters"])
    assert all(r["image1"]["passes"] >= 1 for k, r in qwen["drafters"].items() if k != "tree")
    assert set(reduced_run["actors"]) >= {"1", "2"}
    assert reduced_run["actors"]["2"]["rows"] == 2


def test_float32_answers_are_ar_s_and_the_static_path_is_the_engine_s(reduced_run):
    """In float32 the oracle drafter's answers are AR's token for token, so its tokens per forward is the chain's;
    the static-cache forward of the CUDA-graph section computes the engine's own verify logits."""
    for m in reduced_run["models"].values():
        o = m["oracle"]
        for n, row in o["chains"].items():
            assert row["identical"] == o["requests"], (n, row)
            assert row["tokens_per_forward"] > 0.7 * int(n)  # the end of a 16-token answer cuts the last chain
            assert 0 < row["bookkeeping_share"] < 1
    agree = reduced_run["models"]["qwen2_5_vl_7b"]["oracle"]["agreement"]
    assert agree["tie_guard"]["identical"] == agree["no_guard"]["identical"] == 3
    for n, row in reduced_run["models"]["qwen2_5_vl_7b"]["graphs"].items():
        if isinstance(row, dict):
            assert row["vs_engine_max_logit_diff"] < 1e-4, (n, row)
    hf = reduced_run["models"]["qwen2_5_vl_7b"]["hf"]
    assert hf["static"]["same_output"] is True
    assert all(r["identical"] == r["rows"] for r in reduced_run["actors"].values() if isinstance(r, dict))


def test_reduced_config_keeps_vocabulary_and_media_settings():
    for spec in scale_models.MODELS.values():
        small = scale_models.reduced_config(spec.config)
        assert small["text_config"]["vocab_size"] == spec.config["text_config"]["vocab_size"]
        assert small["text_config"]["num_hidden_layers"] == 2
        for key in ("patch_size", "spatial_merge_size", "temporal_patch_size", "image_size"):
            assert small["vision_config"].get(key) == spec.config["vision_config"].get(key)
    tok = scale_models.word_tokenizer(1000, {"<s>": 1, "<image>": 999}, "<s>", "")
    assert tok.convert_tokens_to_ids(["w5", "<image>", "<s>"]) == [5, 999, 1]


def test_projection_formula():
    assert scale_report.project(4.0, 20.0, 22.0, 5.0, 1.0) == pytest.approx(4 * 20 / 28)
    curve = {"1": 10.0, "4": 11.0, "16": 12.0}
    assert [scale_report.verify_at(curve, n) for n in (1, 3, 16, 40)] == [10.0, 11.0, 12.0, 12.0]
    drafters = {"tree": {}, "eagle2": {"a": {"propose_ms": 50.0, "passes": 5.0, "observe_ms": 4.0}},
                "msd": {"a": {"propose_ms": 10.0, "passes": 5.0, "observe_ms": 1.0},
                        "b": {"propose_ms": 20.0, "passes": 5.0, "observe_ms": 0.5}}}
    costs = scale_report.pass_costs(drafters)
    assert costs["msd"] == costs["eagle2"] == (2.0, 0.5)  # lowest per request; one architecture, one cost


def test_committed_gpu_results_render_with_a_projection_per_drafter():
    runs = sorted(DOCS.glob("results-run*.json"))
    assert runs, "docs/bench/gpu-scale holds the GPU run's results"
    res = scale_report.merge(runs)
    toy = json.loads((DOCS.parent / "toy-m-matrix-2" / "bench.json").read_text())
    text = scale_report.render(res, toy)
    assert "H100" in text and "CUDA graph ms" in text and "decoders on one device" in text
    rows = scale_report.projections(res["models"]["qwen2_5_vl_7b"], toy)
    assert {r["method"] for r in rows} == {"eagle2", "hivis", "dream", "specflash", "vispec", "msd"}
    assert all(r["projected_speedup"] > 0 for r in rows)
