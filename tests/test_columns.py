"""The controller's plan from columns kept between events equals the plan
built from scratch, event after event (issue 34's incremental planning)."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest

from mlfabric.controller.state import ControlState, Drop, Go
from mlfabric.scheduling import schedule
from mlfabric.scheduling.columns import ActiveTransfers, PendingColumns
from mlfabric.scheduling.plan import Network, Route, Transfer, with_estimates, with_host_load
from mlfabric.scheduling.policies import PLAN_AHEAD, Mlfabric, mlfabric_policy

MB = 1e6

pytestmark = pytest.mark.skipif(not schedule.has_kernel(),
                                reason="the column planner needs the compiled core")


def _action(a: Go | Drop) -> tuple:
    if isinstance(a, Go):
        return ("go", a.transfer.id, a.position, a.planned_seconds, a.upto, a.first)
    return ("drop", a.transfer.id, a.reason, a.detail)


def _full_plan(state: ControlState, now: float) -> list:
    """Every item of the plan (not only those due now) of a one-server job."""
    return list(state.policy(state.snapshot(now)))


class _Twins:
    """Two controllers fed the same events: one plans from scratch
    (`mlfabric_policy`), one from its columns (`Mlfabric`)."""

    def __init__(self, rng: random.Random, *, shards: int, guard: bool, learn: bool,
                 tau_max: int | None, idle_factor: float | None, overload: str,
                 plan_ahead: int = PLAN_AHEAD) -> None:
        def scratch(snap):
            return mlfabric_policy(snap, idle_factor=idle_factor, overload=overload)

        net = Network(default=100 * MB, up={"h3": 20 * MB},
                      down={f"s{k}": (40 + 20 * k) * MB for k in range(shards)})
        self.both = [ControlState(policy, tau_max=tau_max, network=net, guard_order=guard,
                                  learn_rates=learn)
                     for policy in (scratch, Mlfabric(idle_factor=idle_factor,
                                                      overload=overload, plan_ahead=plan_ahead))]
        self.whole = plan_ahead == 0 or plan_ahead >= 1000  # (never more pending here)
        self.rng, self.shards, self.now, self.req = rng, shards, 0.0, 0
        self.decisions = 0

    def _each(self, name: str, *args, **kwargs) -> list:
        return [getattr(s, name)(*args, **kwargs) for s in self.both]

    def step(self) -> None:
        rng, a = self.rng, self.both[0]
        self.now += rng.choice([0.0, 0.001, 0.01, 0.05, 0.2])
        kind = rng.random()
        if kind < 0.45:
            self.req += 1
            shard = rng.randrange(self.shards)
            owner = f"w{rng.randrange(10)}"
            version = a.shard_versions.get(shard, 0)
            self._each("request", owner, self.req, host=f"h{rng.randrange(6)}",
                       dst=f"s{shard}", nbytes=rng.choice([1, 2, 3, 8]) * 1_000_000,
                       base_version=max(0, version - rng.randrange(8)), norm=1.0, now=self.now,
                       shard=shard, chunk=rng.choice([0, 0, 0, 1 << 20]))
        elif kind < 0.70 and a.active:
            t = rng.choice(sorted(a.active.values(), key=lambda t: t.id))
            version = a.shard_versions.get(t.shard, 0) + 1
            seconds = rng.choice([None, 0.05, 0.2, 1.0])
            done = self._each("done", t.owner, t.req, version=version,
                              applied=rng.random() < 0.9, delay=1, now=self.now,
                              seconds=seconds)
            assert (done[0] is None) == (done[1] is None)
        elif kind < 0.78 and a.active:
            t = rng.choice(sorted(a.active.values(), key=lambda t: t.id))
            if t.chunk:
                sent = rng.choice([t.granted, t.nbytes])
                self._each("progress", t.owner, t.req, sent=sent, now=self.now)
        elif kind < 0.84:
            host = f"h{rng.randrange(6)}"
            net = a.network
            draw = rng.random()
            if draw < 0.15:  # several controllers: this one's part of the uplinks changes
                net = dataclasses.replace(net, up_share=rng.choice([1.0, 0.5, 0.25]))
            elif draw < 0.55:
                net = with_host_load(net, host, down=rng.choice([-1.0, 30 * MB]),
                                     up=rng.choice([-1.0, 10 * MB, 95 * MB]))
            else:
                dst = f"s{rng.randrange(self.shards)}"
                net = with_estimates(net, host, {dst: (rng.choice([15, 60]) * MB,
                                                       rng.random() < 0.3)})
            self._each("set_network", net)
        elif kind < 0.87:
            self._each("forget", f"w{rng.randrange(10)}", self.now)
        self.decide()

    def decide(self) -> None:
        a, b = self.both
        if self.shards == 1 and a.pending:
            assert _full_plan(b, self.now) == _full_plan(a, self.now)
        da, db = self._each("decide", self.now)
        assert [_action(x) for x in db.actions] == [_action(x) for x in da.actions]
        if self.whole:
            assert db.wake_at == da.wake_at
        elif da.wake_at is not None:  # a plan stopped early looks again no later
            assert db.wake_at is not None and db.wake_at <= da.wake_at
        assert sorted(b.pending) == sorted(a.pending)
        self.decisions += bool(da.actions)


@pytest.mark.parametrize("seed", range(24))
def test_the_plan_from_columns_equals_the_plan_from_scratch(seed):
    rng = random.Random(seed)
    twins = _Twins(rng, shards=1 if seed % 3 else 3, guard=seed % 2 == 0, learn=seed % 4 < 2,
                   tau_max=rng.choice([None, 3, 6, 20]),
                   idle_factor=rng.choice([None, 1.0, 0.5]),
                   overload=rng.choice(["stalest", "deadline"]))
    for _ in range(150):
        twins.step()
    assert twins.decisions > 10  # the runs decide things, not only wait


@pytest.mark.parametrize("seed", range(16))
def test_a_plan_stopped_once_nothing_more_can_start_decides_as_the_whole_plan(seed):
    """Without deadlines that could pass in the plan, a plan that stops
    after `plan_ahead` positions once nothing left can start now lets go
    exactly what the whole plan lets go (the full plans are compared on
    the kernel's own arrays below)."""
    rng = random.Random(seed)
    twins = _Twins(rng, shards=1 if seed % 3 else 3, guard=seed % 2 == 0, learn=seed % 4 < 2,
                   tau_max=rng.choice([None, 10_000]), idle_factor=1.0, overload="stalest",
                   plan_ahead=rng.choice([1, 2, 4]))
    for _ in range(150):
        twins.step()
    assert twins.decisions > 10


def test_a_full_plan_from_columns_equals_the_policy_on_its_snapshot():
    """Every item, not only those due: 300 pending over 40 hosts, three of
    them sending, measured pair rates and other tenants' load."""
    rng = random.Random(7)
    net = Network(default=100 * MB, up={f"h{k}": (10 + k) * MB for k in range(40)},
                  down={"s": 300 * MB}, pair={("h1", "s"): 5 * MB, ("h2", "s"): 50 * MB},
                  load_down={"s": 100 * MB}, observed_up={"h5": 3 * MB})
    state = ControlState(Mlfabric(), tau_max=120, network=net)
    for i in range(300):
        state.request(f"w{i}", i, host=f"h{rng.randrange(40)}", dst="s",
                      nbytes=rng.randrange(1, 30) * 1_000_000,
                      base_version=rng.randrange(100), norm=1.0, now=i * 1e-3)
    def both(now: float) -> list:
        snap = state.snapshot(now)
        columns = PendingColumns()
        for t in reversed(snap.pending):  # any row order: the plan ranks them
            columns.add(t)
        scratch = list(mlfabric_policy(snap))
        plan = Mlfabric().plan_columns(columns, columns.rows(None), now=now,
                                       version=snap.version, in_flight=snap.server_in_flight,
                                       tau_max=120,
                                       active=ActiveTransfers.of(snap.active, columns.hosts),
                                       network=net)
        assert plan is not None and list(plan) == scratch
        return scratch

    first = both(0.3)  # nothing sent yet: drops and later starts
    assert any(item.drop for item in first)
    state.decide(0.3)
    assert state.active and len(state.pending) > 100
    then = both(0.31)  # planned around the transfers under way
    assert any(item.start > 0.31 for item in then if item.drop is None)


def test_columns_follow_adds_and_removes():
    cols = PendingColumns()
    ts = [Transfer(i, "o", i, f"h{i % 3}", "s", 100 + i, i, 1.0, float(i), shard=i % 2)
          for i in range(1, 8)]
    for t in ts:
        cols.add(t)
    for tid in (3, 7, 1):
        cols.remove(tid)
    left = {int(i): k for k, i in enumerate(cols.ids[:len(cols)])}
    assert sorted(left) == [2, 4, 5, 6]
    for t in ts:
        if t.id in left:
            k = left[t.id]
            assert (cols.size[k], cols.base_version[k], cols.arrival[k], cols.shard[k]) == (
                t.nbytes, t.base_version, t.arrival, t.shard)
            assert cols.hosts.names[cols.src[k]] == t.host
    assert sorted(cols.ids[cols.rows(0)].tolist()) == [2, 4, 6]
    assert cols.shards() == [0, 1]  # 5 is shard 1's last
    cols.remove(5)
    assert cols.shards() == [0]
    with pytest.raises(ValueError, match="transfer 2 is pending already"):
        cols.add(ts[1])
    many = [Transfer(100 + i, "o", i, "h", "s", 1, 0, 1.0, 0.0) for i in range(200)]
    for t in many:  # grows past its first room
        cols.add(t)
    assert len(cols) == 203 and 150 in cols


@pytest.mark.parametrize("seed", range(8))
def test_active_columns_follow_every_change_a_transfer_goes_through(seed):
    """`ActiveTransfers` is a dictionary of the transfers let go whose
    columns say what each transfer's fields say, after transfers are let
    go, end, grow past their first room, and change in place (a chunked
    one's rest joining its chunk): each row against the transfer's own
    fields, the rows by id, the counts, and the rows that land as
    themselves (started, with a planned time, and whole)."""
    rng = random.Random(seed)
    active = ActiveTransfers()
    plain: dict[int, Transfer] = {}
    next_id = 1
    for _ in range(400):
        if plain and rng.random() < 0.4:
            tid = rng.choice(sorted(plain))
            if rng.random() < 0.3 and plain[tid].chunk:
                t = plain[tid]  # the rest follows the chunk under way
                t.piece, t.granted = t.piece + t.rest, t.nbytes
                t.planned_seconds = (t.planned_seconds or 0.0) + 0.1
                active[tid] = t
            else:
                del active[tid], plain[tid]
        else:
            chunk = rng.choice([0, 0, 400])
            t = Transfer(next_id, "o", next_id, f"h{rng.randrange(5)}", f"s{rng.randrange(3)}",
                         1000, rng.randrange(50), 1.0, 0.0, shard=rng.randrange(3),
                         started=rng.choice([None, 1.0, 2.5]),
                         planned_seconds=rng.choice([None, 0.0, 0.2]), chunk=chunk,
                         granted=chunk, piece=chunk,
                         route=None if rng.random() < 0.8 else Route(
                             host="agg", address="agg:1", group=1, fan_in=2, index=0))
            active[t.id] = plain[t.id] = t
            next_id += 1
        assert len(active) == len(plain) and dict(active.items()) == plain
        rows = active.by_id()
        assert active.ids[rows].tolist() == sorted(plain)
        for k, tid in zip(rows.tolist(), sorted(plain), strict=True):
            t = plain[tid]
            assert active.hosts.names[active.src[k]] == t.host
            assert active.hosts.names[active.dst[k]] == t.dst
            assert (active.shard[k], active.base_version[k], active.direct[k]) == (
                t.shard, t.base_version, t.route is None)
            assert active.planned[k] == (t.planned_seconds or 0.0)
            assert active.nbytes[k] == (t.piece if t.chunk and t.piece else t.nbytes)
            assert np.isnan(active.started[k]) == (t.started is None)
        assert [t.nbytes for t in active.planned_view()] == [
            plain[i].piece if plain[i].chunk else plain[i].nbytes for i in sorted(plain)]
        assert active.all_direct == all(t.route is None for t in plain.values())
        for shard in range(3):
            assert active.in_flight(shard) == sum(t.shard == shard for t in plain.values())
            end, ids, planned, base, direct = active.landing_rows(shard)
            want = sorted((t.started + t.planned_seconds, t.id, t.planned_seconds,
                           60 - t.base_version, t.route is None) for t in plain.values()
                          if t.shard == shard and t.started is not None and t.planned_seconds
                          and (not t.chunk or t.granted >= t.nbytes))
            got = sorted(zip(end.tolist(), ids.tolist(), planned.tolist(),
                             (60 - base).tolist(), direct.tolist(), strict=True))
            assert got == want
            one_by_one = (active.landing_row(t.id, 60) for t in plain.values()
                          if t.shard == shard)
            assert sorted(r for r in one_by_one if r is not None) == want
    with pytest.raises(ValueError, match="transfer 5 stored under id 6"):
        active[6] = Transfer(5, "o", 5, "h", "s", 1, 0, 1.0, 0.0)


@pytest.mark.parametrize("seed", range(24))
def test_rows_ranked_as_the_policy_ranks_transfers(seed):
    """PendingColumns.ranked against sorting the transfers by (base version,
    arrival, id): ties in base version and arrival, arrivals out of add
    order, removals that move rows, one shard's rows, and base versions
    spread too far to pack (the three-key sort)."""
    rng = random.Random(seed)
    spread = [3, 50, 1 << 61, 1 << 62][seed % 4]
    # Arrivals in add order (a later add never comes first by (arrival, id)),
    # or some out of it.
    in_order = seed % 3 != 0
    cols = PendingColumns()
    live: dict[int, Transfer] = {}
    # Both sides of PACKED_RANKING_FROM: the three-key sort and the packed one.
    for i in range(rng.randrange(1, 300) if seed % 2 else rng.randrange(3200, 4000)):
        t = Transfer(rng.randrange(1 << 40) * 1000 + i, "o", i, "h", "s", 1,
                     rng.randrange(-spread // 2, spread // 2 + 1), 1.0,
                     i * 0.5 if in_order or rng.random() < 0.7 else float(rng.randrange(20)),
                     shard=rng.randrange(2))
        cols.add(t)
        live[t.id] = t
        if rng.random() < 0.3:
            gone = rng.choice(sorted(live))
            cols.remove(gone)
            del live[gone]
    for shard in (None, 0, 1):
        rows = cols.rows(shard)
        want = [t.id for t in sorted(live.values(),
                                     key=lambda t: (t.base_version, t.arrival, t.id))
                if shard is None or t.shard == shard]
        assert cols.ids[cols.ranked(rows)].tolist() == want


def test_host_rates_equal_the_networks_own():
    cols = PendingColumns()
    for h in ("a", "b", "c", "s"):
        cols.hosts.index(h)
    net = Network(default=100 * MB, up={"a": 10 * MB}, down={"s": 50 * MB},
                  load_up={"b": 99 * MB}, load_down={"s": 20 * MB},
                  observed_up={"c": 7 * MB}, observed_down={"s": 40 * MB})
    up, down = cols.hosts.rates(net)
    assert up.tolist() == [net.up_rate(h) for h in ("a", "b", "c", "s")]
    assert down.tolist() == [net.down_rate(h) for h in ("a", "b", "c", "s")]
    cols.hosts.index("d")  # a new host under the same tables
    up, _ = cols.hosts.rates(net)
    assert up.tolist() == [net.up_rate(h) for h in ("a", "b", "c", "s", "d")]
    assert np.isfinite(up).all()
    other = dataclasses.replace(net, default=30 * MB)  # the same tables, another default
    up, down = cols.hosts.rates(other)
    assert up.tolist() == [other.up_rate(h) for h in ("a", "b", "c", "s", "d")]
    assert down.tolist() == [other.down_rate(h) for h in ("a", "b", "c", "s", "d")]


def test_host_rates_are_shared_read_only_and_a_host_without_rate_is_checked_per_plan():
    """The rates are kept until the network changes, so a plan cannot write
    into the next one's; a host at rate 0 that no pending transfer uses
    does not stop the plan, one that a transfer uses does (the core refuses
    it, and the snapshot planner then says which)."""
    net = Network(default=100 * MB, up={"idle": 0.0})
    cols = PendingColumns()
    for i, host in enumerate(("a", "b")):
        cols.add(Transfer(i, f"w{i}", 0, host, "s", nbytes=int(MB), base_version=0, norm=1.0,
                          arrival=0.0))
    cols.hosts.index("idle")
    up = cols.hosts.rates(net)[0]
    assert cols.hosts.rates(net)[0] is up  # kept, not computed again
    with pytest.raises(ValueError):
        up[0] = 1.0
    assert not cols.hosts.usable(net)
    none_running = ActiveTransfers(cols.hosts)
    plan = Mlfabric().plan_columns(cols, cols.rows(None), now=0.0, version=0, in_flight=0,
                                   tau_max=8, active=none_running, network=net)
    assert plan is not None and sorted(item.id for item in plan) == [0, 1]
    cols.add(Transfer(2, "w2", 0, "idle", "s", nbytes=int(MB), base_version=0, norm=1.0,
                      arrival=0.0))
    assert Mlfabric().plan_columns(cols, cols.rows(None), now=0.0, version=0, in_flight=0,
                                   tau_max=8, active=none_running, network=net) is None
    assert cols.hosts.usable(Network(default=100 * MB))


@pytest.mark.parametrize("seed", range(30))
def test_a_plan_that_stops_ahead_is_the_whole_plans_first_positions(seed):
    """PlanConfig.plan_ahead: the positions filled are the whole plan's, with
    the drops decided there; every send due now is among them; and what was
    left out starts no earlier than `unplanned_from`, after now."""
    rng = random.Random(seed)
    now, hosts, dests = 5.0, 12, rng.choice([1, 2])
    n = rng.randrange(5, 120)
    capacity = np.array([rng.choice([1.0, 2.0, 5.0]) for _ in range(hosts)]  # uplinks
                        + [rng.choice([4.0, 10.0]) for _ in range(hosts)], np.float64)
    up = np.array([rng.randrange(dests, hosts) for _ in range(n)], np.intp)
    down = np.array([hosts + rng.randrange(dests) for _ in range(n)], np.intp)
    rows = schedule.IndexedRows(
        np.array([rng.choice([1.0, 2.0, 3.0, 8.0]) for _ in range(n)]),
        np.array([rng.randrange(40) for _ in range(n)], np.int64), up, down,
        np.full(n, -1, np.intp), np.minimum(capacity[up], capacity[down]))
    # A transfer under way holds part of the first destination for a while.
    reserved = {hosts: ([now, now + 1.5], [capacity[hosts] / 2, capacity[hosts]],
                        [capacity[hosts] / 2, capacity[hosts]])}
    links = schedule.LinkSegments.of(now, capacity, reserved)
    tau = rng.choice([None, 8, 30])
    whole = schedule.plan_indexed(rows, links, ready=now, v_init=20,
                                  config=schedule.PlanConfig(tau_max=tau, overload="deadline"))
    ahead = rng.choice([1, 3, 10])
    part = schedule.plan_indexed(rows, links, ready=now, v_init=20, now=now,
                                 config=schedule.PlanConfig(tau_max=tau, overload="deadline",
                                                            plan_ahead=ahead))
    filled = len(part.send_row) + len(part.drop_row)
    if part.unplanned_from == math.inf:
        assert filled == n
    else:
        assert part.unplanned_from > now and filled < n
        assert len(part.send_row) >= ahead
    k = len(part.send_row)
    for column in ("send_row", "start", "rate", "end", "position"):
        assert np.asarray(getattr(part, column)).tolist() == \
            np.asarray(getattr(whole, column))[:k].tolist()
    drops = list(zip(whole.drop_row, whole.reason, whole.drop_position, strict=True))
    if part.unplanned_from < math.inf:  # it stopped before filling position k
        drops = [d for d in drops if d[2] < k]
    assert list(zip(part.drop_row, part.reason, part.drop_position, strict=True)) == drops
    due = {int(r) for r, s in zip(whole.send_row, whole.start, strict=True) if s <= now}
    assert due <= {int(r) for r in part.send_row}
    assert all(s >= part.unplanned_from for s in np.asarray(whole.start)[k:].tolist())
