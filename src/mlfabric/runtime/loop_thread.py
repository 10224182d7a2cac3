"""An event loop on a thread of its own: how blocking code drives asyncio code.

The blocking `mlfabric.Client` runs the asyncio client on one, as hivemind
runs its asyncio core behind blocking wrappers: every feature is written once,
on the loop, and a blocking call hands a coroutine over and waits for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from .loop import loop_factory

T = TypeVar("T")


class LoopThread:
    """A running event loop (uvloop unless MLFABRIC_LOOP says otherwise) on a
    daemon thread named `name`; `stop()` ends both."""

    def __init__(self, name: str = "mlfabric-loop", kind: str | None = None) -> None:
        self.loop = loop_factory(kind)()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start `coro` on the loop; its result on a concurrent future."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a blocking mlfabric call from the client's own event loop "
                               "would wait forever: call it from another thread")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result. After `timeout`
        seconds it is cancelled and TimeoutError raised."""
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError from None
        except BaseException:
            fut.cancel()  # KeyboardInterrupt in the waiting thread: stop the work too
            raise

    def call_soon(self, fn: Callable[..., object], *args: Any) -> None:
        """Schedule `fn(*args)` on the loop (from any thread); nothing waits for it."""
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop and join its thread. Tasks still pending are dropped."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
        if not self._thread.is_alive() and not self.loop.is_closed():
            self.loop.close()
