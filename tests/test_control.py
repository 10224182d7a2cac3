"""The controller's bookkeeping and decisions, pure: a fake clock is a number."""

from __future__ import annotations

import pytest

from mlfabric.controller.state import ControlState, Drop, Go
from mlfabric.scheduling.columns import ActiveTransfers
from mlfabric.scheduling.plan import ColumnPlan, Network, PlanItem, Snapshot, fifo_policy

MB = 1e6


def test_network_rate_is_the_bottleneck_of_the_path():
    net = Network(default=100 * MB, up={"a": 50 * MB}, down={"s": 20 * MB},
                  pair={("b", "s"): 5 * MB})
    assert net.rate("a", "x") == 50 * MB
    assert net.rate("a", "s") == 20 * MB
    assert net.rate("b", "s") == 5 * MB
    assert net.rate("c", "d") == 100 * MB


def test_fifo_lets_everything_go_at_once_with_fair_shares():
    state = ControlState(fifo_policy, tau_max=4, network=Network(default=10 * MB))
    a = state.request("w1", 1, host="a", dst="s", nbytes=10 * MB, base_version=0, norm=1.0,
                      now=0.0)
    b = state.request("w2", 7, host="b", dst="s", nbytes=20 * MB, base_version=0, norm=1.0,
                      now=0.5)
    d = state.decide(now=1.0)
    assert d.wake_at is None
    assert [(type(x), x.transfer.id, x.position) for x in d.actions] == [
        (Go, a.id, 0), (Go, b.id, 1)]
    # Two transfers share the link: each planned at half the rate.
    assert d.actions[0].planned_seconds == pytest.approx(10 * MB / (10 * MB / 1))
    assert d.actions[1].planned_seconds == pytest.approx(20 * MB / (10 * MB / 2))
    assert not state.pending and set(state.active) == {a.id, b.id}
    assert state.done("w2", 7, version=5) is b
    assert state.version == 5 and set(state.active) == {a.id}
    assert state.done("w2", 7, version=6) is None  # twice: ignored


def test_later_starts_wait_and_drops_are_final():
    def policy(snap: Snapshot) -> list[PlanItem]:
        first, second, third = snap.pending
        return [PlanItem(first.id, start=snap.now, position=0, planned_seconds=1.0),
                PlanItem(second.id, start=snap.now + 2.0, position=1, planned_seconds=1.0),
                PlanItem(third.id, drop="deadline_missed", detail="dl 3 < position 4")]

    state = ControlState(policy, tau_max=2)
    ts = [state.request("w", i, host="h", dst="s", nbytes=1, base_version=0, norm=0.0,
                        now=0.0) for i in range(3)]
    d = state.decide(now=10.0)
    assert [type(x) for x in d.actions] == [Go, Drop]
    assert d.actions[1] == Drop(ts[2], "deadline_missed", "dl 3 < position 4")
    assert d.wake_at == 12.0
    assert list(state.pending) == [ts[1].id]


def test_each_action_is_handed_on_as_it_is_taken():
    """`decide`'s on_action sees the decision's actions in its order, each
    once it is taken (a go's transfer active, the transfers after it still
    pending), before the decision returns: the controller sends each then."""
    def policy(snap: Snapshot) -> list[PlanItem]:
        a, b, c, d = snap.pending
        return [PlanItem(a.id, start=snap.now, position=0, planned_seconds=1.0),
                PlanItem(b.id, start=snap.now, position=1, planned_seconds=1.0),
                PlanItem(c.id, start=snap.now + 2.0, position=2, planned_seconds=1.0),
                PlanItem(d.id, drop="deadline_missed", detail="dl 3 < position 4")]

    state = ControlState(policy, tau_max=2)
    ts = [state.request("w", i, host=f"h{i}", dst="s", nbytes=1, base_version=0, norm=0.0,
                        now=0.0) for i in range(4)]
    seen = []
    d = state.decide(now=10.0, on_action=lambda x: seen.append(
        (x, sorted(state.active), sorted(state.pending))))
    assert [x for x, _, _ in seen] == list(d.actions)
    assert [type(x) for x in d.actions] == [Go, Go, Drop]
    ids = [t.id for t in ts]
    assert [(active, pending) for _, active, pending in seen] == [
        ([ids[0]], ids[1:]), (ids[:2], ids[2:]), (ids[:2], [ids[2]])]


