"""`python -m mmspec_ray.serve CONFIG [serve run options]`: Ray Serve's `serve run` with this server's environment.
Where no cluster is named (RAY_ADDRESS) and Ray's token auth is off (RAY_AUTH_MODE, default disabled here), the
Ray it starts listens on loopback only; Ray's HTTP proxy answers its own errors in the API's JSON format. Where it
starts that Ray itself, a replica asking for more GPUs or CPUs than this machine has is refused in one line (exit 2)
before Ray starts: on a fixed machine Ray would wait for them forever."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from mmspec_ray.serve.proxy_errors import PROXY_CALLBACK, PROXY_CALLBACK_ENV

SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # (batch/cluster.py's name; that module imports Ray)


def serve_environment(env: MutableMapping[str, str]) -> None:
    """Set what `serve run` needs before Ray is imported: an explicit auth mode, loopback where auth is off and
    this starts the cluster, and the proxy's error middleware. A value the caller set is kept."""
    env.setdefault("RAY_AUTH_MODE", "disabled")
    if env["RAY_AUTH_MODE"] == "disabled" and not env.get("RAY_ADDRESS"):
        env[SINGLE_MACHINE_ENV] = "0"
    env.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)


def replica_asks(app: dict[str, Any]) -> dict[str, tuple[float, str]]:
    """What one replica of a config's application asks for: {"GPU"|"CPU": (count, where it is set)}. A
    `ray_actor_options` in the config's `deployments:` entry replaces the app's own whole (Serve's rule: a key it
    leaves out is not asked for); without one, the app's: `args.deployment.ray_actor_options` over the server's
    default, and `args.gpus_per_replica` where those set no `num_gpus` (auto asks for none where the machine has
    no GPU)."""
    from mmspec_ray.serve.settings import DEFAULT_DEPLOYMENT

    args = app.get("args") or {}
    keys = (("num_gpus", "GPU"), ("num_cpus", "CPU"))
    for d in app.get("deployments") or []:
        if d.get("name") in (None, "ChatCompletions") and d.get("ray_actor_options") is not None:
            where = f"deployments: {d.get('name')} ray_actor_options"
            return {res: (float(d["ray_actor_options"][k]), where) for k, res in keys
                    if d["ray_actor_options"].get(k) is not None}
    out: dict[str, tuple[float, str]] = {}
    gpus = args.get("gpus_per_replica", "auto")
    if gpus != "auto":
        out["GPU"] = (float(gpus), "args.gpus_per_replica")
    for options, where in ((DEFAULT_DEPLOYMENT.get("ray_actor_options") or {}, "the server's default"),
                           ((args.get("deployment") or {}).get("ray_actor_options") or {},
                            "args.deployment.ray_actor_options")):
        for key, res in keys:
            if options.get(key) is not None:
                out[res] = (float(options[key]), where)
    return out


def starts_local_ray(argv: list[str], env: MutableMapping[str, str]) -> bool:
    """Whether `serve run` with these arguments starts a fresh Ray on this machine: no cluster named (RAY_ADDRESS,
    --address / -a) and none running here already (`ray start`; its address file), which may have other nodes."""
    if env.get("RAY_ADDRESS") or any(a in ("--address", "-a") or a.startswith("--address=") for a in argv):
        return False
    return not Path(tempfile.gettempdir(), "ray", "ray_current_cluster").exists()


def check_config_fits(path: str, env: MutableMapping[str, str], argv: list[str] | None = None) -> str | None:
    """Why the config's replicas can never start on this machine (None: they fit, or a cluster named or running
    decides, its autoscaler perhaps adding nodes). Only where this command starts Ray on this machine."""
    import yaml

    if not starts_local_ray(argv or [], env) or not path.endswith((".yaml", ".yml")) or not Path(path).is_file():
        return None
    config = yaml.safe_load(Path(path).read_text()) or {}
    for app in config.get("applications") or []:
        if app.get("import_path", "").split(":")[0] != "mmspec_ray.serve.app":
            continue
        asks = replica_asks(app)
        gpus, where = asks.get("GPU", (0.0, ""))
        if gpus > 0:
            import torch

            if torch.cuda.device_count() < gpus:
                return (f"{path}: a replica asks for {gpus:g} GPU ({where}) but this machine has "
                        f"{torch.cuda.device_count()} that torch can use, so Ray would wait for one forever; on a CPU "
                        "machine serve deployments/cpu.yaml (your checkpoint, float32 on CPU) or set num_gpus: 0 "
                        "there, or name a GPU cluster in RAY_ADDRESS")
        cpus, where = asks.get("CPU", (0.0, ""))
        if cpus > (os.cpu_count() or 1):
            return (f"{path}: a replica asks for {cpus:g} CPUs ({where}) but this machine has {os.cpu_count()}, so "
                    "Ray would wait for them forever; lower num_cpus there (leave one CPU for Serve's proxy and "
                    "controller)")
    return None


def main(argv: list[str]) -> int:
    serve_environment(os.environ)
    why = check_config_fits(argv[0], os.environ, argv) if argv else None
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    from ray.serve.scripts import cli

    return cli.main(["run", *argv], prog_name="python -m mmspec_ray.serve", standalone_mode=True) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
