"""Read raw bytes from a local path, a file:// URI or an s3:// URI (pyarrow S3FileSystem, explicit endpoint)."""

from __future__ import annotations

import logging
import os
import re
import time
from functools import lru_cache

from mmspec_ray.config import MediaLimits, S3Config
from mmspec_ray.media.errors import MediaError

log = logging.getLogger(__name__)


@lru_cache(maxsize=8)
def s3_filesystem(cfg: S3Config):  # -> pyarrow.fs.S3FileSystem
    """One S3FileSystem per distinct config; credentials come from the standard AWS chain."""
    from pyarrow import fs

    kwargs: dict = {"scheme": cfg.scheme}
    if cfg.endpoint_override:
        kwargs["endpoint_override"] = cfg.endpoint_override
    if cfg.region:
        kwargs["region"] = cfg.region
    return fs.S3FileSystem(**kwargs)


def filesystem_for(uri: str, s3: S3Config | None = None):  # -> (pyarrow.fs.FileSystem, path in it)
    """A local path, file:// URI or s3://bucket/key as the pyarrow filesystem and the path it names there (local
    paths absolute, S3 with the explicit endpoint of `s3`, default: from the environment)."""
    from pyarrow import fs

    if uri.startswith("s3://"):
        key = uri[len("s3://"):].rstrip("/")
        if not key:
            raise ValueError(f"{uri!r} names no bucket")
        return s3_filesystem(s3 or S3Config.from_env()), key
    path = uri[len("file://"):] if uri.startswith("file://") else uri
    return fs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))


def read_bytes(source: str, limits: MediaLimits | None = None, s3: S3Config | None = None) -> bytes:
    """Return the bytes at `source`, refusing anything over `limits.max_bytes`."""
    limits = limits or MediaLimits()
    if source.startswith("s3://"):
        return _read_s3(source[len("s3://"):], limits, s3 or S3Config.from_env(), source)
    path = source[len("file://"):] if source.startswith("file://") else source
    if not os.path.exists(path):
        raise MediaError("not_found", "no such file; check the path or URI", source)
    if os.path.isdir(path):
        raise MediaError("not_found", "is a folder, not a file; give the media file's path", source)
    if not os.path.isfile(path):
        raise MediaError("io", "not a regular file", source)
    size = os.path.getsize(path)
    if size > limits.max_bytes:
        raise MediaError("too_large", f"{size} bytes > limit {limits.max_bytes}", source)
    with open(path, "rb") as f:
        return f.read()


# pyarrow / AWS SDK error texts of failures that say nothing about the object: the store was unreachable, slow or
# briefly failing. Anything else (access denied, no such key, bad request) is final.
_TRANSIENT = re.compile(r"NETWORK_CONNECTION|SLOW_DOWN|SERVICE_UNAVAILABLE|INTERNAL_FAILURE|THROTTL|REQUEST_TIMEOUT|"
                        r"TOO_MANY_REQUESTS|REQUEST_LIMIT_EXCEEDED|HTTP status 429|"
                        r"curlCode|HTTP status 5\d\d|Connection (?:refused|reset)|timed out|Broken pipe|"
                        r"Couldn't connect", re.IGNORECASE)


def is_transient(e: BaseException) -> bool:
    """True for an S3 error worth retrying (connection, throttling, 5xx)."""
    return bool(_TRANSIENT.search(str(e)))


def _read_s3(key: str, limits: MediaLimits, cfg: S3Config, source: str) -> bytes:
    """Read an object, retrying transient errors with backoff; a still-failing one is kind `unavailable`."""
    for attempt in range(cfg.retries + 1):
        try:
            return _read_s3_once(key, limits, cfg, source)
        except _Transient as e:
            if attempt == cfg.retries:
                raise MediaError("unavailable", f"S3 unreachable after {attempt + 1} attempts ({e.__cause__}); the "
                                 "row is marked retryable: re-run the job to decode it again", source) from e
            wait = cfg.backoff(attempt)
            log.warning("S3 read of %s failed (%s); retry %d/%d in %.1f s", source, e.__cause__, attempt + 1,
                        cfg.retries, wait)
            time.sleep(wait)
    raise AssertionError("unreachable")


class _Transient(Exception):
    """Internal: a transient S3 failure, to be retried."""


def _read_s3_once(key: str, limits: MediaLimits, cfg: S3Config, source: str) -> bytes:
    from pyarrow import fs

    s3fs = s3_filesystem(cfg)
    try:
        info = s3fs.get_file_info(key)
    except OSError as e:
        if is_transient(e):
            raise _Transient() from e
        raise MediaError("io", f"S3 error: {e}", source) from e
    if info.type == fs.FileType.NotFound:
        raise MediaError("not_found", "no such S3 object; check bucket and key", source)
    if info.type == fs.FileType.Directory:
        raise MediaError("not_found", "is an S3 prefix (a folder), not an object; give the object's key", source)
    if info.size is not None and info.size > limits.max_bytes:
        raise MediaError("too_large", f"{info.size} bytes > limit {limits.max_bytes}", source)
    try:
        with s3fs.open_input_stream(key) as f:
            return f.read()
    except OSError as e:
        if is_transient(e):
            raise _Transient() from e
        raise MediaError("io", f"S3 read failed: {e}", source) from e
