"""Your checkpoint on your GPUs: resources that follow the cluster (a local Ray that declares GPUs), the GPU probe
that refuses where torch sees no CUDA, fractional packing, the memory refusal, the plan and `--dry-run` (no model
loaded, nothing written), and drafters found for the checkpoint by its identity."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray")

from mmspec_ray.batch import JobSpec, run_job  # noqa: E402
from mmspec_ray.batch.cli import main as job_main  # noqa: E402
from mmspec_ray.batch.jobspec import DecodeConfig  # noqa: E402
from mmspec_ray.batch.plan import check_memory, format_plan, make_plan, memory_need, resolve_gpus  # noqa: E402
from mmspec_ray.batch.storage import JobInputError  # noqa: E402
from mmspec_ray.drafters.base import load_drafter  # noqa: E402
from mmspec_ray.drafters.eagle import Eagle2Drafter  # noqa: E402
from mmspec_ray.targets import load_target  # noqa: E402
from mmspec_ray.targets.layout import checkpoint_identity, read_layout  # noqa: E402
from mmspec_ray.toy.drafter import choose_drafter  # noqa: E402
from tiny import random_images, tiny_llava  # noqa: E402

GIB = 2**30


@pytest.fixture(scope="module")
def gpu_cluster():
    """A local Ray that declares 2 GPUs (a resource only: torch here has no CUDA)."""
    from mmspec_ray.batch.cluster import start_local_ray

    start_local_ray(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def requests_parquet(tmp_path) -> str:
    rows = []
    for i, img in enumerate(random_images(3, seed=5)):
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        rows.append({"id": f"r{i}", "prompt": "describe the image", "image": buf.getvalue()})
    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load in this process fails the test."""
    import transformers

    def boom(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(transformers.AutoModelForImageTextToText, "from_pretrained", boom)
    monkeypatch.setattr("mmspec_ray.targets.registry.load_target", boom)


def test_gpus_auto_plans_one_gpu_per_actor_and_refuses_where_torch_has_no_cuda(gpu_cluster, ckpt, tmp_path,
                                                                             requests_parquet, no_model_loads):
    spec = JobSpec(input=requests_parquet, output=str(tmp_path / "out"), decode=DecodeConfig(target=ckpt,
                                                                                            drafter="ngram"))
    assert spec.gpus_per_actor == "auto" and resolve_gpus(spec) == 1.0
    assert resolve_gpus(spec.model_copy(update={"gpus_per_actor": 0.5})) == 0.5
    cpu = spec.model_copy(update={"decode": spec.decode.model_copy(update={"device": "cpu"})})
    assert resolve_gpus(cpu) == 0.0  # asked for CPU decoding: no GPU reserved
    with pytest.raises(JobInputError, match="offers GPUs to Ray, but torch .* sees no CUDA device.*"
                                            "--gpus-per-actor 0"):
        run_job(spec, dry_run=True)
    assert not (tmp_path / "out").exists()


def test_dry_run_prints_the_plan_loads_no_model_and_writes_nothing(gpu_cluster, ckpt, tmp_path, requests_parquet,
                                                                  no_model_loads, capsys):
    out = tmp_path / "out"
    rc = job_main(["--target", ckpt, "--input", requests_parquet, "--output", str(out), "--drafter", "ngram",
                   "--gpus-per-actor", "0", "--limit", "2", "--dry-run"], "instruct")
    assert rc == 0 and not out.exists()
    text = capsys.readouterr().out
    assert "plan:" in text and "(llava, 0.2 M parameters)" in text and "float32 on cpu" in text
    assert "no GPU (CPU)" in text and "2 from " in text and "2 to decode" in text and "drafter  ngram: given" in text
    assert "calibrated on this machine" in text


def test_a_dry_run_refuses_exactly_what_the_run_refuses(gpu_cluster, ckpt, tmp_path, requests_parquet, capsys):
    """Every check the run makes on its output, the dry run makes too, writing nothing: an output made with other
    settings, another input, a changed input (with --overwrite: another input still refused), files the job did not
    write, an output that is a file, a lease another job holds. Where the run would resume, the dry run says so; with
    --overwrite it plans every row."""
    from mmspec_ray.batch.lease import acquire
    from mmspec_ray.batch.output import claim
    from mmspec_ray.batch.pipeline import job_config
    from mmspec_ray.batch.storage import input_fingerprints, locate, parquet_files

    def spec_for(out: Path, src: str = requests_parquet, **over) -> JobSpec:
        return JobSpec(input=src, output=str(out), gpus_per_actor=0, **over,
                       decode=DecodeConfig(target=ckpt, drafter="ngram", device="cpu", max_new_tokens=8))

    def made(out: Path, src: str = requests_parquet) -> None:  # an output this job made earlier
        s3, spec = spec_for(out).decode.s3, spec_for(out, src)
        src_loc = locate(src, s3)
        claim(locate(str(out), s3), job_config(spec).text_settings(), src,
              input_fingerprints(src_loc, parquet_files(src_loc)))

    def both(spec: JobSpec, match: str) -> None:
        before = sorted(p.name for p in Path(spec.output).iterdir()) if Path(spec.output).is_dir() else None
        for dry in (True, False):
            with pytest.raises(JobInputError, match=match):
                run_job(spec, dry_run=dry)
            after = sorted(p.name for p in Path(spec.output).iterdir()) if Path(spec.output).is_dir() else None
            assert after == before, (dry, before, after)

    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"id": ["z"], "prompt": ["p"], "image": [b"x"]}), other)
    out = tmp_path / "out"
    made(out)
    run_job(spec_for(out), dry_run=True)
    assert "the output exists: a run decodes only the rows not in it yet" in capsys.readouterr().out
    run_job(spec_for(out, overwrite=True), dry_run=True)
    assert "3 to decode" in capsys.readouterr().out
    other_settings = spec_for(out)
    other_settings = other_settings.model_copy(update={"decode": other_settings.decode.model_copy(
        update={"max_new_tokens": 9})})
    both(other_settings, "other decoding settings")
    both(spec_for(out, str(other)), "holds the answers of another job")
    both(spec_for(out, str(other), overwrite=True), "holds the answers of another job")
    changed = tmp_path / "changed" / "in.parquet"
    changed.parent.mkdir()
    shutil.copy(requests_parquet, changed)
    made(tmp_path / "out2", str(changed))
    table = pq.read_table(changed)
    pq.write_table(table.set_column(1, "prompt", pa.array(["another prompt"] * len(table))), changed)
    both(spec_for(tmp_path / "out2", str(changed)), "the input changed")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    both(spec_for(foreign), "that this job did not write")
    (tmp_path / "a-file").write_text("x")
    both(spec_for(tmp_path / "a-file"), "is a file")
    lease = acquire(locate(str(out), spec_for(out).decode.s3), spec_for(out).decode.s3)
    try:
        both(spec_for(out), "is in use by another job")
    finally:
        lease.release()


