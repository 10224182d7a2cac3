"""An emulated multi-host cluster of Linux network namespaces with shaped links.

The network model of the design brief is a big switch: host h has an uplink
(capacity ``up[h]``) into the switch and a downlink (``down[h]``) out of it.
The testbed builds exactly that::

    netns mlfabric-<run>-h0         netns mlfabric-<run>-sw          netns mlfabric-<run>-h1
    mf<run>h0 (198.18.k.1/24) <-veth-> mf<run>s0 --+-- bridge mf<run>br
      egress: uplink shaping           egress: downlink shaping of h0
                                       mf<run>s1 --+  <-veth->  mf<run>h1 (198.18.k.2/24)

* Every host and the switch get their own namespace; nothing is created in,
  or changed in, the root namespace. Addresses come from the benchmarking
  range 198.18.0.0/15 and there is no default route, so no traffic leaves.
* Shaping is a ``tbf`` qdisc with a small bucket (``max(2 frames, 1 ms at
  the rate)``; a frame is the MTU plus 14 B of Ethernet header) so that
  even short packet trains see the shaped rate (``burst`` sets another
  bucket, as real shapers and cloud rate limiters have: "64KB", "10ms" at
  the rate), and a moderate queue
  (``queue_ms`` at the rate, at least 64 KiB) so that TCP reaches it.
  ``delay_ms`` adds one-way latency on every uplink with a ``netem`` root
  and the ``tbf`` as its child (kernels without sch_netem get a
  ConfigError). GSO is capped at one segment on every port so the qdisc
  sees wire-size packets. ``mtu`` is 1500 by default; 9000 (jumbo frames, as
  many training clusters run) costs the kernel about a fifth of the CPU per
  byte, which matters when a 2-core machine emulates a whole cluster. Live
  changes (:meth:`Testbed.set_rate`, schedules) are one netlink message each
  (well under a millisecond), with `tc` as the fallback.
* Teardown (``close()``, ``__exit__``, atexit; Ctrl-C, SIGTERM and SIGHUP
  unwind to it) stops schedules and cross-traffic, kills every process in the
  namespaces and deletes them.
  ``mlfabric testbed down`` (:func:`cleanup`) removes what a killed run left.

Root is needed (:func:`require_root`). Example::

    with Testbed(hosts=3, rate_mbit=100) as tb:
        h0, h1 = tb.host("h0"), tb.host("h1")
        with h1.enter():            # this thread now lives in h1's namespace
            srv = socket.create_server((h1.ip, 5000))
        proc = tb.popen(h0, ["python", "client.py", h1.ip])
        tb.set_rate("h1", down=20)  # live, takes effect at once
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import logging
import math
import os
import re
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, MlfabricError
from . import traffic
from .traffic import CrossTraffic

log = logging.getLogger(__name__)

PREFIX = "mlfabric-"
NETNS_DIR = "/var/run/netns"
STATE_DIR = "/run/mlfabric"
ETHERNET_HEADER = 14
DEFAULT_MTU = 1500  # Ethernet's
MTU_FRAME = DEFAULT_MTU + ETHERNET_HEADER  # bytes on the wire per full frame (the qdisc's view)
MTU_RANGE = (1280, 9000)  # IPv6's minimum to the usual jumbo frame
SUBNET_BASE = (198, 18)  # 198.18.0.0/15: RFC 2544 benchmarking range
CLONE_NEWNET = 0x40000000
_NAME_RE = re.compile(r"^mlfabric-([0-9a-f]{4,16})-(h\d+|sw)$")


class TestbedError(MlfabricError):
    """A command that builds or changes the testbed failed; the message has its output."""

    __test__ = False  # not a pytest test class


# --------------------------------------------------------------------------- root check


def require_root(ip: str = "ip") -> None:
    """Raise ConfigError unless this process can create network namespaces."""
    if os.geteuid() != 0:
        raise ConfigError(
            "the mlfabric testbed needs root: it creates network namespaces, veth pairs, "
            f"a bridge and tc qdiscs (running as uid {os.geteuid()}); run it with sudo, "
            "or in CI as root"
        )
    try:
        res = subprocess.run(
            [ip, "netns", "list"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(
            f"the mlfabric testbed needs iproute2 (`{ip} netns`), which failed: {exc}; "
            "install iproute2 and run as root (sudo, or CI as root)"
        ) from exc
    if res.returncode != 0:
        raise ConfigError(
            f"`{ip} netns list` failed ({res.stderr.strip()}): the testbed needs network "
            "namespace support and root; run with sudo, or in CI as root"
        )


# --------------------------------------------------------------------------- tc parameters


@dataclass(frozen=True)
class Burst:
    """A token bucket's depth: bytes, or seconds at the link's rate."""

    nbytes: int | None = None
    seconds: float | None = None

    @classmethod
    def parse(cls, text: str) -> Burst:
        """ "64KB", "100KB", "1500B", "10ms"; a ConfigError that says why otherwise."""
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|B|KB|KiB|MB|MiB)\s*", str(text))
        if m is None:
            raise ConfigError(f"a burst is bytes (64KB, 1500B) or time at the rate (10ms), "
                              f"got {text!r}")
        value, unit = float(m.group(1)), m.group(2)
        if unit in ("ms", "s"):
            seconds = value / 1000 if unit == "ms" else value
            if not 0 < seconds <= 1:
                raise ConfigError(f"a burst of {text!r} is not in (0, 1 s]")
            return cls(seconds=seconds)
        scale = {"B": 1, "KB": 1000, "KiB": 1024, "MB": 1000**2, "MiB": 1024**2}[unit]
        nbytes = int(value * scale)
        if not 0 < nbytes <= 64 * 1024**2:
            raise ConfigError(f"a burst of {text!r} is not in (0, 64 MiB]")
        return cls(nbytes=nbytes)

    def __str__(self) -> str:
        return f"{self.nbytes}B" if self.nbytes is not None else f"{(self.seconds or 0) * 1000:g}ms"


@dataclass(frozen=True)
class Shaping:
    """tbf parameters for one link direction, derived from the rate."""

    rate_mbit: float
    burst_bytes: int
    limit_bytes: int

    @classmethod
    def for_rate(cls, rate_mbit: float, queue_ms: float = 50.0,
                 frame_bytes: int = MTU_FRAME, burst: Burst | None = None) -> Shaping:
        rate_bytes = rate_mbit * 1e6 / 8
        depth = burst or Burst(seconds=0.001)
        # tbf drops a packet larger than its bucket, so it holds two frames at least.
        burst_bytes = max(2 * frame_bytes, depth.nbytes if depth.nbytes is not None else int(
            rate_bytes * (depth.seconds or 0.0)))
        limit = max(64 * 1024, int(rate_bytes * queue_ms / 1000), 2 * burst_bytes)
        return cls(rate_mbit, burst_bytes, limit)

    def tbf_args(self) -> list[str]:
        rate_kbit = max(1, round(self.rate_mbit * 1000))
        return [
            "tbf",
            "rate",
            f"{rate_kbit}kbit",
            "burst",
            str(self.burst_bytes),
            "limit",
            str(self.limit_bytes),
        ]


def check_mtu(mtu: Any) -> None:
    """A ConfigError that says why, unless `mtu` is a link MTU the testbed builds."""
    lo, hi = MTU_RANGE
    if isinstance(mtu, bool) or not isinstance(mtu, int) or not lo <= mtu <= hi:
        raise ConfigError(
            f"mtu must be an integer number of bytes from {lo} to {hi} "
            f"({DEFAULT_MTU} is Ethernet's, 9000 a jumbo frame), got {mtu!r}"
        )


def _check_rate(what: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{what} must be a number of Mbit/s or None, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{what} must be a finite rate > 0 Mbit/s, got {value!r}")
    return float(value)


# --------------------------------------------------------------------------- setns


_libc: ctypes.CDLL | None = None


def _setns(fd: int, nstype: int = CLONE_NEWNET) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def enter_netns(path: str) -> Iterator[None]:
    """Move the calling thread into the network namespace at ``path``, and back after.

    Sockets created inside stay in that namespace after the block ends. Other
    threads are unaffected; threads started inside inherit the namespace.
    """
    target = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        orig = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except BaseException:
        os.close(target)
        raise
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(orig)
    finally:
        os.close(target)
        os.close(orig)


# --------------------------------------------------------------------------- netlink

# A live rate change is one RTM_NEWQDISC message on a netlink socket kept open
# in the namespace: no fork/exec of `tc`, so it lands in well under a
# millisecond even on a loaded machine (spawning `tc` took 10-90 ms there).
_RTM_NEWQDISC = 36
_NLMSG_ERROR = 2
_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_REPLACE, _NLM_F_CREATE = 0x1, 0x4, 0x100, 0x400
_TCA_KIND, _TCA_OPTIONS = 1, 2
_TCA_TBF_PARMS, _TCA_TBF_BURST = 1, 6
_NLA_F_NESTED = 0x8000
_TC_LINKLAYER_ETHERNET = 1
_TC_H_ROOT = 0xFFFFFFFF


def _nla(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def tbf_request(ifindex: int, parent: int, handle: int, shaping: Shaping, seq: int) -> bytes:
    """The netlink message `tc qdisc replace dev <ifindex> ... tbf rate R burst B limit L` sends.

    The rate spec says "Ethernet link layer", so the kernel needs no rate table,
    and TCA_TBF_BURST gives the bucket in bytes.
    """
    rate = max(1, round(shaping.rate_mbit * 1000)) * 125  # bytes/s, as `tc ... rate <n>kbit`
    if not 0 < rate < 2**32:
        raise ValueError(f"rate {shaping.rate_mbit} Mbit/s does not fit a 32-bit tbf rate")
    # struct tc_ratespec: cell_log, linklayer, overhead, cell_align, mpu, rate (bytes/s)
    ratespec = struct.pack("=BBHhHI", 0, _TC_LINKLAYER_ETHERNET, 0, -1, 0, rate)
    buffer_ticks = 0  # superseded by TCA_TBF_BURST
    qopt = ratespec + bytes(12) + struct.pack("=III", shaping.limit_bytes, buffer_ticks, 0)
    options = _nla(_TCA_TBF_PARMS, qopt) + _nla(
        _TCA_TBF_BURST, struct.pack("=I", shaping.burst_bytes)
    )
    attrs = _nla(_TCA_KIND, b"tbf\0") + _nla(_TCA_OPTIONS | _NLA_F_NESTED, options)
    tcmsg = struct.pack("=BxxxiIII", socket.AF_UNSPEC, ifindex, handle, parent, 0)
    flags = _NLM_F_REQUEST | _NLM_F_ACK | _NLM_F_REPLACE | _NLM_F_CREATE
    body = tcmsg + attrs
    return struct.pack("=IHHII", 16 + len(body), _RTM_NEWQDISC, flags, seq, 0) + body


def _netlink_call(sock: socket.socket, request: bytes, seq: int) -> None:
    """Send one request and wait (bounded by the socket timeout) for its ack."""
    sock.send(request)
    while True:
        data = sock.recv(65536)
        offset = 0
        while offset + 16 <= len(data):
            length, kind, _flags, rseq, _pid = struct.unpack_from("=IHHII", data, offset)
            if kind == _NLMSG_ERROR and rseq == seq:
                (error,) = struct.unpack_from("=i", data, offset + 16)
                if error:
                    raise OSError(-error, f"netlink RTM_NEWQDISC: {os.strerror(-error)}")
                return
            offset += max(16, (length + 3) & ~3)


# --------------------------------------------------------------------------- hosts


@dataclass(eq=False)
class Host:
    """One emulated host: its namespace, NIC and address."""

    name: str  # "h0", "h1", ...
    index: int
    netns: str  # namespace name, e.g. "mlfabric-3fa2-h0"
    ip: str
    ifname: str  # the NIC inside the host namespace
    switch_port: str  # its peer, attached to the bridge in the switch namespace
    up_mbit: float | None  # current uplink rate (None: unshaped)
    down_mbit: float | None  # current downlink rate
    _testbed: Testbed = field(repr=False)

    @property
    def netns_path(self) -> str:
        return os.path.join(self._testbed.netns_dir, self.netns)

    def enter(self) -> contextlib.AbstractContextManager[None]:
        """``with host.enter():`` runs the calling thread inside this host's namespace."""
        return enter_netns(self.netns_path)

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed with ``ip netns exec <netns>``."""
        return [self._testbed.ip, "netns", "exec", self.netns, *argv]

    def popen(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in this host; see :meth:`Testbed.popen`."""
        return self._testbed.popen(self, argv, **kw)


