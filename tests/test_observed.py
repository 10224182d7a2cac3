"""The controller's closed loop (issue 34): rates learnt from the job's own
transfers, and a release order the real link honours. Pure: a fake clock."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from mlfabric.controller.state import ControlState, Go
from mlfabric.scheduling import observed
from mlfabric.scheduling.plan import Network, PlanItem, Snapshot
from mlfabric.scheduling.policies import mlfabric_policy

MB = 1e6


def test_a_completion_sets_the_downlinks_rate_up_or_down():
    net = Network(default=100 * MB, down={"s": 10 * MB})
    assert observed.bottleneck(net, "a", "s") == ("down", "s")
    assert observed.bottleneck(Network(default=10 * MB), "a", "s") == ("down", "s")  # a tie
    assert observed.bottleneck(Network(default=10 * MB, up={"a": 2 * MB}), "a", "s") == ("up", "a")
    delivered = observed.Delivered()
    # Planned at 10 MB/s for 1 s, took 2 s: the downlink delivers 5 MB/s (no
    # faster transfer into it to blame a's uplink instead).
    slow = delivered.completed(net, "a", "s", believed=10 * MB, planned_seconds=1.0,
                               seconds=2.0)
    assert slow.observed_down == {"s": 5 * MB} and slow.observed_up == {}
    assert slow.rate("b", "s") == 5 * MB
    # Planned at 5 MB/s, took half the time: back to the configured rate, no cap.
    back = delivered.completed(slow, "b", "s", believed=5 * MB, planned_seconds=2.0,
                               seconds=1.0)
    assert back.observed_down == {} and back.rate("b", "s") == 10 * MB
    # Half the link planned beside another transfer, and it got half: no change.
    same = observed.Delivered().completed(net, "a", "s", believed=10 * MB,
                                          planned_seconds=2.0, seconds=2.0)
    assert same.observed_down == {}


def test_an_overdue_transfer_only_lowers_the_rate():
    net = Network(default=100 * MB, down={"s": 10 * MB})
    late = observed.overdue(net, "a", "s", believed=10 * MB, planned_seconds=1.0, elapsed=4.0)
    assert late.down_rate("s") == 2.5 * MB
    assert observed.overdue(late, "a", "s", believed=10 * MB, planned_seconds=1.0,
                            elapsed=2.0) is late  # 5 MB/s is no news below 2.5
    assert observed.overdue(net, "a", "s", believed=10 * MB, planned_seconds=1.0,
                            elapsed=0.5) is net


def test_a_critical_transfer_and_its_guard():
    assert observed.order_guard(1.0) == pytest.approx(0.1)
    assert observed.order_guard(0.01) == observed.ORDER_GUARD_MIN
    assert not observed.RunningOrder([], now=0.0, tau_max=1).has_critical
    # One running transfer, planned to end at 1.0 after 1 s, one version stale
    # at tau_max 1: critical.
    critical = [(1.0, 7, 1.0, 1, True)]
    assert observed.RunningOrder(critical, now=0.0, tau_max=1).critical() == [(1.0, 1.0)]
    # Fresher, or through an aggregator: not critical.
    assert not observed.RunningOrder([(1.0, 7, 1.0, 0, True)], now=0.0, tau_max=1
                                     ).has_critical
    assert not observed.RunningOrder([(1.0, 7, 1.0, 1, False)], now=0.0, tau_max=1
                                     ).has_critical


def test_a_newcomer_names_the_running_transfers_it_would_refuse_by_passing_them():
    """Issue 34: a transfer the plan has land before a newcomer, with fewer
    versions of slack than the transfers that could pass it (those planned
    after it, the newcomer too), is named in the newcomer's go, and its
    server applies the newcomer only after it."""
    # tau_max 10. r1 ends first, 8 stale: 2 more may pass it; r2: 9 more.
    rows = [(1.0, 1, 1.0, 8, True), (1.1, 2, 1.0, 0, True)]
    assert observed.RunningOrder(rows, now=None, tau_max=10).must_follow(2.0, 9) is None
    # With a third running after r1, a newcomer would be the third that could pass it.
    rows.append((1.2, 3, 0.5, 0, True))
    order = observed.RunningOrder(rows, now=None, tau_max=10)
    assert order.must_follow(2.0, 9) == (
        (1,), pytest.approx(observed.FOLLOW_PATIENCE * 1.0))
    # Planned to land before r1, or between r1 and r2: it passes nothing at risk.
    assert order.must_follow(0.5, 9) is None
    assert order.must_follow(1.05, 9) == ((1,), pytest.approx(observed.FOLLOW_PATIENCE))
    # Through an aggregator: never named (its aggregate is another push).
    rows[0] = (1.0, 1, 1.0, 8, False)
    assert observed.RunningOrder(rows, now=None, tau_max=10).must_follow(2.0, 9) is None


def test_the_wait_for_a_named_transfer_is_bounded_by_its_length_or_its_lateness():
    # Critical (10 stale at tau_max 10): named whatever runs beside it. At
    # 0.5 s into a 1 s transfer the bound is its planned second; at 3 s in,
    # past its end, what it has taken so far.
    rows = [(1.0, 1, 1.0, 10, True)]
    early = observed.RunningOrder(rows, now=0.5, tau_max=10).must_follow(2.0, 9)
    assert early == ((1,), pytest.approx(observed.FOLLOW_PATIENCE * 1.0))
    late = observed.RunningOrder(rows, now=3.0, tau_max=10).must_follow(4.0, 9)
    assert late == ((1,), pytest.approx(observed.FOLLOW_PATIENCE * 3.0))
    # A short one: no less than the order guard's minimum.
    short = observed.RunningOrder([(1e-4, 1, 1e-4, 10, True)], now=None, tau_max=10)
    assert short.must_follow(1.0, 9) == (
        (1,), pytest.approx(observed.FOLLOW_PATIENCE * observed.ORDER_GUARD_MIN))
    # At most MAX_FOLLOW are named, the first planned.
    many = [(1.0 + k, k, 1.0, 100, True) for k in range(observed.MAX_FOLLOW + 6)]
    ids, _ = observed.RunningOrder(many, now=None, tau_max=100).must_follow(1e3, 999)
    assert ids == tuple(range(observed.MAX_FOLLOW))


def _land(landing: list[int], names: dict[int, tuple[int, ...]], base: dict[int, int],
          version: int, tau: int) -> set[int]:
    """A server's applies as `landing` orders the arrivals, each held until
    the transfers `names` gives it have landed: the refused."""
    v, landed, waiting, refused = version, set(), [], set()
    for t in landing:
        waiting.append(t)
        while any(set(names.get(w, ())) <= landed for w in waiting):
            w = next(w for w in waiting if set(names.get(w, ())) <= landed)
            waiting.remove(w)
            if v - base[w] > tau:
                refused.add(w)
            else:
                v += 1
            landed.add(w)
    assert not waiting  # every name lands: nothing waits for ever
    return refused


def test_no_transfer_is_refused_for_being_passed_when_its_server_keeps_the_names(
        ) -> None:
    """The invariant `must_follow` gives: transfers let go one after the
    other, each planned to land after those running, each named by the
    newcomers that could take its last version of slack. However they
    land, a server that holds each until the ones its go named have landed
    refuses none that had at least as much slack as passers when let go.
    Without the names, the same landings refuse some."""
    rng = random.Random(34)
    refused_without = 0
    for _ in range(300):
        tau = rng.randint(1, 8)
        order = observed.RunningOrder([], now=None, tau_max=tau)
        version = 100
        base: dict[int, int] = {}
        names: dict[int, tuple[int, ...]] = {}
        protectable: set[int] = set()
        for tid in range(rng.randint(1, 12)):
            stale = rng.randint(0, tau)
            end = float(tid + 1)
            ahead = len(order)
            follow = order.must_follow(end, tid)
            names[tid] = follow[0] if follow else ()
            if tau - stale - ahead >= 0:  # the plan can land it in time
                protectable.add(tid)
            order.add(end, tid, 1.0, stale, True)
            base[tid] = version - stale
        landing = list(base)
        rng.shuffle(landing)
        for held in (True, False):
            refused = _land(landing, names if held else {}, base, version, tau)
            if held:
                assert not refused & protectable, (tau, names, landing, refused)
            else:
                refused_without += len(refused & protectable)
    assert refused_without > 0  # the names are what kept them


def test_a_newcomer_with_room_to_spare_also_waits_for_one_at_risk_planned_after_it():
    """Seen on the emulated cluster: transfer 149 critical (its last version
    of slack), the next one let go planned to land before it (the hold
    budget released it to keep the link busy), landed first, and 149 was
    refused. A newcomer that can wait for every running transfer and still
    be applied names it: with room for one version, it can wait for one."""
    order = observed.RunningOrder([(5.0, 1, 1.0, 10, True)], now=None, tau_max=10)
    assert order.must_follow(2.0, 9) is None  # planned first, its room unknown
    assert order.must_follow(2.0, 9, room=0) is None  # waiting would have it refused
    assert order.must_follow(2.0, 9, room=1) == ((1,), pytest.approx(4.0))
    assert order.must_follow(6.0, 9, room=0) == ((1,), pytest.approx(4.0))  # planned after


def test_with_any_planned_order_none_is_refused_that_every_passer_named():
    """`must_follow`'s invariant when newcomers may be planned to land before
    running transfers: a transfer is safe when the plan can land it in time,
    it cannot be passed by a running transfer it did not name (it names all
    those at risk if it has room for every running one, else all running
    ones are planned before it), and every later newcomer planned before it
    had room to wait for it. However they land, a server that keeps the
    names refuses none of those."""
    rng = random.Random(35)
    checked = refused_without = 0
    for _ in range(400):
        tau = rng.randint(1, 8)
        order = observed.RunningOrder([], now=None, tau_max=tau)
        version = 100
        base: dict[int, int] = {}
        names: dict[int, tuple[int, ...]] = {}
        ends: dict[int, float] = {}
        safe: set[int] = set()
        for tid in range(rng.randint(1, 10)):
            stale = rng.randint(0, tau)
            end = rng.uniform(0.0, 10.0)
            room, running = tau - stale, len(order)
            ahead = sum(1 for e in ends.values() if (e, 0) < (end, tid))
            follow = order.must_follow(end, tid, room)
            names[tid] = follow[0] if follow else ()
            # Later newcomers planned before a safe one, without room to wait: not safe.
            if room < running:
                safe -= {t for t in safe if (end, tid) < (ends[t], t)}
            if room - ahead >= 0 and (room >= running or ahead == running):
                safe.add(tid)
            order.add(end, tid, 1.0, stale, True)
            base[tid], ends[tid] = version - stale, end
        landing = list(base)
        rng.shuffle(landing)
        refused = _land(landing, names, base, version, tau)
        assert not refused & safe, (tau, names, ends, landing, refused, safe)
        checked += len(safe)
        refused_without += len(_land(landing, {}, base, version, tau) & safe)
    assert checked > 300 and refused_without > 0  # the names are what kept them


def _planned_to_end(ends: dict[str, float]) -> Callable[[Snapshot], list[PlanItem]]:
    """A policy that starts every pending transfer now, planned to end at
    its worker's time in `ends`, in the order they were asked for."""
    def policy(snap: Snapshot) -> list[PlanItem]:
        return [PlanItem(t.id, start=snap.now, position=k,
                         planned_seconds=ends[str(t.owner)] - snap.now)
                for k, t in enumerate(snap.pending)]
    return policy


