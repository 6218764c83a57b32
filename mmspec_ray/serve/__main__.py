"""`python -m mmspec_ray.serve CONFIG [serve run options]`: Ray Serve's `serve run` with this server's environment.
Where no cluster is named (RAY_ADDRESS) and Ray's token auth is off (RAY_AUTH_MODE, default disabled here), the
Ray it starts listens on loopback only; Ray's HTTP proxy answers its own errors in the API's JSON format."""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

from mmspec_ray.serve.proxy_errors import PROXY_CALLBACK, PROXY_CALLBACK_ENV

SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # (batch/cluster.py's name; that module imports Ray)


def serve_environment(env: MutableMapping[str, str]) -> None:
    """Set what `serve run` needs before Ray is imported: an explicit auth mode, loopback where auth is off and
    this starts the cluster, and the proxy's error middleware. A value the caller set is kept."""
    env.setdefault("RAY_AUTH_MODE", "disabled")
    if env["RAY_AUTH_MODE"] == "disabled" and not env.get("RAY_ADDRESS"):
        env[SINGLE_MACHINE_ENV] = "0"
    env.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)


def main(argv: list[str]) -> int:
    serve_environment(os.environ)
    from ray.serve.scripts import cli

    return cli.main(["run", *argv], prog_name="python -m mmspec_ray.serve", standalone_mode=True) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
