"""The per-host agent daemon: moves probe bytes and carries out the estimator's plans.

One port number serves both channels (see `mlfabric.wire.agent_protocol`): a TCP listener
for control connections (peer agents, local clients, the controller; each
logs in, and with `AgentConfig.tls` speaks mutual TLS first) and a
UDP socket receiving probe trains, timestamped by the kernel
(SO_TIMESTAMPNS) so that a busy event loop does not distort the dispersion.

For every peer the agent keeps a control connection (reconnecting with
bounded exponential backoff), and in a loop asks its `PathEstimator` for the
next train, sends it back to back (a train is a few milliseconds of the
link's capacity), waits for the peer's `TrainReport` (arrival times and the
peer's downlink load), and feeds the measurement back. A task samples the
host's NIC counters for the load on its own links. All decisions live in
`mlfabric.agent.estimator`; this module only moves bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import math
import os
import random
import re
import socket
import ssl
import struct
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..errors import (
    AuthenticationError,
    ConfigError,
    ConnectionLost,
    IntegrityError,
    NotMlfabric,
    ProtocolError,
    TLSError,
)
from ..runtime.loop import within
from ..transport.agent_login import open_agent, open_agent_blocking
from ..transport.listener import LogLimiter, accept_tls
from ..transport.tls import tls_failure
from ..wire import agent_protocol as probe
from ..wire.agent_auth import AgentCredential, AgentGate, cluster_credential
from .estimator import (
    BusyMeter,
    LoadMeter,
    PathEstimate,
    PathEstimator,
    ProbeConfig,
    TrainMeasurement,
    TrainPlan,
    analyze_train,
)
from .job_traffic import SEGMENT_OVERHEAD, JobTrafficReader

if TYPE_CHECKING:
    from ..runtime.metrics import AgentMetrics

log = logging.getLogger("mlfabric.agent")
FIRST = asyncio.FIRST_COMPLETED

LOGIN_MAX_FRAME = 4096  # the largest frame before a login (agent_protocol.Login fits)
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux; SCM_TIMESTAMPNS == SO_TIMESTAMPNS
SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
_TIMESPEC = struct.Struct("@qq")


def _set_buffer(sock: socket.socket, opt: int, force_opt: int, size: int) -> None:
    """A socket buffer big enough for a whole train; beyond net.core.*mem_max if root."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, force_opt, size)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, opt, size)


READ_CHUNK = 65536


def read_net_dev(interface: str | None = None,
                 paths: tuple[str, ...] = ("/proc/thread-self/net/dev", "/proc/net/dev"),
                 ) -> tuple[int, int] | None:
    """(rx_bytes, tx_bytes) of `interface`, or summed over every interface but
    loopback, in the calling thread's network namespace; None if unreadable."""
    for path in paths:
        try:
            with open(path) as f:
                lines = f.readlines()[2:]
        except OSError:
            continue
        rx = tx = 0
        found = False
        for line in lines:
            name, _, rest = line.partition(":")
            name = name.strip()
            if name == "lo" or (interface is not None and name != interface):
                continue
            fields = rest.split()
            if len(fields) < 9:
                continue
            rx += int(fields[0])
            tx += int(fields[8])
            found = True
        return (rx, tx) if found else None
    return None


def read_nic_speed(interface: str | None = None, sysfs: str = "/sys/class/net",
                   net_dev: tuple[str, ...] = ("/proc/thread-self/net/dev", "/proc/net/dev"),
                   ) -> float | None:
    """The line rate of `interface` (or the fastest interface but loopback) in
    bit/s, from the kernel's `speed` (Mbit/s); None when no interface says
    (virtual ones often do not, or say -1). The interfaces are listed from the
    calling thread's network namespace."""
    names: list[str] = []
    for path in net_dev:
        try:
            with open(path) as f:
                names = [line.partition(":")[0].strip() for line in f.readlines()[2:]]
            break
        except OSError:
            continue
    best = None
    for name in names:
        if name == "lo" or (interface is not None and name != interface):
            continue
        try:
            with open(f"{sysfs}/{name}/speed") as f:
                mbit = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if mbit > 0:
            best = max(best or 0.0, mbit * 1e6)
    return best


_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def valid_host(host: str) -> bool:
    """An IP address, or a host name as DNS takes it (labels of 1-63 letters,
    digits and inner hyphens, 253 characters at most): what a peer's address
    may be. Anything else cannot be resolved (the resolver raises, not the
    network: an empty label, a NUL), and is refused where it is given."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    name = host[:-1] if host.endswith(".") else host
    return 0 < len(name) <= 253 and all(_LABEL.fullmatch(x) for x in name.split("."))


def parse_hostport(text: str, what: str = "address") -> tuple[str, int]:
    """'HOST:PORT' or '[V6]:PORT' -> (host, port); ConfigError on bad input."""
    host, sep, port_s = text.rpartition(":")
    host = host.strip("[]")
    try:
        port = int(port_s)
    except ValueError:
        port = -1
    if not sep or not host or not 0 <= port <= 65535:
        raise ConfigError(f"{what} {text!r} is not HOST:PORT (for example 10.0.0.2:7400)")
    if not valid_host(host):
        raise ConfigError(f"{what} {text!r}: {host!r} is no IP address or host name")
    return host, port


def parse_peer(text: str) -> tuple[str, tuple[str, int]]:
    """'NAME=HOST:PORT' -> (name, (host, port))."""
    name, sep, addr = text.partition("=")
    if not sep or not name:
        raise ConfigError(f"peer {text!r} is not NAME=HOST:PORT (for example h1=10.0.0.2:7400)")
    return name, parse_hostport(addr, f"peer {name!r} address")


@dataclass
class AgentConfig:
    """`cluster_token`: the operator's secret every agent of the cluster holds
    (wire.agent_auth): peers log in with it, and it derives each job's key."""

    name: str
    cluster_token: bytes = field(repr=False, kw_only=True)
    host: str = "0.0.0.0"
    port: int = 7400
    peers: dict[str, tuple[str, int]] = field(default_factory=dict)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    connect_timeout: float = 2.0
    backoff_min: float = 0.05
    backoff_max: float = 2.0
    report_timeout: float = 0.5  # after a train was sent, how long to wait for its report
    train_timeout: float = 0.15  # receiver: report a train this long after its first packet
    udp_rcvbuf: int = 4 << 20
    # NIC byte counters (rx, tx) for the load on this host's links; None: do not use
    counters: Callable[[], tuple[int, int] | None] | None = read_net_dev
    load_interval: float = 0.1  # how often the counters are read
    load_window: float = 0.3  # load is averaged over this long
    # the job's own TCP traffic (rx, tx) in wire bytes, subtracted from the load like
    # probes (mlfabric.agent.job_traffic); None: every byte on the NIC is someone else's
    job_traffic: Callable[[], tuple[int, int]] | None = None
    max_lost_trains: int = 5  # then the connection is dropped and re-established
    login_timeout: float = 5.0  # a control connection not logged in by then is closed
    # Control connections not logged in yet: past this, the oldest of them is
    # closed to make room (issue 33: 500 unauthenticated connections held 534
    # MiB; the oldest, so that a flood cannot keep a peer's login out).
    max_unauthenticated: int = 128
    # Mutual TLS (transport.tls): the control port's server context (None:
    # plain TCP), and the client context the probe sessions dial peers with
    # (None: the process's own, `tls.use_for_process`, else plain TCP).
    tls: ssl.SSLContext | None = field(default=None, repr=False)
    tls_client: ssl.SSLContext | None = field(default=None, repr=False)