HostRef = Host | str | int


# --------------------------------------------------------------------------- schedules


@dataclass(frozen=True)
class SetRate:
    """Schedule action: :meth:`Testbed.set_rate` (None leaves a direction unchanged)."""

    host: str | int
    up: float | None = None
    down: float | None = None


@dataclass(frozen=True)
class StartTraffic:
    """Schedule action: start cross-traffic; the handle is ``schedule.handles[key]``."""

    key: str
    src: str | int
    dst: str | int
    rate_mbit: float | None = None
    proto: str = "tcp"
    duration: float | None = None


@dataclass(frozen=True)
class StopTraffic:
    """Schedule action: stop the cross-traffic started under ``key``."""

    key: str


Action = SetRate | StartTraffic | StopTraffic | Callable[[], Any]


@dataclass(frozen=True)
class Applied:
    """One action the schedule carried out: when planned, when done, what, and any error."""

    planned: float  # seconds after the schedule started
    started: float  # seconds after the schedule started, when the action began
    finished: float
    action: Any
    error: BaseException | None = None


class Schedule:
    """Actions applied at given times by one background thread; see :meth:`Testbed.schedule`."""

    def __init__(self, testbed: Testbed, events: Sequence[tuple[float, Action]]) -> None:
        self._tb = testbed
        self.events = sorted(events, key=lambda e: e[0])
        self.handles: dict[str, CrossTraffic] = {}
        self.applied: list[Applied] = []
        self._cancel = threading.Event()
        self._done = threading.Event()
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="mlfabric-schedule", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for t, action in self.events:
                delay = self.t0 + t - time.monotonic()
                if delay > 0 and self._cancel.wait(delay):
                    return
                if self._cancel.is_set():
                    return
                started = time.monotonic() - self.t0
                error: BaseException | None = None
                try:
                    self._apply(action)
                except Exception as exc:
                    error = exc
                    log.error("testbed schedule: %r at t=%.3f s failed: %s", action, t, exc)
                self.applied.append(Applied(t, started, time.monotonic() - self.t0, action, error))
                if error is not None:
                    return
        finally:
            self._done.set()

    def _apply(self, action: Action) -> None:
        tb = self._tb
        if isinstance(action, SetRate):
            tb.set_rate(action.host, up=action.up, down=action.down)
        elif isinstance(action, StartTraffic):
            self.handles[action.key] = tb.cross_traffic(
                action.src,
                action.dst,
                rate_mbit=action.rate_mbit,
                proto=action.proto,
                duration=action.duration,
            )
        elif isinstance(action, StopTraffic):
            self.handles[action.key].stop()
        else:
            action()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def errors(self) -> list[BaseException]:
        return [a.error for a in self.applied if a.error is not None]

    def wait(self, timeout: float) -> bool:
        """Wait until every action ran (or the schedule stopped); raise the first error."""
        finished = self._done.wait(timeout)
        if self.errors:
            raise self.errors[0]
        return finished

    def cancel(self, timeout: float = 5.0) -> None:
        """Stop before the next action (one under way finishes). Traffic keeps running."""
        self._cancel.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)


