"""`python -m mmspec_ray.bench.precision` (docs/design.md, Precision): a small run writes its JSON and tables, and
in float32 every pair of methods agrees token for token (the float32 identity the engine tests also enforce)."""

from __future__ import annotations

import json

from mmspec_ray.bench.precision import family_requests, main


def test_precision_script_small_run(tmp_path, capsys):
    rc = main(["--families", "llava,idefics3", "--dtypes", "float32,bfloat16", "--requests", "2",
               "--max-new-tokens", "6", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "precision.json").read_text())
    for family in ("llava", "idefics3"):
        f32, bf16 = res["families"][family]["float32"], res["families"][family]["bfloat16"]
        assert f32["n"] == bf16["n"] == 2
        assert all(v == 2 for v in f32["agree"].values()), f32["agree"]  # float32: identical everywhere
        assert set(bf16["agree"]) >= {"ar_vs_hf", "eagle2_vs_ar", "oracle_vs_ar", "ar_vs_hf32"}
        rec = bf16["records"][0]
        assert set(rec["answers"]) == {"hf", "ar", "eagle2", "oracle", "ties"} and len(rec["answers"]["ar"]) == 6
    md = (tmp_path / "precision.md").read_text()
    assert md in capsys.readouterr().out
    assert "| llava | bfloat16 | 2 |" in md and "| **all** | float32 | 4 | 100.0 % (4/4) |" in md


def test_requests_cover_the_family_kinds_and_are_reproducible():
    reqs = family_requests("llava", 8, seed=3)
    assert [len(r.images) for r in reqs[:3]] == [0, 1, 2] and reqs[3].videos and not reqs[3].images
    assert len({r.prompt for r in reqs}) == 8
    again = family_requests("llava", 8, seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    assert again[1].images[0].tobytes() == reqs[1].images[0].tobytes()


def test_float32_head_experiment_keeps_float32_identical(tmp_path):
    """--float32-head recomputes the logits from the hidden state: in float32 that is the model's own computation."""
    assert main(["--families", "gemma3", "--dtypes", "float32", "--requests", "2", "--max-new-tokens", "6",
                 "--float32-head", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "precision.json").read_text())
    assert res["float32_head"] and all(v == 2 for v in res["families"]["gemma3"]["float32"]["agree"].values())
    assert (tmp_path / "precision.md").read_text().startswith("Experiment --float32-head")
