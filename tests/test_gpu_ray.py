"""scripts/gpu_ray.sh: the recorded GPU run of the service under Ray. Its CPU dry run runs the same sequence at tiny
sizes (a one-node loopback Ray; the batch jobs, the Serve endpoint with a killed replica, Ray Train and the trained
drafter decoding) and must leave its records; the pack recipe that carries what the GPU machine lacks is checked
on small fake archives (nothing is downloaded here)."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from mmspec_ray.bench import gpu_pack, gpu_ray
from mmspec_ray.bench.gpu_pack import MIB, Piece, capacity, plan_pieces, select, tree_bytes, unpack, write_pieces

ROOT = Path(__file__).resolve().parent.parent

# What `bash scripts/gpu_ray.sh pack` made (docs/bench/gpu-ray/README.md): the xz archives of the site folder and
# of the pruned toy-s world.
PACKED_BYTES = {"site": 70_672_408, "world": 11_371_928}


# ---------------------------------------------------------------------------------------------------- the pieces
def covered(calls: list[list[Piece]], sizes: dict[str, int]) -> dict[str, list[tuple[int, int]]]:
    spans: dict[str, list[tuple[int, int]]] = {n: [] for n in sizes}
    for call in calls:
        for p in call:
            spans[p.name].append((p.offset, p.length))
    return spans


@pytest.mark.parametrize("sizes,cap", [
    ({"site": 100, "world": 30}, 50),
    ({"a": 50, "b": 50}, 50),
    ({"a": 7}, 100),
    ({"a": 1, "b": 2, "c": 3, "d": 4}, 3),
    (PACKED_BYTES, 46 * MIB),
])
def test_every_byte_in_one_piece_no_call_over_capacity_and_as_few_calls_as_the_bytes_need(sizes, cap):
    calls = plan_pieces(sizes, cap)
    assert all(0 < sum(p.length for p in c) <= cap for c in calls)
    assert len(calls) == math.ceil(sum(sizes.values()) / cap)
    for name, spans in covered(calls, sizes).items():
        assert spans[0][0] == 0 and sum(n for _, n in spans) == sizes[name]
        assert all(o1 + n1 == o2 for (o1, n1), (o2, _) in zip(spans, spans[1:]))  # in order, no gap, no overlap
        indices = [p.index for c in calls for p in c if p.name == name]
        assert indices == list(range(len(indices)))


def test_pieces_property():
    from hypothesis import given
    from hypothesis import strategies as st

    @given(st.dictionaries(st.sampled_from("abcdef"), st.integers(1, 500), min_size=1), st.integers(1, 300))
    def check(sizes, cap):
        calls = plan_pieces(sizes, cap)
        assert all(sum(p.length for p in c) <= cap for c in calls)
        assert len(calls) == math.ceil(sum(sizes.values()) / cap)
        assert {n: sum(x[1] for x in s) for n, s in covered(calls, sizes).items()} == sizes

    check()


def test_capacity_leaves_the_tree_and_a_margin_and_refuses_a_tree_with_no_room():
    assert capacity(14 * MIB) == 64 * MIB - 14 * MIB - gpu_pack.MARGIN
    with pytest.raises(ValueError, match="no room"):
        capacity(63 * MIB)
    with pytest.raises(ValueError):
        plan_pieces({"a": 1}, 0)


def test_this_checkout_leaves_room_for_the_packed_archives_in_two_calls():
    """The recipe in the docs is two calls: the working tree that travels must leave each call room for half of
    what was packed (a tree grown past that needs a third call; `bash scripts/gpu_ray.sh plan` says so)."""
    cap = capacity(tree_bytes(ROOT))
    assert len(plan_pieces(PACKED_BYTES, cap)) <= 2, f"{cap / MIB:.1f} MiB per call"


def test_tree_bytes_counts_what_travels_and_not_what_git_ignores(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("/.gpu-ray/\n")
    (tmp_path / "tracked.txt").write_bytes(b"x" * 1000)
    subprocess.run(["git", "-C", str(tmp_path), "add", "tracked.txt", ".gitignore"], check=True)
    (tmp_path / "untracked.txt").write_bytes(b"y" * 300)
    (tmp_path / ".gpu-ray").mkdir()
    (tmp_path / ".gpu-ray" / "piece").write_bytes(b"z" * 5000)
    assert tree_bytes(tmp_path) == 1000 + 300 + len("/.gpu-ray/\n")


def xz_archive(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:xz") as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return path


def test_pieces_cross_calls_and_unpack_extracts_each_archive_once_all_its_pieces_came(tmp_path):
    """Two archives cut for calls of a few KiB: the machine gets one call's folder at a time (an earlier folder may
    be gone), stashes the pieces, and extracts an archive as soon as all its pieces are there."""
    rng = __import__("random").Random(0)
    site_files = {f"pkg/mod{i}.py": bytes(rng.getrandbits(8) for _ in range(3000)) for i in range(4)}
    world_files = {"toy-s-seed0-v5/.complete": b"ok\n", "toy-s-seed0-v5/target/w": b"w" * 100}
    archives = {"site": (xz_archive(tmp_path / "site.tar.xz", site_files), "site"),
                "world": (xz_archive(tmp_path / "world.tar.xz", world_files), "toy")}
    cap = 5000
    manifest = write_pieces(archives, tmp_path / "pack", cap)
    calls = sorted((tmp_path / "pack").glob("call*"))
    assert len(calls) == len(manifest["calls"]) >= 3
    for c, m in zip(calls, manifest["calls"]):
        size = sum(f.stat().st_size for f in c.iterdir() if f.name != gpu_pack.MANIFEST)
        assert size == m["bytes"] <= cap and (c / gpu_pack.MANIFEST).is_file()

    machine = tmp_path / "machine" / ".gpu-ray"
    stash, dests = tmp_path / "stash", {"site": tmp_path / "site", "toy": tmp_path / "home" / "toy"}
    seen: list[tuple[list[str], list[str]]] = []
    for c in calls:  # one call after another, each bringing its own folder only
        if machine.exists():
            import shutil

            shutil.rmtree(machine)
        machine.mkdir(parents=True)
        (machine / c.name).symlink_to(c, target_is_directory=True)
        seen.append(unpack(machine, stash, dests))
    assert seen[0][0] == [] and set(seen[0][1]) == {"site", "world"}
    assert sorted(seen[-1][0]) == ["site", "world"] and seen[-1][1] == []
    for name, data in site_files.items():
        assert (tmp_path / "site" / name).read_bytes() == data
    assert (tmp_path / "home" / "toy" / "toy-s-seed0-v5" / ".complete").read_bytes() == b"ok\n"
    assert not list(stash.glob("*.0*"))  # the pieces are dropped once extracted
    # a later call that carries nothing finds the archives ready
    import shutil

    shutil.rmtree(machine)
    machine.mkdir()
    assert unpack(machine, stash, dests) == (["site", "world"], [])


def test_unpack_refuses_pieces_that_do_not_join_into_the_packed_archive(tmp_path):
    archives = {"site": (xz_archive(tmp_path / "site.tar.xz", {"a": b"a" * 2000}), "site")}
    write_pieces(archives, tmp_path / "pack", 10**6)
    piece = tmp_path / "pack" / "call1" / "site.000"
    piece.write_bytes(piece.read_bytes()[:-1] + b"\0")
    with pytest.raises(ValueError, match="sha256"):
        unpack(tmp_path / "pack", tmp_path / "stash", {"site": tmp_path / "site"})


def test_check_calls_flags_a_call_the_grown_tree_pushes_over_the_limit(tmp_path):
    archives = {"site": (xz_archive(tmp_path / "s.tar.xz", {"a": os.urandom(4000)}), "site")}
    m = write_pieces(archives, tmp_path / "pack", 10**6)
    assert gpu_pack.check_calls(m, 10 * MIB)[0].endswith(": ok")
    assert "OVER THE LIMIT" in gpu_pack.check_calls(m, 64 * MIB)[0]


def test_select_carries_what_the_machine_lacks_or_has_too_old_and_drops_what_the_run_never_imports():
    report = {"install": [{"metadata": {"name": n, "version": v}} for n, v in [
        ("ray", "2.60.0"), ("pydantic_core", "2.50.5"), ("numpy", "2.5.2"), ("transformers", "5.23.0"),
        ("Typing_Extensions", "4.16.0"), ("botocore", "1.44.18"), ("py-spy", "0.4.3"), ("av", "19.0.2")]]}
    assert select(report) == ["av==19.0.2", "pydantic-core==2.50.5", "ray==2.60.0", "transformers==5.23.0",
                              "typing-extensions==4.16.0"]


def test_prune_removes_what_the_run_never_imports(tmp_path):
    for rel in ("ray/jars/a.jar", "ray/rllib/x.py", "ray/serve/api.py", "ray/dashboard/client/m.js.map", "bin/ray",
                "pydantic/__init__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"0" * 10)
    assert gpu_pack.prune(tmp_path) == 40
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == [
        "pydantic/__init__.py", "ray/serve/api.py"]


# ---------------------------------------------------------------------------------------------------- records
def test_memory_peaks_per_process_and_device(tmp_path):
    (tmp_path / "apps.csv").write_text("101, python, 500\n202, ray::Decoder, 15000\n202, ray::Decoder, 16000\n"
                                       "303, ray::Decoder, 15500\nNo running processes found\n")
    (tmp_path / "gpu.csv").write_text("1000, 81559, 10\n32000, 81559, 90\n")
    m = gpu_ray.memory(tmp_path / "gpu.csv", tmp_path / "apps.csv")
    assert m["per_process_peak_mib"] == {"101": 500.0, "202": 16000.0, "303": 15500.0}
    assert m["decoder_processes"] == 2 and m["peak_per_decoder_gib"] == round(16000 / 1024, 2)
    assert m["device_peak_used_gib"] == round(32000 / 1024, 2) and m["mean_utilization_pct"] == 50.0


def test_serve_config_is_the_gpu_config_pointed_at_the_target_on_loopback():
    c = gpu_ray.serve_config(ROOT / "deployments" / "gpu.yaml", "/t", 8123, 1.0, 4.0, "auto", "auto",
                             "MMSPEC_API_KEY")
    assert c["http_options"]["host"] == "127.0.0.1" and c["http_options"]["port"] == 8123
    args, dep = c["applications"][0]["args"], c["applications"][0]["deployments"][0]
    assert args["decode"]["target"] == "/t" and "s3" not in args["decode"] and args["api_key_env"] == "MMSPEC_API_KEY"
    assert dep["num_replicas"] == 1 and "autoscaling_config" not in dep
    assert dep["ray_actor_options"] == {"num_gpus": 1.0, "num_cpus": 4.0}
    from mmspec_ray.serve.settings import ServeSettings

    ServeSettings.model_validate(args)


# ---------------------------------------------------------------------------------------------------- the dry run
@pytest.mark.slow
def test_the_dry_run_runs_every_stage_on_cpu_and_records_it(tmp_path, ckpt):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "PY": sys.executable, "OUT": str(out), "WORK": str(work), "DRY_TARGET": ckpt,
           "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    p = subprocess.run(["bash", "scripts/gpu_ray.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert {f.name for f in out.iterdir()} >= {"results.json", "log.txt", "gpu-ray.tar.gz"}
    res = json.loads((out / "results.json").read_text())
    assert res["failed"] == [], res["failed"]
    for stage in ("ray-start", "inputs", "caption", "instruct-gauto", "serve-ready", "serve-client",
                  "serve-shutdown", "train", "drafted"):
        assert res["stages"][stage]["rc"] == 0, (stage, res["stages"].get(stage))
    rec = res["records"]
    for job in ("caption", "instruct-gauto", "drafted"):
        r = rec[job]
        assert r["ok"] and r["complete"] and r["errors"] == 0 and r["rows_written"] == r["rows"] > 0, (job, r)
        assert r["estimate_need_gib"] > 0 and r["device"] == "cpu"
    assert rec["drafted"]["drafter"] == str(work / "drafter")
    serve = rec["serve"]
    assert serve["plain"]["status"] == 200 and serve["stream"]["status"] == 200 and serve["stream"]["done"]
    assert serve["stream"]["same_text_as_plain"]
    kill = serve["kill"]
    assert kill["status"] == 503 and int(kill["retry_after"]) >= 1 and kill["error"]["code"] == "unavailable"
    assert kill["recovered_s"] > 0
    assert rec["train-history"]["heldout_tau"] is not None
    assert rec["inputs"]["big_target"]["reduced"] is True
    with tarfile.open(out / "gpu-ray.tar.gz") as t:
        names = set(t.getnames())
    assert {"jobs/caption/_summary.json", "records/serve.json", "logs/train.log"} <= names
    log = (out / "log.txt").read_text()
    assert "dry run on CPU" in log and "every step ok" in log
