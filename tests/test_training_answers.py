"""Drafter training says what it does and answers each row once: row errors summed up by kind on the console, the
held-out τ's progress logged, and the target's answers shared by every method trained on the same target, data and
answer settings (a second method answers nothing again and says it reuses them)."""

from __future__ import annotations

import io
import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("ray")

from mmspec_ray.training.answers import row_error_kinds, row_error_lines  # noqa: E402
from mmspec_ray.training.shards import ShardStore  # noqa: E402
from tiny import random_images  # noqa: E402


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_row_errors_are_summed_up_by_kind_with_an_example():
    errors = {"a": {"error": "media: not found: x.png", "error_kind": "media.not_found"},
              "b": {"error": "media: not found: y.png", "error_kind": "media.not_found"},
              "c": {"error": "prompt is null", "error_kind": "null_field"}}
    kinds = row_error_kinds(errors)
    assert list(kinds) == ["media.not_found", "null_field"] and kinds["media.not_found"]["rows"] == 2
    lines = row_error_lines(kinds, "/w/features/")
    assert lines == ["row errors: 3 rows gave no training example",
                     "  media.not_found: 2 rows, e.g. row 'a': media: not found: x.png",
                     "  null_field: 1 rows, e.g. row 'c': prompt is null",
                     "  every row's reason: /w/features/manifest.json"]
    assert row_error_lines({}, "/w") == []


def _shards(uri: str) -> dict[str, int]:
    """Each shard file's modification time: a shard written again changes it."""
    import os

    return {n: os.stat(f"{uri}/{n}").st_mtime_ns for n in ShardStore(uri).shard_names()}


def test_two_methods_in_a_row_answer_the_rows_once(ray_cluster, ckpt, tmp_path, capsys, caplog, monkeypatch):
    """eagle2 then suffix on the same target and data: the first run answers every training row into the shared
    answers folder and prints its row errors by kind; the second finds them all answered, says it reuses them and
    answers none (the data generation log and the shards, unchanged, say so). Both log the held-out τ's progress."""
    import mmspec_ray.training.trainer as trainer
    from mmspec_ray.cli import main

    monkeypatch.setenv("MMSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(trainer, "PROGRESS_EVERY_S", 0.0)
    caplog.set_level(logging.INFO)
    rows = [{"id": f"r{i}", "prompt": "describe the image", "image": _png(img), "image_uri": None}
            for i, img in enumerate(random_images(6, seed=3))]
    rows.insert(2, {"id": "bad-null", "prompt": None, "image": _png(random_images(1, seed=4)[0]), "image_uri": None})
    rows.insert(3, {"id": "bad-missing", "prompt": "describe", "image": None,
                    "image_uri": str(tmp_path / "nope.png")})
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string()), ("image", pa.binary()),
                        ("image_uri", pa.string())])
    data = str(tmp_path / "req.parquet")
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), data)
    common = ["train-drafter", "--target", ckpt, "--data", data, "--heldout", "2", "--max-new-tokens", "8",
              "--device", "cpu"]

    assert main(common + ["--method", "eagle2", "--epochs", "1", "--batch-size", "4",
                          "--out", str(tmp_path / "d" / "eagle2")]) == 0
    out = capsys.readouterr().out
    first = json.loads("{" + out.partition("\n{")[2])
    answers = first["answers"]
    assert answers.startswith(str(tmp_path / "home" / "train-data")) and "(new: shared with every method" in out
    assert first["row_errors"] == 2 and "row errors: 2 rows gave no training example" in out
    assert "e.g. row 'bad-null'" in out and "e.g. row 'bad-missing'" in out
    assert f"every row's reason: {answers}/manifest.json" in out
    assert any("held-out τ: 2/2 rows" in r.getMessage() for r in caplog.records)
    shards = _shards(answers)
    assert shards and not (tmp_path / "d" / "eagle2.work" / "features").exists()

    caplog.clear()
    assert main(common + ["--method", "suffix", "--out", str(tmp_path / "d" / "suffix")]) == 0
    out = capsys.readouterr().out
    second = json.loads("{" + out.partition("\n{")[2])
    assert second["answers"] == answers and second["examples"] == first["examples"]
    assert f"stored   {answers}: reusing the target's answers to 6 rows done there" in out
    assert "none left to answer" in out
    assert "trainer  none: suffix trains no network" in out
    assert any("0 to answer" in r.getMessage() for r in caplog.records if r.name.endswith("datagen_job"))
    assert _shards(answers) == shards  # no shard written again: nothing answered twice
    assert any("held-out τ: 2/2 rows" in r.getMessage() for r in caplog.records)


def test_answers_are_keyed_by_the_files_that_shape_them_and_stay_inside_the_bucket(ckpt, tmp_path):
    """Stored answers are keyed by what changes an answer besides config and weights (generation config, tokenizer,
    chat template, processor files): a checkpoint re-saved with another stop id or template answers afresh. A work
    folder at a bucket's root keeps the answers inside that bucket."""
    import shutil
    from types import SimpleNamespace

    from mmspec_ray.targets.layout import answer_files_digest
    from mmspec_ray.training.answers import answers_root

    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    assert answer_files_digest(str(copy)) == answer_files_digest(ckpt)  # where it lies does not matter
    gen = copy / "generation_config.json"
    config = json.loads(gen.read_text()) if gen.exists() else {}
    gen.write_text(json.dumps({**config, "eos_token_id": 7}))
    assert answer_files_digest(str(copy)) != answer_files_digest(ckpt)
    assert answers_root(SimpleNamespace(work_dir="s3://bucket.work")) == "s3://bucket.work/train-data"
    assert answers_root(SimpleNamespace(work_dir="s3://b/drafters/x.work")) == "s3://b/drafters/train-data"
