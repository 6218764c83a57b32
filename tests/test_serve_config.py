"""The Serve configs in deployments/: valid for Ray's config schema (plus a check for keys it would silently ignore,
at every level) and for `build_app`'s args; and `serve run` of the toy config, pointed at the tiny checkpoint,
answers on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray")
from ray.serve.schema import ServeDeploySchema  # noqa: E402

from mmspec_ray.serve.app import DEPLOYMENT_NAME  # noqa: E402
from mmspec_ray.serve.settings import ServeSettings  # noqa: E402
from serve_fixtures import free_port, unknown_serve_keys  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "deployments").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_is_valid(path):
    data = yaml.safe_load(path.read_text())
    config = ServeDeploySchema.model_validate(data)
    assert not unknown_serve_keys(ServeDeploySchema, data)  # the schema ignores typos at every level: catch them
    for app in data["applications"]:
        assert app["import_path"] == "mmspec_ray.serve.app:build_app"
        ServeSettings.model_validate(app["args"])
        for dep in app["deployments"]:
            assert dep["name"] == DEPLOYMENT_NAME
    assert config.applications


def test_serve_run_toy_config_with_the_tiny_checkpoint(ckpt, tmp_path):
    data = yaml.safe_load((ROOT / "deployments" / "toy.yaml").read_text())
    port = free_port()
    data["http_options"]["port"] = port
    app = data["applications"][0]
    app["args"]["decode"]["target"] = ckpt
    app["args"]["model_name"] = "tiny"
    app["deployments"][0]["ray_actor_options"] = {"num_cpus": 0.5}
    cfg = tmp_path / "toy-tiny.yaml"
    cfg.write_text(yaml.safe_dump(data))
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", PYTHONPATH=str(ROOT))
    env.pop("RAY_ADDRESS", None)
    serve_cli = str(Path(sys.executable).parent / "serve")
    proc = subprocess.Popen([serve_cli, "run", "--address", "local", str(cfg)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline, ready = time.time() + 150, False
        while time.time() < deadline and proc.poll() is None and not ready:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                    ready = json.loads(r.read())["data"][0]["id"] == "tiny"
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(1)
        assert ready, proc.stdout.read().decode()[-3000:] if proc.poll() is not None else "not ready in time"
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "red"}], "max_tokens": 5,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 5
        # the documented command (auth off, single-machine Ray): nothing of it listens beyond loopback
        import ray  # noqa: F401  (ray ships psutil)
        import psutil

        tree = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)} | {proc.pid}
        listen = {(c.laddr.ip, c.laddr.port, psutil.Process(c.pid).name()) for c in psutil.net_connections("inet")
                  if c.status == "LISTEN" and c.pid in tree}
        open_ = sorted(x for x in listen if x[0] not in ("127.0.0.1", "::ffff:127.0.0.1"))
        assert len(listen) > 3 and not open_, open_
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # serve run shuts Serve and its own Ray down on Ctrl-C
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_a_gpu_config_on_a_machine_without_gpus_is_refused_in_one_line_before_ray_starts(tmp_path, monkeypatch,
                                                                                          capsys):
    """`python -m mmspec_ray.serve deployments/gpu.yaml` on a machine whose torch sees no GPU: one line, exit 2,
    naming where the GPU is asked for and the CPU config (Ray would otherwise wait for a GPU forever). The same for
    a replica asking more CPUs than the machine has; the CPU config passes; a cluster named in RAY_ADDRESS decides
    for itself (its autoscaler may add GPU nodes)."""
    import ray
    import torch

    from mmspec_ray.serve.__main__ import check_config_fits, main

    import tempfile

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))  # no Ray already running here
    gpu = str(ROOT / "deployments" / "gpu.yaml")
    assert main([gpu]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "asks for 1 GPU" in err and "deployments/cpu.yaml" in err, err
    assert "ChatCompletions ray_actor_options" in err and not ray.is_initialized()
    assert check_config_fits(str(ROOT / "deployments" / "cpu.yaml"), {}) is None
    assert check_config_fits(gpu, {"RAY_ADDRESS": "ray://head:10001"}) is None
    assert check_config_fits(gpu, {}, [gpu, "--address", "ray://head:10001"]) is None
    data = yaml.safe_load((ROOT / "deployments" / "cpu.yaml").read_text())
    data["applications"][0]["args"]["gpus_per_replica"] = 1  # the deployments: entry's options replace the app's
    (tmp_path / "replaced.yaml").write_text(yaml.safe_dump(data))
    assert check_config_fits(str(tmp_path / "replaced.yaml"), {}) is None  # whole, as Serve does: no GPU asked
    del data["applications"][0]["deployments"][0]["ray_actor_options"]  # now the app's own options hold
    (tmp_path / "args.yaml").write_text(yaml.safe_dump(data))
    assert "args.gpus_per_replica" in check_config_fits(str(tmp_path / "args.yaml"), {})
    data["applications"][0]["args"]["gpus_per_replica"] = 0
    data["applications"][0]["deployments"][0]["ray_actor_options"] = {"num_cpus": (os.cpu_count() or 1) + 1}
    (tmp_path / "cpus.yaml").write_text(yaml.safe_dump(data))
    assert "CPUs" in check_config_fits(str(tmp_path / "cpus.yaml"), {})
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:6379")  # a `ray start` cluster: it decides
    assert check_config_fits(str(tmp_path / "cpus.yaml"), {}) is None