def _two(guard: bool) -> tuple[ControlState, list]:
    """A must land next (base 0, the server at 2, tau_max 2); the plan starts
    B beside it and has it end after A, but B's path could carry it in 0.2 s."""
    def policy(snap: Snapshot) -> list[PlanItem]:
        return [PlanItem(t.id, start=snap.now, position=k,
                         planned_seconds=(1.0, 1.2)[k] - snap.now)
                for k, t in enumerate(snap.pending)]

    state = ControlState(policy, tau_max=2, network=Network(default=10 * MB),
                         guard_order=guard)
    state.shard_at(0, "s", 2)
    ts = [state.request("w1", 1, host="a", dst="s", nbytes=10 * MB, base_version=0,
                        norm=1.0, now=0.0),
          state.request("w2", 1, host="b", dst="s", nbytes=2 * MB, base_version=2,
                        norm=1.0, now=0.0)]
    return state, ts


def test_a_transfer_that_could_overtake_a_critical_one_goes_named_for_the_server():
    """Issue 34: B could land before A, which must land next. It is not held
    (holding idled the link: benchmarks/RESULTS.md, "The release guard no
    longer holds"): it goes at once, and its server applies it only after
    A, waiting for it at most FOLLOW_PATIENCE x A's planned second."""
    state, (a, b) = _two(guard=True)
    assert state.critical(0) == []
    go_a, go_b = state.decide(0.0).actions
    assert (go_a.transfer.id, go_b.transfer.id) == (a.id, b.id)
    assert state.critical(0) == [(1.0, 1.0)]
    assert go_a.after is None and go_a.after_seconds is None  # nothing ran before it
    assert go_b.after == (a.id,)
    assert go_b.after_seconds == pytest.approx(observed.FOLLOW_PATIENCE * 1.0)
    # Without the release order there is nothing to name by.
    state, (a, b) = _two(guard=False)
    assert [x.after for x in state.decide(0.0).actions] == [None, None]


