"""Grouping the order for aggregation (pure) and the definition of applying an aggregate."""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.agent.group_sum import GroupSum
from mlfabric.controller.state import ControlState
from mlfabric.errors import ConfigError
from mlfabric.scheduling.aggregation import (
    AggregationConfig,
    Group,
    Links,
    Slot,
    apply_aggregate,
    direct_delivery,
    plan_groups,
    rescue_drops,
    route_groups,
)
from mlfabric.scheduling.plan import Network, PlanItem, Route, Snapshot, Transfer

TOL = 1e-9


@st.composite
def cases(draw):
    hosts = [f"w{i}" for i in range(draw(st.integers(1, 6)))] + ["a0", "a1", "s"]
    rate = st.sampled_from([5.0, 10.0, 50.0, 100.0, 1000.0])
    up = {h: draw(rate) for h in hosts}
    down = {h: draw(rate) for h in hosts}
    pair = {}
    for a in hosts:
        for b in hosts:
            if a != b and draw(st.booleans()) and draw(st.booleans()):
                pair[(a, b)] = draw(rate)
    size = draw(st.sampled_from([10, 40]))
    order = [Slot(i, draw(st.sampled_from([*hosts[:-3], "a0"])),
                  size if draw(st.integers(0, 5)) else 20, draw(st.integers(0, 9)))
             for i in range(draw(st.integers(0, 12)))]
    now = draw(st.sampled_from([0.0, 5.0]))
    ready = now + draw(st.sampled_from([0.0, 0.5, 3.0]))
    aggs = draw(st.lists(st.sampled_from(["a0", "a1", "s", "w0"]), unique=True, max_size=3))
    config = AggregationConfig(min_fan_in=draw(st.integers(2, 3)),
                               max_fan_in=draw(st.integers(3, 6)), sum_rate=1e3,
                               wait=draw(st.sampled_from([0.0, 0.0, 0.3, 2.0])))
    return order, Links(up, down, pair), now, ready, aggs, config


@settings(max_examples=300, deadline=None)
@given(cases())
def test_groups_keep_the_order_stall_the_server_at_most_the_wait_and_pay(case):
    order, links, now, ready, aggs, config = case
    groups, saved = plan_groups(order, "s", aggs, links, now, ready, config)
    # every position exactly once, consecutive, in order
    assert [i for g in groups for i in g.ids] == [s.id for s in order]
    assert [g.first for g in groups] == [sum(len(h.ids) for h in groups[:k])
                                        for k in range(len(groups))]
    done = max(now, ready)
    expect_saved = 0
    for g in groups:
        members = order[g.first:g.first + len(g.ids)]
        if g.aggregator is None:
            assert len(g.ids) == 1
            s = members[0]
            assert g.delivered == pytest.approx(done + s.size / links.rate(s.source, "s"))
        else:
            assert g.aggregator in aggs and g.aggregator != "s"
            assert config.min_fan_in <= len(g.ids) <= config.max_fan_in
            assert len({m.size for m in members}) == 1
            # the constraint: ready at the aggregator before the server is
            # free (wait 0: the brief's never-stall rule), or at most `wait` after
            assert g.ready <= done + config.wait + TOL
            fwd = members[0].size / links.rate(g.aggregator, "s")
            assert g.delivered == pytest.approx(max(done, g.ready) + fwd)
            # it pays: sooner than the members sent one by one
            assert g.delivered < done + sum(m.size / links.rate(m.source, "s")
                                            for m in members)
            expect_saved += (len(g.ids) - 1) * members[0].size
        done = g.delivered
    assert saved == expect_saved
    assert done <= direct_delivery(order, "s", links, now, ready) + TOL


@settings(max_examples=100, deadline=None)
@given(cases(), st.randoms(use_true_random=False))
def test_grouping_does_not_depend_on_the_order_aggregators_are_listed(case, rnd):
    order, links, now, ready, aggs, config = case
    shuffled = list(aggs)
    rnd.shuffle(shuffled)
    assert plan_groups(order, "s", shuffled, links, now, ready, config) == plan_groups(
        order, "s", aggs, links, now, ready, config)


