"""The replica role: updates applied strictly in the server's sequence,
whatever order they arrive in, checked bit for bit against a numpy replay."""

from __future__ import annotations

import time

import numpy as np
import pytest

from mlfabric.errors import InvalidUpdate, SequenceGap
from mlfabric.replication.replica import ReplicaServer
from mlfabric.replication.sequencer import Sequencer
from mlfabric.runtime.metrics import ServerMetrics
from mlfabric.server.store import ParameterStore
from mlfabric.wire.protocol import Error, Ping, Pong, Promote, Pull, Push, PushResult, Resync

from support import (
    JOB,
    TOKEN,
    RawClient,
    Reference,
    ServerThread,
    assert_model_equal,
    make_model,
    random_update,
)

# -- the pure sequencer -------------------------------------------------------


def test_sequencer_releases_in_order_whatever_the_arrival_order():
    s: Sequencer[str] = Sequencer(5, max_pending=8)
    released = []
    for seq in (7, 9, 6, 8, 5):
        assert s.offer(seq, f"u{seq}") == "accepted"
        released += list(s.ready())
        if seq != 5:
            assert released == []
    assert released == [(5, "u5"), (6, "u6"), (7, "u7"), (8, "u8"), (9, "u9")]
    assert s.next_seq == 10 and s.pending == {}


def test_sequencer_never_releases_a_number_twice():
    s: Sequencer[str] = Sequencer(1, max_pending=4)
    assert s.offer(2, "first") == "accepted"
    assert s.offer(2, "again") == "held"
    assert s.missing() == [1]
    assert s.offer(1, "a") == "accepted"
    assert list(s.ready()) == [(1, "a"), (2, "first")]
    assert s.offer(1, "late") == "applied"
    assert s.offer(2, "late") == "applied"
    assert list(s.ready()) == []


def test_sequencer_buffer_is_bounded_with_a_clear_error():
    s: Sequencer[int] = Sequencer(10, max_pending=3)
    s.offer(11, 0)
    s.offer(12, 0)
    with pytest.raises(SequenceGap, match=r"sequence number 13 .* waits for 10; it holds at "
                                          r"most 3 .*updates 10\.\.12 first"):
        s.offer(13, 0)
    assert sorted(s.pending) == [11, 12]


def test_sequencer_reset_drops_what_a_snapshot_already_holds():
    s: Sequencer[str] = Sequencer(1, max_pending=8)
    for seq in (3, 5, 6):
        s.offer(seq, str(seq))
    s.reset(5)
    assert list(s.ready()) == [(5, "5"), (6, "6")]


# -- the store ----------------------------------------------------------------


def test_apply_sequenced_refuses_a_number_out_of_turn_and_skips_staleness():
    model = make_model()
    store = ParameterStore(model, momentum=0.9, tau_max=0)
    with pytest.raises(InvalidUpdate, match="sequence number 2 is not the next one \\(1\\)"):
        store.apply_sequenced(2, 0, random_update(model, 1))
    assert store.version == 0
    store.apply_sequenced(1, 0, random_update(model, 1))
    # Delay 1 > tau_max 0: the server decided to apply it, so the replica does too.
    outcome = store.apply_sequenced(2, 0, random_update(model, 2))
    assert (outcome.applied, outcome.version, outcome.delay) == (True, 2, 1)


# -- the replica endpoint -----------------------------------------------------


@pytest.fixture
def replica(loop_kind):
    started = []

    def start(model, *, momentum=0.9, max_pending=64, recovery=0.3):
        endpoint = ReplicaServer(ParameterStore(model, momentum=momentum), job=JOB,
                                 token=TOKEN, metrics=ServerMetrics(), max_pending=max_pending,
                                 recovery=recovery)
        st = ServerThread(None, loop_kind=loop_kind, endpoint=endpoint)
        started.append(st.__enter__())
        return st

    yield start
    for st in started:
        st.__exit__(None, None, None)


