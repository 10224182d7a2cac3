"""The agent daemon on loopback: probing, API, faults, restarts, shutdown, CLI.

Every async test runs on asyncio's loop and on uvloop (the `run_async` fixture
of conftest.py; an exception reaching the loop's handler fails the test).
Measured values on loopback mean nothing (no bottleneck); the emulated-cluster
tests (test_agent_testbed.py) check the numbers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from mlfabric.agent.cli import add_arguments, build_config
from mlfabric.agent.daemon import (
    Agent,
    AgentClient,
    AgentConfig,
    parse_hostport,
    parse_peer,
    query_estimates,
    read_net_dev,
)
from mlfabric.agent.estimator import PathEstimator, ProbeConfig
from mlfabric.errors import ConfigError, ProtocolError
from mlfabric.runtime.metrics import AgentMetrics
from mlfabric.wire import agent_protocol as probe

from support import (
    CLUSTER,
    CLUSTER_TOKEN,
    JOB_AGENT_KEY,
    TOKEN,
    agent_key_file,
    cluster_token_file,
    free_port,
    secret_file,
)

LOCAL = "127.0.0.1"
# Small trains: loopback has no bottleneck, every train is "sender-limited".
PROBE = ProbeConfig(max_packets=64, initial_bps=50e6, stale_after=0.5)


def _config(name: str, port: int = 0, **kw) -> AgentConfig:
    kw.setdefault("probe", PROBE)
    kw.setdefault("counters", None)
    kw.setdefault("backoff_max", 0.2)
    kw.setdefault("cluster_token", CLUSTER_TOKEN)
    return AgentConfig(name=name, host=LOCAL, port=port, **kw)


async def _pair(metrics: bool = False, **kw) -> tuple[Agent, Agent]:
    a = Agent(_config("a", **kw), metrics=AgentMetrics() if metrics else None)
    b = Agent(_config("b", **kw), metrics=AgentMetrics() if metrics else None)
    await a.start()
    await b.start()
    a.set_peers({"b": (LOCAL, b.port)})
    b.set_peers({"a": (LOCAL, a.port)})
    return a, b


async def _measured(agent: Agent, peer: str, timeout: float = 5.0) -> None:
    """Wait (train by train, bounded) until `agent` has a fresh estimate of `peer`."""
    deadline = time.monotonic() + timeout
    while agent.estimates()[peer][0].stale:
        await agent.wait_trains(peer, 1, timeout=max(0.01, deadline - time.monotonic()))


async def _stop(*agents: Agent) -> None:
    for ag in agents:
        await asyncio.wait_for(ag.stop(), 10)


async def _raw_control(port: int, data: bytes) -> bytes:
    """Send raw bytes on a control connection; return what came back until close."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(LOCAL, port), 2)
    writer.write(data)
    await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()
    got = await asyncio.wait_for(reader.read(), 2)
    writer.close()
    return got


# --- probing and the API ---------------------------------------------------------


def test_agents_probe_each_other_and_serve_estimates(run_async) -> None:
    async def main() -> None:
        a, b = await _pair(metrics=True)
        try:
            await _measured(a, "b")
            await _measured(b, "a")
            async with await AgentClient.connect(LOCAL, a.port, CLUSTER) as client:
                est = await client.estimates()
            assert est.agent == "a"
            (e,) = est.estimates
            assert e.peer == "b" and e.connected and not e.stale
            assert e.bandwidth_bps > 0 and e.capacity_bps > 0 and e.samples >= 1
            assert 0 <= e.age_s < PROBE.stale_after
            assert e.rtt_s > 0
            m = a.metrics
            assert m is not None
            assert m.probe_sent_bytes.labels("b")._value.get() > 0
            assert m.peer_connected.labels("b")._value.get() == 1
            assert b.metrics.probe_received_bytes.labels("a")._value.get() > 0  # type: ignore
        finally:
            await _stop(a, b)

    run_async(main())


def test_estimates_of_an_agent_without_peers_are_empty(run_async) -> None:
    async def main() -> None:
        a = Agent(_config("a"))
        await a.start()
        try:
            async with await AgentClient.connect(LOCAL, a.port, CLUSTER) as client:
                est = await client.estimates()
            assert est == probe.Estimates(1, "a", ())
        finally:
            await _stop(a)

    run_async(main())


def test_transfer_reports_feed_the_passive_estimate(run_async) -> None:
    async def main() -> None:
        metrics = AgentMetrics()
        a = Agent(_config("a", peers={"b": (LOCAL, 9)}), metrics=metrics)  # b never answers
        await a.start()
        try:
            async with await AgentClient.connect(LOCAL, a.port, CLUSTER) as client:
                await client.report_transfer("b", 8 * 2**20, 0.5)
                await client.report_transfer("nobody", 8 * 2**20, 0.5)
                est = await client.estimates()  # answered after the reports: in order
            (e,) = est.estimates
            assert e.bandwidth_bps == pytest.approx(8 * 2**20 * 8 / 0.5)
            assert not e.stale and not e.connected
            assert metrics.transfer_reports.labels("accepted")._value.get() == 1
            assert metrics.transfer_reports.labels("unknown_peer")._value.get() == 1
        finally:
            await _stop(a)

    run_async(main())


