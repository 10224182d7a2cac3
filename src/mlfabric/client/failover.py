"""What a client keeps while its server is lost and the controller has not
yet named the promoted replica.

Updates the lost server never answered are parked (their futures stay
pending) and re-sent to the new server once the controller's FAILOVER
arrives; pull() waits for it too. Nothing waits forever: after `timeout`
seconds without a failover, parked updates fail with ConnectionLost saying
their fate is unknown.

`FailoverBook` decides (no event loop); `AsyncFailoverWait` carries it out
on the client's event loop with an event and a timer (the blocking client
runs that same client on a thread).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError, ConnectionLost
from ..runtime.loop import within

PARKED, RESEND, CLOSED = "parked", "resend", "closed"


class FailoverBook:
    """The parked updates of one client and the failovers it has seen.
    Callers serialise access (a lock, or the event loop)."""

    def __init__(self, timeout: float) -> None:
        if not timeout > 0:
            raise ConfigError(f"failover_timeout must be positive, got {timeout}")
        self.timeout = timeout
        self.generation = 0  # failovers seen
        self.closed = False
        self.parked: list[tuple[Callable[[], None], Any]] = []

    def park(self, generation: int, resend: Callable[[], None], future: Any) -> str:
        """An update sent at `generation` was not answered. PARKED: it waits
        for the next failover; RESEND: a failover came since it was sent, send
        it again now; CLOSED: fail it, the client is closed."""
        if self.closed:
            return CLOSED
        if self.generation != generation:
            return RESEND
        self.parked.append((resend, future))
        return PARKED

    def advance(self) -> list[Callable[[], None]]:
        """The client now talks to the promoted replica: what to re-send."""
        self.generation += 1
        parked, self.parked = self.parked, []
        return [resend for resend, _ in parked]

    def expire(self, generation: int) -> list[Any]:
        """`timeout` passed since an update was parked at `generation`: the
        futures to fail with `expired_error()` (none if a failover came)."""
        if self.generation > generation:
            return []
        gone, self.parked = self.parked, []
        return [future for _, future in gone]

    def close(self) -> list[Any]:
        """The futures to fail with `closed_error()`."""
        self.closed = True
        gone, self.parked = self.parked, []
        return [future for _, future in gone]

    def expired_error(self) -> ConnectionLost:
        return ConnectionLost(
            f"the server was lost and no failover came within {self.timeout:.0f} s; this "
            f"update's fate is unknown: pull() and compute it again")

    @staticmethod
    def closed_error() -> ConnectionLost:
        return ConnectionLost("the client was closed before the server came back")


def _fail(futures: list[Any], exc: ConnectionLost) -> None:
    for future in futures:
        if not future.done():
            future.set_exception(exc)


class AsyncFailoverWait:
    """FailoverBook for the asyncio client (on its event loop only)."""

    def __init__(self, timeout: float) -> None:
        self.book = FailoverBook(timeout)
        self.timeout = timeout
        self._changed = asyncio.Event()  # set, and replaced, at each failover or close
        self._timer: asyncio.TimerHandle | None = None

    @property
    def generation(self) -> int:
        return self.book.generation

    def park(self, generation: int, resend: Callable[[], None], future: Any) -> None:
        action = self.book.park(generation, resend, future)
        loop = asyncio.get_running_loop()
        if action == PARKED and self._timer is None:
            self._timer = loop.call_later(self.timeout, self._expire, generation)
        elif action == CLOSED:
            _fail([future], ConnectionLost("the client was closed"))
        elif action == RESEND:
            # Later, not inside the callback that found the update lost.
            loop.call_soon(resend)

    def advance(self) -> None:
        resends = self.book.advance()
        self._wake()
        for resend in resends:
            resend()

    async def wait_past(self, generation: int) -> bool:
        """Wait until a failover after `generation`; False on timeout or close."""
        if self.book.generation == generation and not self.book.closed:
            try:
                await within(self._changed.wait(), self.timeout)
            except TimeoutError:
                return False
        return self.book.generation > generation and not self.book.closed

    def _expire(self, generation: int) -> None:
        self._timer = None
        _fail(self.book.expire(generation), self.book.expired_error())

    def _wake(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._changed.set()
        self._changed = asyncio.Event()

    def close(self) -> None:
        self._wake()
        _fail(self.book.close(), self.book.closed_error())