def test_hand_example_groups_behind_the_first_transfer():
    # server downlink 10 B/s; three 10 B updates; aggregator a with 100 B/s links.
    links = Links(up={"w1": 100.0, "w2": 100.0, "w3": 100.0, "a": 100.0, "s": 100.0},
                  down={"w1": 100.0, "w2": 100.0, "w3": 100.0, "a": 100.0, "s": 10.0}, pair={})
    order = [Slot(1, "w1", 10, 0), Slot(2, "w2", 10, 0), Slot(3, "w3", 10, 0)]
    groups, saved = plan_groups(order, "s", ["a"], links, now=0.0, ready=0.0,
                                config=AggregationConfig(sum_rate=1e3))
    # position 0 cannot be aggregated (the server is free at once): direct, done at 1.0.
    # positions 1-2 arrive at a by 20/100 = 0.2 s, summed by 0.22 s <= 1.0: one
    # 10 B forward, delivered at 2.0 instead of 3.0.
    assert groups == [Group(0, (1,), None, 0.0, 1.0), Group(1, (2, 3), "a", 0.22, 2.0)]
    assert saved == 10
    assert direct_delivery(order, "s", links, 0.0, 0.0) == 3.0
    # with no aggregator, or when it would not pay (a's uplink as slow as the server's
    # downlink share: forward 10/5 = 2 s >= 2 direct seconds), everything goes directly
    assert all(g.aggregator is None for g in plan_groups(order, "s", [], links, 0.0, 0.0)[0])
    slow = Links(up={**links.up, "a": 5.0}, down=links.down, pair={})
    assert all(g.aggregator is None for g in plan_groups(order, "s", ["a"], slow, 0.0, 0.0)[0])


def test_a_group_wait_lets_the_free_server_wait_for_an_aggregate_up_to_the_wait():
    links = Links(up={"w1": 100.0, "w2": 100.0, "w3": 100.0, "a": 100.0, "s": 100.0},
                  down={"w1": 100.0, "w2": 100.0, "w3": 100.0, "a": 100.0, "s": 10.0}, pair={})
    order = [Slot(1, "w1", 10, 0), Slot(2, "w2", 10, 0), Slot(3, "w3", 10, 0)]
    # All three are at a by 30/100 = 0.3 s and summed by 0.33 s: the free
    # server waits 0.33 s and receives one forward instead of three transfers.
    groups, saved = plan_groups(order, "s", ["a"], links, now=0.0, ready=0.0,
                                config=AggregationConfig(sum_rate=1e3, wait=0.5))
    assert groups == [Group(0, (1, 2, 3), "a", pytest.approx(0.33), pytest.approx(1.33))]
    assert saved == 20
    # A wait of 0.3 s is too short for three (0.33 s), long enough for two (0.22 s).
    groups, _ = plan_groups(order, "s", ["a"], links, now=0.0, ready=0.0,
                            config=AggregationConfig(sum_rate=1e3, wait=0.3))
    assert groups == [Group(0, (1, 2), "a", pytest.approx(0.22), pytest.approx(1.22)),
                      Group(2, (3,), None, pytest.approx(1.22), pytest.approx(2.22))]
    # A group whose wait would make it later than its members sent directly
    # is not formed: a's uplink forwards in 10/5.5 = 1.82 s, so 0.22 s of
    # waiting gives 2.04 s against 2.0 s for two direct transfers...
    slow = Links(up={**links.up, "a": 5.5}, down=links.down, pair={})
    two = order[:2]
    config = AggregationConfig(sum_rate=1e3, wait=0.5)
    assert [g.aggregator for g in plan_groups(two, "s", ["a"], slow, 0.0, 0.0, config)[0]] == [
        None, None]
    # ...while behind a busy downlink (free at 1.0 s) it waits for nothing and pays.
    assert plan_groups(two, "s", ["a"], slow, 0.0, 1.0, config)[0] == [
        Group(0, (1, 2), "a", pytest.approx(0.22), pytest.approx(1.0 + 10 / 5.5))]


