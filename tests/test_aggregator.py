"""The aggregation path, live: workers, controller, aggregator and server on
loopback. A test policy routes every k pending updates as one group, so what
is tested is the I/O (members in, one aggregate out, each worker told its own
outcome, failures re-sent straight to the server), not the planner's timing
(tests/test_aggregation.py tests the planner)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

import numpy as np
import pytest

import mlfabric
from mlfabric.agent.aggregator import Aggregator
from mlfabric.agent.destinations import Destinations
from mlfabric.controller.controller import Controller
from mlfabric.runtime.metrics import AggregatorMetrics
from mlfabric.scheduling.aggregation import AggregationConfig, apply_aggregate
from mlfabric.scheduling.plan import Network, PlanItem, Route, Snapshot
from mlfabric.scheduling.policies import mlfabric_policy
from mlfabric.server.store import ParameterStore
from mlfabric.wire.protocol import (
    NEED_DATA,
    Challenge,
    Connection,
    Error,
    Hello,
    Push,
    PushResult,
)

from support import (
    JOB,
    LOOP_CLOCK_SLACK,
    TOKEN,
    RawClient,
    Reference,
    ServerThread,
    assert_model_equal,
    make_model,
    random_update,
    wait_until,
)

GAMMA = 0.5


def grouping_policy(k: int, address: str, fan_in: int | None = None):
    """Hold updates until k are pending, then send all k through the
    aggregator at `address` as one group (claiming `fan_in` members)."""

    def policy(snap: Snapshot) -> list[PlanItem]:
        if len(snap.pending) < k:
            return []
        first = snap.pending[0].id
        return [PlanItem(t.id, start=snap.now, position=i, planned_seconds=0.01,
                         route=Route("agg", address, first, fan_in or k, i))
                for i, t in enumerate(snap.pending[:k])]

    return policy


def _server_and_aggregator(threads: list, loop_kind: str, model, group_timeout: float,
                           tau_max: int | None = None, servers: list[str] | None = None):
    """A server and an aggregator that forwards to it (or to `servers` only)."""
    server = ServerThread(ParameterStore(model, momentum=GAMMA, tau_max=tau_max),
                          loop_kind=loop_kind).__enter__()
    threads.append(server)
    agg = ServerThread(None, loop_kind=loop_kind, endpoint=Aggregator(
        job=JOB, token=TOKEN, servers=servers or [server.address],
        group_timeout=group_timeout, metrics=AggregatorMetrics())).__enter__()
    threads.append(agg)
    return server, agg


@pytest.fixture
def live(loop_kind):
    threads: list = []

    def start(k: int, *, fan_in: int | None = None, group_timeout: float = 5.0,
              tau_max: int | None = None, servers: list[str] | None = None):
        model = make_model()
        server, agg = _server_and_aggregator(threads, loop_kind, model, group_timeout, tau_max,
                                             servers)
        controller = ServerThread(None, loop_kind=loop_kind, endpoint=Controller(
            grouping_policy(k, agg.address, fan_in), job=JOB, token=TOKEN,
            tau_max=tau_max)).__enter__()
        threads.append(controller)
        return server, agg, controller, model

    yield start
    for t in reversed(threads):
        if t._thread.is_alive():
            t.__exit__(None, None, None)


def test_a_group_is_summed_forwarded_once_and_each_member_told(live):
    server, agg, controller, model = live(4)
    w, prev, version = dict(model), dict(model), 0
    with mlfabric.connect(server.address, job=JOB, token=TOKEN,
                          controller=controller.address) as ps:
        for rnd in range(2):
            updates = [random_update(model, seed=10 * rnd + i) for i in range(4)]
            futures = [ps.push(u, base_version=version) for u in updates]
            outcomes = [f.result(10) for f in futures]
            w, prev, version, delays = apply_aggregate(
                w, prev, version, [(u, version) for u in updates], GAMMA)
            assert [(o.applied, o.version, o.delay) for o in outcomes] == \
                [(True, version, d) for d in delays]
        assert_model_equal(ps.pull(timeout=10)[1], w)
    sm, am = server.metrics, agg.metrics
    assert sm.aggregates_applied._value.get() == 2
    assert sm.updates_applied._value.get() == 8
    assert am.aggregates.labels("applied")._value.get() == 2
    assert am.members._value.get() == 8
    update_bytes = sum(a.nbytes for a in model.values())
    assert am.saved_bytes._value.get() == 2 * 3 * update_bytes
    # The server received 2 aggregates, not 8 updates.
    assert sm.received_bytes._value.get() < 3 * update_bytes + 64 * 1024
    # Each group's time has the wait for its members and the forward (they
    # overlap when the aggregate streams out while members arrive).
    seconds = {part: [am.registry.get_sample_value(f"mlfabric_aggregator_{part}_seconds_{s}")
                      for s in ("count", "sum")]
               for part in ("gather", "forward", "aggregation")}
    assert [seconds[p][0] for p in seconds] == [2, 2, 2]
    assert 0 < seconds["gather"][1] <= seconds["aggregation"][1]
    assert 0 < seconds["forward"][1] <= seconds["aggregation"][1]


def test_a_replicating_worker_aggregates_and_its_replica_replays_every_aggregate(live):
    """Worker-driven replication through an aggregator: each member goes to
    the replica at its place in the aggregate, and the replica ends bit for
    bit where the server is, each aggregate applied as the server's one step."""
    from mlfabric.replication.replica import ReplicaServer
    from mlfabric.runtime.metrics import ServerMetrics

    server, _agg, controller, model = live(4)
    with ServerThread(None, loop_kind=server.loop_kind, endpoint=ReplicaServer(
            ParameterStore(model, momentum=GAMMA), job=JOB, token=TOKEN,
            metrics=ServerMetrics())) as replica, \
            mlfabric.connect(server.address, job=JOB, token=TOKEN,
                             controller=controller.address, replica=replica.address) as ps:
        w, prev, version = dict(model), dict(model), 0
        for rnd in range(3):
            updates = [random_update(model, seed=10 * rnd + i) for i in range(4)]
            outcomes = [f.result(10) for f in [ps.push(u, base_version=version)
                                                for u in updates]]
            w, prev, version, _ = apply_aggregate(
                w, prev, version, [(u, version) for u in updates], GAMMA)
            assert [(o.applied, o.version, o.fan_in, o.index) for o in outcomes] == \
                [(True, version, 4, i) for i in range(4)]
        # A push's future resolves once the replica has it too.
        store = replica.server.store
        assert replica.call(lambda: store.version) == version == 12
        assert_model_equal(replica.call(lambda: store.snapshot()[1]), w)
        assert_model_equal(ps.pull(timeout=10)[1], w)
    assert replica.metrics.aggregates_applied._value.get() == 3
    assert server.metrics.aggregates_applied._value.get() == 3