def test_a_transfer_let_go_beside_a_critical_one_is_paced_at_its_reserved_rate():
    """Issue 34: on the emulated cluster a newcomer from a fast uplink took
    more of the server's downlink than planned and halved a critical
    transfer's rate; twice in 15 runs it landed first. Beside a critical
    transfer a go now carries its reserved rate, which the worker's socket
    keeps to; elsewhere none."""
    assert observed.pace(2_000_000, 0.5) == pytest.approx(observed.PACE_HEADROOM * 4e6)
    assert observed.pace(2_000_000, 0.0) is None and observed.pace(0, 1.0) is None
    ends = {"w1": 1.0, "w2": 1.2, "w3": 2.0}  # each worker's planned end
    policy = _planned_to_end(ends)

    for guard in (True, False):
        state = ControlState(policy, tau_max=2, network=Network(default=10 * MB),
                             guard_order=guard)
        state.shard_at(0, "s", 2)
        # A must land next (base 0, the server at 2); B's 2 MB could land first.
        for owner, host, nbytes, base in (("w1", "a", 10 * MB, 0), ("w2", "b", 2 * MB, 2)):
            state.request(owner, 1, host=host, dst="s", nbytes=nbytes, base_version=base,
                          norm=1.0, now=0.0)
        d = state.decide(0.0)
        if not guard:  # without the release order nothing is paced
            assert [x.pace for x in d.actions] == [None, None]
            continue
        go_a, go_b = d.actions
        assert go_a.transfer.owner == "w1" and go_a.pace is None  # nothing critical yet
        # B's 2 MB planned from 0 to 1.2: 1.67 MB/s reserved, 5% more on the
        # wire (A's reserved 10 MB/s leaves no more room), until A's planned
        # end (1.0) and its guard (0.1 s) have passed.
        assert go_b.transfer.owner == "w2" and go_b.planned_seconds == pytest.approx(1.2)
        assert go_b.pace == pytest.approx(1.05 * 2 * MB / 1.2)
        assert go_b.pace_seconds == pytest.approx(1.1)
        # Once A is reported, nothing is critical: the next go is not paced.
        state.done("w1", 1, version=3)
        state.request("w3", 1, host="c", dst="s", nbytes=1 * MB, base_version=3, norm=1.0,
                      now=1.0)
        (go_c,) = state.decide(1.0).actions
        assert go_c.transfer.owner == "w3" and go_c.pace is None and go_c.pace_seconds is None


def test_a_paced_transfer_takes_the_room_the_critical_ones_leave_until_they_land():
    assert observed.room_beside(10 * MB, 2.5 * MB, 10 * MB) == 7.5 * MB
    # Reserved 4 MB/s beside another transfer, with 7.5 MB/s of room: 7.5.
    assert observed.pace(4 * MB, 1.0, room=7.5 * MB) == pytest.approx(1.05 * 7.5 * MB)
    assert observed.pace(4 * MB, 0.5, room=7.5 * MB) == pytest.approx(1.05 * 8 * MB)
    # One critical transfer planned to end at 1.0 after 1 s (guard 0.1).
    order = observed.RunningOrder([(1.0, 7, 1.0, 1, True)], now=0.25, tau_max=1)
    assert order.paced_for() == pytest.approx(0.85)
    # Past its planned end nothing says when it lands: paced to the end.
    assert observed.RunningOrder([(1.0, 7, 1.0, 1, True)], now=1.2, tau_max=1
                                 ).paced_for() is None


def test_only_a_transfer_that_could_crowd_a_critical_one_out_is_paced():
    """Paced only where, flat out, a newcomer would take more than the room
    the critical transfers' reserved rates leave on the downlink."""
    room = observed.room_beside
    assert room(10 * MB, 2.5 * MB, 10 * MB) is not None  # 1 Gbit/s up, 80 Mbit/s down
    assert room(125 * MB, 135 * MB, 1562 * MB) is None  # 1,000 workers
    assert room(6 * MB, 4 * MB, 10 * MB) is None  # exactly the room: no more
    assert room(6 * MB, 0.0, 5 * MB) == 5 * MB  # a halved link: a path faster than it
    ends = {"w1": 1.0, "w2": 1.2}
    policy = _planned_to_end(ends)

    # A (critical, 10 MB/s reserved) and B (a 10 MB/s path) into a downlink
    # of 10 MB/s: paced; of 100 MB/s: B flat out leaves A its room.
    for down, paced in ((10 * MB, True), (100 * MB, False)):
        state = ControlState(policy, tau_max=2, guard_order=True,
                             network=Network(default=10 * MB, down={"s": down}))
        state.shard_at(0, "s", 2)
        for owner, host, nbytes, base in (("w1", "a", 10 * MB, 0), ("w2", "b", 2 * MB, 2)):
            state.request(owner, 1, host=host, dst="s", nbytes=nbytes, base_version=base,
                          norm=1.0, now=0.0)
        _, go_b = state.decide(0.0).actions
        assert go_b.transfer.owner == "w2" and (go_b.pace is not None) == paced


def test_a_transfer_past_its_planned_end_may_be_overtaken_by_every_running_one():
    """A (base 0) is planned to land first, C (base 1) after it; the server
    is at 1 and tau_max is 2, so in planned order A has one update of slack.
    Past its planned end A has no planned place: if C landed first, A would
    have none, so it is critical: what goes to its server next names it."""
    ends = {"w1": 0.5, "w3": 1.0, "w2": 1.2}
    policy = _planned_to_end(ends)

    state = ControlState(policy, tau_max=2, network=Network(default=10 * MB),
                         guard_order=True)
    state.shard_at(0, "s", 1)
    a, _ = [state.request(owner, 1, host=host, dst="s", nbytes=1 * MB, base_version=base,
                          norm=1.0, now=0.0) for owner, host, base in (("w1", "a", 0),
                                                                       ("w3", "c", 1))]
    assert len(state.decide(0.0).actions) == 2
    assert state.critical(0, 0.5) == []  # within its guard (5 ms past its end)
    assert state.critical(0, 0.6) == [(0.5, 0.5)]
    state.request("w2", 1, host="b", dst="s", nbytes=1 * MB, base_version=1, norm=1.0,
                  now=0.6)
    (go,) = state.decide(0.6).actions
    assert go.transfer.owner == "w2" and a.id in (go.after or ())


def test_beside_a_critical_transfer_past_its_planned_end_one_goes_paced_to_its_end():
    """Nothing says when a critical transfer past its planned end lands: a
    newcomer goes all the same, paced until its own end and applied only
    after it, the wait bounded by its time so far."""
    ends = {"w1": 1.0, "w2": 2.0}
    policy = _planned_to_end(ends)

    state = ControlState(policy, tau_max=2, network=Network(default=10 * MB),
                         guard_order=True)
    state.shard_at(0, "s", 2)  # A (base 0) must land next
    a = state.request("w1", 1, host="a", dst="s", nbytes=10 * MB, base_version=0, norm=1.0,
                      now=0.0)
    (go_a,) = state.decide(0.0).actions
    assert go_a.transfer.id == a.id
    b = state.request("w2", 1, host="b", dst="s", nbytes=2 * MB, base_version=2, norm=1.0,
                      now=1.2)
    (go_b,) = state.decide(1.2).actions  # A planned to end at 1.0, not reported
    assert go_b.transfer.id == b.id and go_b.after == (a.id,)
    assert go_b.pace is not None and go_b.pace_seconds is None
    assert go_b.after_seconds == pytest.approx(observed.FOLLOW_PATIENCE * 1.2)


