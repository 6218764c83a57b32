"""Training a drafter for a user's own (non-toy) checkpoint at scale, against a loopback S3 (moto): requests in
parquet on S3 -> data generation on Ray Data (bad rows recorded, resumable) -> 2-worker CPU training on Ray Train
with one worker killed mid-run (the run resumes from its last checkpoint) -> a drafter on S3 that loads with
`load_drafter("s3://...")` and decodes losslessly."""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

ray = pytest.importorskip("ray")

from mmspec_ray.drafters.base import load_drafter  # noqa: E402
from mmspec_ray.drafters.eagle import Eagle2Drafter  # noqa: E402
from mmspec_ray.decoding.engine import SpecEngine  # noqa: E402
from mmspec_ray.decoding.tree import TreeConfig  # noqa: E402
from mmspec_ray.targets import Request, load_target  # noqa: E402
from mmspec_ray.training.datagen_job import DatagenJob, run_datagen  # noqa: E402
from mmspec_ray.training.pipeline import TrainJob, run_train_job  # noqa: E402
from mmspec_ray.training.shards import ShardStore  # noqa: E402
from mmspec_ray.training.trainer import TrainConfig  # noqa: E402
from tiny import random_images  # noqa: E402

MAX_NEW = 12
SCHEMA = pa.schema([("id", pa.string()), ("prompt", pa.string()), ("image", pa.binary()), ("image_uri", pa.string())])


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def request_rows(s3_server, bucket: str, n: int) -> list[dict]:
    """n image rows (bytes or an s3:// uri), two text-only rows, and two bad rows (a missing image object, a null
    prompt)."""
    rows = []
    for i, img in enumerate(random_images(n, seed=5)):
        data = png(img)
        uri = s3_server.put(bucket, f"media/{i}.png", data) if i % 2 else None
        rows.append({"id": f"r{i:03d}", "prompt": f"describe the image {i % 3}", "image": None if uri else data,
                     "image_uri": uri})
    rows.insert(3, {"id": "text-0", "prompt": "say something", "image": None, "image_uri": None})
    rows.insert(5, {"id": "text-1", "prompt": "say something else", "image": None, "image_uri": None})
    rows.insert(7, {"id": "bad-missing", "prompt": "describe", "image": None,
                    "image_uri": f"s3://{bucket}/media/nope.png"})
    rows.insert(9, {"id": "bad-null", "prompt": None, "image": png(random_images(1, seed=9)[0]), "image_uri": None})
    return rows


def put_rows(s3_server, bucket: str, rows: list[dict]) -> str:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), buf)
    return s3_server.put(bucket, "requests/part-0.parquet", buf.getvalue())