def _hand_links():
    return Links(up={h: 100.0 for h in ("w1", "w2", "w3", "w4", "w5", "a", "s")},
                 down={**{h: 100.0 for h in ("w1", "w2", "w3", "w4", "w5", "a")}, "s": 10.0},
                 pair={})


def test_a_dropped_update_joins_the_aggregate_when_its_deadline_and_the_others_allow():
    links = _hand_links()
    order = [Slot(1, "w1", 10, 5), Slot(2, "w2", 10, 5), Slot(3, "w3", 10, 5)]
    config = AggregationConfig(sum_rate=1e3)
    groups, _ = plan_groups(order, "s", ["a"], links, 0.0, 0.0, config)
    assert groups[1] == Group(1, (2, 3), "a", 0.22, 2.0)

    def rescue(dropped, tau_max=4, first_version=6, cfg=config, order=order, groups=groups):
        return rescue_drops(groups, order, dropped, links, 0.0, 0.0,
                            first_version=first_version, tau_max=tau_max, config=cfg)

    # The group's members are applied at version 6 + 1 = 7: a dropped update
    # of base 4 has delay 3 = tau_max - 1 there and joins (ready 30/100 + 30/1e3
    # = 0.33 s, before the server is free at 1.0 s); base 3 would be
    # exactly tau_max, refused (one version of margin), and so is another size.
    fresh, stale, other_size = Slot(7, "w4", 10, 4), Slot(8, "w5", 10, 3), Slot(9, "w5", 20, 6)
    out = rescue([stale, fresh, other_size])
    assert out[0] == groups[0]
    assert out[1] == Group(1, (2, 3, 7), "a", pytest.approx(0.33), 2.0, rescued=1)
    # Freshest first, up to max_fan_in.
    assert rescue([Slot(7, "w4", 10, 4), Slot(8, "w5", 10, 6)],
                  cfg=replace(config, max_fan_in=3))[1].ids == (2, 3, 8)
    # A later position with no slack left: nothing joins before it.
    tight = [*order, Slot(4, "w1", 20, 3)]  # direct, position 3: version 9 = 3 + tau_max 6
    groups_tight, _ = plan_groups(tight, "s", ["a"], links, 0.0, 0.0, config)
    assert rescue([fresh], tau_max=6, order=tight, groups=groups_tight) == groups_tight
    assert rescue([fresh], tau_max=7, order=tight, groups=groups_tight)[1].rescued == 1
    # Not when the aggregate would then be ready after the server is free:
    # a member whose uplink takes 2 s (20x slower than the others).
    slow = replace(links, up={**links.up, "w4": 5.0})
    assert rescue_drops(groups, order, [fresh], slow, 0.0, 0.0, first_version=6, tau_max=4,
                        config=config) == groups