def test_members_from_several_workers_with_different_base_versions(live):
    """Members are summed in the controller's order (request order here),
    and each gets its own delay: version before the step minus its base."""
    server, _agg, controller, model = live(3)
    clients = [mlfabric.connect(server.address, job=JOB, token=TOKEN,
                                controller=controller.address, name=f"w{i}") for i in range(3)]

    def push_in_order(updates, bases):
        futures = []
        for i, (c, u, b) in enumerate(zip(clients, updates, bases, strict=True)):
            futures.append(c.push(u, base_version=b))
            if i < 2:  # the next request only once this one is pending
                wait_until(lambda i=i: len(controller.server.state.pending) == i + 1,
                           what=f"request {i + 1} at the controller")
        return [f.result(10) for f in futures]

    try:
        first = [random_update(model, seed=i) for i in range(3)]
        got = push_in_order(first, [0, 0, 0])
        w, prev, version, _ = apply_aggregate(model, model, 0, [(u, 0) for u in first], GAMMA)
        assert version == 3
        assert [(o.version, o.delay) for o in got] == [(3, 0)] * 3
        second = [random_update(model, seed=10 + i) for i in range(3)]
        got = push_in_order(second, [0, 3, 3])
        w, prev, version, delays = apply_aggregate(
            w, prev, 3, [(second[0], 0), (second[1], 3), (second[2], 3)], GAMMA)
        assert (version, delays) == (6, [3, 0, 0])
        assert [(o.version, o.delay) for o in got] == [(6, 3), (6, 0), (6, 0)]
        assert_model_equal(clients[0].pull(timeout=10)[1], w)
    finally:
        for c in clients:
            c.close()