def test_a_transfer_report_faster_than_the_link_is_refused_and_never_averaged_in(
        run_async, caplog) -> None:
    """Issue 32: a fabricated report (50 MB in 1 ms, 400 Gbit/s) must not set
    an estimate; and no estimate is reported above the link's limit."""
    async def main() -> None:
        metrics = AgentMetrics()
        cfg = _config("a", peers={"b": (LOCAL, 9)})
        cfg.probe = replace(cfg.probe, max_bps=1e9)  # a 1 Gbit/s NIC
        a = Agent(cfg, metrics=metrics)
        await a.start()
        try:
            async with await AgentClient.connect(LOCAL, a.port, CLUSTER) as client:
                await client.report_transfer("b", 50_000_000, 0.001)
                est = await client.estimates()
                (e,) = est.estimates
                assert math.isnan(e.bandwidth_bps) and e.stale  # nothing learnt
                await client.report_transfer("b", 100_000_000, 1.0)  # 800 Mbit/s: fine
                (e,) = (await client.estimates()).estimates
            assert e.bandwidth_bps == pytest.approx(800e6)
            assert metrics.transfer_reports.labels("refused")._value.get() == 1
            assert metrics.transfer_reports.labels("accepted")._value.get() == 1
        finally:
            await _stop(a)

    with caplog.at_level(logging.WARNING, logger="mlfabric.agent"):
        run_async(main())
    assert "refused a transfer report for b from" in caplog.text
    assert ("50000000 bytes in 0.001 s is 400,000 Mbit/s, above this host's link "
            "(1,000 Mbit/s)") in caplog.text


def test_passive_problems_and_the_estimate_cap() -> None:
    est = PathEstimator(ProbeConfig(max_bps=1e9), clock=lambda: 10.0)
    assert est.passive_problem(10**6, 0.01) is None
    assert est.passive_problem(10**6, 0.0) == "1000000 bytes in 0.0 s is no transfer"
    assert est.passive_problem(10**6, math.nan) == "1000000 bytes in nan s is no transfer"
    assert est.passive_problem(10**9, 1.0) == (
        "1000000000 bytes in 1 s is 8,000 Mbit/s, above this host's link (1,000 Mbit/s)")
    assert not est.on_passive(10**9, 1.0)
    # A capacity sample above the link (a burst let a train through at a
    # faster NIC's pace) is still never reported above the limit.
    est.capacity.add(3e9, 10.0)
    assert est.snapshot(10.0).bandwidth_bps == 1e9


def test_the_nic_speed_is_read_from_the_kernel_and_bounds_the_estimates(tmp_path) -> None:
    from mlfabric.agent.daemon import read_nic_speed

    net_dev = tmp_path / "dev"
    net_dev.write_text("Inter-|\n face |\n    lo: 0 0\n  eth0: 0 0\n  eth1: 0 0\n"
                       "  veth9: 0 0\n")
    sysfs = tmp_path / "net"
    for name, speed in (("lo", "x"), ("eth0", "25000"), ("eth1", "10000"), ("veth9", "-1")):
        (sysfs / name).mkdir(parents=True)
        (sysfs / name / "speed").write_text(speed + "\n")
    paths = dict(sysfs=str(sysfs), net_dev=(str(net_dev),))
    assert read_nic_speed(None, **paths) == 25e9  # the fastest
    assert read_nic_speed("eth1", **paths) == 10e9
    assert read_nic_speed("veth9", **paths) is None  # a virtual NIC says -1: unknown
    assert read_nic_speed("wlan0", **paths) is None
    cfg, _ = build_config(_args(["--nic-mbit", "2500"]))
    assert cfg.probe.max_bps == 2.5e9
    with pytest.raises(ConfigError, match=r"nic-mbit must be the link's speed in Mbit/s, "
                                          r"above 0, got -5\.0"):
        build_config(_args(["--nic-mbit", "-5"]))


def test_while_the_job_transfers_every_path_probes_at_half_the_budget(run_async) -> None:
    """The job's own TCP bytes (the socket counters, here scripted at 80 Mbit/s
    in all) make the host busy: every path's probes take half the budget."""
    job = {"bytes": 0}

    def job_traffic() -> tuple[int, int]:
        job["bytes"] += 1_000_000  # per reading, 0.1 s apart
        return job["bytes"], 0

    async def main() -> None:
        cfg = _config("a", peers={"b": (LOCAL, 9)})
        cfg.counters = lambda: (0, 0)
        cfg.job_traffic = job_traffic
        a = Agent(cfg)
        await a.start()
        try:
            est = a.path("b")
            deadline = asyncio.get_running_loop().time() + 10
            while not est.busy:
                assert asyncio.get_running_loop().time() < deadline, "never busy"
                await asyncio.sleep(0.02)
            assert est.budget() == cfg.probe.budget / 2
        finally:
            await _stop(a)

    run_async(main())