def test_replica_applies_shuffled_pushes_in_sequence_exactly(replica):
    model = make_model()
    st = replica(model, momentum=0.9)
    n = 12
    updates = [random_update(model, seed) for seed in range(n)]
    # Seq 1 comes last, so every other update waits for it.
    order = [*(1 + np.random.default_rng(3).permutation(n - 1)), 0]
    raw = RawClient(st.port)
    try:
        for req, i in enumerate(order, 1):
            if i == 0:
                # A second copy of an update that is waiting: held, applied once.
                raw.send(Push(req=100, base_version=0, tensors=updates[n - 1], seq=n))
            raw.send(Push(req=req, base_version=0, tensors=updates[i], seq=int(i) + 1))
        answers = {}
        while len(answers) < n + 1:
            event = raw.recv_event()
            assert isinstance(event, PushResult), event
            answers[event.req] = event
        # A copy of an update already applied: answered, not applied again.
        raw.send(Push(req=101, base_version=0, tensors=updates[0], seq=1))
        dup = raw.recv_event()
        raw.send(Pull(req=102))
        pulled = raw.recv_event()
    finally:
        raw.close()
    for req, i in enumerate(order, 1):
        assert (answers[req].applied, answers[req].version) == (True, i + 1)
    assert (answers[100].applied, answers[100].version) == (True, n)
    assert isinstance(dup, PushResult) and not dup.applied
    assert dup.reason == f"duplicate: sequence number 1 was already applied (replica at " \
                         f"version {n})"
    ref = Reference(model, 0.9)
    for u in updates:
        ref.apply(u)
    assert pulled.version == n
    assert_model_equal(dict(pulled.tensors), ref.w)
    assert st.metrics.updates_applied._value.get() == n
    assert st.metrics.updates_rejected.labels("duplicate")._value.get() == 2
    assert st.metrics.replica_pending._value.get() == 0


def test_replica_refuses_unsequenced_pushes_gaps_and_bad_layouts(replica):
    model = make_model()
    st = replica(model, max_pending=2)
    raw = RawClient(st.port)
    try:
        raw.send(Push(req=1, base_version=0, tensors=random_update(model, 0)))
        err = raw.recv_event()
        assert isinstance(err, Error) and err.code == "misrouted" and err.req == 1
        assert "this is a replica at version 0" in err.message
        raw.send(Push(req=2, base_version=0, tensors=random_update(model, 0), seq=3))
        err = raw.recv_event()
        assert isinstance(err, Error) and err.code == "seq_gap" and err.req == 2
        assert "waits for 1" in err.message
        raw.send(Push(req=3, base_version=0, tensors={"w": model["w"]}, seq=1))
        err = raw.recv_event()
        assert isinstance(err, Error) and err.code == "unknown_tensor"
        # The connection stays usable, and nothing was applied.
        raw.send(Pull(req=4))
        pulled = raw.recv_event()
        assert pulled.version == 0
        assert_model_equal(dict(pulled.tensors), model)
    finally:
        raw.close()


def test_the_server_refuses_a_sequenced_push(loop_kind):
    model = make_model()
    with ServerThread(ParameterStore(model), loop_kind=loop_kind) as st:
        raw = RawClient(st.port)
        try:
            raw.send(Push(req=1, base_version=0, tensors=random_update(model, 0), seq=1))
            err = raw.recv_event()
        finally:
            raw.close()
    assert isinstance(err, Error) and err.code == "misrouted"
    assert "this is the server" in err.message
    assert st.store is not None and st.store.version == 0