def test_a_group_missing_a_member_is_forwarded_after_the_timeout(live):
    server, agg, controller, model = live(3, fan_in=4, group_timeout=0.3)
    updates = [random_update(model, seed=i) for i in range(3)]
    with mlfabric.connect(server.address, job=JOB, token=TOKEN,
                          controller=controller.address) as ps:
        outcomes = [f.result(10) for f in [ps.push(u, base_version=0) for u in updates]]
        w, _, _version, _ = apply_aggregate(model, model, 0, [(u, 0) for u in updates], GAMMA)
        assert [(o.applied, o.version) for o in outcomes] == [(True, 3)] * 3
        assert_model_equal(ps.pull(timeout=10)[1], w)
    assert agg.metrics.group_timeouts._value.get() == 1
    # The group's wait for its members lasted the timeout (by the loop's clock).
    r = agg.metrics.registry
    assert r.get_sample_value("mlfabric_aggregator_gather_seconds_count") == 1
    assert r.get_sample_value("mlfabric_aggregator_gather_seconds_sum") >= 0.3 - LOOP_CLOCK_SLACK


def test_a_stopped_aggregator_fails_its_members_and_they_go_straight_to_the_server(
        live, caplog):
    """The aggregator stops with 3 of 4 members in: each worker is told, sends
    its update to the server directly (applied once), and the controller
    hears of the failure."""
    server, agg, controller, model = live(3, fan_in=4, group_timeout=30)
    caplog.set_level(logging.WARNING)
    updates = [random_update(model, seed=i) for i in range(3)]
    with mlfabric.connect(server.address, job=JOB, token=TOKEN,
                          controller=controller.address) as ps:
        futures = [ps.push(u, base_version=0) for u in updates]
        wait_until(lambda: len(agg.server.groups) == 1
                   and len(next(iter(agg.server.groups.values())).members) == 3,
                   what="three members at the aggregator")
        agg.__exit__(None, None, None)
        outcomes = [f.result(10) for f in futures]
        assert sorted(o.version for o in outcomes) == [1, 2, 3]
        assert all(o.applied for o in outcomes)
        ref = Reference(model, GAMMA)
        for _, u in sorted(zip(outcomes, updates, strict=True), key=lambda x: x[0].version):
            ref.apply(u)
        assert_model_equal(ps.pull(timeout=10)[1], ref.w)
    cm = controller.metrics
    wait_until(lambda: cm.aggregator_failures._value.get() == 3, what="failures reported")
    assert "agg" in controller.server.state.benched
    assert server.metrics.aggregates_applied._value.get() == 0
    assert any("straight to the server" in r.getMessage() for r in caplog.records)


def test_the_link_to_the_server_is_dialled_while_members_arrive(live):
    """The group's first member starts the aggregator's dial to the server, so
    the handshake overlaps the wait for the other members instead of
    following it."""
    server, agg, controller, model = live(1, fan_in=2, group_timeout=30)
    update = random_update(model, seed=0)
    with mlfabric.connect(server.address, job=JOB, token=TOKEN,
                          controller=controller.address) as ps:
        assert server.metrics.connected_clients._value.get() == 1  # the worker only
        future = ps.push(update, base_version=0)
        wait_until(lambda: server.metrics.connected_clients._value.get() == 2,
                   what="the aggregator's link to the server")
        # ... with the group still waiting for its second member.
        assert [len(g.members) for g in agg.server.groups.values()] == [1]
        assert agg.metrics.aggregates.labels("applied")._value.get() == 0
        agg.__exit__(None, None, None)  # the member goes straight to the server
        outcome = future.result(10)
        assert (outcome.applied, outcome.version) == (True, 1)
    assert server.metrics.aggregates_applied._value.get() == 0


@pytest.mark.parametrize("api", ["blocking", "asyncio"])
def test_workers_dial_the_controllers_aggregators_before_any_push(loop_kind, api, run_async):
    """The controller's welcome lists its aggregators and each client dials
    them at once, so a member's send never waits for a handshake; a client
    that does not aggregate (it replicates) dials none."""
    from mlfabric.client import aio

    model = make_model()
    with ServerThread(ParameterStore(model), loop_kind=loop_kind) as server, \
            ServerThread(None, loop_kind=loop_kind, endpoint=Aggregator(
                job=JOB, token=TOKEN, servers=[server.address],
                metrics=AggregatorMetrics())) as agg, \
            ServerThread(None, loop_kind=loop_kind, endpoint=Controller(
                lambda snap: [], job=JOB, token=TOKEN, tau_max=None,
                aggregators={"h1": agg.address})) as controller:
        dialled = agg.metrics.connected_clients._value.get
        if api == "blocking":
            with mlfabric.connect(server.address, job=JOB, token=TOKEN,
                                  controller=controller.address):
                wait_until(lambda: dialled() == 1, what="the client's link to the aggregator")
        else:
            async def body():
                async with await aio.connect(server.address, job=JOB, token=TOKEN,
                                             controller=controller.address):
                    loop = asyncio.get_running_loop()
                    await loop.run_in_executor(None, lambda: wait_until(
                        lambda: dialled() == 1, what="the client's link to the aggregator"))

            run_async(body())
        wait_until(lambda: dialled() == 0, what="the link closed with the client")
        # A replicating client aggregates too (its replica replays aggregates).
        with ServerThread(ParameterStore(model), loop_kind=loop_kind) as replica, \
                mlfabric.connect(server.address, job=JOB, token=TOKEN,
                                 controller=controller.address, replica=replica.address):
            wait_until(lambda: dialled() == 1, what="the replicating client's aggregator link")