# --------------------------------------------------------------------------- process registry

_live: set[Testbed] = set()
_live_lock = threading.Lock()
_prev_handlers: dict[int, Any] = {}  # signals we took over while testbeds are live
_atexit_registered = False
# Ctrl-C already raises KeyboardInterrupt; these would end the process without cleanup.
_UNWIND_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _on_signal(signum: int, frame: Any) -> None:
    # Unwind the main thread like Ctrl-C does, so `with` blocks and atexit tear down.
    raise SystemExit(128 + signum)


def _register(tb: Testbed) -> None:
    global _atexit_registered
    with _live_lock:
        _live.add(tb)
        if not _atexit_registered:
            atexit.register(_close_all)
            _atexit_registered = True
        if threading.current_thread() is threading.main_thread():
            for sig in _UNWIND_SIGNALS:
                if sig not in _prev_handlers and signal.getsignal(sig) == signal.SIG_DFL:
                    _prev_handlers[sig] = signal.signal(sig, _on_signal)


def _unregister(tb: Testbed) -> None:
    with _live_lock:
        _live.discard(tb)
        if not _live and threading.current_thread() is threading.main_thread():
            for sig, prev in list(_prev_handlers.items()):
                if signal.getsignal(sig) is _on_signal:
                    signal.signal(sig, prev)
                del _prev_handlers[sig]