def test_nothing_is_held_for_a_critical_transfer_on_a_wide_link():
    """Issue 34: at 10,000 simulated workers the release guard held every
    release into the server for one critical transfer after another, and
    the link, 125 lanes wide, drained. W0 must land next (its staleness is
    tau_max); the nine others go with it, each naming it for the server."""
    def policy(snap: Snapshot) -> list[PlanItem]:
        return [PlanItem(t.id, start=snap.now, position=k,
                         planned_seconds=0.5 if t.owner == "w0" else 1.0)
                for k, t in enumerate(snap.pending)]

    state = ControlState(policy, tau_max=20, network=Network(default=10 * MB),
                         guard_order=True)
    state.shard_at(0, "s", 20)
    ts = [state.request(f"w{k}", 1, host=f"h{k}", dst="s", nbytes=1 * MB,
                        base_version=0 if k == 0 else 20, norm=1.0, now=0.0)
          for k in range(10)]
    d = state.decide(0.0)
    assert [x.transfer.owner for x in d.actions] == [f"w{k}" for k in range(10)]
    assert state.critical(0) == [(0.5, 0.5)]
    assert all(isinstance(x, Go) and x.after == (ts[0].id,) for x in d.actions[1:])


def _one(state: ControlState, req: int, now: float) -> Go:
    state.request("w", req, host="a", dst="s", nbytes=10 * MB, base_version=0, norm=1.0,
                  now=now)
    (go,) = state.decide(now).actions
    assert isinstance(go, Go)
    return go


def test_the_next_plan_uses_the_rate_the_last_transfer_showed_and_recovers():
    state = ControlState(mlfabric_policy, tau_max=None, learn_rates=True,
                         network=Network(default=125 * MB, down={"s": 10 * MB}))  # 80 Mbit/s
    assert _one(state, 1, 0.0).planned_seconds == pytest.approx(1.0)
    state.done("w", 1, version=1, seconds=2.0)  # the downlink dropped to 40 Mbit/s
    assert state.network.down_rate("s") == pytest.approx(5 * MB)
    assert _one(state, 2, 2.0).planned_seconds == pytest.approx(2.0)
    state.done("w", 2, version=2, seconds=1.0)  # and came back
    assert state.network.observed_down == {}
    assert _one(state, 3, 3.0).planned_seconds == pytest.approx(1.0)


def test_a_landing_the_server_reports_ends_the_transfer_and_its_workers_report_times_it():
    """The server's own report (`ControlState.landed`, by the transfer's id)
    frees the transfer and gives the server's version a message before the
    worker's could; the worker's report that follows is counted once, and
    its time still teaches the closed loop (the server's report has none)."""
    state = ControlState(mlfabric_policy, tau_max=None, learn_rates=True,
                         network=Network(default=125 * MB, down={"s": 10 * MB}))
    go = _one(state, 1, 0.0)
    t = go.transfer
    assert state.landed(t.id, shard=1, version=1, applied=True, delay=0, now=2.0) is None
    assert state.landed(t.id + 1, shard=0, version=1, applied=True, delay=0, now=2.0) is None
    # The same id from another controller's ticket (another push: another base).
    assert state.landed(t.id, shard=0, version=1, applied=True, delay=0, now=2.0,
                        base_version=1) is None
    assert state.active  # another shard's, another push's or an unknown ticket: nothing
    assert state.landed(t.id, shard=0, version=7, applied=True, delay=0, now=2.0,
                        base_version=0) is t
    assert not state.active and state.version == 7 and t.landed_at == 2.0
    assert state.servers["s"].applied == 1 and state.workers["w"].applied == 1
    assert state.network.observed_down == {}  # nothing learnt yet: no time
    # Twice (from a second controller link, say): ignored.
    assert state.landed(t.id, shard=0, version=7, applied=True, delay=0, now=2.0) is None
    # The worker's report: the same transfer, counted once, and its 2 s for
    # a transfer planned at 1 s halve the downlink.
    assert state.done("w", 1, version=7, applied=True, delay=0, now=2.1, seconds=2.0) is t
    assert state.servers["s"].applied == 1 and state.workers["w"].applied == 1
    assert state.delays.summary()["count"] == 1
    assert state.network.down_rate("s") == pytest.approx(5 * MB)
    assert state.done("w", 1, version=7, seconds=2.0) is None  # and once only


def test_a_landing_reported_after_the_workers_report_or_for_a_routed_transfer_is_ignored():
    state = ControlState(mlfabric_policy, tau_max=None, learn_rates=True,
                         network=Network(default=125 * MB, down={"s": 10 * MB}))
    t = _one(state, 1, 0.0).transfer
    assert state.done("w", 1, version=1, applied=True, delay=0, now=1.0, seconds=1.0) is t
    assert state.landed(t.id, shard=0, version=1, applied=True, delay=0, now=1.1) is None
    assert state.servers["s"].applied == 1
    # A worker gone before its report: what the server's report kept of it goes too.
    t2 = _one(state, 2, 2.0).transfer
    assert state.landed(t2.id, shard=0, version=2, applied=False, delay=3, now=3.0) is t2
    assert state.servers["s"].refused == 1
    state.forget("w")
    assert state.done("w", 2, version=2, applied=False, seconds=1.0) is None


def test_a_transfer_past_its_planned_end_replans_what_follows_at_its_rate_so_far():
    state = ControlState(mlfabric_policy, tau_max=None, learn_rates=True,
                         network=Network(default=125 * MB, down={"s": 10 * MB}))
    _one(state, 1, 0.0)  # planned 1 s
    state.request("w2", 1, host="b", dst="s", nbytes=10 * MB, base_version=0, norm=1.0,
                  now=0.5)
    d = state.decide(0.5)
    assert d.actions == () and d.wake_at == pytest.approx(1.0)  # it starts after the first
    assert state.decide(1.0).wake_at == pytest.approx(1.1)  # its guard: look again then
    d = state.decide(2.0)  # 2 s in, not done: the link gives at most 5 MB/s
    assert state.network.down_rate("s") == pytest.approx(5 * MB)
    assert d.actions == ()


def _measured_handover(state: ControlState, hops: float) -> None:
    """One short transfer into s reported `hops` s after its go plus the
    worker's own time: the go's way there and the report's way back."""
    go = _one(state, 99, 0.0)
    state.done("w", 99, version=1, now=go.planned_seconds + hops,
               seconds=go.planned_seconds)