def test_the_plan_packs_fractional_actors_and_refuses_a_target_that_cannot_fit(ckpt):
    layout = read_layout(ckpt)
    need = memory_need(layout, "bfloat16", 128)
    assert need["weights_gib"] == round(layout.parameters * 2 / GIB, 4) and need["need_gib"] > need["weights_gib"]
    h100 = {"cuda": True, "torch": "x", "name": "H100", "memory": 80 * GIB}
    assert check_memory(need, 0.25, h100) == 20.0 and check_memory(need, 0.0, None) is None
    big = {"weights_gib": 15.2, "kv_gib": 4.3, "need_gib": 22.4}
    with pytest.raises(JobInputError, match=r"needs about 22.4 GiB per actor .* has 20.0 GiB \(0.25 of a 80 GiB "
                                            r"H100\).*--gpus-per-actor 1"):
        check_memory(big, 0.25, h100)
    assert check_memory(big, 1.0, h100) == 80.0
    spec = JobSpec(input="in.parquet", output="out", num_actors=4, gpus_per_actor=0.5,
                   decode=DecodeConfig(target=ckpt, drafter="ngram"))
    cfg = spec.decode.model_copy(update={"device": "cuda", "dtype": "bfloat16"})
    plan = make_plan(spec, cfg, 0.5, 1.0, 10, 10, None, h100)
    assert plan["packing"] == "2 actors per GPU" and plan["memory_per_actor"]["device_share_gib"] == 40.0
    assert "0.5 GPU per actor (2 actors per GPU)" in format_plan(plan) and "cuda (H100)" in format_plan(plan)


