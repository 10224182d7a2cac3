"""Worker-driven replication, client side: each update the server applied
goes from the worker straight to the replica, numbered with the server's
version, with no second hop through the server.

The worker keeps each update until the replica has it: a push's future
resolves (with the server's outcome) once the replica applied the update or
said it already had it, so "acknowledged" means "on both". A replica never
holds the job hostage: if it cannot be reached, or has not answered within
`timeout` seconds (it may be waiting for an update whose worker died, until
the controller resyncs it), the future resolves with the server's outcome
all the same, the update stays in `unreplicated` (still on its way) and a
warning says so, once. A replica that refuses an update because it is too
far ahead of what it has ("seq_gap") will take it from the server's state
when it resyncs: the update is not kept for it.
With a controller, each replica apply is reported (REPLICA_DONE) so the
controller can track the divergence bound.

`ReplicaFeed` runs on the client's event loop; it needs only the replica
link's `send_push` (a `ReplicaSink`) and its futures' callbacks.
`ReplicaFeeds` is what a client keeps across failovers and joins: the
current feed, the retired ones and the updates acknowledged while no
replica was attached.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import ConfigError, ConnectionLost, MlfabricError, ServerError
from ..runtime.loop import within
from .outcome import PushOutcome

log = logging.getLogger("mlfabric.client")

# An update kept for a replica: its arrays, base version and the server's
# outcome (which says where in the server's order it goes), by that place
# (`PushOutcome.seq`).
Kept = tuple[dict[str, np.ndarray], int, PushOutcome]

DEFAULT_REPLICA_TIMEOUT = 10.0  # seconds a push waits for the replica's answer

Schedule = Callable[[float, Callable[[], None]], Any]

class ReplicaFeed:
    """Sends a client's applied updates to the replica."""

    def __init__(self, replica: Any, host: str,
                 report: Callable[[str, int], None] | None = None, *,
                 timeout: float = DEFAULT_REPLICA_TIMEOUT,
                 schedule: Schedule | None = None) -> None:
        """`replica`: a Client or AsyncClient connected to the replica; `host`
        its address as named to the controller; `report(host, version)` tells
        the controller. `schedule(delay, fn)` runs fn after delay seconds (the
        event loop's call_later); with it, a push resolves after `timeout`
        seconds without the replica's answer."""
        if not timeout > 0:
            raise ConfigError(f"replica_timeout must be positive, got {timeout}")
        self.replica = replica
        self.host = host
        self.report = report
        self.timeout = timeout
        self.schedule = schedule
        self.timed_out = 0  # pushes resolved without the replica's answer
        self._warned_slow = False
        # Called once, outside any lock of this feed, when the replica is
        # found unreachable (the client then keeps updates for the next one).
        self.on_lost: Callable[[ReplicaFeed], None] | None = None
        # Applied at the server, not yet known to be applied at the replica.
        self.unreplicated: dict[int, Kept] = {}
        self._warned = False
        # Called after every answer or failure (close() waits on them).
        self._watchers: list[Callable[[], None]] = []

    def replicate(self, arrays: dict[str, np.ndarray], base_version: int,
                  outcome: PushOutcome, done: Any) -> None:
        """Send an update the server answered; resolve `done` (a concurrent or
        asyncio future) with `outcome` once the replica has it (at once if
        the server did not apply it). A member of an aggregate goes at its
        place in the aggregate, with that place: the replica applies the
        aggregate once all its members are in, as the server did."""
        if not outcome.applied:
            _resolve(done, outcome)
            return
        seq = outcome.seq
        self.unreplicated[seq] = (arrays, base_version, outcome)
        fields = ({} if outcome.fan_in is None or outcome.fan_in < 2
                  else {"fan_in": outcome.fan_in, "index": outcome.index})
        try:
            sent = self.replica.send_push(arrays, base_version, seq=seq, **fields)
        except MlfabricError as exc:
            self._failed(seq, exc)
            _resolve(done, outcome)
            return
        sent.add_done_callback(lambda f: self._answered(f, seq, outcome, done))
        if self.schedule is not None and not done.done():
            self.schedule(self.timeout, lambda: self._too_slow(seq, outcome, done))

    def _too_slow(self, seq: int, outcome: PushOutcome, done: Any) -> None:
        """`timeout` passed: resolve with the server's outcome if the replica
        has not answered (the update stays kept and on its way)."""
        if seq not in self.unreplicated or done.done():
            return
        warn, self._warned_slow = not self._warned_slow, True
        self.timed_out += 1
        if warn:
            log.warning("the replica %s has not confirmed update %d within %.1f s: the push "
                        "completes with the server's outcome, and the update stays kept for "
                        "the replica (is it waiting for a lost update? the controller "
                        "resyncs it with --server/--replica)", self.replica.address, seq,
                        self.timeout)
        _resolve(done, outcome)

    def _answered(self, f: Any, seq: int, outcome: PushOutcome, done: Any) -> None:
        exc = ConnectionLost("cancelled") if f.cancelled() else f.exception()
        if isinstance(exc, ServerError) and exc.code == "seq_gap":
            # Too far ahead of what the replica has: it is waiting for an
            # earlier update and takes this one from the server's state when
            # it resyncs. Not a lost replica.
            log.info("the replica %s will take update %d from the server's state: %s",
                     self.replica.address, seq, exc)
            self.unreplicated.pop(seq, None)
            self._changed()
        elif exc is not None:
            self._failed(seq, exc)
        else:
            # Applied now, or a duplicate: either way the replica has it.
            self.unreplicated.pop(seq, None)
            self._changed()
            answer = f.result()
            if self.report is not None:
                # The replica is at the version the server reached with it
                # (an aggregate's last: it applies the whole aggregate at once).
                self.report(self.host, outcome.version)
            if answer.applied and answer.version != outcome.version:
                # A promoted replica renumbered it (an earlier update of the
                # lost server never arrived): its history is the one that lives on.
                outcome = dataclasses.replace(outcome, version=answer.version,
                                              fan_in=answer.fan_in, index=answer.index)
        _resolve(done, outcome)

    def _changed(self) -> None:
        for watcher in self._watchers:
            watcher()

    def _failed(self, seq: int, exc: BaseException) -> None:
        warn, self._warned = not self._warned, True
        held = len(self.unreplicated)
        self._changed()
        if warn:
            log.warning("update %d is applied at the server but did not reach the replica "
                        "%s (%s); %d updates kept for it", seq, self.replica.address, exc, held)
            if self.on_lost is not None:
                self.on_lost(self)

    def take_unreplicated(self) -> dict[int, Kept]:
        return dict(self.unreplicated)

    async def aclose(self, timeout: float | None = None) -> None:
        """Close, once the updates sent to the replica are answered (a worker
        that quits right after its last push must not take them along), or
        after `timeout` seconds (default: the replica timeout)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.timeout if timeout is None else timeout)
        changed = asyncio.Event()
        self._watchers.append(changed.set)
        try:
            while True:
                left = 0 if self._warned else len(self.unreplicated)
                changed.clear()
                if not left or loop.time() >= deadline:
                    break
                try:
                    await within(changed.wait(), deadline - loop.time())
                except TimeoutError:
                    pass
        finally:
            self._watchers.remove(changed.set)
        self._closing(len(self.unreplicated) if not self._warned else 0)
        await self.replica.close()

    def _closing(self, left: int) -> None:
        if left:
            log.warning("closing with %d updates not confirmed by the replica %s", left,
                        self.replica.address)


def _resolve(done: Any, outcome: PushOutcome) -> None:
    # An asyncio caller may have cancelled its future.
    if not done.done():
        done.set_result(outcome)


class ReplicaFeeds:
    """A client's replicas over failovers and joins: the current feed (None
    while no replica is attached), feeds retired (open until what was sent
    to them is answered) and, while none is attached, the newest `limit`
    updates the server acknowledged, for the next replica to join. Thread-safe."""

    def __init__(self, current: ReplicaFeed | None, limit: int = 0) -> None:
        if limit < 0:
            raise ConfigError(f"replica_backlog must be >= 0, got {limit}")
        self.current = current
        self.limit = limit
        self.retired: list[ReplicaFeed] = []
        self.backlog: dict[int, Kept] = {}  # by place in the server's order

    def acknowledged(self, arrays: dict[str, np.ndarray], base: int, outcome: PushOutcome
                     ) -> ReplicaFeed | None:
        """The server answered an update: the feed to send it to, or None
        (kept for the next replica if it was applied)."""
        # The replica now, not at push time: one may have joined since.
        feed = self.current
        if feed is None and outcome.applied and self.limit:
            self.backlog[outcome.seq] = (arrays, base, outcome)
            self._trim()
        return feed

    def _trim(self) -> None:
        while len(self.backlog) > self.limit:
            del self.backlog[min(self.backlog)]

    def retire(self) -> None:
        """The replica became the server: no replica until one joins (call
        before the first answer from the new server, so every update it
        acknowledges is kept)."""
        if self.current is not None:
            self.retired.append(self.current)
            self.current = None

    def lost(self, feed: ReplicaFeed) -> None:
        """`feed`'s replica is unreachable: from now on keep what the server
        acknowledges, and what never reached that replica, for the next one."""
        kept = feed.take_unreplicated()
        if self.current is not feed:
            return
        self.current = None
        self.retired.append(feed)
        self.backlog.update(kept)
        self._trim()

    def attach(self, feed: ReplicaFeed, version: int) -> list[tuple[int, Kept]]:
        """A new replica serves from `version`: the kept updates above it, in
        version order, to send it before anything else."""
        old, self.current = self.current, feed
        kept = sorted(((v, x) for v, x in self.backlog.items() if v > version),
                      key=lambda item: item[0])
        self.backlog.clear()
        if old is not None:
            self.retired.append(old)
        return kept

    def all(self) -> list[ReplicaFeed]:
        return [*self.retired, *([self.current] if self.current is not None else [])]

    def warn_unprotected(self) -> None:
        """At close: say so if updates were acknowledged by the server alone."""
        n = len(self.backlog) if self.current is None else 0
        if n:
            log.warning("closing with %d updates acknowledged by the server alone (no replica "
                        "has joined since the failover): a loss of the server now loses them", n)