def test_a_column_plan_reads_as_its_list_and_decides_the_same():
    """The mlfabric policy's plan builds items only when read: as a sequence it
    is the list of sends by position then drops; decide() reads only what is
    due, and acts and wakes exactly as on that list."""
    drop = PlanItem(13, drop="deadline_missed", detail="at position 3")
    plan = ColumnPlan([11, 12, 10], start=[10.0, 12.5, 10.0], end=[11.0, 14.0, 10.25],
                      position=[0, 1, 2], drops=[drop])
    as_list = [PlanItem(11, start=10.0, position=0, planned_seconds=1.0),
               PlanItem(12, start=12.5, position=1, planned_seconds=1.5),
               PlanItem(10, start=10.0, position=2, planned_seconds=0.25), drop]
    assert list(plan) == as_list and len(plan) == 4
    assert (plan[1], plan[-1], plan[1:3]) == (as_list[1], drop, as_list[1:3])
    with pytest.raises(IndexError, match="plan index 4 out of range for 4 items"):
        plan[4]
    assert plan.due(10.0) == ([as_list[0], as_list[2], drop], 12.5)
    assert plan.due(13.0) == ([*as_list[:3], drop], None)

    def decide_with(policy_plan):
        state = ControlState(lambda snap: policy_plan, tau_max=None)
        for req in range(4):
            state.request("w", req, host="h", dst="s", nbytes=1, base_version=0, norm=0.0,
                          now=0.0)
        d = state.decide(now=10.0)
        return ([(type(a).__name__, a.transfer.id, getattr(a, "position", None))
                 for a in d.actions], d.wake_at, sorted(state.pending))

    # ids 10..13 are the transfers' ids once state.request gave 1..4: shift them
    shifted = ColumnPlan([2, 3, 1], [10.0, 12.5, 10.0], [11.0, 14.0, 10.25], [0, 1, 2],
                         [drop._replace(id=4)])
    assert decide_with(shifted) == decide_with(list(shifted)) == (
        [("Go", 2, 0), ("Go", 1, 2), ("Drop", 4, None)], 12.5, [3])


def test_snapshot_is_ordered_and_sees_the_version_from_requests():
    seen = []
    state = ControlState(lambda snap: seen.append(snap) or [], tau_max=None)
    state.request("w", 1, host="h", dst="s", nbytes=5, base_version=9, norm=0.5, now=1.0)
    state.request("w", 2, host="h", dst="s", nbytes=3, base_version=4, norm=0.5, now=2.0)
    state.decide(now=3.0)
    (snap,) = seen
    assert snap.now == 3.0 and snap.version == 9 and snap.tau_max is None
    assert [t.req for t in snap.pending] == [1, 2] and snap.active == ()


def test_forgetting_a_worker_removes_its_transfers_only():
    state = ControlState(fifo_policy, tau_max=None)
    state.request("gone", 1, host="h", dst="s", nbytes=5, base_version=0, norm=0.0, now=0.0)
    state.decide(now=0.0)
    state.request("gone", 2, host="h", dst="s", nbytes=5, base_version=0, norm=0.0, now=0.0)
    keep = state.request("stay", 1, host="g", dst="s", nbytes=5, base_version=0, norm=0.0,
                         now=0.0)
    assert sorted(t.req for t in state.forget("gone")) == [1, 2]
    assert list(state.pending) == [keep.id] and not state.active


def test_nothing_pending_asks_no_policy():
    def policy(snap):
        raise AssertionError("called")

    assert ControlState(policy, tau_max=None).decide(now=0.0).actions == ()


def test_agent_estimates_set_and_clear_pair_rates():
    from mlfabric.scheduling.plan import with_estimates

    net = Network(default=100 * MB, down={"s": 50 * MB})
    net = with_estimates(net, "a", {"s": (20 * MB, False), "b": (float("nan"), False)})
    assert net.pair == {("a", "s"): 20 * MB}
    assert net.rate("a", "s") == 20 * MB and net.down == {"s": 50 * MB}
    net = with_estimates(net, "a", {"s": (30 * MB, True)})  # stale: back to the capacities
    assert net.pair == {} and net.rate("a", "s") == 50 * MB


