"""One job per output at a time: a lease object in the output directory (`_mmspec_lease.json`).

The lease names its owner (user, host, process, run time), and the time until which it holds (`expires_at`). It is
created with a conditional write, so of two jobs started together exactly one gets it: on S3 a PUT with
`If-None-Match: *`, on a local disk an exclusive create. While the job runs, a daemon thread in the driver renews
the expiry every `HEARTBEAT_S` (on S3 a PUT with `If-Match` on the lease's ETag, locally under an flock of the
output directory); the lease is deleted when the job ends, also when it fails. A job that finds a live lease is
refused in one line; one that finds an expired lease (its holder crashed, or its driver was killed) takes it over,
as does `--break-lease` for any lease. Taking over is itself conditional (S3: `If-Match` on the ETag seen; local:
under the directory's flock), so two jobs taking over the same stale lease cannot both win.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import json
import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from mmspec_ray.batch.storage import JobInputError, Location
from mmspec_ray.config import S3Config

log = logging.getLogger(__name__)

LEASE_NAME = "_mmspec_lease.json"
HEARTBEAT_S = 30.0  # the driver renews its lease this often
EXPIRY_S = 180.0  # a lease not renewed for this long is stale (six missed heartbeats): the next job takes it over


class LeaseHeld(JobInputError):
    """Another job holds the output's lease."""


class LeaseLost(JobInputError):
    """This job's lease was taken over or broken while it ran."""


def is_lease_file(name: str) -> bool:
    """Whether `name` (a file name) is the lease or the lease's temporary file (a local renewal in flight)."""
    return name == LEASE_NAME or (name.startswith(f".{LEASE_NAME}.") and name.endswith(".tmp"))


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _iso(t: datetime) -> str:
    return t.isoformat(timespec="milliseconds")


def _owner() -> str:
    """Who holds the lease, for the refusal line: user@host, process id."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "?"
    return f"{user}@{socket.gethostname()} pid {os.getpid()}"


def _expired(body: dict[str, Any], now: datetime) -> bool:
    try:
        return datetime.fromisoformat(body["expires_at"]) <= now
    except (KeyError, TypeError, ValueError):  # unreadable: treated as stale only after a full expiry from creation
        return False


# ---------------- the two stores: each create is exclusive, each replace and delete conditional ----------------

class _Store:
    """The lease object in one store. `version` is what a conditional replace or delete compares against."""

    def create(self, body: bytes) -> str | None:
        """Create the lease; its version, or None if one exists."""
        raise NotImplementedError

    def read(self) -> tuple[dict[str, Any], str] | None:
        """The lease and its version, or None if there is none."""
        raise NotImplementedError

    def replace(self, body: bytes, version: str) -> str | None:
        """Replace the lease if it is still at `version`; its new version, or None if it changed or is gone."""
        raise NotImplementedError

    def delete(self, version: str) -> bool:
        """Delete the lease if it is still at `version`."""
        raise NotImplementedError


class _S3Store(_Store):
    """S3 through boto3: pyarrow's filesystem has no conditional PUT."""

    def __init__(self, loc: Location, s3: S3Config) -> None:
        import boto3

        endpoint = f"{s3.scheme}://{s3.endpoint_override}" if s3.endpoint_override else None
        self.client = boto3.client("s3", endpoint_url=endpoint, region_name=s3.region)
        self.bucket, _, self.key = loc.path.partition("/")

    @staticmethod
    def _conflict(e: Exception) -> bool:
        code = getattr(e, "response", {}).get("Error", {}).get("Code", "")
        return code in ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "412", "409", "404")

    def create(self, body: bytes) -> str | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.put_object(Bucket=self.bucket, Key=self.key, Body=body, IfNoneMatch="*")["ETag"]
        except ClientError as e:
            if self._conflict(e):
                return None
            raise

    def read(self) -> tuple[dict[str, Any], str] | None:
        from botocore.exceptions import ClientError

        try:
            got = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except ClientError as e:
            if self._conflict(e):
                return None
            raise
        return _parse(got["Body"].read()), got["ETag"]

    def replace(self, body: bytes, version: str) -> str | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.put_object(Bucket=self.bucket, Key=self.key, Body=body, IfMatch=version)["ETag"]
        except ClientError as e:
            if self._conflict(e):
                return None
            raise

    def delete(self, version: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=version)
            return True
        except ClientError as e:
            if self._conflict(e):
                return False
            raise