def test_promotion_applies_what_it_holds_then_serves(replica):
    model = make_model()
    st = replica(model, momentum=0.9, recovery=0.1)
    u = [random_update(model, seed) for seed in range(6)]
    raw = RawClient(st.port)
    try:
        raw.send(Ping(req=1))
        assert raw.recv_event() == Pong(req=1, role="replica", version=0)
        for req, seq in ((2, 1), (3, 2)):
            raw.send(Push(req=req, base_version=0, tensors=u[seq], seq=seq))
            assert raw.recv_event().version == seq
        # Update 3 never arrives (its worker is gone too); 4 waits behind it.
        raw.send(Push(req=4, base_version=0, tensors=u[4], seq=4))
        raw.send(Promote(req=5, force=True))
        assert raw.recv_event() == Pong(req=5, role="server", version=2)
        # New pushes wait for the recovery; base 9 is the lost server's version.
        raw.send(Push(req=6, base_version=9, tensors=u[5]))
        answers = {}
        while len(answers) < 2:
            event = raw.recv_event()
            answers[event.req] = event
        raw.send(Push(req=7, base_version=0, tensors=u[3], seq=3))
        late = raw.recv_event()
        raw.send(Ping(req=8))
        pong = raw.recv_event()
        raw.send(Pull(req=9))
        pulled = raw.recv_event()
    finally:
        raw.close()
    assert (answers[4].applied, answers[4].version) == (True, 3)  # renumbered over the gap
    assert (answers[6].applied, answers[6].version, answers[6].delay) == (True, 4, 0)
    assert isinstance(late, Error) and late.code == "misrouted"
    assert "arrived after recovery ended" in late.message
    assert pong == Pong(req=8, role="server", version=4)
    ref = Reference(model, 0.9)
    for i in (1, 2, 4, 5):
        ref.apply(u[i])
    assert pulled.version == 4
    assert_model_equal(dict(pulled.tensors), ref.w)


# -- promotion only when the server is gone ---------------------------------


def test_promotion_is_refused_while_the_replica_still_reaches_the_server(replica, loop_kind):
    """Any token holder could promote a replica beside a live server: now the
    replica checks the server it would replace itself, and only a forced
    promotion (an operator's explicit word) skips that."""
    model = make_model()
    with ServerThread(ParameterStore(model, momentum=0.9), loop_kind=loop_kind) as server:
        address = server.address
        st = replica(model, momentum=0.9)
        raw = RawClient(st.port)
        try:
            raw.send(Promote(req=1))
            unnamed = raw.recv_event()
            raw.send(Promote(req=2, server=server.address))
            alive = raw.recv_event()
            raw.send(Ping(req=3))
            still = raw.recv_event()
        finally:
            raw.close()
        assert isinstance(unnamed, Error) and unnamed.code == "promote_refused"
        assert "must name the server it replaces" in unnamed.message
        assert isinstance(alive, Error) and alive.code == "server_alive", alive
        assert f"the server at {server.address} still answers the replica (version 0)" in (
            alive.message)
        assert "mlfabric promote --force" in alive.message
        assert still == Pong(req=3, role="replica", version=0)
        assert st.metrics.promotions_refused._value.get() == 2
    # The server is gone now: the same promotion goes through.
    raw = RawClient(st.port)
    try:
        raw.send(Promote(req=4, server=address))
        assert raw.recv_event() == Pong(req=4, role="server", version=0)
    finally:
        raw.close()


# -- a gap that will not fill: resync from the server's state -----------------


