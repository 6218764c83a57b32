"""The ingress's view of the decoder replicas: whether any is running, and how long the last replacement took, so
that a request waiting for a replica that is being replaced gets a prompt 503 whose Retry-After matches a restart,
instead of a silent half-minute wait (Serve holds requests while no replica is up)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_RESTART_S = 30.0  # a replica's replacement before one was seen here (measured: 20-37 s for the toy target)
PROBE_S = 2.0  # a request not yet at a replica after this long asks whether any replica runs
STATUS_TTL_S = 1.0  # one status look-up serves every waiting request for this long
MAX_RESTART_S = 120.0  # the longest replacement time a Retry-After is based on
# replica states that still take requests (a controller recovering, a node draining, a reconfigure)
SERVING = ("RUNNING", "UPDATING", "RECOVERING", "PENDING_MIGRATION")


class ReplicaWatch:
    """Answers `wait_assigned(gen)`: True once a request reached a replica, False when it waits while the
    deployment has no running replica. `running()` is injectable for tests; by default it asks Serve's controller."""

    def __init__(self, app: str, deployment: str, running: Callable[[], Awaitable[int]] | None = None,
                 probe_s: float = PROBE_S, ttl_s: float = STATUS_TTL_S) -> None:
        self.app, self.deployment, self.probe_s, self.ttl_s = app, deployment, probe_s, ttl_s
        self.running = running or self._running_from_status
        self.down_since: float | None = None  # when a request first found no replica running
        self.restart_s = DEFAULT_RESTART_S  # the last replacement seen, from down to a request reaching a replica
        self._cached: tuple[float, int] | None = None

    async def wait_assigned(self, gen: Any) -> bool:
        """Wait until the Serve response generator `gen` is assigned to a replica (True), or until it has waited
        `probe_s` while no replica is running (False: the caller answers 503 and cancels it)."""
        task = asyncio.ensure_future(gen._fetch_future_result_async())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # read by __anext__: never "unretrieved"
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.probe_s)
                if done:
                    self._up()
                    return True
                if await self._running_cached() > 0:
                    self._up()  # a replica serves again: the outage ended, though this request still waits
                else:
                    if self.down_since is None:
                        self.down_since = time.monotonic()
                        log.warning("no %s replica is running: answering 503 until one is", self.deployment)
                    return False
        finally:
            if not task.done():
                task.cancel()

    def retry_after_s(self) -> float:
        """Seconds until a replacement is likely up: the last one's duration less the time already down."""
        gone = time.monotonic() - self.down_since if self.down_since is not None else 0.0
        return max(1.0, self.restart_s - gone)

    def _up(self) -> None:
        if self.down_since is not None:
            self.restart_s = min(MAX_RESTART_S, max(1.0, time.monotonic() - self.down_since))
            log.info("a %s replica is running again after %.1f s", self.deployment, self.restart_s)
            self.down_since = None
            self._cached = None

    async def _running_cached(self) -> int:
        now = time.monotonic()
        if self._cached is None or now - self._cached[0] >= self.ttl_s:
            try:
                self._cached = (now, await self.running())
            except Exception as e:  # noqa: BLE001  (no status: keep waiting, as Serve would)
                log.warning("Serve status unavailable: %s: %s", type(e).__name__, e)
                return 1
        return self._cached[1]

    async def _running_from_status(self) -> int:
        from ray import serve

        status = await asyncio.to_thread(serve.status)
        app = status.applications.get(self.app)
        dep = app.deployments.get(self.deployment) if app is not None else None
        if dep is None:
            return 1
        return sum(int(n) for state, n in dep.replica_states.items() if str(getattr(state, "value", state)) in SERVING)