def test_host_load_leaves_the_remainder_of_each_edge_link_to_the_job():
    from mlfabric.scheduling.plan import MIN_LEFT, with_estimates, with_host_load

    net = Network(default=100 * MB, down={"s": 50 * MB})
    net = with_host_load(net, "s", down=30 * MB, up=float("nan"))
    assert net.load_down == {"s": 30 * MB} and net.load_up == {}
    assert net.down_rate("s") == 20 * MB and net.up_rate("s") == 100 * MB
    assert net.rate("a", "s") == 20 * MB and net.rate("s", "a") == 100 * MB
    # a measured pair rate still bounds its path
    assert with_estimates(net, "a", {"s": (5 * MB, False)}).rate("a", "s") == 5 * MB
    # a link others fill entirely still leaves the job MIN_LEFT of it, never zero
    full = with_host_load(net, "a", down=0.0, up=500 * MB)
    assert full.up_rate("a") == MIN_LEFT * 100 * MB and full.rate("a", "s") == 5 * MB
    # not measured any more (an agent says -1): the capacity applies again
    net = with_host_load(net, "s", down=-1.0, up=-1.0)
    assert net.load_down == {} and net.down_rate("s") == 50 * MB


def test_planner_sees_the_host_load():
    """The mlfabric policy plans a transfer into a loaded downlink at what is left."""
    from mlfabric.scheduling.plan import with_host_load
    from mlfabric.scheduling.policies import mlfabric_policy

    state = ControlState(mlfabric_policy, tau_max=4,
                         network=Network(default=100 * MB, down={"s": 10 * MB}))
    state.set_network(with_host_load(state.network, "s", down=6 * MB, up=0.0))
    state.join("w", "w1")
    state.request("w", 1, host="w1", dst="s", nbytes=4 * MB, base_version=0, norm=1.0, now=0.0)
    (go,) = state.decide(now=0.0).actions
    assert go.planned_seconds == pytest.approx(1.0)  # 4 MB at the 4 MB/s left


def test_status_counts_what_each_worker_asked_for():
    state = ControlState(fifo_policy, tau_max=4, network=Network(default=10 * MB))
    state.join("w", "worker-1")
    for req in (1, 2):
        state.request("w", req, host="h1", dst="s", nbytes=5, base_version=0, norm=0.0, now=0.0)
    state.decide(now=0.0)
    state.done("w", 1, version=1, applied=True, delay=0)
    state.done("w", 2, version=1, applied=False, delay=5)
    status = state.status()
    (w,) = status["workers"]
    assert (w["name"], w["host"], w["requests"], w["sent"], w["applied"], w["refused"],
            w["last_delay"]) == ("worker-1", "h1", 2, 2, 1, 1, 0)
    assert status["delay"] == {"count": 1, "mean": 0.0, "max": 0, "std": 0.0}
    assert status["server_version"] == 1
    assert status["servers"] == [{"host": "s", "version": 1, "transfers": 2, "applied": 1,
                                  "refused": 1, "last_heard_age_s": None}]
    assert set(status["bandwidth"]) == {"h1", "s"}
    assert status["replicas"] == [] and status["agents"] == []


def test_status_lists_servers_and_agents_with_ages_on_the_given_clock():
    state = ControlState(fifo_policy, tau_max=4)
    state.add_agent("h1", "10.0.0.1:7400")
    state.add_agent("h2", "10.0.0.2:7400")
    state.request("w", 1, host="h1", dst="s2", nbytes=5, base_version=0, norm=0.0, now=0.0)
    state.request("w", 2, host="h1", dst="s1", nbytes=5, base_version=0, norm=0.0, now=0.0)
    state.decide(now=0.0)
    state.done("w", 2, version=7, applied=True, delay=0, now=3.0)
    state.agent_reported("h1", now=4.0, peers=2, fresh=1)
    state.agent_unreachable("h2", "Connection refused")
    status = state.status(now=10.0)
    # Seen but not yet reported back: no version, never heard from.
    assert status["servers"] == [
        {"host": "s1", "version": 7, "transfers": 1, "applied": 1, "refused": 0,
         "last_heard_age_s": 7.0},
        {"host": "s2", "version": None, "transfers": 1, "applied": 0, "refused": 0,
         "last_heard_age_s": None}]
    assert status["agents"] == [
        {"host": "h1", "address": "10.0.0.1:7400", "reachable": True, "last_report_age_s": 6.0,
         "peers": 2, "fresh": 1, "error": ""},
        {"host": "h2", "address": "10.0.0.2:7400", "reachable": False,
         "last_report_age_s": None, "peers": 0, "fresh": 0, "error": "Connection refused"}]
    # An agent that goes away keeps its last report's time; back, its error clears.
    state.agent_unreachable("h1", "timed out")
    assert state.status(now=11.0)["agents"][0]["last_report_age_s"] == 7.0
    state.agent_reported("h1", now=12.0, peers=2, fresh=2)
    assert state.status(now=12.5)["agents"][0] == {
        "host": "h1", "address": "10.0.0.1:7400", "reachable": True, "last_report_age_s": 0.5,
        "peers": 2, "fresh": 2, "error": ""}
    state.replicas["r1"] = {"host": "r1", "version": 6}
    assert state.status()["replicas"] == [{"host": "r1", "version": 6}]


