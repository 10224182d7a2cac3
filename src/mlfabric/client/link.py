"""A link to an mlfabric listener (a parameter server, replica, aggregator or
controller), for asyncio code: the protocol that frames and authenticates it
(`Link`), the dial (`open_link`), a frame's data block sent as it becomes
final (`FrameWriter`), a frame sent a chunk at a time (`PartFrame`), and
links kept per address (`LinkPool`).

The asyncio client is built on it, and so is every other component that
talks to a server: the replica, chain replication, measured divergence,
failover and the aggregator.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable, Coroutine
from typing import Any, Generic, Protocol, TypeVar

from ..errors import ConnectError, ConnectionLost, MlfabricError, NotMlfabric
from ..runtime.loop import within, write_parts
from ..runtime.metrics import ClientMetrics
from ..runtime.pacing import set_pace
from ..transport.tls import process_client_context, tls_refused
from ..wire import roles
from ..wire.handshake import ClientHandshake
from ..wire.protocol import (
    HEADER,
    MAX_META_LEN,
    NEED_DATA,
    Challenge,
    Connection,
    ScatteredBlock,
    expand_parts,
    layout,
)
from ..wire.streamed import StreamedBlock
from .core import RequestTable, connection_lost_error, parse_address


async def open_link(address: str, hs: ClientHandshake, timeout: float, what: str, *,
                    metrics: ClientMetrics | None = None, on_event: Any = None,
                    on_lost: Any = None, command: str | None = None,
                    tls: ssl.SSLContext | None = None) -> Link:
    """Connect to an mlfabric server or controller and complete the handshake.
    `what` says which kind of listener is wanted ("parameter server",
    "controller", ...: `wire.roles.WANTED`); another kind that answers is a
    `WrongPeer` error naming both. `command`: what should be running there
    (default: the command that runs a `what`).

    `tls`: a client context (`transport.tls.client_context`) for mutual TLS,
    the listener's certificate checked against the host of `address`; None:
    the process's own (`transport.tls.use_for_process`: a process started
    with --tls-* dials its peers over TLS too), else plain TCP. A failed TLS
    handshake is a `TLSError` saying which side refused what."""
    host, port = parse_address(address)
    loop = asyncio.get_running_loop()
    command = command or roles.command_for(what)
    ctx = tls if tls is not None else process_client_context()
    secured: dict[str, Any] = {} if ctx is None else {"ssl": ctx, "server_hostname": host}
    try:
        _, proto = await within(
            loop.create_connection(
                lambda: Link(address, hs, metrics, on_event, on_lost, what=what), host, port,
                **secured),
            timeout,
        )
    except ssl.SSLError as exc:
        raise tls_refused(exc, what, address, command, by_us=True) from None
    except (TimeoutError, OSError) as exc:
        detail = getattr(exc, "strerror", None) or str(exc) or "timed out"
        raise ConnectError(
            f"cannot reach the {what} at {address}: {detail}; is `{command}` running there?"
        ) from None
    try:
        await within(asyncio.shield(proto.welcomed), timeout)
    except TimeoutError:
        proto.close()
        raise ConnectError(
            f"the {what} at {address} accepted the connection but did not answer the "
            f"handshake within {timeout:g} s: it is hung, or not `{command}`") from None
    except BaseException:
        proto.close()
        raise
    return proto


class Closable(Protocol):
    """What a `LinkPool` keeps: anything that says whether it is closed and closes."""

    @property
    def closed(self) -> bool: ...

    async def close(self) -> None: ...


L = TypeVar("L", bound=Closable)


class LinkPool(Generic[L]):
    """Links kept per address, dialled on first use and again once they failed
    or closed; callers asking meanwhile share one dial. `dial(address)` makes
    a new link (the asyncio client and the aggregator dial `AsyncClient`s)."""

    def __init__(self, dial: Callable[[str], Coroutine[Any, Any, L]]) -> None:
        self._dial = dial
        self._links: dict[str, asyncio.Task[L]] = {}

    def ahead(self, address: str) -> asyncio.Task[L]:
        """Start dialling `address` unless a live or pending link to it is kept;
        returns the dial. A failed dial is only kept for `get` to replace."""
        task = self._links.get(address)
        if task is None or (task.done() and (task.exception() is not None
                                             or task.result().closed)):
            task = self._links[address] = asyncio.get_running_loop().create_task(
                self._dial(address))
            # Nobody may await a dial made ahead; its failure is seen at the next use.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def get(self, address: str) -> L:
        """The link to `address` (dialled now if none is kept or it failed)."""
        return await asyncio.shield(self.ahead(address))

    def forget(self, address: str, link: L) -> None:
        """Stop keeping `link` for `address` (it is being dropped: not to be reused)."""
        task = self._links.get(address)
        if task is not None and task.done() and not task.cancelled() \
                and task.exception() is None and task.result() is link:
            del self._links[address]

    async def close(self) -> None:
        """Close every link kept (or stop its dial)."""
        for task in self._links.values():
            if task.done() and task.exception() is None:
                await task.result().close()
            else:
                task.cancel()


class Link(asyncio.BufferedProtocol):
    """A connection to a server (answers resolve requests) or, with `on_event`,
    to a controller (events go to that callback)."""

    def __init__(self, address: str, hs: ClientHandshake, metrics: ClientMetrics | None,
                 on_event: Any = None, on_lost: Any = None, *,
                 what: str = "parameter server") -> None:
        self.address = address
        self.what = what  # the kind of listener wanted (wire.roles.WANTED)
        self.on_event = on_event
        self.on_lost = on_lost
        self.hs = hs
        self.metrics = metrics
        self.conn = Connection()
        self.requests = RequestTable(metrics)
        self.conn.scatter_for = self.requests.scatter_for
        self.transport: Any = None
        self.welcomed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.error: BaseException | None = None
        self._stage = "challenge"
        self.can_write = asyncio.Event()
        self.can_write.set()
        # While a frame is sent a chunk at a time (`send_part`), the frames
        # sent meanwhile wait here: the stream is in the middle of one.
        self._part: PartFrame | None = None
        self._held: list[list[Any]] = []

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        # Writing pauses as soon as anything is left unsent, and resumes once
        # all of it is sent: `can_write` then means "nothing buffered", so
        # `flushed()` can tell when a frame's bytes no longer point into the
        # caller's arrays (uvloop buffers what it cannot send without a copy).
        # Not over TLS: its layer encrypts each write into a buffer of its
        # own at once (nothing then points into the arrays), and with a high
        # mark of 0 it pauses on every other write even when all is sent
        # (it pauses at size >= high), never to resume if nothing more comes:
        # a push over TLS then waited forever in flushed(). Its default
        # marks bound what is buffered.
        if transport.get_extra_info("sslcontext") is None:
            transport.set_write_buffer_limits(high=0)
        sock = transport.get_extra_info("socket")
        if sock is not None:
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
            if isinstance(exc, NotMlfabric) and not self.welcomed.done():
                # Something else answered the hello: say what, if its bytes tell.
                exc = roles.foreign_peer(exc.head, self.what, self.address)
            self._fail(exc)
            self.close()

    def _handle(self, event: Any) -> None:
        if self._stage == "ready":
            if self.on_event is not None:
                self.on_event(event)
            else:
                self.requests.dispatch(event)
        elif self._stage == "challenge":
            # Another kind of listener than wanted is named before anything
            # else (no proof is sent to it): its job or token are beside the point.
            wrong = roles.wrong_role(getattr(event, "role", ""), self.what, self.address) \
                if isinstance(event, Challenge) else None
            if wrong is not None:
                raise wrong
            # Our proof goes only to a listener whose proof checked out; any
            # other gets a refusal without one (and we give up on it).
            self.send(self.hs.on_challenge(event))
            self.hs.verify_server(self.what, self.address)
            # Every frame from here on carries its MAC (the listener's refusal
            # of the proof just sent, a plain ERROR, excepted).
            self.conn.protect(*self.hs.frame_keys(), plain_error=True)
            self._stage = "welcome"
        else:
            welcome = self.hs.on_welcome(event)
            self.conn.max_frame_size = HEADER.size + MAX_META_LEN + layout(welcome.tensors)[1]
            self._stage = "ready"
            self.welcomed.set_result(welcome)

    async def flushed(self) -> None:
        """Wait until nothing is left in the transport's write buffer (at once
        if the link is gone: its buffer is then dropped)."""
        if self.transport is not None:
            await self.can_write.wait()

    def pace(self, rate: float | None) -> bool:
        """Cap what this link sends at `rate` bytes/s (None: no cap), from the
        bytes still in the kernel's buffer on (`runtime.pacing`). False if
        the link is gone or the platform cannot pace a socket."""
        sock = None if self.transport is None else self.transport.get_extra_info("socket")
        return sock is not None and set_pace(sock, rate)

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.can_write.set()  # wake drain(); it then raises the connection's error
        self._part, self._held = None, []
        if not self.welcomed.done() and isinstance(exc, ssl.SSLError):
            # The listener refused our certificate (TLS 1.3 tells after the
            # client's side of the handshake is done, on the first read).
            self._fail(tls_refused(exc, self.what, self.address,
                                   roles.command_for(self.what), by_us=False))
        elif not self.welcomed.done() and self.transport is not None \
                and self.transport.get_extra_info("sslcontext") is not None:
            # TLS was up, and the listener closed before the mlfabric
            # handshake: what a listener does to a certificate it does not
            # accept (asyncio's TLS layer closes without sending its alert).
            self._fail(ConnectionLost(
                f"the {self.what} at {self.address} closed the connection right after the "
                f"TLS handshake: it did not accept this client's certificate (not signed by "
                f"its --tls-ca; its log says why), or it is shutting down; give tls_cert and "
                f"tls_key signed by the cluster's CA"))
        elif not self.welcomed.done():
            # A peer that dies mid-handshake: callers fall back on ConnectionLost
            # (an aggregator's members go straight to the server).
            tls = ("it requires TLS (give tls_cert, tls_key and tls_ca, or --tls-cert, "
                   "--tls-key and --tls-ca)")
            why = (f"the connection to the {self.what} at {self.address} was lost during the "
                   f"handshake: {getattr(exc, 'strerror', None) or exc}; perhaps {tls}"
                   if exc is not None
                   else f"{self.address} closed the connection during the handshake: it "
                        f"is not {roles.a(self.what)} (`{roles.command_for(self.what)}`), "
                        f"{tls}, or it is shutting down")
            self._fail(ConnectionLost(why))
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
        assert self.transport is not None
        parts = self.conn.send(event)
        if self._part is not None:
            if isinstance(parts[-1], ScatteredBlock):
                # Held, it would point into the caller's arrays after flushed().
                parts = [b"".join(expand_parts(parts))]
            self._held.append(parts)
            return sum(len(p) for p in parts)
        return self._write_frame(parts)

    def _write_frame(self, parts: list[Any]) -> int:
        size = write_parts(self.transport, parts)
        if self.metrics is not None:
            self.metrics.sent_bytes.inc(size)
        return size

    def send_part(self, event: Any, upto: int) -> PartFrame | None:
        """Send `event`'s frame up to byte `upto` of its data block; the rest
        goes on `PartFrame.advance`. Frames sent meanwhile wait for it to
        end. None if another frame is under way: this one then goes whole
        after it."""
        if self._part is not None:
            self.send(event)
            return None
        parts = expand_parts(self.conn.send(event))
        self.write(parts[0])
        self._part = PartFrame(self, parts[1:], trailer=self.conn.trailer_size)
        self._part.advance(upto)
        return self._part

    def part_ended(self, part: PartFrame) -> None:
        """`part`, sent a chunk at a time, is whole: send what waited for it."""
        if part is not self._part:
            return  # the link was lost meanwhile (and what waited with it)
        self._part = None
        held, self._held = self._held, []
        for parts in held:
            if self.transport is None:
                return
            self._write_frame(parts)

    def write(self, data: Any) -> None:
        """Put bytes of a frame on the link, counted as sent."""
        self.transport.write(data)
        if self.metrics is not None:
            self.metrics.sent_bytes.inc(len(data))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class PartFrame:
    """The data block of a frame whose head is sent, sent on its link in
    chunks as the controller lets them go (`Link.send_part`)."""

    def __init__(self, link: Link, parts: list[Any], trailer: int = 0) -> None:
        self._link = link
        self._parts = parts
        self._next = 0  # index of the next part to write
        self._offset = 0  # bytes of that part already written
        self.sent = 0
        self.total = sum(len(p) for p in parts)
        # The frame's MAC, after the block, goes with the block's last byte.
        self._block = self.total - trailer

    @property
    def whole(self) -> bool:
        return self.sent >= self.total

    def advance(self, upto: int) -> None:
        """Write the data block up to byte `upto` (at most all of it)."""
        upto = self.total if upto >= self._block else upto
        link = self._link
        while self.sent < upto and link.transport is not None:
            part = memoryview(self._parts[self._next]).cast("B")
            take = min(len(part) - self._offset, upto - self.sent)
            link.write(part[self._offset:self._offset + take])
            self.sent += take
            self._offset += take
            if self._offset == len(part):
                self._next, self._offset = self._next + 1, 0
        if self.whole:
            link.part_ended(self)


class FrameWriter:
    """The data block of a frame whose head is already sent, written on this
    link in order as its bytes become final (`wire.streamed.StreamedBlock`:
    an aggregator forwards an aggregate while its members still arrive)."""

    def __init__(self, proto: Link, block: StreamedBlock) -> None:
        self._proto = proto
        self.block = block
        if block.done:  # no data block: the frame's MAC follows its head at once
            trailer = proto.conn.stream_trailer()
            if trailer:
                proto.write(trailer)

    @property
    def nbytes(self) -> int:
        return self.block.total

    @property
    def sent(self) -> int:
        return self.block.sent

    def write(self, data: memoryview, upto: int) -> None:
        """Send the block's bytes up to `upto`, from `data`, the whole block
        as laid out on the wire (not copied: keep it unchanged until the
        frame is answered)."""
        proto = self._proto
        if proto.error is not None or proto.transport is None:
            raise proto.error or ConnectionLost(f"the link to {proto.address} is closed")
        chunk = self.block.from_block(data, upto)
        proto.conn.stream_data(chunk)
        proto.write(chunk)
        if self.block.done:
            trailer = proto.conn.stream_trailer()  # the frame's MAC
            if trailer:
                proto.write(trailer)

    def abort(self) -> None:
        """Give up on the frame: the link is dropped at once, so the far end
        discards the partial frame (a request already waiting on this link
        fails with the link)."""
        if self._proto.transport is not None:
            self._proto.transport.abort()
