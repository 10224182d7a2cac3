"""Cross-traffic from "other tenants" for the emulated cluster.

Two halves live here:

* the traffic processes, run as ``python -m mlfabric.traffic sink|send ...``
  (usually through ``ip netns exec`` by :meth:`mlfabric.tools.testbed.Testbed.cross_traffic`).
  They import nothing but the standard library, start fast, and report on
  stdout, one line at a time::

      ready <port>                  (sink only: it is listening)
      bytes <total> <monotonic>     (every --report-interval seconds)
      done <total> <monotonic>      (on exit: duration over, SIGTERM or SIGINT)

  ``<monotonic>`` is the sender's or sink's ``time.monotonic()``; CLOCK_MONOTONIC
  is system-wide, so the parent can compare it with its own clock.
* :class:`CrossTraffic`, the handle the parent keeps: it reads those lines in
  a background thread and exposes the byte counts and their samples.

The pacing rule is :class:`TokenBucket`, a pure object with an injectable
clock, so it is tested without sockets or sleeping.
"""

from __future__ import annotations

import argparse
import errno
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

UDP_PAYLOAD = 1400  # bytes per datagram
TCP_CHUNK = 256 * 1024  # bytes per send() when not paced
REPORT_INTERVAL = 0.1  # seconds between "bytes" lines


# --------------------------------------------------------------------------- pacing