def test_a_member_resent_after_its_aggregate_was_applied_is_not_applied_again(loop_kind):
    """The aggregate was applied but the answer was lost (the aggregator died
    after forwarding): the worker re-sends with the same uid and gets the
    aggregate's outcome; the model does not change."""
    model = make_model()
    with ServerThread(ParameterStore(model, momentum=GAMMA), loop_kind=loop_kind) as server:
        raw = RawClient(server.port)
        u1, u2 = random_update(model, 1), random_update(model, 2)
        total = {n: u1[n] + u2[n] for n in model}
        raw.send(Push(1, 0, total, members=(("a-1", 0, "w1"), ("b-1", 0, "w2"))))
        assert raw.recv_event() == PushResult(1, True, 2, 0, None, (0, 0))
        raw.send(Push(2, 0, u2, uid="b-1"))
        # With its place in the aggregate, where its worker's replica takes it.
        assert raw.recv_event() == PushResult(2, True, 2, 0, fan_in=2, index=1)
        w, _, _, _ = apply_aggregate(model, model, 0, [(u1, 0), (u2, 0)], GAMMA)
        assert_model_equal(server.call(lambda: server.store.snapshot()[1]), w)
        # An aggregate naming a member applied already is refused whole.
        raw.send(Push(3, 0, total, members=(("c-1", 0, "w3"), ("a-1", 0, "w1"))))
        err = raw.recv_event()
        assert err.code == "duplicate" and "'a-1' was applied already" in err.message
        assert server.metrics.updates_rejected.labels("duplicate")._value.get() == 2
        raw.close()


def test_the_aggregator_refuses_pushes_without_a_group(loop_kind):
    model = make_model()
    with ServerThread(None, loop_kind=loop_kind,
                      endpoint=Aggregator(job=JOB, token=TOKEN,
                                          servers=["127.0.0.1:1"])) as agg:
        raw = RawClient(agg.port)
        raw.send(Push(1, 0, model))
        err = raw.recv_event()
        assert err.code == "misrouted" and "this is an aggregator" in err.message
        raw.send(Push(2, 0, {"w": np.zeros(3)}, uid="u", group=1, fan_in=2, index=0,
                      dst="127.0.0.1:1"))
        err = raw.recv_event()
        assert err.code == "bad_dtype" and "float32" in err.message
        raw.close()


def test_asyncio_client_through_the_aggregator_and_its_fallback(live, run_async):
    """The asyncio client follows the same routes: one group applied as an
    aggregate, then, with the aggregator gone, the next group's members go
    straight to the server and each is applied once."""
    from mlfabric.client import aio

    server, agg, controller, model = live(2)
    first = [random_update(model, seed=i) for i in range(2)]
    second = [random_update(model, seed=10 + i) for i in range(2)]

    async def body():
        async with await aio.connect(server.address, job=JOB, token=TOKEN,
                                     controller=controller.address) as ps:
            got = await asyncio.gather(*[ps.push(u, base_version=0) for u in first])
            assert [(o.applied, o.version, o.delay) for o in got] == [(True, 2, 0)] * 2
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, agg.__exit__, None, None, None)
            got = await asyncio.gather(*[ps.push(u, base_version=2) for u in second])
            assert sorted(o.version for o in got) == [3, 4] and all(o.applied for o in got)
            return got, (await ps.pull())[1]

    got, final = run_async(body())
    w, prev, _, _ = apply_aggregate(model, model, 0, [(u, 0) for u in first], GAMMA)
    for _, u in sorted(zip(got, second, strict=True), key=lambda x: x[0].version):
        w, prev, _, _ = apply_aggregate(w, prev, 0, [(u, 0)], GAMMA)
    assert_model_equal(final, w)
    assert server.metrics.aggregates_applied._value.get() == 1


