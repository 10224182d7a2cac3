"""Fuzzing every other listener (issue 33): an agent's control API, an
aggregator and a controller get random bytes and mutated frames, before and
after a real login; then a good client gets its exact answer, no exception
reached the listener's loop and nothing was logged as an internal error.

Streams are recipes (tests/fuzz_recipes.py), made at exchange time. A
connection's frames carry MACs once authenticated (a job's handshake, an
agent's login), so what a listener takes from a stream is the frames sent
intact and in order up to the first flaw: each test replays the exact bytes
sent with the listener's parser (protected with its receive key) and,
independently, the recipe, and the two must agree with each other and with
the listener.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import socket
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import pytest
from fuzz_recipes import Frame, Swapped, Twice, render, streams
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import mlfabric
from mlfabric.agent.aggregator import Aggregator
from mlfabric.agent.daemon import Agent, AgentClient, AgentConfig
from mlfabric.agent.estimator import ProbeConfig
from mlfabric.controller.controller import Controller
from mlfabric.errors import AuthenticationError, ConfigError, InvalidUpdate, ProtocolError
from mlfabric.runtime.metrics import AgentMetrics, AggregatorMetrics
from mlfabric.scheduling.plan import fifo_policy
from mlfabric.server.store import ParameterStore
from mlfabric.transport.agent_login import blocking_login
from mlfabric.wire import agent_protocol as probe
from mlfabric.wire.agent_auth import AgentLogin, cluster_credential
from mlfabric.wire.protocol import (
    HEADER,
    MAC_SIZE,
    NEED_DATA,
    Auth,
    Connection,
    Directive,
    Error,
    FellBack,
    Hello,
    Ping,
    Pull,
    Push,
    PushResult,
    ReplicaDone,
    ReplicaJoin,
    ShardAt,
    StatusRequest,
    TransferDone,
    TransferProgress,
    TransferRequest,
    Welcome,
)

from support import (
    CLUSTER,
    CLUSTER_TOKEN,
    JOB,
    JOB_AGENT_KEY,
    TOKEN,
    WRONG_TOKEN,
    RawClient,
    ServerThread,
    assert_model_equal,
    make_model,
    random_update,
    sample,
    wait_until,
)

LOCAL = "127.0.0.1"
EXAMPLES = 100
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MODEL = make_model(sizes={"w": (16, 4), "b": (4,)})
UPDATE = random_update(MODEL, seed=1)
UPDATE2 = random_update(MODEL, seed=2)
GOOD = random_update(MODEL, seed=3)
GAMMA = 0.5


def _drain(sock: socket.socket) -> None:
    """Half-close and read until the listener closes (each read bounded by
    the socket's timeout): it answers what it can and closes."""
    try:
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(1 << 16):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass  # the listener closed first: fine
    finally:
        sock.close()


def _send(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except (ConnectionResetError, BrokenPipeError):
        pass  # refused and closed before all of it was sent: the replays stop there too


def _no_internal_errors(caplog: pytest.LogCaptureFixture,
                        known: Callable[[logging.LogRecord], bool] = lambda r: False) -> None:
    """Nothing logged at ERROR: a listener logs its own bugs there (an
    "internal error" with its traceback), but for `known` ones."""
    errors = [f"{r.name}: {r.getMessage()}" for r in caplog.records
              if r.levelno >= logging.ERROR and not known(r)]
    assert not errors, errors


# --- a) the agent's control API --------------------------------------------------------


def _agent_config(name: str) -> AgentConfig:
    return AgentConfig(name=name, cluster_token=CLUSTER_TOKEN, host=LOCAL, port=0,
                       counters=None, backoff_max=0.2,
                       probe=ProbeConfig(max_packets=64, initial_bps=50e6, stale_after=0.5))


class AgentPair:
    """Agents "a" and "b" probing each other, as one endpoint to run in a
    ServerThread; "a" is the one fuzzed."""

    role = "agent"

    def __init__(self) -> None:
        self.metrics = AgentMetrics()
        self.a = Agent(_agent_config("a"), metrics=self.metrics)
        self.b = Agent(_agent_config("b"))

    async def start(self, host: str, port: int) -> tuple[str, int]:
        await self.a.start()
        await self.b.start()
        self.a.set_peers(self.peers_of_a())
        self.b.set_peers({"a": (LOCAL, self.a.port)})
        return self.address

    def peers_of_a(self) -> dict[str, tuple[str, int]]:
        return {"b": (LOCAL, self.b.port)}

    @property
    def address(self) -> tuple[str, int]:
        return LOCAL, self.a.port

    async def close(self) -> None:
        await self.b.stop()
        await self.a.stop()


def _agent_events(b_port: int) -> list[probe.Event]:
    return [
        # Served after a cluster login (the first four after a job key's too).
        probe.GetEstimates(1),
        probe.Ping(2, 3),
        probe.TransferReport("b", 1 << 20, 0.1),
        probe.Hello("fz", 77),
        probe.SetPeers(4, (probe.PeerAddress("c", LOCAL, 9),)),
        probe.SetPeers(5, ()),
        probe.SetPeers(6, (probe.PeerAddress("b", LOCAL, b_port),
                           probe.PeerAddress("a", LOCAL, 1))),  # itself: left out
        probe.SetPeers(7, (probe.PeerAddress("", LOCAL, 5),)),  # refused: no name
        probe.SetPeers(8, (probe.PeerAddress("d", LOCAL, 0),)),  # refused: port 0
        # Never served (a login's first two, a new login's once logged in).
        probe.Login("cluster", "", "fz", b"n" * 32),
        probe.Login("job", JOB, "fz", b"n" * 32),
        probe.Login("root", "", "fz", b""),
        probe.Prove(b"p" * 32),
        probe.TrainReport(1, 1, 4, 0.0, False, ((0, 10), (1, 20))),
        probe.HelloAck("fz"),
        probe.Pong(1, 2),
        probe.Estimates(9, "x", ()),
        probe.Ack(1),
        probe.Error(1, "e"),
        probe.Challenge(b"n" * 32, b"p" * 32),
    ]


AGENT_SIZES = [(len(f), len(f) + MAC_SIZE) for f in
               (probe.Connection().send(ev) for ev in _agent_events(65535))]
# What each login may have served (wire.agent_auth); without one, nothing.
SERVED: dict[str, tuple[type, ...]] = {
    "cluster": (probe.Hello, probe.Ping, probe.GetEstimates, probe.TransferReport,
                probe.SetPeers),
    "job": (probe.Ping, probe.GetEstimates, probe.TransferReport),
}
LOGINS = ("none", "cluster", "cluster", "job", "wrong")  # (the cluster's twice as often)


def _agent_exchange(port: int, parts, events: Sequence[probe.Event], login: str
                    ) -> tuple[bytes, list[int], tuple[bytes, bytes] | None]:
    """Log in (`login`: "none", with the cluster token, with the job's agent
    key, or with a wrong token, which the client gives up at the agent's
    challenge), then send the stream `parts` makes of `events`: its bytes,
    the events it carries intact and in order up to its first flaw, and the
    client's frame keys (None without a login)."""
    sock = socket.create_connection((LOCAL, port), timeout=5)
    keys = None
    try:
        conn = probe.Connection()
        if login in ("cluster", "job"):
            credential = CLUSTER if login == "cluster" else JOB_AGENT_KEY
            flow = AgentLogin(credential, "fuzz")
            sock.sendall(conn.send(flow.login()))
            sock.sendall(conn.send(flow.on_challenge(_next(sock, conn))))
            keys = flow.frame_keys()
            conn.protect(*keys, plain_error=True)
            flow.on_welcome(_next(sock, conn))
            make = conn.send  # each frame numbered, with its MAC
        else:
            if login == "wrong":
                with pytest.raises(AuthenticationError, match="did not prove"):
                    blocking_login(sock, conn, cluster_credential(WRONG_TOKEN), "fuzz")
            make = probe.Connection().send
        data, intact = render(parts, lambda i: make(events[i]), _agent_prefix)
        _send(sock, data)
    finally:
        _drain(sock)
    return data, intact, keys


def _next(sock: socket.socket, conn: probe.Connection) -> probe.Event:
    while isinstance(ev := conn.next_event(), probe.NeedData):
        conn.receive_data(sock.recv(1 << 16))
    assert not isinstance(ev, probe.ConnectionClosed)
    return ev


def _agent_prefix(frame: bytes) -> int:
    """A control frame's header and payload (its MAC follows)."""
    return probe.HEADER.size + int.from_bytes(frame[5:9], "big")


def _apply_peers(login: str, events: Iterable[probe.Event],
                 peers: dict[str, tuple[str, int]]) -> dict[str, tuple[str, int]]:
    """Agent "a"'s peers after a client logged in so had `events` served in
    order: the connection ends at the first one the login does not allow."""
    served = SERVED[login]
    for ev in events:
        if not isinstance(ev, served):
            break
        if isinstance(ev, probe.SetPeers) and all(p.name and p.port for p in ev.peers):
            peers = {p.name: (p.host, p.port) for p in ev.peers if p.name != "a"}
    return peers


def _peers_after(login: str, data: bytes, keys: tuple[bytes, bytes] | None,
                 peers: dict[str, tuple[str, int]]) -> dict[str, tuple[str, int]]:
    """Agent "a"'s peers after a client logged in so sent `data`, by the
    agent's parser: after a cluster login a SetPeers sent intact takes
    effect; an altered, injected, replayed or reordered one fails its MAC
    and ends the connection. Without a login, with a wrong key or a job's
    key, none does."""
    if login not in SERVED:
        return peers  # not logged in: its proof is no one's, nothing is served
    assert keys is not None
    conn = probe.Connection()
    conn.protect(keys[1], keys[0])  # the agent receives under the client's send key
    conn.receive_data(data)
    conn.receive_data(b"")  # the client's half-close

    def parsed() -> Iterable[probe.Event]:
        while True:
            try:
                ev = conn.next_event()
            except ProtocolError:
                return
            if isinstance(ev, probe.ConnectionClosed):
                return
            assert not isinstance(ev, probe.NeedData)
            yield ev

    return _apply_peers(login, parsed(), peers)


# The agents' threads draw probing jitter and backoff from `random` while
# hypothesis draws examples, which it takes for a strategy using `random`.
@pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")
def test_fuzzed_frames_at_an_agent_change_its_peers_only_after_a_cluster_login(
        loop_kind, caplog):
    pair = AgentPair()
    with ServerThread(None, loop_kind=loop_kind, endpoint=pair) as thread:
        baseline = pair.peers_of_a()
        events = _agent_events(pair.b.port)
        changes = [0]  # examples whose stream changed the peers

        async def good(peers: dict[str, tuple[str, int]] | None = None) -> probe.Estimates:
            async with await AgentClient.connect(LOCAL, pair.a.port, CLUSTER,
                                                 timeout=5.0) as client:
                if peers is not None:
                    await client.set_peers(peers)
                return await client.estimates()

        def peers_now() -> dict[str, tuple[str, int]]:
            return thread.call(lambda: {n: st.addr for n, st in pair.a._peers.items()})

        @FUZZ
        @given(parts=streams(AGENT_SIZES, favoured=9), login=st.sampled_from(LOGINS))
        @example(parts=[Frame(4)], login="cluster")  # the peers become "c"
        @example(parts=[Frame(4)], login="job")  # forbidden
        @example(parts=[Frame(4)], login="none")  # log in first
        @example(parts=[Frame(12), Frame(4)], login="wrong")  # a proof no one made
        @example(parts=[Frame(9), Frame(12), Frame(4)], login="none")
        @example(parts=[Frame(0), Frame(5), Frame(7), Frame(4)], login="cluster")
        @example(parts=[Frame(4, (("set", 29, 0x21),))], login="cluster")  # port 9 -> 8457
        @example(parts=[Frame(0), Twice(4)], login="cluster")  # the replay is refused
        @example(parts=[Swapped(4, 5)], login="cluster")
        def check(parts, login: str) -> None:
            data, intact, keys = _agent_exchange(pair.a.port, parts, events, login)
            expected = _peers_after(login, data, keys, baseline)
            assert login == "cluster" or expected == baseline  # (the decision, spelt out)
            if login in SERVED:  # the recipe says the same as the parser
                assert expected == _apply_peers(login, (events[i] for i in intact), baseline)
            estimates = thread.run(good())
            assert estimates.agent == "a"
            assert [e.peer for e in estimates.estimates] == sorted(expected)
            assert peers_now() == expected
            if expected != baseline:  # back to probing "b" only
                changes[0] += 1
                estimates = thread.run(good(baseline))
                assert [e.peer for e in estimates.estimates] == ["b"]
                assert peers_now() == baseline
            assert not thread.loop_errors

        check()
        assert changes[0] > 0  # (the examples above change them)
        assert all(sample(pair.metrics.refused, reason=r) > 0
                   for r in ("unauthenticated", "auth", "forbidden", "integrity"))
        # Still probing: a measures b again.
        thread.run(pair.a.wait_trains("b", 2, timeout=10), timeout=15)
    _no_internal_errors(caplog)


@pytest.mark.parametrize("host", ["127..0.1", "a" * 64, "a\x00b"],
                         ids=["empty-label", "long-label", "nul"])
def test_a_peer_host_that_cannot_be_resolved_is_refused_where_it_is_given(run_async, caplog,
                                                                          host):
    """Found by the fuzz test: a SetPeers host the resolver refuses (an empty
    label, a label over 63 characters, a NUL) was taken, and the peer loop
    logged a traceback at ERROR for it at every backoff. Now SetPeers refuses
    it with the reason, and the peers stay as they were."""
    caplog.set_level(logging.DEBUG, logger="mlfabric.agent")

    async def main() -> None:
        agent = Agent(_agent_config("a"))
        await agent.start()
        try:
            async with await AgentClient.connect(LOCAL, agent.port, CLUSTER) as client:
                with pytest.raises(ConfigError) as err:
                    await client.set_peers({"x": (host, 9)})
            assert str(err.value) == (f"agent refused the peer list: peer 'x': {host!r} is no "
                                      f"IP address or host name")
            assert list(agent.estimates()) == []
        finally:
            await agent.stop()

    run_async(main())
    _no_internal_errors(caplog)


# --- job connections (aggregator, controller) -----------------------------------


def _prefix_len(frame: bytes) -> int:
    return HEADER.size + int.from_bytes(frame[8:12], "little")


def _sizes(events: Sequence[object]) -> list[tuple[int, int]]:
    out = []
    for ev in events:
        frame = Connection().send_bytes(ev)
        out.append((_prefix_len(frame), len(frame) + MAC_SIZE))
    return out


def _job_exchange(port: int, parts, events: Sequence[object], authenticate: bool
                  ) -> tuple[bytes, list[int], tuple[bytes, bytes] | None]:
    """Send the stream `parts` makes of `events` to a job listener: its
    bytes, the events it carries intact and in order up to its first flaw,
    and the client's frame keys (None unauthenticated)."""
    raw = RawClient(port, authenticate=authenticate)
    if authenticate:
        assert raw.keys is not None
        data, intact = render(parts, lambda i: raw.frame(events[i]), _prefix_len)
    else:
        data, intact = render(parts, lambda i: Connection().send_bytes(events[i]), _prefix_len)
    _send(raw.sock, data)
    _drain(raw.sock)
    return data, intact, raw.keys


def _parsed(data: bytes, keys: tuple[bytes, bytes], max_frame_size: int) -> Iterable[object]:
    """The events a listener reads from `data`, sent by a client whose frame
    keys are `keys`, up to the first frame it refuses or the stream's end."""
    conn = Connection(max_frame_size=max_frame_size)
    conn.protect(keys[1], keys[0])  # the listener receives under the client's send key
    conn.receive_data(data)
    while True:
        try:
            event = conn.next_event()
        except ProtocolError:
            return
        if event is NEED_DATA:
            return  # the stream ends
        yield event


# --- b) the aggregator ------------------------------------------------------------------


def _aggregator_events(base: int, dst: str) -> list[object]:
    """The base events of one example: its members are of groups base + 0..4
    (`base` random: no other example's group, and none a mutation makes)."""

    def member(slot: int, fan_in: int, index: int, tensors=UPDATE, req: int = 1) -> Push:
        return Push(req=req, base_version=0, tensors=tensors, uid=f"fz{base}-{slot}-{index}",
                    group=base + slot, fan_in=fan_in, index=index, dst=dst)

    return [
        member(0, 1, 0),  # a group of one: forwarded and applied
        member(1, 2, 0, req=2),  # a group of two: applied once both are in,
        member(1, 2, 1, UPDATE2, req=3),  # as one step of their sum
        member(2, 2, 0, req=4),  # alone: waits (the group timeout is far)
        member(3, 1, 0, {"w": UPDATE["w"]}, req=5),  # forwarded, refused by the server
        member(4, 1, 0, {"w": UPDATE["w"].astype(np.float64)}, req=6),  # refused: float64
        Push(req=7, base_version=0, tensors=UPDATE),  # no group: refused as misrouted
        # (A member without tensors: test_a_member_without_tensors_is_no_internal_error.)
        # What the aggregator does not take: it closes the connection.
        Hello(job=JOB, client="fuzz", nonce=b"n" * 32),
        Auth(proof=b"p" * 32),
        Pull(req=8),
        Ping(req=9),
        PushResult(req=10, applied=True, version=1, delay=0),
        Error(code="x", message="y"),
    ]


AGGREGATOR_SIZES = _sizes(_aggregator_events(1 << 40, "127.0.0.1:65535"))


def _aggregates(events: Iterable[object]) -> list[tuple[list[tuple[str, int]], dict]]:
    """The aggregates an aggregator forwards from one connection's `events`
    (all of its groups new): [((uid, base_version) of each member, their sum)]."""
    groups: dict[tuple[str, int], dict] = {}
    closed: set[tuple[str, int]] = set()
    out = []
    for ev in events:
        if not isinstance(ev, Push):
            return out  # the aggregator takes pushes only: it closes the connection here
        if ev.group is None or ev.uid is None or ev.dst is None:
            continue  # misrouted: refused with an error
        tensors = {n: np.asarray(a) for n, a in ev.tensors.items()}
        if any(a.dtype != np.dtype("<f4") for a in tensors.values()):
            continue  # refused with an error
        key = (ev.dst, ev.group)
        if key in closed:
            continue  # a late member: told to go to the server
        specs = tuple((n, a.shape) for n, a in tensors.items())
        g = groups.setdefault(key, {"fan_in": ev.fan_in, "specs": specs, "members": {}})
        if g["fan_in"] != ev.fan_in or ev.index in g["members"] or g["specs"] != specs:
            continue  # does not fit its group: told to go to the server
        g["members"][ev.index] = (ev.uid, ev.base_version, tensors)
        if len(g["members"]) == g["fan_in"]:
            del groups[key]
            closed.add(key)
            members = [g["members"][i] for i in range(g["fan_in"])]
            total = {n: a.copy() for n, a in members[0][2].items()}
            for _, _, t in members[1:]:  # summed in index order, in float32
                for n in total:
                    total[n] += t[n]
            out.append(([(uid, base) for uid, base, _ in members], total))
    return out


def _apply(reference: ParameterStore, aggregates) -> int:
    """Apply `aggregates` as the server does; how many it applies."""
    applied = 0
    for members, total in aggregates:
        try:
            reference.apply_aggregate(members, total)
        except InvalidUpdate:
            continue  # the server refuses it (a tensor missing): the members are told
        applied += 1
    return applied


@pytest.fixture
def aggregator(loop_kind):
    """A server with MODEL behind an aggregator whose groups wait for their
    members longer than any test runs (so a group of two with one member in
    never forwards that one alone at a time no replay can tell)."""
    server = ServerThread(ParameterStore(MODEL, momentum=GAMMA, tau_max=None),
                          loop_kind=loop_kind)
    with server:
        agg = ServerThread(None, loop_kind=loop_kind, endpoint=Aggregator(
            job=JOB, token=TOKEN, servers=[server.address], group_timeout=120.0,
            metrics=AggregatorMetrics()))
        with agg:
            yield server, agg


def test_fuzzed_frames_at_an_aggregator_change_nothing_but_intact_members(aggregator, caplog):
    server, agg = aggregator
    endpoint = agg.server
    reference = ParameterStore(MODEL, momentum=GAMMA, tau_max=None)
    by_recipe = ParameterStore(MODEL, momentum=GAMMA, tau_max=None)
    count = {"examples": 0, "applied": 0}

    def settled() -> bool:
        """The server is where the replay says, and no aggregate is on its way."""
        version = server.call(lambda: server.store.version)
        assert version <= reference.version, "the server applied more than the replay says"
        return version == reference.version and agg.call(lambda: not endpoint._forwards)

    @FUZZ
    @given(parts=streams(AGGREGATOR_SIZES, favoured=4), authenticate=st.booleans())
    @example(parts=[Frame(0)], authenticate=True)
    @example(parts=[Frame(1), Frame(2)], authenticate=True)
    @example(parts=[Frame(1), Frame(2)], authenticate=False)
    @example(parts=[Frame(1), Frame(2, (("flip_any", 1 << 20, 0),))], authenticate=True)
    @example(parts=[Frame(1), Frame(2, cut=300)], authenticate=True)
    @example(parts=[Swapped(1, 2)], authenticate=True)
    @example(parts=[Twice(0), Frame(3), Frame(4), Frame(5), Frame(6), Frame(0)],
             authenticate=True)
    def check(parts, authenticate: bool) -> None:
        count["examples"] += 1
        events = _aggregator_events(secrets.randbits(40) << 3, server.address)
        data, intact, keys = _job_exchange(agg.port, parts, events, authenticate)
        if authenticate:
            assert keys is not None
            parsed = _aggregates(_parsed(data, keys, endpoint.max_frame_size))
            recipe = _aggregates(events[i] for i in intact)
            assert [m for m, _ in parsed] == [m for m, _ in recipe]
            count["applied"] += _apply(reference, parsed)
            _apply(by_recipe, recipe)
        wait_until(settled, timeout=10, what="the aggregates forwarded and applied")
        # A good member, in a group of its own: its exact answer, and the model.
        version = reference.version
        uid = f"good-{count['examples']}"
        raw = RawClient(agg.port)
        try:
            raw.send(Push(req=1, base_version=version, tensors=GOOD, uid=uid,
                          group=secrets.randbits(62), fan_in=1, index=0, dst=server.address))
            answer = raw.recv_event()
        finally:
            raw.close()
        assert answer == PushResult(req=1, applied=True, version=version + 1, delay=0,
                                    fan_in=1, index=0)
        for ref in (reference, by_recipe):
            ref.apply_aggregate([(uid, version)], GOOD)
        count["applied"] += 1
        got_version, weights = server.call(lambda: server.store.snapshot())
        assert got_version == reference.version == by_recipe.version
        assert_model_equal(weights, reference.weights)
        assert_model_equal(weights, by_recipe.weights)
        assert not server.loop_errors and not agg.loop_errors
        _no_internal_errors(caplog)

    check()
    # Fuzzed aggregates were applied (the examples above make some), each
    # counted once, as were the good members'.
    assert count["applied"] > count["examples"]
    assert agg.metrics.aggregates.labels("applied")._value.get() == count["applied"]
    assert agg.metrics.protocol_errors._value.get() > 0


# --- c) the controller --------------------------------------------------------------


def _controller_events(dst: str) -> list[object]:
    return [
        TransferRequest(req=1, host="fz", dst=dst, nbytes=4096, base_version=0, norm=1.0),
        TransferDone(req=1, applied=True, version=1, delay=0, seconds=0.01),
        TransferRequest(req=2, host="fz", dst=dst, nbytes=1 << 20, base_version=7, norm=2.0,
                        chunk=1 << 16),
        TransferProgress(req=2, sent=1 << 16),
        StatusRequest(req=3),
        ShardAt(shard=0, dst=dst, version=0),
        FellBack(updates=1, seconds=0.5),
        ReplicaDone(dst="127.0.0.1:1", version=1),
        ReplicaJoin(address="127.0.0.1:1", version=0),
        # What the controller does not take: it closes the connection.
        Hello(job=JOB, client="fuzz", nonce=b"n" * 32),
        Auth(proof=b"p" * 32),
        Push(req=4, base_version=0, tensors=UPDATE),
        Pull(req=5),
        Ping(req=6),
        Directive(req=1, action="go"),
        Welcome(session="s", version=0, tensors=()),
    ]


CONTROLLER_TAKES = (TransferRequest, TransferDone, TransferProgress, StatusRequest, ShardAt,
                    FellBack, ReplicaDone, ReplicaJoin)
CONTROLLER_SIZES = _sizes(_controller_events("127.0.0.1:65535"))


def _requests_taken(events: Iterable[object]) -> int:
    """How many transfer requests a controller takes from `events`."""
    n = 0
    for ev in events:
        if not isinstance(ev, CONTROLLER_TAKES):
            break  # it closes the connection here
        n += isinstance(ev, TransferRequest)
    return n


@pytest.fixture
def controller(loop_kind):
    server = ServerThread(ParameterStore(MODEL, momentum=GAMMA, tau_max=None),
                          loop_kind=loop_kind)
    ctl = ServerThread(None, loop_kind=loop_kind,
                       endpoint=Controller(fifo_policy, job=JOB, token=TOKEN, tau_max=None))
    with server, ctl:
        yield server, ctl


def test_fuzzed_frames_at_a_controller_leave_a_good_workers_directive_as_it_was(
        controller, caplog):
    server, ctl = controller
    endpoint = ctl.server
    state = endpoint.state

    def alone() -> bool:
        """The fuzzing connection is gone, and with it its transfers."""
        return ctl.call(lambda: not endpoint.connections)

    def directive(req: int) -> object:
        """A good worker's request, on a connection of its own, while no one
        else's transfer is pending or under way: its directive."""
        wait_until(alone, timeout=10, what="the controller without other connections")
        assert ctl.call(lambda: (len(state.pending), len(state.active))) == (0, 0)
        raw = RawClient(ctl.port)
        try:
            raw.send(TransferRequest(req=req, host="good", dst=server.address, nbytes=4096,
                                     base_version=0, norm=1.0))
            return raw.recv_event()
        finally:
            raw.close()

    before = directive(1)
    assert isinstance(before, Directive) and before.action == "go" and before.position == 0
    requests = [1]  # taken by the controller (its metric counts them)
    examples = [0]

    @FUZZ
    @given(parts=streams(CONTROLLER_SIZES, favoured=9), authenticate=st.booleans())
    @example(parts=[Frame(0), Frame(1), Frame(2), Frame(4), Frame(8)], authenticate=True)
    @example(parts=[Frame(0), Frame(0, (("flip", 27, 0),)), Frame(2)], authenticate=True)
    @example(parts=[Frame(0)], authenticate=False)
    @example(parts=[Twice(0), Frame(2)], authenticate=True)
    def check(parts, authenticate: bool) -> None:
        examples[0] += 1
        events = _controller_events(server.address)
        data, intact, keys = _job_exchange(ctl.port, parts, events, authenticate)
        if authenticate:
            assert keys is not None
            taken = _requests_taken(_parsed(data, keys, endpoint.max_frame_size))
            assert taken == _requests_taken(events[i] for i in intact)
            requests[0] += taken
        req = 100 + examples[0]
        after = directive(req)
        # As it was, but for the transfer's id at the controller (its ticket).
        assert dataclasses.replace(after, ticket=None) == Directive(
            req=req, action="go", position=0, planned_seconds=before.planned_seconds)
        assert after.ticket > before.ticket
        requests[0] += 1
        assert ctl.metrics.requests._value.get() == requests[0]
        assert not ctl.loop_errors
        _no_internal_errors(caplog)

    check()
    assert requests[0] > examples[0] + 1  # fuzzed requests were taken (the examples above)
    assert ctl.metrics.protocol_errors._value.get() > 0
    # A worker pushing through the controller: applied, exactly.
    wait_until(alone, timeout=10, what="the controller without other connections")
    reference = ParameterStore(MODEL, momentum=GAMMA, tau_max=None)
    with mlfabric.connect(server.address, job=JOB, token=TOKEN,
                          controller=ctl.address) as worker:
        for i in range(3):
            outcome = worker.push(GOOD, base_version=i).result(10)
            reference.apply(i, GOOD)
            assert (outcome.applied, outcome.version, outcome.delay) == (True, i + 1, 0)
        version, weights = worker.pull(timeout=10)
    assert version == reference.version == 3
    assert_model_equal(weights, reference.weights)


def test_a_member_without_tensors_is_no_internal_error(aggregator, caplog):
    server, agg = aggregator
    answers = []
    for before in ([], [Push(req=1, base_version=0, tensors=UPDATE, uid="full", group=1,
                              fan_in=2, index=0, dst=server.address)]):
        raw = RawClient(agg.port)
        try:
            for ev in before:
                raw.send(ev)
            raw.send(Push(req=2, base_version=0, tensors={}, uid=f"empty{len(before)}",
                          group=2 + len(before), fan_in=1, index=0, dst=server.address))
            answers.append(raw.recv_event())
        finally:
            raw.close()
    assert all(isinstance(a, Error) and a.req == 2 and a.code != "internal"
               for a in answers), answers
    _no_internal_errors(caplog)
