"""An asyncio client's link to the job's controller.

The same behaviour as mlfabric.client_control (see there), on the event
loop: push() asks the controller, sends on go, reports the outcome; a drop
resolves the future with the reason; without the controller, updates go at
once with a warning (fallback "fifo") or wait for it up to `timeout` seconds
(fallback "wait").
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _core
from .client_control import FALLBACKS
from .client_core import Handshake
from .errors import ConfigError, ConnectError, ConnectionLost, MlfabricError
from .outcome import PushOutcome
from .protocol import Directive, TransferDone, TransferRequest

log = logging.getLogger("mlfabric.client")

_RECONNECT_EVERY = 0.5


@dataclass
class _Entry:
    arrays: dict[str, np.ndarray]
    base_version: int
    nbytes: int
    norm: float
    future: asyncio.Future[PushOutcome]
    requested: float = field(default_factory=time.monotonic)
    creq: int | None = None


class AsyncControlledPushes:
    def __init__(self, client: Any, address: str, hs: Handshake, *, host: str, dst: str,
                 fallback: str = "fifo", timeout: float = 30.0) -> None:
        if fallback not in FALLBACKS:
            raise ConfigError(f"controller fallback must be one of {FALLBACKS}, got {fallback!r}")
        self.client = client
        self.address = address
        self.hs = hs
        self.host = host
        self.dst = dst
        self.fallback = fallback
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._asked: dict[int, _Entry] = {}
        self._orphans: list[_Entry] = []
        self._link: Any = None
        self._reconnect_task: asyncio.Task[None] | None = None
        self._closed = False
        self._warned = False

    async def start(self) -> None:
        try:
            self._link = await self._connect()
        except (OSError, MlfabricError) as exc:
            if self.fallback == "wait":
                raise ConnectError(
                    f"cannot reach the controller at {self.address}: {exc}; is `mlfabric "
                    f"controller` running there?") from None
            self._lost(None, exc)

    async def _connect(self) -> Any:
        from .aio import open_link

        return await open_link(self.address, self.hs, min(self.timeout, 10.0), "controller",
                               on_event=self._directive, on_lost=self._lost)

    # -- push -----------------------------------------------------------------------

    def push(self, arrays: dict[str, np.ndarray], base_version: int, nbytes: int
             ) -> asyncio.Future[PushOutcome]:
        if self._closed:
            raise ConnectionLost("the client is closed")
        copies = {n: a.copy() for n, a in arrays.items()}
        norm = math.sqrt(sum(_core.l2_norm(a.reshape(-1)) ** 2 for a in copies.values()))
        entry = _Entry(copies, base_version, nbytes, norm,
                       asyncio.get_running_loop().create_future())
        if self._link is None:
            self._without_controller([entry])
        else:
            self._ask(entry)
        return entry.future

    def _ask(self, entry: _Entry) -> None:
        entry.creq = next(self._ids)
        self._asked[entry.creq] = entry
        self._link.send(TransferRequest(req=entry.creq, host=self.host, dst=self.dst,
                                        nbytes=entry.nbytes, base_version=entry.base_version,
                                        norm=entry.norm))

    def _without_controller(self, entries: list[_Entry]) -> None:
        if not entries:
            return
        if self.fallback == "fifo":
            if not self._warned:
                log.warning("controller %s unreachable: sending updates at once (fifo) "
                            "until it is back", self.address)
                self._warned = True
            for e in entries:
                e.creq = None
                self._send(e)
        else:
            self._orphans.extend(entries)

    # -- controller events ------------------------------------------------------------

    def _directive(self, d: Any) -> None:
        if not isinstance(d, Directive):
            raise MlfabricError(f"controller sent {type(d).__name__}")
        entry = self._asked.pop(d.req, None)
        if entry is None:
            log.warning("controller sent a directive for unknown request %d", d.req)
        elif d.action == "go":
            self._send(entry)
        elif not entry.future.done():
            entry.future.set_result(PushOutcome(
                applied=False, version=self.client.last_version, delay=None,
                reason=f"dropped by the controller: {d.reason}",
                base_version=entry.base_version))

    def _lost(self, link: Any, exc: BaseException | None) -> None:
        if link is not None and link is not self._link:
            return
        self._link = None
        stranded = list(self._asked.values())
        self._asked.clear()
        if self._closed:
            return
        log.warning("lost the controller %s (%s); %d updates waiting", self.address, exc,
                    len(stranded))
        self._without_controller(stranded)
        if self._reconnect_task is None:
            self._reconnect_task = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        while not self._closed:
            await asyncio.sleep(_RECONNECT_EVERY)
            self._expire_orphans()
            try:
                link = await self._connect()
            except (OSError, MlfabricError):
                continue
            self._link, self._reconnect_task, self._warned = link, None, False
            orphans, self._orphans = self._orphans, []
            for e in orphans:
                self._ask(e)
            log.info("controller %s is back; %d waiting updates re-requested", self.address,
                     len(orphans))
            return

    def _expire_orphans(self) -> None:
        now = time.monotonic()
        keep = []
        for e in self._orphans:
            if now - e.requested <= self.timeout:
                keep.append(e)
            elif not e.future.done():
                e.future.set_exception(ConnectionLost(
                    f"the controller {self.address} was unreachable for {self.timeout:.0f} s; "
                    f"this update was not sent"))
        self._orphans = keep

    # -- sending ------------------------------------------------------------------------

    def _send(self, entry: _Entry) -> None:
        started = time.monotonic()
        try:
            server_future = self.client._send_push(entry.arrays, entry.base_version)
        except MlfabricError as exc:
            if not entry.future.done():
                entry.future.set_exception(exc)
            return
        server_future.add_done_callback(lambda f: self._finish(entry, f, started))

    def _finish(self, entry: _Entry, server_future: asyncio.Future[Any], started: float) -> None:
        if entry.future.done():
            return
        if server_future.cancelled():
            entry.future.cancel()
            return
        exc = server_future.exception()
        if exc is not None:
            entry.future.set_exception(exc)
            return
        outcome: PushOutcome = server_future.result()
        if entry.creq is not None and self._link is not None:
            self._link.send(TransferDone(req=entry.creq, applied=outcome.applied,
                                         version=outcome.version, delay=outcome.delay,
                                         seconds=time.monotonic() - started))
        entry.future.set_result(outcome)

    async def close(self) -> None:
        self._closed = True
        if self._reconnect_task is not None:
            self._reconnect_task.cancel()
        link, self._link = self._link, None
        for e in [*self._asked.values(), *self._orphans]:
            if not e.future.done():
                e.future.set_exception(ConnectionLost(
                    "the client was closed before the controller let this update go"))
        self._asked.clear()
        self._orphans = []
        if link is not None:
            link.close()
            await link.closed