def test_set_peers_from_the_controller(run_async) -> None:
    async def main() -> None:
        a, b = await _pair()
        c = Agent(_config("c", peers={"a": (LOCAL, a.port)}))
        await c.start()
        try:
            async with await AgentClient.connect(LOCAL, a.port, CLUSTER) as client:
                await client.set_peers({"c": (LOCAL, c.port), "a": (LOCAL, a.port)})
                await a.wait_trains("c", 2, timeout=5)
                names = [e.peer for e in (await client.estimates()).estimates]
                assert names == ["c"]  # b dropped, itself ignored
                with pytest.raises(ConfigError, match="port"):
                    await client.set_peers({"x": (LOCAL, 0)})
                assert [e.peer for e in (await client.estimates()).estimates] == ["c"]
        finally:
            await _stop(a, b, c)

    run_async(main())


def test_agents_probing_one_host_divide_the_budget_by_its_senders(run_async) -> None:
    """Two agents probe the hub (one peer each): the hub's reports tell them they
    are two, so each plans for half the budget, as the hub does for its two
    peers through its uplink; when one goes, the other is told it is alone. The
    share is exported (agent_probe_share) for operators and the testbed's tests."""
    async def main() -> None:
        hub = Agent(_config("hub"))
        await hub.start()
        am = AgentMetrics()
        a = Agent(_config("a", peers={"hub": (LOCAL, hub.port)}), metrics=am)

        def exported() -> float | None:
            return am.registry.get_sample_value("mlfabric_agent_probe_share", {"peer": "hub"})

        b = Agent(_config("b", peers={"hub": (LOCAL, hub.port)}))
        await a.start()
        await b.start()
        hub.set_peers({"a": (LOCAL, a.port), "b": (LOCAL, b.port)})
        try:
            await b.wait_trains("hub", 1, timeout=5)
            await a.wait_trains("hub", 1, timeout=5)  # reported once both were there
            for ag in (a, b, hub):
                assert {st.estimator.config.share for st in ag._peers.values()} == {2}
            assert exported() == 2
            await _stop(b)
            deadline = time.monotonic() + 5
            while a._peers["hub"].estimator.config.share != 1:
                await a.wait_trains("hub", 1, timeout=max(0.01, deadline - time.monotonic()))
            assert exported() == 1
        finally:
            await _stop(a, b, hub)

    run_async(main())


def test_blocking_query_helper(run_async) -> None:
    async def main() -> None:
        a, b = await _pair()
        try:
            await a.wait_trains("b", 1, timeout=5)
            est = await asyncio.get_running_loop().run_in_executor(
                None, query_estimates, LOCAL, a.port, CLUSTER, 2.0
            )
            assert [e.peer for e in est.estimates] == ["b"]
        finally:
            await _stop(a, b)

    run_async(main())


async def _load_readings(a: Agent, n: int, timeout: float = 4.0) -> None:
    """Until the agent's load meter holds `n` readings (its task samples on its
    own schedule, so this polls, bounded)."""
    deadline = time.monotonic() + timeout
    while len(a.load._readings) < n:
        assert time.monotonic() < deadline, f"{len(a.load._readings)} of {n} load readings"
        await asyncio.sleep(0.01)


def test_link_load_comes_from_the_counters_less_probes(run_async) -> None:
    async def main() -> None:
        ticks = {"rx": 0, "tx": 0}

        def counters() -> tuple[int, int]:
            # 1 MB/s of other traffic each way, plus whatever the agent probes
            ticks["rx"] += 100_000 + 0
            ticks["tx"] += 100_000
            return ticks["rx"] + a.probe_rx_bytes, ticks["tx"] + a.probe_tx_bytes

        a = Agent(_config("a", counters=counters, load_interval=0.02, load_window=0.2))
        await a.start()
        try:
            await _load_readings(a, 6)
            down, up = a.link_load()  # type: ignore[misc]
            # 100 kB per reading every ~20 ms: about 40 Mbit/s; probes excluded exactly
            assert 10e6 < down < 60e6 and 10e6 < up < 60e6
        finally:
            await _stop(a)

    run_async(main())