# -- sharded servers: each shard's transfers against its own version -------------------


def test_each_shard_is_planned_against_its_own_version_and_in_flight():
    """Shard 0 is far ahead of shard 1; with tau_max = 2 a transfer computed
    on shard 1's version 3 is fresh there, though stale against shard 0's 10.
    Positions count only the shard's own transfers in flight."""
    from mlfabric.scheduling.policies import mlfabric_policy

    state = ControlState(mlfabric_policy, tau_max=2, network=Network(default=10 * MB))
    state.request("w0", 1, host="a", dst="s0", nbytes=MB, base_version=10, norm=1.0, now=0.0,
                  shard=0)
    state.request("w0", 2, host="a", dst="s1", nbytes=MB, base_version=3, norm=1.0, now=0.0,
                  shard=1)
    assert state.shard_versions == {0: 10, 1: 3}
    d = state.decide(now=0.0)
    drops = [x for x in d.actions if isinstance(x, Drop)]
    assert drops == []  # against one version (10), shard 1's part would be dropped
    gone = {x.transfer.shard: x for x in d.actions if isinstance(x, Go)}
    assert set(gone) == {0}  # shard 1's part waits: the worker's uplink is busy
    # Shard 1's first transfer is at position 0 of shard 1, whatever runs at shard 0.
    seen = []
    state2 = ControlState(lambda snap: seen.append(snap) or [], tau_max=None)
    for shard in (0, 0, 1):
        state2.request("w", len(seen) + shard, host="h", dst="s", nbytes=1, base_version=0,
                       norm=0.0, now=0.0, shard=shard)
    state2.active = ActiveTransfers.of(state2.pending.values())
    state2.pending.clear()
    state2.request("w", 9, host="h", dst="s", nbytes=1, base_version=0, norm=0.0, now=0.0,
                   shard=1)
    state2.decide(now=0.0)
    (snap,) = seen
    assert [t.shard for t in snap.pending] == [1]
    assert len(snap.active) == 3 and snap.server_in_flight == 1


def test_the_shard_planned_first_rotates():
    order = []

    def policy(snap):
        order.append(snap.pending[0].shard)
        return []

    state = ControlState(policy, tau_max=None)
    for shard in (0, 1, 2):
        state.request("w", shard, host="h", dst="s", nbytes=1, base_version=0, norm=0.0,
                      now=0.0, shard=shard)
    for _ in range(3):
        state.decide(now=0.0)
        state.touch()  # (every shard planned again, though nothing of theirs changed)
    assert order == [0, 1, 2, 1, 2, 0, 2, 0, 1]
    assert state.status()["shards"] == [{"shard": k, "host": "s", "version": 0}
                                        for k in range(3)]


