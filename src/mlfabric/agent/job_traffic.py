"""The job's own TCP traffic on this host, from the kernel's per-socket counters.

An agent measures the load on its host's links from the NIC counters
(`mlfabric.agent.estimator.LoadMeter`). Those count every byte, the job's own
pushes and pulls included; left in, a server host whose downlink carries
four concurrent pushes looks 80% loaded by "other tenants", the controller
plans every transfer into it at a fifth of the link and the shortest-first
order has nothing to work with. The bandwidth the controller schedules is
what the *job* can use: capacity less the load of everyone else.

So the agent subtracts the job's bytes, as it subtracts its own probe bytes.
The kernel keeps, for every TCP socket, the bytes and segments it sent and
received (``struct tcp_info``); the sock_diag netlink interface (what ``ss``
uses) dumps them for all sockets of the network namespace. The job's sockets
are those with an endpoint on one of the job's ports (the server, replica
and aggregator listening ports, given to the agent with ``--job-port``).

Reading the counters in the same loop iteration as the NIC counters keeps
the two aligned: no report from the training processes, no lag.

A dump walks the kernel's whole TCP hash table, whatever the namespace holds:
measured here (262,144 buckets on a 24 GiB host), 4.0 ms of CPU for IPv4 and
2.4 ms for IPv6, so an agent dumping at its 10 load readings a second spent
6% of a core on it, most of its CPU. Between dumps, once a second, the
reader asks for the job's known sockets one by one by their endpoints and
cookie, a hash lookup each (about 30 us a socket from Python); a connection
opened since the last dump is found by the next one and its bytes are
counted in full then: late by up to a second, not lost.

This module splits into pure code (building the requests, parsing the
replies, accumulating per-socket deltas) and the netlink I/O (`SockDiag`).
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass

# linux/netlink.h, linux/sock_diag.h, linux/inet_diag.h
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
INET_DIAG_INFO = 2
ALL_STATES = 0xFFFFFFFF

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_REQ_V2 = struct.Struct("=BBBBI")  # family, protocol, ext, pad, states
_SOCKID = struct.Struct("!HH16s16s")  # sport, dport, src, dst (network order)
_SOCKID_REST = struct.Struct("=III")  # interface, cookie[2]
_DIAG_MSG_HEAD = struct.Struct("=BBBB")  # family, state, timer, retrans
_DIAG_MSG_TAIL = struct.Struct("=IIIII")  # expires, rqueue, wqueue, uid, inode
_RTATTR = struct.Struct("=HH")  # len, type
_DIAG_MSG_LEN = _DIAG_MSG_HEAD.size + _SOCKID.size + _SOCKID_REST.size + _DIAG_MSG_TAIL.size

# struct tcp_info offsets (linux/tcp.h); bytes_received since 4.1,
# segs_out/segs_in since 4.2, bytes_sent since 4.19 (before it: bytes_acked)
_BYTES_ACKED = 120
_BYTES_RECEIVED = 128
_SEGS = 136
_BYTES_SENT = 200
_MIN_INFO = _SEGS + 8
# tcpi_delivery_rate (bytes/s, since 4.9) and the bit saying the sample was
# app-limited (the first bit of byte 7, tcpi_delivery_rate_app_limited)
_DELIVERY_RATE = 160
_APP_LIMITED_BYTE = 7

# Ethernet (14) + IPv4 (20) + TCP with timestamps (32) per segment, so that
# socket bytes compare with the NIC counters (which count whole frames).
SEGMENT_OVERHEAD = 66


@dataclass(frozen=True)
class TcpSocketBytes:
    """One TCP socket's endpoints and cumulative wire bytes (headers included)."""

    cookie: int
    local: tuple[str, int]
    remote: tuple[str, int]
    rx_bytes: int
    tx_bytes: int
    # The kernel's latest delivery-rate sample (TCP payload bit/s; what BBR
    # measures), and whether the sender was app-limited then (the rate then
    # says how fast the application sent, not what the path delivers).
    delivery_bps: float = 0.0
    app_limited: bool = True