def train_worker_pids() -> list[int]:
    """Processes running a Ray Train worker (Ray names them ray::RayTrainWorker...)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if b"RayTrainWorker" in (p / "cmdline").read_bytes():
                    pids.append(int(p.name))
            except OSError:
                continue
    return pids


def kill_one_worker_after_checkpoints(s3_server, bucket: str, prefix: str, killed: list[int],
                                      stop: threading.Event, after: int = 4) -> None:
    """SIGKILL one Ray Train worker once `after` checkpoints have been written (Ray Train's controller registers
    reports on its polling cadence, and a worker's reports block once a few are pending, so by the fourth the
    earlier ones are registered and the restart has one to resume from)."""
    seen: set[str] = set()
    while not stop.is_set():
        keys = s3_server.client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
        seen |= {k["Key"].split("/")[-2] for k in keys if k["Key"].endswith("trainer_state.pt")}
        if len(seen) >= after:
            pids = train_worker_pids()
            if pids:
                os.kill(pids[-1], signal.SIGKILL)
                killed.append(pids[-1])
                return
        time.sleep(0.05)


def test_train_drafter_for_a_saved_checkpoint_from_s3_on_ray_data_and_ray_train(s3_server, ray_cluster, ckpt,
                                                                                 monkeypatch):
    bucket = s3_server.new_bucket("train")
    rows = request_rows(s3_server, bucket, 22)
    data = put_rows(s3_server, bucket, rows)
    s3 = s3_server.s3_config.model_dump()
    job = TrainJob(method="eagle2", target=ckpt, data=data, out=f"s3://{bucket}/drafters/eagle2",
                   work=f"s3://{bucket}/work", heldout=3, num_workers=2, cpus_per_worker=0.5, max_failures=2,
                   rows_per_shard=4,
                   train=TrainConfig(epochs=12, batch_size=4, lr=3e-3, warmup_steps=2, eval_max_new_tokens=8),
                   recipe={"max_new_tokens": MAX_NEW, "aux_features": True}, decode={"s3": s3, "device": "cpu"})
    killed: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(target=kill_one_worker_after_checkpoints,
                              args=(s3_server, bucket, "work/ray-train/", killed, stop), daemon=True)
    killer.start()
    try:
        summary = run_train_job(job)
    finally:
        stop.set()
        killer.join(5)

    # data generation: every non-held-out row is in a shard, as an example or as a recorded error
    store = ShardStore(f"s3://{bucket}/work/features", s3_server.s3_config)
    manifest = store.manifest()
    held = [r["id"] for r in rows[-3:]]
    assert manifest["rows"] == len(rows) - 3 and set(manifest["held_out"]) == set(held)
    assert manifest["errors"]["bad-missing"]["error_kind"] == "media.not_found"
    assert manifest["errors"]["bad-null"]["error_kind"] == "null_field"
    assert manifest["examples"] + len(manifest["errors"]) == manifest["rows"]
    assert manifest["examples"] >= 18 and sum(manifest["multimodal_per_shard"]) == manifest["examples"] - 2
    # a re-run answers nothing again (resume), and lists the same shards
    again = run_datagen(DatagenJob(input=data, output=store.uri, decode=job.decode_config(),
                                   recipe=job.recipe, exclude_ids=tuple(held), rows_per_shard=4))
    assert again["shards"] == manifest["shards"] and again["rows"] == manifest["rows"]
    assert len(manifest["shards"]) >= 4  # so that both Ray Train workers own shards of their own
    lost = store.shard_info(manifest["shards"][0])  # a shard lost: a re-run answers exactly its rows again
    s3_server.client.delete_object(Bucket=bucket, Key=f"work/features/{lost.name}")
    redone = run_datagen(DatagenJob(input=data, output=store.uri, decode=job.decode_config(),
                                    recipe=job.recipe, exclude_ids=tuple(held), rows_per_shard=4))
    assert redone["rows"] == manifest["rows"] and redone["examples"] == manifest["examples"]
    assert len(redone["shards"]) == len(manifest["shards"])  # its rows came back (in a shard named by their ids)
    assert set(lost.ids) <= {i for n in redone["shards"] for i in store.shard_info(n).ids}
    manifest = redone
    with pytest.raises(ValueError, match="features of another job .*held_out"):  # a changed split is refused
        run_datagen(DatagenJob(input=data, output=store.uri, decode=job.decode_config(), recipe=job.recipe,
                               exclude_ids=tuple(held[:1])))

    # Ray Train: one worker was killed after the first checkpoint; the group restarted from a checkpoint
    assert killed, "the killer never found a checkpoint and a worker to kill"
    hist = summary["history"]
    assert len(hist["starts"]) >= 2 and 0 < hist["starts"][-1] < 12, hist
    assert [h["epoch"] for h in hist["history"]] == list(range(1, 13)) and hist["history"][0]["workers"] == 2
    assert hist["history"][-1]["loss"] < hist["history"][0]["loss"]
    assert summary["heldout_rows"] == 3 and 0 <= summary["heldout_tau"] <= TreeConfig().depth

    # re-running the finished job resumes everything from storage: nothing is answered or trained again
    before = s3_server.client.get_object(Bucket=bucket, Key="drafters/eagle2/model.safetensors")["Body"].read()
    again = run_train_job(job)
    assert again["history"]["history"] == hist["history"] and again["examples"] == summary["examples"]
    assert s3_server.client.get_object(Bucket=bucket, Key="drafters/eagle2/model.safetensors")["Body"].read() == before

    # every other method trains from the same shards on Ray Train (nothing answered again): MSD's and ViSpec's
    # two-stage schedules read the text-only rows first; SpecFLASH and ViSpec cut media by the segments stored with
    # each example, HiViS trains on the selection made where the target is loaded (workers never load it), EAGLE-3
    # on the three layers' states stored with each example and a draft vocabulary counted where the target is
    two = job.train.model_copy(update={"epochs": 2})
    trained = {"eagle2": summary}
    for method in ("msd", "vispec", "hivis", "specflash", "eagle3"):
        options = {"min_answer_words": 0} if method == "hivis" else {}  # the tiny model answers in word-less soup
        if method == "eagle3":  # a draft vocabulary smaller than the target's: built on the driver from the shards
            options = {"draft_vocab_size": 64, "ttt_steps": 3}
        res = run_train_job(job.model_copy(update={"method": method, "out": f"s3://{bucket}/drafters/{method}",
                                                   "method_options": options,
                                                   "train": two.model_copy(update={"epochs": 3}) if method == "vispec"
                                                   else two}))
        assert res["examples"] == manifest["examples"] and res["trainer"] == "ray-train", (method, res)
        hist_m = res["history"]["history"]  # (a two-stage epoch has min(text, multimodal) = 2 items here: a worker
        assert all(h["workers"] == 2 for h in hist_m) and any(h["steps"] for h in hist_m), (method, hist_m)  # may get none)
        trained[method] = res
    # EAGLE-3's draft vocabulary: counted on the driver over every shard's answers, carried in the head config
    from mmspec_ray.drafters.eagle3 import frequent_tokens

    e3 = json.loads(s3_server.client.get_object(Bucket=bucket, Key="drafters/eagle3/config.json")["Body"].read())
    answers = [ex.input_ids[ex.n_prompt:] for ex in store.load_all()]
    assert e3["draft_vocab_size"] == 64 and e3["draft_tokens"] == frequent_tokens(answers, e3["target_vocab_size"], 64)
    assert [h["multimodal_share"] for h in trained["msd"]["history"]["history"]] == [0.0, 1.0]
    assert [h["multimodal_share"] for h in trained["vispec"]["history"]["history"]] == [0.0, 1.0, 1.0]
    init = json.loads(s3_server.client.get_object(Bucket=bucket, Key="work/init/selection.json")["Body"].read())
    assert sorted(init) == sorted(manifest["shards"])  # hivis's selection (the last one made): one entry per shard
    with pytest.raises(ValueError, match="hivis data selection keeps no multimodal example"):  # its own filter:
        run_train_job(job.model_copy(update={"method": "hivis", "train": two}))  # every tiny answer is short

    # the drafter on S3 loads by its URI (endpoint from the environment, as a user sets it) and decodes exactly as
    # the target alone: HF generate, greedy
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint_url)
    target = load_target(ckpt)
    drafter = load_drafter(job.out, target)
    assert isinstance(drafter, Eagle2Drafter)
    engines = [SpecEngine(target, load_drafter(f"s3://{bucket}/drafters/{m}", target),
                          TreeConfig(top_k=4, depth=3, total_tokens=12)) for m in trained]
    for i, img in enumerate(random_images(4, seed=77)):
        req = Request(prompt=f"describe the image {i}", images=(img,))
        inputs = target.encode(req)
        with torch.inference_mode():
            hf = target.model.generate(**inputs, do_sample=False, max_new_tokens=16)
        for engine in engines:
            assert engine.generate(req, max_new_tokens=16).token_ids == hf[0, inputs["input_ids"].shape[1]:].tolist()


def test_cli_single_process_trainer_on_the_same_path(ray_cluster, ckpt, tmp_path, capsys, monkeypatch):
    """As a new user: `--drafter auto` finds no drafter for the checkpoint and names the command that trains one on
    the data; that command (`mmspec train-drafter --target DIR --data PARQUET --out ...`, num-workers 0: the same
    datagen job, then the in-memory trainer; run here with a relative --out) trains a drafter that records the
    checkpoint's identity, and auto then finds it. The printed summary is what was measured."""
    from mmspec_ray.cli import main
    from mmspec_ray.targets.layout import checkpoint_identity
    from mmspec_ray.toy.drafter import choose_drafter

    monkeypatch.setenv("MMSPEC_HOME", str(tmp_path / "home"))
    rows = [{"id": f"r{i}", "prompt": "describe the image", "image": png(img), "image_uri": None}
            for i, img in enumerate(random_images(10, seed=3))]
    data = str(tmp_path / "req.parquet")
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), data)
    before = choose_drafter("auto", ckpt, data=data)
    assert before.spec == "ngram" and "train-drafter --method auto" in before.why
    command = before.why.split("train one on this data with: ")[1].split()
    command = command[command.index("train-drafter"):]  # after the program (mmspec, its path, or python -m ...)
    out = Path(command[command.index("--out") + 1])
    assert out.parent == tmp_path / "home" / "drafters"
    (tmp_path / "home").mkdir()
    monkeypatch.chdir(tmp_path / "home")
    relative = ["--out" if a == "--out" else str(out.relative_to(tmp_path / "home")) if a == str(out) else a
                for a in command]
    argv = relative + ["--heldout", "2", "--epochs", "2", "--batch-size", "4", "--max-new-tokens", "8",
                       "--device", "cpu", "--method", "eagle2"]  # (auto picks suffix for the 2-layer checkpoint)
    assert main(argv) == 0
    plan, _, printed = capsys.readouterr().out.partition("\n{")
    summary = json.loads("{" + printed)
    assert "method   eagle2: given" in plan and "trainer  single process, in this process" in plan, plan
    assert summary["trainer"] == "single-process" and summary["examples"] + summary["row_errors"] == 8
    saved = json.loads((out / "history.json").read_text())
    assert saved["heldout_tau"] == summary["heldout_tau"] and [h["epoch"] for h in saved["history"]] == [1, 2]
    assert (out / "model.safetensors").exists() and not (out / "trainer_state.pt").exists()
    assert main(["train-drafter", "--target", ckpt, "--out", str(out)]) == 2  # a checkpoint needs --data
    assert json.loads((out / "config.json").read_text())["target_id"] == checkpoint_identity(ckpt)
    after = choose_drafter("auto", ckpt, data=data)
    assert after.spec == str(out) and "eagle2 trained for this checkpoint" in after.why

    # the README's own-checkpoint job with the defaults (--drafter auto, --gpus-per-actor auto): its plan names the
    # drafter it found and why, and its summary reports the speedup it measured over AR on its sample rows
    from mmspec_ray.batch.cli import main as job_main

    capsys.readouterr()
    assert job_main(["--target", ckpt, "--input", data, "--output", str(tmp_path / "answers"),
                     "--max-new-tokens", "48"], "instruct") == 0  # long enough that calibration ends within the rows
    printed = capsys.readouterr().out
    assert f"drafter  {out}" in printed and "trained for this checkpoint" in printed, printed
    assert "no GPU (CPU)" in printed and "float32 on cpu" in printed, printed
    job = json.loads((tmp_path / "answers" / "_summary.json").read_text())
    measured = job["run"]["speedup_vs_ar"]
    assert measured["rows"] >= 1 and measured["speedup"] > 0 and measured["greedy_identical"] == measured["rows"], job
    assert '"speedup_vs_ar": {' in printed  # the printed summary carries it too


