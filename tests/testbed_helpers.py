"""Helpers for tests that run on the emulated cluster (mlfabric.tools.testbed)."""

from __future__ import annotations

import bisect
import itertools
import os
import socket
import statistics
import struct
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from mlfabric.errors import ConfigError
from mlfabric.tools.testbed import Host, require_root
from mlfabric.tools.traffic import Sample

# TCP goodput over Ethernet with timestamps: 1448 payload bytes per 1514-byte frame.
TCP_EFFICIENCY = 1448 / 1514


def root_skip_reason() -> str | None:
    try:
        require_root()
    except ConfigError as exc:
        return str(exc)
    return None


_reason = root_skip_reason()
needs_root = pytest.mark.skipif(_reason is not None, reason=_reason or "")


def our_namespaces(run_id: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [
        line.split()[0]
        for line in out.splitlines()
        if line.strip() and line.split()[0].startswith(f"mlfabric-{run_id}-")
    ]


@dataclass
class Transfer:
    """What a TCP receiver saw: (monotonic time, total bytes) after every recv."""

    marks: list[tuple[float, int]]

    def received(self, at: float) -> int:
        """Bytes received by time `at` (the last recv at or before it)."""
        k = bisect.bisect_right(self.marks, at, key=lambda m: m[0])
        return self.marks[k - 1][1] if k else 0

    def mbit(self, start: float, end: float) -> float:
        """Bytes received in [start, end] over its length: a window in which
        the flow stalled (a TCP retransmission timeout) reads 0, as it was.
        The window is cut to the recorded transfer, of which it must keep
        at least half."""
        lo = max(start, self.marks[0][0]) if self.marks else start
        hi = min(end, self.marks[-1][0]) if self.marks else start
        if hi - lo < (end - start) / 2 or end <= start:
            span = f"{self.marks[0][0]:.3f}..{self.marks[-1][0]:.3f}" if self.marks else "none"
            raise AssertionError(f"window {start:.3f}..{end:.3f} is outside the transfer ({span})")
        return (self.received(hi) - self.received(lo)) * 8 / (hi - lo) / 1e6

    def median_mbit(self, start: float, end: float, width: float = 0.1) -> float:
        """Median rate of ``width``-second windows: robust to a stalled receiver thread.

        On a loaded machine the receiving thread can miss the CPU for tens of ms;
        the window it stalls in is low (and the next one high), the median is not.
        """
        count = int((end - start) / width)
        rates = [self.mbit(start + k * width, start + (k + 1) * width) for k in range(count)]
        return statistics.median(rates)


class TcpFlow:
    """A bulk TCP flow src -> dst, both ends in-process threads living in the hosts.

    The receiver records every recv; ``run_for`` sends for a while. All waits bounded.
    """

    def __init__(self, src: Host, dst: Host, port: int = 0) -> None:
        with dst.enter():
            self._srv = socket.create_server((dst.ip, port))
        self._srv.settimeout(5.0)
        self.port = self._srv.getsockname()[1]
        self.transfer = Transfer([])
        self._accepted = threading.Event()
        self._error: list[BaseException] = []
        self._rx = threading.Thread(target=self._receive, daemon=True)
        self._rx.start()
        with src.enter():
            self._cl = socket.create_connection((dst.ip, self.port), timeout=5.0)
        if not self._accepted.wait(5.0):
            raise AssertionError("receiver did not accept within 5 s")
        self._stop = threading.Event()
        self._tx = threading.Thread(target=self._send, daemon=True)

    def _receive(self) -> None:
        try:
            conn, _ = self._srv.accept()
            self._accepted.set()
            conn.settimeout(5.0)
            buf = bytearray(1 << 20)
            total = 0
            marks = self.transfer.marks
            with conn:
                while True:
                    n = conn.recv_into(buf)
                    if not n:
                        return
                    total += n
                    marks.append((time.monotonic(), total))
        except BaseException as exc:
            self._error.append(exc)
            self._accepted.set()

    def _send(self) -> None:
        data = memoryview(bytes(1 << 18))
        self._cl.settimeout(0.2)
        try:
            while not self._stop.is_set():
                try:
                    self._cl.send(data)
                except TimeoutError:
                    pass
        except OSError as exc:
            self._error.append(exc)

    def start(self) -> None:
        self._tx.start()

    def stop(self) -> Transfer:
        self._stop.set()
        self._tx.join(5.0)
        self._cl.close()
        self._rx.join(5.0)
        self._srv.close()
        if self._error:
            raise self._error[0]
        return self.transfer

    def run_for(self, seconds: float) -> Transfer:
        self.start()
        time.sleep(seconds)  # the measurement window passes
        return self.stop()


def icmp_ping(src: Host, dst_ip: str, timeout: float = 1.0) -> bool:
    """One ICMP echo from inside ``src`` (raw socket; root). True if answered."""
    with src.enter():
        sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    with sock:
        sock.settimeout(timeout)
        ident = os.getpid() & 0xFFFF
        header = struct.pack("!BBHHH", 8, 0, 0, ident, 1)
        payload = b"mlfabric-ping"
        csum = _checksum(header + payload)
        packet = struct.pack("!BBHHH", 8, 0, csum, ident, 1) + payload
        try:
            sock.sendto(packet, (dst_ip, 0))
        except OSError:
            return False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                data, addr = sock.recvfrom(2048)
            except (TimeoutError, OSError):
                return False
            ihl = (data[0] & 0x0F) * 4
            typ, _code, _c, rid, _seq = struct.unpack("!BBHHH", data[ihl : ihl + 8])
            if typ == 0 and rid == ident and addr[0] == dst_ip:
                return True
        return False


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    s = (s >> 16) + (s & 0xFFFF)
    s += s >> 16
    return ~s & 0xFFFF


SO_TIMESTAMPNS = 35  # socket.SO_TIMESTAMPNS is missing from some Python builds


def udp_pair(src: Host, dst: Host) -> tuple[socket.socket, socket.socket]:
    """(tx in src, rx in dst): rx bound on dst's address with a 2 s timeout, tx
    connected to it. The caller closes both."""
    with dst.enter():
        rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with src.enter():
        tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind((dst.ip, 0))
    rx.settimeout(2.0)
    tx.connect((dst.ip, rx.getsockname()[1]))
    return tx, rx


def udp_train_mbit(src: Host, dst: Host, packets: int = 60, size: int = 1400) -> float:
    """Send ``packets`` datagrams back to back; the rate their second half arrived at.

    Uses kernel receive timestamps and counts wire bytes (UDP + IP + Ethernet
    headers). The first half is skipped: it includes the token bucket's burst.
    """
    tx, rx = udp_pair(src, dst)
    with rx, tx:
        rx.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        tx.send(b"warm-up")  # resolves ARP before the train
        rx.recv(16)
        payload = bytes(size)
        for _ in range(packets):
            tx.send(payload)
        stamps = []
        for _ in range(packets):
            _data, ancillary, _flags, _addr = rx.recvmsg(2048, 64)
            for level, kind, raw in ancillary:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                    sec, nsec = struct.unpack("qq", raw[:16])
                    stamps.append(sec + nsec * 1e-9)
    half = stamps[len(stamps) // 2 :]
    wire = size + 8 + 20 + 14
    return (len(half) - 1) * wire * 8 / (half[-1] - half[0]) / 1e6


def median_sample_mbit(samples: Sequence[Sample], start: float, end: float) -> float:
    """Median rate between consecutive traffic-process reports inside [start, end]."""
    inside = [s for s in samples if start <= s.time <= end]
    rates = [
        (b.total - a.total) * 8 / (b.time - a.time) / 1e6
        for a, b in itertools.pairwise(inside)
        if b.time > a.time
    ]
    if not rates:
        raise AssertionError(f"no reports between {start:.3f} and {end:.3f}")
    return statistics.median(rates)
