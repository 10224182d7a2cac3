"""The emulated cluster: namespaces, shaped links, live rate changes, cross-traffic.

Tests marked ``root`` build real network namespaces (each its own testbed, torn
down at the end) and are skipped, with the reason, when not run as root.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mlfabric.errors import ConfigError
from mlfabric.tools import testbed_cli
from mlfabric.tools.testbed import (
    STATE_DIR,
    Burst,
    SetRate,
    Shaping,
    StartTraffic,
    StopTraffic,
    Testbed,
    cleanup,
    list_runs,
    require_root,
)
from mlfabric.tools.traffic import TokenBucket, rate_mbit

from testbed_helpers import (
    TCP_EFFICIENCY,
    TcpFlow,
    icmp_ping,
    median_sample_mbit,
    needs_root,
    our_namespaces,
    udp_pair,
    udp_train_mbit,
)

REPO = Path(__file__).resolve().parent.parent
IP_MTU_DISCOVER, IP_PMTUDISC_DO = 10, 2  # <linux/in.h>; the socket module lacks them


# --------------------------------------------------------------------------- without root


def test_require_root_refuses_non_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match=r"needs root.*sudo.*CI as root"):
        require_root()
    tb = Testbed(hosts=2, rate_mbit=10)
    with pytest.raises(ConfigError, match="needs root"), tb:
        pass  # pragma: no cover


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hosts": 0}, "hosts must be"),
        ({"hosts": 300}, "hosts must be"),
        ({"rate_mbit": -5}, "rate_mbit must be a finite rate"),
        ({"rate_mbit": "fast"}, "rate_mbit must be a number"),
        ({"delay_ms": -1}, "delay_ms must be >= 0"),
        ({"rates": {"h9": (10, 10)}}, "rates names host 'h9'"),
        ({"rates": {"h0": 10}}, r"rates\['h0'\] must be \(up_mbit, down_mbit\)"),
        ({"run_id": "XYZ!"}, "run_id must be 4 lowercase hex"),
        ({"mtu": 1000}, r"mtu must be an integer number of bytes from 1280 to 9000 \(1500 is "
                        r"Ethernet's, 9000 a jumbo frame\), got 1000"),
        ({"mtu": 65535}, "mtu must be .* got 65535"),
        ({"mtu": "9000"}, "mtu must be .* got '9000'"),
    ],
)
def test_bad_settings_are_config_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Testbed(**kwargs)


def test_per_host_rates_override_defaults() -> None:
    tb = Testbed(hosts=3, rate_mbit=100, down_mbit=40, rates={"h1": (10, None)})
    assert tb._link_rates == {"h0": (100, 40), "h1": (10, 40), "h2": (100, 40)}


def test_shaping_keeps_bucket_small_and_queue_moderate() -> None:
    slow, fast = Shaping.for_rate(10), Shaping.for_rate(200)
    assert slow.burst_bytes == 2 * 1514  # two frames at low rates
    assert fast.burst_bytes == 25_000  # 1 ms at 200 Mbit/s
    assert fast.limit_bytes == 1_250_000  # 50 ms at 200 Mbit/s
    assert slow.limit_bytes == 64 * 1024  # floor
    assert fast.tbf_args()[:3] == ["tbf", "rate", "200000kbit"]
    # tbf drops a packet larger than its bucket: with jumbo frames it holds two of them.
    assert Shaping.for_rate(10, frame_bytes=9014).burst_bytes == 2 * 9014
    assert Shaping.for_rate(200, frame_bytes=9014).burst_bytes == 25_000


def test_a_burst_is_bytes_or_time_at_the_rate_as_real_shapers_have() -> None:
    """Issue 32: shapers with the buckets users meet (64 KB, 10 ms at rate)."""
    assert Burst.parse("64KB") == Burst(nbytes=64_000)
    assert Burst.parse("100KiB") == Burst(nbytes=102_400)
    assert Burst.parse("10ms") == Burst(seconds=0.01)
    assert str(Burst.parse("10ms")) == "10ms" and str(Burst.parse("64KB")) == "64000B"
    assert Shaping.for_rate(200, burst=Burst.parse("64KB")).burst_bytes == 64_000
    assert Shaping.for_rate(200, burst=Burst.parse("10ms")).burst_bytes == 250_000
    # the queue holds two buckets at least, so a full bucket never overflows it
    assert Shaping.for_rate(10, burst=Burst.parse("100KB")).limit_bytes == 200_000
    assert Shaping.for_rate(10, burst=Burst.parse("1500B")).burst_bytes == 2 * 1514
    for bad, why in (("64", "bytes .* or time at the rate"), ("0ms", r"not in \(0, 1 s\]"),
                     ("100MB", r"not in \(0, 64 MiB\]"), ("fast", "got 'fast'")):
        with pytest.raises(ConfigError, match=why):
            Burst.parse(bad)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_paces_to_rate() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate_bytes=1000, burst=3000, clock=clock)
    assert [bucket.delay(1000) for _ in range(3)] == [0.0, 0.0, 0.0]  # the burst
    assert bucket.delay(1000) == pytest.approx(1.0)  # empty: wait one second
    clock.now = 1.0
    assert bucket.delay(1000) == 0.0
    clock.now = 100.0  # a long pause saves up at most one burst
    assert [bucket.delay(1000) for _ in range(4)][-1] == pytest.approx(1.0)
    big = TokenBucket(rate_bytes=1000, burst=500, clock=clock)
    assert big.delay(2000) == 0.0  # larger than the bucket: goes when the bucket is full
    assert big.delay(100) > 0


def test_token_bucket_long_run_rate() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate_bytes=10_000, burst=2800, clock=clock)
    sent = 0
    while clock.now < 10.0:
        wait = bucket.delay(1400)
        if wait > 0:
            clock.now += max(wait, 0.001)
        else:
            sent += 1400
    assert sent / 10.0 == pytest.approx(10_000, rel=0.03)


def test_rate_mbit_needs_two_samples() -> None:
    from mlfabric.tools.traffic import Sample

    samples = [Sample(1.0, 0), Sample(2.0, 1_250_000)]
    assert rate_mbit(samples, 0.0, 3.0) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="fewer than two"):
        rate_mbit(samples, 1.5, 3.0)


# --------------------------------------------------------------------------- with root


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


@pytest.mark.root
@needs_root
def test_namespaces_links_and_shaping_exist_while_up_and_vanish_after() -> None:
    root_links_before = _ip("-o", "link", "show")
    with Testbed(hosts=3, rate_mbit=100, rates={"h2": (30, 20)}) as tb:
        run = tb.run_id
        expected = {f"mlfabric-{run}-sw", *(f"mlfabric-{run}-h{i}" for i in range(3))}
        assert set(our_namespaces(run)) == expected
        assert [h.name for h in tb.hosts] == ["h0", "h1", "h2"]
        assert tb.host("h1") is tb.hosts[1] and tb.host(2) is tb.hosts[2]
        sw_links = _ip("-n", tb.switch_netns, "-o", "link", "show")
        assert tb.bridge in sw_links
        for h in tb.hosts:
            assert h.ip.startswith(("198.18.", "198.19.")) and h.ip.endswith(f".{h.index + 1}")
            assert len(h.ifname) <= 15 and len(h.switch_port) <= 15
            assert f"{h.switch_port}@" in sw_links and f"master {tb.bridge}" in sw_links
            addrs = _ip("-n", h.netns, "-o", "addr", "show", "dev", h.ifname)
            assert f"inet {h.ip}/24" in addrs
            lo = _ip("-n", h.netns, "-o", "link", "show", "lo")
            assert "UP" in lo and "LOWER_UP" in lo
        q = tb.qdiscs("h2")
        assert "tbf" in q["up"] and "30Mbit" in q["up"]
        assert "tbf" in q["down"] and "20Mbit" in q["down"]
        assert "100Mbit" in tb.qdiscs("h0")["up"]
        assert tb.rates()["h2"] == (30, 20)
        # A live change (netlink) leaves exactly the qdisc a fresh `tc` build makes.
        tb.set_rate("h0", up=30, down=20)
        assert tb.qdiscs("h0") == q and tb.rates()["h0"] == (30, 20)
        state = json.loads((Path(STATE_DIR) / f"{run}.json").read_text())
        assert state["pid"] == os.getpid()
        # Nothing of the testbed is in the root namespace.
        assert _ip("-o", "link", "show") == root_links_before
    assert our_namespaces(run) == []
    assert not (Path(STATE_DIR) / f"{run}.json").exists()
    with pytest.raises(ConfigError, match="not up"):
        tb.set_rate("h0", up=10)


@pytest.mark.root
@needs_root
def test_exception_in_block_tears_down_and_kills_processes() -> None:
    with pytest.raises(RuntimeError, match="boom"), Testbed(hosts=2, rate_mbit=None) as tb:
        run = tb.run_id
        proc = tb.popen("h0", [sys.executable, "-c", "import time; time.sleep(60)"])
        assert len(our_namespaces(run)) == 3
        raise RuntimeError("boom")
    assert our_namespaces(run) == []
    assert proc.wait(timeout=1) is not None


@pytest.mark.root
@needs_root
def test_host_enter_switches_only_the_calling_thread_and_restores() -> None:
    def netns_inode() -> int:
        return os.stat("/proc/thread-self/ns/net").st_ino

    before = netns_inode()
    with Testbed(hosts=2, rate_mbit=None) as tb:
        h0 = tb.host("h0")
        with pytest.raises(KeyError), h0.enter():
            assert netns_inode() == os.stat(h0.netns_path).st_ino
            names = [name for _, name in socket.if_nameindex()]
            assert sorted(names) == sorted(["lo", h0.ifname])
            raise KeyError("leaves the namespace on errors too")
        assert netns_inode() == before


@pytest.mark.root
@needs_root
def test_asyncio_server_in_a_thread_lives_in_its_host() -> None:
    with Testbed(hosts=2, rate_mbit=100) as tb:
        h0, h1 = tb.hosts
        listening = threading.Event()
        stop = threading.Event()
        errors: list[BaseException] = []

        async def serve() -> None:
            async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                writer.write(await reader.readline())
                await writer.drain()
                writer.close()

            server = await asyncio.start_server(echo, h1.ip, 7400)
            listening.set()
            async with server:
                while not stop.is_set():
                    await asyncio.sleep(0.01)

        def host_thread() -> None:
            try:
                with h1.enter():
                    asyncio.run(serve())
            except BaseException as exc:
                errors.append(exc)
                listening.set()

        thread = threading.Thread(target=host_thread)
        thread.start()
        try:
            assert listening.wait(5.0) and not errors, errors
            with h0.enter():
                conn = socket.create_connection((h1.ip, 7400), timeout=2)
            with conn:
                conn.sendall(b"ping\n")
                assert conn.recv(16) == b"ping\n"
            # The listening socket is in h1's namespace, not in this thread's.
            port = f":{7400:04X} "
            with h1.enter():
                assert port in Path("/proc/thread-self/net/tcp").read_text()
            assert port not in Path("/proc/thread-self/net/tcp").read_text()
        finally:
            stop.set()
            thread.join(5.0)
        assert not errors, errors


@pytest.mark.root
@needs_root
def test_two_testbeds_at_once_are_isolated() -> None:
    # Same subnet on purpose: the addresses collide, the networks must not.
    with (
        Testbed(hosts=2, rate_mbit=None, subnet=7) as a,
        Testbed(hosts=2, rate_mbit=None, subnet=7) as b,
    ):
        assert a.run_id != b.run_id
        assert set(our_namespaces(a.run_id)).isdisjoint(our_namespaces(b.run_id))
        assert a.hosts[1].ip == b.hosts[1].ip
        # Each host reaches its own peer; a's h1 answers a's h0 only.
        assert icmp_ping(a.hosts[0], a.hosts[1].ip)
        assert icmp_ping(b.hosts[0], b.hosts[1].ip)
        with a.hosts[1].enter():
            srv = socket.create_server((a.hosts[1].ip, 0))
        port = srv.getsockname()[1]
        with srv, b.hosts[0].enter(), pytest.raises(ConnectionRefusedError):
            socket.create_connection((b.hosts[1].ip, port), timeout=2).close()
        b_run = b.run_id
        a.close()
        assert our_namespaces(a.run_id) == [] and len(our_namespaces(b_run)) == 3
        assert icmp_ping(b.hosts[0], b.hosts[1].ip)
    assert our_namespaces(b_run) == []


@pytest.mark.root
@needs_root
def test_hosts_reach_each_other_and_nothing_else() -> None:
    with Testbed(hosts=3, rate_mbit=100) as tb:
        h0, h1, _h2 = tb.hosts
        assert icmp_ping(h0, h1.ip)
        assert not icmp_ping(h0, tb.subnet.replace(".0/24", ".200"), timeout=0.3)
        with h1.enter():
            srv = socket.create_server((h1.ip, 0))
        with srv:
            with h0.enter():
                conn = socket.create_connection((h1.ip, srv.getsockname()[1]), timeout=2)
            peer, _ = srv.accept()
            with conn, peer:
                conn.sendall(b"hello")
                assert peer.recv(5) == b"hello"
        routes = _ip("-n", h0.netns, "-4", "route", "show")
        assert "default" not in routes and routes.count("\n") == 1
        with h0.enter():
            for outside in ("8.8.8.8", "10.0.0.1", "127.0.0.53"):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                with s, pytest.raises(OSError) as info:
                    s.settimeout(1)
                    s.connect((outside, 53))
                assert info.value.errno in (errno.ENETUNREACH, errno.ECONNREFUSED)


@pytest.mark.root
@needs_root
@pytest.mark.parametrize("rate", [50, 200])
def test_tcp_bulk_transfer_measures_the_shaped_rate(rate: float) -> None:
    # 2.6 s measured, not 1.2: in one fresh-clone CI run the 50 Mbit/s flow
    # delivered nothing in most 100 ms windows of 1.2 s (mean 22.8, median
    # 0): the processes stalled about 0.6 s on the loaded 2-core host. The
    # median of a longer run is the shaped rate through a stall of up to 1.3 s.
    with Testbed(hosts=2, rate_mbit=rate) as tb:
        flow = TcpFlow(tb.host("h0"), tb.host("h1"))
        transfer = flow.run_for(3.0)
    t0 = transfer.marks[0][0]
    mean = transfer.mbit(t0 + 0.4, t0 + 3.0)
    median = transfer.median_mbit(t0 + 0.4, t0 + 3.0)
    expected = rate * TCP_EFFICIENCY
    print(
        f"shaped {rate} Mbit/s: TCP goodput mean {mean:.1f}, median of 100 ms windows "
        f"{median:.1f} Mbit/s (expected {expected:.1f})"
    )
    assert median == pytest.approx(expected, rel=0.10)
    # looser: the mean includes such stalls (0.6 s of that run's 1.2 would be
    # a quarter of 2.6 s)
    assert mean == pytest.approx(expected, rel=0.30)


@pytest.mark.root
@needs_root
def test_jumbo_frames_cross_the_switch_whole_at_the_shaped_rate() -> None:
    with Testbed(hosts=2, rate_mbit=50, mtu=9000) as tb:
        h0, h1 = tb.host("h0"), tb.host("h1")
        for h in tb.hosts:
            for ns, dev in ((h.netns, h.ifname), (tb.switch_netns, h.switch_port)):
                assert " mtu 9000 " in _ip("-n", ns, "-o", "link", "show", dev)
        # One 9000-byte IP packet, not to be fragmented: it arrives only if every
        # hop (both veths, the bridge, tbf's bucket) takes a jumbo frame.
        tx, rx = udp_pair(h0, h1)
        with rx, tx:
            tx.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
            tx.send(bytes(9000 - 28))
            assert len(rx.recv(65536)) == 9000 - 28
        transfer = TcpFlow(h0, h1).run_for(1.6)
    t0 = transfer.marks[0][0]
    median = transfer.median_mbit(t0 + 0.4, t0 + 1.6)
    expected = 50 * (9000 - 52) / 9014  # TCP payload per jumbo frame on the wire
    print(f"shaped 50 Mbit/s, MTU 9000: TCP goodput median {median:.1f} Mbit/s "
          f"(expected {expected:.1f})")
    assert median == pytest.approx(expected, rel=0.10)


@pytest.mark.root
@needs_root
@pytest.mark.parametrize("rate", [50, 200])
def test_short_packet_trains_see_the_shaped_rate(rate: float) -> None:
    # The bucket is small (1 ms at the rate), so a 60-packet train is spaced out.
    with Testbed(hosts=2, rate_mbit=rate) as tb:
        measured = [udp_train_mbit(tb.host("h0"), tb.host("h1")) for _ in range(3)]
    print(f"shaped {rate} Mbit/s: 60-packet UDP trains measured {measured} Mbit/s (wire)")
    assert sorted(measured)[1] == pytest.approx(rate, rel=0.10)


@pytest.mark.root
@needs_root
def test_scheduled_rate_change_takes_effect_within_tens_of_ms() -> None:
    with Testbed(hosts=2, rate_mbit=200) as tb:
        flow = TcpFlow(tb.host("h0"), tb.host("h1"))
        flow.start()
        # after 2.5 s: TCP's slow start overshoots the bucket's queue, and a
        # retransmission timeout there once left the flow silent for 100+ ms;
        # in a CI run the flow still ran at half the rate 1.0-1.5 s in
        at = 2.5
        sched = tb.schedule([(at, SetRate("h1", down=50))])
        assert sched.wait(5.0)
        change = sched.t0 + sched.applied[0].finished
        time.sleep(max(0.0, change + 1.0 - time.monotonic()))  # the window passes
        transfer = flow.stop()
        assert tb.host("h1").down_mbit == 50
        assert "50Mbit" in tb.qdiscs("h1")["down"]
    before = transfer.median_mbit(change - 0.5, change)
    after = transfer.median_mbit(change + 0.1, change + 1.0)
    # Reaction: from the set_rate call until a 25 ms window runs at the new rate.
    called = sched.t0 + sched.applied[0].started
    reaction = next(
        ms
        for ms in range(0, 300, 5)
        if transfer.mbit(called + ms / 1000, called + ms / 1000 + 0.025) < 1.2 * 50
    )
    print(
        f"set_rate 200->50: before {before:.1f}, after {after:.1f} Mbit/s, "
        f"reaction {reaction} ms; applied {sched.applied[0].started - at:+.4f} s late, "
        f"set_rate took {1000 * (sched.applied[0].finished - sched.applied[0].started):.2f} ms"
    )
    assert before == pytest.approx(200 * TCP_EFFICIENCY, rel=0.10)
    assert after == pytest.approx(50 * TCP_EFFICIENCY, rel=0.10)
    assert reaction <= 50
    assert sched.applied[0].started - at < 0.25  # thread wake-up on a loaded machine
    assert sched.applied[0].finished - sched.applied[0].started < 0.05


@pytest.mark.root
@needs_root
def test_udp_cross_traffic_delivers_its_rate_and_schedules_start_stop() -> None:
    with Testbed(hosts=3, rate_mbit=100) as tb:
        sched = tb.schedule(
            [
                (0.0, StartTraffic("tenant", "h2", "h0", rate_mbit=40, proto="udp")),
                (1.6, StopTraffic("tenant")),
            ]
        )
        assert sched.wait(10.0)
        handle = sched.handles["tenant"]
        assert not handle.running
        samples = handle.received_samples
        window = (samples[0].time + 0.3, handle.sent_samples[-1].time)
        rx = rate_mbit(samples, *window)
        rx_median = median_sample_mbit(samples, *window)
        print(f"UDP cross-traffic at 40 Mbit/s: sink mean {rx:.1f}, median {rx_median:.1f} Mbit/s")
        assert rx_median == pytest.approx(40, rel=0.10)
        assert rx == pytest.approx(40, rel=0.20)
        assert handle.bytes_sent > 0
        assert handle.bytes_received == pytest.approx(handle.bytes_sent, rel=0.02)
        # TCP bulk cross-traffic fills its shaped path; stop() ends both sides.
        bulk = tb.cross_traffic("h1", "h0")
        time.sleep(1.0)  # a measurement window passes
        bulk.stop()
        samples = bulk.received_samples
        flowing = next(s.time for s in samples if s.total > 0)
        tcp = median_sample_mbit(samples, flowing + 0.2, bulk.sent_samples[-1].time)
        print(f"TCP bulk cross-traffic on 100 Mbit/s links: median {tcp:.1f} Mbit/s")
        assert tcp == pytest.approx(100 * TCP_EFFICIENCY, rel=0.10)
        assert bulk.bytes_sent >= bulk.bytes_received > 0


@pytest.mark.root
@needs_root
def test_bad_schedules_are_refused_up_front() -> None:
    with Testbed(hosts=2, rate_mbit=None) as tb:
        with pytest.raises(ConfigError, match="before any StartTraffic"):
            tb.schedule([(1.0, StopTraffic("x"))])
        with pytest.raises(ConfigError, match="no host 'h7'"):
            tb.schedule([(0.0, SetRate("h7", up=5))])
        with pytest.raises(ConfigError, match="seconds >= 0"):
            tb.schedule([(-1, SetRate("h0", up=5))])
        with pytest.raises(ConfigError, match="UDP cross-traffic needs rate_mbit"):
            tb.cross_traffic("h0", "h1", proto="udp")
        # Callables run in order; the first failure stops the schedule, wait() raises it.
        calls: list[str] = []

        def fail() -> None:
            raise ValueError("action failed")

        failing = tb.schedule(
            [(0.0, lambda: calls.append("a")), (0.01, fail), (0.02, lambda: calls.append("c"))]
        )
        with pytest.raises(ValueError, match="action failed"):
            failing.wait(5.0)
        assert calls == ["a"] and failing.done
        # A pending schedule is cancelled at teardown, promptly.
        sched = tb.schedule([(30.0, SetRate("h0", up=5))])
    assert sched.done and sched.applied == []


@pytest.mark.root
@needs_root
def test_delay_needs_netem_or_adds_latency() -> None:
    try:
        tb = Testbed(hosts=2, rate_mbit=100, delay_ms=5).start()
    except ConfigError as exc:
        assert "netem" in str(exc)
        assert not [r for r in list_runs() if r.owner_pid == os.getpid()]
        return
    with tb:
        h0, h1 = tb.hosts
        with h1.enter():
            srv = socket.create_server((h1.ip, 0))
        with srv, h0.enter():
            t = time.monotonic()
            socket.create_connection((h1.ip, srv.getsockname()[1]), timeout=2).close()
            rtt = time.monotonic() - t
        assert 0.009 < rtt < 0.05  # 5 ms on each uplink


def _default_signals() -> None:
    """The owner starts as a shell would start it: every signal unblocked and
    handled by default. A child inherits ignored signals and the signal mask
    from whoever runs the suite; the testbed rightly leaves an ignored SIGHUP
    ignored (nohup), and in two full CI runs the SIGHUP case timed out while
    it passed alone, so the test sets the state it is about."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


