"""The job's own TCP traffic on this host, from the kernel's per-socket counters.

An agent measures the load on its host's links from the NIC counters
(`mlfabric.bandwidth.LoadMeter`). Those count every byte, the job's own
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

This module splits into pure code (building the dump request, parsing the
reply, accumulating per-socket deltas) and one function that does the
netlink I/O (`read_tcp_sockets`).
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from collections.abc import Collection, Iterable
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


def _align(n: int) -> int:
    return (n + 3) & ~3


def build_request(family: int, seq: int) -> bytes:
    """A sock_diag dump request for all TCP sockets of `family`, with tcp_info."""
    body = (_REQ_V2.pack(family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), 0, ALL_STATES)
            + _SOCKID.pack(0, 0, bytes(16), bytes(16)) + _SOCKID_REST.pack(0, 0, 0))
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY,
                          NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body


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


def parse_dump(data: bytes) -> tuple[list[TcpSocketBytes], bool]:
    """Parse one recv() of a sock_diag dump: (sockets, done). Sockets without
    tcp_info (e.g. listening, or state the kernel gives none for) are skipped.
    Raises OSError for an NLMSG_ERROR reply."""
    out: list[TcpSocketBytes] = []
    off = 0
    while off + _NLMSGHDR.size <= len(data):
        length, kind, _flags, _seq, _pid = _NLMSGHDR.unpack_from(data, off)
        if length < _NLMSGHDR.size or off + length > len(data):
            raise ValueError(f"truncated netlink message ({length} bytes at {off})")
        body = data[off + _NLMSGHDR.size: off + length]
        off += _align(length)
        if kind == NLMSG_DONE:
            return out, True
        if kind == NLMSG_ERROR:
            errno, = struct.unpack_from("=i", body, 0)
            if errno:
                raise OSError(-errno, f"sock_diag dump failed: {errno}")
            continue
        if kind != SOCK_DIAG_BY_FAMILY or len(body) < _DIAG_MSG_LEN:
            continue
        family = body[0]
        sport, dport, src, dst = _SOCKID.unpack_from(body, _DIAG_MSG_HEAD.size)
        _ifc, c0, c1 = _SOCKID_REST.unpack_from(body, _DIAG_MSG_HEAD.size + _SOCKID.size)
        counts = None
        a = _DIAG_MSG_LEN
        while a + _RTATTR.size <= len(body):
            alen, atype = _RTATTR.unpack_from(body, a)
            if alen < _RTATTR.size:
                break
            if atype == INET_DIAG_INFO:
                counts = _tcp_info_bytes(body[a + _RTATTR.size: a + alen])
            a += _align(alen)
        if counts is not None:
            out.append(TcpSocketBytes(cookie=(c1 << 32) | c0,
                                      local=(_address(family, src), sport),
                                      remote=(_address(family, dst), dport),
                                      rx_bytes=counts[0], tx_bytes=counts[1]))
    return out, False


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

    Feed every reading of the host's TCP sockets to `update`; it adds each
    socket's growth since the previous reading (a socket seen for the first
    time counts in full: its counters started at zero when it was created).
    Bytes a socket moved between its last reading and its close are missed,
    at most one reading interval of one connection.
    """

    def __init__(self, ports: Collection[int]) -> None:
        self.ports = frozenset(ports)
        self.rx_bytes = 0
        self.tx_bytes = 0
        self._last: dict[int, tuple[int, int]] = {}

    def is_job(self, s: TcpSocketBytes) -> bool:
        if s.local[1] not in self.ports and s.remote[1] not in self.ports:
            return False
        return not _on_this_host(s.remote[0], s.local[0])

    def update(self, sockets: Iterable[TcpSocketBytes]) -> tuple[int, int]:
        seen: dict[int, tuple[int, int]] = {}
        for s in sockets:
            if not self.is_job(s):
                continue
            rx0, tx0 = self._last.get(s.cookie, (0, 0))
            self.rx_bytes += max(0, s.rx_bytes - rx0)
            self.tx_bytes += max(0, s.tx_bytes - tx0)
            seen[s.cookie] = (s.rx_bytes, s.tx_bytes)
        self._last = seen
        return self.rx_bytes, self.tx_bytes


def read_tcp_sockets() -> list[TcpSocketBytes]:
    """All TCP sockets (IPv4 and IPv6) of the calling thread's network namespace,
    with their byte counters. Raises OSError if sock_diag is unavailable."""
    out: list[TcpSocketBytes] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)  # the kernel answers at once; bounded all the same
        for seq, family in enumerate((socket.AF_INET, socket.AF_INET6), start=1):
            nl.send(build_request(family, seq))
            done = False
            while not done:
                sockets, done = parse_dump(nl.recv(1 << 16))
                out += sockets
    return out


class JobTrafficReader:
    """`JobTraffic` fed from the kernel: call it for cumulative (rx, tx) wire bytes."""

    def __init__(self, ports: Collection[int]) -> None:
        self.traffic = JobTraffic(ports)

    def __call__(self) -> tuple[int, int]:
        return self.traffic.update(read_tcp_sockets())