def test_a_short_transfer_alone_lets_its_successor_go_at_its_planned_end():
    """Issue 34, the hand-over: at 300 simulated workers over 16 shards,
    each 4.5 ms transfer waited 3.1 ms for its predecessor's outcome,
    report and go, and a shard's link idled 40% of the time. A transfer
    alone into its server and planned within PIPELINE_HANDOVERS measured
    hand-overs is trusted to end as planned: its successor goes then, its
    go on the way while the last bytes are. A third waits for a report
    (one late overlaps one successor at most)."""
    state = ControlState(mlfabric_policy, tau_max=None, learn_rates=True,
                         network=Network(default=125 * MB, down={"s": 10 * MB}))
    assert state.handover == 0.0
    _measured_handover(state, hops=0.002)
    assert state.handover == pytest.approx(0.003)  # 1.5 x the two measured hops
    t0 = 1.0
    for owner, host in (("w1", "a"), ("w2", "b"), ("w3", "c")):
        state.request(owner, 1, host=host, dst="s", nbytes=0.02 * MB, base_version=1,
                      norm=1.0, now=t0)
    (first,) = state.decide(t0).actions  # 2 ms at 10 MB/s, one at a time
    assert first.planned_seconds == pytest.approx(0.002)
    end = t0 + first.planned_seconds
    (second,) = state.decide(end).actions  # at its planned end, no report yet
    assert isinstance(second, Go) and second.transfer.owner != first.transfer.owner
    # two let go into s: neither trusted, the third waits past both ends
    d = state.decide(end + second.planned_seconds)
    assert d.actions == ()
    state.done(first.transfer.owner, 1, version=2, now=end + 0.003, seconds=0.003)
    (third,) = state.decide(end + 0.004).actions  # the second alone again: trusted
    assert isinstance(third, Go)


def test_a_long_transfer_waits_for_its_report_as_before():
    """Planned beyond PIPELINE_HANDOVERS hand-overs, a transfer is not
    trusted: waiting for its report costs little beside it, and a late one
    re-plans what follows (the closed loop) instead of sharing its link."""
    state = ControlState(mlfabric_policy, tau_max=None, learn_rates=True,
                         network=Network(default=125 * MB, down={"s": 10 * MB}))
    _measured_handover(state, hops=0.002)  # trusted up to 30 ms
    for owner, host in (("w1", "a"), ("w2", "b")):
        state.request(owner, 1, host=host, dst="s", nbytes=0.4 * MB, base_version=1,
                      norm=1.0, now=1.0)
    (first,) = state.decide(1.0).actions  # 40 ms
    d = state.decide(1.0 + first.planned_seconds)
    assert d.actions == () and d.wake_at is not None  # its guard, then its report


def test_trusted_needs_a_measured_handover_and_a_transfer_alone_direct_and_whole():
    from mlfabric.scheduling.columns import ActiveTransfers
    from mlfabric.scheduling.plan import Route, Transfer
    from mlfabric.scheduling.policies import PIPELINE_HANDOVERS, trusted

    def t(tid: int, dst: str = "s", planned: float = 0.01, **kw: object) -> Transfer:
        return Transfer(id=tid, owner=tid, req=1, host=f"h{tid}", dst=dst, nbytes=1000,
                        base_version=0, norm=1.0, arrival=0.0, started=0.0,
                        planned_seconds=planned, **kw)  # type: ignore[arg-type]

    def trusted_ids(transfers: list[Transfer], handover: float) -> set[int]:
        active = ActiveTransfers.of(transfers)
        return set(active.ids[active.by_id()][trusted(active, handover)].tolist())

    limit = PIPELINE_HANDOVERS * 0.003
    assert trusted_ids([t(1)], 0.0) == set()  # no hand-over measured yet
    assert trusted_ids([t(3, dst="q", planned=limit * 1.01), t(1), t(2, dst="r", planned=limit)],
                       0.003) == {1, 2}
    assert trusted_ids([t(1), t(2)], 0.003) == set()  # two into s
    assert trusted_ids([t(1, chunk=500)], 0.003) == set()
    assert trusted_ids([t(1, route=Route(host="agg", address="agg:7070", group=1, fan_in=2,
                                         index=0))], 0.003) == set()


def test_fifo_runs_without_the_closed_loop():
    from mlfabric.scheduling.plan import fifo_policy
    state = ControlState(fifo_policy, tau_max=None, network=Network(default=10 * MB))
    _one(state, 1, 0.0)
    state.done("w", 1, version=1, seconds=5.0)
    assert state.network.observed_down == {}


def test_only_a_transfer_alone_on_its_links_teaches_the_loop():
    """Two transfers into s at once share its downlink: each gets what TCP
    gives it beside the other, not the plan's share, and neither a late
    report nor an overdue one moves the picture (a shared downlink is
    capped only by DOWNLINK_WINDOW slowed transfers from as many workers). Learnt from such
    transfers, the loop capped workers' uplinks for their share of the
    downlink (at 1,000 simulated workers: 18% of pushes dropped). Once the
    downlink is free again, a transfer alone on it teaches as before."""
    state = ControlState(mlfabric_policy, tau_max=None, learn_rates=True,
                         network=Network(default=125 * MB, down={"s": 200 * MB}))
    for owner, host in (("w1", "a"), ("w2", "b")):
        state.request(owner, 1, host=host, dst="s", nbytes=10 * MB, base_version=0,
                      norm=1.0, now=0.0)
    gone = state.decide(0.0).actions
    assert len(gone) == 2  # both at once: 125 + 75 of the downlink's 200 MB/s
    state.decide(5.0)  # both far past their planned ends: shared, nothing learnt
    assert state.network.observed_down == {} and state.network.observed_up == {}
    state.done("w1", 1, version=1, seconds=5.0)
    state.done("w2", 1, version=2, seconds=5.0)
    assert state.network.observed_down == {} and state.network.observed_up == {}
    go = _one(state, 3, 6.0)  # host a, alone now: its time says what a's path gives
    state.done("w", 3, version=3, seconds=go.planned_seconds * 4)
    assert state.network.rate("a", "s") == pytest.approx(125 * MB / 4)


def test_a_shared_downlink_is_capped_only_by_slowed_transfers_from_several_workers():
    """Into a downlink eight uplinks wide, booked full: one slowed transfer
    may be its worker's slow uplink, so the cap waits for DOWNLINK_WINDOW
    of them in a row from as many workers, and takes the most any shows."""
    assert observed.DOWNLINK_WINDOW == 3
    net = Network(default=125 * MB, down={"s": 1000 * MB})
    shared = observed.SharedDownlink()

    def done(n: Network, src: str, seconds: float, booked: float = 1000 * MB) -> Network:
        return shared.completed(n, src, "s", booked=booked, planned_seconds=1.0,
                                seconds=seconds)

    n = done(done(net, "a", 2.0), "a", 2.0)
    assert done(n, "b", 2.5) is net  # a, a, b: two workers
    n = done(net, "c", 2.0)  # a, b, c: each at half its speed or less
    assert n.observed_down == {"s": pytest.approx(500 * MB)} and n.observed_up == {}
    assert n.rate("z", "s") == 125 * MB  # (each worker's uplink is still narrower)
    # Evidence starts over after a cap, and an on-time transfer clears it:
    shared = observed.SharedDownlink()
    n = done(done(net, "a", 2.0), "b", 2.0)
    n = done(n, "c", 1.05)  # within SHARED_SLOWED: a full link's ramp and queue
    assert done(done(n, "d", 2.0), "e", 2.0).observed_down == {}
    # Booked under (1 - ORDER_GUARD) of the link, a slow transfer was held
    # back elsewhere: no evidence at all.
    shared = observed.SharedDownlink()
    for src in "abcde":
        assert done(net, src, 4.0, booked=800 * MB) is net


