"""The controller's bookkeeping and decisions, without I/O.

`ControlState` knows every transfer a job's workers asked for: pending (no
directive yet) or active (let go, not yet reported done), the newest server
version it has heard of, and the network picture. `decide(now)` asks the
policy for a plan over a snapshot of that state and turns it into actions
(`Go`, `Drop`) and the time it next needs to be asked (`wake_at`). The asyncio
controller only carries the actions out; tests drive this class with a fake
clock (the `now` arguments).
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from ..scheduling import observed
from ..scheduling.columns import ActiveTransfers, PendingColumns
from ..scheduling.plan import (
    ColumnPlan,
    Network,
    PlanItem,
    Policy,
    Route,
    Snapshot,
    Transfer,
)
from ..scheduling.policies import Mlfabric

# The smallest chunk a chunked transfer is let go in: each grant costs a
# round trip to the controller and a re-plan, so a peer's smaller chunk is
# planned as this one.
MIN_CHUNK = 256 * 1024
# Workers that disconnected, kept for `mlfabric status` (the newest).
GONE_KEPT = 32
# The hand-over (`ControlState.handover`) is the median of this many reports,
# each taken as at most MAX_HANDOVER seconds: a worker's own timing is its
# word, and a wrong one must not make long transfers trusted (policies.trusted).
HANDOVER_SAMPLES = 16
MAX_HANDOVER = 0.1
# Transfers the server reported landed, kept until their workers' reports
# time them (`ControlState.landed`): a worker that died before it could is
# forgotten once this many newer ones are kept.
LANDED_KEPT = 65536
# Transfer ids start below this (`first_id`), leaving 2^39 more before they
# reach 2^40, where the plans' ids for aggregates' forwards begin
# (`policies._running`).
MAX_FIRST_ID = 1 << 39


@dataclass(frozen=True)
class Go:
    """Let `transfer` go now, to be applied at `position` (it was planned to
    take `planned_seconds`), through the aggregator of `route` if set.
    A chunked transfer's go lets its data go up to byte `upto` (None: all);
    `first` is False for the grants after its first."""

    transfer: Transfer
    position: int
    planned_seconds: float
    route: Route | None = None
    upto: int | None = None
    first: bool = True
    codec: str | None = None  # go compressed by this of its worker's options
    # Let go beside a critical transfer: the worker sends at most this many
    # bytes/s (`observed.pace`; None: as TCP allows) for `pace_seconds`
    # (None: until the server's answer).
    pace: float | None = None
    pace_seconds: float | None = None
    # Transfers running into its server that would be refused as stale if
    # it landed before them: the server applies it only once they have
    # landed, waiting at most `after_seconds` (`RunningOrder.must_follow`).
    after: tuple[int, ...] | None = None
    after_seconds: float | None = None


@dataclass(frozen=True)
class Drop:
    """Tell the worker of `transfer` that its update is dropped: `reason` is
    one of `DROP_REASONS`, `detail` says why in words."""

    transfer: Transfer
    reason: str
    detail: str


@dataclass
class WorkerStats:
    """What one worker asked for and what became of it."""

    name: str
    host: str | None = None
    requests: int = 0
    sent: int = 0
    dropped: int = 0
    applied: int = 0
    refused: int = 0  # sent, but not applied by the server (stale)
    last_delay: int | None = None
    # What the worker reported when it came back after this controller did
    # not answer it (FellBack), since it connected: updates it sent straight
    # to the server, unscheduled, and the time without the controller.
    fell_back_updates: int = 0
    fell_back_seconds: float = 0.0
    client: str = ""  # the name in its hello (`name` adds its address)


@dataclass(frozen=True)
class GoneWorker:
    """A worker that disconnected after asking for transfers. It finished,
    died, or lost this controller; in the last case, with fallback "fifo", it
    sends straight to the server until it reconnects. The controller cannot
    tell which: `mlfabric status` says so."""

    name: str
    host: str | None
    requests: int
    gone_at: float | None  # clock time it disconnected


@dataclass
class ServerStats:
    """A parameter server as the controller knows it: from the transfers
    workers sent to it and the versions they reported back from it."""

    host: str
    version: int | None = None  # newest version reported after an apply there
    transfers: int = 0  # requested to it
    applied: int = 0
    refused: int = 0
    last_heard: float | None = None  # clock time of the last report from it


@dataclass
class AgentStats:
    """An agent the controller polls (--agent HOST=ADDR:PORT)."""

    host: str
    address: str
    reachable: bool = False
    last_report: float | None = None  # clock time of the last estimates read
    peers: int = 0  # peers in that report
    fresh: int = 0  # of which had a fresh estimate
    error: str = ""  # why the last poll failed, while unreachable


def _age(then: float | None, now: float | None) -> float | None:
    return None if then is None or now is None else max(0.0, now - then)


@dataclass
class DelayStats:
    count: int = 0
    total: float = 0.0
    squares: float = 0.0
    max: int = 0

    def add(self, delay: int) -> None:
        self.count += 1
        self.total += delay
        self.squares += delay * delay
        self.max = max(self.max, delay)

    def summary(self) -> dict[str, float | int]:
        if not self.count:
            return {"count": 0}
        mean = self.total / self.count
        return {"count": self.count, "mean": mean, "max": self.max,
                "std": math.sqrt(max(0.0, self.squares / self.count - mean * mean))}


@dataclass(frozen=True)
class Decisions:
    actions: tuple[Go | Drop, ...]
    wake_at: float | None  # ask again at this time (a planned start), if any


class _SharedAt(NamedTuple):
    """A server's downlink as a transfer alone on its uplink found it, once
    its decision was made (those let go with it count as much as those
    before): the rate the transfers into it were planned at, the closed
    loop's cap on it then, and how many transfers at its own planned rate
    that booking is (what `observed.SharedDownlink.completed` learns from)."""

    booked: float
    capped: float | None
    lanes: int

    @classmethod
    def of(cls, booked: float, capped: float | None, rate: float) -> _SharedAt:
        return cls(booked, capped, max(1, round(booked / rate)) if rate > 0 else 1)


def _planned_rate(t: Transfer) -> float:
    """The bytes/s of its links the plan gave transfer `t` let go."""
    return (t.piece if t.chunk and t.piece else t.nbytes) / t.planned_seconds \
        if t.planned_seconds else 0.0


def _planned(transfers: Iterable[Transfer]) -> tuple[Transfer, ...]:
    """Pending transfers as a policy plans them: a chunked transfer that
    waits for its next grant by what is left of it (the policies know
    nothing of chunks; `ActiveTransfers.planned_view` is the same for the
    active ones)."""
    return tuple(replace(t, nbytes=t.rest) if t.granted else t for t in transfers)


class ControlState:
    def __init__(self, policy: Policy, *, tau_max: int | None,
                 network: Network | None = None, guard_order: bool = False,
                 learn_rates: bool = False, first_id: int = 1) -> None:
        """`guard_order`: keep the order running transfers must land in
        (`observed.RunningOrder`): a transfer let go beside one that must
        land next names it for its server to wait for, and is paced if it
        could crowd it out. `learn_rates`:
        the job's own transfers correct the network picture (`observed`).
        The mlfabric policy plans with both; FIFO lets everything go at once
        by definition, so it runs without them. `first_id`: the first
        transfer's id, the next ones counting up from it (below
        MAX_FIRST_ID)."""
        if not 1 <= first_id < MAX_FIRST_ID:
            raise ValueError(f"first_id must be in [1, {MAX_FIRST_ID}), got {first_id}")
        self.policy = policy
        self.guard_order = guard_order
        self.learn_rates = learn_rates
        self.tau_max = tau_max
        self.network = network or Network()
        self.version = 0
        # A sharded job's servers keep their own versions: shard -> newest heard
        # of (shard 0 only, equal to `version`, for a job of one server).
        self.shard_versions: dict[int, int] = {}
        self._first_shard = 0  # the shard planned first next time (rotates)
        # A sharded job re-plans a shard only when something of its own
        # happened (see `decide`): the shards with news, each shard's next
        # planned start, and the network and aggregators the plans assumed.
        self._dirty: set[int] = set()
        self._shard_wake: dict[int, float] = {}
        self._planned_with: tuple[Network, dict[str, str]] | None = None
        self.chunks = True  # let chunked requests go a chunk at a time (else whole)
        self.shard_hosts: dict[int, str] = {}  # shard -> its server's host, from the requests
        self.pending: dict[int, Transfer] = {}
        # (owner, request id) -> the transfers asked for under it, pending or
        # active: a report finds its transfer without a pass over thousands.
        self._requests: dict[tuple[Hashable, int], list[int]] = {}
        # The same pending transfers as columns, kept between events for the
        # mlfabric policy (`Mlfabric.plan_columns`): changed only by `_pend`
        # and `_unpend`, as `pending` is.
        self._columns = PendingColumns() if isinstance(policy, Mlfabric) else None
        # The transfers let go, by id, with their columns kept as well (the
        # links they hold and the order they land in are read from them at
        # every decision), their hosts numbered as the pending ones'.
        self.active = ActiveTransfers(self._columns.hosts if self._columns is not None else None)
        # Which links the active transfers hold, for the closed loop: only a
        # transfer that had its uplink and downlink to itself from its go to
        # its report measures them (`_hold`, `_release`).
        self._holders: dict[tuple[str, str], int] = {}  # link -> active transfers on it
        self._starts: dict[tuple[str, str], int] = {}  # link -> transfers ever started on it
        self._held: set[int] = set()  # active transfers counted in _holders
        self._delivered = observed.Delivered()  # which link held an alone transfer back
        self._solo: dict[int, tuple[int, int]] = {}  # those alone when they went: their marks
        # Those alone on their uplink when they went, into a downlink others
        # shared: their uplink's mark, and the downlink as they found it
        # (`_SharedAt`, `observed.SharedDownlink`); and each downlink's rate
        # planned now, the sum of what the transfers holding it were planned at.
        self._shared = observed.SharedDownlink()
        self._up_solo: dict[int, tuple[int, _SharedAt]] = {}
        self._booked: dict[str, float] = {}
        self._rate_held: dict[int, float] = {}  # what each added to _booked
        self._handovers: deque[float] = deque(maxlen=HANDOVER_SAMPLES)  # see handover
        self._handover = 0.0
        self.workers: dict[Hashable, WorkerStats] = {}
        self.gone: OrderedDict[str, GoneWorker] = OrderedDict()  # by hello name, oldest first
        self.delays = DelayStats()
        self.servers: dict[str, ServerStats] = {}
        self.agents: dict[str, AgentStats] = {}
        # Replicas (worker-driven replication) register here: host -> a JSON-ready dict that
        # `mlfabric status` prints as one row (host, version, lag, ...).
        # The replicas `mlfabric status` lists: by host, or by shard index.
        self.replicas: dict[str | int, dict[str, object]] = {}
        # Aggregators (agents that sum updates): host -> address, and the
        # hosts benched after a failure: host -> until when.
        self.aggregators: dict[str, str] = {}
        self.benched: dict[str, float] = {}
        self.bench_seconds = 10.0
        self._next_id = first_id
        # (owner, request id) -> a transfer its server reported landed, with
        # what `_release` said of it, until its worker's report times it.
        self._landed: OrderedDict[tuple[Hashable, int],
                                  tuple[Transfer, bool, _SharedAt | None]] = \
            OrderedDict()

    def join(self, owner: Hashable, name: str, client: str = "") -> None:
        """A worker (or any peer) connected under `name` (`client`: the name
        in its hello; a worker that comes back is no longer gone)."""
        self.workers[owner] = WorkerStats(name, client=client)
        self.gone.pop(client or name, None)

    def fell_back(self, owner: Hashable, updates: int, seconds: float) -> None:
        """The worker came back after `seconds` without this controller in
        all since it connected, having sent `updates` straight to the server."""
        stats = self.workers.get(owner)
        if stats is not None:
            stats.fell_back_updates, stats.fell_back_seconds = updates, seconds

    # -- events ---------------------------------------------------------------

    def request(self, owner: Hashable, req: int, *, host: str, dst: str, nbytes: int,
                base_version: int, norm: float, now: float, shard: int = 0,
                chunk: int = 0, options: tuple[tuple[str, int, float], ...] = ()
                ) -> Transfer:
        """A worker asks to send an update. `chunk` > 0: it may be let go
        that many bytes at a time (at least `MIN_CHUNK`), so that shorter
        transfers can pass it between chunks. `options`: the compressed forms
        it can send instead, (codec, bytes, encode seconds) (the policy may
        choose one)."""
        chunk = max(chunk, MIN_CHUNK) if chunk > 0 and self.chunks else 0
        t = Transfer(self._next_id, owner, req, host, dst, nbytes, base_version, norm, now,
                     shard=shard, chunk=chunk if nbytes > chunk else 0, options=options)
        self._next_id += 1
        stats = self.workers.setdefault(owner, WorkerStats(str(owner)))
        stats.requests += 1
        stats.host = host
        self.servers.setdefault(dst, ServerStats(dst)).transfers += 1
        self._pend(t)
        self._requests.setdefault((owner, req), []).append(t.id)
        # A worker computed on base_version, so the server has reached it.
        self.version = max(self.version, base_version)
        self.shard_versions[shard] = max(self.shard_versions.get(shard, 0), base_version)
        self.shard_hosts[shard] = dst
        self._dirty.add(shard)
        return t

    def shard_at(self, shard: int, dst: str, version: int) -> None:
        """A client says shard `shard` is served at `dst`, at least at `version`."""
        self.shard_versions[shard] = max(self.shard_versions.get(shard, 0), version)
        self.shard_hosts[shard] = dst
        self._dirty.add(shard)

    def done(self, owner: Hashable, req: int, *, version: int, applied: bool = True,
             delay: int | None = None, now: float | None = None,
             via_failed: str | None = None, seconds: float | None = None
             ) -> Transfer | None:
        """An active transfer ended at the server (applied or not).
        `via_failed`: its aggregator failed it (it was then sent directly).
        `seconds`: from its go to the server's answer, as its worker timed it;
        with `learn_rates` it corrects the picture of its path at once.
        A pending one reported done was withdrawn by its worker (it waited
        past its push_timeout): forgotten, never let go. A chunked transfer
        waiting for its next grant has ended all the same (its link failed).
        One its server reported first (`landed`) is only timed now, and
        returned again with its `landed_at` set."""
        t = self._asked(owner, req, self.pending)
        if t is not None:
            self._unpend(t)
            self._dirty.add(t.shard)
            if not t.granted:
                self._ended(t)
                return None
            self.active[t.id] = t
        landed = self._landed.pop((owner, req), None)
        if landed is not None:  # the server reported it first: its worker's times it
            t, alone, shared = landed
            self._learn(t, alone, shared, seconds, now)
            return t
        t = self._asked(owner, req, self.active)
        if t is not None:
            alone, shared = self._finish(t, version, applied, delay, now)
            self._learn(t, alone, shared, seconds, now)
            if via_failed is not None and t.route is not None and now is not None:
                self.aggregator_failed(t.route.host, now)
            return t
        return None

    def landed(self, tid: int, *, shard: int, version: int, applied: bool,
               delay: int | None, now: float | None = None,
               base_version: int | None = None) -> Transfer | None:
        """The server's own report that the transfer with id `tid` (its
        ticket) was applied or refused at `version`, a message before its
        worker's could say so: its links and place are free now, and the
        controller knows the server's version that much sooner. Only a
        transfer straight to `shard`'s server, whole, is reported so (an
        aggregate lands as another transfer); anything else, or one already
        reported, is None; so is one whose `base_version` (the push's) is
        not the transfer's (a ticket of the controller that planned the
        shard before, repeating an id). Its worker's report (`done`) then
        only times it, for the closed loop; `t.landed_at` says when this
        one came."""
        t = self.active.get(tid)
        if (t is None or t.shard != shard or t.route is not None
                or (base_version is not None and base_version != t.base_version)
                or (t.chunk and t.granted < t.nbytes)):
            return None
        alone, shared = self._finish(t, version, applied, delay, now)
        t.landed_at = now
        self._landed[(t.owner, t.req)] = (t, alone, shared)
        while len(self._landed) > LANDED_KEPT:  # workers that never reported
            self._landed.popitem(last=False)
        return t

    def _finish(self, t: Transfer, version: int, applied: bool, delay: int | None,
                now: float | None) -> tuple[bool, _SharedAt | None]:
        """Active `t` ended at the server: no longer active, its links free,
        the versions and counts updated. Returns what `_release` says of it."""
        del self.active[t.id]
        self._ended(t)
        self._dirty.add(t.shard)
        alone, shared = self._release(t)
        self.version = max(self.version, version)
        self.shard_versions[t.shard] = max(self.shard_versions.get(t.shard, 0), version)
        server = self.servers.setdefault(t.dst, ServerStats(t.dst))
        server.version = max(server.version or 0, version)
        server.applied += applied
        server.refused += not applied
        server.last_heard = now if now is not None else server.last_heard
        stats = self.workers.get(t.owner)
        if applied and delay is not None:
            self.delays.add(delay)
        if stats is not None:
            stats.applied += applied
            stats.refused += not applied
            stats.last_delay = delay if applied else stats.last_delay
        return alone, shared

    def _learn(self, t: Transfer, alone: bool, shared: _SharedAt | None,
               seconds: float | None, now: float | None) -> None:
        """What `t`'s time, from its go to the server's answer as its worker
        timed it, says of its path (the closed loop) and of the hand-over."""
        if seconds is None:
            return
        if self.learn_rates and alone:
            self._observed(t, seconds)
        elif self.learn_rates and shared is not None and self._measures(t):
            assert t.planned_seconds
            self.network = self._shared.completed(
                self.network, t.host, t.dst, booked=shared.booked,
                planned_seconds=t.planned_seconds, seconds=seconds, capped=shared.capped,
                lanes=shared.lanes)
        if now is not None and t.started is not None:
            hops = now - t.started - seconds  # the go's way there, the report's back
            if math.isfinite(hops):
                self._handovers.append(min(max(hops, 0.0), MAX_HANDOVER))
                # (statistics, not numpy: on 16 numbers np.median cost
                # 0.1 ms of every report.)
                self._handover = 1.5 * statistics.median(self._handovers)

    def _asked(self, owner: Hashable, req: int, where: Mapping[int, Transfer]
               ) -> Transfer | None:
        """The transfer `owner` asked for as `req`, if it is in `where`
        (of two under the same request id, the first asked)."""
        for tid in self._requests.get((owner, req), ()):
            t = where.get(tid)
            if t is not None:
                return t
        return None

    def _ended(self, t: Transfer) -> None:
        """`t` is neither pending nor active any more, for good."""
        ids = self._requests.get((t.owner, t.req))
        if ids is not None and t.id in ids:
            ids.remove(t.id)
            if not ids:
                del self._requests[(t.owner, t.req)]

    def _pend(self, t: Transfer) -> None:
        """`t` waits for a decision (again, for a chunked one between grants)."""
        self.pending[t.id] = t
        if self._columns is not None:
            self._columns.add(t)

    def _unpend(self, t: Transfer) -> None:
        del self.pending[t.id]
        if self._columns is not None:
            self._columns.remove(t.id)

    @property
    def handover(self) -> float:
        """Seconds a transfer's successor waits past its end for its report
        and go when it waits: three messages (the server's answer to the
        worker, its report here, the go to the next worker). Measured as
        the median of the last reports' go-and-report time (a report's
        arrival less the go's, less the worker's own time from go to
        answer: two of the three messages), times 1.5. 0 until a transfer
        has been reported."""
        return self._handover

    def _hold(self, t: Transfer) -> None:
        """`t` goes: it holds its uplink and downlink until `_release`."""
        if t.id in self._held:
            return
        self._held.add(t.id)
        up, down = ("up", t.host), ("down", t.dst)
        up_alone = not self._holders.get(up)
        alone = up_alone and not self._holders.get(down)
        for link in (up, down):
            self._holders[link] = self._holders.get(link, 0) + 1
            self._starts[link] = self._starts.get(link, 0) + 1
        rate = self._rate_held[t.id] = _planned_rate(t)
        booked = self._booked[t.dst] = self._booked.get(t.dst, 0.0) + rate
        if alone:
            self._solo[t.id] = (self._starts[up], self._starts[down])
        if up_alone:  # (alone on both, and joined on the downlink later: shared)
            self._up_solo[t.id] = (self._starts[up], _SharedAt.of(
                booked, self.network.observed_down.get(t.dst), rate))

    def _release(self, t: Transfer) -> tuple[bool, _SharedAt | None]:
        """`t` no longer holds its links; returns whether it had them to
        itself from its go until now (nothing else on them when it went,
        nothing started on them since). Only then does its time measure
        them: a transfer sharing a link gets what TCP gives it beside the
        others, not the plan's share. Learnt from shared transfers, the
        controller capped workers' uplinks for the server downlink's share:
        at 1,000 simulated workers it dropped 18% of the pushes (16 before).
        And, if it had only its uplink to itself, the downlink's rate
        booked when it went, the cap the closed loop had on that downlink
        then, and that booking's width in transfers at its rate
        (`_SharedAt`); else None."""
        if t.id not in self._held:
            return False, None
        self._held.discard(t.id)
        alone = self._alone(t)
        self._solo.pop(t.id, None)
        up, down = ("up", t.host), ("down", t.dst)
        for link in (up, down):
            left = self._holders[link] - 1
            if left:
                self._holders[link] = left
            else:
                del self._holders[link]
        rate = self._rate_held.pop(t.id)
        if down in self._holders:
            self._booked[t.dst] -= rate
        else:
            self._booked.pop(t.dst, None)  # (no rounding left over)
        mark = self._up_solo.pop(t.id, None)
        return alone, mark[1] if mark is not None and mark[0] == self._starts[up] else None

    def _alone(self, t: Transfer) -> bool:
        mark = self._solo.get(t.id)
        return mark is not None and mark == (self._starts[("up", t.host)],
                                             self._starts[("down", t.dst)])

    @staticmethod
    def _measures(t: Transfer) -> bool:
        """Whether `t`'s time can measure its path: only a transfer sent
        whole and direct (a chunk's report times the whole update, and an
        aggregated one times the aggregate's forward), with a planned time."""
        return (not t.chunk and t.route is None and t.path_rate is not None
                and bool(t.planned_seconds) and t.started is not None)

    def _observed(self, t: Transfer, seconds: float) -> None:
        """Correct the network picture by what `t` took (if it `_measures`)."""
        if not self._measures(t):
            return
        assert t.path_rate is not None and t.planned_seconds
        self.network = self._delivered.completed(
            self.network, t.host, t.dst, believed=t.path_rate,
            planned_seconds=t.planned_seconds, seconds=seconds)

    def _overdue(self, now: float) -> float | None:
        """Cap the links of transfers running alone on them past their
        planned time (see `observed.overdue`, `_release`); returns the next
        planned end (plus its guard) of one not yet overdue, when a re-plan
        should look again."""
        later = math.inf
        shared = [tid for tid in self._solo
                  if tid not in self.active or not self._alone(self.active[tid])]
        for tid in shared:  # (shared now, for good: what TCP gives it beside the others)
            del self._solo[tid]
        for tid in self._solo:
            t = self.active[tid]
            if not self._measures(t):
                continue
            assert t.started is not None and t.path_rate is not None and t.planned_seconds
            # (One expression for the test and the wake time: a wake-up at
            # exactly `due` must find the transfer overdue, not wake again.)
            due = t.started + t.planned_seconds + observed.order_guard(t.planned_seconds)
            if now >= due:
                self.network = observed.overdue(self.network, t.host, t.dst,
                                                believed=t.path_rate,
                                                planned_seconds=t.planned_seconds,
                                                elapsed=now - t.started)
            else:
                later = min(later, due)
        return None if later == math.inf else later

    def critical(self, shard: int, now: float | None = None) -> list[tuple[float, float]]:
        """(planned end, planned seconds) of the running transfers to `shard`
        that must land next or be refused as stale: their staleness when
        they land in planned order (the version now, plus the ones planned to
        land before them) is tau_max already. A transfer past its planned
        end and its guard at `now` has no planned place left: every other
        running transfer may land before it, and it counts them all. (At
        1,000 simulated workers, after an unannounced halving of the
        server's downlink that no transfer alone could show, transfers
        planned for 17 ms took 60-160, and 10 in 4,000 were refused as stale
        after others overtook them; with this rule 6.)"""
        order = self._running_order(shard, now)
        return [] if order is None else order.critical()

    def _running_order(self, shard: int, now: float | None,
                       joining: Sequence[Transfer] | None = None
                       ) -> observed.RunningOrder | None:
        """The running transfers to `shard` as `critical` orders them (None
        without a staleness bound). With `joining` (the transfers a decision
        may let go beside them), None also when the order has nothing to
        guard within the decision (`observed.order_matters`)."""
        if self.tau_max is None:
            return None
        version = self.shard_versions.get(shard, self.version)
        end, ids, planned, base_version, direct = self.active.landing_rows(shard)
        stale = version - base_version
        if joining is not None and not observed.order_matters(
                stale, [version - t.base_version for t in joining if t.shard == shard],
                self.tau_max):
            return None
        return observed.RunningOrder.of_columns(end, ids, planned, stale, direct, now=now,
                                                tau_max=self.tau_max)

    def progress(self, owner: Hashable, req: int, *, sent: int, now: float
                 ) -> Transfer | None:
        """The first `sent` bytes of a chunked transfer have left. Short of
        all of it, it no longer holds its links, and what is left of it is
        planned again with the pending transfers (a shorter one may pass it
        now). All of it (the worker could not wait for the grants): it is
        active until done. Returns the transfer if the plan changes."""
        t = self._asked(owner, req, self.active) or self._asked(owner, req, self.pending)
        if t is None or not t.chunk or t.granted >= t.nbytes:
            return None
        self._dirty.add(t.shard)
        if sent >= t.nbytes:
            rate = self.network.rate(t.host, t.dst)
            if t.id in self.pending:  # between two grants
                self._unpend(t)
                t.started, t.piece = now, t.rest
                t.planned_seconds = t.rest / rate
                self._hold(t)
            else:  # during one: the rest follows the chunk under way
                t.piece += t.rest
                t.planned_seconds = (t.planned_seconds or 0.0) + t.rest / rate
            t.granted = t.nbytes
            self.active[t.id] = t  # (active again, or its row as it is now)
            return t
        if t.id not in self.active or sent < t.granted:
            return None  # a report of a chunk already planned again
        del self.active[t.id]
        self._release(t)
        self._pend(t)
        return t

    def forget(self, owner: Hashable, now: float | None = None) -> list[Transfer]:
        """The owner is gone: its transfers, pending or active, are forgotten.
        A worker that asked for any is listed as gone (at `now`)."""
        gone = [t for t in (*self.pending.values(), *self.active.values()) if t.owner == owner]
        for t in gone:
            self._dirty.add(t.shard)
            self._ended(t)
            if t.id in self.pending:
                self._unpend(t)
            if self.active.pop(t.id, None) is not None:
                self._release(t)
        for asked in [asked for asked in self._landed if asked[0] == owner]:
            del self._landed[asked]  # its report will not come
        stats = self.workers.pop(owner, None)
        if stats is not None and stats.requests:  # not a status request, nor a replica
            key = stats.client or stats.name
            self.gone.pop(key, None)
            self.gone[key] = GoneWorker(stats.name, stats.host, stats.requests, now)
            while len(self.gone) > GONE_KEPT:
                self.gone.popitem(last=False)
        return gone

    def touch(self, shard: int | None = None) -> None:
        """Something outside the transfers changed what `shard`'s plan may
        do (its divergence gate, its replica, a failover; None: every
        shard): plan it again at the next decision (see `decide`)."""
        if shard is None:
            self._planned_with = None
        else:
            self._dirty.add(shard)

    def aggregator_failed(self, host: str, now: float) -> None:
        """Route nothing through `host` for `bench_seconds`."""
        self.benched[host] = now + self.bench_seconds

    def usable_aggregators(self, now: float) -> dict[str, str]:
        """Aggregators neither benched nor on a host whose agent is unreachable."""
        return {h: a for h, a in self.aggregators.items()
                if self.benched.get(h, -math.inf) <= now
                and (h not in self.agents or self.agents[h].reachable)}

    def set_network(self, network: Network) -> None:
        self.network = network

    def add_agent(self, host: str, address: str) -> None:
        self.agents[host] = AgentStats(host, address)

    def agent_reported(self, host: str, *, now: float, peers: int, fresh: int) -> None:
        a = self.agents[host]
        a.reachable, a.last_report, a.peers, a.fresh, a.error = True, now, peers, fresh, ""

    def agent_unreachable(self, host: str, error: str) -> None:
        a = self.agents[host]
        a.reachable, a.error = False, error

    # -- decisions ------------------------------------------------------------

    def snapshot(self, now: float) -> Snapshot:
        return Snapshot(
            now=now,
            version=self.version,
            tau_max=self.tau_max,
            pending=_planned(sorted(self.pending.values(), key=lambda t: t.id)),
            active=self._active(),
            network=self.network,
            aggregators=self.usable_aggregators(now),
            handover=self.handover,
        )

    def decide(self, now: float, on_action: Callable[[Go | Drop], None] | None = None
               ) -> Decisions:
        """Ask the policy, and commit what is due now: transfers whose start
        has come are let go, drops are final. Later starts are re-planned at
        `wake_at` (or earlier, at the next event).

        With `on_action`, each action is also handed to it the moment it is
        committed, in the order the result lists them: the controller sends
        each go then, so a decision that lets a round of a link go has its
        first transfers on their way while it commits the rest. The
        transfers of a round of the server's link end together, and their
        landings are answered by one decision that lets the next round go;
        sent once that decision returned, at 10,000 simulated workers a push
        took 0.59 s, sent as taken 0.54 (medians of 8 alternated pairs;
        benchmarks/RESULTS.md, "Each go sent as it is taken").

        With sharded servers, each shard's transfers are planned against its
        own version, one shard after the other: a shard's plan sees the
        transfers let go for the shards before it as running on their links.
        The shard that goes first rotates from one decision to the next, so
        no shard's transfers always have the links first. A shard is planned
        again only when something of its own happened (a request, a report,
        a chunk's progress, a worker gone), when its plan's next start has
        come, or when the network or the aggregators changed: as separate
        controllers per shard would, each seeing the transfers already
        running on the workers' uplinks but not the other shards' plans.
        Every shard re-planned on every event, the decision grew with the
        shards: at 1,000 simulated workers and 16 shards the controller was
        busy all the time and a push took 61 s against FIFO's 0.6 s."""
        if not self.pending:
            return Decisions((), None)
        # A transfer past its planned time: plan what follows it at the rate
        # it shows so far, and look again when the next one is due to end.
        look_again = self._overdue(now) if self.learn_rates else None
        decided = self._decide(now, on_action)
        if look_again is not None and self.pending:
            wake = look_again if decided.wake_at is None else min(decided.wake_at, look_again)
            return Decisions(decided.actions, wake)
        return decided

    def _decide(self, now: float, on_action: Callable[[Go | Drop], None] | None
                ) -> Decisions:
        if self._columns is not None:
            shards = self._columns.shards()
        else:
            shards = sorted({t.shard for t in self.pending.values()})
        if shards == [0] and len(self.shard_versions) <= 1:
            return self._commit(self._plan(now, None, lambda: self.snapshot(now)), now,
                                on_action)
        first = self._first_shard % len(shards)
        self._first_shard += 1
        actions: list[Go | Drop] = []
        wake_at = math.inf
        aggregators = self.usable_aggregators(now)
        if self._planned_with is None or self._planned_with[0] is not self.network \
                or self._planned_with[1] != aggregators:
            due = set(shards)
        else:
            due = {k for k in shards
                   if k in self._dirty or self._shard_wake.get(k, -math.inf) <= now}
        self._planned_with = (self.network, aggregators)
        by_shard: dict[int, list[Transfer]] | None = None
        for shard in shards[first:] + shards[:first]:
            if shard not in due:
                continue

            def snapshot(shard: int = shard) -> Snapshot:
                nonlocal by_shard
                if by_shard is None:
                    by_shard = self._pending_by_shard(due)
                return Snapshot(
                    now=now, version=self.shard_versions.get(shard, 0), tau_max=self.tau_max,
                    pending=_planned(by_shard[shard]), active=self._active(),
                    network=self.network, aggregators=aggregators,
                    in_flight=self.active.in_flight(shard), handover=self.handover)

            decided = self._commit(self._plan(now, shard, snapshot), now, on_action)
            actions.extend(decided.actions)
            self._dirty.discard(shard)
            self._shard_wake[shard] = math.inf if decided.wake_at is None else decided.wake_at
        for shard in shards:
            wake_at = min(wake_at, self._shard_wake.get(shard, math.inf))
        return Decisions(tuple(actions), None if wake_at == math.inf else wake_at)

    def _pending_by_shard(self, shards: Iterable[int]) -> dict[int, list[Transfer]]:
        """`shards`' pending transfers, by id, in one pass (not one pass over
        every pending transfer per shard: at 16 shards and 16,000 pending
        that filter alone was an eighth of the simulator's time)."""
        by_shard: dict[int, list[Transfer]] = {k: [] for k in shards}
        for t in self.pending.values():
            if t.shard in by_shard:
                by_shard[t.shard].append(t)
        for waiting in by_shard.values():
            waiting.sort(key=lambda t: t.id)
        return by_shard

    def _active(self) -> tuple[Transfer, ...]:
        """The active transfers as a policy plans them, by id."""
        return self.active.planned_view()

    def _plan(self, now: float, shard: int | None, snapshot: Callable[[], Snapshot]
              ) -> Sequence[PlanItem]:
        """The policy's plan of `shard`'s pending transfers (None: a job of
        one server, all of them) with the active ones under way: from the
        columns when the policy plans from them (`Mlfabric.plan_columns`),
        else from the `snapshot()`."""
        if self._columns is not None:
            assert isinstance(self.policy, Mlfabric)
            if shard is None:
                version, in_flight = self.version, len(self.active)
            else:
                version = self.shard_versions.get(shard, 0)
                in_flight = self.active.in_flight(shard)
            plan = self.policy.plan_columns(
                self._columns, self._columns.rows(shard), now=now, version=version,
                in_flight=in_flight, tau_max=self.tau_max, active=self.active,
                network=self.network, handover=self.handover)
            if plan is not None:
                return plan
        return self.policy(snapshot())

    def _commit(self, plan: Sequence[PlanItem], now: float,
                on_action: Callable[[Go | Drop], None] | None = None) -> Decisions:
        """Carry out the part of `plan` due at `now`, each action handed to
        `on_action` as it is taken (see decide)."""
        wake_at = math.inf
        if isinstance(plan, ColumnPlan):
            plan, later = plan.due(now)
            wake_at = later if later is not None else math.inf
        actions: list[Go | Drop] = []

        def take(action: Go | Drop) -> None:
            actions.append(action)
            if on_action is not None:
                on_action(action)

        # By shard, once needed: what runs into it, told of each transfer let go.
        orders: dict[int, observed.RunningOrder | None] = {}
        # By shard: how many of its critical transfers the sum of their
        # planned rates counts, and the sum (critical ones stay so within a
        # decision; summed anew for each transfer let go, tens of them, it
        # was about a tenth of a decision that let 88 go at 10,000 simulated
        # workers, profiled).
        beside: dict[int, tuple[int, float]] = {}
        joining: list[Transfer] | None = None  # what this decision may let go
        for item in plan:
            t = self.pending.get(item.id)
            if t is None:
                continue
            stats = self.workers.get(t.owner)
            if item.drop is not None and t.granted:
                # Part of it is on the wire, and the server's connection holds
                # the rest of its frame: it cannot be dropped now. It goes
                # whole, and the server refuses it if it is too stale by then.
                forced = PlanItem(t.id, start=now, position=self.active.in_flight(t.shard),
                                  planned_seconds=t.rest / self.network.rate(t.host, t.dst))
                take(self._let_go(t, forced, now, whole=True))
                self._joined(orders, t)
            elif item.drop is not None:
                self._unpend(t)
                self._ended(t)
                take(Drop(t, item.drop, item.detail))
                if stats is not None:
                    stats.dropped += 1
            elif item.start is not None and item.start <= now:
                order = None
                if self.guard_order:
                    if t.shard not in orders:
                        if joining is None:
                            joining = [self.pending[i.id] for i in plan if i.id in self.pending]
                        orders[t.shard] = self._running_order(t.shard, now, joining)
                    order = orders[t.shard]
                room = paced_for = None
                if order is not None and order.has_critical:
                    # Paced if, flat out, it could take the critical ones'
                    # part of the downlink (`observed.room_beside`), until
                    # they are planned to have landed. Not held: the server
                    # applies it only after those it must not pass
                    # (`must_follow`, below), so holding it would only idle
                    # its lane (benchmarks/RESULTS.md, "The release guard no
                    # longer holds").
                    net = self.network
                    seen, reserved = beside.get(t.shard, (0, 0.0))
                    found = order.critical_since(seen)
                    reserved += sum(_planned_rate(self.active[c]) for c in found
                                    if c in self.active)
                    beside[t.shard] = (seen + len(found), reserved)
                    room = observed.room_beside(net.fastest(t.host, t.dst), reserved,
                                                net.down_rate(t.dst))
                    paced_for = order.paced_for()
                follow = None
                if order is not None and not t.granted and item.route is None:
                    # What it must not pass at the server, should it land first.
                    slack = order.tau_max - (self.shard_versions.get(t.shard, self.version)
                                             - t.base_version)
                    follow = order.must_follow(now + (item.planned_seconds or 0.0), t.id, slack)
                if stats is not None and not t.granted:
                    stats.sent += 1
                take(self._let_go(t, item, now, room=room, paced_for=paced_for, follow=follow))
                self._joined(orders, t)  # it may be critical itself, or make others so
            elif item.start is not None:
                wake_at = min(wake_at, item.start)
        # What a transfer let go shares its downlink with: those let go with
        # it count as much as those before (`observed.SharedDownlink`).
        for a in actions:
            mark = self._up_solo.get(a.transfer.id) if isinstance(a, Go) else None
            if mark is not None:
                tid = a.transfer.id
                self._up_solo[tid] = (mark[0], _SharedAt.of(
                    self._booked[a.transfer.dst], mark[1].capped, self._rate_held[tid]))
        return Decisions(tuple(actions), None if wake_at == math.inf else wake_at)

    def _joined(self, orders: dict[int, observed.RunningOrder | None], t: Transfer) -> None:
        """`t` was let go: into its shard's running order, if one is kept."""
        order = orders.get(t.shard)
        if order is not None:
            row = self.active.landing_row(t.id, self.shard_versions.get(t.shard, self.version))
            if row is not None:
                order.add(*row)

    def _let_go(self, t: Transfer, item: PlanItem, now: float, whole: bool = False,
                room: float | None = None, paced_for: float | None = None,
                follow: tuple[tuple[int, ...], float] | None = None) -> Go:
        """Move pending `t` to active as planned by `item`: all of it, or for
        a chunked transfer its next chunk (the rest of it if `whole`). With a
        `room` (bytes/s critical transfers leave it), paced (`observed.pace`;
        straight to its server only: an aggregator's sum is another transfer)
        for `paced_for` seconds (None: to its end). With `follow` (ids,
        seconds), applied only after those transfers have landed
        (`RunningOrder.must_follow`)."""
        self._unpend(t)
        first = not t.granted
        planned = item.planned_seconds or 0.0
        upto = None
        if t.chunk and item.route is not None:
            # Through an aggregator it goes whole: an aggregate is one frame
            # (route_groups never groups a transfer already sent in part).
            t.piece, t.granted = t.nbytes, t.nbytes
        elif t.chunk:
            upto = t.nbytes if whole else min(t.granted + t.chunk, t.nbytes)
            # The plan was for all that is left; this grant is a part of it.
            planned *= (upto - t.granted) / max(t.rest, 1)
            t.piece, t.granted = upto - t.granted, upto
        if item.codec is not None and not t.chunk:
            # Compressed: it holds its links for the bytes it will send.
            t.codec, t.nbytes = item.codec, t.option_bytes(item.codec)
        t.started, t.position = now, item.position
        t.planned_seconds = planned
        t.path_rate = self.network.rate(t.host, t.dst)
        t.route = item.route
        self.active[t.id] = t
        self._hold(t)
        rate = observed.pace(t.piece if t.chunk and t.piece else t.nbytes, planned, room) \
            if room is not None and item.route is None else None
        after, after_seconds = follow if follow is not None else (None, None)
        return Go(t, item.position or 0, planned, item.route, upto=upto, first=first,
                  codec=t.codec, pace=rate,
                  pace_seconds=paced_for if rate is not None else None,
                  after=after, after_seconds=after_seconds)

    def status(self, now: float | None = None) -> dict[str, object]:
        """The job at a glance (what `mlfabric status` prints), JSON-ready.
        Ages (seconds) are measured to `now`; without it they are None."""
        net = self.network
        hosts = sorted({*net.up, *net.down, *(w.host for w in self.workers.values() if w.host),
                        *self.servers})
        return {
            "server_version": self.version,
            "shards": [{"shard": k, "host": self.shard_hosts.get(k), "version": v}
                       for k, v in sorted(self.shard_versions.items())]
            if len(self.shard_versions) > 1 else [],
            "tau_max": self.tau_max,
            "pending": len(self.pending),
            "active": len(self.active),
            "servers": [
                {"host": v.host, "version": v.version, "transfers": v.transfers,
                 "applied": v.applied, "refused": v.refused,
                 "last_heard_age_s": _age(v.last_heard, now)}
                for v in sorted(self.servers.values(), key=lambda v: v.host)],
            "replicas": [dict(r) for _, r in sorted(self.replicas.items())],
            "agents": [
                {"host": a.host, "address": a.address, "reachable": a.reachable,
                 "last_report_age_s": _age(a.last_report, now), "peers": a.peers,
                 "fresh": a.fresh, "error": a.error}
                for a in sorted(self.agents.values(), key=lambda a: a.host)],
            "workers": [vars(w).copy() for w in sorted(self.workers.values(),
                                                        key=lambda w: w.name)],
            "gone_workers": [
                {"name": g.name, "client": client, "host": g.host, "requests": g.requests,
                 "gone_age_s": _age(g.gone_at, now)}
                for client, g in reversed(self.gone.items())],
            "delay": self.delays.summary(),
            "bandwidth": {h: {"up_bytes_per_s": net.up.get(h, net.default),
                              "down_bytes_per_s": net.down.get(h, net.default),
                              "up_left_bytes_per_s": net.up_rate(h),
                              "down_left_bytes_per_s": net.down_rate(h)} for h in hosts},
            "default_bytes_per_s": net.default,
            "measured_paths": {f"{a}->{b}": rate for (a, b), rate in sorted(net.pair.items())},
        }
