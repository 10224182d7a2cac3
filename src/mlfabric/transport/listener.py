"""What every mlfabric listener shares: accepting connections, the job-token
handshake, framing, flow control and refusals.

`Endpoint` is the listening side (a parameter server, a controller);
`EndpointProtocol` is one accepted connection. Subclasses say what an
authenticated peer is welcomed with and how its events are handled; this
module only moves bytes and enforces the handshake.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
import ssl
import time
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError, ProtocolError
from ..runtime.loop import write_parts
from ..runtime.memory import give_back_soon
from ..wire import auth
from ..wire.handshake import ServerHandshake
from ..wire.protocol import (
    NEED_DATA,
    Connection,
    Error,
    MsgType,
    Welcome,
    default_allocate,
)
from ..wire.roles import unexpected
from .tls import add_tls_arguments, tls_failure

# Before a peer has authenticated, it may not make us allocate more than this.
UNAUTHENTICATED_MAX_FRAME = 1 << 16


def add_listener_arguments(p: argparse.ArgumentParser, peers: str) -> None:
    """The flags every listening command takes: where, which job, its token."""
    p.add_argument("--listen", required=True, metavar="HOST:PORT",
                   help=f"address to accept {peers} on (port 0 picks a free port)")
    p.add_argument("--job", required=True, help=f"the job's name; {peers} must name it")
    p.add_argument("--token-file", required=True, metavar="PATH",
                   help="file holding the job's secret token")
    add_handshake_timeout(p, peers)
    add_tls_arguments(p, peers)


DEFAULT_HANDSHAKE_TIMEOUT = 10.0


def add_handshake_timeout(p: argparse.ArgumentParser, peers: str) -> None:
    p.add_argument("--handshake-timeout", type=float, default=DEFAULT_HANDSHAKE_TIMEOUT,
                   metavar="SECONDS",
                   help=f"seconds {peers} have to prove they hold the token before the "
                        f"connection is closed (default: {DEFAULT_HANDSHAKE_TIMEOUT:g})")


def handshake_timeout(args: argparse.Namespace) -> float:
    """--handshake-timeout, checked (None: the default)."""
    if args.handshake_timeout is None:
        return DEFAULT_HANDSHAKE_TIMEOUT
    return check_positive("--handshake-timeout", float(args.handshake_timeout))


def job_name(value: str) -> str:
    """--job, checked: a name, not blank (issue 33: `--job ""` was served)."""
    if not value.strip():
        raise ConfigError(f"--job must name the job, got {value!r}")
    return value


# The largest --tau-max: a bound past a million versions bounds nothing a job
# would notice (say -1), and a value past 2**64 started a server whose
# welcome no client could read (issue 33).
MAX_TAU_MAX = 1_000_000


def parse_tau_max(value: int | None) -> int | None:
    """--tau-max (the server's and the controller's): a number of versions
    up to MAX_TAU_MAX, or -1 (or None) for no bound. Any other negative
    number is an error: -2 and -16 used to start a server with no bound at
    all (issue 33)."""
    if value is None or value == -1:
        return None
    if not 0 <= value <= MAX_TAU_MAX:
        raise ConfigError(f"--tau-max must be a number of versions in 0..{MAX_TAU_MAX}, or -1 "
                          f"for no bound; got {value}")
    return value


def add_metrics_arguments(p: argparse.ArgumentParser) -> None:
    """--metrics-port and --metrics-host, the same for every long-running command."""
    p.add_argument("--metrics-port", type=int, default=None, metavar="P",
                   help="serve Prometheus metrics on this port at /metrics; 0 picks a free "
                        "port (the start line prints the URL) (default: off)")
    p.add_argument("--metrics-host", default=None, metavar="ADDR",
                   help="address to serve the metrics on, with --metrics-port (default: the "
                        "--listen host, so a process listening on 127.0.0.1 does not export "
                        "its metrics to the network)")


# -- numeric flags: each checked for its range, with a one-line error naming the
# flag, the value and the range (issue 33). NaN fails every comparison, and an
# infinite interval or timeout means "never", which no flag here is meant to.


def check_port(flag: str, value: int | None) -> int | None:
    """A port to listen on: 0..65535, 0 picking a free one (None: not given)."""
    if value is not None and not 0 <= value <= 65535:
        raise ConfigError(f"{flag} must be a port number in 0..65535 (0 picks a free port), "
                          f"got {value}")
    return value


def check_positive(flag: str, value: float, unit: str = "seconds") -> float:
    """A finite number above 0: a timeout, an interval, a rate."""
    if not 0 < value < math.inf:
        raise ConfigError(f"{flag} must be a positive number{_of(unit)}, got {value}")
    return float(value)


def check_not_negative(flag: str, value: float, unit: str = "seconds") -> float:
    """A finite number from 0 up (0: none, as a wait)."""
    if not 0 <= value < math.inf:
        raise ConfigError(f"{flag} must be a finite number{_of(unit)} >= 0, got {value}")
    return float(value)


def _of(unit: str) -> str:
    return f" of {unit}" if unit else ""


def check_at_least(flag: str, value: int, low: int) -> int:
    """A count with a lower bound."""
    if value < low:
        raise ConfigError(f"{flag} must be at least {low}, got {value}")
    return value


def check_count(flag: str, value: int, low: int, high: int) -> int:
    """A count in low..high."""
    if not low <= value <= high:
        raise ConfigError(f"{flag} must be in {low}..{high}, got {value}")
    return value


def check_metrics_host(port: int | None, host: str | None) -> None:
    """--metrics-host is where the metrics are served: without a metrics
    port there are none, and it used to be ignored silently (issue 33).
    `port`: the metrics port from wherever the command takes it."""
    if host is None:
        return
    if not host.strip():
        raise ConfigError(f"--metrics-host must name an address of this host, got {host!r}")
    if port is None:
        raise ConfigError("--metrics-host without --metrics-port: metrics are off without a "
                          "port; give --metrics-port P (0 picks a free one), or drop "
                          "--metrics-host")


def check_momentum(flag: str, value: float | None) -> float | None:
    """A momentum gamma: in [0, 1) (None: not given)."""
    if value is not None and not 0 <= value < 1:
        raise ConfigError(f"{flag} must be in [0, 1), got {value}")
    return value


async def listen(endpoint: Endpoint, host: str, port: int, address: str) -> tuple[str, int]:
    """Start `endpoint`; an address that cannot be bound is a ConfigError naming it."""
    try:
        return await endpoint.start(host, port)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {address}: {exc.strerror}") from None


def stop_on_signals() -> asyncio.Event:
    """An event set on SIGINT or SIGTERM (Ctrl-C and a service manager's stop).
    Call it before announcing the process as ready: a stop that comes right
    after the announcement must still shut down cleanly, not kill it."""
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    return stop


# Connections that have not finished the handshake, per listener: past this,
# the oldest of them is closed to make room (issue 33: 3,000 idle ones were
# only closed by the handshake timeout, each holding a file descriptor). The
# oldest rather than the newest: a flood then cannot keep a good client out,
# whose handshake takes milliseconds, unless it opens this many in that time.
MAX_UNAUTHENTICATED = 256


class LogLimiter:
    """At most `burst` lines per `interval` seconds of one kind of warning;
    the next line after a quiet spell says how many were not logged (failed
    handshakes must not flood the log: one line per many, with a count)."""

    def __init__(self, log: logging.Logger, burst: int = 5, interval: float = 10.0,
                 clock: Any = None) -> None:
        self.log, self.burst, self.interval = log, burst, interval
        self.clock = clock or time.monotonic
        self._window = -math.inf
        self._lines = 0
        self.suppressed = 0

    def warning(self, msg: str, *args: Any) -> None:
        now = self.clock()
        if now - self._window >= self.interval:
            self._window, self._lines = now, 0
        if self._lines >= self.burst:
            self.suppressed += 1
            return
        self._lines += 1
        if self.suppressed:
            msg += " (and %d more like these in the last %.0f s, not logged)"
            args = (*args, self.suppressed, self.interval)
            self.suppressed = 0
        self.log.warning(msg, *args)


class Endpoint:
    """A TCP listener whose peers must prove they hold the job's token.

    `metrics` needs: received_bytes, sent_bytes, connected_clients,
    auth_failures, protocol_errors, unauthenticated_refused, backpressure,
    tls_refused.

    With `tls` (a server context, `transport.tls.server_context`), every
    connection does a mutual TLS handshake before the job-token one, within
    the same handshake timeout and counted among the unauthenticated ones.

    Limits (issue 33): at most `max_unauthenticated` connections that have
    not finished the handshake (a new one closes the oldest); and per
    connection, once the answers queued
    for a peer that does not read them pass `queue_limit` bytes, its further
    requests wait (they stay unparsed, in its receive buffer) until those
    are sent: 256 pipelined pulls once held 4.2 GB."""

    role = "server"
    log = logging.getLogger("mlfabric.endpoint")

    def __init__(self, *, job: str, token: bytes, metrics: Any,
                 handshake_timeout: float = 10.0, max_frame_size: int = 1 << 20,
                 max_unauthenticated: int = MAX_UNAUTHENTICATED,
                 tls: ssl.SSLContext | None = None) -> None:
        self.job = job
        self.tls = tls
        self.token = auth.as_token(token)
        self.metrics = metrics
        self.handshake_timeout = handshake_timeout
        self.max_frame_size = max_frame_size
        self.max_unauthenticated = max_unauthenticated
        # connections open that have not finished the handshake, oldest first
        self.unauthenticated: dict[EndpointProtocol, None] = {}
        self.refusals = LogLimiter(self.log)
        self._server: asyncio.base_events.Server | None = None
        self.connections: set[EndpointProtocol] = set()

    @property
    def queue_limit(self) -> int:
        """Bytes of answers queued for one connection past which its requests
        wait: two of the largest frames (a pull answered while another is in
        the socket), and at least 4 MiB."""
        return max(4 << 20, 2 * self.max_frame_size)

    def make_protocol(self) -> EndpointProtocol:
        raise NotImplementedError

    def welcome(self, conn: EndpointProtocol) -> Welcome:
        raise NotImplementedError

    @property
    def address(self) -> tuple[str, int]:
        assert self._server is not None, f"{self.role} not started"
        return self._server.sockets[0].getsockname()[:2]

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self.make_protocol, host, port,
                                                reuse_address=True)
        return self.address

    async def serve_forever(self) -> None:
        assert self._server is not None, f"{self.role} not started"
        try:
            await self._server.serve_forever()
        except asyncio.CancelledError:
            pass

    async def close(self) -> None:
        """Stop accepting, close every connection, and wait until all are gone."""
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()


async def accept_tls(raw: Any, protocol: Any, ctx: ssl.SSLContext,
                     take_early: Callable[[], bytes]) -> Any:
    """The server side of a TLS handshake on the accepted connection `raw`
    (a listener starts TLS itself, per connection, so that a failed
    handshake reaches it to be counted and logged, and is held to its
    limits); `protocol` then reads and writes through the secured transport
    this returns (None if the connection was closed meanwhile). Raises what
    the handshake raised (ssl.SSLError, ConnectionError).

    `take_early()`: the bytes read from `raw` before start_tls took it over
    (uvloop undoes a pause_reading made in connection_made, and may have
    read the start of the ClientHello); called once, when the TLS protocol
    is in place, and those bytes are handed to it before anything newer."""
    loop = asyncio.get_running_loop()
    raw.pause_reading()  # sticks now (past connection_made): take_early() is complete
    handshake = loop.create_task(loop.start_tls(raw, protocol, ctx, server_side=True))
    # One turn: start_tls has swapped its protocol in and scheduled its
    # connection_made and resume_reading; the early bytes go right after
    # those, in the same turn, before any read can come.
    await asyncio.sleep(0)
    early = take_early()
    if early:
        loop.call_soon(_feed, raw, early)
    return await handshake


def _feed(raw: Any, data: bytes) -> None:
    """Give `data`, read from `raw` before start_tls took it over, to the TLS
    layer now reading it (a BufferedProtocol, in asyncio and uvloop alike)."""
    proto = raw.get_protocol()
    view = memoryview(data)
    while view and not raw.is_closing():
        buf = proto.get_buffer(len(view))
        n = min(len(buf), len(view))
        buf[:n] = view[:n]
        proto.buffer_updated(n)
        view = view[n:]


class EndpointProtocol(asyncio.BufferedProtocol):
    """One accepted connection: handshake, then `handle(event)` per event."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.log = endpoint.log
        self.conn = Connection(max_frame_size=UNAUTHENTICATED_MAX_FRAME, allocate=self.allocate)
        self.transport: Any = None
        self.peer = "?"
        self.peer_host = "?"
        self.handshake = ServerHandshake(endpoint.job, endpoint.token, endpoint.role)
        self._timer: asyncio.TimerHandle | None = None
        self.last_read = 0  # bytes of the latest read: large means data is backed up
        self.closing = False
        self._held = False  # requests wait for the answers queued to drain
        self._tls_pending: asyncio.Task[None] | None = None  # the TLS handshake, under way
        # Bytes read before start_tls took the socket over (uvloop undoes a
        # pause_reading made in connection_made and may read the start of
        # the peer's ClientHello): given to the TLS layer once it is in place.
        # None once it is.
        self._early: bytearray | None = None
        self._scratch = bytearray()
        self._lost = False

    # The events this listener's role takes once the peer is in (wire.roles).
    accepts: tuple[type, ...] = ()

    @property
    def stage(self) -> str:
        """hello -> auth -> ready (or refused): how far the handshake is."""
        return self.handshake.stage

    @property
    def client(self) -> str:
        """The peer's name, from its hello ("?" before)."""
        return self.handshake.client

    # -- hooks for subclasses -------------------------------------------------

    def handle(self, event: Any) -> None:
        """An event from an authenticated peer."""
        raise NotImplementedError

    def after_events(self) -> None:
        """Called after the events of each read have been handled."""

    def allocate(self, msg_type: MsgType, nbytes: int) -> Any:
        return default_allocate(msg_type, nbytes)

    def on_ready(self) -> None:
        """The peer has authenticated."""

    def on_lost(self) -> None:
        """The connection is gone (after the base bookkeeping)."""

    # -- asyncio callbacks ------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        if peer:
            self.peer, self.peer_host = f"{peer[0]}:{peer[1]}", str(peer[0])
        ep = self.endpoint
        if len(ep.unauthenticated) >= ep.max_unauthenticated:
            oldest = next(iter(ep.unauthenticated))
            ep.metrics.unauthenticated_evicted.inc()
            ep.refusals.warning("closing connection from %s to make room: %d connections "
                                "had not finished the handshake (the cap)", oldest.peer,
                                len(ep.unauthenticated))
            oldest.evict()
        ep.unauthenticated[self] = None
        self.endpoint.connections.add(self)
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.endpoint.handshake_timeout, self._handshake_timeout)
        if ep.tls is not None:
            # TLS is started here rather than by create_server(ssl=...): a
            # failed TLS handshake then reaches us (asyncio drops it silently
            # before the protocol sees the connection) to be counted and
            # logged, and a connection in its TLS handshake is held to the
            # handshake timeout and the cap on unauthenticated ones like any.
            transport.pause_reading()  # until start_tls takes over the socket
            self._early = bytearray()
            self._tls_pending = loop.create_task(self._start_tls(transport, ep.tls))

    async def _start_tls(self, raw: Any, ctx: ssl.SSLContext) -> None:
        """The TLS handshake on `raw`; this protocol then reads and writes
        through the secured transport. A failure is a refusal."""
        ep = self.endpoint

        def take_early() -> bytes:
            early, self._early = bytes(self._early or b""), None
            return early

        try:
            secured = await accept_tls(raw, self, ctx, take_early)
        except Exception as exc:  # SSLError, ConnectionError, the transport closed by us
            if not self.closing:  # else evicted or timed out: said so already
                ep.metrics.tls_refused.inc()
                ep.refusals.warning("refused %s: TLS handshake failed: %s", self.peer,
                                    tls_failure(exc))
            raw.abort()
            self._tls_pending = None
            # The TLS layer does not tell a protocol of a connection lost
            # before its handshake: the bookkeeping is done here.
            self.connection_lost(None)
            return
        self._tls_pending = None
        if secured is None or self.closing or self._lost:
            # Closed during the handshake (by us: evicted, timed out, the
            # listener closing): start_tls then returns None, not an error.
            (secured or raw).abort()
            self.connection_lost(None)
            return
        self.transport = secured
        self._process()  # what the peer sent with the end of the TLS handshake

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._early is not None:  # raw bytes, before TLS: not for the frame parser
            if len(self._scratch) < max(sizehint, 1 << 12):
                self._scratch = bytearray(max(sizehint, 1 << 12))
            return memoryview(self._scratch)
        return self.conn.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if self._early is not None:
            self._early += self._scratch[:nbytes]
            if self.transport is not None:
                self.transport.pause_reading()
                if len(self._early) > UNAUTHENTICATED_MAX_FRAME:  # a ClientHello is small
                    self.evict()
            return
        self.last_read = nbytes
        self.conn.buffer_updated(nbytes)
        self.endpoint.metrics.received_bytes.inc(nbytes)
        if self._tls_pending is not None:
            # Sent with the end of the TLS handshake, before start_tls has
            # returned the transport to answer on: handled once it has.
            return
        self._process()

    def _process(self) -> None:
        """Handle the events received, unless the answers queued for this
        peer are past the bound: then they wait for `resume_writing`."""
        while self.transport is not None and not self.closing:
            if (self.stage == "ready" and not self._held
                    and self.transport.get_write_buffer_size() > self.endpoint.queue_limit):
                self._held = True
                self.endpoint.metrics.backpressure.inc()
                self.transport.pause_reading()
                return
            if self._held:
                return
            try:
                event = self.conn.next_event()
            except ProtocolError as exc:
                self.protocol_error(str(exc))
                return
            if event is NEED_DATA:
                break
            try:
                if self.stage != "ready":
                    self._handshake(event)
                elif isinstance(event, self.accepts):
                    self.handle(event)
                else:
                    self.protocol_error(unexpected(event))
                    return
            except Exception:  # a bug: keep serving the others, say so loudly
                self.log.exception("internal error handling %s from %s",
                                   type(event).__name__, self.peer)
                role = self.endpoint.role
                self.refuse("internal", f"internal {role} error; see the {role}'s log")
                return
        if self.stage == "ready" and self.transport is not None and not self.closing:
            self.after_events()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lost:
            return
        self._lost = True
        self._uncount()
        if self.stage == "ready":
            self.endpoint.metrics.connected_clients.dec()
            self.log.info("client %s (%s) disconnected", self.client, self.peer)
        if self._timer is not None:
            self._timer.cancel()
        self.endpoint.connections.discard(self)
        self.transport = None
        self.on_lost()
        # Free what this connection received now, not when the cyclic GC
        # finds it: the Connection refers back to this protocol (`allocate`).
        self.conn.release()
        self._scratch = bytearray()
        # ... and give the pages back: freed, a large frame's buffer can stay
        # in the process's heap for good (runtime.memory says why).
        give_back_soon()

    def pause_writing(self) -> None:
        # The peer is not reading its answers: stop reading its requests
        # until it catches up, so our write buffer stays bounded.
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None:
            self.transport.resume_reading()
        if self._held:  # the answers drained: on with the requests that waited
            self._held = False
            self._process()

    def _uncount(self) -> None:
        self.endpoint.unauthenticated.pop(self, None)

    def evict(self) -> None:
        """Close at once, unanswered: a connection that had not finished the
        handshake, to make room for a new one."""
        self._uncount()
        self.closing = True
        if self.transport is not None:
            self.transport.abort()

    # -- helpers ----------------------------------------------------------------

    def close(self) -> None:
        # The transport closes later; from now on nothing more this peer sent
        # is acted on (frames already buffered behind a refused one included).
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    def send(self, event: Any) -> None:
        if self.transport is None:
            return
        size = write_parts(self.transport, self.conn.send(event))
        self.endpoint.metrics.sent_bytes.inc(size)

    def refuse(self, code: str, message: str) -> None:
        """Answer with a connection-wide error and close."""
        self.send(Error(code=code, message=message))
        self.close()

    def protocol_error(self, message: str) -> None:
        self.endpoint.metrics.protocol_errors.inc()
        self.endpoint.refusals.warning("closing connection from %s: protocol error: %s",
                                       self.peer, message)
        self.refuse("protocol", message)

    def _handshake_timeout(self) -> None:
        if self._tls_pending is not None and self.transport is not None:
            # No frame can be sent before TLS is up: the connection is just closed.
            self.endpoint.refusals.warning("closing connection from %s: no TLS handshake "
                                           "within %.1f s", self.peer,
                                           self.endpoint.handshake_timeout)
            self.closing = True
            self.transport.abort()
            return
        if self.stage != "ready" and self.transport is not None:
            self.endpoint.refusals.warning("closing connection from %s: no handshake within "
                                           "%.1f s", self.peer, self.endpoint.handshake_timeout)
            self.refuse("protocol", "handshake not completed in time")

    def _handshake(self, event: Any) -> None:
        """One step of `wire.handshake.ServerHandshake`, carried out."""
        ep = self.endpoint
        step = self.handshake.on_event(event)
        if step.code == "protocol":
            self.protocol_error(step.message)
            return
        if step.code is not None:
            ep.metrics.auth_failures.inc()
            ep.refusals.warning("refused %s (%s): %s", self.client, self.peer, step.why)
            self.refuse(step.code, step.message)
            return
        if step.send is not None:
            self.send(step.send)
            return
        if self._timer is not None:
            self._timer.cancel()
        self._uncount()
        self.conn.max_frame_size = ep.max_frame_size
        # Every frame from here on, the welcome first, carries its MAC.
        self.conn.protect(*self.handshake.frame_keys())
        ep.metrics.connected_clients.inc()
        self.log.info("client %s (%s) connected", self.client, self.peer)
        self.send(ep.welcome(self))
        self.on_ready()