def test_a_wide_downlinks_cap_waits_for_a_round_of_it_and_takes_its_fastest():
    """Into a downlink booked for ten transfers at once, the cap waits for
    the last ten slowed transfers, not three: on a saturated link those
    that join ramp up behind its queue, and at 10,000 simulated workers
    three in a row were often all such (the cap fell to 0.16 of what the
    link gave). It takes the fastest of the round, one that had its share;
    an on-time transfer still starts the round over. Booked for three or
    fewer, the rule is DOWNLINK_WINDOW's, as before."""
    net = Network(default=125 * MB, down={"s": 1000 * MB})
    shared = observed.SharedDownlink()

    def done(n: Network, src: str, seconds: float, lanes: int = 10) -> Network:
        return shared.completed(n, src, "s", booked=1000 * MB, planned_seconds=1.0,
                                seconds=seconds, lanes=lanes)

    n = net
    for k in range(9):  # ramped behind the queue: a tenth of their speed, but one
        n = done(n, f"w{k}", 2.0 if k == 4 else 10.0)
        assert n is net
    n = done(n, "w9", 10.0)
    assert n.observed_down == {"s": pytest.approx(500 * MB)}  # the fastest of ten
    # An on-time one starts the round over; a narrower round caps sooner.
    shared = observed.SharedDownlink()
    n = done(done(net, "a", 10.0), "b", 1.0)
    for k in range(9):
        assert done(n, f"c{k}", 4.0) is net
    assert done(n, "d", 4.0).observed_down == {"s": pytest.approx(250 * MB)}
    shared = observed.SharedDownlink()
    assert done(done(net, "a", 4.0, lanes=2), "b", 4.0, lanes=2) is net
    assert done(net, "c", 4.0, lanes=2).observed_down == {"s": pytest.approx(250 * MB)}
    # The round is bounded (what is kept per server): a downlink a thousand
    # transfers wide waits for MAX_DOWNLINK_WINDOW of them.
    shared = observed.SharedDownlink()
    for k in range(observed.MAX_DOWNLINK_WINDOW - 1):
        assert done(net, f"e{k}", 4.0, lanes=1000) is net
    assert done(net, "f", 4.0, lanes=1000).observed_down == {"s": pytest.approx(250 * MB)}


def test_a_shared_downlinks_cap_rises_by_transfers_on_time_at_the_cap():
    """A capped link booked to its cap shows more only in transfers' speed:
    each on time (within its order_guard) or faster lets the cap rise by
    ORDER_GUARD, until it reaches the configured rate and goes. Transfers
    let go before the cap (booked above it) say nothing of it. Faster
    counts: at 1,000 simulated workers over 4 shards, a shard's cap learnt
    while its link was halved stayed at half the restored link for ten
    simulated seconds, its parts planned at a share of the cap running
    faster than planned and none on time (benchmarks/RESULTS.md, "A cap
    that rises when transfers beat it")."""
    net = Network(default=125 * MB, down={"s": 1000 * MB}, observed_down={"s": 500 * MB})
    shared = observed.SharedDownlink()

    def done(n: Network, seconds: float, booked: float) -> Network:
        return shared.completed(n, "a", "s", booked=booked, planned_seconds=1.0,
                                seconds=seconds)

    assert done(net, 1.0, 1000 * MB) is net
    assert done(net, 0.5, 500 * MB).observed_down == {"s": pytest.approx(550 * MB)}
    assert done(net, 1.2, 500 * MB) is net  # late, but not by a shared link's margin
    n = done(net, 1.05, 480 * MB)
    assert n.observed_down == {"s": pytest.approx(550 * MB)}
    steps = 1
    while n.observed_down:
        n = done(n, 1.0, n.observed_down["s"])
        steps += 1
    assert steps == 8 and n.down_rate("s") == 1000 * MB  # 500 x 1.1^8 > 1000


def test_a_short_transfer_is_on_time_within_the_release_orders_guard():
    """On time is within `order_guard`: ORDER_GUARD of the planned time,
    and ORDER_GUARD_MIN at least. A 4 ms part that took 5.2 ms (the
    answer's way back and TCP's ramp, which its plan does not hold) raises
    its capped link; one 1.1 ms later than the guard allows does not, nor
    does a long transfer 15% late."""
    net = Network(default=125 * MB, down={"s": 1000 * MB}, observed_down={"s": 500 * MB})
    shared = observed.SharedDownlink()

    def done(planned: float, seconds: float) -> Network:
        return shared.completed(net, "a", "s", booked=500 * MB, planned_seconds=planned,
                                seconds=seconds)

    assert observed.order_guard(0.004) == observed.ORDER_GUARD_MIN == 0.005
    assert done(0.004, 0.0052).observed_down == {"s": pytest.approx(550 * MB)}
    assert done(0.004, 0.0101) is net
    assert done(1.0, 1.15) is net


def test_a_transfer_on_time_under_the_cap_raises_it_even_booked_past_it():
    """At 1,000 simulated workers (seed 16) the cap fell to two uplinks'
    worth and stayed there for 30 simulated seconds after the link came
    back: each transfer was let go beside ones past their planned ends,
    which the plan no longer counts, so each was booked past the cap and
    none could raise it (a push took 6.5 s against 0.6). One let go under
    the cap that ran on time raises it; one let go before it (booked
    beside what the old rate allowed) still says nothing."""
    net = Network(default=125 * MB, down={"s": 1000 * MB}, observed_down={"s": 200 * MB})
    shared = observed.SharedDownlink()

    def done(capped: float | None, seconds: float = 1.0) -> Network:
        return shared.completed(net, "a", "s", booked=340 * MB, planned_seconds=1.0,
                                seconds=seconds, capped=capped)

    assert done(200 * MB).observed_down == {"s": pytest.approx(220 * MB)}
    assert done(None) is net and done(400 * MB) is net  # let go before this cap
    assert done(200 * MB, seconds=1.2) is net  # late: no news either way


def test_transfers_that_shared_a_halved_downlink_cap_it_for_the_next_plans():
    """The controller's side: eight workers' transfers into s go at once,
    booking its 1000 MB/s; all eight, a round of the link, report twice
    their planned time (the link was halved, unannounced); the next plan is
    made at the 500 MB/s they delivered, four at once. (At 1,000 simulated workers over five seeds:
    refused as stale 6.0 per run before, 0 after; benchmarks/RESULTS.md.)"""
    state = ControlState(mlfabric_policy, tau_max=None, learn_rates=True,
                         network=Network(default=125 * MB, down={"s": 1000 * MB}))
    for k in range(8):
        state.request(f"w{k}", 1, host=f"h{k}", dst="s", nbytes=125 * MB, base_version=0,
                      norm=1.0, now=0.0)
    gone = state.decide(0.0).actions
    assert len(gone) == 8 and all(a.planned_seconds == pytest.approx(1.0) for a in gone)
    for k in range(7):  # booked eight wide: the cap waits for a round of eight
        state.done(f"w{k}", 1, version=k + 1, seconds=2.0, now=2.0)
        assert state.network.observed_down == {}
    state.done("w7", 1, version=8, seconds=2.0, now=2.0)
    assert state.network.observed_down == {"s": pytest.approx(500 * MB)}
    assert state.network.observed_up == {}
    for k in range(8):
        state.request(f"w{k}", 2, host=f"h{k}", dst="s", nbytes=125 * MB, base_version=8,
                      norm=1.0, now=2.0)
    assert len(state.decide(2.0).actions) == 4