def test_a_replica_reports_its_gap_and_resyncs_from_the_server(replica, loop_kind):
    """Update 2 was applied by the server, but its worker died before feeding
    the replica: 3 and 4 wait behind it. The replica says how long it has
    waited; told to RESYNC, it takes the server's state, answers the pushes
    it held as applied (the state holds them) and goes on from there, bit for
    bit the server's model."""
    model = make_model()
    gamma = 0.9
    u = [random_update(model, seed) for seed in range(7)]
    store = ParameterStore(model, momentum=gamma)
    for i in range(1, 6):
        store.apply(i - 1, u[i])  # the server is at version 5
    with ServerThread(store, loop_kind=loop_kind) as server:
        st = replica(model, momentum=gamma)
        raw = RawClient(st.port)
        try:
            raw.send(Push(req=1, base_version=0, tensors=u[1], seq=1))
            assert raw.recv_event().version == 1
            raw.send(Push(req=3, base_version=2, tensors=u[3], seq=3))
            raw.send(Push(req=4, base_version=3, tensors=u[4], seq=4))
            raw.send(Ping(req=10))
            gap = raw.recv_event()
            raw.send(Resync(req=11, server=server.address))
            answers = {}
            while len(answers) < 3:
                event = raw.recv_event()
                answers[event.req] = event
            raw.send(Push(req=5, base_version=4, tensors=u[5], seq=5))  # in the state
            dup = raw.recv_event()
            raw.send(Push(req=6, base_version=5, tensors=u[6], seq=6))
            six = raw.recv_event()
            raw.send(Ping(req=12))
            after = raw.recv_event()
            raw.send(Pull(req=13))
            pulled = raw.recv_event()
        finally:
            raw.close()
        server.call(lambda: store.apply(5, u[6]))
        want = {n: w.copy() for n, w in store.weights.items()}
    assert isinstance(gap, Pong) and gap.version == 1 and gap.gap is not None and gap.gap >= 0
    resynced = answers[11]
    assert isinstance(resynced, Pong) and (resynced.role, resynced.version) == ("replica", 5)
    ref = Reference(model, gamma)
    for x in u[1:6]:
        ref.apply(x)
    velocity = np.sqrt(sum(np.sum((ref.w[n].astype(np.float64) - ref.prev[n]) ** 2)
                           for n in ref.w))
    assert resynced.velocity == pytest.approx(velocity, rel=1e-9)
    for req, seq in ((3, 3), (4, 4)):
        assert isinstance(answers[req], PushResult)
        assert (answers[req].applied, answers[req].version) == (True, seq)
    assert dup.applied is False and "duplicate" in dup.reason
    assert (six.applied, six.version) == (True, 6)
    assert after.gap is None and after.version == 6
    assert_model_equal(dict(pulled.tensors), want)
    assert st.metrics.replica_resyncs._value.get() == 1



def test_mlfabric_promote_checks_the_server_unless_forced(replica, tmp_path, capsys):
    """The operator's command: refused while the server answers the replica,
    and only --force skips that check."""
    from mlfabric import cli

    model = make_model()
    token_file = tmp_path / "job.token"
    token_file.write_bytes(TOKEN)
    token_file.chmod(0o600)
    common = ["--job", JOB, "--token-file", str(token_file)]
    with ServerThread(ParameterStore(model, momentum=0.9)) as server:
        st = replica(model, momentum=0.9)
        assert cli.main(["promote", "--replica", st.address, *common]) == 2
        assert "give --server HOST:PORT" in capsys.readouterr().err
        assert cli.main(["promote", "--replica", st.address, "--server", server.address,
                         *common]) == 2
        err = capsys.readouterr().err
        assert f"the replica at {st.address} refused: the server at {server.address} still " \
               f"answers the replica (version 0)" in err
        assert cli.main(["promote", "--replica", st.address, "--force", *common]) == 0
        assert (f"the replica at {st.address} is the server from version 0 (forced)"
                in capsys.readouterr().out)
        assert st.call(lambda: st.server.promoted) is True