class TokenBucket:
    """A time-based token bucket: ``rate`` bytes/s, at most ``burst`` bytes saved up.

    ``delay(n)`` answers how long to wait before ``n`` bytes may go (0.0: go now,
    the tokens are taken). It never sleeps itself; the caller does.
    """

    def __init__(
        self, rate_bytes: float, burst: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not rate_bytes > 0:
            raise ValueError(f"rate_bytes must be > 0, got {rate_bytes!r}")
        if not burst > 0:
            raise ValueError(f"burst must be > 0, got {burst!r}")
        self.rate = float(rate_bytes)
        self.burst = float(burst)
        self._clock = clock
        self._tokens = float(burst)
        self._last = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now

    def delay(self, n: int) -> float:
        """Take ``n`` bytes' tokens and return 0.0, or return seconds to wait first."""
        self._refill()
        if self._tokens >= n or self._tokens >= self.burst:
            # A request larger than the bucket goes once the bucket is full.
            self._tokens -= n
            return 0.0
        need = min(n, self.burst) - self._tokens
        return need / self.rate


def pacing_bucket(rate_mbit: float, packet: int) -> TokenBucket:
    """The bucket senders use: the rate, and a burst of 10 ms or 4 packets.

    The burst is what a sender may catch up after oversleeping: on a loaded
    machine a wake-up can come several ms late, and a smaller bucket would
    lose that time for good (the sender would fall below its rate).
    """
    rate = rate_mbit * 1e6 / 8
    return TokenBucket(rate, max(4 * packet, rate * 0.010))


def _nap(bucket: TokenBucket, wait: float) -> None:
    # Sleeping per packet costs more than it paces: wait for at least half the
    # bucket (at most 1 ms) to refill, which the burst allowance absorbs.
    time.sleep(max(wait, min(0.001, bucket.burst / bucket.rate / 2)))


# --------------------------------------------------------------------------- processes


# Set by SIGTERM/SIGINT; the loops check it between calls. The handler must
# not raise: an exception between `sock.send()` returning and `total +=`
# would lose a chunk from the count. Every blocking call is bounded (select
# and socket timeouts, naps), so a stop takes effect within one interval.
_stopping = False


def _request_stop(signum: int, frame: object) -> None:
    global _stopping
    _stopping = True


class _Reporter:
    def __init__(self, interval: float) -> None:
        self.total = 0
        self.interval = interval
        self._next = time.monotonic() + interval

    def maybe(self) -> None:
        now = time.monotonic()
        if now >= self._next:
            print(f"bytes {self.total} {now:.6f}", flush=True)
            self._next = now + self.interval

    def done(self) -> None:
        print(f"done {self.total} {time.monotonic():.6f}", flush=True)


def run_sink(proto: str, bind: str, port: int, interval: float) -> int:
    """Receive and count bytes until SIGTERM/SIGINT. Prints ``ready <port>`` first."""
    rep = _Reporter(interval)
    buf = bytearray(256 * 1024)
    sel = selectors.DefaultSelector()
    if proto == "udp":
        lsock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
    else:
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((bind, port))
    if proto == "tcp":
        lsock.listen(16)
    lsock.setblocking(False)
    sel.register(lsock, selectors.EVENT_READ)
    print(f"ready {lsock.getsockname()[1]}", flush=True)
    try:
        while not _stopping:
            for key, _ in sel.select(interval):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if proto == "tcp" and sock is lsock:
                    conn, _addr = lsock.accept()
                    conn.setblocking(False)
                    sel.register(conn, selectors.EVENT_READ)
                    continue
                try:
                    n = sock.recv_into(buf)
                except (BlockingIOError, InterruptedError):
                    continue
                except ConnectionError:
                    n = 0
                if n == 0 and proto == "tcp":
                    sel.unregister(sock)
                    sock.close()
                rep.total += n
            rep.maybe()
    finally:
        rep.done()
    return 0


def run_send(
    proto: str,
    dst: str,
    port: int,
    rate_mbit: float | None,
    duration: float | None,
    size: int,
    interval: float,
) -> int:
    """Send to ``dst:port`` until ``duration`` passes or SIGTERM/SIGINT."""
    rep = _Reporter(interval)
    end = time.monotonic() + duration if duration is not None else float("inf")
    try:
        if proto == "udp":
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.connect((dst, port))
            if rate_mbit is None:
                raise SystemExit("mlfabric.traffic: UDP needs --rate-mbit")
            _send_udp(sock, pacing_bucket(rate_mbit, size), size, end, rep)
        else:
            sock = socket.create_connection((dst, port), timeout=5.0)
            sock.settimeout(None)
            bucket = pacing_bucket(rate_mbit, size) if rate_mbit is not None else None
            _send_tcp(sock, bucket, end, rep)
    except ConnectionError as exc:
        print(f"error {exc}", file=sys.stderr, flush=True)
    finally:
        rep.done()
    return 0


def _send_udp(
    sock: socket.socket, bucket: TokenBucket, size: int, end: float, rep: _Reporter
) -> None:
    payload = bytes(size)
    while not _stopping and time.monotonic() < end:
        wait = bucket.delay(size)
        if wait > 0:
            _nap(bucket, wait)
            rep.maybe()
            continue
        try:
            rep.total += sock.send(payload)
        except OSError as exc:
            # A full queue or an unreachable port drops the datagram, like a
            # real network would; the sender keeps its pace.
            if exc.errno not in (errno.ENOBUFS, errno.EAGAIN, errno.ECONNREFUSED):
                raise
        rep.maybe()


def _send_tcp(sock: socket.socket, bucket: TokenBucket | None, end: float, rep: _Reporter) -> None:
    chunk = TCP_CHUNK
    if bucket is not None:
        # Chunks of about 1 ms at the rate keep the pacing smooth.
        chunk = int(max(1448, min(64 * 1024, bucket.rate * 0.001)))
    payload = memoryview(bytes(chunk))
    sock.settimeout(0.2)  # wake up to report and to check the deadline and stop
    while not _stopping and time.monotonic() < end:
        if bucket is not None:
            wait = bucket.delay(chunk)
            if wait > 0:
                _nap(bucket, wait)
                rep.maybe()
                continue
        try:
            rep.total += sock.send(payload)
        except TimeoutError:
            pass
        rep.maybe()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mlfabric.traffic", description="cross-traffic sender and sink"
    )
    sub = parser.add_subparsers(dest="role", required=True)
    sink = sub.add_parser("sink", help="receive and count bytes")
    sink.add_argument("--proto", choices=["tcp", "udp"], default="tcp")
    sink.add_argument("--bind", default="0.0.0.0")
    sink.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    send = sub.add_parser("send", help="send to a sink")
    send.add_argument("--proto", choices=["tcp", "udp"], default="tcp")
    send.add_argument("--dst", required=True)
    send.add_argument("--port", type=int, required=True)
    send.add_argument("--rate-mbit", type=float, default=None, help="default: TCP bulk")
    send.add_argument("--duration", type=float, default=None, help="seconds (default: forever)")
    send.add_argument("--size", type=int, default=UDP_PAYLOAD, help="UDP datagram payload")
    for p in (sink, send):
        p.add_argument("--report-interval", type=float, default=REPORT_INTERVAL)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _request_stop)
    signal.signal(signal.SIGINT, _request_stop)
    if args.role == "sink":
        return run_sink(args.proto, args.bind, args.port, args.report_interval)
    if args.rate_mbit is not None and not args.rate_mbit > 0:
        print(f"--rate-mbit must be > 0, got {args.rate_mbit}", file=sys.stderr)
        return 2
    if args.proto == "udp" and args.rate_mbit is None:
        print("UDP cross-traffic needs --rate-mbit", file=sys.stderr)
        return 2
    return run_send(
        args.proto,
        args.dst,
        args.port,
        args.rate_mbit,
        args.duration,
        args.size,
        args.report_interval,
    )


# --------------------------------------------------------------------------- the handle


@dataclass(frozen=True)
class Sample:
    """One report line: ``total`` bytes by ``time`` (system-wide monotonic seconds)."""

    time: float
    total: int


