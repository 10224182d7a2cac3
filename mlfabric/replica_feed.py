"""Worker-driven replication, client side: each update the server applied
goes from the worker straight to the replica, numbered with the server's
version, with no second hop through the server.

The worker keeps each update until the replica has it: a push's future
resolves (with the server's outcome) only once the replica applied the
update or said it already had it, so "acknowledged" means "on both". If the
replica cannot be reached the future still resolves (the server has the
update), the update stays in `unreplicated` and a warning says so, once.
With a controller, each replica apply is reported (REPLICA_DONE) so the
controller can track the divergence bound.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from .errors import MlfabricError
from .outcome import PushOutcome

log = logging.getLogger("mlfabric.client")


class ReplicaFeed:
    """Sends a blocking client's applied updates to the replica."""

    def __init__(self, replica: Any, host: str,
                 report: Callable[[str, int], None] | None = None) -> None:
        """`replica`: a Client connected to the replica; `host` its address as
        named to the controller; `report(host, version)` tells the controller."""
        self.replica = replica
        self.host = host
        self.report = report
        # Called once, outside any lock of this feed, when the replica is
        # found unreachable (the client then keeps updates for the next one).
        self.on_lost: Callable[[ReplicaFeed], None] | None = None
        self._lock = threading.Condition()
        # version -> (arrays, base_version): applied at the server, not yet
        # known to be applied at the replica.
        self.unreplicated: dict[int, tuple[dict[str, np.ndarray], int]] = {}
        self._warned = False

    def replicate(self, arrays: dict[str, np.ndarray], base_version: int,
                  outcome: PushOutcome, done: concurrent.futures.Future[PushOutcome]) -> None:
        """Send an update the server answered; resolve `done` with `outcome`
        once the replica has it (at once if the server did not apply it)."""
        if not outcome.applied:
            done.set_result(outcome)
            return
        seq = outcome.version
        with self._lock:
            self.unreplicated[seq] = (arrays, base_version)
        try:
            sent = self.replica._send_push(arrays, base_version, seq=seq)
        except MlfabricError as exc:
            self._failed(seq, exc)
            done.set_result(outcome)
            return
        sent.add_done_callback(lambda f: self._answered(f, seq, outcome, done))

    def _answered(self, f: concurrent.futures.Future[PushOutcome], seq: int,
                  outcome: PushOutcome, done: concurrent.futures.Future[PushOutcome]) -> None:
        exc = f.exception()
        if exc is not None:
            self._failed(seq, exc)
        else:
            # Applied now, or a duplicate: either way the replica has it.
            with self._lock:
                self.unreplicated.pop(seq, None)
                self._lock.notify_all()
            if self.report is not None:
                self.report(self.host, seq)
            answer = f.result()
            if answer.applied and answer.version != seq:
                # A promoted replica renumbered it (an earlier update of the
                # lost server never arrived): its history is the one that lives on.
                outcome = dataclasses.replace(outcome, version=answer.version)
        done.set_result(outcome)

    def _failed(self, seq: int, exc: BaseException) -> None:
        with self._lock:
            warn, self._warned = not self._warned, True
            held = len(self.unreplicated)
            self._lock.notify_all()
        if warn:
            log.warning("update %d is applied at the server but did not reach the replica "
                        "%s (%s); %d updates kept for it", seq, self.replica.address, exc, held)
            if self.on_lost is not None:
                self.on_lost(self)

    def take_unreplicated(self) -> dict[int, tuple[dict[str, np.ndarray], int]]:
        with self._lock:
            return dict(self.unreplicated)

    def drain(self, timeout: float) -> int:
        """Wait up to `timeout` s for the updates on their way to the replica
        to be answered; how many are still unanswered."""
        with self._lock:
            self._lock.wait_for(lambda: not self.unreplicated or self._warned, timeout)
            return len(self.unreplicated)

    def close(self, timeout: float = 10.0) -> None:
        """Close, once the updates sent to the replica are answered (a worker
        that quits right after its last push must not take them along)."""
        left = self.drain(timeout)
        if left:
            log.warning("closing with %d updates not confirmed by the replica %s", left,
                        self.replica.address)
        self.replica.close()
