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