@settings(max_examples=300, deadline=None)
@given(cases(), st.integers(0, 9), st.integers(1, 9), st.data())
def test_rescued_members_meet_their_deadlines_and_keep_every_later_one(case, first, tau, data):
    order, links, now, ready, aggs, config = case
    # The policy's order meets every deadline; the drops are updates of any staleness.
    order = [replace(s, base_version=max(s.base_version, first + j - tau))
             for j, s in enumerate(order)]
    dropped = [Slot(100 + i, data.draw(st.sampled_from(sorted(links.up))),
                    data.draw(st.sampled_from([10, 40, 20])), data.draw(st.integers(0, 12)))
               for i in range(data.draw(st.integers(0, 6)))]
    groups, _ = plan_groups(order, "s", aggs, links, now, ready, config)
    out = rescue_drops(groups, order, dropped, links, now, ready, first_version=first,
                       tau_max=tau, config=config)
    by_id = {s.id: s for s in [*order, *dropped]}
    assert len(out) == len(groups)
    added = 0
    rescued_ids = []
    due = max(now, ready)
    for g, h in zip(groups, out, strict=True):
        # Rescued members only join aggregated groups, at their end.
        assert h.ids[:len(g.ids)] == g.ids and h.rescued == len(h.ids) - len(g.ids)
        assert (g.first, g.aggregator, g.delivered) == (h.first, h.aggregator, h.delivered)
        version = first + g.first + added
        if h.rescued:
            assert g.aggregator is not None and len(h.ids) <= config.max_fan_in
            assert len({by_id[i].size for i in h.ids}) == 1
            assert h.ready <= due + TOL
            for i in h.ids[len(g.ids):]:
                assert version - by_id[i].base_version <= tau - 1
                rescued_ids.append(i)
        # Every position of the order is still applied within its deadline.
        for i in g.ids:
            assert version - by_id[i].base_version <= tau
        added += h.rescued
        due = h.delivered
    assert len(set(rescued_ids)) == len(rescued_ids)
    assert set(rescued_ids) <= {s.id for s in dropped}


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="need 2 <= min_fan_in <= max_fan_in, got 3 and 2"):
        AggregationConfig(min_fan_in=3, max_fan_in=2)
    with pytest.raises(ConfigError, match="sum_rate must be positive bytes/s, got 0"):
        AggregationConfig(sum_rate=0)
    for wait in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=rf"group wait must be a finite number of "
                                              rf"seconds >= 0 .*, got {wait}"):
            AggregationConfig(wait=wait)
    links = Links({"w": 1.0, "s": 1.0}, {"w": 1.0, "s": 1.0}, {})
    with pytest.raises(ConfigError, match="update 7 has size 0"):
        plan_groups([Slot(7, "w", 0, 0)], "s", [], links, 0.0, 0.0)


def test_applying_an_aggregate_is_one_momentum_step_that_advances_by_k():
    rng = np.random.default_rng(3)
    w = {"a": rng.standard_normal(5).astype(np.float32)}
    w_prev = {"a": rng.standard_normal(5).astype(np.float32)}
    members = [({"a": rng.standard_normal(5).astype(np.float32)}, base) for base in (7, 9, 10)]
    new, prev, version, delays = apply_aggregate(w, w_prev, 12, members, gamma=0.5)
    total = members[0][0]["a"] + members[1][0]["a"] + members[2][0]["a"]
    np.testing.assert_array_equal(
        new["a"], (w["a"] + total + np.float32(0.5) * (w["a"] - w_prev["a"])).astype(np.float32))
    np.testing.assert_array_equal(prev["a"], w["a"])
    assert (version, delays) == (15, [5, 3, 2])
    # one member: exactly the server's rule for a single update
    one, _, v1, d1 = apply_aggregate(w, w_prev, 12, members[:1], gamma=0.5)
    np.testing.assert_array_equal(
        one["a"], w["a"] + members[0][0]["a"] + np.float32(0.5) * (w["a"] - w_prev["a"]))
    assert (v1, d1) == (13, [5])
    with pytest.raises(ConfigError, match="at least one member"):
        apply_aggregate(w, w_prev, 12, [], gamma=0.5)




# -- GroupSum: the aggregator's sum --------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(k=st.integers(1, 6), n=st.integers(1, 3000), chunk=st.sampled_from([1, 7, 64, 1 << 17]),
       seed=st.integers(0, 2**31), data=st.data())
