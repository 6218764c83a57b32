"""Drafter training on a user's checkpoint, before any work: `--method auto` from the data, shards cut for the
Ray Train workers, paths made absolute on the driver, and a checkpoint that cannot load refused in one line."""

from __future__ import annotations

import io
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mmspec_ray.targets.registry import check_loadable
from mmspec_ray.targets.request import TargetError
from mmspec_ray.training.choose import DataMix, choose_method, data_mix
from mmspec_ray.training.pipeline import TrainJob, absolute_paths, shards_for_workers
from tiny import random_images


def _png() -> bytes:
    buf = io.BytesIO()
    random_images(1, seed=1)[0].save(buf, format="PNG")
    return buf.getvalue()


def test_data_mix_counts_video_image_and_text_rows(tmp_path):
    rows = ([{"id": f"v{i}", "prompt": "p", "image": None, "video_uri": f"s3://b/{i}.mp4"} for i in range(3)] +
            [{"id": f"i{i}", "prompt": "p", "image": _png(), "video_uri": None} for i in range(2)] +
            [{"id": "t", "prompt": "p", "image": None, "video_uri": None}])
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    pq.write_table(pa.Table.from_pylist([{"id": "both", "prompt": "p", "image_uri": "x.png", "video_uri": "x.mp4"},
                                         {"id": "t2", "prompt": "p", "image_uri": None, "video_uri": None}]),
                   tmp_path / "b.parquet")
    assert data_mix(str(tmp_path)) == DataMix(rows=8, video=4, image=2, text=2)  # a clip and an image: video


@pytest.mark.parametrize("mix,sampled,method,why", [
    (DataMix(10, 0, 10, 0), False, "hivis", "HiViS measured fastest"),
    (DataMix(10, 6, 4, 0), False, "msd", "mostly video"),
    (DataMix(10, 0, 10, 0), True, "vispec", "sampled answers"),
    (DataMix(10, 0, 4, 6), False, "eagle2", "mostly text-only"),
])
def test_method_auto_follows_the_data(mix, sampled, method, why):
    got, text = choose_method(mix, sampled)
    assert got == method and why in text and "10 rows:" in text


def test_shards_follow_the_workers_and_paths_are_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = TrainJob(target="s3://b/model/", data="req.parquet", out="drafters/x", num_workers=2, rows_per_shard=32)
    assert shards_for_workers(job, 6).rows_per_shard == 3  # 2 shards of 3 rows: one per worker
    assert shards_for_workers(job, 200).rows_per_shard == 32  # already enough shards
    assert shards_for_workers(job.model_copy(update={"num_workers": 0}), 6).rows_per_shard == 32
    fixed = absolute_paths(job)
    assert fixed.out == str(tmp_path / "drafters" / "x") and fixed.data == str(tmp_path / "req.parquet")
    assert fixed.target == "s3://b/model/" and fixed.work_dir == str(tmp_path / "drafters" / "x.work")