def test_the_jobs_own_traffic_is_not_load_and_estimates_carry_the_host_load(
        run_async) -> None:
    """NIC counters move 100 kB per reading each way, 60 kB of it the job's
    own down and 100 kB of it up: the load left is the other 40 kB down, 0 up;
    the Estimates event carries it (payload bit/s), and the metric counts the
    job's bytes."""
    async def main() -> None:
        ticks = {"nic": 0, "job_rx": 0, "job_tx": 0}

        def counters() -> tuple[int, int]:
            return ticks["nic"] + a.probe_rx_bytes, ticks["nic"] + a.probe_tx_bytes

        def job() -> tuple[int, int]:
            # called first in each reading: the step happens here
            ticks["nic"] += 100_000
            ticks["job_rx"] += 60_000
            ticks["job_tx"] += 100_000
            return ticks["job_rx"], ticks["job_tx"]

        metrics = AgentMetrics()
        a = Agent(_config("a", counters=counters, job_traffic=job, load_interval=0.02,
                          load_window=0.2), metrics=metrics)
        await a.start()
        try:
            await _load_readings(a, 6)
            down, up = a.link_load()  # type: ignore[misc]
            readings = a.load._readings
            dt = readings[-1][0] - readings[0][0]
            steps = len(readings) - 1
            assert down == pytest.approx(steps * 40_000 * 8 / dt) and up == 0.0
            est = a._estimates_event(7)  # no await: the same readings as link_load()
            ratio = a.config.probe.payload_ratio
            assert (est.down_load_bps, est.up_load_bps) == (down * ratio, 0.0)
            rx = metrics.registry.get_sample_value("mlfabric_agent_job_traffic_bytes_total",
                                                   {"direction": "rx"})
            assert rx == a.job_rx_bytes > 0
        finally:
            await _stop(a)

    run_async(main())


def test_unreadable_job_counters_warn_once_and_count_as_load(run_async, caplog) -> None:
    async def main() -> None:
        calls = []

        def job() -> tuple[int, int]:
            calls.append(1)
            raise PermissionError(1, "Operation not permitted")

        nic = {"n": 0}

        def counters() -> tuple[int, int]:
            nic["n"] += 50_000
            return nic["n"], nic["n"]

        a = Agent(_config("a", counters=counters, job_traffic=job, load_interval=0.02))
        await a.start()
        try:
            await _load_readings(a, 4)
            down, up = a.link_load()  # type: ignore[misc]
            assert down > 0 and up > 0 and len(calls) == 1
        finally:
            await _stop(a)

    with caplog.at_level("WARNING", logger="mlfabric.agent"):
        run_async(main())
    warnings = [r.message for r in caplog.records if "job's TCP counters" in r.message]
    assert len(warnings) == 1 and "Operation not permitted" in warnings[0]


def test_receiver_flags_trains_that_overlap(run_async) -> None:
    """Two agents' trains reaching one host at once share its downlink: both reports
    say so, and a train alone does not."""

    async def main() -> None:
        a = Agent(_config("a"))
        await a.start()
        try:
            sent: list[probe.TrainReport] = []

            class FakeControl:
                peer_name = "x"

                def send(self, ev) -> None:
                    sent.append(ev)

            a._sessions[1] = a._sessions[2] = FakeControl()  # type: ignore[assignment]

            def train(session: int, train_id: int, start_ns: int, n: int = 5) -> list:
                return [(probe.encode_datagram(session, train_id, i, n, 0, 100),
                         start_ns + i * 1000) for i in range(n)]

            a_train, b_train = train(1, 1, 0), train(2, 1, 2500)  # interleaved in time
            for (d1, t1), (d2, t2) in zip(a_train, b_train, strict=True):
                a._on_datagram(d1, t1)
                a._on_datagram(d2, t2)
            for d, t in train(1, 2, 10**9):  # a second later, alone
                a._on_datagram(d, t)
            assert [(r.session, r.train, r.overlapped) for r in sent] == [
                (1, 1, True), (2, 1, True), (1, 2, False)
            ]
            assert all(len(r.arrivals) == 5 for r in sent)
        finally:
            await _stop(a)

    run_async(main())


# --- faults ----------------------------------------------------------------------


def test_bad_and_truncated_datagrams_are_counted_and_ignored(run_async) -> None:
    async def main() -> None:
        a, b = await _pair(metrics=True)
        try:
            await b.wait_trains("a", 1, timeout=5)
            good = probe.encode_datagram(1, 1, 0, 2, 0, 200)
            junk = [b"", b"x", good[:20], b"XXXX" + good[4:], good]  # last: unknown session
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                for d in junk:
                    s.sendto(d, (LOCAL, a.port))
            finally:
                s.close()
            await b.wait_trains("a", 2, timeout=5)  # a still answers b's trains
            await _measured(a, "b")
            assert a.bad_datagrams >= len(junk) - 1  # an empty datagram may not arrive
            assert a.metrics.bad_messages.labels("datagram")._value.get() == a.bad_datagrams  # type: ignore
            est = await (await AgentClient.connect(LOCAL, a.port, CLUSTER)).estimates()
            assert not est.estimates[0].stale
        finally:
            await _stop(a, b)

    run_async(main())


def _answers(data: bytes) -> list[probe.Event]:
    conn = probe.Connection()
    conn.receive_data(data)
    conn.receive_data(b"")
    events = []
    while not isinstance(ev := conn.next_event(), probe.ConnectionClosed):
        events.append(ev)
    return events


BAD_STREAMS = {
    "garbage": b"GET / HTTP/1.1\r\n\r\n",
    "truncated frame": probe.Connection().send(probe.Hello("x", 1))[:-3],
    "bad type": probe.HEADER.pack(b"MA", probe.VERSION, 99, 0, 0),
    "oversized": probe.HEADER.pack(b"MA", probe.VERSION, probe.MsgType.PING, 0, 2**31),
}


