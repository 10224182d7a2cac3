"""Frames cannot be altered, injected, replayed or reordered (issue 33).

Measured before: a man in the middle on loopback, relaying an authenticated
session, negated a worker's update in flight (the server applied it, and the
worker was told it was applied), and injected a push of its own (applied).
Now every frame after the handshake carries a MAC keyed per session and
direction, over its sequence number: a relay that flips one bit of a push,
injects a forged or a replayed push, or alters the server's answer is
detected, the session closes, and the model is untouched. A real server and
a real client, through a real relay on loopback. The same for an agent's
control connections after their login: a SetPeers or a transfer report
altered, injected or replayed on the way changes no peer and no estimate.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import mlfabric
from mlfabric.agent.daemon import AgentClient
from mlfabric.errors import ConnectionLost, MlfabricError, ProtocolError
from mlfabric.server.store import ParameterStore
from mlfabric.wire import agent_protocol as probe
from mlfabric.wire import auth
from mlfabric.wire.protocol import FLAG_MAC, HEADER, MAC_SIZE, Connection, Ping, Pong, Push

from support import (
    CLUSTER,
    CLUSTER_TOKEN,
    JOB,
    JOB_AGENT_KEY,
    TOKEN,
    Relay,
    ServerThread,
    assert_model_equal,
    make_model,
    random_update,
    sample,
)


@pytest.fixture
def served():
    model = make_model(sizes={"w": (256, 512), "b": (512,)})  # 512 KiB of float32
    st = ServerThread(ParameterStore({n: a.copy() for n, a in model.items()}))
    st.__enter__()
    relay = Relay(("127.0.0.1", st.port))
    yield model, st, relay
    relay.close()
    st.__exit__(None, None, None)


def _untouched(st: ServerThread, model, version: int = 0) -> None:
    assert st.call(lambda: st.store.version) == version
    if version == 0:
        assert_model_equal(st.call(lambda: {n: a.copy() for n, a in st.store.weights.items()}),
                           model)


def test_a_bit_flipped_in_a_push_is_detected_and_the_model_untouched(served) -> None:
    model, st, relay = served
    with mlfabric.connect(relay.address, job=JOB, token=TOKEN, timeout=10) as ps:
        relay.flip_at = len(relay.c2s) + 300_000  # inside the push's data block
        with pytest.raises(MlfabricError) as err:
            ps.push(random_update(model, 1), base_version=0).result(10)
    assert "a PUSH frame failed its integrity check" in str(err.value)
    assert st.metrics.protocol_errors._value.get() == 1
    _untouched(st, model)


@pytest.mark.parametrize("forgery", ["forged MAC", "no MAC", "replayed"])
def test_an_injected_push_is_detected_and_the_session_closes(served, forgery) -> None:
    """The relay puts a push of its own into an authenticated session: with a
    MAC under a key of its own, without any, or a copy of the worker's own
    last push (a replay). None is applied; the session closes."""
    model, st, relay = served
    evil = {n: np.full_like(a, 1000.0) for n, a in model.items()}
    with mlfabric.connect(relay.address, job=JOB, token=TOKEN, timeout=10) as ps:
        if forgery == "replayed":
            start = len(relay.c2s)
            ps.push(random_update(model, 2), base_version=0).result(10)
            frame = bytes(relay.c2s[start:])
            expected_version = 1  # the worker's own push, once
        else:
            conn = Connection()
            if forgery == "forged MAC":
                guess = auth.new_nonce()
                conn.protect(guess, guess)
            frame = conn.send_bytes(Push(req=99, base_version=0, tensors=evil))
            expected_version = 0
        relay.inject(frame)
        with pytest.raises(MlfabricError) as err:  # the session is closed under the worker
            ps.push(random_update(model, 3), base_version=expected_version).result(10)
    message = str(err.value)
    assert ("failed its integrity check" in message if forgery != "no MAC" else
            "without its integrity check on a protected connection" in message), message
    assert st.metrics.protocol_errors._value.get() == 1
    _untouched(st, model, expected_version)
    if expected_version == 1:
        w = st.call(lambda: {n: a.copy() for n, a in st.store.weights.items()})
        assert not np.any(w["w"] > 100)  # the replay was not applied a second time


def test_a_bit_flipped_in_the_servers_answer_is_detected_by_the_client(served) -> None:
    _, st, relay = served
    with mlfabric.connect(relay.address, job=JOB, token=TOKEN, timeout=10) as ps:
        relay.flip_s2c_at = relay.s2c_count + 200_000  # inside the model's data block
        with pytest.raises(ProtocolError) as err:
            ps.pull()
    assert str(err.value).startswith("a MODEL frame failed its integrity check (frame ")
    assert st.call(lambda: st.store.version) == 0


# --- the codec, without I/O ---------------------------------------------------------


def _pair() -> tuple[Connection, Connection]:
    a, b = Connection(), Connection()
    k1, k2 = auth.new_nonce(), auth.new_nonce()
    a.protect(k1, k2)
    b.protect(k2, k1)
    return a, b


def test_protected_frames_round_trip_and_carry_their_mac() -> None:
    a, b = _pair()
    u = {"w": np.arange(1000, dtype=np.float32)}
    for ev in (Ping(req=1), Push(req=2, base_version=0, tensors=u),
               Pong(req=3, role="server", version=4)):
        frame = a.send_bytes(ev)
        assert HEADER.unpack_from(frame)[3] == FLAG_MAC
        b.receive_data(frame)
        got = b.next_event()
        assert type(got) is type(ev) and got.req == ev.req
        if isinstance(ev, Push):
            assert np.array_equal(got.tensors["w"], u["w"])


@pytest.mark.parametrize("what", ["reordered", "dropped", "truncated MAC", "reflected"])
def test_reordered_dropped_or_reflected_frames_fail_their_check(what: str) -> None:
    a, b = _pair()
    first, second = a.send_bytes(Ping(req=1)), a.send_bytes(Ping(req=2))
    if what == "reordered":
        stream = second + first
    elif what == "dropped":
        stream = second
    elif what == "truncated MAC":
        stream = first[:-1] + bytes([first[-1] ^ 1])
    else:  # the receiver's own frame sent back to it
        stream = b.send_bytes(Ping(req=1))
    b.receive_data(stream)
    with pytest.raises(ProtocolError, match="failed its integrity check"):
        b.next_event()
    with pytest.raises(ProtocolError):  # and the connection stays broken
        b.next_event()


def test_a_streamed_frame_carries_one_mac_over_its_pieces() -> None:
    from mlfabric.wire.protocol import Model, spec_of
    from mlfabric.wire.streamed import StreamedBlock

    a, b = _pair()
    tensors = {"w": np.arange(3000, dtype=np.float32), "b": np.ones(7, np.float32)}
    head = a.send_head(Model(req=1, version=3, tensors=tensors))
    block = StreamedBlock([spec_of(n, t) for n, t in tensors.items()])
    data = bytearray(head)
    for upto in (1000, 5000, block.total):
        piece = block.from_arrays(tensors, upto)
        a.stream_data(piece)
        data += piece
    data += a.stream_trailer()
    assert len(data) == len(head) + block.total + MAC_SIZE
    b.receive_data(bytes(data))
    got = b.next_event()
    assert np.array_equal(got.tensors["w"], tensors["w"])


# --- the agents' control connections -------------------------------------------------
#
# The same man in the middle between a real client and a real agent: the
# operator's tool setting peers with the cluster token (AgentClient), and a
# worker's transfer reports with its job's agent key (TransferReporter, a
# blocking socket). Before, the frames after the login carried no MAC: a
# flipped bit in a SetPeers sent the agent's probe trains elsewhere.

PEERS = {"b": ("127.0.0.1", 9)}  # (nothing listens on port 9: b's probe session retries)


def _agent():
    from mlfabric.agent.daemon import Agent, AgentConfig
    from mlfabric.agent.estimator import ProbeConfig
    from mlfabric.runtime.metrics import AgentMetrics

    config = AgentConfig(name="a", cluster_token=CLUSTER_TOKEN, host="127.0.0.1", port=0,
                         counters=None, probe=ProbeConfig(max_packets=64))
    return Agent(config, metrics=AgentMetrics())


def _at(relay: Relay) -> tuple[str, int]:
    host, port = relay.address.rsplit(":", 1)
    return host, int(port)


def _reports(agent) -> dict[str, float]:
    return {r: sample(agent.metrics.transfer_reports, result=r)
            for r in ("accepted", "unknown_peer", "refused")}


def _integrity_refusals(agent) -> float:
    return sample(agent.metrics.refused, reason="integrity")


async def _until(predicate, what: str, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.01)


def test_a_bit_flipped_in_a_set_peers_is_detected_and_the_peers_untouched(run_async) -> None:
    async def main() -> None:
        agent = _agent()
        await agent.start()
        agent.set_peers(PEERS)
        relay = Relay(("127.0.0.1", agent.port))
        try:
            async with await AgentClient.connect(*_at(relay), CLUSTER, timeout=5) as client:
                # the logged-in client's first frame: inside its first peer's host
                relay.flip_at = len(relay.c2s) + probe.HEADER.size + 4 + 2 + 2 + 4 + 2 + 3
                with pytest.raises(ProtocolError) as err:
                    await client.set_peers({"evil": ("192.0.2.1", 9)})
            assert str(err.value) == (
                "the agent closed the connection: a SET_PEERS frame failed its integrity "
                "check (frame 0 of the connection): altered, injected, replayed or "
                "reordered in transit; the connection is closed")
            assert relay.flip_at is None  # (the relay did flip it)
            assert {n: st.addr for n, st in agent._peers.items()} == PEERS
            assert _integrity_refusals(agent) == 1
        finally:
            relay.close()
            await agent.stop()

    run_async(main())


def test_a_bit_flipped_in_a_transfer_report_is_detected_and_no_estimate_moves(
        run_async) -> None:
    """A worker's reporter (blocking socket, the job's agent key): its report
    of 1 MiB in 0.1 s altered on the way is not taken, nor counted as a
    report; the same report sent intact is."""
    from mlfabric.client.agent_report import TransferReporter

    login = (len(probe.Connection().send(probe.Login("job", JOB, "client", bytes(32))))
             + len(probe.Connection().send(probe.Prove(bytes(32)))))

    async def main() -> None:
        agent = _agent()
        await agent.start()
        agent.set_peers(PEERS)
        relay = Relay(("127.0.0.1", agent.port))
        # in the report's byte count (after the peer's name, u16 + "b")
        relay.flip_at = login + probe.HEADER.size + 3 + 5
        reporter = TransferReporter(relay.address, JOB_AGENT_KEY, timeout=5)
        try:
            reporter.report("b", 1 << 20, 0.1)
            await _until(lambda: _integrity_refusals(agent) == 1, "the report refused")
            assert relay.flip_at is None
            assert _reports(agent) == {"accepted": 0, "unknown_peer": 0, "refused": 0}
            assert agent.path("b").snapshot().samples == 0
            direct = TransferReporter(f"127.0.0.1:{agent.port}", JOB_AGENT_KEY, timeout=5)
            direct.report("b", 1 << 20, 0.1)
            await _until(lambda: _reports(agent)["accepted"] == 1, "the intact report")
            await asyncio.get_running_loop().run_in_executor(None, direct.close)
        finally:
            await asyncio.get_running_loop().run_in_executor(None, reporter.close)
            relay.close()
            await agent.stop()

    run_async(main())


@pytest.mark.parametrize("forgery", ["no MAC", "forged MAC", "replayed"])
def test_a_frame_injected_into_an_agents_session_is_detected(run_async, forgery) -> None:
    """The relay puts a SetPeers of its own into the operator's session:
    without a MAC, with one under a key of its own, or a copy of the
    operator's own earlier SetPeers (a replay, which would undo the later
    one). None takes effect; the session closes."""
    evil = probe.SetPeers(99, (probe.PeerAddress("evil", "192.0.2.1", 9),))

    async def main() -> None:
        agent = _agent()
        await agent.start()
        relay = Relay(("127.0.0.1", agent.port))
        first = {"b": ("127.0.0.1", 9)}
        later = {"c": ("127.0.0.1", 10)}
        try:
            async with await AgentClient.connect(*_at(relay), CLUSTER, timeout=5) as client:
                start = len(relay.c2s)
                await client.set_peers(first)
                recorded = bytes(relay.c2s[start:])
                await client.set_peers(later)
                if forgery == "replayed":
                    frame = recorded
                else:
                    conn = probe.Connection()
                    if forgery == "forged MAC":
                        guess = auth.new_nonce()
                        conn.protect(guess, guess)
                    frame = conn.send(evil)
                relay.inject(frame)
                await _until(lambda: _integrity_refusals(agent) == 1, "the injection refused")
                with pytest.raises((ProtocolError, ConnectionLost)):
                    await client.estimates()  # the session is closed under the operator
            assert {n: st.addr for n, st in agent._peers.items()} == later
        finally:
            relay.close()
            await agent.stop()

    run_async(main())