def test_an_aggregate_refused_for_a_stale_member_blames_no_one(live, caplog):
    """The server refuses an aggregate whose member is past tau_max: that
    member is answered stale, the others are applied straight, one by one,
    and the aggregator is not benched (it did nothing wrong). The server's
    log names the members' sources."""
    server, agg, controller, model = live(3, tau_max=1)
    caplog.set_level(logging.INFO, logger="mlfabric.server")
    with mlfabric.connect(server.address, job=JOB, token=TOKEN, name="worker-x",
                          controller=controller.address) as ps:
        first = [ps.push(random_update(model, seed=i), base_version=0) for i in range(3)]
        assert [f.result(10).version for f in first] == [3, 3, 3]
        late = [random_update(model, seed=10 + i) for i in range(3)]
        outcomes = [f.result(10) for f in [ps.push(u, base_version=b)
                                           for u, b in zip(late, [0, 3, 3], strict=True)]]
    assert (outcomes[0].applied, outcomes[0].delay) == (False, 3)
    assert outcomes[0].reason == ("stale: delay 3 exceeds tau_max 1; pull a fresher model (its "
                                  "aggregate was refused)")
    assert [(o.applied, o.version) for o in outcomes[1:]] == [(True, 4), (True, 5)]
    assert agg.metrics.aggregates.labels("refused")._value.get() == 1
    wait_until(lambda: sum(b.get() for b in controller.metrics.actual_seconds._buckets) == 6,
               what="6 outcomes reported")
    assert controller.server.state.benched == {}
    assert controller.metrics.aggregator_failures._value.get() == 0
    assert any(r.getMessage().startswith("refused an aggregate of updates from worker-x, "
                                         "worker-x, worker-x: stale: delay 3")
               for r in caplog.records)


@pytest.mark.parametrize("wait", [0.0, 1.0])
def test_with_a_group_wait_the_free_server_waits_for_one_aggregate_of_all(loop_kind, wait):
    """The real planner (mlfabric policy, holding groups), three updates
    pushed at once. On loopback each transfer ends long before the planner
    expects, so the server is always free when it plans: without a wait
    aggregation never stalls it and every update goes straight in; with a
    1 s wait the first is held for company and all three go as one aggregate."""
    model = make_model()
    # About 2.7 kB an update: planned at 0.5 s each into the server.
    network = Network(default=1e9, down={"127.0.0.1": 5e3})
    with ServerThread(ParameterStore(model, momentum=GAMMA), loop_kind=loop_kind) as server, \
            ServerThread(None, loop_kind=loop_kind, endpoint=Aggregator(
                job=JOB, token=TOKEN, servers=[server.address],
                metrics=AggregatorMetrics())) as agg, \
            ServerThread(None, loop_kind=loop_kind, endpoint=Controller(
                mlfabric_policy, job=JOB, token=TOKEN, tau_max=None, network=network,
                aggregators={"h1": agg.address},
                aggregation=AggregationConfig(hold=True, wait=wait))) as controller, \
            mlfabric.connect(server.address, job=JOB, token=TOKEN, host="w1",
                             controller=controller.address) as ps:
        updates = [random_update(model, seed=i) for i in range(3)]
        outcomes = [f.result(20) for f in [ps.push(u, base_version=0) for u in updates]]
        w, prev, version = dict(model), dict(model), 0
        if wait == 0.0:
            for u in updates:
                w, prev, version, _ = apply_aggregate(w, prev, version, [(u, 0)], GAMMA)
            assert [(o.version, o.delay) for o in outcomes] == [(1, 0), (2, 1), (3, 2)]
        else:
            w, prev, version, _ = apply_aggregate(
                w, prev, version, [(u, 0) for u in updates], GAMMA)
            assert [(o.version, o.delay) for o in outcomes] == [(3, 0)] * 3
        assert_model_equal(ps.pull(timeout=10)[1], w)
    assert server.metrics.aggregates_applied._value.get() == (0 if wait == 0.0 else 1)
    assert agg.metrics.members._value.get() == (0 if wait == 0.0 else 3)


# About 2.4 MB: members' bytes arrive over many reads, so the sum (and the
# stream to the server) advances before a member is whole.
BIG = {"w": (600_000,), "b": (10,)}


def _member_frames(model, group: int, dst: str, members, seed: int = 0):
    """Each member's push of `group`, as a frame on its connection."""
    fan_in = len(members)
    updates = [random_update(model, seed=seed + i) for i in range(fan_in)]
    frames = [m.frame(Push(1, 0, u, uid=f"u{group}-{i}", group=group, fan_in=fan_in,
                           index=i, dst=dst))
              for i, (m, u) in enumerate(zip(members, updates, strict=True))]
    return updates, frames