def _other_ckpt(tmp_path: Path) -> str:
    model, processor = tiny_llava(seed=7)
    path = tmp_path / "other"
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


def _saved_drafter(target, path: Path, tau: float | None) -> str:
    Eagle2Drafter.random(target).head.save(path)
    if tau is not None:
        (path / "history.json").write_text(json.dumps({"method": "eagle2", "heldout_tau": tau}))
    return str(path)


def test_auto_finds_the_drafter_trained_for_the_checkpoint_and_prefers_the_faster(ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_HOME", str(tmp_path / "home"))
    target = load_target(ckpt)
    assert target.identity == checkpoint_identity(ckpt)
    other_ckpt = _other_ckpt(tmp_path)
    other = load_target(other_ckpt)
    assert other.identity != target.identity
    home = tmp_path / "home" / "drafters"
    extra = tmp_path / "team-drafters"
    choice = choose_drafter("auto", ckpt, data="s3://b/requests/")
    assert choice.spec == "ngram" and "no drafter trained for this checkpoint" in choice.why
    assert f"train-drafter --method auto --target {ckpt} --data s3://b/requests/ --out {home}/" in choice.why
    with_tokens = choose_drafter("auto", ckpt, data="s3://b/requests/", max_new_tokens=96)
    assert "--data s3://b/requests/ --max-new-tokens 96 --out" in with_tokens.why
    slow = _saved_drafter(target, home / "slow", 0.8)
    _saved_drafter(other, home / "for-other", 3.0)  # faster, but for another checkpoint
    assert json.loads((Path(slow) / "config.json").read_text())["target_id"] == target.identity
    assert choose_drafter("auto", ckpt).spec == slow
    fast = _saved_drafter(target, extra / "fast", 1.6)
    assert choose_drafter("auto", ckpt).spec == slow  # --drafter-dir not given: not looked at
    choice = choose_drafter("auto", ckpt, (str(extra),))
    assert choice.spec == fast and "held-out τ 1.60" in choice.why and target.identity in choice.why
    assert isinstance(load_drafter(fast, target), Eagle2Drafter)
    with pytest.raises(ValueError, match=f"trained for another target: checkpoint {other.identity} vs this "
                                         f"target's {target.identity}"):
        load_drafter(str(home / "for-other"), target)
    assert choose_drafter("ngram", ckpt).spec == "ngram"  # anything but auto passes through


def test_auto_skips_drafters_that_would_not_load_and_says_which(ckpt, tmp_path, monkeypatch):
    """An interrupted copy (config.json and history.json with a better τ, no weights) and a config.json that is not
    JSON never win: auto takes the loadable drafter and names each folder it skipped and why, also on S3."""
    monkeypatch.setenv("MMSPEC_HOME", str(tmp_path / "home"))
    target = load_target(ckpt)
    home = tmp_path / "home" / "drafters"
    good = _saved_drafter(target, home / "good", 0.5)
    partial = Path(_saved_drafter(target, home / "partial", 0.9))
    (partial / "model.safetensors").unlink()
    empty = Path(_saved_drafter(target, home / "empty", 1.5))
    (empty / "model.safetensors").write_bytes(b"")
    broken = home / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    (home / "a-checkpoint").mkdir()  # some other model's folder: not a drafter, not reported
    (home / "a-checkpoint" / "config.json").write_text(json.dumps({"model_type": "llava"}))
    choice = choose_drafter("auto", ckpt)
    assert choice.spec == good and "held-out τ 0.50" in choice.why, choice.why
    assert "skipped 3 that would not load" in choice.why and "a-checkpoint" not in choice.why
    assert f"{partial} (no weights" in choice.why and f"{empty} (no weights" in choice.why
    assert f"{broken} (config.json is not JSON" in choice.why
    shutil.rmtree(home / "good")
    choice = choose_drafter("auto", ckpt)
    assert choice.spec == "ngram" and "skipped 3" in choice.why


def test_a_drafter_dir_that_does_not_exist_is_refused_in_one_line(ckpt, tmp_path, capsys, monkeypatch):
    """A misspelt --drafter-dir is a job-level mistake (exit 2, one line), not "no drafter among 0"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mmspec_ray.batch.cli import main as job_main

    monkeypatch.setenv("MMSPEC_HOME", str(tmp_path / "home"))
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a"], "prompt": ["p"], "image_uri": ["x.png"]}), src)
    rc = job_main(["--input", str(src), "--output", str(tmp_path / "out"), "--target", ckpt,
                   "--drafter-dir", str(tmp_path / "no-such-dir"), "--dry-run"], "instruct")
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == f"error: --drafter-dir {tmp_path / 'no-such-dir'} does not exist; give a folder " \
        "holding trained drafters (or one drafter), or leave the flag out to look only in $MMSPEC_HOME/drafters"


def test_identity_is_the_same_wherever_the_checkpoint_is_copied_and_differs_for_other_weights(ckpt, tmp_path,
                                                                                           s3_server):
    import torch

    mine = checkpoint_identity(ckpt)
    bucket = s3_server.new_bucket("ckpt")
    for f in Path(ckpt).iterdir():
        s3_server.client.upload_file(str(f), bucket, f"models/llava/{f.name}")
    assert checkpoint_identity(f"s3://{bucket}/models/llava/", s3_server.s3_config) == mine  # ranged reads
    assert read_layout(f"s3://{bucket}/models/llava", s3_server.s3_config).parameters == read_layout(ckpt).parameters
    model, processor = tiny_llava()
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    processor.save_pretrained(tmp_path / "bf16")
    assert checkpoint_identity(str(tmp_path / "bf16")) == mine  # another dtype, another folder: the same model
    sparse = tmp_path / "sparse"  # the same weights with a config that leaves a default out (as hub configs do)
    shutil.copytree(ckpt, sparse)
    cfg = json.loads((sparse / "config.json").read_text())
    tc_default = type(load_target(ckpt).model.config.text_config)().to_dict()
    dropped = next(k for k, v in cfg["text_config"].items() if k in tc_default and tc_default[k] == v and
                   k not in ("model_type",))
    del cfg["text_config"][dropped]
    (sparse / "config.json").write_text(json.dumps(cfg))
    assert checkpoint_identity(str(sparse)) == mine, dropped
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1.0  # a fine-tune of the same base
    model.save_pretrained(tmp_path / "tuned")
    assert checkpoint_identity(str(tmp_path / "tuned")) != mine


def test_serve_takes_a_gpu_per_replica_where_the_cluster_has_them_and_prints_its_plan(gpu_cluster, ckpt):
    from mmspec_ray.batch.plan import auto_gpus
    from mmspec_ray.serve.app import serve_drafter, serve_plan
    from mmspec_ray.serve.settings import ServeSettings

    assert auto_gpus("auto", "auto") == 1.0 and auto_gpus(0.5, "auto") == 0.5 and auto_gpus(0, "cuda") == 0.0
    assert auto_gpus("auto", "cpu") == 0.0  # a CPU decode device takes no GPU, as in the batch jobs
    settings = ServeSettings.model_validate({"decode": {"target": ckpt}})
    decode, why = serve_drafter(settings.decode)
    assert decode.drafter == "ngram" and "no drafter trained for this checkpoint" in why
    plan = serve_plan(settings, decode, 1.0, why)
    assert "(llava, 0.2 M parameters)" in plan and "bfloat16 on cuda; 1 GPU per replica" in plan
    cpu = settings.decode.model_copy(update={"device": "cpu"})
    assert "float32 on cpu; no GPU (CPU)" in serve_plan(settings, cpu, 0.0, "given")
    from mmspec_ray.serve.proxy_errors import PROXY_CALLBACK, PROXY_CALLBACK_ENV

    said = "every answer in the API's JSON format" in serve_plan(settings, cpu, 0.0, "given")
    assert said == (os.environ.get(PROXY_CALLBACK_ENV) == PROXY_CALLBACK)


def test_auto_finds_a_drafter_in_an_s3_drafter_dir(ckpt, tmp_path, s3_server, monkeypatch):
    monkeypatch.setenv("MMSPEC_HOME", str(tmp_path / "home"))
    target = load_target(ckpt)
    local = Path(_saved_drafter(target, tmp_path / "d", 1.1))
    bucket = s3_server.new_bucket("drafters")
    for f in local.iterdir():
        s3_server.client.upload_file(str(f), bucket, f"team/llava-eagle2/{f.name}")
    choice = choose_drafter("auto", ckpt, (f"s3://{bucket}/team/",), s3=s3_server.s3_config)
    assert choice.spec == f"s3://{bucket}/team/llava-eagle2" and "held-out τ 1.10" in choice.why
    for name in ("config.json", "history.json"):  # an interrupted upload with a better τ: skipped, named
        s3_server.client.put_object(Bucket=bucket, Key=f"team/partial/{name}", Body=(local / name).read_bytes()
                                    .replace(b"1.1", b"2.5"))
    choice = choose_drafter("auto", ckpt, (f"s3://{bucket}/team/",), s3=s3_server.s3_config)
    assert choice.spec == f"s3://{bucket}/team/llava-eagle2", choice.why
    assert f"s3://{bucket}/team/partial (no weights" in choice.why


def test_a_checkpoint_without_safetensors_has_no_identity_and_still_loads_drafters(ckpt, tmp_path):
    target = load_target(ckpt)
    (tmp_path / "bin").mkdir()
    shutil.copy(Path(ckpt) / "config.json", tmp_path / "bin" / "config.json")
    target.checkpoint = str(tmp_path / "bin")  # as if loaded from pytorch_model.bin weights
    assert target.identity is None and target.checkpoint is None
    assert isinstance(Eagle2Drafter.random(target), Eagle2Drafter)


def test_media_decoding_stays_apart_from_the_decoder_actors(gpu_cluster, ckpt):
    """With as many actors as leave each the media tasks' CPU share (2 actors on 2 CPUs: 0.5 each), Ray Data would
    fuse the media stage into the decoder actors (no overlap, the media's memory on top of the model's): the
    optimised plan keeps it a task stage of its own, for 1 or 2 actors."""
    from ray.data._internal.logical.optimizers import get_execution_plan

    from mmspec_ray.batch.decoder import SpecDecoder
    from mmspec_ray.batch.pipeline import _build
    from mmspec_ray.batch.rows import prepare_row

    table = pa.table({"id": ["a", "b", "c", "d"], "prompt": ["p"] * 4})
    for actors in (1, 2):
        spec = JobSpec(input="in.parquet", output="out", num_actors=actors, gpus_per_actor=0, cpus_per_actor=0.5,
                       decode=DecodeConfig(target=ckpt, drafter="ngram", device="cpu"))
        assert spec.cpus_per_task == 0.5  # the media tasks ask for what each actor gets
        ds = _build(spec, spec.decode, table, None, table.column("id").combine_chunks(), True, SpecDecoder, None,
                    prepare_row, actor_cpus=0.5)
        op, names = get_execution_plan(ds._logical_plan)[0].dag, []
        while op is not None:
            names.append(op.name)
            op = op.input_dependencies[0] if op.input_dependencies else None
        assert names[:2] == ["MapBatches(SpecDecoder)", "MapBatches(prepare_block)"], names
