"""Grouping the order for aggregation (pure) and the definition of applying an aggregate."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.aggregation import (
    AggregationConfig,
    Group,
    Links,
    Slot,
    apply_aggregate,
    direct_delivery,
    plan_groups,
)
from mlfabric.errors import ConfigError

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
                               max_fan_in=draw(st.integers(3, 6)), sum_rate=1e3)
    return order, Links(up, down, pair), now, ready, aggs, config


@settings(max_examples=300, deadline=None)
@given(cases())
def test_groups_keep_the_order_never_stall_the_server_and_pay(case):
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
            # the constraint: ready at the aggregator before the server is free
            assert g.ready <= done + TOL
            fwd = members[0].size / links.rate(g.aggregator, "s")
            assert fwd < sum(m.size / links.rate(m.source, "s") for m in members)
            assert g.delivered == pytest.approx(done + fwd)
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


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="need 2 <= min_fan_in <= max_fan_in, got 3 and 2"):
        AggregationConfig(min_fan_in=3, max_fan_in=2)
    with pytest.raises(ConfigError, match="sum_rate must be positive bytes/s, got 0"):
        AggregationConfig(sum_rate=0)
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


