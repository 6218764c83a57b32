"""`mmspec bench` over workloads: toy workloads by name, request parquets (local and s3://) for any checkpoint, all
in one interleaved run with a summary per workload, the method x workload table and the grouped speedup plot. No
speed assertions: what is checked is that every method ran on every workload's prompts and the bookkeeping adds up."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mmspec_ray.bench.workloads import TOY_WORKLOADS, parse_workloads
from tiny import random_images


def test_workload_specs_name_toy_workloads_and_parquets():
    assert parse_workloads("all,long") == [("all", "all"), ("long", "long")]
    assert parse_workloads("mine=s3://b/req.parquet, /data/run/req.parquet") == [
        ("mine", "s3://b/req.parquet"), ("req", "/data/run/req.parquet")]
    assert parse_workloads("s3://b/requests/") == [("requests", "s3://b/requests/")]
    for bad, why in (("", "at least one"), ("long=x.parquet", "toy workload"), ("a=x.parquet,a=y.parquet", "twice")):
        with pytest.raises(ValueError, match=why):
            parse_workloads(bad)
    assert set(TOY_WORKLOADS) == {"all", "instructions", "captions", "long", "long_images"}
    assert TOY_WORKLOADS["long_images"] == (("detail",), 160)  # long, less video (no PyAV needed)


def test_bench_drafter_labels_leave_out_the_tree():
    from mmspec_ray.cli import UsageError, bench_drafters

    assert bench_drafters("eagle2@auto,/a/ckpt@k4d1n8,x=/y@auto") == {
        "eagle2": "eagle2@auto", "ckpt": "/a/ckpt@k4d1n8", "x": "/y@auto"}
    with pytest.raises(UsageError, match="taken"):
        bench_drafters("eagle2@auto,eagle2@k4d5n16")


def _request_table(tmp_path) -> pa.Table:
    """Three good image rows and one without prompt or messages (the bench must skip and report it)."""
    paths = []
    for i, img in enumerate(random_images(3, seed=5)):
        paths.append(str(tmp_path / f"img{i}.png"))
        img.save(paths[-1])
    return pa.table({"id": ["r0", "bad", "r1", "r2"],
                     "prompt": ["describe the image", None, "what is in it?", "name a colour"],
                     "image_uri": [paths[0], paths[1], paths[1], paths[2]]})


def test_bench_cli_on_a_checkpoint_with_local_and_s3_request_parquets(tmp_path, ckpt, s3_server, monkeypatch,
                                                                      capsys):
    from mmspec_ray.cli import main

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint_url)
    monkeypatch.setenv("MMSPEC_CALIBRATION_DIR", str(tmp_path / "calibration"))
    table = _request_table(tmp_path)
    local = tmp_path / "req.parquet"
    pq.write_table(table, local)
    buf = io.BytesIO()
    pq.write_table(table.slice(2), buf)  # the s3 workload: rows r1, r2
    remote = s3_server.put(s3_server.new_bucket(), "req/part-0.parquet", buf.getvalue())
    out = tmp_path / "bench"
    rc = main(["bench", "--target", ckpt, "--workloads", f"local={local},remote={remote.rsplit('/', 1)[0]}/",
               "--drafter", "ngram:1", "--prompts", "2", "--repeats", "1", "--temperatures", "0",
               "--max-new-tokens", "6", "--no-peers", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    res = json.loads((out / "bench.json").read_text())
    info = res["workload_info"]
    assert info["local"]["prompts"] == 2 and info["remote"]["prompts"] == 2
    assert [s["row"] for s in info["local"]["skipped"]] == ["bad"] and not info["remote"]["skipped"]
    assert set(res["workloads"]) == {"local", "remote"}
    for w in ("local", "remote"):
        assert set(res["workloads"][w]["0.0"]) == {"ar", "ngram:1", "ar_again"}  # ar_again: AR against itself
        assert res["workloads"][w]["0.0"]["ar"]["prompts"] == 2
        assert {r["prompt"] for r in res["runs"] if r["workload"] == w and r["method"] == "ngram:1"} == (
            {0, 1} if w == "local" else {2, 3})  # one numbering over the run
    assert res["summary"]["0.0"]["ngram:1"]["prompts"] == 4  # pooled over both workloads
    md = (out / "bench.md").read_text()
    assert "| method | local | remote | every workload |" in md and "#### workload remote: 2 prompts" in md
    assert "row bad not read" in md
    # 2 prompts x 1 repeat per workload, 4 pooled: too few timed runs, said for each
    assert len(res["warnings"]) == 3 and "workload remote: only 2 timed runs" in md and "Noise floor" in md
    assert (out / "speedup.png").read_bytes()[:4] == b"\x89PNG"

    rc = main(["bench", "--target", ckpt, "--workloads", "long", "--drafter", "", "--out", str(out)])
    assert rc == 2 and "toy workload needs a toy target" in capsys.readouterr().err
    rc = main(["bench", "--target", ckpt, "--workloads", f"x={local}", "--out", str(out)])  # default --drafter eagle2
    assert rc == 2 and "--drafter eagle2: a method name stands for the toy world's drafter" in capsys.readouterr().err


def test_bench_runs_toy_workloads_each_with_its_own_answer_cap(tmp_path, monkeypatch):
    """Workloads with their own max_new_tokens: every run of a workload stays within its cap, both are summarised."""
    from mmspec_ray.bench.run import BenchConfig, run_bench, to_markdown
    from mmspec_ray.bench.workloads import Workload
    from mmspec_ray.decoding.tree import TreeConfig
    from mmspec_ray.targets import Request, wrap
    from tiny import tiny_llava

    target = wrap(*tiny_llava())
    img = tuple(random_images(1, seed=3))
    short = Workload("short", [Request(prompt="describe the image", images=img)], max_new_tokens=3)
    longer = Workload("longer", [Request(prompt="describe the image in detail", images=img)])
    cfg = BenchConfig(max_new_tokens=10, repeats=1, temperatures=(0.0,), peers=False,
                      tree=TreeConfig(top_k=2, depth=2, total_tokens=6))
    res = run_bench(target, [short, longer], {"ng": "ngram:1"}, cfg)
    caps = {"short": 3, "longer": 10}
    for r in res["runs"]:
        assert r["tokens"] <= caps[r["workload"]], r
    assert {w: i["max_new_tokens"] for w, i in res["workload_info"].items()} == caps
    assert set(res["workloads"]) == {"short", "longer"}
    assert "| method | short | longer | every workload |" in to_markdown(res, "tiny")