@pytest.fixture
def spawn_owner() -> Iterator[Callable[[], tuple[subprocess.Popen[str], str]]]:
    """Start a separate Python process that builds a testbed and prints its run id.

    Whatever the test does, the process and its testbed are gone afterwards.
    """
    code = textwrap.dedent(
        """
        import time
        from mlfabric.tools.testbed import Testbed
        tb = Testbed(hosts=2, rate_mbit=50).start()
        tb.popen("h0", ["sleep", "60"])
        print(tb.run_id, flush=True)
        with tb:
            time.sleep(60)
        """
    )
    spawned: list[tuple[subprocess.Popen[str], str]] = []

    def spawn() -> tuple[subprocess.Popen[str], str]:
        env = dict(os.environ)
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            preexec_fn=_default_signals,
        )
        spawned.append((proc, ""))
        ready, _, _ = select.select([proc.stdout], [], [], 15)
        assert ready, "the testbed owner did not start within 15 s"
        assert proc.stdout is not None
        run = proc.stdout.readline().strip()
        assert run, f"the testbed owner failed (exit {proc.poll()})"
        spawned[-1] = (proc, run)
        return proc, run

    yield spawn
    for proc, run in spawned:
        try:
            if proc.poll() is None:
                proc.kill()
            # wait, not communicate: a process the owner started in a host
            # (its `sleep 60`) may still hold the pipes if the owner died
            # before its teardown killed it.
            proc.wait(timeout=5)
        finally:
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
            if run and our_namespaces(run):
                cleanup(run=run, include_live=True)


