"""What a client keeps while its server is lost and the controller has not
yet named the promoted replica.

Updates the lost server never answered are parked (their futures stay
pending) and re-sent to the new server once the controller's FAILOVER
arrives; pull() waits for it too. Nothing waits forever: after `timeout`
seconds without a failover, parked updates fail with ConnectionLost saying
their fate is unknown.

`FailoverBook` decides (no threads, no event loop); `FailoverWait` carries
it out for the blocking client with a condition and a watchdog thread,
`AsyncFailoverWait` for the asyncio client with an event and a timer.
"""

from __future__ import annotations

import asyncio
import threading
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


class FailoverWait:
    """FailoverBook for the blocking client (any thread)."""

    def __init__(self, timeout: float) -> None:
        self.book = FailoverBook(timeout)
        self.timeout = timeout
        self._cond = threading.Condition()
        self._watchdog: threading.Thread | None = None

    @property
    def generation(self) -> int:
        return self.book.generation

    def park(self, generation: int, resend: Callable[[], None], future: Any) -> None:
        """An update sent at `generation` was not answered: `resend()` it once
        the server changes (at once if it already has)."""
        with self._cond:
            action = self.book.park(generation, resend, future)
            if action == PARKED and self._watchdog is None:
                self._watchdog = threading.Thread(target=self._expire, args=(generation,),
                                                  name="mlfabric-failover-wait", daemon=True)
                self._watchdog.start()
        if action == CLOSED:
            _fail([future], ConnectionLost("the client was closed"))
        elif action == RESEND:
            # Not in this thread: it may be a reader thread holding the
            # client's lock, which sending takes.
            threading.Thread(target=resend, name="mlfabric-resend", daemon=True).start()

    def advance(self) -> None:
        with self._cond:
            resends = self.book.advance()
            self._cond.notify_all()
        for resend in resends:
            resend()

    def wait_past(self, generation: int) -> bool:
        """Wait until a failover after `generation`; False on timeout or close."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self.book.generation > generation or self.book.closed, self.timeout
            ) and not self.book.closed

    def _expire(self, generation: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.book.generation > generation or self.book.closed,
                                self.timeout)
            self._watchdog = None
            gone = [] if self.book.closed else self.book.expire(generation)
        _fail(gone, self.book.expired_error())

    def close(self) -> None:
        with self._cond:
            gone = self.book.close()
            self._cond.notify_all()
        _fail(gone, self.book.closed_error())


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
