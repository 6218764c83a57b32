"""A local Ray started with auth off (the README's commands, the tests, the toy Serve config) exposes nothing beyond
loopback: every server of its process tree (GCS, raylet, workers, agents, dashboard) listens on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import json, time, ray
import psutil  # importable once ray is (ray ships it)
from mmspec_ray.batch.cluster import start_local_ray
start_local_ray(num_cpus=1, include_dashboard=True, log_to_driver=False)
ray.get(ray.remote(lambda: 1).remote())  # a worker process too
time.sleep(2)
me = psutil.Process()
tree = {p.pid for p in me.children(recursive=True)} | {me.pid}
print(json.dumps({"gcs": ray.get_runtime_context().gcs_address,
                  "listen": sorted({(c.laddr.ip, psutil.Process(c.pid).name()) for c in psutil.net_connections("inet")
                                    if c.status == "LISTEN" and c.pid in tree})}))
ray.shutdown()
"""


def test_a_local_ray_with_auth_off_listens_on_loopback_only():
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    env["RAY_AUTH_MODE"] = "disabled"
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["gcs"].startswith("127.0.0.1:"), seen
    names = {name for _, name in seen["listen"]}
    assert {"gcs_server", "raylet"} <= names, seen  # the probe saw the servers it is about
    assert all(ip in ("127.0.0.1", "::ffff:127.0.0.1") for ip, _ in seen["listen"]), seen


OPEN_SERVE = """
import os, ray
os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)  # as `serve run` starts it
from mmspec_ray.serve.app import build_app
try:
    build_app({"decode": {"target": "never-read", "device": "cpu"}})
    print("SERVED")
except ValueError as e:
    print("REFUSED", e)
ray.shutdown()
"""


def test_serve_refuses_a_ray_open_beyond_loopback_with_auth_off():
    """`serve run` of a config starts Ray itself; without the loopback variable Ray's servers listen on the
    machine's address. With auth off, build_app refuses in one line instead of serving on that cluster."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    env["RAY_AUTH_MODE"] = "disabled"
    out = subprocess.run([sys.executable, "-c", OPEN_SERVE], env=env, capture_output=True, text=True, timeout=300)
    line = [x for x in out.stdout.splitlines() if x.startswith(("REFUSED", "SERVED"))]
    if line == ["SERVED"]:  # a machine whose only address is loopback: nothing to refuse
        import pytest

        pytest.skip("this machine's node address is loopback")
    assert line and line[0].startswith("REFUSED refusing to serve: Ray's token auth is off"), out.stdout + out.stderr
    assert "python -m mmspec_ray.serve CONFIG" in line[0] and "\n" not in line[0]


def test_the_open_cluster_rule(monkeypatch):
    """Refused: auth off and a node address beyond loopback. Served: loopback, token auth, or the config's explicit
    allow_unauthenticated_network. Before Ray starts (`serve run module:build_app`) the loopback mode is set."""
    import pytest
    import ray
    from ray._private.authentication import authentication_utils as auth

    from mmspec_ray.batch import cluster
    from mmspec_ray.serve.app import refuse_open_cluster
    from mmspec_ray.serve.settings import ServeSettings

    settings = ServeSettings.model_validate({"decode": {"target": "t"}})
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(auth, "is_token_auth_enabled", lambda: False)
    for ip, refused in (("10.1.2.3", True), ("fe80::1%eth0", True), ("127.0.0.1", False), ("::1", False)):
        monkeypatch.setattr(ray.util, "get_node_ip_address", lambda ip=ip: ip)
        if refused:
            with pytest.raises(ValueError, match="refusing to serve"):
                refuse_open_cluster(settings)
            refuse_open_cluster(settings.model_copy(update={"allow_unauthenticated_network": True}))
        else:
            refuse_open_cluster(settings)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.1.2.3")
    monkeypatch.setattr(auth, "is_token_auth_enabled", lambda: True)
    refuse_open_cluster(settings)
    monkeypatch.setattr(auth, "is_token_auth_enabled", lambda: False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv(cluster.SINGLE_MACHINE_ENV, raising=False)
    monkeypatch.setattr(cluster, "loopback_only", lambda: os.environ.__setitem__(cluster.SINGLE_MACHINE_ENV, "0"))
    import mmspec_ray.serve.app as app

    monkeypatch.setattr(app, "loopback_only", cluster.loopback_only)
    refuse_open_cluster(settings)
    assert os.environ[cluster.SINGLE_MACHINE_ENV] == "0"