def test_group_sum_is_the_left_to_right_sum_whatever_the_arrival_order(k, n, chunk, seed,
                                                                       data):
    rng = np.random.default_rng(seed)
    members = [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4)).astype(np.float32)
               for _ in range(k)]
    blocks = [np.empty(4 * n, np.uint8) for _ in range(k)]  # as the wire delivers them
    gs = GroupSum(k, 4 * n, chunk=chunk)
    received = [0] * k
    while not gs.all_in:
        i = data.draw(st.sampled_from([j for j in range(k) if not gs.complete[j]]))
        step = data.draw(st.integers(1, 4 * n))
        received[i] = min(4 * n, received[i] + step)
        blocks[i][:received[i]] = members[i].view(np.uint8)[:received[i]]
        if received[i] == 4 * n:
            gs.member_done(i, blocks[i])
        else:
            gs.progress(i, blocks[i], received[i])
        # Only what every member has in is ever summed.
        assert gs.summed * 4 <= min(received)
    want = functools.reduce(np.add, members)
    assert np.array_equal(gs.total().view(np.uint32), want.view(np.uint32))


def test_group_sum_of_a_subset_and_its_errors():
    a, c = (np.full(5, x, np.float32) for x in (1.0, 4.0))
    gs = GroupSum(3, 20)
    gs.member_done(0, a.view(np.uint8))
    gs.member_done(2, c.view(np.uint8))
    np.testing.assert_array_equal(gs.total_of([2, 0]), a + c)
    with pytest.raises(ConfigError, match="before all its members are in"):
        gs.total()
    with pytest.raises(ConfigError, match=r"members \[0, 1\] are not all complete"):
        gs.total_of([0, 1])
    with pytest.raises(ConfigError, match="member 1 carries 16 bytes, the group's members 20"):
        gs.progress(1, np.zeros(4, np.float32).view(np.uint8), 4)
    with pytest.raises(ConfigError, match="multiple of 4"):
        GroupSum(2, 10)
    with pytest.raises(ConfigError, match="fan_in=0"):
        GroupSum(0, 8)


# -- route_groups: the planner applied to a policy's plan -------------------------------

MB = 1_000_000


def _snapshot(pending, aggregators, down_server=12.5 * MB, now=0.0, active=()):
    net = Network(default=125 * MB, down={"s": down_server})
    return Snapshot(now=now, version=0, tau_max=None, pending=tuple(pending),
                    active=tuple(active), network=net, aggregators=aggregators)


def _transfers(n, size=2 * MB):
    return [Transfer(i + 1, "owner", i, f"w{i}", "s", size, 0, 1.0, 0.0) for i in range(n)]


def _back_to_back(ts, snap):
    """A plan that sends into s one after another (what the core does when
    the server's downlink is the bottleneck)."""
    t, items = snap.now, []
    for pos, tr in enumerate(ts):
        d = tr.nbytes / snap.network.rate(tr.host, tr.dst)
        items.append(PlanItem(tr.id, start=t, position=pos, planned_seconds=d))
        t += d
    return items


def test_route_groups_sends_the_positions_behind_the_first_through_the_aggregator():
    ts = _transfers(5)
    snap = _snapshot(ts, {"a": "10.0.0.9:7401"})
    items, groups = route_groups(snap, _back_to_back(ts, snap))
    # Position 0 goes straight in (0.16 s on the 100 Mbit/s downlink); while it
    # does, positions 1-4 reach the 1 Gbit/s aggregator (4 x 2 MB in 0.064 s)
    # and are summed: one forward of 0.16 s instead of four.
    assert [g.ids for g in groups] == [(2, 3, 4, 5)]
    assert items[0] == _back_to_back(ts, snap)[0]
    for index, item in enumerate(items[1:]):
        assert item.start == 0.0 and item.route == Route("a", "10.0.0.9:7401", 2, 4, index)
        assert item.planned_seconds == pytest.approx(0.32)  # D_0 + one forward
        assert item.position == index + 1
    # A restarted controller's epoch keeps its group ids apart from earlier ones.
    items, _ = route_groups(snap, _back_to_back(ts, snap), epoch=5)
    assert {i.route.group for i in items[1:]} == {(5 << 32) | 2}