def test_the_loops_corrections_are_listed_link_by_link():
    net = Network(default=125 * MB, observed_down={"s": 5 * MB, "t": 7 * MB})
    after = Network(default=125 * MB, observed_up={"a": 1 * MB},
                    observed_down={"s": 6 * MB, "t": 7 * MB})
    assert observed.corrections(net, after) == [("up", "a", None, 1 * MB),
                                                ("down", "s", 5 * MB, 6 * MB)]
    assert observed.corrections(after, Network(default=125 * MB)) == [
        ("up", "a", 1 * MB, None), ("down", "s", 6 * MB, None), ("down", "t", 7 * MB, None)]
    assert observed.corrections(net, net) == []


def test_a_slow_uplink_is_told_from_a_slow_downlink_by_the_other_workers_transfers():
    """Alone on its links, a transfer runs at the slower of its uplink and
    the server's downlink, and its own time cannot say which. Recorded in
    the simulator: workers with 20-50 Mbit/s uplinks the configuration did
    not know had the downlink taken for 20 Mbit/s, the next fast worker was
    planned at that, and transfers went one at a time (mlfabric applied
    0.79x FIFO's updates per second). The downlink gives at least the
    fastest of the last transfers into it; one well below that was held
    back by its uplink."""
    state = ControlState(mlfabric_policy, tau_max=None, learn_rates=True,
                         network=Network(default=125 * MB, down={"s": 10 * MB}))
    fast = _one(state, 1, 0.0)  # from host a, at the configured 10 MB/s
    state.done("w", 1, version=1, seconds=fast.planned_seconds)
    state.request("v", 1, host="b", dst="s", nbytes=10 * MB, base_version=0, norm=1.0,
                  now=1.0)
    (slow,) = state.decide(1.0).actions
    state.done("v", 1, version=2, seconds=4 * slow.planned_seconds)  # b's uplink: 2.5 MB/s
    assert state.network.down_rate("s") == pytest.approx(10 * MB)  # a showed it gives 10
    assert state.network.up_rate("b") == pytest.approx(2.5 * MB)
    assert state.network.up_rate("a") == pytest.approx(125 * MB)
    # b's next transfer is planned at its uplink's rate; it ran at it: nothing moves
    state.request("v", 2, host="b", dst="s", nbytes=10 * MB, base_version=0, norm=1.0,
                  now=6.0)
    (again,) = state.decide(6.0).actions
    assert again.planned_seconds == pytest.approx(4.0)
    state.done("v", 2, version=3, seconds=4.0)
    assert state.network.up_rate("b") == pytest.approx(2.5 * MB)
    # the downlink halves: a's transfers run at 5 MB/s. The last 3 into the
    # downlink (b's two at 2.5, a's at 5) showed at most 5: it gives 5, and
    # a's uplink is not blamed; so it stays while a's transfers show 5
    rates = []
    for req in (2, 3, 4):
        _one(state, req, 10.0 + 3 * req)
        state.done("w", req, version=3 + req, seconds=2.0)  # 10 MB at 5 MB/s
        rates.append((state.network.down_rate("s"), state.network.up_rate("a")))
    assert rates[0] == (pytest.approx(5 * MB), pytest.approx(125 * MB))
    assert rates[-1] == (pytest.approx(5 * MB), pytest.approx(125 * MB))


def test_a_transfer_held_to_its_uplink_does_not_set_a_wider_downlinks_rate():
    """A downlink several uplinks wide: a transfer alone runs at its uplink's
    rate, which says nothing of the downlink but that it gives at least that.
    Taken for the downlink's rate, it capped the downlink at one uplink's
    rate, and at 1,000 simulated workers over 4 shards the transfers went one
    at a time into each shard (a push took 11 s against FIFO's 0.6)."""
    state = ControlState(mlfabric_policy, tau_max=None, learn_rates=True,
                         network=Network(default=10 * MB, down={"s": 40 * MB}))
    go = _one(state, 1, 0.0)
    assert go.planned_seconds == pytest.approx(1.0)  # at a's uplink, 10 MB/s
    state.done("w", 1, version=1, seconds=1.25)  # a's uplink gives 8
    assert state.network.down_rate("s") == pytest.approx(40 * MB)
    assert state.network.up_rate("a") == pytest.approx(8 * MB)
    # and once it shows 10 again, the cap goes
    _one(state, 2, 2.0)
    state.done("w", 2, version=2, seconds=1.0)
    assert state.network.observed_up == {} and state.network.observed_down == {}
    # A downlink capped below what a transfer showed is lifted to it.
    capped = observed.Delivered().completed(
        Network(default=10 * MB, down={"s": 40 * MB}, observed_down={"s": 5 * MB}),
        "a", "s", believed=5 * MB, planned_seconds=2.0, seconds=1.0)
    assert capped.down_rate("s") == pytest.approx(10 * MB)


def _critical_by_sorting(rows: list[tuple[float, int, float, int, bool]], now: float | None,
                         tau_max: int) -> list[tuple[float, float]]:
    """The definition, by sorting every running transfer (the controller's
    rule before RunningOrder kept the order between transfers let go)."""
    running = sorted(rows)
    others = len(running) - 1
    return [(end, planned) for ahead, (end, _, planned, stale, direct) in enumerate(running)
            if direct and stale + (others if now is not None and now >= end + observed.order_guard(
                planned) else ahead) >= tau_max]


@pytest.mark.parametrize("seed", range(20))
def test_the_running_order_kept_between_transfers_let_go_equals_sorting_them_again(seed):
    rng = random.Random(seed)
    now = 10.0
    tau = rng.choice([2, 5, 20])

    def row(tid: int, end: float) -> tuple[float, int, float, int, bool]:
        return (end, tid, rng.choice([0.001, 0.02, 0.5]), rng.randrange(tau + 2),
                rng.random() < 0.9)

    # Running: some past their planned end (and guard), ties in end included.
    rows = [row(tid, rng.choice([9.0, 9.99, 10.2, 10.2, 11.0]) + rng.random() * 0.5 * (tid % 2))
            for tid in rng.sample(range(1000), rng.randrange(0, 30))]
    order = observed.RunningOrder(rows, now=now, tau_max=tau)
    assert order.critical() == _critical_by_sorting(rows, now, tau)
    for tid in range(1000, 1000 + rng.randrange(1, 40)):  # let go one by one
        new = row(tid, now + rng.choice([0.001, 0.02, 0.3, 1.2]))
        rows.append(new)
        order.add(*new)
        assert len(order) == len(rows)
        critical = _critical_by_sorting(rows, now, tau)
        assert order.critical() == critical
    assert observed.RunningOrder(rows, now=None, tau_max=tau).critical() == \
        _critical_by_sorting(rows, None, tau)