def test_a_shard_is_planned_again_only_when_something_of_its_own_happened():
    """Every shard re-planned on every event, a sharded controller's
    decision grew with the shards (at 1,000 simulated workers and 16
    shards it was busy all the time, and a push took 61 s against FIFO's
    0.6 s). A shard is planned again on its own news, when its plan's next
    start comes, and when the network or the aggregators change."""
    planned = []

    def policy(snap):
        planned.append(snap.pending[0].shard)
        # shard k's transfer starts at k + 1: a later start, a wake-up then
        return [PlanItem(t.id, t.shard + 1.0, 0, 1.0) for t in snap.pending]

    state = ControlState(policy, tau_max=None, network=Network(default=1e6))
    for shard in (0, 1, 2):
        state.request("w", shard, host="h", dst=f"s{shard}", nbytes=1, base_version=0,
                      norm=0.0, now=0.0, shard=shard)
    assert state.decide(0.0).wake_at == 1.0
    assert sorted(planned) == [0, 1, 2]
    planned.clear()
    state.request("w", 9, host="h", dst="s1", nbytes=1, base_version=0, norm=0.0, now=0.1,
                  shard=1)
    assert state.decide(0.1).wake_at == 1.0  # shard 0's plan still holds
    assert planned == [1]
    planned.clear()
    (go,) = state.decide(1.0).actions  # shard 0's start has come: only it
    assert planned == [0] and go.transfer.shard == 0
    planned.clear()
    state.set_network(Network(default=2e6))  # a new picture of the links: all of them
    state.decide(1.1)
    assert sorted(planned) == [1, 2]
    planned.clear()
    state.touch(2)  # e.g. shard 2's divergence gate opened
    state.decide(1.2)
    assert planned == [2]


def test_a_job_of_one_server_is_planned_as_before():
    seen = []
    state = ControlState(lambda snap: seen.append(snap) or [], tau_max=None)
    state.request("w", 1, host="h", dst="s", nbytes=1, base_version=4, norm=0.0, now=0.0)
    state.decide(now=0.0)
    assert seen[0].in_flight is None and seen[0].version == 4
    assert state.status()["shards"] == []


# -- chunked transfers: a shorter transfer passes a long one between its chunks -------

MiB = 1 << 20


def _chunked_state(**kw):
    from mlfabric.scheduling.policies import mlfabric_policy

    return ControlState(mlfabric_policy, tau_max=None, network=Network(default=10 * MB), **kw)


def test_a_shorter_transfer_passes_a_chunked_one_at_its_next_chunk():
    state = _chunked_state()
    big = state.request("w0", 1, host="a", dst="s", nbytes=8 * MiB, base_version=0, norm=1.0,
                        now=0.0, chunk=MiB)
    (go,) = state.decide(now=0.0).actions
    assert (go.transfer, go.upto, go.first) == (big, MiB, True)
    assert go.planned_seconds == pytest.approx(MiB / (10 * MB))
    small = state.request("w1", 1, host="b", dst="s", nbytes=2 * MiB, base_version=0,
                          norm=1.0, now=0.05)
    d = state.decide(now=0.05)
    # The server's downlink is the big transfer's until its chunk ends, not until all of it.
    assert d.actions == () and d.wake_at == pytest.approx(MiB / (10 * MB))
    assert state.progress("w0", 1, sent=MiB, now=0.105) is big
    assert set(state.pending) == {big.id, small.id}
    (go,) = state.decide(now=0.105).actions
    assert go.transfer is small and go.upto is None  # shortest remaining first
    assert state.done("w1", 1, version=1, now=0.32) is small
    (go,) = state.decide(now=0.32).actions
    assert (go.transfer, go.upto, go.first) == (big, 2 * MiB, False)
    assert go.planned_seconds == pytest.approx(MiB / (10 * MB))
    # Without chunks the short transfer would have waited for all 8 MiB.
    whole = _chunked_state()
    whole.request("w0", 1, host="a", dst="s", nbytes=8 * MiB, base_version=0, norm=1.0,
                  now=0.0)
    (go,) = whole.decide(now=0.0).actions
    assert go.upto is None and go.planned_seconds == pytest.approx(8 * MiB / (10 * MB))
    whole.request("w1", 1, host="b", dst="s", nbytes=2 * MiB, base_version=0, norm=1.0,
                  now=0.05)
    assert whole.decide(now=0.05).wake_at == pytest.approx(8 * MiB / (10 * MB))


def test_a_chunked_transfer_goes_to_its_end_and_counts_once():
    state = _chunked_state()
    t = state.request("w", 1, host="a", dst="s", nbytes=2 * MiB + 10, base_version=0,
                      norm=1.0, now=0.0, chunk=MiB)
    uptos, now = [], 0.0
    while True:
        (go,) = state.decide(now=now).actions
        uptos.append(go.upto)
        now += 0.2
        if go.upto == t.nbytes:
            break
        assert state.progress("w", 1, sent=go.upto, now=now) is t
    assert uptos == [MiB, 2 * MiB, 2 * MiB + 10]
    assert state.progress("w", 1, sent=t.nbytes, now=now) is None  # all of it let go
    assert state.done("w", 1, version=1, now=now) is t
    stats = next(iter(state.workers.values()))
    assert (stats.requests, stats.sent, stats.applied) == (1, 1, 1)