@pytest.mark.parametrize("data", BAD_STREAMS.values(), ids=BAD_STREAMS.keys())
def test_bad_frames_close_the_connection_and_the_agent_goes_on(run_async, data) -> None:
    async def main() -> None:
        a = Agent(_config("a"), metrics=AgentMetrics())
        await a.start()
        try:
            # closed, with at most a word on what was wrong
            assert [type(e) for e in _answers(await _raw_control(a.port, data))] in (
                [], [probe.Error])
            assert a.bad_frames == 1
            async with await AgentClient.connect(LOCAL, a.port, CLUSTER) as client:
                assert (await client.estimates()).agent == "a"
        finally:
            await _stop(a)

    run_async(main())


def test_peer_that_disappears_goes_stale_and_says_so(run_async) -> None:
    async def main() -> None:
        a, b = await _pair()
        try:
            await _measured(a, "b")
            await _stop(b)
            deadline = time.monotonic() + 5
            e = None
            while time.monotonic() < deadline:
                client = await AgentClient.connect(LOCAL, a.port, CLUSTER)
                (e,) = (await client.estimates()).estimates
                await client.close()
                if e.stale and not e.connected:
                    break
                await asyncio.sleep(0.05)  # polling the API is what a user does
            assert e is not None and e.stale and not e.connected
            assert e.age_s > PROBE.stale_after
            assert not math.isnan(e.bandwidth_bps)  # the last value, flagged stale
        finally:
            await _stop(a)

    run_async(main())


def test_peer_restart_reconnects_with_bounded_backoff(run_async) -> None:
    async def main() -> None:
        a, b = await _pair(metrics=True)
        port = b.port
        try:
            await a.wait_trains("b", 2, timeout=5)
            await _stop(b)
            await asyncio.sleep(0.5)  # let a fail a few reconnects (backoff <= 0.2 s)
            b = Agent(_config("b", port=port, peers={"a": (LOCAL, a.port)}))
            await b.start()
            t0 = time.monotonic()
            await a.wait_trains("b", 1, timeout=5)
            assert time.monotonic() - t0 < 2.0
            await _measured(a, "b")
            assert a.metrics.peer_connects.labels("b")._value.get() == 2  # type: ignore
            (e,) = a._estimates_event(0).estimates
            assert e.connected and not e.stale
        finally:
            await _stop(a, b)

    run_async(main())


def test_peer_that_stops_answering_trains_is_reconnected(run_async) -> None:
    async def main() -> None:
        a, b = await _pair(metrics=True, max_lost_trains=3)
        try:
            await a.wait_trains("b", 2, timeout=5)
            # b keeps its control connections but stops reading probe datagrams
            assert b._udp is not None
            asyncio.get_running_loop().remove_reader(b._udp.fileno())
            await a.wait_trains("b", a.config.max_lost_trains + 1, timeout=10)
            assert a._peers["b"].estimator.outcomes.get("lost", 0) >= a.config.max_lost_trains
            t0 = time.monotonic()
            while a.metrics.peer_connects.labels("b")._value.get() < 2:  # type: ignore
                assert time.monotonic() - t0 < 5
                await asyncio.sleep(0.02)
        finally:
            await _stop(a, b)

    run_async(main())


def test_stop_is_clean_and_bounded(run_async) -> None:
    async def main() -> None:
        before = asyncio.all_tasks()
        a, b = await _pair()
        await a.wait_trains("b", 1, timeout=5)
        client = await AgentClient.connect(LOCAL, a.port, CLUSTER)
        t0 = time.monotonic()
        await _stop(a, b)
        assert time.monotonic() - t0 < 3
        assert asyncio.all_tasks() - before == set()
        with pytest.raises((ConnectionError, ProtocolError, OSError, Exception)):
            await client.estimates()
        await client.close()

    run_async(main())


def test_port_in_use_is_a_config_error(run_async) -> None:
    async def main() -> None:
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind((LOCAL, 0))
        port = udp.getsockname()[1]
        try:
            a = Agent(_config("a", port=port))
            with pytest.raises(ConfigError, match="--listen"):
                await a.start()
        finally:
            udp.close()

    run_async(main())


def test_tcp_port_in_use_is_a_config_error(run_async) -> None:
    """The agent listens on TCP and UDP at one port: a TCP port already taken
    is refused as clearly as a UDP one, naming the address and --listen."""

    async def main() -> None:
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.bind((LOCAL, 0))
        tcp.listen()
        port = tcp.getsockname()[1]
        try:
            a = Agent(_config("a", port=port))
            with pytest.raises(ConfigError, match=f"{LOCAL}:{port}.*--listen"):
                await a.start()
        finally:
            tcp.close()

    run_async(main())


# --- pieces -------------------------------------------------------------------------