def _align(n: int) -> int:
    return (n + 3) & ~3


def _request(family: int, flags: int, seq: int, sockid: bytes) -> bytes:
    body = _REQ_V2.pack(family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), 0,
                        ALL_STATES) + sockid
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY, flags, seq,
                          0) + body


def build_request(family: int, seq: int) -> bytes:
    """A sock_diag dump request for all TCP sockets of `family`, with tcp_info."""
    sockid = _SOCKID.pack(0, 0, bytes(16), bytes(16)) + _SOCKID_REST.pack(0, 0, 0)
    return _request(family, NLM_F_REQUEST | NLM_F_DUMP, seq, sockid)


def _family(address: str) -> int:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def build_lookup(s: TcpSocketBytes, seq: int) -> bytes:
    """A sock_diag request for one socket seen before, found by its endpoints and
    cookie (a hash lookup in the kernel, no walk), with tcp_info. A socket of
    the same endpoints created since has another cookie and is not answered."""
    family = _family(s.local[0])
    sockid = (_SOCKID.pack(s.local[1], s.remote[1],
                           socket.inet_pton(family, s.local[0]).ljust(16, b"\0"),
                           socket.inet_pton(family, s.remote[0]).ljust(16, b"\0"))
              + _SOCKID_REST.pack(0, s.cookie & 0xFFFFFFFF, s.cookie >> 32))
    return _request(family, NLM_F_REQUEST, seq, sockid)


def _address(family: int, raw: bytes) -> str:
    if family == socket.AF_INET:
        return str(ipaddress.IPv4Address(raw[:4]))
    return str(ipaddress.IPv6Address(raw))


def _tcp_info_bytes(info: bytes) -> tuple[int, int] | None:
    """(rx, tx) wire bytes from a struct tcp_info, or None if the kernel's is too old."""
    if len(info) < _MIN_INFO:
        return None
    received, = struct.unpack_from("=Q", info, _BYTES_RECEIVED)
    segs_out, segs_in = struct.unpack_from("=II", info, _SEGS)
    if len(info) >= _BYTES_SENT + 8:
        sent, = struct.unpack_from("=Q", info, _BYTES_SENT)
    else:
        sent, = struct.unpack_from("=Q", info, _BYTES_ACKED)
    return received + segs_in * SEGMENT_OVERHEAD, sent + segs_out * SEGMENT_OVERHEAD


def _tcp_info_delivery(info: bytes) -> tuple[float, bool]:
    """(delivery rate in bit/s, app-limited) from a struct tcp_info; (0, True)
    from a kernel too old to say."""
    if len(info) < _DELIVERY_RATE + 8:
        return 0.0, True
    rate, = struct.unpack_from("=Q", info, _DELIVERY_RATE)
    if not rate:
        return 0.0, True  # no sample yet
    return rate * 8.0, bool(info[_APP_LIMITED_BYTE] & 1)