def _close_all() -> None:
    with _live_lock:
        live = list(_live)
    for tb in live:
        tb.close()


def _proc_starttime(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[19])


# --------------------------------------------------------------------------- the testbed


class Testbed:
    """N hosts in their own network namespaces, joined by a bridge in a switch namespace.

    ``rate_mbit`` shapes every uplink and downlink; ``up_mbit`` / ``down_mbit``
    override one direction for all hosts, and ``rates={"h0": (up, down)}`` one
    host (None in a tuple: the default). A rate of None leaves links unshaped.
    ``delay_ms`` adds one-way latency to every uplink (needs sch_netem).
    ``mtu`` is every link's MTU (1280 to 9000 bytes).

    The namespaces exist between :meth:`start` (or ``__enter__``) and
    :meth:`close` (or ``__exit__``); the constructor only checks the settings.
    """

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        hosts: int = 3,
        rate_mbit: float | None = 100.0,
        delay_ms: float = 0.0,
        up_mbit: float | None = None,
        down_mbit: float | None = None,
        rates: Mapping[str, tuple[float | None, float | None]] | None = None,
        *,
        queue_ms: float = 50.0,
        burst: str | Burst = "1ms",
        mtu: int = DEFAULT_MTU,
        run_id: str | None = None,
        subnet: int | None = None,
        ip: str = "ip",
        tc: str = "tc",
        netns_dir: str = NETNS_DIR,
        state_dir: str = STATE_DIR,
        python: str = sys.executable,
    ) -> None:
        if isinstance(hosts, bool) or not isinstance(hosts, int) or not 1 <= hosts <= 253:
            raise ConfigError(f"hosts must be an integer from 1 to 253, got {hosts!r}")
        rate = _check_rate("rate_mbit", rate_mbit)
        up = _check_rate("up_mbit", up_mbit)
        down = _check_rate("down_mbit", down_mbit)
        if isinstance(delay_ms, bool) or not isinstance(delay_ms, (int, float)):
            raise ConfigError(f"delay_ms must be a number of milliseconds, got {delay_ms!r}")
        if not (math.isfinite(delay_ms) and delay_ms >= 0):
            raise ConfigError(f"delay_ms must be >= 0, got {delay_ms!r}")
        if not (math.isfinite(queue_ms) and queue_ms > 0):
            raise ConfigError(f"queue_ms must be > 0, got {queue_ms!r}")
        check_mtu(mtu)
        if run_id is not None and not re.fullmatch(r"[0-9a-f]{4}", run_id):
            raise ConfigError(f"run_id must be 4 lowercase hex digits, got {run_id!r}")
        if subnet is not None and not 0 <= subnet <= 511:
            raise ConfigError(f"subnet must be 0..511 (a /24 in 198.18.0.0/15), got {subnet!r}")
        names = [f"h{i}" for i in range(hosts)]
        self._link_rates: dict[str, tuple[float | None, float | None]] = {}
        for name in names:
            default = (up if up is not None else rate, down if down is not None else rate)
            self._link_rates[name] = default
        for name, pair in (rates or {}).items():
            if name not in self._link_rates:
                raise ConfigError(f"rates names host {name!r}, but the hosts are {names}")
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise ConfigError(f"rates[{name!r}] must be (up_mbit, down_mbit), got {pair!r}")
            r_up = _check_rate(f"rates[{name!r}] up", pair[0])
            r_down = _check_rate(f"rates[{name!r}] down", pair[1])
            d_up, d_down = self._link_rates[name]
            self._link_rates[name] = (
                r_up if r_up is not None else d_up,
                r_down if r_down is not None else d_down,
            )
        self.n_hosts = hosts
        self.delay_ms = float(delay_ms)
        self.queue_ms = float(queue_ms)
        self.burst = burst if isinstance(burst, Burst) else Burst.parse(burst)
        self.mtu = mtu
        self.ip = ip
        self.tc = tc
        self.netns_dir = netns_dir
        self.state_dir = state_dir
        self.python = python
        self._run_id = run_id
        self._subnet = subnet
        self.run_id = ""
        self.hosts: list[Host] = []
        self.switch_netns = ""
        self.bridge = ""
        self._procs: list[subprocess.Popen[Any]] = []
        self._traffic: list[CrossTraffic] = []
        self._schedules: list[Schedule] = []
        self._lock = threading.RLock()
        self._started = False
        self._closed = False
        self._created: list[str] = []  # namespaces created, in order
        self._netlink: dict[str, socket.socket] = {}  # per namespace, for set_rate
        self._ifindex: dict[tuple[str, str], int] = {}
        self._nl_seq = 0
        self._nl_broken = False  # fall back to `tc` after a netlink failure

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Testbed:
        if not self._started:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def frame_bytes(self) -> int:
        """Bytes on the wire of one full frame: what tbf meters."""
        return self.mtu + ETHERNET_HEADER

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("up" if self._started else "new")
        return f"<Testbed run={self.run_id or '?'} hosts={self.n_hosts} {state}>"

    def start(self) -> Testbed:
        """Create namespaces, bridge, veth pairs, addresses and shaping. Idempotent."""
        if self._started:
            return self
        if self._closed:
            raise ConfigError("this Testbed was closed; create a new one")
        require_root(self.ip)
        self._started = True
        _register(self)
        try:
            self._pick_names()
            self._write_state()
            self._build()
        except BaseException:
            self.close()
            raise
        log.info(
            "testbed %s up: %s", self.run_id, ", ".join(f"{h.name}={h.ip}" for h in self.hosts)
        )
        return self

    def _pick_names(self) -> None:
        existing = set(list_namespaces(self.ip))
        state = Path(self.state_dir)
        for _ in range(64):
            run = self._run_id or secrets.token_hex(2)
            taken = (
                any(n.startswith(f"{PREFIX}{run}-") for n in existing)
                or (state / f"{run}.json").exists()
            )
            if not taken:
                break
            if self._run_id is not None:
                raise ConfigError(f"run_id {run!r} is in use; pick another or omit it")
        else:  # pragma: no cover - 64 collisions in 65536 ids
            raise TestbedError("could not find a free testbed run id")
        self.run_id = run
        subnet = self._subnet if self._subnet is not None else int(run, 16) % 512
        a, b = SUBNET_BASE[0], SUBNET_BASE[1] + subnet // 256
        c = subnet % 256
        self.subnet = f"{a}.{b}.{c}.0/24"
        self.switch_netns = f"{PREFIX}{run}-sw"
        self.bridge = f"mf{run}br"
        self.hosts = [
            Host(
                name=f"h{i}",
                index=i,
                netns=f"{PREFIX}{run}-h{i}",
                ip=f"{a}.{b}.{c}.{i + 1}",
                ifname=f"mf{run}h{i}",
                switch_port=f"mf{run}s{i}",
                up_mbit=self._link_rates[f"h{i}"][0],
                down_mbit=self._link_rates[f"h{i}"][1],
                _testbed=self,
            )
            for i in range(self.n_hosts)
        ]

    def _state_path(self) -> Path:
        return Path(self.state_dir) / f"{self.run_id}.json"

    def _write_state(self) -> None:
        path = self._state_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "run": self.run_id,
            "pid": os.getpid(),
            "starttime": _proc_starttime(os.getpid()),
            "argv": sys.argv,
            "namespaces": [self.switch_netns, *(h.netns for h in self.hosts)],
            "hosts": {h.name: h.ip for h in self.hosts},
            "created": time.time(),
        }
        # Atomic: `testbed down` must never see a half-written record of a live run.
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, path)

    def _build(self) -> None:
        sw = self.switch_netns
        for ns in [sw, *(h.netns for h in self.hosts)]:
            self._run([self.ip, "netns", "add", ns])
            self._created.append(ns)
            self._quiet_ipv6(ns)
            self._ipn(ns, "link", "set", "lo", "up")
        self._ipn(sw, "link", "add", self.bridge, "type", "bridge", "stp_state", "0")
        self._ipn(sw, "link", "set", self.bridge, "up")
        for h in self.hosts:
            self._ipn(
                sw, "link", "add", h.switch_port, "type", "veth",
                "peer", "name", h.ifname, "netns", h.netns,
            )  # fmt: skip
            for ns, dev in ((sw, h.switch_port), (h.netns, h.ifname)):
                # One wire-size packet per skb, so tbf meters what the wire carries.
                gso = ["gso_max_size", str(self.frame_bytes), "gso_max_segs", "1"]
                self._ipn(ns, "link", "set", dev, "mtu", str(self.mtu), *gso)
            self._ethtool_off(h.netns, h.ifname)
            self._ethtool_off(sw, h.switch_port)
            self._ipn(sw, "link", "set", h.switch_port, "master", self.bridge, "up")
            self._ipn(h.netns, "addr", "add", f"{h.ip}/24", "dev", h.ifname)
            self._ipn(h.netns, "link", "set", h.ifname, "up")
            self._shape(h.netns, h.ifname, h.up_mbit, uplink=True)
            self._shape(sw, h.switch_port, h.down_mbit, uplink=False)
            # Ready for live rate changes, so the first one is as fast as the rest.
            self._netlink_target(h.netns, h.ifname)
            self._netlink_target(sw, h.switch_port)

    def _quiet_ipv6(self, ns: str) -> None:
        # No IPv6 router solicitations or DAD packets on the shaped links.
        try:
            with enter_netns(os.path.join(self.netns_dir, ns)):
                for conf in ("all", "default"):
                    with open(f"/proc/sys/net/ipv6/conf/{conf}/disable_ipv6", "w") as f:
                        f.write("1")
        except OSError as exc:
            log.debug("could not disable IPv6 in %s: %s", ns, exc)

    def _ethtool_off(self, ns: str, dev: str) -> None:
        ethtool = _which("ethtool")
        if ethtool is None:
            return
        features = ["tso", "off", "gso", "off", "gro", "off"]
        argv = [self.ip, "netns", "exec", ns, ethtool, "-K", dev, *features]
        res = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
        if res.returncode != 0:
            log.debug("ethtool -K %s in %s: %s", dev, ns, res.stderr.strip())

    def _shape(self, ns: str, dev: str, rate: float | None, uplink: bool) -> None:
        delay = self.delay_ms if uplink else 0.0
        if delay > 0:
            # netem holds every packet of one delay's worth of traffic, plus a queue.
            in_flight = (rate or 10_000) * 1e6 / 8 * delay / 1000 / self.frame_bytes
            limit = str(int(1000 + 2 * in_flight))
            netem = ["root", "handle", "1:", "netem", "delay", f"{delay}ms", "limit", limit]
            res = self._tcq(ns, "qdisc", "replace", "dev", dev, *netem, check=False)
            if res.returncode != 0:
                if "unknown" in res.stderr.lower():
                    raise ConfigError(
                        f"delay_ms={self.delay_ms:g} needs the netem qdisc, which this kernel "
                        "lacks (CONFIG_NET_SCH_NETEM / module sch_netem): run "
                        "`modprobe sch_netem`, or use delay_ms=0"
                    )
                raise TestbedError(f"tc netem on {dev} in {ns} failed: {res.stderr.strip()}")
        if rate is not None:
            self._set_tbf(ns, dev, rate, nested=delay > 0)

    def close(self) -> None:
        """Stop schedules, traffic and processes; delete every namespace. Idempotent.

        A KeyboardInterrupt or SystemExit arriving during teardown does not cut
        it short: the remaining steps run, then the interrupt is re-raised.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        pending: BaseException | None = None
        steps: list[Callable[[], None]] = [
            self._stop_schedules,
            self._stop_traffic,
            self._stop_procs,
            self._close_netlink,
            self._delete_namespaces,
            self._remove_state,
        ]
        for step in steps:
            # Every step is idempotent: one interrupted (a second Ctrl-C; `timeout`
            # sends SIGINT twice) is run again, so the namespaces still go away.
            for _attempt in range(5):
                try:
                    step()
                    break
                except (KeyboardInterrupt, SystemExit) as exc:
                    pending = exc
                except Exception as exc:
                    name = step.__name__
                    log.warning("testbed %s teardown: %s failed: %s", self.run_id, name, exc)
                    break
        _unregister(self)
        if pending is not None:
            raise pending

    def _stop_schedules(self) -> None:
        for sched in list(self._schedules):
            sched.cancel(timeout=5.0)

    def _stop_traffic(self) -> None:
        for handle in list(self._traffic):
            try:
                handle.stop(timeout=1.0)
            except Exception as exc:
                log.warning("stopping %r: %s", handle, exc)

    def _stop_procs(self) -> None:
        procs = [p for p in self._procs if p.poll() is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        deadline = time.monotonic() + 2.0
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(2.0)

    def _delete_namespaces(self) -> None:
        for ns in reversed(self._created):
            kill_netns_pids(ns, self.ip)
        for ns in reversed(list(self._created)):
            res = self._run([self.ip, "netns", "del", ns], check=False)
            if res.returncode != 0 and os.path.exists(os.path.join(self.netns_dir, ns)):
                log.warning("could not delete netns %s: %s", ns, res.stderr.strip())
            else:
                self._created.remove(ns)

    def _remove_state(self) -> None:
        if self.run_id:
            with contextlib.suppress(FileNotFoundError):
                self._state_path().unlink()

    # ------------------------------------------------------------------ commands

    def _run(self, argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        if check and res.returncode != 0:
            raise TestbedError(
                f"`{' '.join(argv)}` failed (exit {res.returncode}): {res.stderr.strip()}"
            )
        return res

    def _ipn(self, ns: str, *args: str) -> None:
        self._run([self.ip, "-n", ns, *args])

    def _tcq(self, ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self._run([self.tc, "-n", ns, *args], check=check)

    def _require_up(self) -> None:
        if not self._started or self._closed:
            raise ConfigError(f"{self!r} is not up: use `with Testbed(...) as tb:` or start()")

    # ------------------------------------------------------------------ hosts

    def host(self, ref: HostRef) -> Host:
        """The host named ``ref`` ("h1"), with index ``ref``, or ``ref`` itself."""
        self._require_up()
        if isinstance(ref, Host):
            if ref._testbed is not self:
                raise ConfigError(f"host {ref.name} belongs to another testbed")
            return ref
        if isinstance(ref, int) and not isinstance(ref, bool) and 0 <= ref < len(self.hosts):
            return self.hosts[ref]
        for h in self.hosts:
            if h.name == ref:
                return h
        names = [h.name for h in self.hosts]
        raise ConfigError(f"no host {ref!r} in this testbed; hosts are {names}")

    def popen(self, host: HostRef, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``host`` (``ip netns exec``); killed at teardown.

        Keyword arguments go to :class:`subprocess.Popen`.
        """
        h = self.host(host)
        if isinstance(argv, (str, bytes)):
            raise ConfigError(f"argv must be a list of strings, got the string {argv!r}")
        with self._lock:
            self._require_up()
            proc = subprocess.Popen(h.exec_argv(argv), **kw)
            self._procs.append(proc)
        return proc

    # ------------------------------------------------------------------ shaping

    def set_rate(self, host: HostRef, up: float | None = None, down: float | None = None) -> None:
        """Change ``host``'s uplink and/or downlink rate (Mbit/s) now; None: unchanged."""
        h = self.host(host)
        up_rate = _check_rate("up", up)
        down_rate = _check_rate("down", down)
        with self._lock:
            self._require_up()
            if up_rate is not None:
                self._set_tbf(h.netns, h.ifname, up_rate, nested=self.delay_ms > 0, live=True)
                h.up_mbit = up_rate
            if down_rate is not None:
                self._set_tbf(self.switch_netns, h.switch_port, down_rate, nested=False, live=True)
                h.down_mbit = down_rate

    def _set_tbf(self, ns: str, dev: str, rate: float, nested: bool, live: bool = False) -> None:
        shaping = Shaping.for_rate(rate, self.queue_ms, self.frame_bytes, self.burst)
        if live and not self._nl_broken:
            try:
                self._set_tbf_netlink(ns, dev, shaping, nested)
                return
            except (OSError, ValueError) as exc:
                self._nl_broken = True
                log.warning("netlink rate change failed (%s); using `tc` from now on", exc)
        where = ["parent", "1:1", "handle", "10:"] if nested else ["root", "handle", "1:"]
        self._tcq(ns, "qdisc", "replace", "dev", dev, *where, *shaping.tbf_args())

    def _set_tbf_netlink(self, ns: str, dev: str, shaping: Shaping, nested: bool) -> None:
        sock, ifindex = self._netlink_target(ns, dev)
        parent, handle = (0x00010001, 0x00100000) if nested else (_TC_H_ROOT, 0x00010000)
        self._nl_seq += 1
        seq = self._nl_seq
        _netlink_call(sock, tbf_request(ifindex, parent, handle, shaping, seq), seq)

    def _netlink_target(self, ns: str, dev: str) -> tuple[socket.socket, int]:
        """The namespace's netlink socket and the device's index, opened once and kept."""
        sock = self._netlink.get(ns)
        ifindex = self._ifindex.get((ns, dev))
        if sock is None or ifindex is None:
            with enter_netns(os.path.join(self.netns_dir, ns)):
                if sock is None:
                    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)  # NETLINK_ROUTE
                    sock.settimeout(5.0)
                    sock.bind((0, 0))
                    self._netlink[ns] = sock
                if ifindex is None:
                    ifindex = self._ifindex[(ns, dev)] = socket.if_nametoindex(dev)
        return sock, ifindex

    def _close_netlink(self) -> None:
        # An open socket keeps its namespace alive after `ip netns del`.
        for sock in self._netlink.values():
            sock.close()
        self._netlink.clear()
        self._ifindex.clear()

    def rates(self) -> dict[str, tuple[float | None, float | None]]:
        """Current (up, down) Mbit/s per host name."""
        return {h.name: (h.up_mbit, h.down_mbit) for h in self.hosts}

    def qdiscs(self, host: HostRef) -> dict[str, str]:
        """``tc qdisc show`` of the host's NIC ("up") and its switch port ("down")."""
        h = self.host(host)
        return {
            "up": self._tcq(h.netns, "qdisc", "show", "dev", h.ifname).stdout,
            "down": self._tcq(self.switch_netns, "qdisc", "show", "dev", h.switch_port).stdout,
        }

    def schedule(self, events: Sequence[tuple[float, Action]]) -> Schedule:
        """Apply actions at times (seconds from now) in a background thread.

        An action is :class:`SetRate`, :class:`StartTraffic`, :class:`StopTraffic`
        or a callable without arguments. The first failing action stops the
        schedule (``wait()`` raises it). Teardown cancels pending actions.
        """
        self._require_up()
        started: set[str] = set()
        checked = sorted(events, key=lambda e: e[0]) if events else []
        for item in checked:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise ConfigError(f"schedule items are (seconds, action), got {item!r}")
            t, action = item
            if (
                isinstance(t, bool)
                or not isinstance(t, (int, float))
                or not (math.isfinite(t) and t >= 0)
            ):
                raise ConfigError(f"schedule time must be seconds >= 0, got {t!r}")
            if isinstance(action, SetRate):
                self.host(action.host)
                _check_rate("SetRate.up", action.up)
                _check_rate("SetRate.down", action.down)
            elif isinstance(action, StartTraffic):
                self.host(action.src)
                self.host(action.dst)
                self._check_traffic(action.proto, action.rate_mbit, action.duration)
                if action.key in started:
                    raise ConfigError(f"schedule starts traffic {action.key!r} twice")
                started.add(action.key)
            elif isinstance(action, StopTraffic):
                if action.key not in started:
                    raise ConfigError(
                        f"schedule stops traffic {action.key!r} before any StartTraffic of it"
                    )
            elif not callable(action):
                raise ConfigError(f"schedule action must be an action or callable, got {action!r}")
        sched = Schedule(self, checked)
        with self._lock:
            self._schedules.append(sched)
        return sched

    # ------------------------------------------------------------------ cross-traffic

    @staticmethod
    def _check_traffic(proto: str, rate_mbit: float | None, duration: float | None) -> None:
        if proto not in ("tcp", "udp"):
            raise ConfigError(f"proto must be 'tcp' or 'udp', got {proto!r}")
        _check_rate("rate_mbit", rate_mbit)
        if proto == "udp" and rate_mbit is None:
            raise ConfigError("UDP cross-traffic needs rate_mbit (it has no congestion control)")
        if duration is not None and not (
            isinstance(duration, (int, float)) and math.isfinite(duration) and duration > 0
        ):
            raise ConfigError(f"duration must be seconds > 0 or None, got {duration!r}")

    def cross_traffic(
        self,
        src: HostRef,
        dst: HostRef,
        rate_mbit: float | None = None,
        proto: str = "tcp",
        duration: float | None = None,
    ) -> CrossTraffic:
        """Start another tenant's flow src -> dst: TCP bulk (rate None), paced TCP, or UDP.

        Returns when the sink listens and the sender is started; the handle
        counts bytes sent and received, ``stop()`` ends both. Stopped at teardown.
        """
        s, d = self.host(src), self.host(dst)
        self._check_traffic(proto, rate_mbit, duration)
        common = dict(stdout=subprocess.PIPE, text=True, start_new_session=True)
        # The file is run as a script in isolated mode (the same code as
        # `python -m mlfabric.traffic`): it needs only the standard library, so it
        # starts fast and does not depend on the rest of the package importing.
        mod = [self.python, "-I", traffic.__file__]
        sink = self.popen(d, [*mod, "sink", "--proto", proto, "--bind", d.ip], **common)

        def start_sender(port: int) -> subprocess.Popen[str]:
            argv = [*mod, "send", "--proto", proto, "--dst", d.ip, "--port", str(port)]
            if rate_mbit is not None:
                argv += ["--rate-mbit", repr(float(rate_mbit))]
            if duration is not None:
                argv += ["--duration", repr(float(duration))]
            return self.popen(s, argv, **common)

        try:
            handle = CrossTraffic(s.name, d.name, proto, rate_mbit, duration, sink, start_sender)
        except RuntimeError as exc:
            raise TestbedError(str(exc)) from exc
        with self._lock:
            self._traffic.append(handle)
        return handle


