"""Event-loop choice: uvloop when installed (the default), else asyncio's."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from .errors import ConfigError

T = TypeVar("T")

LOOP_ENV = "MLFABRIC_LOOP"  # "uvloop" (default when installed) or "asyncio"


def loop_factory(kind: str | None = None) -> Callable[[], asyncio.AbstractEventLoop]:
    kind = kind or os.environ.get(LOOP_ENV, "uvloop")
    if kind == "uvloop":
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
            return asyncio.new_event_loop
        return uvloop.new_event_loop
    if kind == "asyncio":
        return asyncio.new_event_loop
    raise ConfigError(f"{LOOP_ENV} must be 'uvloop' or 'asyncio', got {kind!r}: fix or unset it")


def run(coro: Coroutine[Any, Any, T], *, kind: str | None = None) -> T:
    """Run `coro` to completion on a new loop of the chosen kind."""
    try:
        factory = loop_factory(kind)
    except ConfigError:
        coro.close()  # never started: no "was never awaited" warning
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)