# A full frame of 1514 bytes carries 1448 bytes of TCP payload (timestamps on)
# or 1472 of a probe datagram's: rates of the job's TCP flows are converted
# to what the estimates count.
TCP_TO_DATAGRAM = (1514 - probe.WIRE_OVERHEAD) / (1514 - SEGMENT_OVERHEAD)


@dataclass
class _PeerState:
    name: str
    addr: tuple[str, int]
    estimator: PathEstimator
    task: asyncio.Task[None] | None = None
    connected: bool = False
    trains: int = 0  # trains whose outcome was folded into the estimator
    # agents probing the peer (its last report): they share its downlink's budget
    peer_senders: int = 1


@dataclass
class _RxTrain:
    count: int
    arrivals: dict[int, int]
    timer: asyncio.TimerHandle | None = None


class _Control:
    """One accepted control connection (peer agent or local client). Its
    `writer` is None while its TLS handshake is under way."""

    def __init__(self, agent: Agent, transport: Any) -> None:
        self.agent = agent
        # The raw transport, then the secured one: aborted to evict. (Any:
        # uvloop's transports are no asyncio.Transport instances.)
        self.transport = transport
        self.writer: asyncio.StreamWriter | None = None
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        self.login_by = agent.clock() + agent.config.login_timeout
        self.evicted = False
        self.tls_task: asyncio.Task[None] | None = None  # its TLS handshake, under way
        # Before the login, frames are small (a login is at most 3.1 KB): a
        # peer that is not in holds a few KiB of this agent, not MAX_FRAME.
        self.conn = probe.Connection(max_frame=LOGIN_MAX_FRAME)
        self.gate = AgentGate(agent.config.cluster_token)
        self.sessions: set[int] = set()
        self.peer_name: str | None = None

    def send(self, event: probe.Event) -> None:
        if self.writer is not None and not self.writer.is_closing():
            self.writer.write(self.conn.send(event))

    def evict(self) -> None:
        self.evicted = True
        self.transport.abort()
        if self.tls_task is not None:  # (start_tls may not notice the abort at once)
            self.tls_task.cancel()


