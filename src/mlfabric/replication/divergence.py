"""A bound on ||w_server - w_replica||_2 from update norms alone, without I/O.

The controller never reads the weights; workers report ||u|| with every
transfer request. With momentum gamma, from a common state (w_0, w_-1)
with velocity v_0 = w_0 - w_-1, applying the sequence a_1, ..., a_n gives

    w_n = w_0 + sum_{t=1..n} Delta_t,   Delta_t = a_t + gamma * Delta_{t-1},  Delta_0 = v_0
        = w_0 + gamma * c(n-1) * v_0 + sum_{j=1..n} c(n-j) * a_j

with c(k) = 1 + gamma + ... + gamma^k = (1 - gamma^(k+1)) / (1 - gamma), and
c(-1) = 0. So the weights are a linear combination of the updates, each
weighted by how many steps ago it was applied. For the server's sequence S
(length n) and the replica's R (length m), subtracting and using the
triangle inequality:

    ||w_s - w_r|| <= gamma * |c(n-1) - c(m-1)| * ||v_0||
                     + sum over updates g of ||u_g|| * |c_S(g) - c_R(g)|

where c_S(g) = c(n - position of g in S), or 0 if S lacks g (likewise R).
This holds for any two sequences: a replica that lacks updates, holds them
in another order, or both (u1, u2 at the server and u2, u1 at the replica
gives exactly gamma * ||u1 - u2|| <= gamma * (||u1|| + ||u2||)).

When the replica applies a prefix of the server's sequence (what the
sequencer enforces), with lag L = n - m, the bound is the sum of the
per-step bounds over the steps the replica lacks,
||Delta_t|| <= B_t = ||a_t|| + gamma * B_{t-1} (B_0 = ||v_0||):

    ||w_s - w_r|| = ||sum_{t=m+1..n} Delta_t|| <= sum_{t=m+1..n} B_t
                  = gamma * c(L-1) * B_m + sum_{t=m+1..n} c(n-t) * ||a_t||

`PrefixBound` keeps B_m and the norms of the lagging updates, so it costs
O(lag) per evaluation.

Both are exact-arithmetic bounds. The stores compute in float32: equal
prefixes are bit-identical (a replica that has caught up has divergence 0),
but each step the server is ahead rounds w_{t+1} by up to a few units in the
last place, a perturbation of norm <= 2^-22 * ||w|| that momentum then
carries forward like an update. `PrefixBound` adds that allowance,
2^-22 * ||w|| * sum over lagging steps of c(n-t), when given ||w||.

Aggregates. An aggregate of k members is ONE momentum step with their sum
A = u_1 + ... + u_k: Delta = A + gamma * Delta_prev, and the version moves
v -> v+k, so the recursion above runs over steps, not versions (a replica
replays the aggregate as the same one step, and is never between v+1 and
v+k-1). `DivergenceGate` therefore keeps one norm per step: lagging steps
are counted once each, and folding a step into B is B <- ||A|| + gamma * B,
once. Folding the k versions as k steps of norms 0, ..., 0, ||A|| (what the
store records) would give ||A|| + gamma^k * B, short of the true bound by
(gamma - gamma^k) * B, and every later bound would inherit that deficit
(decaying by gamma per step): not a bound any more.

Until the server's exact ||A|| is known, the gate learns an aggregate from
its members' reports, each with its own norm n_i; sum n_i >= ||A|| by the
triangle inequality. Counting it, while it lags, as one step of the sum
its reported members give plus one item for those still in flight (their
summed norms, `gate.in_flight_norms`) stays an upper bound, by this lemma:
replacing one lagging step of norm a by j >= 1 lagging items x_1..x_j with
sum x_i >= a never lowers the prefix bound (nor does adding an item).
Put the items where the step was, at positions p..p+j-1 of an order with
n' = n+j-1: the steps after them keep their weights c(n-t), the steps
before them gain (c is increasing), the velocity term gamma*c(L-1)*B_m grows
with L, and the items' weights are c(n-p+j-1), ..., c(n-p), each >= c(n-p),
so their part is >= c(n-p) * sum x_i >= c(n-p) * a. The unordered bound
covers that order (rearrangement). Folding is another matter: once the
replica passed the step, folding the member norms as j steps gives
n_j + gamma*n_{j-1} + ... + gamma^j * B, which with small members (or a
zero update) is again short of ||A|| + gamma * B. So an aggregate is folded
only as one step, and only once its norm is complete: all k members
reported (their sum) or the server's exact norm.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..errors import ConfigError


def _check_gamma(gamma: float) -> float:
    if not 0.0 <= gamma < 1.0:
        raise ConfigError(f"momentum must be in [0, 1), got {gamma}")
    return float(gamma)


def weight(k: int, gamma: float) -> float:
    """c(k) = 1 + gamma + ... + gamma^k, the weight in w of an update applied
    k steps before the last; c(-1) = 0."""
    if k < 0:
        return 0.0
    if gamma == 0.0:
        return 1.0
    return (1.0 - gamma ** (k + 1)) / (1.0 - gamma)


def sequence_bound(server: Sequence[Hashable], replica: Sequence[Hashable],
                   norms: Mapping[Hashable, float], gamma: float,
                   velocity_norm: float = 0.0) -> float:
    """Bound on ||w_s - w_r|| when, from one common state whose velocity has
    norm `velocity_norm`, the server applied `server` and the replica
    `replica` (update ids; each id at most once per sequence)."""
    gamma = _check_gamma(gamma)
    n, m = len(server), len(replica)
    coeff: dict[Hashable, float] = {}
    for j, g in enumerate(server, 1):
        if g in coeff:
            raise ValueError(f"update {g!r} appears twice in the server's sequence")
        coeff[g] = weight(n - j, gamma)
    seen = set()
    for j, g in enumerate(replica, 1):
        if g in seen:
            raise ValueError(f"update {g!r} appears twice in the replica's sequence")
        seen.add(g)
        coeff[g] = coeff.get(g, 0.0) - weight(m - j, gamma)
    total = gamma * abs(weight(n - 1, gamma) - weight(m - 1, gamma)) * velocity_norm
    for g, c in coeff.items():
        total += abs(c) * norms[g]
    return total


class PrefixBound:
    """The bound while the replica applies a prefix of the server's sequence.

    Call `server_applied(norm)` as the server applies each update and
    `replica_applied()` as the replica catches up by one; `bound()` is then
    the current bound, `bound_after(norms)` what it would be if the server
    applied those updates next with the replica standing still.
    """

    def __init__(self, gamma: float, *, velocity_norm: float = 0.0) -> None:
        self.gamma = _check_gamma(gamma)
        self.replica_velocity = float(velocity_norm)  # B_m
        self.lagging: deque[float] = deque()  # ||a_t|| for t = m+1..n

    @property
    def lag(self) -> int:
        """Updates the server applied that the replica has not."""
        return len(self.lagging)

    def server_applied(self, norm: float) -> None:
        if not norm >= 0.0:
            raise ValueError(f"an update norm must be >= 0, got {norm}")
        self.lagging.append(float(norm))

    def replica_applied(self, count: int = 1) -> None:
        if count > len(self.lagging):
            raise ValueError(f"the replica cannot apply {count} updates: it lags by "
                             f"{len(self.lagging)}")
        for _ in range(count):
            self.replica_velocity = self.lagging.popleft() + self.gamma * self.replica_velocity

    def bound(self, weights_norm: float = 0.0) -> float:
        """The bound now; with `weights_norm` = ||w||, float32 rounding included."""
        return self.bound_after((), weights_norm)

    def bound_after(self, norms: Iterable[float], weights_norm: float = 0.0) -> float:
        lagging = [*self.lagging, *norms]
        n = len(lagging)
        gamma = self.gamma
        total = gamma * weight(n - 1, gamma) * self.replica_velocity
        carried = 0.0
        for t, norm in enumerate(lagging, 1):
            c = weight(n - t, gamma)
            total += c * norm
            carried += c
        return total + ROUNDING * weights_norm * carried


# Seconds the gate holds server transfers while the replica makes no
# progress before it gives up holding (DivergenceGate.stalled).
DEFAULT_LAG_TIMEOUT = 3.0

# Relative size of one float32 apply's rounding, as a perturbation of w.
ROUNDING = 2.0**-22


def unordered_bound(replica_velocity: float, lagging: Iterable[float], gamma: float,
                    weights_norm: float = 0.0) -> float:
    """The prefix bound when the order of the lagging updates is unknown
    (some are still in flight, or reported out of order): by the
    rearrangement inequality, the largest norms take the largest weights
    c(L-1), c(L-2), ..., c(0), which bounds every order. One norm per step:
    an aggregate is one step of its sum's norm (or of an upper bound on it,
    see the module's docstring), and the versions it skipped are no steps."""
    ordered = sorted(lagging, reverse=True)
    n = len(ordered)
    total = gamma * weight(n - 1, gamma) * replica_velocity
    carried = 0.0
    for t, norm in enumerate(ordered, 1):
        c = weight(n - t, gamma)
        total += c * norm
        carried += c
    return total + ROUNDING * weights_norm * carried


