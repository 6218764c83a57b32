"""Media URL -> bytes: `data:` URLs, `s3://` URIs (the batch layer's reader) and, only for allow-listed hosts,
plain http(s) from public addresses (the connection is pinned to the address that was checked)."""

from __future__ import annotations

import base64
import binascii
import http.client
import ipaddress
import logging
import socket
import ssl
from typing import Literal
from urllib.parse import unquote, urlsplit

from mmspec_ray.config import MediaLimits, S3Config
from mmspec_ray.media import MediaError
from mmspec_ray.media.io import read_bytes
from mmspec_ray.serve.errors import APIError
from mmspec_ray.serve.settings import FetchSettings

log = logging.getLogger(__name__)
MediaKind = Literal["image", "video"]
ONLINE_S3_RETRIES = 2  # an online request waits seconds, not the batch job's half minute of backoff


def fetch_media(url: str, kind: MediaKind, limit: int, where: str, s3: S3Config, fetch: FetchSettings) -> bytes:
    """The encoded bytes behind a media URL; APIError 400 (bad or refused URL) or 413 (over `limit` bytes)."""
    if not isinstance(url, str) or not url:
        raise APIError(400, f"{where}: expected a non-empty url string", param=where, code="invalid_url")
    if url.startswith("data:"):
        return _data_url(url, limit, where)
    if url.startswith("s3://"):
        bucket = s3_bucket_of(url, where)
        if bucket not in fetch.allow_s3_buckets:
            raise APIError(400, f"{where}: s3 bucket {bucket!r} is not in this server's allow-list for media URLs "
                           "(fetch.allow_s3_buckets); send the media inline as a data: URL", param=where,
                           code="invalid_url")
        return _s3(url, limit, where, s3)
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        return _http(url, limit, where, fetch)
    raise APIError(400, f"{where}: unsupported URL scheme {scheme or url[:16]!r}; send a data: URL (base64), an "
                   f"s3:// URI or, where the server allows it, an http(s) URL", param=where, code="invalid_url")


def s3_bucket_of(url: str, where: str) -> str:
    """The bucket of an s3:// URL whose key names one object plainly. A key with an empty, `.` or `..` segment
    (`s3://ok/../secret/x.png`, `s3://ok//x.png`), also percent-encoded, is refused: S3 clients collapse such paths
    before sending, so the object read would not be the one the allow-list checked. So are `?`, `#` and `\\`."""
    bucket, _, key = url[len("s3://"):].partition("/")
    why = None
    if not bucket or not key:
        why = "no bucket and object key"
    elif any(c in key for c in "?#\\"):
        why = "a ?, # or \\ in its key"
    else:
        for segments in (key.split("/"), unquote(key).split("/")):
            bad = next((seg for seg in segments if seg in ("", ".", "..")), None)
            if bad is not None:
                why = f"a path segment {bad!r} in its key" if bad else "an empty path segment (//) in its key"
                break
    if why:
        raise APIError(400, f"{where}: {url[:200]!r} has {why}; name one object by its plain key "
                       "(s3://bucket/path/file.png)", param=where, code="invalid_url")
    return bucket


def _too_large(where: str, size: int | str, limit: int) -> APIError:
    return APIError(413, f"{where}: media of {size} bytes is over this server's limit of {limit} bytes",
                    param=where, code="too_large")


def _data_url(url: str, limit: int, where: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise APIError(400, f"{where}: expected a base64 data URL (data:<type>;base64,<data>)", param=where,
                       code="invalid_url")
    if len(payload) * 3 // 4 > limit + 2:
        raise _too_large(where, f"about {len(payload) * 3 // 4}", limit)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise APIError(400, f"{where}: data URL is not valid base64 ({e})", param=where, code="invalid_url") from e
    if len(data) > limit:
        raise _too_large(where, len(data), limit)
    return data


def _s3(url: str, limit: int, where: str, s3: S3Config) -> bytes:
    cfg = s3.model_copy(update={"retries": min(s3.retries, ONLINE_S3_RETRIES)})
    try:
        return read_bytes(url, MediaLimits(max_bytes=limit), s3=cfg)
    except MediaError as e:
        if e.kind == "too_large":
            raise APIError(413, f"{where}: {e}", param=where, code="too_large") from e
        if e.kind == "unavailable":  # the store's address and the batch job's advice stay in the server's log
            log.warning("%s: %s", where, e)
            raise APIError(503, f"{where}: {url} could not be read: the object store is unreachable right now; "
                           "retry later", param=where, code="media_unavailable", headers={"Retry-After": "5"}) from e
        raise APIError(400, f"{where}: {e}", param=where, code=f"media_{e.kind}") from e


def is_public_address(ip: str) -> bool:
    """True for a globally routable unicast address (never loopback, private, link-local, reserved, shared)."""
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_global and not addr.is_multicast


def _http(url: str, limit: int, where: str, fetch: FetchSettings) -> bytes:
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if not fetch.allow_hosts:
        raise APIError(400, f"{where}: http(s) media URLs are turned off on this server; send a data: URL or an "
                       "s3:// URI", param=where, code="invalid_url")
    if host not in {h.lower() for h in fetch.allow_hosts}:
        raise APIError(400, f"{where}: host {host!r} is not in this server's allow-list for media URLs",
                       param=where, code="invalid_url")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise APIError(400, f"{where}: cannot resolve {host!r} ({e})", param=where, code="invalid_url") from e
    ips = sorted({info[4][0] for info in infos})
    if not ips or not all(is_public_address(ip) for ip in ips):
        raise APIError(400, f"{where}: {host!r} resolves to a loopback, private or link-local address; refused",
                       param=where, code="invalid_url")
    conn = _Pinned(parts.scheme, host, ips[0], port, fetch.timeout_s)
    try:
        conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                     headers={"Host": parts.netloc, "User-Agent": "mmspec-ray"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise APIError(400, f"{where}: fetching the URL returned HTTP {resp.status} (redirects are not "
                           "followed)", param=where, code="media_not_found")
        declared = resp.getheader("Content-Length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise _too_large(where, declared, limit)
        data = resp.read(limit + 1)
    except (OSError, http.client.HTTPException) as e:
        raise APIError(400, f"{where}: fetching the URL failed ({type(e).__name__}: {e})", param=where,
                       code="media_io") from e
    finally:
        conn.close()
    if len(data) > limit:
        raise _too_large(where, f"more than {limit}", limit)
    return data


class _Pinned:
    """An HTTP(S) connection to a host name whose socket goes to one already-checked IP (no second DNS look-up)."""

    def __init__(self, scheme: str, host: str, ip: str, port: int, timeout: float) -> None:
        cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        self.conn = cls(host, port, timeout=timeout)
        self.ip, self.host, self.port, self.timeout, self.tls = ip, host, port, timeout, scheme == "https"
        self.conn.connect = self._connect  # type: ignore[method-assign]

    def _connect(self) -> None:
        sock = socket.create_connection((self.ip, self.port), self.timeout)
        if self.tls:
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self.host)
        self.conn.sock = sock

    def request(self, method: str, path: str, headers: dict[str, str]) -> None:
        self.conn.request(method, path, headers=headers)

    def getresponse(self) -> http.client.HTTPResponse:
        return self.conn.getresponse()

    def close(self) -> None:
        self.conn.close()
