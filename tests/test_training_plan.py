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