def test_a_chunked_transfer_part_sent_is_let_go_whole_instead_of_dropped():
    """A drop cannot take back bytes on the wire: the rest goes, and the
    server judges its staleness."""
    drop_all = [False]

    def policy(snap):
        if drop_all[0]:
            return [PlanItem(t.id, drop="deadline_missed") for t in snap.pending]
        return [PlanItem(t.id, start=snap.now, position=0, planned_seconds=1.0)
                for t in snap.pending]

    state = ControlState(policy, tau_max=2, network=Network(default=10 * MB))
    state.request("w", 1, host="a", dst="s", nbytes=4 * MiB, base_version=0, norm=1.0,
                      now=0.0, chunk=MiB)
    (go,) = state.decide(now=0.0).actions
    assert go.upto == MiB and go.planned_seconds == pytest.approx(0.25)  # a quarter of it
    state.progress("w", 1, sent=MiB, now=0.1)
    drop_all[0] = True
    (go,) = state.decide(now=0.1).actions
    assert isinstance(go, Go) and (go.upto, go.first) == (4 * MiB, False)
    assert go.planned_seconds == pytest.approx(3 * MiB / (10 * MB))
    other = state.request("w", 2, host="a", dst="s", nbytes=4 * MiB, base_version=0,
                          norm=1.0, now=0.2, chunk=MiB)
    (drop,) = state.decide(now=0.2).actions
    assert drop == Drop(other, "deadline_missed", "")  # nothing of it was sent: dropped


def test_chunks_have_a_floor_and_a_transfer_of_one_chunk_goes_whole():
    from mlfabric.controller.state import MIN_CHUNK

    state = _chunked_state()
    tiny = state.request("w", 1, host="a", dst="s", nbytes=4 * MIN_CHUNK, base_version=0,
                         norm=1.0, now=0.0, chunk=1)
    one = state.request("w", 2, host="b", dst="t", nbytes=MiB, base_version=0, norm=1.0,
                        now=0.0, chunk=MiB)
    assert (tiny.chunk, one.chunk) == (MIN_CHUNK, 0)
    uptos = {a.transfer.id: a.upto for a in state.decide(now=0.0).actions}
    assert uptos == {tiny.id: MIN_CHUNK, one.id: None}


def test_a_worker_that_sends_the_rest_alone_holds_the_link_until_done():
    state = _chunked_state()
    t = state.request("w", 1, host="a", dst="s", nbytes=4 * MiB, base_version=0, norm=1.0,
                      now=0.0, chunk=MiB)
    state.decide(now=0.0)
    state.progress("w", 1, sent=MiB, now=0.1)
    assert t.id in state.pending
    # Its controller link failed over, or its push failed: all the rest went at once.
    assert state.progress("w", 1, sent=4 * MiB, now=0.2) is t
    assert t.id in state.active and (t.granted, t.piece) == (4 * MiB, 3 * MiB)
    assert t.planned_seconds == pytest.approx(3 * MiB / (10 * MB))
    assert state.decide(now=0.2).actions == ()
    # Reported done while waiting for a grant, it still counts as sent and applied.
    u = state.request("w", 2, host="a", dst="s", nbytes=4 * MiB, base_version=0, norm=1.0,
                      now=0.3, chunk=MiB)
    assert state.done("w", 1, version=1, now=0.5) is t
    state.decide(now=0.5)
    state.progress("w", 2, sent=MiB, now=0.6)
    assert state.done("w", 2, version=2, applied=False, now=0.7) is u
    assert not state.pending and not state.active
    stats = state.workers["w"]
    assert (stats.sent, stats.applied, stats.refused) == (2, 1, 1)