def test_parse_addresses() -> None:
    assert parse_hostport("10.0.0.1:7400") == ("10.0.0.1", 7400)
    assert parse_hostport("[::1]:80") == ("::1", 80)
    assert parse_peer("h1=10.0.0.2:7400") == ("h1", ("10.0.0.2", 7400))
    for bad in ("10.0.0.1", "10.0.0.1:x", ":80", "h:70000"):
        with pytest.raises(ConfigError, match="HOST:PORT"):
            parse_hostport(bad)
    with pytest.raises(ConfigError, match="NAME=HOST:PORT"):
        parse_peer("10.0.0.2:7400")


def test_read_net_dev(tmp_path: Path) -> None:
    f = tmp_path / "dev"
    f.write_text(
        "Inter-|   Receive |  Transmit\n"
        " face |bytes    packets errs drop fifo frame compressed multicast|bytes ...\n"
        "    lo: 999 1 0 0 0 0 0 0 999 1 0 0 0 0 0 0\n"
        "  eth0: 100 1 0 0 0 0 0 0 200 1 0 0 0 0 0 0\n"
        "  eth1: 10 1 0 0 0 0 0 0 20 1 0 0 0 0 0 0\n"
    )
    assert read_net_dev(paths=(str(f),)) == (110, 220)
    assert read_net_dev("eth1", paths=(str(f),)) == (10, 20)
    assert read_net_dev("nope", paths=(str(f),)) is None
    assert read_net_dev(paths=(str(tmp_path / "missing"),)) is None
    assert read_net_dev() is not None  # this host's own counters


def _args(argv: list[str]):
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--cluster-token-file", str(cluster_token_file()), *argv])


def test_cli_config_from_flags_and_file(tmp_path: Path, monkeypatch) -> None:
    f = tmp_path / "agent.json"
    f.write_text(json.dumps({
        "name": "h0", "listen": "10.0.0.1:7400", "probe_budget": 0.01, "stale_after": 2,
        "metrics_port": 9470, "peers": {"h1": "10.0.0.2:7400", "h2": "10.0.0.3:7400"},
    }))
    cfg, mport = build_config(_args(["--config", str(f), "--peer", "h2=10.0.0.9:7401"]))
    assert cfg.name == "h0" and (cfg.host, cfg.port) == ("10.0.0.1", 7400)
    assert cfg.peers == {"h1": ("10.0.0.2", 7400), "h2": ("10.0.0.9", 7401)}
    assert cfg.probe.budget == 0.01 and cfg.probe.stale_after == 2 and mport == 9470
    assert cfg.counters is not None and cfg.counters.keywords == {} and cfg.counters.args == (None,)
    # --interface must name one of this host's (test_cli_errors: a misspelt one)
    monkeypatch.setattr(socket, "if_nameindex", lambda: [(1, "lo"), (7, "eth7")])
    cfg, _ = build_config(_args(["--interface", "eth7"]))
    assert cfg.counters.args == ("eth7",)  # type: ignore[union-attr]
    cfg, mport = build_config(_args(["--name", "x", "--probe-budget", "0.02"]))
    assert (cfg.host, cfg.port, cfg.peers, mport) == ("0.0.0.0", 7400, {}, None)
    assert cfg.job_traffic is None  # no job ports: every byte on the NIC is load


def test_cli_job_ports_from_flags_file_and_aggregator(tmp_path: Path) -> None:
    from mlfabric.agent.cli import AggregateConfig

    f = tmp_path / "agent.json"
    f.write_text(json.dumps({"job_ports": [7100]}))
    args = _args(["--config", str(f), "--job-port", "7200", "--job-port", "7100"])
    cfg, _ = build_config(args)
    assert cfg.job_traffic.traffic.ports == {7100, 7200}  # type: ignore[union-attr]
    agg = AggregateConfig("10.0.0.2", 7401, "job", b"t" * 32, 2.0, ("10.0.0.1:7070",))
    cfg, _ = build_config(args, agg)
    assert cfg.job_traffic.traffic.ports == {7100, 7200, 7401}  # type: ignore[union-attr]
    cfg, _ = build_config(_args([]), agg)
    assert cfg.job_traffic.traffic.ports == {7401}  # type: ignore[union-attr]
    cfg, _ = build_config(_args([]), None)
    assert cfg.job_traffic is None
    # how often all sockets are listed: 1 s unless the file or a flag says otherwise
    assert build_config(args)[0].job_traffic.rediscover == 1.0  # type: ignore[union-attr]
    f.write_text(json.dumps({"job_ports": [7100], "job_rediscover": 0}))
    cfg, _ = build_config(_args(["--config", str(f)]))
    assert cfg.job_traffic.rediscover == 0.0  # type: ignore[union-attr]
    cfg, _ = build_config(_args(["--config", str(f), "--job-rediscover", "2.5"]))
    assert cfg.job_traffic.rediscover == 2.5  # type: ignore[union-attr]