def test_a_grouped_transfer_goes_whole_whatever_form_the_policy_chose():
    """An aggregator sums whole updates, and the group was planned at its
    members' whole sizes: a member the policy planned compressed (issue 35's
    adaptive choice) goes whole; one that goes straight keeps its form."""
    ts = _transfers(5)
    snap = _snapshot(ts, {"a": "10.0.0.9:7401"})
    plan = [item._replace(codec="fp16") for item in _back_to_back(ts, snap)]
    items, groups = route_groups(snap, plan)
    assert [g.ids for g in groups] == [(2, 3, 4, 5)]
    assert [(i.route is not None, i.codec) for i in items] == \
        [(False, "fp16")] + [(True, None)] * 4


def test_route_groups_forms_no_group_that_would_not_pay_or_without_aggregators():
    ts = _transfers(4)
    plan = _back_to_back(ts, _snapshot(ts, {}))
    assert route_groups(_snapshot(ts, {}), plan) == (plan, [])
    # An aggregator whose forward is no faster than the direct transfers:
    # the server's downlink is not the bottleneck (every link 1 Gbit/s).
    snap = _snapshot(ts, {"a": "x:1"}, down_server=125 * MB)
    plan = _back_to_back(ts, snap)
    assert route_groups(snap, plan) == (plan, [])


def test_route_groups_keeps_drops_and_ignores_other_servers_singletons():
    ts = _transfers(3)
    ts[2].dst = "s2"
    snap = _snapshot(ts, {"a": "x:1"})
    plan = [PlanItem(1, start=0.0, position=0, planned_seconds=0.16),
            PlanItem(2, drop="deadline_missed", detail="at position 1"),
            PlanItem(3, start=0.0, position=0, planned_seconds=0.016)]
    assert route_groups(snap, plan) == (plan, [])


def test_route_groups_routes_an_update_dropped_in_overload_through_the_aggregate():
    ts = _transfers(5)
    for t in ts:
        t.base_version = 3  # positions 0-3 at versions 4-7: within tau_max 4
    snap = replace(_snapshot(ts, {"a": "10.0.0.9:7401"}), version=4, tau_max=4)
    plan = [*_back_to_back(ts[:4], snap),
            PlanItem(5, drop="stalest_in_overload", detail="base version 3")]
    without = route_groups(snap, plan)
    assert without[0][4] == plan[4] and [g.ids for g in without[1]] == [(2, 3, 4)]
    items, groups = route_groups(snap, plan, AggregationConfig(rescue=True))
    assert [(g.ids, g.rescued) for g in groups] == [((2, 3, 4, 5), 1)]
    assert items[4].drop is None and items[4].start == 0.0
    assert items[4].route == Route("a", "10.0.0.9:7401", 2, 4, 3)
    # A drop for a missed deadline stays a drop.
    missed = [*plan[:4], PlanItem(5, drop="deadline_missed", detail="at position 4")]
    assert route_groups(snap, missed, AggregationConfig(rescue=True))[0][4] == missed[4]


def test_benched_and_unreachable_aggregators_are_not_offered():
    state = ControlState(lambda snap: [], tau_max=None)
    state.aggregators = {"a": "x:1", "b": "y:1", "c": "z:1"}
    state.add_agent("c", "z:7400")  # its agent was never reached
    state.aggregator_failed("a", now=5.0)
    assert state.snapshot(now=6.0).aggregators == {"b": "y:1"}
    assert state.snapshot(now=15.0).aggregators == {"a": "x:1", "b": "y:1"}
    state.agent_reported("c", now=15.0, peers=1, fresh=1)
    assert set(state.snapshot(now=15.0).aggregators) == {"a", "b", "c"}