def _cli(*argv: str, capsys: pytest.CaptureFixture[str]) -> str:
    parser = argparse.ArgumentParser()
    testbed_cli.add_arguments(parser)
    assert testbed_cli.run(parser.parse_args(list(argv))) == 0
    return capsys.readouterr().out


@pytest.mark.root
@needs_root
def test_testbed_down_removes_leftovers_of_a_killed_run(
    spawn_owner: Callable[[], tuple[subprocess.Popen[str], str]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    proc, run = spawn_owner()
    proc.kill()
    proc.wait(5)
    assert len(our_namespaces(run)) == 3
    sleeper = [int(p) for p in _ip("netns", "pids", f"mlfabric-{run}-h0").split()]
    assert sleeper
    with Testbed(hosts=2, rate_mbit=None) as live:
        assert f"run {run}: LEFTOVER" in _cli("status", capsys=capsys)
        out = _cli("down", capsys=capsys)
        assert f"removed run {run}" in out
        assert f"kept run {live.run_id}" in out
        assert our_namespaces(run) == []
        assert len(our_namespaces(live.run_id)) == 3  # a live run is not a leftover
        for pid in sleeper:
            assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
        assert all(r.run != run for r in list_runs())


@pytest.mark.root
@needs_root
@pytest.mark.parametrize(
    ("sig", "times", "raised"),
    [
        (signal.SIGINT, 1, "KeyboardInterrupt"),
        (signal.SIGINT, 2, "KeyboardInterrupt"),  # a second Ctrl-C during teardown
        (signal.SIGTERM, 1, ""),
        (signal.SIGHUP, 1, ""),
    ],
    ids=["SIGINT", "SIGINT-twice", "SIGTERM", "SIGHUP"],
)
def test_signals_tear_the_testbed_down(
    spawn_owner: Callable[[], tuple[subprocess.Popen[str], str]],
    sig: signal.Signals,
    times: int,
    raised: str,
) -> None:
    proc, run = spawn_owner()
    assert len(our_namespaces(run)) == 3
    for _ in range(times):
        proc.send_signal(sig)
        time.sleep(0.005)
    _, err = proc.communicate(timeout=10)
    # KeyboardInterrupt propagates (not swallowed: Python then dies of SIGINT);
    # SIGTERM and SIGHUP exit with 128 + signal number after the teardown.
    assert proc.returncode == (-sig if sig == signal.SIGINT else 128 + sig), err
    assert raised in err
    assert our_namespaces(run) == []
    assert all(r.run != run for r in list_runs())


@pytest.mark.root
@needs_root
def test_cli_up_prints_hosts_and_tears_down_on_ctrl_c() -> None:
    code = textwrap.dedent(
        """
        import argparse, sys
        from mlfabric.tools import testbed_cli
        parser = argparse.ArgumentParser()
        testbed_cli.add_arguments(parser)
        sys.exit(testbed_cli.run(parser.parse_args(sys.argv[1:])))
        """
    )
    env = dict(os.environ)
    argv = [sys.executable, "-c", code, "up", "--hosts", "2", "--rate", "20", "--down-mbit", "10"]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: [lines.put(x.strip()) for x in proc.stdout or []])
    reader.start()
    try:
        seen = [lines.get(timeout=15)]
        while not seen[-1].startswith("press Ctrl-C"):
            seen.append(lines.get(timeout=5))
        run = seen[0].split()[1]
        assert len(our_namespaces(run)) == 3
        assert any(line.startswith("h1 ") and "up=20Mbit/s  down=10Mbit/s" in line for line in seen)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
        assert f"testbed {run} torn down" in (proc.stderr.read() if proc.stderr else "")
        assert our_namespaces(run) == []
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # lets it tear down even when the test failed
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        reader.join(5)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