def _must_follow_by_sorting(rows: list[tuple[float, int, float, int, bool]], now: float | None,
                            tau_max: int, end: float, tid: int, room: int | None
                            ) -> tuple[tuple[int, ...], float] | None:
    """`RunningOrder.must_follow` by its definition: every running direct
    transfer at risk (tau_max less its staleness below the number running),
    sorted by planned end, those before the newcomer (all of them with room
    for every running one), the first MAX_FOLLOW."""
    running = len(rows)
    every = room is not None and room >= running
    ahead = sorted((e, r, planned) for e, r, planned, stale, direct in rows
                   if direct and tau_max - stale < running
                   and (every or (e, r) < (end, tid)))[:observed.MAX_FOLLOW]
    if not ahead:
        return None
    longest = max(max(planned, 0.0 if now is None else now - (e - planned))
                  for e, _, planned in ahead)
    return (tuple(r for _, r, _ in ahead),
            observed.FOLLOW_PATIENCE * max(longest, observed.ORDER_GUARD_MIN))


def test_what_a_newcomer_must_follow_kept_as_transfers_join_equals_the_definition():
    """The transfers at risk, kept sorted between the transfers let go
    (asked after each, or only now and then), name what the definition
    does, past MAX_FOLLOW of them too; and the critical ones found since a
    count are those the order has, in the order found."""
    most, nothing = zip(*(_follow_as_joined_against_sorting(seed) for seed in range(30)),
                        strict=True)
    assert max(most) == observed.MAX_FOLLOW  # the cut is reached
    assert sum(nothing) > 0  # and some newcomer need follow none


def _follow_as_joined_against_sorting(seed: int) -> tuple[int, int]:
    """One random order, asked as transfers join: the most it named, and
    how many times it named none."""
    import numpy as np
    rng = random.Random(seed)
    tau = rng.choice([3, 10, 60])
    now = rng.choice([None, 10.0])

    def row(tid: int, end: float) -> tuple[float, int, float, int, bool]:
        return (end, tid, rng.choice([0.01, 0.5]), rng.randrange(tau + 2), rng.random() < 0.9)

    rows = [row(tid, rng.choice([9.0, 10.5, 10.5, 11.0])) for tid in
            rng.sample(range(1000), rng.randrange(0, 90))]
    columns = [np.array(c) for c in zip(*rows, strict=True)] if rows else \
        [np.empty(0), np.empty(0, np.int64), np.empty(0), np.empty(0, np.int64), np.empty(0, bool)]
    order = observed.RunningOrder.of_columns(*columns, now=now, tau_max=tau) \
        if rng.random() < 0.5 else observed.RunningOrder(rows, now=now, tau_max=tau)
    named = nothing = 0
    seen: list[int] = []
    for tid in range(1000, 1000 + rng.randrange(1, 60)):
        if rng.random() < 0.6:
            end, room = 10.0 + rng.choice([0.0, 0.5, 0.7, 2.0]), rng.choice([None, 0, 5, 200])
            follow = order.must_follow(end, 5000 + tid, room)
            assert follow == _must_follow_by_sorting(rows, now, tau, end, 5000 + tid, room)
            named = max(named, 0 if follow is None else len(follow[0]))
            nothing += follow is None
        seen += order.critical_since(len(seen))
        assert sorted(seen) == sorted(order.critical_ids) and len(seen) == len(set(seen))
        new = row(tid, 10.0 + rng.choice([0.02, 0.5, 1.2]))
        rows.append(new)
        order.add(*new)
    return named, nothing


def _random_rows(rng: random.Random, tau: int) -> list[tuple[float, int, float, int, bool]]:
    """Running transfers: planned ends with ties, staleness up to past tau."""
    ids = rng.sample(range(1, 1000), rng.randint(0, 14))
    return [(float(rng.randint(0, 8)) / 4, tid, rng.choice([0.1, 0.5, 2.0]),
             rng.randint(-1, tau + 1), rng.random() < 0.85) for tid in ids]


def _seen(order: observed.RunningOrder, probes: list[tuple[float, int, int]]) -> tuple:
    """What the controller reads of an order."""
    now = order.now
    return (len(order), order.has_critical, order.critical_ids, order.critical(),
            None if now is None else order.paced_for(),
            [order.must_follow(end, tid, room) for end, tid, room in probes])


@pytest.mark.parametrize("seed", range(40))
def test_an_order_built_from_columns_is_the_order_built_row_by_row(seed):
    """`RunningOrder.of_columns` (what the controller builds at each
    decision) reads the same as the order built from the same rows one by
    one, before and after transfers join it."""
    import numpy as np
    rng = random.Random(seed)
    for _ in range(25):
        tau = rng.randint(1, 12)
        now = rng.choice([None, 0.0, 0.5, 1.5, 4.0])
        rows = _random_rows(rng, tau)
        columns = [np.array(c) for c in zip(*rows, strict=True)] if rows else \
            [np.empty(0), np.empty(0, np.int64), np.empty(0), np.empty(0, np.int64),
             np.empty(0, bool)]
        a = observed.RunningOrder(rows, now=now, tau_max=tau)
        b = observed.RunningOrder.of_columns(*columns, now=now, tau_max=tau)
        probes = [(rng.uniform(0, 3), 2000 + k, rng.choice([None, 0, 3, 20]))
                  for k in range(4)]
        assert _seen(b, probes) == _seen(a, probes)
        for k in range(rng.randint(0, 4)):
            joiner = (rng.uniform(0, 3), 3000 + k, 0.5, rng.randint(0, tau), True)
            a.add(*joiner)
            b.add(*joiner)
        assert _seen(b, probes) == _seen(a, probes)


def test_an_order_that_does_not_matter_guards_nothing_whatever_joins():
    """`order_matters` false: no running transfer is critical, and however
    many of the joining ones are let go, in any planned order, none is
    made critical and no go names any (so the controller need not build
    the order). Both answers occur here."""
    import numpy as np
    rng = random.Random(9)
    skipped = kept = 0
    for _ in range(2000):
        tau = rng.randint(1, 40)
        now = rng.choice([None, 0.0, 1.0, 5.0])
        rows = _random_rows(rng, tau)
        stale = np.array([r[3] for r in rows], np.int64)
        joining = [rng.randint(0, tau) for _ in range(rng.randint(0, 5))]
        if observed.order_matters(stale, joining, tau):
            kept += 1
            continue
        skipped += 1
        order = observed.RunningOrder(rows, now=now, tau_max=tau)
        assert not order.has_critical
        for k, s in enumerate(joining):
            end = rng.uniform(0, 3)
            assert order.must_follow(end, 5000 + k, tau - s) is None
            order.add(end, 5000 + k, 0.5, s, True)
            assert not order.has_critical
    assert skipped > 100 and kept > 100