def _which(name: str) -> str | None:
    import shutil

    return shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.access(p, os.X_OK)), None
    )


# --------------------------------------------------------------------------- leftovers


def list_namespaces(ip: str = "ip") -> list[str]:
    """Names of all network namespaces with the testbed prefix."""
    res = subprocess.run([ip, "netns", "list"], capture_output=True, text=True, timeout=10)
    names = [line.split()[0] for line in res.stdout.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(PREFIX))


def netns_pids(ns: str, ip: str = "ip") -> list[int]:
    res = subprocess.run([ip, "netns", "pids", ns], capture_output=True, text=True, timeout=10)
    return [int(p) for p in res.stdout.split() if p.isdigit()]


def kill_netns_pids(ns: str, ip: str = "ip", grace: float = 1.0) -> list[int]:
    """SIGTERM, then SIGKILL, every process in ``ns`` (never this process). Bounded."""
    me = os.getpid()
    pids = [p for p in netns_pids(ns, ip) if p != me]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            if pids:
                time.sleep(0.02)
        if not pids:
            break
    return pids


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@dataclass(frozen=True)
class RunInfo:
    """One testbed run found on this machine."""

    run: str
    namespaces: list[str]
    owner_pid: int | None  # from the state file; None when there is none
    owner_alive: bool
    hosts: dict[str, str]  # host name -> ip, from the state file

    @property
    def leftover(self) -> bool:
        """True when no live process owns the run (it crashed or was killed)."""
        return not self.owner_alive