def test_streamed_epochs_cover_the_shards_and_keep_the_schedules_mixture():
    """Ray Train's data plan, without Ray: N workers read disjoint shards covering all of them, every worker takes
    the same number of steps, the single-process trainer's (also when the workers' shards hold unequal counts), and a two-stage epoch keeps exactly the in-memory schedule's mixture, however small
    the shards."""
    from mmspec_ray.training.distributed import epoch_steps, keep_probabilities, shard_keeps, worker_shards
    from mmspec_ray.training.schedule import StageSchedule

    for n, world in ((6, 2), (7, 2), (5, 3)):
        for epoch in range(3):
            got = [worker_shards(n, r, world, epoch, seed=0) for r in range(world)]
            assert sorted(sum(got, [])) == list(range(n))  # disjoint, and every shard read once per epoch
    manifest = {"shards": [f"s{i}" for i in range(6)], "examples_per_shard": [10] * 6,
                "multimodal_per_shard": [8] * 6}
    one = StageSchedule(epochs=4)
    assert keep_probabilities(one, 1, 48, 12) == (1.0, 0.0)
    assert shard_keeps(manifest, one, 1) == [(8, 0)] * 6
    assert epoch_steps(manifest, one, 0, world=2, local_bs=8, seed=0) == 3  # 24 examples per worker / 8
    uneven = {"shards": [f"s{i}" for i in range(6)], "examples_per_shard": [32] * 5 + [16]}
    for seed in range(4):  # 176 examples split 96 / 80 or 80 / 96: the single-process trainer's 11 steps of 16
        assert epoch_steps(uneven, one, 0, world=2, local_bs=8, seed=seed) == 11
    msd = StageSchedule(epochs=4, text_epochs=2)
    for epoch in (1, 3, 4):
        keeps = shard_keeps(manifest, msd, epoch)
        n_mm, n_text = sum(k[0] for k in keeps), sum(k[1] for k in keeps)
        assert n_mm + n_text == 12  # min(N_mm, N_text) items
        assert n_mm == round(12 * msd.ratio(epoch))  # with the schedule's multimodal share
    tiny = {"shards": ["a", "b", "c", "d"], "examples_per_shard": [4, 4, 4, 4], "multimodal_per_shard": [4, 3, 4, 3]}
    keeps = shard_keeps(tiny, StageSchedule(epochs=2, text_epochs=1), 2)
    assert sum(k[0] for k in keeps) == 2  # 2 of 14 multimodal examples kept, not 0 after per-shard rounding
    mixed = StageSchedule(epochs=4, mixed=True)
    assert keep_probabilities(mixed, 2, 48, 12) == (1.0, 1.0)
    assert shard_keeps(manifest, mixed, 2) == [(8, 2)] * 6


