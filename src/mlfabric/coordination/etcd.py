"""A small asyncio client for etcd's v3 API, through its JSON gateway.

Only what shard ownership needs: leases (grant, keep alive, revoke), a put
that succeeds only where the key is absent, and a range over a prefix. It speaks HTTP/1.1 to the
gateway every etcd (3.4 and later) serves on its client URL (`/v3/...`,
keys and values in base64), on one kept-alive connection per endpoint.

Why not a library: the asyncio etcd clients on PyPI pull in gRPC (grpcio
and protobuf, tens of MB in every controller's image) for four calls, and
the gateway client that does not (etcd3gw) blocks, which would stall the
controller's event loop. This is about 200 lines with every answer bound
checked.

Every call is bounded by `timeout` and tries the endpoints in turn; an etcd
that cannot be reached or answers with an error raises `EtcdError`. An
https:// endpoint is dialled over TLS with a client certificate (etcd's
--client-cert-auth then admits only the holders of a certificate its CA
signed): `tls` is the client context.
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ..errors import ConfigError, MlfabricError
from ..runtime.loop import within

MAX_HEADER = 64 * 1024
MAX_BODY = 4 * 1024 * 1024  # a range over one job's keys is a few KB


class EtcdError(MlfabricError):
    """etcd could not be reached, or refused or failed a request."""


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: str
    lease: int  # 0: no lease


def parse_endpoints(spec: str) -> tuple[list[tuple[str, int]], bool]:
    """`http[s]://HOST:PORT[,...]` (or bare HOST:PORT: http) -> (addresses,
    whether they are https). All of one kind: a cluster is served one way."""
    out, schemes = [], set()
    for part in (p.strip() for p in spec.split(",")):
        url = urlsplit(part if "://" in part else f"http://{part}")
        if url.scheme not in ("http", "https") or not url.hostname \
                or url.path not in ("", "/"):
            raise ConfigError(f"etcd endpoint {part!r}: expected http://HOST:PORT or "
                              f"https://HOST:PORT, e.g. https://10.0.0.2:2379")
        try:
            port = url.port or 2379
        except ValueError:
            raise ConfigError(f"etcd endpoint {part!r}: the port is not a number") from None
        out.append((url.hostname, port))
        schemes.add(url.scheme)
    if len(schemes) > 1:
        raise ConfigError(f"etcd endpoints {spec!r} mix http:// and https://: give the "
                          f"cluster's client URLs, all of one kind")
    return out, schemes == {"https"}


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def _unb64(s: Any) -> str:
    if not isinstance(s, str) or len(s) > MAX_BODY:
        raise EtcdError(f"etcd sent a key or value that is not base64 text: {s!r:.80}")
    try:
        return base64.b64decode(s, validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        raise EtcdError(f"etcd sent a key or value that is not base64 text: {s!r:.80}") from None


def _int(msg: dict[str, Any], name: str) -> int:
    """The gateway sends 64-bit integers as strings and leaves zeros out."""
    value = msg.get(name, 0)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise EtcdError(f"etcd sent {name}={value!r:.40}, not an integer") from None


def prefix_end(prefix: str) -> str:
    """The range end that covers every key starting with `prefix` (etcd's rule:
    the prefix with its last byte plus one)."""
    raw = prefix.encode()
    return (raw[:-1] + bytes([raw[-1] + 1])).decode()


class EtcdClient:
    def __init__(self, endpoints: Sequence[tuple[str, int]], *, timeout: float = 1.0,
                 tls: ssl.SSLContext | None = None) -> None:
        if not endpoints:
            raise ConfigError("etcd: no endpoint given")
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.tls = tls
        self._at = 0  # the endpoint in use
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._lock = asyncio.Lock()  # one request at a time on the connection

    # -- the calls ------------------------------------------------------------------

    async def grant(self, ttl: int) -> tuple[int, int]:
        """A new lease of `ttl` seconds: (its id, the TTL etcd granted, which
        can be longer: etcd's minimum is 1.5 election timeouts)."""
        r = await self._call("/v3/lease/grant", {"TTL": ttl})
        lease, granted = _int(r, "ID"), _int(r, "TTL")
        if lease == 0 or granted <= 0:
            raise EtcdError(f"etcd granted no lease: {r.get('error') or r!r:.200}")
        return lease, granted

    async def keepalive(self, lease: int) -> int:
        """Renew `lease`: the seconds it now has left, 0 when it has expired."""
        r = await self._call("/v3/lease/keepalive", {"ID": str(lease)})
        result = r.get("result")
        if not isinstance(result, dict):
            raise EtcdError(f"etcd's keepalive answer has no result: {r!r:.200}")
        return max(0, _int(result, "TTL"))

    async def revoke(self, lease: int) -> None:
        """End `lease` now: its keys are deleted at once."""
        await self._call("/v3/lease/revoke", {"ID": str(lease)})

    async def create(self, key: str, value: str, lease: int) -> bool:
        """Put `key` under `lease` if no one holds it; False if someone does."""
        r = await self._call("/v3/kv/txn", {
            "compare": [{"target": "CREATE", "key": _b64(key), "create_revision": "0"}],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value),
                                         "lease": str(lease)}}]})
        return bool(r.get("succeeded", False))

    async def range(self, prefix: str) -> list[KeyValue]:
        """Every key under `prefix`, in key order."""
        r = await self._call("/v3/kv/range", {"key": _b64(prefix),
                                              "range_end": _b64(prefix_end(prefix))})
        kvs = r.get("kvs", [])
        if not isinstance(kvs, list):
            raise EtcdError(f"etcd's range answer is not a list: {kvs!r:.200}")
        return [KeyValue(_unb64(kv.get("key")), _unb64(kv.get("value", "")), _int(kv, "lease"))
                for kv in kvs if isinstance(kv, dict)]

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn[1].close()
            try:
                await within(conn[1].wait_closed(), self.timeout)
            except (OSError, TimeoutError):
                pass

    # -- HTTP -----------------------------------------------------------------------

    def where(self) -> str:
        host, port = self.endpoints[self._at]
        return f"{'https' if self.tls else 'http'}://{host}:{port}"

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST `body` to `path`: on the connection in use, then on each
        other endpoint once, each try bounded by `timeout`."""
        errors = []
        async with self._lock:
            for _ in range(len(self.endpoints)):
                try:
                    return await within(self._post(path, body), self.timeout)
                except _Refused:
                    raise  # etcd answered: another endpoint would answer the same
                except (OSError, TimeoutError, EtcdError, asyncio.IncompleteReadError
                        ) as exc:
                    errors.append(f"{self.where()}: {exc or type(exc).__name__}")
                    await self._drop()
                    self._at = (self._at + 1) % len(self.endpoints)
        raise EtcdError(f"etcd {path} failed: {'; '.join(errors)}")

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn[1].close()

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self._conn is None:
            host, port = self.endpoints[self._at]
            try:
                self._conn = await asyncio.open_connection(
                    host, port, ssl=self.tls, server_hostname=host if self.tls else None)
            except ssl.SSLError as exc:
                raise EtcdError(f"TLS with etcd failed: {exc.reason or exc} (is its "
                                f"certificate signed by --etcd-ca, for this host name?)"
                                ) from None
        reader, writer = self._conn
        payload = json.dumps(body).encode()
        host, port = self.endpoints[self._at]
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                     f"\r\n".encode() + payload)
        await writer.drain()
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise EtcdError("etcd's answer has an oversized header") from None
        if len(head) > MAX_HEADER:
            raise EtcdError("etcd's answer has an oversized header")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise EtcdError(f"not an HTTP answer: {status_line!r:.80} (is this etcd's "
                            f"client URL?)")
        headers = {}
        for line in lines:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            data = await _read_chunked(reader)
        else:
            try:
                length = int(headers.get("content-length", "-1"))
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_BODY:
                raise EtcdError(f"etcd's answer has no usable length "
                                f"({headers.get('content-length')!r})")
            data = await reader.readexactly(length)
        if headers.get("connection", "").lower() == "close":
            await self._drop()
        try:
            msg = json.loads(data) if data.strip() else {}
        except ValueError:
            raise EtcdError(f"etcd's answer is not JSON: {data[:80]!r}") from None
        if not isinstance(msg, dict):
            raise EtcdError(f"etcd's answer is not a JSON object: {data[:80]!r}")
        if parts[1] != "200":
            # A refusal (bad request, no such lease): trying elsewhere would not help.
            raise _Refused(f"etcd refused {path}: HTTP {parts[1]}: "
                           f"{msg.get('message') or msg.get('error') or msg!r:.200}")
        if "error" in msg and "result" not in msg:
            raise _Refused(f"etcd refused {path}: {msg['error']!r:.200}")
        return msg


class _Refused(EtcdError):
    """etcd answered with an error: not a failure of the endpoint."""


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    data = bytearray()
    while True:
        line = await reader.readuntil(b"\r\n")
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise EtcdError(f"etcd's answer has a bad chunk size {line[:20]!r}") from None
        if size < 0 or len(data) + size > MAX_BODY:
            raise EtcdError("etcd's answer is larger than "
                            f"{MAX_BODY // (1024 * 1024)} MiB")
        if size == 0:
            await reader.readuntil(b"\r\n")  # no trailers from the gateway: the last CRLF
            return bytes(data)
        data += await reader.readexactly(size)
        await reader.readexactly(2)