class _TLSAccept(asyncio.BufferedProtocol):
    """An accepted control connection before its TLS handshake: holds what
    it reads (the start of the ClientHello, which uvloop may read before
    start_tls takes the socket over) for the TLS layer, and starts the
    agent's handling of it (`Agent._serve_tls`). start_tls then gives the
    socket to the TLS layer: nothing more comes here."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.early: bytearray | None = bytearray()
        self._scratch = bytearray(1 << 12)
        self.raw: Any = None  # the accepted transport
        self.lost = False

    def connection_made(self, transport: Any) -> None:
        self.raw = transport
        transport.pause_reading()  # until start_tls takes over the socket
        self.agent._accept_tls(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if len(self._scratch) < sizehint:
            self._scratch = bytearray(sizehint)
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        if self.early is None or self.raw is None:
            return
        self.early += self._scratch[:nbytes]
        self.raw.pause_reading()
        if len(self.early) > LOGIN_MAX_FRAME * 16:  # a ClientHello is a few hundred bytes
            self.raw.abort()

    def take_early(self) -> bytes:
        early, self.early = bytes(self.early or b""), None
        return early

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True  # (before start_tls took over: the handshake sees it too)


class Agent:
    """The agent daemon. `await start()`, then `await stop()` (or `async with`)."""

    def __init__(self, config: AgentConfig, *, metrics: AgentMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.name = config.name
        self.metrics = metrics
        self.clock = clock
        self._peers: dict[str, _PeerState] = {}
        self._controls: set[_Control] = set()
        self._sessions: dict[int, _Control] = {}
        self._rx: dict[tuple[int, int], _RxTrain] = {}
        self._spans: deque[tuple[int, int, int]] = deque(maxlen=32)  # (session, first, last)
        self._server: asyncio.base_events.Server | None = None
        self._udp: socket.socket | None = None
        self._tx: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = asyncio.Event()
        self._handlers: set[asyncio.Task[Any]] = set()
        self.port: int = config.port
        self.bad_datagrams = 0
        self.bad_frames = 0
        self.probe_tx_bytes = 0  # wire bytes, for subtracting from the NIC counters
        self.probe_rx_bytes = 0
        # of probe_tx_bytes, the trains not yet reported on: maybe still in
        # a shaper's queue on this host, not yet counted by the NIC
        self.probe_tx_pending = 0
        self.job_rx_bytes = 0  # wire bytes of the job's own connections, same purpose
        self.job_tx_bytes = 0
        self._job_traffic = config.job_traffic  # None once unreadable
        self.load = LoadMeter(config.load_window)
        self._job_busy = BusyMeter()  # the job's own transfers: probes take half
        self._load_task: asyncio.Task[None] | None = None
        self._progress = asyncio.Condition()
        # a line a minute at most of each (the rest counted in the next line)
        self._report_log = LogLimiter(log, burst=1, interval=60.0, clock=clock)
        self._refusal_log = LogLimiter(log, burst=1, interval=60.0, clock=clock)
        self._peer_log = LogLimiter(log, burst=1, interval=60.0, clock=clock)
        # control connections open and not logged in, oldest first
        self._unauthenticated: dict[_Control, None] = {}

    @property
    def pending_logins(self) -> int:
        """Control connections open that have not logged in (at most
        `AgentConfig.max_unauthenticated`)."""
        return len(self._unauthenticated)

    # -- lifecycle -------------------------------------------------------------

    async def __aenter__(self) -> Agent:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        c = self.config
        try:
            if c.tls is None:
                self._server = await asyncio.start_server(self._on_control, c.host, c.port)
            else:
                # TLS is started per connection rather than by start_server(ssl=):
                # a failed handshake then reaches the agent to be counted and
                # logged (asyncio drops it silently), and a connection in its
                # handshake is held to the login timeout and the cap on
                # connections not logged in, like any.
                self._server = await loop.create_server(lambda: _TLSAccept(self), c.host,
                                                        c.port)
        except OSError as exc:
            raise ConfigError(
                f"cannot listen for the agent's TCP connections on {c.host}:{c.port}: {exc}; "
                "choose another --listen address or port"
            ) from None
        self.port = self._server.sockets[0].getsockname()[1]
        family = self._server.sockets[0].family
        udp = socket.socket(family, socket.SOCK_DGRAM)
        try:
            _set_buffer(udp, socket.SO_RCVBUF, SO_RCVBUFFORCE, c.udp_rcvbuf)
            with contextlib.suppress(OSError):
                udp.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            udp.bind((c.host, self.port))
            udp.setblocking(False)
        except OSError as exc:
            udp.close()
            self._server.close()
            raise ConfigError(
                f"cannot bind the probe UDP socket on {c.host}:{self.port}: {exc}; "
                "choose another --listen port"
            ) from None
        self._udp = udp
        tx = socket.socket(family, socket.SOCK_DGRAM)
        _set_buffer(tx, socket.SO_SNDBUF, SO_SNDBUFFORCE, c.udp_rcvbuf)
        tx.setblocking(False)
        self._tx = tx
        loop.add_reader(udp.fileno(), self._on_udp_readable)
        if c.counters is not None:
            self._load_task = loop.create_task(self._load_loop(), name="agent-load")
        self.set_peers(c.peers)
        log.info("agent %s listening on %s:%d with %d peers", self.name, c.host, self.port,
                 len(c.peers))

    async def stop(self) -> None:
        self._stopping.set()
        tasks = [p.task for p in self._peers.values() if p.task is not None]
        tasks += list(self._handlers)
        if self._load_task is not None:
            tasks.append(self._load_task)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        if self._udp is not None and self._loop is not None:
            self._loop.remove_reader(self._udp.fileno())
            self._udp.close()
            self._udp = None
        if self._tx is not None:
            self._tx.close()
            self._tx = None
        for rx in self._rx.values():
            if rx.timer is not None:
                rx.timer.cancel()
        self._rx.clear()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await within(self._server.wait_closed(), 2.0)
            self._server = None

    async def wait_stopped(self) -> None:
        await self._stopping.wait()

    async def _load_loop(self) -> None:
        counters = self.config.counters
        assert counters is not None
        while not self._stopping.is_set():
            self._read_job_traffic()  # first: its bytes must not lag the NIC's
            # The probes the kernel has received, counted before its counters
            # are read: a train waiting in the socket (its agent descheduled)
            # is in the NIC's bytes and would read as load.
            # (The socket holds udp_rcvbuf: a bound on what waits, not on
            # what a flood could keep sending while it is read.)
            self._on_udp_readable(limit=self.config.udp_rcvbuf // 1024)
            try:
                reading = counters()
            except (OSError, ValueError) as exc:  # an odd /proc line: no load this round
                log.debug("agent %s: reading NIC counters: %s", self.name, exc)
                reading = None
            if reading is not None:
                rx, tx = reading
                self.load.update(self.clock(), rx, tx, self.probe_rx_bytes,
                                 self.probe_tx_bytes, self.job_rx_bytes, self.job_tx_bytes,
                                 self.probe_tx_pending)
            with contextlib.suppress(asyncio.TimeoutError):
                await within(self._stopping.wait(), self.config.load_interval)

    def _read_job_traffic(self) -> None:
        if self._job_traffic is None:
            return
        try:
            rx, tx = self._job_traffic()
        except (OSError, ValueError) as exc:
            # Without the socket counters the job's traffic counts as load: the
            # estimates are low while the job transfers, as before --job-port.
            log.warning("agent %s: cannot read the job's TCP counters (%s); its own "
                        "traffic now counts as load on this host's links", self.name, exc)
            self._job_traffic = None
            return
        if self.metrics is not None:
            self.metrics.job_traffic_bytes.labels("rx").inc(max(0, rx - self.job_rx_bytes))
            self.metrics.job_traffic_bytes.labels("tx").inc(max(0, tx - self.job_tx_bytes))
        self.job_rx_bytes, self.job_tx_bytes = rx, tx
        now = self.clock()
        busy = self._job_busy.update(now, rx + tx)
        deliveries = (self._job_traffic.deliveries
                      if isinstance(self._job_traffic, JobTrafficReader) else {})
        for st in self._peers.values():
            st.estimator.busy = busy
            rate = deliveries.get(st.addr[0])
            if rate is not None:
                # TCP payload of full frames -> the datagram payload estimates are in
                used = st.estimator.on_delivery(rate * TCP_TO_DATAGRAM, now)
                if self.metrics is not None:
                    self.metrics.delivery_samples.labels(
                        st.name, "used" if used else "refused").inc()

    def link_load(self) -> tuple[float, float] | None:
        """(downlink, uplink) load of this host in wire bit/s, probes and the job's
        own traffic excluded: the most of the last second (`LoadMeter.peak`)."""
        return self.load.peak(self.clock())

    # -- peers -----------------------------------------------------------------

    def set_peers(self, peers: Mapping[str, tuple[str, int]]) -> None:
        """Replace the peer set (flags, config file or the controller)."""
        peers = {n: a for n, a in peers.items() if n != self.name}
        for name in list(self._peers):
            st = self._peers[name]
            if name not in peers or peers[name] != st.addr:
                if st.task is not None:
                    st.task.cancel()
                    self._handlers.add(st.task)  # stop() waits for it
                    st.task.add_done_callback(self._handlers.discard)
                del self._peers[name]
                self._unexport(name)
        for name, addr in peers.items():
            known = self._peers.get(name)
            if known is None:
                est = PathEstimator(self.config.probe, clock=self.clock)
                st = self._peers[name] = _PeerState(name, addr, est)
                st.task = asyncio.get_running_loop().create_task(
                    self._peer_loop(st), name=f"agent-peer-{name}"
                )
                self._export(st)
        for st in self._peers.values():
            self._share_budget(st)
        if self.metrics is not None:
            self.metrics.peers.set(len(self._peers))

    def _share_budget(self, st: _PeerState, peer_senders: int | None = None) -> None:
        """A path's trains cross this host's uplink, which the trains to every other
        peer cross too, and the peer's downlink, which every agent probing the peer
        crosses: the path's budget is divided by the larger of the two counts, so
        that neither link carries more than the budget."""
        if peer_senders is not None:
            st.peer_senders = max(1, peer_senders)
        share = max(1, len(self._peers), st.peer_senders)
        if st.estimator.config.share != share:
            st.estimator.config = replace(st.estimator.config, share=share)
        if self.metrics is not None and self._peers.get(st.name) is st:
            self.metrics.probe_share.labels(st.name).set(share)

    def _share_bucket(self, nbytes: int) -> None:
        """A bucket learnt on one path is likely this host's uplink shaper,
        which every path's trains cross: all of them go past it. (Otherwise
        a train cleared the peer's larger downlink bucket but not this
        uplink's, and measured the downlink's rate: a path bottlenecked at
        an 80 Mbit/s uplink read 100.)"""
        for st in self._peers.values():
            st.estimator.burst_bytes = max(st.estimator.burst_bytes, nbytes)

    def path(self, peer: str) -> PathEstimator:
        """The estimator of the path to `peer` (tools, tests)."""
        st = self._peers.get(peer)
        if st is None:
            raise ConfigError(f"{peer!r} is not a peer of agent {self.name!r}")
        return st.estimator

    async def wait_trains(self, peer: str, count: int, timeout: float) -> None:
        """Wait until `count` more trains to `peer` have been measured (tools, tests)."""
        st = self._peers.get(peer)
        if st is None:
            raise ConfigError(f"{peer!r} is not a peer of agent {self.name!r}")
        target = st.trains + count

        async def reached() -> None:
            async with self._progress:
                await self._progress.wait_for(lambda: st.trains >= target)

        await within(reached(), timeout)

    def estimates(self) -> dict[str, tuple[PathEstimate, bool]]:
        now = self.clock()
        load = self.link_load()
        up = None if load is None else load[1]
        up_capacity = self.up_capacity()
        return {n: (p.estimator.snapshot(now, up, up_capacity), p.connected)
                for n, p in self._peers.items()}

    def up_capacity(self) -> float | None:
        """A lower bound of this host's uplink capacity: its fastest path's."""
        caps = [p.estimator.capacity.value for p in self._peers.values()]
        return max((c for c in caps if c is not None), default=None)

    def _estimates_event(self, request_id: int) -> probe.Estimates:
        return probe.Estimates(
            request_id,
            self.name,
            tuple(
                probe.PeerEstimate(
                    n, e.bandwidth_bps, e.capacity_bps, e.load_bps, e.rtt_s,
                    e.age_s if math.isfinite(e.age_s) else -1.0,
                    e.stale, connected, e.samples,
                )
                for n, (e, connected) in sorted(self.estimates().items())
            ),
            *self.host_load(),
        )

    def host_load(self) -> tuple[float, float]:
        """(downlink, uplink) load of this host in payload bit/s, as the
        estimates count it (probes and the job excluded); -1 until measured."""
        load = self.link_load()
        if load is None:
            return -1.0, -1.0
        ratio = self.config.probe.payload_ratio
        return load[0] * ratio, load[1] * ratio

    async def _peer_loop(self, st: _PeerState) -> None:
        c = self.config
        attempt = 0
        while not self._stopping.is_set():
            try:
                await self._probe_session(st)
                attempt = 0
            except asyncio.CancelledError:
                raise
            except (TLSError, AuthenticationError) as exc:
                # A peer whose TLS or cluster token does not match this agent's:
                # no retry fixes that, but the operator can (a line a minute).
                self._peer_log.warning("agent %s: cannot open a probe session to peer %s: %s "
                                       "(warned once a minute)", self.name, st.name, exc)
            except (TimeoutError, OSError, ProtocolError, ConnectionLost, UnicodeError,
                    ValueError) as exc:
                # (UnicodeError, ValueError: a host the resolver refuses; checked
                # where peers are given, so only as a last line here)
                log.debug("peer %s: %s", st.name, exc)
                if isinstance(exc, ProtocolError):
                    self._count_bad("frame")
                if isinstance(exc, IntegrityError):  # someone on the path: worth a warning
                    self._peer_log.warning(
                        "agent %s: closed the probe session to peer %s: %s (counted in "
                        "mlfabric_agent_bad_messages_total{kind=\"frame\"}; warned once a "
                        "minute)", self.name, st.name, exc)
            except Exception:  # a bug must not end probing of this peer for good
                log.exception("agent %s: probing peer %s failed", self.name, st.name)
            finally:
                st.connected = False
                if self.metrics is not None and self._peers.get(st.name) is st:
                    self.metrics.peer_connected.labels(st.name).set(0)
            delay = min(c.backoff_max, c.backoff_min * (2**attempt)) * random.uniform(0.8, 1.2)
            attempt = min(attempt + 1, 16)
            with contextlib.suppress(asyncio.TimeoutError):
                await within(self._stopping.wait(), delay)

    async def _probe_session(self, st: _PeerState) -> None:
        c = self.config
        host, port = st.addr
        reader, writer, conn = await open_agent(host, port, cluster_credential(c.cluster_token),
                                                self.name, c.connect_timeout, c.tls_client)
        session = int.from_bytes(os.urandom(8), "big")
        reports: dict[int, asyncio.Future[probe.TrainReport]] = {}
        pings: dict[int, float] = {}
        acked = asyncio.get_running_loop().create_future()

        async def read_loop() -> None:
            while True:
                data = await reader.read(READ_CHUNK)
                conn.receive_data(data)
                while True:
                    ev = conn.next_event()
                    if isinstance(ev, probe.NeedData):
                        break
                    if isinstance(ev, probe.ConnectionClosed):
                        raise ConnectionLost(f"peer {st.name} closed the connection")
                    if isinstance(ev, probe.HelloAck):
                        if not acked.done():
                            acked.set_result(ev.name)
                    elif isinstance(ev, probe.TrainReport):
                        fut = reports.get(ev.train)
                        if fut is not None and not fut.done() and ev.session == session:
                            fut.set_result(ev)
                    elif isinstance(ev, probe.Pong):
                        sent = pings.pop(ev.nonce, None)
                        if sent is not None:
                            st.estimator.on_rtt(time.perf_counter() - sent)
                    else:
                        raise ProtocolError(f"unexpected {type(ev).__name__} from peer agent")

        reader_task = asyncio.get_running_loop().create_task(read_loop())
        try:
            writer.write(conn.send(probe.Hello(self.name, session)))
            done, _ = await asyncio.wait(
                {acked, reader_task}, timeout=c.connect_timeout, return_when=FIRST
            )
            if acked not in done:
                if reader_task in done:
                    reader_task.result()
                raise TimeoutError(f"peer {st.name} did not answer Hello")
            st.connected = True
            if self.metrics is not None:
                self.metrics.peer_connected.labels(st.name).set(1)
                self.metrics.peer_connects.labels(st.name).inc()
            log.info("agent %s: connected to peer %s at %s:%d", self.name, st.name, host, port)
            train_id = 0
            while True:
                train_id = (train_id + 1) & 0xFFFFFFFF
                while st.estimator.delivering():
                    # the job's own flow measures the path: no trains meanwhile
                    with contextlib.suppress(asyncio.TimeoutError):
                        await within(self._stopping.wait(),
                                     st.estimator.config.delivery_window / 2)
                    if self._stopping.is_set():
                        return
                plan = st.estimator.plan(train_id)
                fut = asyncio.get_running_loop().create_future()
                reports[train_id] = fut
                sent_ns, nbytes = self._send_train(st, session, plan)
                self.probe_tx_pending += nbytes
                try:
                    done, _ = await asyncio.wait(
                        {fut, reader_task},
                        timeout=c.report_timeout + c.train_timeout,
                        return_when=FIRST,
                    )
                finally:
                    # reported on (or given up): the train has left this host
                    self.probe_tx_pending -= nbytes
                reports.pop(train_id, None)
                if reader_task in done:
                    reader_task.result()
                    raise ConnectionLost(f"peer {st.name} closed the connection")
                peer_load = peer_carried = None
                overlapped = False
                if fut in done:
                    report = fut.result()
                    m = analyze_train(plan, sent_ns, report.arrivals)
                    peer_load, peer_carried = report.rx_load_bps, report.rx_carried_bps
                    overlapped = report.overlapped
                    self._share_budget(st, report.senders)
                else:
                    m = analyze_train(plan, sent_ns, ())
                    fut.cancel()
                bucket = st.estimator.burst_bytes
                outcome = st.estimator.on_train(m, peer_down_load=peer_load,
                                                overlapped=overlapped, peer_carried=peer_carried)
                if st.estimator.burst_bytes > bucket:  # a token bucket learnt
                    self._share_bucket(st.estimator.burst_bytes)
                if len(pings) > 16:
                    pings.clear()
                self._record(st, plan, m, outcome)
                st.trains += 1
                async with self._progress:
                    self._progress.notify_all()
                if st.estimator.lost_streak >= c.max_lost_trains:
                    raise ConnectionLost(
                        f"peer {st.name} reported none of the last {c.max_lost_trains} trains"
                    )
                # jitter keeps the trains of different agents from meeting
                interval = st.estimator.interval() * random.uniform(0.85, 1.15)
                # RTT between trains, so that neither end is busy with a train
                pings[train_id] = time.perf_counter()
                writer.write(conn.send(probe.Ping(train_id, time.monotonic_ns())))
                with contextlib.suppress(asyncio.TimeoutError):
                    await within(self._stopping.wait(), interval)
                if self._stopping.is_set():
                    return
        finally:
            reader_task.cancel()
            with contextlib.suppress(BaseException):
                await reader_task
            writer.close()
            with contextlib.suppress(Exception):
                await within(writer.wait_closed(), 1.0)

    def _send_train(self, st: _PeerState, session: int,
                    plan: TrainPlan) -> tuple[list[int], int]:
        """Send one train back to back; returns the send time of each packet
        (ns) and the wire bytes sent."""
        tx = self._tx
        assert tx is not None
        addr = st.addr
        buf = probe.datagram_template(session, plan.train, plan.count, plan.size)
        sent_ns: list[int] = []
        clock = time.perf_counter_ns
        sent = 0
        for seq in range(plan.count):
            now = clock()
            probe.stamp_datagram(buf, seq, now)
            try:
                tx.sendto(buf, addr)
                sent += 1
            except (BlockingIOError, InterruptedError):
                pass  # socket buffer full: the packet counts as lost
            except OSError as exc:
                log.debug("probe to %s: %s", st.name, exc)
            sent_ns.append(now)
        nbytes = sent * (plan.size + probe.WIRE_OVERHEAD)
        self.probe_tx_bytes += nbytes
        st.estimator.record_sent(nbytes)
        if self.metrics is not None:
            self.metrics.probe_sent_bytes.labels(st.name).inc(nbytes)
            self.metrics.probe_sent_packets.labels(st.name).inc(sent)
        return sent_ns, nbytes

    def _unexport(self, name: str) -> None:
        """A removed peer's gauges disappear (its counters stay, as counters do)."""
        m = self.metrics
        if m is None:
            return
        for g in (m.available_bandwidth, m.capacity, m.path_load, m.rtt, m.estimate_age,
                  m.estimate_stale, m.probe_interval, m.peer_connected, m.probe_share):
            with contextlib.suppress(KeyError):
                g.remove(name)

    def _export(self, st: _PeerState) -> None:
        """Age and staleness are computed when Prometheus scrapes."""
        m = self.metrics
        if m is None:
            return
        est = st.estimator
        m.estimate_age.labels(st.name).set_function(lambda: est.snapshot().age_s)
        m.estimate_stale.labels(st.name).set_function(lambda: float(est.snapshot().stale))
        m.probe_interval.labels(st.name).set_function(est.steady_interval)

    def _record(self, st: _PeerState, plan: TrainPlan, m: TrainMeasurement,
                outcome: str) -> None:
        load = self.link_load()
        e = st.estimator.snapshot(local_up_load=None if load is None else load[1],
                                  up_capacity=self.up_capacity())
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "train %s->%s n=%d recv=%d queued=%d C=%s send=%s head=%s -> %s "
                "bw=%.1f cap=%.1f load=%.1f (peer: carried %.1f, load %s)", self.name,
                st.name, plan.count, m.received, m.queued, _mbit(m.capacity_bps),
                _mbit(m.send_bps), _mbit(m.head_bps), outcome, e.bandwidth_bps / 1e6,
                e.capacity_bps / 1e6, e.load_bps / 1e6, st.estimator.peer_carried / 1e6,
                _mbit(st.estimator.peer_down_load),
            )
        mt = self.metrics
        if mt is None:
            return
        mt.trains.labels(st.name, outcome).inc()
        mt.probe_lost_packets.labels(st.name).inc(m.lost)
        if math.isfinite(e.bandwidth_bps):
            mt.available_bandwidth.labels(st.name).set(e.bandwidth_bps / 8)
        if math.isfinite(e.capacity_bps):
            mt.capacity.labels(st.name).set(e.capacity_bps / 8)
        mt.path_load.labels(st.name).set(e.load_bps / 8)
        if math.isfinite(e.rtt_s):
            mt.rtt.labels(st.name).set(e.rtt_s)

    # -- receiving probes ------------------------------------------------------

    def _count_bad(self, kind: str) -> None:
        if kind == "datagram":
            self.bad_datagrams += 1
        else:
            self.bad_frames += 1
        if self.metrics is not None:
            self.metrics.bad_messages.labels(kind).inc()

    def _on_udp_readable(self, limit: int = 512) -> None:
        """Take up to `limit` datagrams waiting in the probe socket (a flood
        cannot hold the loop)."""
        udp = self._udp
        if udp is None:
            return
        for _ in range(limit):
            try:
                data, anc, _flags, _addr = udp.recvmsg(READ_CHUNK, 64)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.debug("probe socket: %s", exc)
                return
            t_ns = None
            for level, kind, cdata in anc:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                    sec, nsec = _TIMESPEC.unpack_from(cdata)
                    t_ns = sec * 1_000_000_000 + nsec
            if t_ns is None:
                t_ns = time.time_ns()
            self._on_datagram(data, t_ns)

    def _on_datagram(self, data: bytes, t_ns: int) -> None:
        try:
            pkt = probe.decode_datagram(data)
        except ProtocolError:
            self._count_bad("datagram")
            return
        ctl = self._sessions.get(pkt.session)
        if ctl is None:
            self._count_bad("datagram")
            return
        self.probe_rx_bytes += len(data) + probe.WIRE_OVERHEAD
        if self.metrics is not None and ctl.peer_name in self._peers:
            self.metrics.probe_received_bytes.labels(ctl.peer_name).inc(
                len(data) + probe.WIRE_OVERHEAD
            )
        key = (pkt.session, pkt.train)
        rx = self._rx.get(key)
        if rx is None:
            if len(self._rx) > 256:  # a flood of bogus trains: forget the oldest
                self._finish_train(next(iter(self._rx)))
            rx = self._rx[key] = _RxTrain(pkt.count, {})
            assert self._loop is not None
            rx.timer = self._loop.call_later(
                self.config.train_timeout, self._finish_train, key
            )
        if pkt.count != rx.count:
            self._count_bad("datagram")
            return
        rx.arrivals.setdefault(pkt.seq, t_ns)
        if pkt.seq == rx.count - 1 or len(rx.arrivals) == rx.count:
            self._finish_train(key)

    def _finish_train(self, key: tuple[int, int]) -> None:
        rx = self._rx.pop(key, None)
        if rx is None:
            return
        if rx.timer is not None:
            rx.timer.cancel()
        ctl = self._sessions.get(key[0])
        if ctl is None or not rx.arrivals:
            return
        arrivals = tuple(sorted(rx.arrivals.items()))
        load = self.link_load()
        down = math.nan if load is None else load[0]
        carried = self.load.carried(self.clock())
        t0, t1 = min(rx.arrivals.values()), max(rx.arrivals.values())
        overlapped = any(
            s != key[0] and a0 <= t1 and a1 >= t0 for s, a0, a1 in self._spans
        ) or any(
            k[0] != key[0] and other.arrivals and min(other.arrivals.values()) <= t1
            for k, other in self._rx.items()
        )
        self._spans.append((key[0], t0, t1))
        senders = min(len({c.peer_name for c in self._sessions.values()}), 0xFFFF)
        ctl.send(probe.TrainReport(key[0], key[1], rx.count, down, overlapped, arrivals,
                                   senders, carried))

    # -- control connections ---------------------------------------------------

    def _admit(self, transport: Any) -> _Control:
        """A new control connection, counted among those not logged in (past
        the cap, the oldest of them is closed to make room)."""
        if len(self._unauthenticated) >= self.config.max_unauthenticated:
            oldest = next(iter(self._unauthenticated))
            del self._unauthenticated[oldest]
            self._refused(oldest, "evicted", f"{self.config.max_unauthenticated} control "
                          "connections were not logged in (the cap)")
            oldest.evict()
        ctl = _Control(self, transport)
        self._controls.add(ctl)
        self._unauthenticated[ctl] = None
        return ctl

    def _forget(self, ctl: _Control) -> None:
        self._unauthenticated.pop(ctl, None)
        for s in ctl.sessions:
            self._sessions.pop(s, None)
        self._controls.discard(ctl)

    async def _on_control(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        """A plain TCP control connection."""
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        ctl = self._admit(writer.transport)
        ctl.writer = writer
        try:
            await self._serve_control(ctl, reader, writer)
        finally:
            if task is not None:
                self._handlers.discard(task)

    def _accept_tls(self, accept: _TLSAccept) -> None:
        """A control connection to secure first (`_TLSAccept.connection_made`)."""
        assert accept.raw is not None
        ctl = self._admit(accept.raw)
        assert self._loop is not None
        ctl.tls_task = task = self._loop.create_task(self._serve_tls(ctl, accept))
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    async def _serve_tls(self, ctl: _Control, accept: _TLSAccept) -> None:
        """The TLS handshake, within the login timeout; then the connection is
        served as a plain one is. A failed handshake is refused: counted in
        agent_tls_refused_total and logged once a minute."""
        c = self.config
        assert c.tls is not None and accept.raw is not None
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        try:
            secured = await within(accept_tls(accept.raw, protocol, c.tls, accept.take_early),
                                   max(0.0, ctl.login_by - self.clock()))
        except TimeoutError:
            accept.raw.abort()
            if not ctl.evicted:
                self._refused(ctl, "login-timeout", f"no TLS handshake within "
                              f"{c.login_timeout:g} s")
            self._forget(ctl)
            return
        except asyncio.CancelledError:  # evicted, or the agent stopping
            accept.raw.abort()
            self._forget(ctl)
            return
        except Exception as exc:  # SSLError, ConnectionError, the transport closed by us
            accept.raw.abort()
            if not ctl.evicted:  # else counted and logged already
                if self.metrics is not None:
                    self.metrics.tls_refused.inc()
                self._refusal_log.warning(
                    "agent %s: refused a control connection from %s: TLS handshake failed: "
                    "%s (mlfabric_agent_tls_refused_total; warned once a minute)", self.name,
                    ctl.peer, tls_failure(exc))
            self._forget(ctl)
            return
        if secured is None or ctl.evicted or accept.lost:
            # closed during the handshake (by us: evicted, the agent stopping)
            (secured or accept.raw).abort()
            self._forget(ctl)
            return
        protocol.connection_made(secured)  # (start_tls does not call it)
        ctl.transport, ctl.tls_task = secured, None
        ctl.writer = writer = asyncio.StreamWriter(secured, protocol, reader, loop)
        await self._serve_control(ctl, reader, writer)

    async def _serve_control(self, ctl: _Control, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        """The login, then the client's requests, until either side closes."""
        try:
            while True:
                if ctl.gate.role is None:
                    # not logged in: bounded, so idle connections do not pile up
                    data = await within(reader.read(READ_CHUNK),
                                        max(0.0, ctl.login_by - self.clock()))
                else:
                    data = await reader.read(READ_CHUNK)
                ctl.conn.receive_data(data)
                while True:
                    ev = ctl.conn.next_event()
                    if isinstance(ev, probe.NeedData):
                        break
                    if isinstance(ev, probe.ConnectionClosed):
                        return
                    step = ctl.gate.on_event(ev)
                    if step.keys is not None:  # logged in: every frame on carries its MAC
                        ctl.conn.protect(*step.keys)
                    if step.send is not None:
                        ctl.send(step.send)
                    if step.refused is not None:
                        self._refused(ctl, step.refused, step.why)
                        await within(writer.drain(), 1.0)
                        return
                    if ctl.gate.role is not None and ctl in self._unauthenticated:
                        del self._unauthenticated[ctl]  # logged in
                        ctl.conn.max_frame = probe.MAX_FRAME
                    if step.serve:
                        self._handle(ctl, ev)
                await writer.drain()
        except TimeoutError:
            self._refused(ctl, "login-timeout", "no login within "
                          f"{self.config.login_timeout:g} s")
        except IntegrityError as exc:
            # Altered, injected or replayed by someone on the path: nothing it
            # carried was served; the client is told why, under its MAC.
            self._refused(ctl, "integrity", str(exc))
            ctl.send(probe.Error(0, str(exc)[:200]))
        except ProtocolError as exc:
            self._count_bad("frame")
            if isinstance(exc, NotMlfabric) and exc.head.startswith(b"\x16\x03"):
                # a TLS ClientHello: the client has TLS settings, this port has none
                self._refusal_log.warning(
                    "agent %s: refused a TLS client at %s: this agent's control port is "
                    "plain TCP (start it with --tls-cert, --tls-key and --tls-ca to serve "
                    "TLS; mlfabric_agent_bad_messages_total{kind=\"frame\"}; warned once a "
                    "minute)", self.name, ctl.peer)
            else:
                log.info("agent %s: dropping a control connection: %s", self.name, exc)
            # Said before closing, in the agent's own frames: a client that
            # took this port for a server's or a controller's can tell what
            # answered it (wire.roles.foreign_peer).
            ctl.send(probe.Error(0, str(exc)[:200]))
        except (ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            self._forget(ctl)
            writer.close()

    def _refused(self, ctl: _Control, reason: str, why: str) -> None:
        """A control connection refused before or at the login, or a request its
        credential does not allow: counted, logged at most once a minute."""
        if self.metrics is not None:
            self.metrics.refused.labels(reason).inc()
        self._refusal_log.warning("agent %s: refused a control connection from %s (%s) (%s: "
                                  "%s; mlfabric_agent_refused_total; warned once a minute)",
                                  self.name, ctl.gate.client, ctl.peer, reason, why)

    def _handle(self, ctl: _Control, ev: probe.Event) -> None:
        if isinstance(ev, probe.Hello):
            ctl.sessions.add(ev.session)
            ctl.peer_name = ev.name
            self._sessions[ev.session] = ctl
            ctl.send(probe.HelloAck(self.name))
        elif isinstance(ev, probe.Ping):
            ctl.send(probe.Pong(ev.nonce, ev.sent_ns))
        elif isinstance(ev, probe.GetEstimates):
            ctl.send(self._estimates_event(ev.request_id))
        elif isinstance(ev, probe.TransferReport):
            st = self._peers.get(ev.peer)
            problem = None if st is None else st.estimator.passive_problem(ev.nbytes,
                                                                          ev.seconds)
            result = ("unknown_peer" if st is None else "refused" if problem is not None
                      else "accepted")
            if self.metrics is not None:
                self.metrics.transfer_reports.labels(result).inc()
            if problem is not None:
                # Never averaged in: one made-up report would otherwise set the
                # path's estimate for as long as passive samples count.
                self._report_log.warning(
                    "refused a transfer report for %s from %s: %s (counted in "
                    "mlfabric_agent_transfer_reports_total{result=\"refused\"}; warned once a "
                    "minute)", ev.peer, ctl.peer_name or "a client", problem)
            elif st is not None:
                st.estimator.on_passive(ev.nbytes, ev.seconds)
        elif isinstance(ev, probe.SetPeers):
            try:
                peers = {}
                for p in ev.peers:
                    if not p.name or not 0 < p.port <= 65535:
                        raise ConfigError(f"peer {p!r} needs a name and a port in 1..65535")
                    if not valid_host(p.host):
                        raise ConfigError(f"peer {p.name!r}: {p.host!r} is no IP address or "
                                          f"host name")
                    peers[p.name] = (p.host, p.port)
                self.set_peers(peers)
            except ConfigError as exc:
                ctl.send(probe.Error(ev.request_id, str(exc)))
            else:
                ctl.send(probe.Ack(ev.request_id))
        else:
            raise ProtocolError(f"a client may not send {type(ev).__name__} to an agent")


def _mbit(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.1f}"


# --- clients ------------------------------------------------------------------


class AgentClient:
    """Talk to an agent: read its estimates, report transfers, set its peers.
    What a client may do depends on its credential (wire.agent_auth)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 timeout: float, conn: probe.Connection) -> None:
        self._reader = reader
        self._writer = writer
        self._conn = conn
        self._next_id = 0
        self.timeout = timeout

    @classmethod
    async def connect(cls, host: str, port: int, credential: AgentCredential,
                      timeout: float = 2.0, name: str = "client",
                      tls: ssl.SSLContext | None = None) -> AgentClient:
        """Dial and log in. `tls`: a client context for an agent started with
        --tls-* (None: the process's own, `transport.tls.use_for_process`,
        else plain TCP)."""
        reader, writer, conn = await open_agent(host, port, credential, name, timeout, tls)
        return cls(reader, writer, timeout, conn)

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(Exception):
            await within(self._writer.wait_closed(), self.timeout)

    async def __aenter__(self) -> AgentClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _request(self, event: probe.Event) -> probe.Event:
        self._writer.write(self._conn.send(event))
        answer = await within(self._read_event(), self.timeout)
        if isinstance(answer, probe.Error) and answer.request_id == 0:
            # about the connection, not the request: the agent closes it
            raise ProtocolError(f"the agent closed the connection: {answer.message}")
        return answer

    async def _read_event(self) -> probe.Event:
        while True:
            ev = self._conn.next_event()
            if isinstance(ev, probe.ConnectionClosed):
                raise ConnectionLost("the agent closed the connection")
            if not isinstance(ev, probe.NeedData):
                return ev
            self._conn.receive_data(await self._reader.read(READ_CHUNK))

    def _rid(self) -> int:
        self._next_id = self._next_id % 0xFFFFFFFF + 1  # 1..2^32-1: 0 is the connection's
        return self._next_id

    async def estimates(self) -> probe.Estimates:
        ev = await self._request(probe.GetEstimates(self._rid()))
        if not isinstance(ev, probe.Estimates):
            raise ProtocolError(f"expected Estimates, got {type(ev).__name__}")
        return ev

    async def report_transfer(self, peer: str, nbytes: int, seconds: float) -> None:
        self._writer.write(self._conn.send(probe.TransferReport(peer, nbytes, seconds)))
        await within(self._writer.drain(), self.timeout)

    async def set_peers(self, peers: Mapping[str, tuple[str, int]]) -> None:
        ev = await self._request(
            probe.SetPeers(self._rid(), tuple(probe.PeerAddress(n, h, p)
                                              for n, (h, p) in peers.items()))
        )
        if isinstance(ev, probe.Error):
            raise ConfigError(f"agent refused the peer list: {ev.message}")
        if not isinstance(ev, probe.Ack):
            raise ProtocolError(f"expected Ack, got {type(ev).__name__}")


def query_estimates(host: str, port: int, credential: AgentCredential,
                    timeout: float = 2.0, tls: ssl.SSLContext | None = None
                    ) -> probe.Estimates:
    """Blocking one-shot: connect, log in, read the estimates, close (for tools
    and tests). `tls` as with `AgentClient.connect`."""
    s, conn = open_agent_blocking(host, port, credential, "query", timeout, tls)
    with s:
        s.sendall(conn.send(probe.GetEstimates(1)))
        while True:
            ev = conn.next_event()
            if isinstance(ev, probe.Estimates):
                return ev
            if isinstance(ev, probe.ConnectionClosed):
                raise ConnectionLost(f"agent at {host}:{port} closed the connection")
            if isinstance(ev, probe.Error):
                raise ProtocolError(f"agent at {host}:{port}: {ev.message}")
            if not isinstance(ev, probe.NeedData):
                raise ProtocolError(f"expected Estimates, got {type(ev).__name__}")
            conn.receive_data(s.recv(READ_CHUNK))