def _aggregate(tmp_path: Path, argv: list[str], file: dict | None = None):
    """build_aggregate for an aggregator of job "j" with `argv` (and the
    config file's keys `file`)."""
    from mlfabric.agent.cli import build_aggregate

    token = secret_file("agg-job.token", TOKEN.decode())
    args = _args(["--aggregate", "127.0.0.1:7401", "--job", "j", "--token-file", str(token),
                  *argv])
    return build_aggregate(args, file or {})


def test_cli_aggregator_servers_from_flags_and_file(tmp_path: Path) -> None:
    """Issue 33: where the aggregator may forward comes from --servers
    (repeatable, comma-separated) or the config file's "servers" (a string
    or a list), flags winning; each entry is checked at start."""
    agg = _aggregate(tmp_path, ["--servers", "10.0.0.1:7070,10.0.0.2:7070",
                                "--servers", " 10.0.0.3:7071"])
    assert agg.servers == ("10.0.0.1:7070", "10.0.0.2:7070", "10.0.0.3:7071")
    agg = _aggregate(tmp_path, [], {"servers": ["10.0.0.1:7070", "[::1]:7070"]})
    assert agg.servers == ("10.0.0.1:7070", "[::1]:7070")
    agg = _aggregate(tmp_path, [], {"servers": "10.0.0.1:7070, 10.0.0.1:7070"})
    assert agg.servers == ("10.0.0.1:7070",)  # one address named twice: once
    agg = _aggregate(tmp_path, ["--servers", "10.0.0.9:7070"], {"servers": "10.0.0.1:7070"})
    assert agg.servers == ("10.0.0.9:7070",)


@pytest.mark.parametrize(("argv", "file", "message"), [
    ([], None, "--aggregate 127.0.0.1:7401 needs --servers HOST:PORT[,HOST:PORT...]: the "
               "job's servers (shards and replicas too) as the workers name them; the "
               "aggregator forwards to no other address"),
    (["--servers", "10.0.0.1:7070,,10.0.0.2:7070"], None,
     "--servers: '' is not HOST:PORT (for example 10.0.0.1:7070)"),
    (["--servers", "10.0.0.1"], None,
     "--servers: '10.0.0.1' is not HOST:PORT (for example 10.0.0.1:7070)"),
    (["--servers", "10.0.0.1:0"], None,
     "--servers: '10.0.0.1:0' is not HOST:PORT (for example 10.0.0.1:7070)"),
    ([], {"servers": 7070},
     'servers must be "HOST:PORT,HOST:PORT,..." or a list of "HOST:PORT" strings, got 7070'),
    ([], {"servers": []}, "--servers is empty: give the address of every server (and "
                          "replica) of the job, as its workers name them"),
])
def test_cli_aggregator_servers_errors(tmp_path: Path, argv, file, message) -> None:
    with pytest.raises(ConfigError) as info:
        _aggregate(tmp_path, argv, file)
    assert str(info.value) == message


def test_cli_servers_belong_to_the_aggregator(tmp_path: Path) -> None:
    from mlfabric.agent.cli import build_aggregate

    with pytest.raises(ConfigError, match="--servers, --group-timeout and --handshake-timeout "
                                          "belong to --aggregate HOST:PORT"):
        build_aggregate(_args(["--servers", "10.0.0.1:7070"]), {})
    with pytest.raises(ConfigError, match="belong to --aggregate"):
        build_aggregate(_args([]), {"servers": "10.0.0.1:7070"})


