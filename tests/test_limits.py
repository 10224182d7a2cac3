"""Limits that hold under abuse (issue 33), each against a real listener.

Measured before: 3,000 idle connections that never finished the handshake
each held a file descriptor until the handshake timeout; 500 unauthenticated
connections raised an agent's memory from 47 to 581 MiB; one authenticated
client's 256 pipelined pulls (7.8 KB of requests) left 4.2 GB held in the
server; failed handshakes logged one line each. The memory of real processes
under these abuses, and after, is test_memory's.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

import mlfabric
from mlfabric.agent.daemon import Agent, AgentClient, AgentConfig
from mlfabric.agent.estimator import ProbeConfig
from mlfabric.server.pulls import MAX_HELD_PER_CONNECTION
from mlfabric.server.store import ParameterStore
from mlfabric.transport.listener import LogLimiter
from mlfabric.wire import agent_protocol as probe
from mlfabric.wire.protocol import Error, Model, Pull

from support import (
    CLUSTER,
    CLUSTER_TOKEN,
    JOB,
    TOKEN,
    RawClient,
    ServerThread,
    make_model,
    sample,
    wait_until,
)


def _closed(sock: socket.socket, timeout: float = 5.0) -> bool:
    """The peer closed `sock` (EOF or reset) within `timeout`."""
    sock.settimeout(timeout)
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def test_a_flood_of_idle_connections_evicts_the_oldest_and_good_clients_get_in() -> None:
    st = ServerThread(ParameterStore(make_model()))
    st.server.max_unauthenticated = 16
    with st:
        idle = [socket.create_connection(("127.0.0.1", st.port)) for _ in range(16)]
        wait_until(lambda: st.call(lambda: len(st.server.unauthenticated)) == 16,
                   what="16 connections in")
        one_more = socket.create_connection(("127.0.0.1", st.port))
        assert _closed(idle[0])  # the oldest made room
        wait_until(lambda: sample(st.metrics.unauthenticated_evicted) == 1, what="counted")
        flood = [socket.create_connection(("127.0.0.1", st.port)) for _ in range(100)]
        # a good client gets in during the flood, and is served
        with mlfabric.connect(st.address, job=JOB, token=TOKEN, timeout=5) as ps:
            version, _ = ps.pull(timeout=5)
            assert version == 0
        assert st.call(lambda: len(st.server.unauthenticated)) <= 16
        assert sample(st.metrics.unauthenticated_evicted) >= 101
        for s in [*idle, one_more, *flood]:
            s.close()


def test_answers_queued_for_a_client_that_does_not_read_are_bounded() -> None:
    """256 pipelined pulls of an 8 MiB model from a client that reads nothing:
    the server stops handling its requests once two frames' worth of answers
    wait for it, and answers the rest as the client reads; none is lost."""
    model = make_model(sizes={"w": (2048, 1024)})  # 8 MiB
    with ServerThread(ParameterStore(model)) as st:
        raw = RawClient(st.port)
        raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        raw.send_raw(b"".join(raw.frame(Pull(req=i)) for i in range(256)))
        wait_until(lambda: sample(st.metrics.backpressure) >= 1, what="the bound reached")
        limit = st.call(lambda: st.server.queue_limit)
        queued = st.call(lambda: max(c.transport.get_write_buffer_size()
                                     for c in st.server.connections))
        frame = 8 << 20
        assert queued <= limit + frame, (queued, limit)
        assert limit < 64 << 20  # against 2 GiB for 256 answers
        reqs = []
        raw.sock.settimeout(10)
        for _ in range(256):
            ev = raw.recv_event()
            assert isinstance(ev, Model)
            reqs.append(ev.req)
        assert reqs == list(range(256))  # every pull answered, in order
        raw.close()
        wait_until(lambda: not st.call(lambda: st.server.connections), what="closed")


def test_held_pulls_per_connection_are_bounded() -> None:
    with ServerThread(ParameterStore(make_model())) as st:
        raw = RawClient(st.port)
        for i in range(MAX_HELD_PER_CONNECTION + 1):
            raw.send(Pull(req=i, uid=f"not-yet-{i}", wait=30.0))
        answer = raw.recv_event()
        assert answer == Error(code="too_many_pulls", req=MAX_HELD_PER_CONNECTION, message=(
            f"{MAX_HELD_PER_CONNECTION} pulls for updates are held on this connection "
            f"already (at most {MAX_HELD_PER_CONNECTION}): wait for their answers"))
        raw.close()


def test_failed_handshakes_are_logged_one_line_per_many() -> None:
    now = [0.0]
    log = logging.getLogger("test.limits")
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep()
    log.addHandler(handler)
    try:
        limiter = LogLimiter(log, burst=5, interval=10.0, clock=lambda: now[0])
        for i in range(1000):
            limiter.warning("refused %s: wrong token", f"c{i}")
        assert records == [f"refused c{i}: wrong token" for i in range(5)]
        now[0] = 10.0
        limiter.warning("refused %s: wrong token", "late")
        assert records[-1] == ("refused late: wrong token (and 995 more like these in the "
                               "last 10 s, not logged)")
    finally:
        log.removeHandler(handler)


def test_a_server_flooded_with_wrong_tokens_logs_a_bounded_number_of_lines(caplog) -> None:
    with ServerThread(ParameterStore(make_model())) as st, \
            caplog.at_level(logging.WARNING, logger="mlfabric"):
        for _ in range(40):
            with pytest.raises(mlfabric.errors.AuthenticationError):
                mlfabric.connect(st.address, job=JOB, token=b"fc9VdvfKRpn_DlhazmmmGVXCKvw94F1D"
                                 b"qIe_6ujLCwQ", timeout=5)
        wait_until(lambda: sample(st.metrics.auth_failures) == 40, what="40 refusals")
    refused = [r for r in caplog.records if "refused" in r.getMessage()]
    assert 1 <= len(refused) <= 5


# --- the agent ------------------------------------------------------------------------


def _agent(**kw) -> Agent:
    return Agent(AgentConfig("a", cluster_token=CLUSTER_TOKEN, host="127.0.0.1", port=0,
                             counters=None, probe=ProbeConfig(max_packets=64), **kw))


def test_an_agent_keeps_few_connections_that_have_not_logged_in_and_small(run_async) -> None:
    async def main() -> None:
        from mlfabric.runtime.metrics import AgentMetrics

        metrics = AgentMetrics()
        agent = _agent(max_unauthenticated=8, login_timeout=30.0)
        agent.metrics = metrics
        await agent.start()
        try:
            streams = [await asyncio.open_connection("127.0.0.1", agent.port)
                       for _ in range(40)]
            # a good client logs in during the flood
            async with await AgentClient.connect("127.0.0.1", agent.port, CLUSTER) as client:
                assert (await client.estimates()).agent == "a"
            for r, _ in streams[:32]:  # the oldest were closed to make room
                try:
                    assert await asyncio.wait_for(r.read(), 5) == b""
                except ConnectionResetError:
                    pass
            assert sample(metrics.refused, reason="evicted") >= 32
            assert agent.pending_logins <= 8
            # before a login, a frame may not be large: 1 MiB announced is refused
            r, w = await asyncio.open_connection("127.0.0.1", agent.port)
            w.write(probe.HEADER.pack(probe.MAGIC, probe.VERSION, probe.MsgType.LOGIN, 0, 1 << 20))
            conn = probe.Connection()
            conn.receive_data(await asyncio.wait_for(r.read(), 5))
            conn.receive_data(b"")
            err = conn.next_event()
            assert isinstance(err, probe.Error) and "exceeds the maximum 4096" in err.message
            for _, w2 in [*streams, (r, w)]:
                w2.close()
        finally:
            await asyncio.wait_for(agent.stop(), 10)

    run_async(main())
