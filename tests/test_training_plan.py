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


@pytest.mark.parametrize("mix,sampled,layers,method,why", [
    (DataMix(10, 0, 10, 0), False, 24, "eagle2", "too few text-only rows for hivis or msd"),  # images, no text
    (DataMix(10, 0, 10, 0), True, 24, "suffix", "sampled answers: suffix measured ahead of eagle2"),
    (DataMix(10, 0, 5, 5), False, 24, "hivis", "text-only rows to mix in"),  # text as HiViS was measured with
    (DataMix(10, 0, 5, 5), True, 24, "hivis", "T = 0 and 1"),
    (DataMix(10, 0, 2, 8), False, 24, "hivis", "text-only rows to mix in"),  # mostly text, some images
    (DataMix(10, 6, 0, 4), False, 24, "msd", "mostly video, with text-only rows"),
    (DataMix(10, 8, 2, 0), False, 24, "eagle2", "too few text-only rows"),  # mostly video, no text: no MSD stage 1
    (DataMix(10, 0, 0, 10), False, 24, "suffix", "no rows with media"),
    (DataMix(10, 0, 5, 5), False, 4, "suffix", "a 4-layer target"),  # toy-s's depth
    (DataMix(10, 0, 5, 5), False, None, "hivis", "text-only rows to mix in"),  # depth unknown: the data decides
])
def test_method_auto_follows_the_data(mix, sampled, layers, method, why):
    """`choose_method` is the one rule: it never picks a method the data cannot train (HiViS and MSD without
    text-only rows, a network method without rows with media) and says the measured reason."""
    got, text = choose_method(mix, sampled, layers)
    assert got == method and why in text and "10 rows:" in text


def test_the_default_method_is_auto_in_both_entry_points():
    from mmspec_ray.cli import build_parser
    from mmspec_ray.training.cli import build_parser as job_parser

    assert build_parser().parse_args(["train-drafter"]).method == "auto"
    assert job_parser().parse_args(["--target", "t", "--out", "o"]).method == "auto"


def test_a_toy_world_without_data_picks_by_the_same_rule(monkeypatch):
    """With a toy target and no --data, auto reads the world's own mix (its multimodal prompts and text-only
    corpus) and its target's depth: toy-s (4 layers) gets suffix, its shipped drafter; toy-m (24) hivis."""
    import mmspec_ray.toy.build as build
    import mmspec_ray.toy.prompts as prompts
    from mmspec_ray.training.cli import toy_auto_method

    monkeypatch.setattr(build, "build_toy", lambda size: size)
    monkeypatch.setattr(prompts, "toy_rows", lambda world, split, n, seed=0: [
        {"media_type": "image" if i % 7 < 4 else "video"} for i in range(n)])
    assert toy_auto_method("toy-s", None, None, False)[0] == "suffix"
    method, why = toy_auto_method("toy-m", 200, None, False)
    assert method == "hivis" and why.startswith("auto: 400 rows:") and "50% text" in why


def test_the_suggested_command_runs_as_printed_and_lets_the_rule_choose(monkeypatch):
    """The command `--drafter auto` suggests starts with a program that runs here (from a checkout: the entry point
    beside this Python, as the README writes `.venv/bin/mmspec`), uses `--method auto` and the job's
    --max-new-tokens, and parses as the CLI's own train-drafter."""
    import os
    import shlex
    import shutil

    from mmspec_ray.cli import build_parser
    from mmspec_ray.drafters.discover import train_command

    for on_path in (True, False):
        monkeypatch.setattr(shutil, "which", lambda name, on=on_path: f"/usr/bin/{name}" if on else None)
        words = shlex.split(train_command("/models/llava-7b", "s3://b/requests/", 64))
        program = words[0]
        assert program == "mmspec" if on_path else (os.access(program, os.X_OK) and program.endswith("mmspec")), \
            program
        a = build_parser().parse_args(words[1:])
        assert (a.cmd if hasattr(a, "cmd") else words[1]) == "train-drafter"
        assert a.method == "auto" and a.max_new_tokens == 64 and a.data == "s3://b/requests/"
        assert a.out.endswith("/drafters/llava-7b-auto")
    assert "--max-new-tokens" not in train_command("/m", None)  # no job limit known: the command's default


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
    answers where, where the answers are stored, the trainer, work and output) and exits 0 without loading a model
    or writing a file; without --data a dry run is refused. The default method is auto; suffix's plan says it
    builds a corpus, not epochs."""
    import transformers

    from mmspec_ray.cli import main

    def boom(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setenv("MMSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(transformers.AutoModelForImageTextToText, "from_pretrained", boom)
    monkeypatch.setattr("mmspec_ray.targets.registry.load_target", boom)
    rows = ([{"id": f"i{i}", "prompt": "describe", "image": _png(), "video_uri": None} for i in range(6)] +
            [{"id": "t", "prompt": "say something", "image": None, "video_uri": None}] +
            [{"id": f"v{i}", "prompt": "what happens", "image": None, "video_uri": f"clips/{i}.mp4"} for i in range(3)])
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "req.parquet")
    out = tmp_path / "drafters" / "mine"
    base = ["train-drafter", "--target", ckpt, "--data", str(tmp_path / "req.parquet"), "--out", str(out),
            "--heldout", "2", "--dry-run"]
    assert main(base + ["--method", "eagle2", "--num-workers", "2"]) == 0
    plan = capsys.readouterr().out
    assert "(llava, 0.2 M parameters)" in plan
    assert "10 rows from" in plan and "(8 to train on, 2 held out" in plan and "30% video, 60% image, 10% text" in plan
    assert "method   eagle2: given" in plan
    assert "the target answers every training row on 1 actor(s), CPU, float32; greedy, up to 256 new tokens" in plan
    assert f"stored   {tmp_path / 'home' / 'train-data'}/" in plan and "(new: shared with every method" in plan
    assert "trainer  Ray Train, 2 workers (CPU, 1 CPU each; the target is not loaded on them); 8 epochs" in plan
    assert f"output   {out}" in plan and f"work     {out}.work" in plan
    assert main(base) == 0  # --method auto: the tiny target's 2 layers make it suffix
    plan = capsys.readouterr().out
    assert "method   suffix: auto: 10 rows: 30% video, 60% image, 10% text; a 2-layer target" in plan
    assert "trainer  none: suffix trains no network; it builds its corpus from the target's answers to the 8 " \
        "training rows in one pass" in plan and "8 epochs" not in plan and "batch 16" not in plan
    assert main(base + ["--work", str(tmp_path / "w")]) == 0  # --work keeps the answers in it, as before
    assert f"stored   {tmp_path / 'w' / 'features'} (new)\n" in capsys.readouterr().out
    assert not out.exists() and not (tmp_path / "drafters" / "mine.work").exists()
    assert not (tmp_path / "home").exists() and not (tmp_path / "w").exists()
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