@dataclass(slots=True)
class Step:
    """One step the server took (`DivergenceGate.steps`, keyed by the
    version it ended at): an update alone (`span` 1) or an aggregate of
    `span` members, one momentum step over versions end - span + 1 .. end."""

    span: int
    norm: float = 0.0  # the step's norm, or the sum of its members' reported so far
    reported: int = 0  # members whose norms `norm` sums
    exact: bool = False  # `norm` is the step's own: the server's, or a lone update's

    @property
    def known(self) -> bool:
        """Its norm is complete (an upper bound on ||A|| at worst), so it may
        be folded into the replica's velocity."""
        return self.exact or self.reported >= self.span

    @property
    def versions(self) -> int:
        """The versions of it the gate counts in its lag: all once its norm
        is complete; until then one per member reported (the others are still
        in flight, and counted there)."""
        return self.span if self.known else self.reported


class DivergenceGate:
    """The controller's view of one replica under worker-driven replication.

    The controller learns the server's order late (a worker reports the
    version an update produced when the server answers, and the server's
    heartbeat answers carry the norm of every step it took) and the
    replica's progress later still, so it bounds with `unordered_bound` over
    every step the replica may lack: those the server took (`steps`, above
    the replica) and those let go to the server but not yet reported. `admit`
    says whether one more may go without the bound passing `div_max`.

    The gate counts steps, not versions: an aggregate of k is one step of k
    versions (the module's docstring, "Aggregates"), learnt from its
    members' reports (`server_applied(..., span=k, member=True)`, summed) or
    from the server's heartbeat (its exact norm). The replica's reported
    version is always a step's end.

    A replica that stops making progress (dead, partitioned, or waiting for
    an update whose worker died) must not hold the job hostage: once server
    transfers have been held for `lag_timeout` seconds with no progress of
    the replica, the gate is `stalled` and lets everything go, counted in
    `stalls`, until the bound is back within div_max (the replica caught up
    or was resynced: `start`).
    """

    def __init__(self, gamma: float, div_max: float, *,
                 lag_timeout: float | None = DEFAULT_LAG_TIMEOUT) -> None:
        self.gamma = _check_gamma(gamma)
        if not div_max > 0:
            raise ConfigError(f"--div-max must be positive, got {div_max}")
        if lag_timeout is not None and not lag_timeout > 0:
            raise ConfigError(f"--replica-lag-timeout must be positive, got {lag_timeout}")
        self.div_max = float(div_max)
        self.lag_timeout = lag_timeout
        self.steps: dict[int, Step] = {}  # by the server version each ended at, above `replica`
        self.replica = 0  # replica version folded into `velocity` (a step's end)
        self.replica_reported = 0  # highest version the replica was reported at
        self.velocity = 0.0  # B at the replica's version
        self.overrides = 0  # updates let go with the bound past div_max (see admit)
        self.held = 0  # times a server transfer was held back
        self.active = True  # False once the replica was promoted (none left)
        self.stalled = False  # holding was given up: the replica made no progress
        self.stalls = 0  # times the gate gave up holding
        self.synced = False  # `start` was called: replica and velocity are known
        self._widest = 1  # the largest span heard of: how far back a step may start
        self._holding_since: float | None = None  # first hold with no progress since
        self._progress = (0, 0)  # (replica, replica_reported) when last seen

    @property
    def applied(self) -> dict[int, float]:
        """The lagging steps' norms by the version each ended at (a copy)."""
        return {v: s.norm for v, s in self.steps.items()}

    def start(self, version: int, velocity_norm: float = 0.0) -> None:
        """Both sides hold version `version`, with ||w - w_prev|| <= velocity_norm."""
        self.replica = self.replica_reported = version
        self.velocity = float(velocity_norm)
        self.steps = {v: s for v, s in self.steps.items() if v > version}
        self.synced = True
        self.stalled = False
        self._holding_since = None

    def forget_above(self, version: int) -> None:
        """The steps past `version` were another server's: a replica promoted
        at `version` numbers its own updates from there."""
        self.steps = {v: s for v, s in self.steps.items() if v <= version}

    def server_applied(self, version: int, norm: float, span: int = 1, *,
                       member: bool = False) -> None:
        """The server took a step of `span` versions ending at `version` (an
        aggregate of `span` members, or an update alone).

        `member`: `norm` is one member's own norm (its worker's report): the
        step's norm is the sum of its members' (>= ||sum||, the triangle
        inequality), complete once all `span` reported. Otherwise `norm` is
        the step's own (the server's heartbeat, or an update applied alone):
        it replaces a partial sum, and later member reports are ignored."""
        if not norm >= 0.0:
            raise ValueError(f"an update norm must be >= 0, got {norm}")
        if not (isinstance(span, int) and span >= 1):
            raise ValueError(f"a step spans 1 or more versions (an aggregate's fan-in), got "
                             f"{span!r}")
        if version <= self.replica or self._skipped(version):
            return  # folded already, or a version an aggregate skipped: no step
        step = self.steps.get(version)
        if step is None:
            step = self.steps[version] = Step(span)
        elif span > step.span:
            # A report that did not know the step was an aggregate (a
            # heartbeat without spans) gives way to one that did.
            step.span = span
        if span > 1:
            self._widest = max(self._widest, span)
            for v in range(version - span + 1, version):
                self.steps.pop(v, None)  # taken for single steps of 0.0 before
        if not member:
            step.norm, step.exact = float(norm), True
        elif not step.exact and not step.known:
            step.norm += float(norm)
            step.reported += 1
        self._advance()

    def _skipped(self, version: int) -> bool:
        """`version` lies inside a known aggregate's span, before its end."""
        for end in range(version + 1, version + self._widest):
            step = self.steps.get(end)
            if step is not None and end - step.span < version:
                return True
        return False

    def _next_step(self) -> tuple[int, Step] | None:
        """The step that starts at replica + 1, if the gate heard of it."""
        for end in range(self.replica + 1, self.replica + self._widest + 1):
            step = self.steps.get(end)
            if step is not None:
                return (end, step) if end - step.span == self.replica else None
        return None

    def replica_applied(self, version: int) -> None:
        self.replica_reported = max(self.replica_reported, version)
        self._advance()

    def _advance(self) -> None:
        # Fold whole steps, in order, and only those whose norm is complete;
        # the rest stay counted as lagging (an over-estimate until the last
        # member's report or the server's norm arrives).
        while self.replica < self.replica_reported:
            found = self._next_step()
            if found is None:
                return
            end, step = found
            if not step.known or end > self.replica_reported:
                return
            del self.steps[end]
            self.replica = end
            self.velocity = step.norm + self.gamma * self.velocity

    def lag(self, in_flight: int = 0) -> int:
        """Versions (updates) the replica may lack, as users count them: those
        of the lagging steps heard of plus `in_flight` updates let go to the
        server and not reported (an aggregate's member in flight whose step
        the server's heartbeat already reported counts twice for a moment)."""
        return sum(s.versions for s in self.steps.values()) + in_flight

    def bound(self, in_flight: Iterable[float] = ()) -> float:
        """The bound now; `in_flight`: one norm per step let go and not yet
        reported (the members of one aggregate are one step, of their summed
        norms: `gate.in_flight_norms`)."""
        return unordered_bound(self.velocity, [*(s.norm for s in self.steps.values()),
                                               *in_flight], self.gamma)

    def admit(self, in_flight: Iterable[float], norm: float, now: float | None = None) -> bool:
        """May a step of norm `norm` (an update, or an aggregate: its members'
        summed norms) go to the server now? Yes if the bound stays within
        div_max, or if nothing is lagging at all: a step larger than div_max
        on its own would otherwise never go (counted in `overrides`).
        With `now`, also yes once the gate has held for `lag_timeout` seconds
        while the replica made no progress (the gate is then `stalled`)."""
        if not self.active or self.stalled:
            return True
        flying = list(in_flight)
        if self.bound([*flying, norm]) <= self.div_max:
            self._holding_since = None
            return True
        if not flying and not self.steps:
            self.overrides += 1
            return True
        if now is not None and self.lag_timeout is not None:
            progress = (self.replica, self.replica_reported)
            if self._holding_since is None or progress != self._progress:
                self._holding_since, self._progress = now, progress
            elif now - self._holding_since >= self.lag_timeout:
                self.stalled = True
                self.stalls += 1
                return True
        return False

    def release_at(self) -> float | None:
        """While holding: when the gate gives up holding if the replica does
        not move (the controller re-plans then)."""
        if self._holding_since is None or self.lag_timeout is None:
            return None
        return self._holding_since + self.lag_timeout

    def recheck(self, in_flight: Iterable[float] = ()) -> bool:
        """While stalled: hold again once the bound is back within div_max
        (the replica caught up). True if the gate is holding-capable again."""
        if self.stalled and self.bound(in_flight) <= self.div_max:
            self.stalled = False
            self._holding_since = None
        return not self.stalled
