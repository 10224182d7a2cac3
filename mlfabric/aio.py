"""The asyncio client: `await mlfabric.aio.connect(...)`.

Same API as the blocking client with awaitables: `await ps.pull()`, and
`ps.push(...)` returns an asyncio future of the outcome at once. Pushed
arrays are handed to the transport without a copy: do not modify them until
the push's future is done.
"""

from __future__ import annotations

import asyncio
import logging
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
log = logging.getLogger("mlfabric.client")


async def connect(
    address: str,
    *,
    job: str,
    token: str | bytes | None = None,
    token_file: str | os.PathLike[str] | None = None,
    timeout: float = 10.0,
    name: str | None = None,
    metrics: ClientMetrics | None = None,
    controller: str | None = None,
    host: str | None = None,
    controller_fallback: str = "fifo",
    controller_timeout: float = 30.0,
    replica: str | None = None,
) -> AsyncClient:
    """Connect to the parameter server at `address` ("HOST:PORT") for `job`.

    The controller arguments work as in mlfabric.connect(), and so does
    `replica` (worker-driven replication: a push's future resolves once the
    replica applied the update too); the asyncio client does not fail over."""
    secret = resolve_token(token, token_file)
    hs = Handshake(job, secret, name or default_client_name())
    proto = await open_link(address, hs, timeout, "parameter server", metrics=metrics)
    client = AsyncClient(proto)
    if replica is not None:
        try:
            client._replica = await connect(replica, job=job, token=secret, timeout=timeout,
                                            name=name)
        except BaseException:
            await client.close()
            raise
        client._replica_host = parse_address(replica)[0]
    if controller is not None:
        from .aio_control import AsyncControlledPushes

        sock = proto.transport.get_extra_info("socket")
        controlled = AsyncControlledPushes(
            client, controller, Handshake(job, secret, name or default_client_name()),
            host=host or sock.getsockname()[0], dst=sock.getpeername()[0],
            fallback=controller_fallback, timeout=controller_timeout,
            aggregation=replica is None)
        try:
            await controlled.start()
        except BaseException:
            await client.close()
            raise
        client._controlled = controlled
    return client


async def open_link(address: str, hs: Handshake, timeout: float, what: str, *,
                    metrics: ClientMetrics | None = None, on_event: Any = None,
                    on_lost: Any = None, command: str | None = None) -> _ClientProtocol:
    """Connect to an mlfabric server or controller and complete the handshake.
    `command`: what should be running there (default: mlfabric + what's last word)."""
    host, port = parse_address(address)
    loop = asyncio.get_running_loop()
    try:
        _, proto = await asyncio.wait_for(
            loop.create_connection(
                lambda: _ClientProtocol(address, hs, metrics, on_event, on_lost), host, port),
            timeout,
        )
    except (TimeoutError, OSError) as exc:
        detail = getattr(exc, "strerror", None) or str(exc) or "timed out"
        command = command or f"mlfabric {what.split()[-1]}"
        raise ConnectError(
            f"cannot reach the {what} at {address}: {detail}; is `{command}` running there?"
        ) from None
    try:
        await asyncio.wait_for(asyncio.shield(proto.welcomed), timeout)
    except TimeoutError:
        proto.close()
        raise ConnectError(f"the {what} did not complete the handshake in time") from None
    except BaseException:
        proto.close()
        raise
    return proto


class _ClientProtocol(asyncio.BufferedProtocol):
    """A connection to a server (answers resolve requests) or, with `on_event`,
    to a controller (events go to that callback)."""

    def __init__(self, address: str, hs: Handshake, metrics: ClientMetrics | None,
                 on_event: Any = None, on_lost: Any = None) -> None:
        self.address = address
        self.on_event = on_event
        self.on_lost = on_lost
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
            if self.on_event is not None:
                self.on_event(event)
            else:
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
        if self.on_lost is not None and self.welcomed.done() and not self.welcomed.exception():
            self.on_lost(self, self.error)

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
        self.last_version = welcome.version
        self._controlled: Any = None  # AsyncControlledPushes with a controller
        self._replica: AsyncClient | None = None  # worker-driven replication
        self._replica_host = ""
        self._replica_warned = False

    async def pull(self) -> tuple[int, dict[str, np.ndarray]]:
        """The model as (version, {name: array}), consistent at that version."""
        version, params = await self._request("pull", Pull, None)
        self.last_version = max(self.last_version, version)
        return version, params

    def push(
        self, update: Mapping[str, Any], *, base_version: int
    ) -> asyncio.Future[PushOutcome]:
        """Hand an update over; returns a future of its PushOutcome at once."""
        base = check_base_version(base_version)
        arrays = check_update(update, self.specs)
        if self._replica is not None:
            return self._push_replicated({n: a.copy() for n, a in arrays.items()}, base)
        if self._controlled is not None:
            return self._controlled.push(arrays, base, layout(self.specs)[1])
        return self._send_push(arrays, base)

    def _push_replicated(self, arrays: dict[str, np.ndarray], base: int
                         ) -> asyncio.Future[PushOutcome]:
        """To the server, then, numbered with the version it produced,
        straight to the replica; resolved once the replica has it."""
        done: asyncio.Future[PushOutcome] = asyncio.get_running_loop().create_future()
        if self._controlled is not None:
            at_server = self._controlled.push(arrays, base, layout(self.specs)[1])
        else:
            at_server = self._send_push(arrays, base)

        def replicated(f: asyncio.Future[PushOutcome], outcome: PushOutcome) -> None:
            if f.cancelled() or f.exception() is not None:
                self._replica_failed(outcome.version, f.exception() if not f.cancelled()
                                     else None)
            elif self._controlled is not None:
                self._controlled.report_replicated(self._replica_host, outcome.version)
            if not done.done():
                done.set_result(outcome)

        def at_server_done(f: asyncio.Future[PushOutcome]) -> None:
            if done.done():
                return
            if f.cancelled():
                done.cancel()
                return
            exc = f.exception()
            if exc is not None:
                done.set_exception(exc)
                return
            outcome = f.result()
            if not outcome.applied or self._replica is None:
                done.set_result(outcome)
                return
            try:
                sent = self._replica._send_push(arrays, base, seq=outcome.version)
            except MlfabricError as exc2:
                self._replica_failed(outcome.version, exc2)
                done.set_result(outcome)
                return
            sent.add_done_callback(lambda r: replicated(r, outcome))

        at_server.add_done_callback(at_server_done)
        return done

    def _replica_failed(self, version: int, exc: BaseException | None) -> None:
        if not self._replica_warned:
            self._replica_warned = True
            log.warning("update %d is applied at the server but did not reach the replica "
                        "(%s)", version, exc)

    def _send_push(self, arrays: dict[str, np.ndarray], base: int, seq: int | None = None,
                   **fields: Any) -> asyncio.Future[PushOutcome]:
        """`fields`: a push's uid and aggregation fields (protocol.Push)."""
        fut: asyncio.Future[PushOutcome] = self._request(
            "push", lambda req: Push(req, base, arrays, seq, **fields), base)
        fut.add_done_callback(self._note_version)
        return fut

    def _note_version(self, fut: asyncio.Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.last_version = max(self.last_version, fut.result().version)

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
        if self._controlled is not None:
            await self._controlled.close()
        if self._replica is not None:
            await self._replica.close()
        self._proto.close()
        await self._proto.closed

    @property
    def closed(self) -> bool:
        return self._proto.transport is None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
