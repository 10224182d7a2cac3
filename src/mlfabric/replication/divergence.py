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
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Mapping, Sequence

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
    c(L-1), c(L-2), ..., c(0), which bounds every order."""
    ordered = sorted(lagging, reverse=True)
    n = len(ordered)
    total = gamma * weight(n - 1, gamma) * replica_velocity
    carried = 0.0
    for t, norm in enumerate(ordered, 1):
        c = weight(n - t, gamma)
        total += c * norm
        carried += c
    return total + ROUNDING * weights_norm * carried


class DivergenceGate:
    """The controller's view of one replica under worker-driven replication.

    The controller learns the server's order late (a worker reports the
    version an update produced when the server answers, and the server's
    heartbeat answers carry the norm of every update it applied) and the
    replica's progress later still, so it bounds with `unordered_bound` over
    every update the replica may lack: those the server applied (norm known,
    version above the replica's) and those let go to the server but not yet
    reported. `admit` says whether one more may go without the bound passing
    `div_max`.

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
        self.applied: dict[int, float] = {}  # server version -> norm, above `replica`
        self.replica = 0  # replica version folded into `velocity`
        self.replica_reported = 0  # highest version the replica was reported at
        self.velocity = 0.0  # B at the replica's version
        self.overrides = 0  # updates let go with the bound past div_max (see admit)
        self.held = 0  # times a server transfer was held back
        self.active = True  # False once the replica was promoted (none left)
        self.stalled = False  # holding was given up: the replica made no progress
        self.stalls = 0  # times the gate gave up holding
        self.synced = False  # `start` was called: replica and velocity are known
        self._holding_since: float | None = None  # first hold with no progress since
        self._progress = (0, 0)  # (replica, replica_reported) when last seen

    def start(self, version: int, velocity_norm: float = 0.0) -> None:
        """Both sides hold version `version`, with ||w - w_prev|| <= velocity_norm."""
        self.replica = self.replica_reported = version
        self.velocity = float(velocity_norm)
        self.applied = {v: n for v, n in self.applied.items() if v > version}
        self.synced = True
        self.stalled = False
        self._holding_since = None

    def server_applied(self, version: int, norm: float) -> None:
        if version > self.replica:
            self.applied[version] = float(norm)
        self._advance()

    def replica_applied(self, version: int) -> None:
        self.replica_reported = max(self.replica_reported, version)
        self._advance()

    def _advance(self) -> None:
        # Fold in order, and only updates whose norm is known; the rest stay
        # counted as lagging (an over-estimate until their report arrives).
        while self.replica < self.replica_reported and self.replica + 1 in self.applied:
            self.replica += 1
            self.velocity = self.applied.pop(self.replica) + self.gamma * self.velocity

    def lag(self, in_flight: int = 0) -> int:
        return len(self.applied) + in_flight

    def bound(self, in_flight: Iterable[float] = ()) -> float:
        return unordered_bound(self.velocity, [*self.applied.values(), *in_flight], self.gamma)

    def admit(self, in_flight: Iterable[float], norm: float, now: float | None = None) -> bool:
        """May an update of norm `norm` go to the server now? Yes if the bound
        stays within div_max, or if nothing is lagging at all: an update larger
        than div_max on its own would otherwise never go (counted in `overrides`).
        With `now`, also yes once the gate has held for `lag_timeout` seconds
        while the replica made no progress (the gate is then `stalled`)."""
        if not self.active or self.stalled:
            return True
        flying = list(in_flight)
        if self.bound([*flying, norm]) <= self.div_max:
            self._holding_since = None
            return True
        if not flying and not self.applied:
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