def test_shards_record_ids_and_errors_in_their_headers(tmp_path):
    from mmspec_ray.training.shards import FeatureExample

    ex = FeatureExample(torch.arange(5), torch.randn(5, 4).half(), torch.randn(5, 4).half(), 3,
                        torch.tensor([0, 1, 1, 0, 0], dtype=torch.bool))
    store = ShardStore(str(tmp_path / "f"))
    store.write_shard("shard-a.safetensors", [ex], ["r1", "r2"], {"r2": {"error": "image: gone",
                                                                      "error_kind": "media.not_found"}})
    info = store.shard_info("shard-a.safetensors")
    assert info.ids == ["r1", "r2"] and info.errors["r2"]["error_kind"] == "media.not_found"
    assert info.examples == 1 and info.multimodal == 1
    back = store.load_shard("shard-a.safetensors")[0]
    assert torch.equal(back.input_ids, ex.input_ids) and torch.equal(back.hidden, ex.hidden)
    assert torch.equal(back.media, ex.media) and back.n_prompt == 3
    manifest = store.write_manifest({"recipe": {}})
    assert manifest["examples"] == 1 and manifest["rows"] == 2 and list(manifest["errors"]) == ["r2"]
    assert [p.name for p in (tmp_path / "f").iterdir() if p.name.startswith(".")] == []  # no partial files left