def test_the_clients_book_finishes_a_part_sent_update_rather_than_withdraw_it():
    """An update sent in part cannot be withdrawn or wait for a lost
    controller: its frame's rest holds up the server's link."""
    from types import SimpleNamespace

    from mlfabric.client.control_book import ControlBook, ControlledUpdate
    from mlfabric.wire.protocol import Directive, TransferProgress

    book = ControlBook("ctl:1", host="h", dst="s", fallback="wait", timeout=30.0, shard=2,
                       chunk=MiB)
    book.connected = True
    updates = [ControlledUpdate({}, 0, 3 * MiB, 1.0, SimpleNamespace(), requested=0.0)
               for _ in range(2)]
    requests = [book.place(u)[0] for u in updates]
    assert [(r.shard, r.chunk) for r in requests] == [(2, MiB)] * 2
    part_sent, waiting = updates
    u, outcome = book.directive(Directive(req=part_sent.creq, action="go", upto=MiB), 0)
    assert u is part_sent and outcome is None and u.upto == MiB
    u.part = SimpleNamespace(sent=MiB, whole=False, total=3 * MiB)  # its first chunk went
    assert book.next_chunk(u) == TransferProgress(req=u.creq, sent=MiB)
    # Past push_timeout, only the update with nothing sent is withdrawn.
    assert [x[0] for x in book.overdue(now=100.0, timeout=10.0)] == [waiting]
    # A drop for it would be carried out as "all the rest" (never sent by a controller).
    u, outcome = book.directive(Directive(req=part_sent.creq, action="drop", reason="x"), 0)
    assert u is part_sent and outcome is None and u.upto is None
    book.next_chunk(u)
    # The controller is lost: with fallback "wait" too, it is finished at once.
    assert book.lost(None) == [part_sent] and part_sent.upto is None
    assert book.finished_alone(part_sent) == TransferProgress(req=part_sent.creq,
                                                              sent=3 * MiB)


def test_without_chunks_a_chunked_request_goes_whole():
    state = _chunked_state()
    state.chunks = False  # mlfabric controller --no-chunks
    t = state.request("w", 1, host="a", dst="s", nbytes=8 * MiB, base_version=0, norm=1.0,
                      now=0.0, chunk=MiB)
    (go,) = state.decide(now=0.0).actions
    assert t.chunk == 0 and go.upto is None


def _update():
    from types import SimpleNamespace

    from mlfabric.client.control_book import ControlledUpdate

    return ControlledUpdate({}, 0, 10, 1.0, SimpleNamespace(), requested=0.0)


def test_the_clients_book_counts_the_time_and_updates_without_the_controller():
    """Issue 33: training without the controller is never silent. The
    client's metrics say while it is without it and count what went
    unscheduled; when it answers, the book's first word to it is the report
    of both since connect (FellBack), which `mlfabric status` shows."""
    from mlfabric.client.control_book import ControlBook
    from mlfabric.errors import ConnectError
    from mlfabric.runtime.metrics import ClientMetrics
    from mlfabric.wire.protocol import FellBack, TransferRequest

    m = ClientMetrics()
    book = ControlBook("ctl:1", host="h", dst="s", fallback="fifo", timeout=30.0, metrics=m)

    def down() -> float:
        return m.controller_unreachable._value.get()

    def unscheduled() -> float:
        return m.controller_fallback_updates._value.get()

    # Unreachable at connect: an update goes at once, counted.
    assert book.lost(ConnectError("refused"), now=10.0) == [] and down() == 1
    u = _update()
    assert book.place(u) == (None, [u]) and unscheduled() == 1
    book.lost(ConnectError("refused"), now=11.0)  # a failed dial again: the same outage
    assert down() == 1
    assert book.reconnected(now=12.5) == [FellBack(updates=1, seconds=2.5)] and down() == 0
    # Connected: updates are asked for, not counted.
    request, now = book.place(_update())
    assert isinstance(request, TransferRequest) and now == [] and unscheduled() == 1
    # Lost later: the one waiting goes at once; the report sums since connect.
    assert len(book.lost(None, now=20.0)) == 1 and (down(), unscheduled()) == (1, 2)
    assert book.reconnected(now=21.0) == [FellBack(updates=2, seconds=3.5)] and down() == 0
    assert book.reconnected(now=22.0) == []  # nothing new to report
    # A client closed while without it no longer counts as one.
    book.lost(None, now=30.0)
    book.close()
    assert down() == 0


def test_with_fallback_wait_the_report_says_nothing_went_unscheduled():
    from mlfabric.client.control_book import ControlBook
    from mlfabric.wire.protocol import FellBack

    book = ControlBook("ctl:1", host="h", dst="s", fallback="wait", timeout=30.0)
    book.reconnected(now=0.0)
    u = _update()
    book.place(u)
    assert book.lost(None, now=5.0) == []  # waits for the controller
    report, request = book.reconnected(now=6.0)
    assert report == FellBack(updates=0, seconds=1.0) and request.req == u.creq