def test_a_checkpoint_that_cannot_load_is_refused_in_one_line(ckpt, tmp_path, capsys):
    from mmspec_ray.cli import main

    assert check_loadable(ckpt).model_type == "llava"
    bad = tmp_path / "no-image-processor"
    shutil.copytree(ckpt, bad)
    for name in ("preprocessor_config.json", "processor_config.json"):
        (bad / name).unlink(missing_ok=True)
    with pytest.raises(TargetError, match="has no image processor"):
        check_loadable(str(bad))
    pq.write_table(pa.Table.from_pylist([{"id": f"r{i}", "prompt": "p", "image": _png()} for i in range(4)]),
                   tmp_path / "req.parquet")
    rc = main(["train-drafter", "--target", str(bad), "--data", str(tmp_path / "req.parquet"), "--out",
               str(tmp_path / "d"), "--heldout", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("mmspec: error: ValueError: target: checkpoint ") and \
        "has no image processor" in err[-1] and not any("Traceback" in line for line in err)


def test_the_plan_and_dry_run_load_no_model_and_write_nothing(ckpt, tmp_path, capsys, monkeypatch):
    """`train-drafter --dry-run` prints the plan (target and family, rows and their mix, the method and why, who
    answers where, the trainer, work and output) and exits 0 without loading a model or writing a file; without
    --data a dry run is refused."""
    import transformers

    from mmspec_ray.cli import main

    def boom(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(transformers.AutoModelForImageTextToText, "from_pretrained", boom)
    monkeypatch.setattr("mmspec_ray.targets.registry.load_target", boom)
    rows = ([{"id": f"i{i}", "prompt": "describe", "image": _png(), "video_uri": None} for i in range(6)] +
            [{"id": "t", "prompt": "say something", "image": None, "video_uri": None}] +
            [{"id": f"v{i}", "prompt": "what happens", "image": None, "video_uri": f"clips/{i}.mp4"} for i in range(3)])
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "req.parquet")
    out = tmp_path / "drafters" / "mine"
    assert main(["train-drafter", "--method", "auto", "--target", ckpt, "--data", str(tmp_path / "req.parquet"),
                 "--out", str(out), "--heldout", "2", "--num-workers", "2", "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert "(llava, 0.2 M parameters)" in plan
    assert "10 rows from" in plan and "(8 to train on, 2 held out" in plan and "30% video, 60% image, 10% text" in plan
    assert "method   hivis: auto: 10 rows" in plan and "HiViS measured fastest" in plan
    assert "1 actor(s), CPU, float32; greedy, up to 256 new tokens" in plan
    assert "trainer  Ray Train, 2 workers (CPU, 1 CPU each; the target is not loaded on them); 8 epochs" in plan
    assert f"output   {out}" in plan and f"work     {out}.work" in plan
    assert not out.exists() and not (tmp_path / "drafters" / "mine.work").exists()
    assert main(["train-drafter", "--target", "toy-s", "--dry-run"]) == 2
    assert "--dry-run plans a run on request rows: give --data" in capsys.readouterr().err


def test_method_options_reach_the_method_and_unknown_ones_are_refused():
    """`--method-option KEY=VALUE` (JSON values) builds the method with those options, on either trainer; an option
    its class does not take is refused by name."""
    from mmspec_ray.training.cli import method_options
    from mmspec_ray.training.methods import training_method

    opts = method_options(["min_answer_words=0", "name=x y"])
    assert opts == {"min_answer_words": 0, "name": "x y"}
    assert training_method("hivis", {"min_answer_words": 0}).min_answer_words == 0
    assert training_method("vispec", {"mtp_steps": 2}).mtp_steps == 2
    with pytest.raises(ValueError, match="method 'eagle2' does not take the options"):
        training_method("eagle2", {"min_answer_words": 0})
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        method_options(["min_answer_words"])


def test_method_options_reach_a_toy_world_run_and_need_out(tmp_path, capsys, monkeypatch):
    """With a toy target, `--method-option` builds the method with its options (the toy path trains that method
    object); without --out it is refused, since the cached toy drafter keeps the default recipe."""
    import mmspec_ray.toy.build as build
    import mmspec_ray.toy.drafter as drafter
    from mmspec_ray.cli import main

    seen = {}
    monkeypatch.setattr(build, "build_toy", lambda name: name)
    monkeypatch.setattr(drafter, "train_drafter_on_world",
                        lambda world, out, method, recipe, resume=True: seen.update(method=method) or out)
    assert main(["train-drafter", "--target", "toy-s", "--method", "vispec", "--method-option", "objective=eagle",
                 "--method-option", "mtp_steps=2", "--out", str(tmp_path / "d")]) == 0
    m = seen["method"]
    assert m.name == "vispec" and m.mtp_steps == 2 and m.objective == "eagle"
    assert main(["train-drafter", "--target", "toy-s", "--method", "vispec", "--method-option",
                 "objective=eagle"]) == 2
    assert "--method-option change the recipe: give --out too" in capsys.readouterr().err