def list_runs(ip: str = "ip", state_dir: str = STATE_DIR) -> list[RunInfo]:
    """Testbed runs on this machine: from namespace names and state files."""
    by_run: dict[str, list[str]] = {}
    for ns in list_namespaces(ip):
        # Namespaces with the prefix but not our naming still count (as their own run).
        m = _NAME_RE.match(ns)
        by_run.setdefault(m.group(1) if m else ns[len(PREFIX) :], []).append(ns)
    sdir = Path(state_dir)
    if sdir.is_dir():
        for f in sdir.glob("*.json"):
            by_run.setdefault(f.stem, [])
    runs = []
    for run, namespaces in sorted(by_run.items()):
        pid = None
        alive = False
        hosts: dict[str, str] = {}
        try:
            state = json.loads((sdir / f"{run}.json").read_text())
            pid = int(state["pid"])
            hosts = dict(state.get("hosts", {}))
            alive = _alive(pid) and _proc_starttime(pid) == state.get("starttime")
        except (OSError, ValueError, KeyError, TypeError):
            pass
        runs.append(RunInfo(run, namespaces, pid, alive, hosts))
    return runs


def cleanup(
    run: str | None = None,
    include_live: bool = False,
    ip: str = "ip",
    state_dir: str = STATE_DIR,
) -> list[RunInfo]:
    """Remove testbed namespaces (and their processes) left by crashed runs.

    By default only runs whose owner process is gone are removed, so a live
    testbed of another user or test is left alone; ``include_live`` removes
    those too, ``run`` limits it to one run id. Returns the runs removed.
    """
    require_root(ip)
    removed = []
    for info in list_runs(ip, state_dir):
        if run is not None and info.run != run:
            continue
        if info.owner_alive and not include_live:
            continue
        for ns in info.namespaces:
            kill_netns_pids(ns, ip)
        for ns in info.namespaces:
            subprocess.run([ip, "netns", "del", ns], capture_output=True, timeout=10)
        with contextlib.suppress(FileNotFoundError):
            (Path(state_dir) / f"{info.run}.json").unlink()
        removed.append(info)
    return removed
