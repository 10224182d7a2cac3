"""The asyncio client: `await mlfabric.aio.connect(...)`.

Same API as the blocking client with awaitables: `await ps.pull()`, and
`ps.push(...)` returns an asyncio future of the outcome at once. Pushed
arrays are handed to the transport without a copy: do not modify them until
the push's future is done.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from .client_core import (
    Handshake,
    RequestTable,
    check_base_version,
    check_update,
    connection_lost_error,
    default_client_name,
    parse_address,
    resolve_token,
)
from .errors import ConnectError, ConnectionLost, MlfabricError
from .metrics import ClientMetrics
from .outcome import PushOutcome
from .protocol import HEADER, MAX_META_LEN, NEED_DATA, Connection, Pull, Push, layout

_JOIN_LIMIT = 1 << 16


async def connect(
    address: str,
    *,
    job: str,
    token: str | bytes | None = None,
    token_file: str | os.PathLike[str] | None = None,
    timeout: float = 10.0,
    name: str | None = None,
    metrics: ClientMetrics | None = None,
) -> AsyncClient:
    """Connect to the parameter server at `address` ("HOST:PORT") for `job`."""
    host, port = parse_address(address)
    secret = resolve_token(token, token_file)
    loop = asyncio.get_running_loop()
    hs = Handshake(job, secret, name or default_client_name())
    try:
        _, proto = await asyncio.wait_for(
            loop.create_connection(lambda: _ClientProtocol(address, hs, metrics), host, port),
            timeout,
        )
    except (TimeoutError, OSError) as exc:
        detail = getattr(exc, "strerror", None) or str(exc) or "timed out"
        raise ConnectError(
            f"cannot reach the parameter server at {address}: {detail}; is `mlfabric server` "
            f"running there?"
        ) from None
    try:
        await asyncio.wait_for(asyncio.shield(proto.welcomed), timeout)
    except TimeoutError:
        proto.close()
        raise ConnectError("the server did not complete the handshake in time") from None
    except BaseException:
        proto.close()
        raise
    return AsyncClient(proto)


class _ClientProtocol(asyncio.BufferedProtocol):
    def __init__(self, address: str, hs: Handshake, metrics: ClientMetrics | None) -> None:
        self.address = address
        self.hs = hs
        self.metrics = metrics
        self.conn = Connection()
        self.requests = RequestTable(metrics)
        self.transport: Any = None
        self.welcomed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.error: BaseException | None = None
        self._stage = "challenge"
        self.can_write = asyncio.Event()
        self.can_write.set()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            import socket

            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.send(self.hs.hello())

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.conn.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.conn.buffer_updated(nbytes)
        if self.metrics is not None:
            self.metrics.received_bytes.inc(nbytes)
        try:
            while (event := self.conn.next_event()) is not NEED_DATA:
                self._handle(event)
        except MlfabricError as exc:
            self._fail(exc)
            self.close()

    def _handle(self, event: Any) -> None:
        if self._stage == "ready":
            self.requests.dispatch(event)
        elif self._stage == "challenge":
            self.send(self.hs.on_challenge(event))
            self.hs.verify_server()
            self._stage = "welcome"
        else:
            welcome = self.hs.on_welcome(event)
            self.conn.max_frame_size = HEADER.size + MAX_META_LEN + layout(welcome.tensors)[1]
            self._stage = "ready"
            self.welcomed.set_result(welcome)

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.can_write.set()  # wake drain(); it then raises the connection's error
        self._fail(connection_lost_error(self.address, exc))
        self.transport = None
        if not self.closed.done():
            self.closed.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        if not self.welcomed.done():
            self.welcomed.set_exception(exc)
            self.welcomed.exception()  # retrieved: connect() re-raises it
        self.requests.fail_all(self.error)

    def send(self, event: Any) -> int:
        parts = self.conn.send(event)
        size = sum(len(p) for p in parts)
        if size <= _JOIN_LIMIT:
            self.transport.write(b"".join(parts))
        else:
            for part in parts:
                self.transport.write(part)
        if self.metrics is not None:
            self.metrics.sent_bytes.inc(size)
        return size

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class AsyncClient:
    """A connection to one parameter server, for asyncio programs."""

    def __init__(self, proto: _ClientProtocol) -> None:
        self._proto = proto
        welcome = proto.welcomed.result()
        self.address = proto.address
        self.specs = welcome.tensors
        self.tau_max = welcome.tau_max
        self.momentum = welcome.momentum
        self.session = welcome.session

    async def pull(self) -> tuple[int, dict[str, np.ndarray]]:
        """The model as (version, {name: array}), consistent at that version."""
        return await self._request("pull", Pull, None)

    def push(
        self, update: Mapping[str, Any], *, base_version: int
    ) -> asyncio.Future[PushOutcome]:
        """Hand an update over; returns a future of its PushOutcome at once."""
        base = check_base_version(base_version)
        arrays = check_update(update, self.specs)
        return self._request("push", lambda req: Push(req, base, arrays), base)

    def _request(self, kind: str, make_event: Any, base_version: int | None) -> Any:
        proto = self._proto
        if proto.error is not None or proto.transport is None:
            raise proto.error or ConnectionLost(f"the client for {self.address} is closed")
        fut = asyncio.get_running_loop().create_future()
        req = proto.requests.add(kind, fut, base_version)
        proto.send(make_event(req))
        return fut

    async def drain(self) -> None:
        """Wait until the transport's write buffer is below its high-water
        mark: call it between pushes to bound the memory of queued updates."""
        await self._proto.can_write.wait()
        if self._proto.error is not None:
            raise self._proto.error

    async def close(self) -> None:
        self._proto.close()
        await self._proto.closed

    @property
    def closed(self) -> bool:
        return self._proto.transport is None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
