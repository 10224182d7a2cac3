"""The parameter server: the asyncio side of `ParameterStore`.

This module only moves bytes: each connection feeds received bytes to a
`protocol.Connection`, hands complete events to the store, and writes the
answers. Pushed tensors are received straight into a per-connection buffer
(BufferedProtocol), validated and applied in the event loop thread, so a pull
always sees the model between two updates, never half of one.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

import numpy as np

from . import auth
from .errors import InvalidUpdate, ProtocolError
from .metrics import ServerMetrics
from .protocol import (
    HEADER,
    MAX_META_LEN,
    NEED_DATA,
    Auth,
    Challenge,
    Connection,
    Error,
    Hello,
    Model,
    MsgType,
    Pull,
    Push,
    PushResult,
    Welcome,
    default_allocate,
    layout,
)
from .store import ParameterStore, StagedApply

log = logging.getLogger("mlfabric.server")

# Before a peer has authenticated, it may not make us allocate more than this.
UNAUTHENTICATED_MAX_FRAME = 1 << 16
# Apply a push while it arrives once this many new bytes are in (large
# enough that per-chunk Python overhead vanishes, small enough to stay in
# cache and to overlap with the rest of the transfer).
STAGE_CHUNK = 1 << 19
# Pushes smaller than this are applied whole when complete.
STAGE_MIN_BYTES = 1 << 20
# Frames up to this size are joined into one write (one syscall); larger ones
# are written buffer by buffer so tensors are not copied.
_JOIN_LIMIT = 1 << 16


class ParameterServer:
    """Serves one job's model over TCP.

    >>> server = ParameterServer(store, job="mnist", token=b"...")
    >>> host, port = await server.start("127.0.0.1", 0)
    >>> await server.close()
    """

    def __init__(
        self,
        store: ParameterStore,
        *,
        job: str,
        token: bytes,
        metrics: ServerMetrics | None = None,
        handshake_timeout: float = 10.0,
        stage_min_bytes: int | None = STAGE_MIN_BYTES,
    ) -> None:
        """`stage_min_bytes`: pushes at least this large are applied while they
        arrive (None: always apply after the last byte)."""
        self.store = store
        self.stage_min_bytes = stage_min_bytes
        self.job = job
        self.token = auth.as_token(token)
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self.handshake_timeout = handshake_timeout
        self.max_frame_size = HEADER.size + MAX_META_LEN + store.nbytes
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[_ServerProtocol] = set()
        self.metrics.version.set(store.version)

    @property
    def address(self) -> tuple[str, int]:
        assert self._server is not None, "server not started"
        return self._server.sockets[0].getsockname()[:2]

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _ServerProtocol(self), host, port, reuse_address=True
        )
        return self.address

    async def serve_forever(self) -> None:
        assert self._server is not None, "server not started"
        try:
            await self._server.serve_forever()
        except asyncio.CancelledError:
            pass

    async def close(self) -> None:
        """Stop accepting, close every connection, and wait until all are gone."""
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()

    # -- decisions on events (called by connections) --------------------------

    def handle_push(self, event: Push, staged: StagedApply | None = None,
                    data: memoryview | None = None) -> PushResult | Error:
        """Apply a received push; `staged` is its apply begun while it arrived."""
        m = self.metrics
        started = time.perf_counter()
        outcome = staged.finish(data) if staged is not None and data is not None else None
        try:
            if outcome is None:
                outcome = self.store.apply(event.base_version, event.tensors)
        except InvalidUpdate as exc:
            m.updates_rejected.labels(exc.reason).inc()
            return Error(code=exc.reason, message=str(exc), req=event.req)
        if outcome.applied:
            m.apply_seconds.observe(time.perf_counter() - started)
            m.updates_applied.inc()
            m.delay.observe(outcome.delay or 0)
            m.version.set(outcome.version)
        else:
            m.updates_rejected.labels("stale").inc()
        return PushResult(
            req=event.req,
            applied=outcome.applied,
            version=outcome.version,
            delay=outcome.delay,
            reason=outcome.reason,
        )

    def handle_pull(self, event: Pull) -> Model:
        version, tensors = self.store.snapshot()
        self.metrics.pulls.inc()
        return Model(req=event.req, version=version, tensors=tensors)


class _ServerProtocol(asyncio.BufferedProtocol):
    """One client connection: handshake, then pulls and pushes."""

    def __init__(self, server: ParameterServer) -> None:
        self.server = server
        self.conn = Connection(max_frame_size=UNAUTHENTICATED_MAX_FRAME, allocate=self._allocate)
        self.transport: Any = None
        self.peer = "?"
        self.client = "?"
        self._stage = "hello"  # hello -> auth -> ready
        self._nonce = b""
        self._client_nonce = b""
        self._push_buffer: np.ndarray | None = None
        self._staged: StagedApply | None = None
        self._staged_frame: Any = None  # the data block the staging belongs to
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio callbacks ----------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        self.server._connections.add(self)
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.server.handshake_timeout, self._handshake_timeout)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.conn.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.conn.buffer_updated(nbytes)
        self.server.metrics.received_bytes.inc(nbytes)
        while self.transport is not None:
            try:
                event = self.conn.next_event()
            except ProtocolError as exc:
                self._protocol_error(str(exc))
                return
            if event is NEED_DATA:
                break
            try:
                self._handle(event)
            except Exception:  # a bug: keep serving the others, say so loudly
                log.exception("internal error handling %s from %s", type(event).__name__,
                              self.peer)
                self._refuse("internal", "internal server error; see the server's log")
                return
        if self._stage == "ready" and self.transport is not None:
            self._stage_push()

    def _stage_push(self) -> None:
        """Apply the push that is arriving as far as its bytes have come."""
        partial = self.conn.receiving()
        if partial is None or partial.msg_type is not MsgType.PUSH:
            return
        if partial.data is not self._staged_frame:
            self._staged_frame = partial.data
            self._staged = None
            base = partial.meta.get("base_version")
            threshold = self.server.stage_min_bytes
            if threshold is not None and len(partial.data) >= threshold and type(base) is int:
                offsets, _ = layout(partial.specs)
                self._staged = self.server.store.begin_staged(base, partial.specs, offsets)
        staged = self._staged
        if staged is not None and partial.received - staged.fed >= STAGE_CHUNK:
            staged.feed(partial.data, partial.received)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._stage == "ready":
            self.server.metrics.connected_clients.dec()
            log.info("client %s (%s) disconnected", self.client, self.peer)
        if self._timer is not None:
            self._timer.cancel()
        if self._staged is not None:
            self._staged.cancel()
            self._staged = self._staged_frame = None
        self.server._connections.discard(self)
        self.transport = None
        self._push_buffer = None

    def pause_writing(self) -> None:
        # The client is not reading its answers: stop reading its requests
        # until it catches up, so our write buffer stays bounded.
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None:
            self.transport.resume_reading()

    # -- helpers ----------------------------------------------------------------

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _allocate(self, msg_type: MsgType, nbytes: int) -> Any:
        if msg_type is MsgType.PUSH and self._stage == "ready":
            # One buffer per connection, reused: a push is applied before the
            # next frame is parsed, so its bytes are no longer needed by then.
            if self._push_buffer is None or len(self._push_buffer) < nbytes:
                self._push_buffer = np.empty(max(nbytes, self.server.store.nbytes), np.uint8)
            return self._push_buffer
        return default_allocate(msg_type, nbytes)

    def _send(self, event: Any) -> None:
        if self.transport is None:
            return
        parts = self.conn.send(event)
        size = sum(len(p) for p in parts)
        self.server.metrics.sent_bytes.inc(size)
        if size <= _JOIN_LIMIT:
            self.transport.write(b"".join(parts))
        else:
            for part in parts:
                self.transport.write(part)

    def _refuse(self, code: str, message: str) -> None:
        """Answer with a connection-wide error and close."""
        self._send(Error(code=code, message=message))
        self.close()

    def _protocol_error(self, message: str) -> None:
        self.server.metrics.protocol_errors.inc()
        log.warning("closing connection from %s: protocol error: %s", self.peer, message)
        self._refuse("protocol", message)

    def _handshake_timeout(self) -> None:
        if self._stage != "ready" and self.transport is not None:
            log.warning(
                "closing connection from %s: no handshake within %.1f s",
                self.peer,
                self.server.handshake_timeout,
            )
            self._refuse("protocol", "handshake not completed in time")

    def _handle(self, event: Any) -> None:
        server = self.server
        if self._stage == "ready":
            if isinstance(event, Push):
                staged, data = self._staged, self._staged_frame
                self._staged = self._staged_frame = None
                answer = server.handle_push(event, staged, data)
                if isinstance(answer, Error):
                    log.warning(
                        "refused push %d from %s (%s): %s",
                        event.req, self.client, self.peer, answer.message,
                    )
                self._send(answer)
            elif isinstance(event, Pull):
                self._send(server.handle_pull(event))
            else:
                self._protocol_error(f"unexpected {type(event).__name__} message")
        elif self._stage == "hello":
            if not isinstance(event, Hello):
                self._protocol_error(f"expected a hello, got {type(event).__name__}")
                return
            self.client = event.client
            if event.job != server.job:
                server.metrics.auth_failures.inc()
                log.warning("refused %s (%s): wrong job %r", event.client, self.peer, event.job)
                self._refuse(
                    "auth",
                    f"this server serves job {server.job!r}, not {event.job!r}: check the job "
                    f"name and the server address",
                )
                return
            self._client_nonce = event.nonce
            self._nonce = auth.new_nonce()
            proof = auth.server_proof(server.token, server.job, event.nonce, self._nonce)
            self._send(Challenge(nonce=self._nonce, proof=proof))
            self._stage = "auth"
        elif self._stage == "auth":
            if not isinstance(event, Auth):
                self._protocol_error(f"expected an auth message, got {type(event).__name__}")
                return
            expected = auth.client_proof(server.token, server.job, self._client_nonce, self._nonce)
            if not auth.proofs_match(expected, event.proof):
                server.metrics.auth_failures.inc()
                log.warning("refused %s (%s): wrong token", self.client, self.peer)
                self._refuse(
                    "auth",
                    f"authentication failed: the client's token is not job {server.job!r}'s "
                    f"token; check the token file",
                )
                return
            self._stage = "ready"
            if self._timer is not None:
                self._timer.cancel()
            self.conn.max_frame_size = server.max_frame_size
            server.metrics.connected_clients.inc()
            log.info("client %s (%s) connected", self.client, self.peer)
            store = server.store
            self._send(
                Welcome(
                    session=secrets.token_hex(8),
                    version=store.version,
                    tensors=store.specs,
                    tau_max=store.tau_max,
                    momentum=store.momentum,
                )
            )