def test_a_missing_update_still_arriving_is_no_gap(replica):
    """A large update on a slow link arrives after later ones: while its
    bytes are coming in, the replica reports no gap (a resync would be two
    model transfers for nothing); once its connection dies, it does."""
    model = make_model()
    st = replica(model, momentum=0.9)
    u = [random_update(model, seed) for seed in range(4)]
    slow, fast, probe = RawClient(st.port), RawClient(st.port), RawClient(st.port)
    try:
        fast.send(Push(req=1, base_version=0, tensors=u[2], seq=2))  # held: 1 is missing
        frame = slow.frame(Push(req=1, base_version=0, tensors=u[1], seq=1))
        slow.send_raw(frame[: len(frame) // 2])  # 1 is on its way

        def gap():
            probe.send(Ping(req=9))
            return probe.recv_event().gap

        # Wait (bounded) until the replica has read the half frame.
        deadline = time.monotonic() + 5
        while st.call(lambda: dict(st.server.arriving)) == {}:
            assert time.monotonic() < deadline, "the half frame was not read"
            time.sleep(0.01)
        assert st.call(lambda: st.server.sequencer.next_seq) == 1
        assert gap() is None
        slow.close()  # its worker died mid-transfer
        deadline = time.monotonic() + 5
        while (g := gap()) is None:
            assert time.monotonic() < deadline, "no gap reported after the sender died"
            time.sleep(0.01)
        assert g > 0
    finally:
        for raw in (fast, probe):
            raw.close()


# -- aggregates ---------------------------------------------------------------


def test_sequencer_releases_an_aggregate_only_whole():
    # Items are (fan_in, index); an aggregate's first member names its span.
    s: Sequencer[tuple[int, int]] = Sequencer(1, max_pending=8, span=lambda item: item[0])
    s.offer(1, (1, 0))
    assert list(s.ready()) == [(1, (1, 0))]
    for seq, item in ((2, (3, 0)), (4, (3, 2)), (5, (1, 0))):
        s.offer(seq, item)
    assert list(s.ready()) == [] and s.waiting_for() == 3
    s.offer(3, (3, 1))
    assert list(s.ready()) == [(2, (3, 0)), (3, (3, 1)), (4, (3, 2)), (5, (1, 0))]
    assert s.next_seq == 6 and s.waiting_for() == 6


def _server_steps(model, gamma):
    """A server store through single updates and aggregates (summed as an
    aggregator sums them, streamed in small chunks or whole), and the
    members of each step as (first version, [(base, update), ...])."""
    from mlfabric.agent.group_sum import GroupSum

    store = ParameterStore(model, momentum=gamma)
    steps = []
    for sizes, seed in (((1,), 0), ((3,), 10), ((1,), 20), ((2,), 30), ((4,), 40)):
        (k,) = sizes
        members = [(store.version, random_update(model, seed + i)) for i in range(k)]
        first = store.version + 1
        if k == 1:
            store.apply(*members[0])
        else:
            flat = [np.concatenate([u[n].reshape(-1) for n in model]) for _, u in members]
            group = GroupSum(k, flat[0].nbytes, chunk=7)
            for i in reversed(range(k)):  # bytes arrive in any order
                group.member_done(i, flat[i].view(np.uint8))
            total, offset = {}, 0
            acc = group.total()
            for n, w in model.items():
                total[n] = acc[offset:offset + w.size].reshape(w.shape)
                offset += w.size
            store.apply_aggregate([(f"u{seed}-{i}", b) for i, (b, _) in enumerate(members)],
                                  total)
        steps.append((first, members))
    return store, steps


def test_a_replica_replays_aggregates_bit_for_bit_whatever_the_arrival_order(replica):
    """Members of an aggregate go to the replica at their places with
    (fan_in, index); it holds them until all are in and applies their sum as
    the server's one step: the same weights, version and norms, bit for bit."""
    model = make_model()
    server, steps = _server_steps(model, 0.9)
    st = replica(model, momentum=0.9)
    pushes = []
    for first, members in steps:
        for i, (base, u) in enumerate(members):
            place = {} if len(members) == 1 else {"fan_in": len(members), "index": i}
            pushes.append(Push(req=len(pushes) + 1, base_version=base, tensors=u,
                               seq=first + i, **place))
    order = np.random.default_rng(5).permutation(len(pushes))
    raws = [RawClient(st.port), RawClient(st.port)]
    try:
        for j, i in enumerate(order):
            raws[j % 2].send(pushes[i])
        answers = {}
        for r, raw in enumerate(raws):
            for _ in range(len(order[r::2])):
                event = raw.recv_event()
                assert isinstance(event, PushResult), event
                answers[event.req] = event
        raws[0].send(Pull(req=99))
        pulled = raws[0].recv_event()
        raws[0].send(Ping(req=100, since=0))
        pong = raws[0].recv_event()
    finally:
        for raw in raws:
            raw.close()
    for first, members in steps:
        k = len(members)
        for i in range(k):
            push = next(p for p in pushes if p.seq == first + i)
            want = (True, first + k - 1, first - 1 - members[i][0])
            a = answers[push.req]
            assert (a.applied, a.version, a.delay) == want
            assert (a.fan_in, a.index) == ((None, None) if k == 1 else (k, i))
    assert pulled.version == server.version == 11
    assert_model_equal(dict(pulled.tensors), server.weights)
    assert pong.norms_from == 1 and list(pong.norms) == server.norms_since(0)[1]
    assert pong.spans == ((4, 3), (7, 2), (11, 4))
    assert st.metrics.aggregates_applied._value.get() == 3
    assert st.metrics.updates_applied._value.get() == 11


def test_a_replica_refuses_a_member_that_does_not_fit_its_aggregate(replica):
    model = make_model()
    st = replica(model, max_pending=4)
    raw = RawClient(st.port)
    u = random_update(model, 0)
    try:
        raw.send(Push(req=1, base_version=0, tensors=u, seq=2, fan_in=2, index=1))
        raw.send(Push(req=2, base_version=0, tensors=u, seq=3, fan_in=3, index=1))
        err = raw.recv_event()
        assert isinstance(err, Error) and (err.code, err.req) == ("out_of_order", 2)
        assert err.message == ("update 3 says it is a step of 3 from version 2, but the update "
                               "held at 2 says 2 from 1")
        raw.send(Push(req=3, base_version=0, tensors=u, seq=1, fan_in=5, index=0))
        err = raw.recv_event()
        assert isinstance(err, Error) and err.message == (
            "update 1 is a member of an aggregate of 5, more than the 4 updates this replica "
            "holds out of order: start it with --max-pending 5 or more")
        raw.send(Push(req=4, base_version=0, tensors=u, seq=1, fan_in=2, index=0))
        done = [raw.recv_event(), raw.recv_event()]
        assert sorted((d.req, d.version, d.index) for d in done) == [(1, 2, 1), (4, 2, 0)]
        # Past the aggregate's start, a member claiming a place inside it does not fit.
        raw.send(Push(req=5, base_version=0, tensors=u, seq=3, fan_in=3, index=2))
        err = raw.recv_event()
        assert isinstance(err, Error) and err.message == (
            "update 3 is member 2 of an aggregate from version 1, but this replica is past "
            "version 0")
    finally:
        raw.close()
    assert st.metrics.updates_rejected.labels("out_of_order")._value.get() == 3


def test_a_promoted_replica_applies_the_members_that_came_as_one_step(replica):
    """The server died after applying an aggregate of 3; one member's worker
    died with it: the promoted replica applies the two it has as one step
    (renumbered), and each member is told its new place."""
    model = make_model()
    st = replica(model, momentum=0.9, recovery=0.1)
    u = [random_update(model, seed) for seed in range(3)]
    raw = RawClient(st.port)
    try:
        raw.send(Push(req=1, base_version=0, tensors=u[0], seq=1, fan_in=3, index=0))
        raw.send(Push(req=2, base_version=0, tensors=u[2], seq=3, fan_in=3, index=2))
        raw.send(Promote(req=3, force=True))
        assert raw.recv_event() == Pong(req=3, role="server", version=0)
        answers = sorted((raw.recv_event() for _ in range(2)), key=lambda a: a.req)
        raw.send(Pull(req=4))
        pulled = raw.recv_event()
    finally:
        raw.close()
    assert answers == [PushResult(1, True, 2, 0, fan_in=2, index=0),
                       PushResult(2, True, 2, 0, fan_in=2, index=1)]
    ref = ParameterStore(model, momentum=0.9)
    ref.apply_aggregate([("a", 0), ("c", 0)], {n: u[0][n] + u[2][n] for n in model})
    assert pulled.version == 2
    assert_model_equal(dict(pulled.tensors), ref.weights)