class _Reader:
    """Reads a traffic process's stdout in a thread; keeps samples and the ready port."""

    def __init__(self, proc: subprocess.Popen[str], what: str) -> None:
        self.proc = proc
        self.what = what
        self.samples: list[Sample] = []
        self.port: int | None = None
        self.ready = threading.Event()
        self.finished = threading.Event()  # "done" seen or stdout closed
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._run, name=f"mlfabric-traffic-{what}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                parts = line.split()
                if not parts:
                    continue
                if parts[0] == "ready" and len(parts) == 2:
                    self.port = int(parts[1])
                    self.ready.set()
                elif parts[0] in ("bytes", "done") and len(parts) == 3:
                    with self._lock:
                        self.samples.append(Sample(float(parts[2]), int(parts[1])))
                    if parts[0] == "done":
                        self.finished.set()
        except (ValueError, OSError):
            pass
        finally:
            self.ready.set()
            self.finished.set()

    @property
    def total(self) -> int:
        with self._lock:
            return self.samples[-1].total if self.samples else 0

    def snapshot(self) -> list[Sample]:
        with self._lock:
            return list(self.samples)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def rate_mbit(samples: Sequence[Sample], start: float, end: float) -> float:
    """Mean rate in Mbit/s between the samples nearest to ``start`` and ``end``.

    Uses the first sample at or after ``start`` and the last at or before ``end``.
    Raises ValueError when fewer than two samples fall in the window.
    """
    inside = [s for s in samples if start <= s.time <= end]
    if len(inside) < 2 or inside[-1].time <= inside[0].time:
        raise ValueError(f"fewer than two samples between {start:.3f} and {end:.3f}")
    first, last = inside[0], inside[-1]
    return (last.total - first.total) * 8 / (last.time - first.time) / 1e6


def _stop_process(proc: subprocess.Popen[str], timeout: float) -> None:
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


class CrossTraffic:
    """A running sender/sink pair. Made by :meth:`mlfabric.tools.testbed.Testbed.cross_traffic`.

    ``bytes_sent`` counts bytes the sender handed to its socket (for UDP: datagrams
    the kernel accepted); ``bytes_received`` counts bytes the sink read. Both are
    updated every report interval and are final after :meth:`stop`.
    """

    def __init__(
        self,
        src: str,
        dst: str,
        proto: str,
        rate_mbit: float | None,
        duration: float | None,
        sink: subprocess.Popen[str],
        start_sender: Callable[[int], subprocess.Popen[str]],
        ready_timeout: float = 5.0,
    ) -> None:
        self.src = src
        self.dst = dst
        self.proto = proto
        self.rate_mbit = rate_mbit
        self.duration = duration
        self._sink_proc = sink
        self._sink = _Reader(sink, "sink")
        self._sender_proc: subprocess.Popen[str] | None = None
        self._sender: _Reader | None = None
        self._stopped = False
        if not self._sink.ready.wait(ready_timeout) or self._sink.port is None:
            self.stop()
            raise RuntimeError(
                f"cross-traffic sink in {dst} did not start listening within "
                f"{ready_timeout} s (exit code {sink.poll()})"
            )
        self.port: int = self._sink.port
        try:
            self._sender_proc = start_sender(self.port)
        except BaseException:
            self.stop()
            raise
        self._sender = _Reader(self._sender_proc, "sender")

    def __repr__(self) -> str:
        rate = "bulk" if self.rate_mbit is None else f"{self.rate_mbit:g} Mbit/s"
        return f"<CrossTraffic {self.proto} {self.src}->{self.dst}:{self.port} {rate}>"

    @property
    def bytes_sent(self) -> int:
        return self._sender.total if self._sender is not None else 0

    @property
    def bytes_received(self) -> int:
        return self._sink.total

    @property
    def sent_samples(self) -> list[Sample]:
        return self._sender.snapshot() if self._sender is not None else []

    @property
    def received_samples(self) -> list[Sample]:
        return self._sink.snapshot()

    @property
    def running(self) -> bool:
        return self._sender_proc is not None and self._sender_proc.poll() is None

    def wait(self, timeout: float) -> bool:
        """Wait for the sender to finish (its duration over); True if it did."""
        if self._sender_proc is None:
            return True
        try:
            self._sender_proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop(self, timeout: float = 2.0) -> None:
        """Stop sender, then sink (so the sink counts what was in flight). Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._sender_proc is not None:
            _stop_process(self._sender_proc, timeout)
        if self._sender is not None:
            self._sender.join(timeout)
        # Let packets still queued in shaped links arrive before the sink stops.
        time.sleep(0.05)
        _stop_process(self._sink_proc, timeout)
        self._sink.join(timeout)
        for proc in (self._sender_proc, self._sink_proc):
            if proc is not None and proc.stdout is not None:
                proc.stdout.close()


if __name__ == "__main__":
    sys.exit(main())
