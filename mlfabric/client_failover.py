"""What a blocking client keeps while its server is lost and the controller
has not yet named the promoted replica.

Updates the lost server never answered are parked (their futures stay
pending) and re-sent to the new server once the controller's FAILOVER
arrives; pull() waits for it too. Nothing waits forever: after `timeout`
seconds without a failover, parked updates fail with ConnectionLost saying
they were not applied anywhere known.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .errors import ConfigError, ConnectionLost


class FailoverWait:
    def __init__(self, timeout: float) -> None:
        if not timeout > 0:
            raise ConfigError(f"failover_timeout must be positive, got {timeout}")
        self.timeout = timeout
        self.generation = 0  # failovers seen
        self._cond = threading.Condition()
        self._parked: list[tuple[Callable[[], None], Any]] = []
        self._watchdog: threading.Thread | None = None
        self._closed = False

    def park(self, generation: int, resend: Callable[[], None], future: Any) -> None:
        """An update sent at `generation` was not answered: `resend()` it once
        the server changes (at once if it already has)."""
        with self._cond:
            if self.generation == generation and not self._closed:
                self._parked.append((resend, future))
                if self._watchdog is None:
                    self._watchdog = threading.Thread(target=self._expire, args=(generation,),
                                                      name="mlfabric-failover-wait", daemon=True)
                    self._watchdog.start()
                return
        if self._closed:
            future.set_exception(ConnectionLost("the client was closed"))
        else:
            # Not in this thread: it may be a reader thread holding the
            # client's lock, which sending takes.
            threading.Thread(target=resend, name="mlfabric-resend", daemon=True).start()

    def advance(self) -> None:
        """The client now talks to the promoted replica: re-send what waited."""
        with self._cond:
            self.generation += 1
            parked, self._parked = self._parked, []
            self._cond.notify_all()
        for resend, _ in parked:
            resend()

    def wait_past(self, generation: int) -> bool:
        """Wait until a failover after `generation`; False on timeout or close."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self.generation > generation or self._closed, self.timeout
            ) and not self._closed

    def _expire(self, generation: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.generation > generation or self._closed,
                                self.timeout)
            self._watchdog = None
            if self.generation > generation:
                return
            gone, self._parked = self._parked, []
        for _, future in gone:
            if not future.done():
                future.set_exception(ConnectionLost(
                    f"the server was lost and no failover came within {self.timeout:.0f} s; "
                    f"this update's fate is unknown: pull() and compute it again"))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            gone, self._parked = self._parked, []
            self._cond.notify_all()
        for _, future in gone:
            if not future.done():
                future.set_exception(ConnectionLost("the client was closed before the server "
                                                    "came back"))