class _LocalStore(_Store):
    """A local (or mounted) disk: an exclusive create; replace and delete under an flock of the output directory,
    the version being the lease's own token and renewal time."""

    def __init__(self, loc: Location) -> None:
        self.path = loc.path
        self.dir = os.path.dirname(loc.path)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # (closing releases the lock)

    def create(self, body: bytes) -> str | None:
        os.makedirs(self.dir, exist_ok=True)
        try:
            with open(self.path, "xb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
        except FileExistsError:
            return None
        return _version(_parse(body))

    def read(self) -> tuple[dict[str, Any], str] | None:
        try:
            with open(self.path, "rb") as f:
                body = _parse(f.read())
        except FileNotFoundError:
            return None
        return body, _version(body)

    def replace(self, body: bytes, version: str) -> str | None:
        with self._locked():
            now = self.read()
            if now is None or now[1] != version:
                return None
            tmp = f"{self.dir}/.{LEASE_NAME}.{uuid.uuid4().hex[:8]}.tmp"
            with open(tmp, "wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        return _version(_parse(body))

    def delete(self, version: str) -> bool:
        with self._locked():
            now = self.read()
            if now is None or now[1] != version:
                return False
            os.unlink(self.path)
        return True


def _parse(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
        return body if isinstance(body, dict) else {}
    except ValueError:
        return {}


def _version(body: dict[str, Any]) -> str:
    return f"{body.get('token')}@{body.get('renewed_at')}"


def _store(out: Location, s3: S3Config) -> _Store:
    lease = out.child(LEASE_NAME)
    return _S3Store(lease, s3) if out.is_s3 else _LocalStore(lease)


# ---------------- the lease a running job holds ----------------

@dataclass
class Lease:
    """This job's lease on `uri`, renewed by a daemon thread until `release`."""

    uri: str
    store: _Store
    body: dict[str, Any]
    version: str
    heartbeat_s: float
    expiry_s: float
    lost: str | None = None  # why the lease is no longer this job's
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)  # one renewal at a time (heartbeat and check)
    _thread: threading.Thread | None = None

    def start(self) -> "Lease":
        self._thread = threading.Thread(target=self._beat, name="mmspec-lease-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        """Renew the expiry every heartbeat until stopped or lost (a failed renewal is retried at the next beat)."""
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.renew()
            except Exception as e:  # noqa: BLE001 - the store is unreachable: try again, unless the lease ran out
                log.warning("output %s: renewing the job's lease failed (%s); retrying in %.0f s", self.uri, e,
                            self.heartbeat_s)
                if _expired(self.body, _now()):
                    self.lost = f"it could not be renewed before it expired ({e})"
            if self.lost:
                log.error("output %s: this job's lease was lost: %s", self.uri, self.lost)
                return

    def renew(self) -> None:
        """Push the expiry on, if the lease is still this job's (else mark it lost). Serialised: the heartbeat and
        the job's final check must not both replace the same version (the second would read as a takeover)."""
        with self._lock:
            if self.lost:
                return
            now = _now()
            body = {**self.body, "renewed_at": _iso(now), "expires_at": _iso(now + timedelta(seconds=self.expiry_s))}
            version = self.store.replace(_encode(body), self.version)
            if version is None:
                held = self.store.read()
                self.lost = (f"it was taken over by {held[0].get('owner', '?')}" if held else "it was deleted")
                return
            self.body, self.version = body, version

    def check(self) -> None:
        """Raise LeaseLost when another job may have written into the output while this one ran: renewed here
        first, so a lease taken over since the last heartbeat is seen now, not up to a heartbeat later."""
        if not self.lost:
            try:
                self.renew()
            except Exception as e:  # noqa: BLE001 - the store is unreachable: judged by the expiry, as the heartbeat
                if _expired(self.body, _now()):
                    self.lost = f"it could not be renewed before it expired ({e})"
        if self.lost:
            raise LeaseLost(f"output {self.uri}: this job's lease was lost while it ran ({self.lost}); another job "
                            "may have written into it. Re-run when no other job uses the output: the resume keeps "
                            "one row per id")

    def release(self) -> None:
        """Stop the heartbeat and delete the lease, if it is still this job's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.lost:
            return
        try:
            if not self.store.delete(self.version):
                log.warning("output %s: the lease was no longer this job's at its end; left in place", self.uri)
        except Exception as e:  # noqa: BLE001 - a lease left behind expires by itself
            log.warning("output %s: could not delete the job's lease (%s); it expires by itself within %.0f s",
                        self.uri, e, self.expiry_s)


def _encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, indent=2).encode()


def acquire(out: Location, s3: S3Config, break_lease: bool = False, heartbeat_s: float = HEARTBEAT_S,
            expiry_s: float = EXPIRY_S) -> Lease:
    """Take the lease on output `out` and start its heartbeat; LeaseHeld (one line) when another job holds a live
    one. An expired lease is taken over; with `break_lease` any lease is."""
    try:
        return _acquire(out, _store(out, s3), break_lease, heartbeat_s, expiry_s)
    except JobInputError:
        raise
    except Exception as e:  # noqa: BLE001 - credentials, an unreachable store, no conditional writes: one line
        raise JobInputError(f"output {out.uri}: cannot take the job's lease ({type(e).__name__}: {e}); check the "
                            "store's address and credentials, and that it supports conditional writes "
                            "(If-None-Match / If-Match on PUT)") from e


def _acquire(out: Location, store: "_Store", break_lease: bool, heartbeat_s: float, expiry_s: float) -> Lease:
    """`acquire` on an open store."""
    now = _now()
    body = {"owner": _owner(), "token": uuid.uuid4().hex, "acquired_at": _iso(now),
            "renewed_at": _iso(now), "expires_at": _iso(now + timedelta(seconds=expiry_s)),
            "heartbeat_s": heartbeat_s, "expiry_s": expiry_s}
    for _ in range(3):  # a lease deleted or replaced between our create and read: look again
        version = store.create(_encode(body))
        if version is not None:
            return _confirmed(out, store, body, version, heartbeat_s, expiry_s)
        held = store.read()
        if held is None:
            continue
        other, seen = held
        if not (break_lease or _expired(other, _now())):
            raise LeaseHeld(_held_line(out, other))
        version = store.replace(_encode(body), seen)
        if version is not None:
            log.warning("output %s: %s the lease of %s (renewed %s, expired %s)", out.uri,
                        "broke" if break_lease else "took over the expired", other.get("owner", "?"),
                        other.get("renewed_at", "?"), other.get("expires_at", "?"))
            return _confirmed(out, store, body, version, heartbeat_s, expiry_s)
    held = store.read()
    raise LeaseHeld(_held_line(out, held[0] if held else {}))


def _confirmed(out: Location, store: _Store, body: dict[str, Any], version: str, heartbeat_s: float,
               expiry_s: float) -> Lease:
    """The lease read back as ours (a store that ignored the condition would show the other writer's), started."""
    held = store.read()
    if held is None or held[0].get("token") != body["token"]:
        raise LeaseHeld(_held_line(out, held[0] if held else {}))
    return Lease(out.uri, store, body, held[1] if out.is_s3 else version, heartbeat_s, expiry_s).start()


def _held_line(out: Location, other: dict[str, Any]) -> str:
    return (f"output {out.uri} is in use by another job ({other.get('owner', 'unknown owner')}, since "
            f"{other.get('acquired_at', '?')}, lease renewed {other.get('renewed_at', '?')}, expires "
            f"{other.get('expires_at', '?')}): one job per output at a time. Wait for it to end; if it crashed, "
            "re-run after the lease expires, or at once with --break-lease")


def check_free(out: Location, s3: S3Config, break_lease: bool = False) -> None:
    """LeaseHeld (one line) when another job holds a live lease on `out`: what `acquire` would refuse, taking
    nothing (a dry run's check)."""
    try:
        held = _store(out, s3).read()
    except Exception as e:  # noqa: BLE001 - as `acquire`: one line
        raise JobInputError(f"output {out.uri}: cannot read the job's lease ({type(e).__name__}: {e}); check the "
                            "store's address and credentials") from e
    if held is not None and not (break_lease or _expired(held[0], _now())):
        raise LeaseHeld(_held_line(out, held[0]))


@contextlib.contextmanager
def hold(out: Location, s3: S3Config, break_lease: bool = False) -> Iterator[Lease]:
    """The lease for the duration of a job: taken, renewed while the block runs, released at its end or failure."""
    lease = acquire(out, s3, break_lease)
    try:
        yield lease
    finally:
        lease.release()
