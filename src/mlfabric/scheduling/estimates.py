"""Which of the agents' estimates the controller plans with, without I/O.

An agent's estimate can be wrong for a while in ways the agent cannot see
(issue 32: a token bucket let a short train through at the sender's pace and
a 30 Mbit/s path read 1,232 Mbit/s for a second; a path read 0 while another
link was busy). A plan built on such a number sends transfers at a rate the
path does not have. `EstimateGuard` stands between the agents and the plan:

* a fresh estimate within `jump` times the last one used is used at once
  (a real rate change of 30% or more is followed at the agent's pace);
* one that jumps by more than `jump` either way is held: the plan keeps the
  last good estimate until `confirm` reports in a row agree on the new
  level (within `agree`), then takes it. A real step of 4x costs one more
  poll (0.5 s by default); a spike that lasts one report costs nothing;
* a stale estimate (the agent has no recent sample) keeps the last good one
  for `keep_stale` seconds, then none (the configured capacities apply).

Every held report is returned as a `Held` so the controller counts and logs
it, and the decision log shows which estimate each plan used.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class Held:
    """A report the plan did not take: `reported` (bytes/s, NaN if stale) on
    host -> peer; `used` what the plan uses instead (NaN: nothing)."""

    host: str
    peer: str
    reason: str  # "jump" or "stale"
    reported: float
    used: float


@dataclass
class _Pair:
    good: float  # the estimate the plan uses, bytes/s
    at: float  # when it was last fresh and taken
    candidate: float | None = None  # a jump waiting for confirmation
    agreeing: int = 0  # reports in a row that agreed with the candidate


class EstimateGuard:
    """The estimates to plan with, host -> peer, from the agents' reports."""

    def __init__(self, *, jump: float = 3.0, confirm: int = 2, agree: float = 0.25,
                 keep_stale: float = 30.0) -> None:
        if not jump > 1:
            raise ConfigError(f"the jump factor must be above 1, got {jump}")
        if confirm < 1:
            raise ConfigError(f"a jump needs at least 1 report to confirm it, got {confirm}")
        if not 0 < agree < 1:
            raise ConfigError(f"agree must be a fraction in (0, 1), got {agree}")
        if not keep_stale >= 0:
            raise ConfigError(f"keep_stale must be >= 0 seconds, got {keep_stale}")
        self.jump = jump
        self.confirm = confirm
        self.agree = agree
        self.keep_stale = keep_stale
        self._pairs: dict[tuple[str, str], _Pair] = {}

    def update(self, host: str, reported: Mapping[str, tuple[float, bool]], now: float
               ) -> tuple[dict[str, tuple[float, bool]], list[Held]]:
        """The agent on `host` reported peer -> (bytes/s, stale): what to plan
        with (same form, for `plan.with_estimates`) and the reports held."""
        used: dict[str, tuple[float, bool]] = {}
        held: list[Held] = []
        for peer, (rate, stale) in reported.items():
            key = (host, peer)
            pair = self._pairs.get(key)
            if stale or not (rate > 0 and math.isfinite(rate)):
                if pair is not None and now - pair.at <= self.keep_stale:
                    used[peer] = (pair.good, False)
                    held.append(Held(host, peer, "stale", rate, pair.good))
                else:
                    used[peer] = (rate, True)
                    self._pairs.pop(key, None)
                continue
            if pair is None:
                self._pairs[key] = _Pair(rate, now)
                used[peer] = (rate, False)
                continue
            if pair.good / self.jump <= rate <= pair.good * self.jump:
                pair.good, pair.at, pair.candidate, pair.agreeing = rate, now, None, 0
                used[peer] = (rate, False)
                continue
            # A jump: the same level reported `confirm` times in a row is real.
            if pair.candidate is not None and abs(rate - pair.candidate) <= (
                    self.agree * pair.candidate):
                pair.agreeing += 1
            else:
                pair.candidate, pair.agreeing = rate, 1
            if pair.agreeing >= self.confirm:
                pair.good, pair.at, pair.candidate, pair.agreeing = rate, now, None, 0
                used[peer] = (rate, False)
                continue
            pair.at = now  # the path answers: the last good estimate is not stale
            used[peer] = (pair.good, False)
            held.append(Held(host, peer, "jump", rate, pair.good))
        return used, held