def test_holding_keeps_a_growing_last_group_pending_until_its_latest_start():
    """Requests arrive one at a time; with `hold` a group that could still
    take members waits (re-planned at its latest start less the guard, or at
    the next request); a full group, or one without slack, goes at once."""
    ts = _transfers(4)
    snap = _snapshot(ts, {"a": "x:1"})
    busy = [PlanItem(ts[0].id, start=0.0, position=0, planned_seconds=0.16)]
    later = busy + _back_to_back(ts[1:], replace(snap, now=0.16))
    items, groups = route_groups(replace(snap, pending=tuple(ts)), later,
                                 AggregationConfig(hold=False))
    assert [g.ids for g in groups] == [(2, 3, 4)]
    items, groups = route_groups(replace(snap, pending=tuple(ts)), later,
                                 AggregationConfig(hold=True, hold_guard=0.05))
    assert groups == []
    # ready at 3 x 2 MB / 125 MB/s + 6 MB / 2 GB/s = 0.051 s, needed at 0.16 s
    assert [i.start for i in items[1:]] == [pytest.approx(0.16 - 0.051 - 0.05)] * 3
    assert all(i.route is None for i in items)
    # Full at max_fan_in: it goes now.
    items, groups = route_groups(replace(snap, pending=tuple(ts)), later,
                                 AggregationConfig(hold=True, max_fan_in=3))
    assert [g.ids for g in groups] == [(2, 3, 4)]
    assert all(i.start == 0.0 for i in items)


def test_a_group_wait_holds_the_last_group_and_a_lone_update_for_company():
    """With a wait, the last group is held until `wait` after its oldest
    member asked, though the server's downlink is free, and then goes with
    the server waiting for its aggregate; a lone update is held likewise."""
    ts = [replace(t, arrival=a) for t, a in zip(_transfers(3), (0.0, 0.1, 0.2), strict=True)]
    snap = _snapshot(ts, {"a": "x:1"}, now=0.25)
    plan = _back_to_back(ts, snap)  # the downlink is free: the first would go now
    # Without a wait the first goes straight in at once; the two behind it are
    # held until their latest start, as they can be summed while it goes.
    items, groups = route_groups(snap, plan, AggregationConfig(hold=True))
    assert groups == [] and items[0] == plan[0] and items[0].start == 0.25
    # With a 0.5 s wait all three wait until 0.5 s (0.0 + 0.5) for more members.
    config = AggregationConfig(hold=True, wait=0.5)
    items, groups = route_groups(snap, plan, config)
    assert groups == []
    assert [i.start for i in items] == [0.5] * 3 and all(i.route is None for i in items)
    # At 0.5 s they go as one group: 3 x 2 MB reach a (1 Gbit/s) in 0.048 s,
    # summed in 0.003 s; the downlink waits that long, then takes one 0.16 s forward.
    later = replace(snap, now=0.5)
    items, groups = route_groups(later, _back_to_back(ts, later), config)
    assert [g.ids for g in groups] == [(1, 2, 3)]
    assert [i.start for i in items] == [0.5] * 3
    assert [i.route.index for i in items] == [0, 1, 2]
    assert items[0].planned_seconds == pytest.approx(0.048 + 0.003 + 0.16)
    # A lone update waits for company until 0.5 s too; then it goes, alone.
    lone = _snapshot(ts[:1], {"a": "x:1"}, now=0.25)
    (item,), _ = route_groups(lone, _back_to_back(ts[:1], lone), config)
    assert item.start == 0.5 and item.route is None
    lone = replace(lone, now=0.5)
    assert route_groups(lone, _back_to_back(ts[:1], lone), config) == (
        _back_to_back(ts[:1], lone), [])
    # Without holding, nothing is held back; the downlink still waits for the
    # aggregate formed now.
    items, groups = route_groups(snap, plan, AggregationConfig(hold=False, wait=0.5))
    assert [g.ids for g in groups] == [(1, 2, 3)] and [i.start for i in items] == [0.25] * 3


