"""Event-loop choice: uvloop when installed (the default), else asyncio's."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from ..errors import ConfigError
from ..wire.protocol import ScatteredBlock, expand_parts
from ._sendv import rest, sendv

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


async def within(aw: Awaitable[T], seconds: float | None) -> T:
    """``asyncio.wait_for`` without its Python 3.11 flaw: there, a cancel that
    lands just as `aw` completes is lost (cpython issue 86296, fixed in 3.12),
    so a task in a polling loop may never stop. ``asyncio.timeout`` counts
    cancels and keeps every one. Raises TimeoutError after `seconds`."""
    async with asyncio.timeout(seconds):
        return await aw


# A frame's parts (header, tensors, padding) are written as they are when
# large, so tensors are not copied; runs of small neighbours are joined into
# writes of up to this many bytes, so a model of 1,000 small tensors is a few
# dozen writes (each may be a send() syscall), not two thousand.
JOIN_LIMIT = 1 << 16


def write_parts(transport: asyncio.WriteTransport, parts: list[Any]) -> int:
    """Write a frame's parts in order; returns the bytes written. A frame
    whose data block is a `ScatteredBlock` goes out straight from its arrays
    (`_write_scattered`)."""
    if parts and isinstance(parts[-1], ScatteredBlock):
        return _write_scattered(transport, parts)
    total = 0
    run: list[Any] = []
    run_size = 0
    for part in parts:
        n = len(part)
        total += n
        if n >= JOIN_LIMIT:
            if run:
                transport.write(b"".join(run) if len(run) > 1 else run[0])
                run, run_size = [], 0
            transport.write(part)
            continue
        run.append(part)
        run_size += n
        if run_size >= JOIN_LIMIT:
            transport.write(b"".join(run))
            run, run_size = [], 0
    if run:
        transport.write(b"".join(run) if len(run) > 1 else run[0])
    return total


def _write_scattered(transport: asyncio.WriteTransport, parts: list[Any]) -> int:
    """A frame of a head and a `ScatteredBlock`: when nothing is queued on a
    plain TCP transport, one sendmsg straight from the arrays hands the
    socket what it takes (the transport would send at once too, and the
    stream's order holds), and only what it does not take is copied and
    queued. Otherwise the pieces are queued as buffers."""
    block: ScatteredBlock = parts[-1]
    head = b"".join(parts[:-1])
    size = len(head) + len(block)
    sock = transport.get_extra_info("socket")
    if (sock is None or transport.get_write_buffer_size() or transport.is_closing()
            or transport.get_extra_info("sslcontext") is not None):
        return write_parts(transport, expand_parts([head, block]))
    plan = block.plan
    try:
        sent = sendv(sock.fileno(), head, block.arrays, plan.index, plan.starts,
                     plan.lengths, plan.offsets, plan.total)
    except OSError:
        # The transport meets the same error on its next write and reports
        # the connection lost the usual way.
        return write_parts(transport, expand_parts([head, block]))
    if sent < len(head):
        transport.write(head[sent:])
    if sent < len(head) + plan.total:
        transport.write(rest(block.arrays, plan.index, plan.starts, plan.lengths,
                             plan.offsets, plan.total, max(0, sent - len(head))))
    if block.trailer:  # the frame's MAC (wire.protocol: protected connections)
        transport.write(block.trailer)
    return size