def test_a_controller_that_refuses_the_worker_fails_its_pushes_for_good():
    """A refusal (a setting is wrong) is no outage: no fallback, the updates
    waiting fail with its reason, and so does every later push."""
    from mlfabric.client.control_book import ControlBook
    from mlfabric.errors import ConfigError

    book = ControlBook("ctl:1", host="h", dst="s", fallback="fifo", timeout=30.0)
    book.reconnected(now=0.0)
    asked = _update()
    book.place(asked)
    refusal = ConfigError("the controller at ctl:1 refused this worker: no")
    assert book.refuse(refusal) == [asked]
    with pytest.raises(ConfigError, match="refused this worker: no"):
        book.place(_update())


def test_status_lists_the_workers_back_from_a_fallback_and_those_gone():
    """What `mlfabric status` can know of workers without this controller:
    what those that came back reported, and when the others disconnected."""
    from mlfabric.controller.state import GONE_KEPT

    state = ControlState(fifo_policy, tau_max=4)
    state.join("a", "w1 (10.0.0.1:5000)", client="w1")
    state.join("b", "w2 (10.0.0.2:5000)", client="w2")
    state.join("s", "status@x (10.0.0.3:1)", client="status@x")
    state.request("b", 1, host="h2", dst="s", nbytes=5, base_version=0, norm=0.0, now=0.0)
    state.fell_back("a", 7, 2.5)
    state.forget("b", now=10.0)
    state.forget("s", now=10.0)  # asked for nothing (a status request): not a worker
    status = state.status(now=12.0)
    (w1,) = status["workers"]
    assert (w1["name"], w1["fell_back_updates"], w1["fell_back_seconds"]) == (
        "w1 (10.0.0.1:5000)", 7, 2.5)
    assert status["gone_workers"] == [{"name": "w2 (10.0.0.2:5000)", "client": "w2",
                                       "host": "h2", "requests": 1, "gone_age_s": 2.0}]
    state.join("b2", "w2 (10.0.0.2:5001)", client="w2")  # back, by its hello's name
    assert state.status()["gone_workers"] == []
    for i in range(GONE_KEPT + 5):  # the newest are kept, newest first
        state.join(i, f"x{i}", client=f"x{i}")
        state.request(i, 1, host="h", dst="s", nbytes=5, base_version=0, norm=0.0, now=0.0)
        state.forget(i, now=float(i))
    gone = state.status()["gone_workers"]
    assert len(gone) == GONE_KEPT and gone[0]["name"] == f"x{GONE_KEPT + 4}"


def test_a_move_to_another_controller_is_no_outage_and_an_unreachable_one_is():
    """Several controllers (issue 34): MOVED turns the updates waiting for a
    directive into ones to ask the next controller, with no fallback (even
    "fifo"), and so are updates placed meanwhile; once it answers, each is
    asked again there and nothing is reported as unscheduled. If the
    controller named cannot be reached, that is an outage after all: the
    fallback takes every waiting update."""
    from mlfabric.client.control_book import ControlBook
    from mlfabric.errors import ConnectError
    from mlfabric.runtime.metrics import ClientMetrics
    from mlfabric.wire.protocol import TransferRequest

    m = ClientMetrics()
    book = ControlBook("ctl:1", host="h", dst="s", fallback="fifo", timeout=30.0, metrics=m)
    book.reconnected(now=0.0)
    asked = _update()
    book.place(asked)
    assert book.moved() == []  # none was sent in part
    later = _update()
    assert book.place(later) == (None, [])  # waits for the next controller
    requests = book.reconnected(now=1.0)
    assert [type(r) for r in requests] == [TransferRequest, TransferRequest]
    assert [r.req for r in requests] == [asked.creq, later.creq]
    assert m.controller_unreachable._value.get() == 0
    assert m.controller_fallback_updates._value.get() == 0
    # Moved again, and the one named is down: both go at once (fifo), counted.
    book.moved()
    third = _update()
    book.place(third)
    assert book.lost(ConnectError("refused"), now=2.0) == [asked, later, third]
    assert m.controller_unreachable._value.get() == 1
    assert m.controller_fallback_updates._value.get() == 3
