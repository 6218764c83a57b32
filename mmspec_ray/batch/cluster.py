"""Ray cluster plumbing for batch jobs: connect or start, size the actor pool's CPUs, check GPUs, and free a
failed run's actors."""

from __future__ import annotations

import gc
import logging
import os
import sys
import time

import ray

from mmspec_ray.batch.jobspec import JobSpec
from mmspec_ray.batch.storage import JobInputError

log = logging.getLogger(__name__)


# Ray's switch for single-machine Ray (what it uses on macOS and Windows): with it at 0 a node takes the loopback
# address as its IP, and Ray's servers then listen on loopback only.
SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def connect_ray(num_cpus: int | None = None, dashboard: bool = False) -> None:
    """Join the cluster in RAY_ADDRESS (`ray job submit` sets it), else start a fresh local one
    (`start_local_ray`; the dashboard only with `dashboard`, which Ray Train's state checks need). No-op when this
    process is already connected."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):  # (a job on a loopback-only head inherits its single-machine mode: kept)
        ray.init()
        return
    start_local_ray(num_cpus=num_cpus, include_dashboard=dashboard)


def start_local_ray(**kwargs) -> None:
    """A fresh single-machine Ray (`ray.init(address="local")`: never some other `ray start` cluster on this host).
    Auth is off unless the caller set RAY_AUTH_MODE; while it is off, every Ray server (GCS, raylets, workers,
    agents, dashboard) listens on loopback only, so nothing on the network can reach a cluster that asks no token."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if os.environ["RAY_AUTH_MODE"] == "disabled":
        loopback_only()
    ray.init(address="local", **kwargs)


def loopback_only() -> None:
    """Ray processes started from here on (and this one) take 127.0.0.1 as the node IP: Ray then binds its servers
    to loopback. The environment carries it to the processes Ray starts; this process already read it at import."""
    from ray._private import ray_constants

    os.environ[SINGLE_MACHINE_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def open_without_auth() -> str | None:
    """The node's address when the connected Ray listens beyond loopback while token auth is off (anyone who
    reaches that address can run code on the cluster), else None."""
    import ipaddress

    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    if is_token_auth_enabled():
        return None
    ip = ray.util.get_node_ip_address()
    return None if ipaddress.ip_address(ip.split("%", 1)[0]).is_loopback else ip


def serve_replica_on_loopback() -> None:
    """In a Serve replica of a single-machine Ray (`loopback_only`'s mode): Serve's per-replica inter-deployment gRPC
    server, which Ray Serve binds to every interface (`[::]:0`), binds to 127.0.0.1 instead. Call it in the
    deployment's constructor (Serve starts that server right after). No-op elsewhere."""
    if os.environ.get(SINGLE_MACHINE_ENV) != "0":
        return
    from ray.serve._private import replica

    bind = getattr(replica, "add_port_to_grpc_server", None)
    if bind is None:  # another Ray Serve: say so rather than fail the replica
        log.warning("Ray Serve has no replica.add_port_to_grpc_server here: its inter-deployment gRPC server keeps "
                    "Serve's own bind address")
        return
    if getattr(bind, "loopback", False):
        return

    def on_loopback(server, address: str):
        return bind(server, address.replace("[::]", "127.0.0.1").replace("0.0.0.0", "127.0.0.1"))

    on_loopback.loopback = True
    replica.add_port_to_grpc_server = on_loopback


def plan_actor_cpus(spec: JobSpec) -> float:
    """CPUs per decoder actor, lowered so the pool never takes every CPU: read, media and write tasks need one
    (on a 2-CPU machine a pool holding both CPUs deadlocks the reads)."""
    total = float(ray.cluster_resources().get("CPU", 0.0))
    reserve = max(1.0, 2 * spec.cpus_per_task)
    room = total - reserve
    want = spec.cpus_per_actor
    if room <= 0:
        log.warning("the cluster has %.1f CPUs: too few to keep one for reads next to the actors", total)
        return min(want, max(total / (spec.num_actors + 1), 0.1))
    if want * spec.num_actors > room:
        got = room / spec.num_actors
        log.warning("%d actors x %.2f CPUs would leave reads no CPU on this %.0f-CPU cluster; using %.2f CPUs per "
                    "actor", spec.num_actors, want, total, got)
        return got
    return want


def check_local_gpus(spec: JobSpec) -> None:
    """Before a local Ray starts: GPUs asked for per actor on a machine whose torch sees none is refused in one
    line (a cluster named in RAY_ADDRESS may add GPU nodes: `check_gpus` decides there)."""
    if os.environ.get("RAY_ADDRESS") or ray.is_initialized() or not isinstance(spec.gpus_per_actor, (int, float)):
        return
    if spec.gpus_per_actor > 0:
        import torch

        if torch.cuda.device_count() == 0:
            raise JobInputError(f"--gpus-per-actor {spec.gpus_per_actor:g} but this machine has no GPU torch can "
                                "use; run on a GPU machine, or with --gpus-per-actor 0 (or auto)")


def check_gpus(spec: JobSpec) -> None:
    """GPUs per actor against the connected cluster's: refused on a local one without them, a warning on a cluster
    (its autoscaler may add GPU nodes)."""
    if spec.gpus_per_actor <= 0:
        return
    have = float(ray.cluster_resources().get("GPU", 0.0))
    if have >= spec.gpus_per_actor:
        return
    msg = f"--gpus-per-actor {spec.gpus_per_actor:g} but the cluster has {have:g} GPUs"
    if not os.environ.get("RAY_ADDRESS"):
        raise JobInputError(msg + "; run on a GPU machine or with --gpus-per-actor 0")
    log.warning("%s now; actors wait until the autoscaler adds GPU nodes", msg)


def release_failed_run(e: BaseException, wait_s: float = 10.0) -> None:
    """Let a failed run's decoder actors go now. Ray Data frees its actors by reference counting, and the frames in
    the exception's traceback (some from its executor thread, which may still be winding down) reference the
    executor; a caller that keeps the exception (a notebook, a test, a retry loop) would keep the actors and their
    CPUs/GPUs, and the next run in this process would wait for them forever. Tracebacks keep their line info."""
    mine: set[int] = set()
    f = sys._getframe()
    while f is not None:
        mine.add(id(f))
        f = f.f_back
    frames, seen, stack = [], set(), [e]
    while stack:
        exc = stack.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            fr = tb.tb_frame  # the frame and its callers (a thread's bootstrap frames hold the executor too)
            while fr is not None and id(fr) not in mine and id(fr) not in seen:
                seen.add(id(fr))
                frames.append(fr)
                fr = fr.f_back
            tb = tb.tb_next
        stack += [exc.__cause__, exc.__context__]
    deadline = time.time() + wait_s
    while frames:
        busy = []
        for fr in frames:
            try:
                fr.clear()
            except RuntimeError:  # still executing in the executor thread: retry once it has returned
                busy.append(fr)
        if not busy or time.time() > deadline:
            break
        frames = busy
        time.sleep(0.1)
    gc.collect()