def test_with_shards_each_shards_parts_form_groups_of_their_own_on_their_best_aggregator():
    """The controller plans each shard's transfers on their own, so a group
    never mixes shards. Groups for two shards form at once, each on the
    aggregator with the fastest forward into its shard's server (a is slow
    to s1, b to s0), and each shard's order starts with a transfer straight
    into its server: the never-stall rule holds per shard link."""
    from mlfabric.controller.state import Go
    from mlfabric.scheduling.aggregation import aggregating
    from mlfabric.scheduling.policies import mlfabric_policy

    net = Network(default=125 * MB, down={"s0": 12.5 * MB, "s1": 12.5 * MB},
                  pair={("a", "s1"): 5 * MB, ("b", "s0"): 5 * MB})
    state = ControlState(aggregating(mlfabric_policy, AggregationConfig(hold=False)),
                         tau_max=None, network=net)
    state.aggregators = {"a": "10.0.0.1:7401", "b": "10.0.0.2:7401"}
    for w in range(5):
        for shard in (0, 1):
            state.request(f"c{w}", shard, host=f"w{w}", dst=f"s{shard}", nbytes=2 * MB,
                          base_version=0, norm=1.0, now=0.0, shard=shard)
    decided = state.decide(0.0)
    assert decided.wake_at is None and not state.pending
    goes = [a for a in decided.actions if isinstance(a, Go)]
    assert len(goes) == 10
    for shard, aggregator in ((0, "a"), (1, "b")):
        mine = sorted((g for g in goes if g.transfer.shard == shard), key=lambda g: g.position)
        assert [g.position for g in mine] == [0, 1, 2, 3, 4]
        assert mine[0].route is None and mine[0].planned_seconds == pytest.approx(0.16)
        routes = [g.route for g in mine[1:]]
        assert {r.host for r in routes} == {aggregator}
        assert {r.group for r in routes} == {mine[1].transfer.id}
        assert [r.index for r in routes] == [0, 1, 2, 3] and {r.fan_in for r in routes} == {4}
        # One forward of 2 MB at 12.5 MB/s behind the direct one: 0.32 s.
        assert [g.planned_seconds for g in mine[1:]] == [pytest.approx(0.32)] * 4


def test_a_chunked_transfer_goes_whole_through_an_aggregator_and_never_joins_one_in_part():
    """An aggregate is one frame: a chunked transfer routed through an
    aggregator is let go whole (no `upto`). One whose first chunk went
    straight to the server goes on alone, whatever groups form around it."""
    from mlfabric.controller.state import Go
    from mlfabric.scheduling.aggregation import aggregating
    from mlfabric.scheduling.policies import mlfabric_policy

    state = ControlState(aggregating(mlfabric_policy, AggregationConfig(hold=False)),
                         tau_max=None, network=Network(default=125 * MB, down={"s": 12.5 * MB}))
    state.aggregators = {"a": "10.0.0.1:7401"}

    def ask(w, now):
        state.request(f"c{w}", w, host=f"w{w}", dst="s", nbytes=2 * MB, base_version=0,
                      norm=1.0, now=now, shard=1, chunk=MB)

    for w in range(5):
        ask(w, 0.0)
    goes = {a.transfer.host: a for a in state.decide(0.0).actions if isinstance(a, Go)}
    first = goes.pop("w0")
    assert first.route is None and first.upto == MB  # straight in, a chunk at a time
    assert {g.route.host for g in goes.values()} == {"a"}
    assert {g.upto for g in goes.values()} == {None}  # whole, through the aggregator
    # w0's first chunk has left; three more workers ask meanwhile.
    state.progress("c0", 0, sent=MB, now=0.08)
    for w in range(5, 8):
        ask(w, 0.08)
    decided = state.decide(0.08)
    goes = {a.transfer.host: a for a in decided.actions if isinstance(a, Go)}
    assert {g.route.host for g in goes.values()} == {"a"} and set(goes) == {"w5", "w6", "w7"}
    # The rest of w0 is planned behind the aggregates; once they are in, it
    # goes, alone.
    assert decided.wake_at is not None
    for w in range(1, 8):
        state.done(f"c{w}", w, version=w, now=0.5)
    (rest,) = [a for a in state.decide(0.5).actions if isinstance(a, Go)]
    assert rest.transfer.host == "w0" and rest.route is None and rest.upto == 2 * MB