def _messages(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(type, body) of each netlink message in one recv()."""
    off = 0
    while off + _NLMSGHDR.size <= len(data):
        length, kind, _flags, _seq, _pid = _NLMSGHDR.unpack_from(data, off)
        if length < _NLMSGHDR.size or off + length > len(data):
            raise ValueError(f"truncated netlink message ({length} bytes at {off})")
        yield kind, data[off + _NLMSGHDR.size: off + length]
        off += _align(length)


def _error(body: bytes) -> int:
    """The (positive) errno of an NLMSG_ERROR body; 0 for an acknowledgement."""
    code, = struct.unpack_from("=i", body, 0)
    return -code


def _socket_bytes(body: bytes) -> TcpSocketBytes | None:
    """One inet_diag_msg; None without tcp_info (listening, time-wait, too old)."""
    if len(body) < _DIAG_MSG_LEN:
        return None
    family = body[0]
    sport, dport, src, dst = _SOCKID.unpack_from(body, _DIAG_MSG_HEAD.size)
    _ifc, c0, c1 = _SOCKID_REST.unpack_from(body, _DIAG_MSG_HEAD.size + _SOCKID.size)
    counts = None
    delivery = (0.0, True)
    a = _DIAG_MSG_LEN
    while a + _RTATTR.size <= len(body):
        alen, atype = _RTATTR.unpack_from(body, a)
        if alen < _RTATTR.size:
            break
        if atype == INET_DIAG_INFO:
            info = body[a + _RTATTR.size: a + alen]
            counts = _tcp_info_bytes(info)
            delivery = _tcp_info_delivery(info)
        a += _align(alen)
    if counts is None:
        return None
    return TcpSocketBytes(cookie=(c1 << 32) | c0, local=(_address(family, src), sport),
                          remote=(_address(family, dst), dport), rx_bytes=counts[0],
                          tx_bytes=counts[1], delivery_bps=delivery[0],
                          app_limited=delivery[1])


def parse_dump(data: bytes) -> tuple[list[TcpSocketBytes], bool]:
    """Parse one recv() of a sock_diag dump: (sockets, done). Sockets without
    tcp_info (e.g. listening, or state the kernel gives none for) are skipped.
    Raises OSError for an NLMSG_ERROR reply."""
    out: list[TcpSocketBytes] = []
    for kind, body in _messages(data):
        if kind == NLMSG_DONE:
            return out, True
        if kind == NLMSG_ERROR:
            code = _error(body)
            if code:
                raise OSError(code, f"sock_diag dump failed: {os.strerror(code)}")
            continue
        if kind == SOCK_DIAG_BY_FAMILY and (found := _socket_bytes(body)) is not None:
            out.append(found)
    return out, False


def parse_lookups(data: bytes) -> tuple[list[TcpSocketBytes], int]:
    """Parse one recv() of answers to `build_lookup` requests: (sockets still
    open, number of answers). A socket gone since (ENOENT) is an answer
    without a socket; any other error raises OSError."""
    out: list[TcpSocketBytes] = []
    answers = 0
    for kind, body in _messages(data):
        if kind == NLMSG_ERROR:
            code = _error(body)
            if code not in (0, errno.ENOENT):
                raise OSError(code, f"sock_diag lookup failed: {os.strerror(code)}")
            answers += 1
        elif kind == SOCK_DIAG_BY_FAMILY:
            answers += 1
            if (found := _socket_bytes(body)) is not None:
                out.append(found)
    return out, answers


def _on_this_host(remote: str, local: str) -> bool:
    """A connection to a local address goes over loopback: never on a NIC."""
    if remote == local:
        return True
    try:
        return ipaddress.ip_address(remote).is_loopback
    except ValueError:
        return False


class JobTraffic:
    """Cumulative wire bytes (rx, tx) of the job's TCP connections that cross a NIC.

    Feed every reading of the host's TCP sockets to `update`: all of them (a
    dump), or the answers for the sockets `known()` lists (a lookup). It adds
    each socket's growth since the previous reading (a socket seen for the
    first time counts in full: its counters started at zero when it was
    created); a socket missing from a reading has closed and is forgotten.
    Bytes a socket moved between its last reading and its close are missed,
    at most one reading interval of one connection.

    `deliveries` holds, after each reading, the delivery rates of the job's
    connections that were sending in bulk since the previous one (at least
    `min_sent` bytes, the sample not app-limited): the largest per remote
    address, in TCP payload bit/s. They are the passive samples BBR takes,
    of the path from this host to that address, taken from the job's own
    transfers.
    """

    def __init__(self, ports: Collection[int], min_sent: int = 64 * 1024) -> None:
        self.ports = frozenset(ports)
        self.min_sent = min_sent
        self.rx_bytes = 0
        self.tx_bytes = 0
        self.deliveries: dict[str, float] = {}
        self._last: dict[int, TcpSocketBytes] = {}

    def is_job(self, s: TcpSocketBytes) -> bool:
        if s.local[1] not in self.ports and s.remote[1] not in self.ports:
            return False
        return not _on_this_host(s.remote[0], s.local[0])

    def known(self) -> list[TcpSocketBytes]:
        """The job's sockets as last read (what a lookup asks for)."""
        return list(self._last.values())

    def update(self, sockets: Iterable[TcpSocketBytes]) -> tuple[int, int]:
        seen: dict[int, TcpSocketBytes] = {}
        deliveries: dict[str, float] = {}
        for s in sockets:
            if not self.is_job(s):
                continue
            last = self._last.get(s.cookie)
            rx0, tx0 = (0, 0) if last is None else (last.rx_bytes, last.tx_bytes)
            self.rx_bytes += max(0, s.rx_bytes - rx0)
            sent = max(0, s.tx_bytes - tx0)
            self.tx_bytes += sent
            if (last is not None and sent >= self.min_sent and not s.app_limited
                    and s.delivery_bps > 0):
                host = s.remote[0]
                deliveries[host] = max(deliveries.get(host, 0.0), s.delivery_bps)
            seen[s.cookie] = s
        self._last = seen
        self.deliveries = deliveries
        return self.rx_bytes, self.tx_bytes