def _member_1_partly_in(server, agg, model):
    """Group 7 of two members: member 0 whole, member 1 70% sent, and the
    first MiB of their aggregate at the server already."""
    members = [RawClient(agg.port) for _ in range(2)]
    updates, frames = _member_frames(model, 7, server.address, members)
    members[0].send_raw(frames[0])
    rest = frames[1][len(frames[1]) * 7 // 10:]
    members[1].send_raw(frames[1][:-len(rest)])
    wait_until(lambda: server.metrics.received_bytes._value.get() >= 1 << 20,
               what="the first MiB of the aggregate at the server")
    # The aggregate at the server shows only that both members are past 1 MiB;
    # member 0's last bytes may still be in flight (then, when the group fails,
    # it is told so only once its update is in, with another message).
    wait_until(lambda: agg.call(lambda: any(0 in g.members for g in agg.server.groups.values())),
               what="member 0's whole update at the aggregator")
    return updates, members, rest


@pytest.fixture
def streaming(loop_kind):
    """start(group_timeout): a server with a 2.4 MB model and an aggregator,
    both live; the members are raw sockets, so a test decides how much of
    each update is in."""
    threads: list = []

    def start(group_timeout: float = 30.0):
        model = make_model(sizes=BIG)
        return (*_server_and_aggregator(threads, loop_kind, model, group_timeout), model)

    yield start
    for t in reversed(threads):
        t.__exit__(None, None, None)


def test_the_aggregate_streams_to_the_server_while_a_member_is_still_arriving(streaming):
    server, agg, model = streaming()
    updates, members, rest = _member_1_partly_in(server, agg, model)
    assert agg.metrics.streamed_bytes._value.get() >= 1 << 20
    assert server.call(lambda: server.store.version) == 0
    members[1].send_raw(rest)
    assert [m.recv_event() for m in members] == [
        PushResult(1, True, 2, 0, fan_in=2, index=i) for i in range(2)]
    w, _, _, _ = apply_aggregate(model, model, 0, [(u, 0) for u in updates], GAMMA)
    assert_model_equal(server.call(lambda: server.store.snapshot()[1]), w)
    assert agg.metrics.streamed_bytes._value.get() < sum(u.nbytes for u in updates[0].values())
    assert server.metrics.aggregates_applied._value.get() == 1
    for m in members:
        m.close()


@pytest.mark.parametrize("how", ["stalls", "disconnects"])
def test_a_member_lost_mid_update_abandons_the_streamed_aggregate(streaming, how):
    """Half the aggregate is at the server when member 1 stalls past the
    group timeout or drops: the partial frame goes with the link (the server
    applies nothing), both members are told to go straight to the server, and
    the next group is forwarded on a fresh link and applied whole."""
    # Stalling ends at the group timeout; a disconnect ends the group at once.
    server, agg, model = streaming(2.0 if how == "stalls" else 30.0)
    _, members, rest = _member_1_partly_in(server, agg, model)
    if how == "disconnects":
        members[1].close()
    failed = members[0].recv_event()  # the group timeout is 2 s; recv_event's bound 5 s
    assert failed.code == "aggregate_failed" and failed.req == 1
    reason = "it timed out after 2.0 s without member(s) [1]" if how == "stalls" else \
        "member 1 (raw) disconnected before its update was in"
    assert failed.message == (f"its aggregate was abandoned: {reason}; send update u7-0 "
                              f"straight to the server")
    if how == "stalls":
        members[1].send_raw(rest)
        late = members[1].recv_event()
        assert late.code == "aggregate_failed" and late.message == (
            f"group 7 is closed: {reason}; send update u7-1 straight to the server")
    assert server.call(lambda: server.store.version) == 0
    assert agg.metrics.aggregates.labels("failed")._value.get() == 1
    # The next group goes out on a new link, whole.
    members[1] = RawClient(agg.port)
    updates, frames = _member_frames(model, 8, server.address, members, seed=10)
    for m, f in zip(members, frames, strict=True):
        m.send_raw(f)
    assert [m.recv_event() for m in members] == [
        PushResult(1, True, 2, 0, fan_in=2, index=i) for i in range(2)]
    w, _, _, _ = apply_aggregate(model, model, 0, [(u, 0) for u in updates], GAMMA)
    assert_model_equal(server.call(lambda: server.store.snapshot()[1]), w)
    for m in members:
        m.close()


# --- where aggregates may go (issue 33) ----------------------------------------------


def test_destinations_match_an_address_in_any_spelling_and_nothing_else():
    listed = Destinations(["10.0.0.1:7070", " [::1]:7071", "Server-A.example:7072"])
    assert listed.addresses == ("10.0.0.1:7070", "[::1]:7071", "Server-A.example:7072")
    for dst, match in [("10.0.0.1:7070", "10.0.0.1:7070"), ("[10.0.0.1]:7070", "10.0.0.1:7070"),
                       ("::1:7071", "[::1]:7071"), ("[0:0::0001]:7071", "[::1]:7071"),
                       ("server-a.EXAMPLE:7072", "Server-A.example:7072")]:
        assert listed.match(dst) == match, dst
    # another port or host, a name for a listed address (names are not
    # resolved), and what is no address at all
    for dst in ("10.0.0.1:7071", "10.0.0.2:7070", "localhost:7071", "server-a:7072",
                "10.0.0.1", "10.0.0.1:0", "10.0.0.1:65536", ":7070", "", "\0"):
        assert listed.match(dst) is None, dst


def _trap():
    """A listening socket on a free loopback port that no one may dial."""
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen()
    return trap, f"127.0.0.1:{trap.getsockname()[1]}"


def assert_never_dialled(trap: socket.socket, within: float = 1.0) -> None:
    """No connection reaches `trap` within `within` seconds. The aggregator
    dials when a group's first bytes arrive, long before its answer, and
    the kernel completes a connection into the backlog without accept()."""
    trap.settimeout(within)
    with pytest.raises(TimeoutError):
        conn, peer = trap.accept()
        conn.close()
        pytest.fail(f"the aggregator connected from {peer}")


def _member(req: int, uid: str, dst: str, group: int, update, fan_in: int = 1,
            index: int = 0) -> Push:
    return Push(req, 0, update, uid=uid, group=group, fan_in=fan_in, index=index, dst=dst)


def refusal(req: int, uid: str, dst: str) -> Error:
    return Error(code="dst_not_allowed", req=req,
                 message=f"this aggregator does not forward to {dst!r}: it is not one of its "
                         f"servers (mlfabric agent --servers); send update {uid} straight to "
                         f"the server")


def test_a_member_bound_off_the_list_is_refused_and_nothing_is_dialled(loop_kind, caplog):
    """Issue 33: a member's dst made the aggregator dial any address. Now
    one not on its servers is refused with the reason, counted and logged
    (at most 5 lines per 10 s), and no connection reaches it; the same
    group id bound for the listed server aggregates exactly, members naming
    it in two spellings of one address joining one group."""
    caplog.set_level(logging.WARNING, logger="mlfabric.aggregator")
    model = make_model()
    u1, u2 = random_update(model, 1), random_update(model, 2)
    trap, off = _trap()
    with trap, ServerThread(ParameterStore(model, momentum=GAMMA), loop_kind=loop_kind) as server, \
            ServerThread(None, loop_kind=loop_kind, endpoint=Aggregator(
                job=JOB, token=TOKEN, servers=[server.address],
                metrics=AggregatorMetrics())) as agg:
        raw, other = RawClient(agg.port), RawClient(agg.port)
        peer, listed = f"127.0.0.1:{raw.sock.getsockname()[1]}", server.address
        for i in range(7):
            raw.send(_member(i + 1, f"w-{i}", off, 7, u1))
            assert raw.recv_event() == refusal(i + 1, f"w-{i}", off)
        assert_never_dialled(trap)
        assert agg.metrics.dst_refused._value.get() == 7
        assert agg.call(lambda: agg.server.groups) == {}
        # the listed server, named as "HOST:PORT" and "[HOST]:PORT": one group
        raw.send(_member(8, "a-1", server.address, 7, u1, fan_in=2, index=0))
        other.send(_member(1, "b-1", f"[127.0.0.1]:{server.port}", 7, u2, fan_in=2, index=1))
        assert raw.recv_event() == PushResult(8, True, 2, 0, fan_in=2, index=0)
        assert other.recv_event() == PushResult(1, True, 2, 0, fan_in=2, index=1)
        w, _, _, _ = apply_aggregate(model, model, 0, [(u1, 0), (u2, 0)], GAMMA)
        assert_model_equal(server.call(lambda: server.store.snapshot()[1]), w)
        raw.close()
        other.close()
    assert agg.metrics.aggregates.labels("applied")._value.get() == 1
    lines = [r.getMessage() for r in caplog.records if "not one of this aggregator's servers"
             in r.getMessage()]
    assert len(lines) == 5, lines  # rate-limited: 7 refusals, 5 lines
    assert lines[0] == (f"refused push 1 from raw ({peer}): its "
                        f"destination '{off}' is not one of this aggregator's servers "
                        f"({listed}); nothing was dialled. If it is a server of the "
                        f"job, add it to --servers as the workers name it")


def test_a_streaming_member_bound_off_the_list_opens_no_group_and_dials_nothing(streaming):
    """A large member is summed as it arrives, and a group's first bytes
    dial the server: a dst off the list must stop that before its end."""
    server, agg, model = streaming()
    trap, off = _trap()
    with trap:
        raw = RawClient(agg.port)
        frame = raw.frame(_member(1, "w-1", off, 9, random_update(model, 1)))
        rest = frame[len(frame) * 7 // 10:]
        raw.send_raw(frame[:-len(rest)])
        assert_never_dialled(trap)
        assert agg.call(lambda: agg.server.groups) == {}
        raw.send_raw(rest)
        assert raw.recv_event() == refusal(1, "w-1", off)
        raw.close()
    assert server.metrics.connected_clients._value.get() == 0


def test_workers_whose_server_is_off_the_list_lose_nothing(live):
    """Members refused for their dst go straight to their own server (the
    address they are connected to), each applied once; the controller hears
    of the aggregator's failure."""
    trap, off = _trap()
    with trap:
        server, agg, controller, model = live(4, servers=[off])
        updates = [random_update(model, seed=i) for i in range(4)]
        with mlfabric.connect(server.address, job=JOB, token=TOKEN,
                              controller=controller.address) as ps:
            outcomes = [f.result(10) for f in [ps.push(u, base_version=0) for u in updates]]
            assert sorted(o.version for o in outcomes) == [1, 2, 3, 4]
            assert all(o.applied for o in outcomes)
            ref = Reference(model, GAMMA)
            for _, u in sorted(zip(outcomes, updates, strict=True), key=lambda x: x[0].version):
                ref.apply(u)
            assert_model_equal(ps.pull(timeout=10)[1], ref.w)
        assert_never_dialled(trap, within=0.2)  # (the members were answered long before)
    assert agg.metrics.dst_refused._value.get() == 4
    assert server.metrics.aggregates_applied._value.get() == 0
    wait_until(lambda: controller.metrics.aggregator_failures._value.get() == 4,
               what="the failures reported")


def test_a_listed_address_that_does_not_prove_itself_gets_no_proof(loop_kind):
    """No proof to a listener that has not proven itself (issue 33): a
    listener on the list that answers the aggregator's hello with a wrong
    server proof gets an ERROR(auth) and nothing made with the token; the
    member is told to go straight to the server."""
    model = make_model()
    trap, fake = _trap()
    heard: list[object] = []

    def impostor() -> None:
        trap.settimeout(10)
        conn, _ = trap.accept()
        with conn:
            conn.settimeout(10)
            wire = Connection()

            def event():
                while (ev := wire.next_event()) is NEED_DATA:
                    data = conn.recv(1 << 16)
                    if not data:
                        return None
                    wire.receive_data(data)
                return ev

            heard.append(event())  # the hello
            conn.sendall(wire.send_bytes(Challenge(nonce=b"n" * 32, proof=b"\0" * 32,
                                                   role="server")))
            heard.append(event())  # what it answers to a wrong proof
            heard.append(event())  # then nothing: the connection closes

    thread = threading.Thread(target=impostor, daemon=True)
    with trap, ServerThread(None, loop_kind=loop_kind, endpoint=Aggregator(
            job=JOB, token=TOKEN, servers=[fake], metrics=AggregatorMetrics())) as agg:
        thread.start()
        raw = RawClient(agg.port)
        raw.send(_member(1, "w-1", fake, 3, random_update(model, 1)))
        answer = raw.recv_event()
        thread.join(10)
        raw.close()
    assert not thread.is_alive()
    assert isinstance(heard[0], Hello) and heard[0].job == JOB
    assert heard[1:] == [Error(code="auth", message="authentication failed: this listener did "
                                                    "not prove it holds the job's token"), None]
    assert answer.code == "aggregate_failed" and answer.req == 1
    assert (f"the aggregate could not be delivered to {fake}: authentication failed: the "
            f"parameter server at {fake} did not prove it holds job {JOB!r}'s token") \
        in answer.message