@pytest.mark.parametrize(
    ("content", "argv", "match"),
    [
        ("{", [], "not valid JSON"),
        ("[]", [], "JSON object"),
        ('{"peerz": {}}', [], "unknown keys"),
        ('{"peers": ["h1"]}', [], "peers"),
        ('{"peers": {"h1": 5}}', [], "HOST:PORT"),
        ("{}", ["--probe-budget", "0.9"], "probe budget"),
        ("{}", ["--stale-after", "-1"], "stale-after"),
        ("{}", ["--stale-after", "nan"], "stale-after must be a positive number of seconds, "
         "got nan"),
        ('{"metrics_port": "x"}', [], "metrics port"),
        # JSON true is an int to Python: it must not pass as port 1 or 1 second
        ('{"metrics_port": true}', [], r"metrics port must be in 0..65535 \(0 picks a free "
         r"port\), got True"),
        ('{"stale_after": true}', [], "stale-after must be a positive number of seconds, "
         "got True"),
        ('{"probe_budget": false}', [], r"probe budget must be a fraction in \(0, 0.5\], "
         "got False"),
        ('{"interface": 5}', [], "NIC name"),
        ('{"job_ports": 7100}', [], "list of port numbers"),
        ('{"job_ports": ["x"]}', [], "job port must be a port number in 1..65535, got 'x'"),
        ("{}", ["--job-port", "0"], "job port must be a port number in 1..65535, got 0"),
        ("{}", ["--peer", "h1"], "NAME=HOST:PORT"),
        ("{}", ["--job-rediscover", "-1"],
         r"job-rediscover must be a number of seconds in \[0, 3600\], got -1.0"),
        ('{"job_rediscover": "1"}', [], "job-rediscover must be .* got '1'"),
        ('{"tls_cert": 5}', [], r"tls_cert in the agent config must be a file path \(a "
         r"string\), got 5"),
        ('{"tls_ca": "/nonexistent/ca.pem"}', [], "TLS needs all three of --tls-cert, "
         "--tls-key, --tls-ca: --tls-ca given without --tls-cert, --tls-key"),
        ("{}", ["--tls-cert", "/nonexistent/a.pem"], "TLS needs all three"),
    ],
)
def test_cli_config_errors(tmp_path: Path, content: str, argv: list[str], match: str) -> None:
    f = tmp_path / "agent.json"
    f.write_text(content)
    with pytest.raises(ConfigError, match=match):
        build_config(_args(["--config", str(f), *argv]))
    with pytest.raises(ConfigError, match="cannot read"):
        build_config(_args(["--config", str(tmp_path / "missing.json")]))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_cli_process_serves_metrics_and_shuts_down_cleanly(sig: int, loop: str) -> None:
    port, mport = free_port(), free_port()
    env = dict(os.environ)
    argv = [sys.executable, "-m", "mlfabric", "agent", "--name", "solo", "--loop", loop,
            "--cluster-token-file", str(cluster_token_file()),
            "--listen", f"{LOCAL}:{port}", "--peer", f"ghost={LOCAL}:9",
            "--metrics-port", str(mport), "--metrics-host", LOCAL]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # bounded: the process exits on any error
        assert "ready" in line, proc.stderr.read() if proc.stderr else line
        est = query_estimates(LOCAL, port, CLUSTER, timeout=5)
        assert est.agent == "solo" and est.estimates[0].peer == "ghost"
        with urllib.request.urlopen(f"http://{LOCAL}:{mport}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert "mlfabric_agent_estimate_stale{peer=\"ghost\"} 1.0" in text
        assert "mlfabric_agent_bad_messages_total" in text
        proc.send_signal(sig)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_cli_reports_config_errors_in_one_line() -> None:
    env = dict(os.environ)
    res = subprocess.run(
        [sys.executable, "-m", "mlfabric", "agent", "--listen", "nowhere"],
        capture_output=True, text=True, env=env, timeout=30,
    )
    assert res.returncode == 2
    assert "mlfabric agent: error: --listen 'nowhere' is not HOST:PORT" in res.stderr


def test_agent_config_is_plain_data() -> None:
    cfg = _config("a")
    assert replace(cfg, name="b").name == "b"


def test_clients_report_their_pushes_to_the_local_agent(tmp_path):
    """A real agent process counts the reports of a real client's pushes."""
    import subprocess
    import sys
    import urllib.request

    import numpy as np

    import mlfabric
    from mlfabric.server.store import ParameterStore

    from support import JOB, TOKEN, ServerThread, wait_until

    agent_port, metrics_port = free_port(), free_port()
    # The agent knows the server's host as a peer (named by its address).
    agent = subprocess.Popen(
        [sys.executable, "-m", "mlfabric", "agent", "--name", "me",
         "--cluster-token-file", str(cluster_token_file()), "--listen",
         f"127.0.0.1:{agent_port}", "--peer", f"127.0.0.1=127.0.0.1:{free_port()}",
         "--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def accepted() -> float:
        try:
            text = urllib.request.urlopen(
                f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).read().decode()
        except OSError:
            return -1.0
        for line in text.splitlines():
            if line.startswith('mlfabric_agent_transfer_reports_total{result="accepted"}'):
                return float(line.split()[-1])
        return -1.0

    try:
        wait_until(lambda: accepted() == 0.0, timeout=30, what="the agent's metrics")
        model = {"w": np.zeros(1 << 16, np.float32)}  # 256 KiB: reported
        with ServerThread(ParameterStore(model)) as server, mlfabric.connect(
                server.address, job=JOB, token=TOKEN, agent=f"127.0.0.1:{agent_port}",
                agent_key_file=agent_key_file()) as ps:
            for v in range(3):
                assert ps.push(model, base_version=v).result(10).applied
        wait_until(lambda: accepted() == 3.0, timeout=10, what="3 accepted reports")
    finally:
        agent.terminate()
        agent.wait(10)


def test_transfer_reports_skip_small_pushes_and_survive_a_missing_agent(caplog):
    from mlfabric.client.agent_report import MIN_REPORT_BYTES, TransferReporter

    dead = free_port()  # nothing listens here
    reporter = TransferReporter(f"127.0.0.1:{dead}", JOB_AGENT_KEY)
    reporter.report("peer", MIN_REPORT_BYTES - 1, 0.01)  # latency-bound: not reported
    reporter.report("peer", MIN_REPORT_BYTES, 0.0)  # no duration: not a rate
    reporter.report("peer", 1 << 20, 0.01)
    reporter.report("peer", 1 << 20, 0.01)
    reporter.close()
    assert (reporter.sent, reporter.dropped) == (0, 2)
    assert caplog.text.count("cannot report transfers to the agent") == 1