# Lookup requests per send(): each answer is one message of its own, and the
# kernel queues them all before the first recv(); 32 stay far below the
# netlink socket's receive buffer.
LOOKUP_BATCH = 32


class SockDiag:
    """A sock_diag netlink socket of the network namespace it was opened in.
    Raises OSError if sock_diag is unavailable."""

    def __init__(self) -> None:
        self._nl = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
        self._nl.settimeout(1.0)  # the kernel answers at once; bounded all the same
        self._seq = 0

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        return self._seq

    def dump(self) -> list[TcpSocketBytes]:
        """All TCP sockets (IPv4 and IPv6) with their byte counters."""
        out: list[TcpSocketBytes] = []
        for family in (socket.AF_INET, socket.AF_INET6):
            self._nl.send(build_request(family, self._next_seq()))
            done = False
            while not done:
                sockets, done = parse_dump(self._nl.recv(1 << 16))
                out += sockets
        return out

    def lookup(self, sockets: Sequence[TcpSocketBytes]) -> list[TcpSocketBytes]:
        """The current counters of `sockets`, less those closed since."""
        out: list[TcpSocketBytes] = []
        for i in range(0, len(sockets), LOOKUP_BATCH):
            batch = sockets[i:i + LOOKUP_BATCH]
            self._nl.send(b"".join(build_lookup(s, self._next_seq()) for s in batch))
            answers = 0
            while answers < len(batch):
                found, n = parse_lookups(self._nl.recv(1 << 16))
                out += found
                answers += n
        return out

    def close(self) -> None:
        self._nl.close()


class JobTrafficReader:
    """`JobTraffic` fed from the kernel: call it for cumulative (rx, tx) wire bytes.

    It dumps every socket on the first call and then every `rediscover`
    seconds, and looks up the job's known sockets in between (see the module
    docstring for why). Raises OSError if sock_diag is unavailable."""

    def __init__(self, ports: Collection[int], rediscover: float = 1.0,
                 clock: Callable[[], float] = time.monotonic,
                 diag: SockDiag | None = None) -> None:
        if not rediscover >= 0:
            raise ValueError(f"rediscover must be a non-negative number of seconds, "
                             f"got {rediscover}")
        self.traffic = JobTraffic(ports)
        self.rediscover = rediscover
        self.clock = clock
        self._diag = diag  # opened at the first call, in the namespace that calls
        self._next_dump = -float("inf")

    def __call__(self) -> tuple[int, int]:
        if self._diag is None:
            self._diag = SockDiag()
        now = self.clock()
        if now >= self._next_dump:
            sockets = self._diag.dump()
            self._next_dump = now + self.rediscover
        else:
            sockets = self._diag.lookup(self.traffic.known())
        return self.traffic.update(sockets)

    @property
    def deliveries(self) -> dict[str, float]:
        """The job's delivery-rate samples of the last reading (`JobTraffic`)."""
        return self.traffic.deliveries

    def close(self) -> None:
        if self._diag is not None:
            self._diag.close()
            self._diag = None
