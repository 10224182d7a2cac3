"""An asyncio client's link to the job's controller.

push() asks the controller, sends on go (straight to the server, or through
the aggregator the controller names), reports the outcome; a drop resolves
the future with the reason; without the controller, updates go at once with
a warning (fallback "fifo") or wait for it up to `timeout` seconds (fallback
"wait"), and the link is dialled again every few seconds. `ControlBook`
decides; this class does the I/O on the client's event loop (the blocking
client runs the same client on a thread).

A job may have several controllers (issue 34), each planning some server
shards: `address` then lists them all ("HOST:PORT,HOST:PORT,..."), and a
shard's link dials the one the shard is first offered to (shard s: the
(s mod N)-th), and whichever one a controller names in a `Moved` answer.
A move is no outage: the updates waiting for a directive wait for the next
controller and are asked again there. When a controller stops answering,
the link dials the next one in the list, which is the one that takes the
shard over.

Only a controller that does not answer is an outage. One that refuses the
worker (another job's, a wrong token, or a refusal after the handshake), or
an address that is no controller (a server's, an agent's, a metrics port),
is a misconfiguration: an error at connect, or every push's error later,
never a silent switch to unscheduled training (issue 33).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
import time
from typing import Any

import numpy as np

from ..errors import ConfigError, ConnectError, MlfabricError
from ..runtime.metrics import ClientMetrics
from ..wire.handshake import ClientHandshake
from ..wire.protocol import Directive, Error, Failover, Moved, ReplicaAt, ReplicaDone, ShardAt
from .control_book import (
    RECONNECT_EVERY,
    ControlBook,
    ControlledUpdate,
    controlled_update,
)
from .core import parse_address
from .futures import AsyncPushFuture
from .link import Link, LinkPool, open_link
from .outcome import PushOutcome
from .seams import ControlledClient, PushLink

log = logging.getLogger("mlfabric.client")


class AsyncControlledPushes:
    """Pushes of one asyncio client that go through the controller: the
    ControlBook decides, this class does the I/O on the event loop."""

    def __init__(self, client: ControlledClient, address: str, hs: ClientHandshake, *,
                 aggregators: LinkPool[PushLink], host: str, dst: str,
                 fallback: str = "fifo", timeout: float = 30.0,
                 shard: int | None = None, chunk: int = 0,
                 metrics: ClientMetrics | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        """`aggregators`: the links to the aggregators the controller may route
        pushes through, dialled by the client. `shard`: this client's shard
        of a sharded job (announced on every link to the controller), else
        None. `chunk` > 0: the controller may let an update go that many
        bytes at a time (a sharded job's chunk), so that a shorter transfer
        can pass it. `metrics`: the client's (time and updates without the
        controller). `tls`: the client's TLS context, for the controller link."""
        self.addresses = controller_addresses(address)
        self._at = (shard or 0) % len(self.addresses)  # the one dialled
        self.book = ControlBook(self.address, host=host, dst=dst, fallback=fallback,
                                timeout=timeout, shard=shard or 0,
                                chunk=chunk, metrics=metrics)
        self.sharded = shard is not None
        self._aggregators = aggregators
        self.client = client
        self._moved_last = False  # a controller sent this link on; nothing decided since
        self._gone: str | None = None  # the controller last lost or not reached
        self.hs = hs
        self.tls = tls
        self._link: Link | None = None
        self._reconnect_task: asyncio.Task[None] | None = None
        self._redial_error = ""  # the last refusal met dialling again, warned once
        # The paced updates on the server link (their goes' `pace`): the link
        # is paced while any is unanswered, at the latest one's rate.
        self._paced: set[int] = set()
        self._pace_refused = False  # the platform cannot pace: said once

    @property
    def address(self) -> str:
        """The controller this link dials."""
        return self.addresses[self._at]

    def _dial(self, index: int) -> None:
        self._at = index % len(self.addresses)
        self.book.address = self.address

    async def start(self) -> None:
        """Dial the controller (with several, each in turn until one
        answers). Any answer but a welcome raises (a refusal, another kind
        of process, a protocol error): those are settings to fix, not an
        outage. Where nothing answers (refused, unreachable, or no handshake
        in time: the controller is down, or not started yet), fallback
        "fifo" goes on without it, loudly, and "wait" raises."""
        for tried in range(len(self.addresses)):
            try:
                self._link = await self._connect()
            except ConnectError as exc:
                if tried + 1 < len(self.addresses):
                    self._dial(self._at + 1)
                    continue
                if self.book.fallback == "wait":
                    raise
                self._lost(None, exc)
            else:
                self.book.reconnected()
            return

    async def _connect(self) -> Link:
        link = await open_link(self.address, self.hs, min(self.book.timeout, 10.0),
                               "controller", on_event=self._directive, on_lost=self._lost,
                               tls=self.tls)
        if self.sharded:  # so that `mlfabric status` lists every shard from the start
            link.send(ShardAt(shard=self.book.shard, dst=self.book.dst,
                              version=self.client.last_version))
        # Every aggregator the controller may route through, dialled ahead
        # of use (a member then does not wait for the handshake).
        for address in link.welcomed.result().aggregators:
            self._aggregators.ahead(address)
        return link

    def aggregators_offered(self) -> bool:
        """The controller's welcome named aggregators it may route through."""
        return self._link is not None and bool(self._link.welcomed.result().aggregators)

    def push(self, arrays: dict[str, np.ndarray], base_version: int, nbytes: int
             ) -> AsyncPushFuture:
        u = controlled_update(arrays, base_version, nbytes,
                              AsyncPushFuture(loop=asyncio.get_running_loop()))
        request, now = self.book.place(u)
        if request is not None and self._link is not None:
            self._link.send(request)
        for x in now:
            self._send(x)
        return u.future

    # -- controller events ------------------------------------------------------------

    def expire(self, timeout: float) -> None:
        """Withdraw the updates that have waited for a directive longer than
        `timeout` seconds, and fail them (the client's push_timeout)."""
        for u, report, exc in self.book.overdue(time.monotonic(), timeout):
            if self._link is not None:
                self._link.send(report)
            if not u.future.done():
                u.future.set_exception(exc)

    def report_replicated(self, dst: str, version: int) -> None:
        """Tell the controller the replica at `dst` applied `version`."""
        if self._link is not None:
            self._link.send(ReplicaDone(dst=dst, version=version))

    def _directive(self, d: Any) -> None:
        if isinstance(d, (Failover, ReplicaAt)):
            self.client.replica_change(d)
            return
        if isinstance(d, Moved):
            self._moved(d)
            return
        if isinstance(d, Error):
            exc = ConfigError(f"the controller at {self.address} refused this worker: "
                              f"{d.message}")
            if d.code == "internal":  # its own bug, not a setting: an outage
                raise MlfabricError(str(exc))
            for waiting in self.book.refuse(exc):
                if not waiting.future.done():
                    waiting.future.set_exception(exc)
            raise exc  # the link closes: no fallback, no dialling again (see _lost)
        if not isinstance(d, Directive):
            raise MlfabricError(f"controller sent {type(d).__name__}")
        self._moved_last, self._gone = False, None
        u, outcome = self.book.directive(d, self.client.last_version)
        if u is None:
            return
        if outcome is None:
            self._send(u)
        elif not u.future.done():
            if self.client.dropped(u.arrays):  # with compression: kept for the next push
                outcome = dataclasses.replace(
                    outcome, folded=True,
                    reason=f"{outcome.reason}; folded into the next push (compression's "
                           f"error feedback)")
            u.future.set_result(outcome)

    def _moved(self, d: Moved) -> None:
        """The controller says another plans this link's shard; it closes
        the link next. Dial the one it names at once, unless the last move
        was not followed by any decision (two controllers that disagree for
        a moment are then dialled every RECONNECT_EVERY, not in a loop).
        Without a name, or naming the controller this link just lost (its
        lease has not run out yet), the shard is being taken over, and by
        this controller: the next in the list after the lost one, as this
        link dials them. It is asked again after the reconnect interval."""
        was = self.address
        if d.owner in self.addresses and d.owner != self._gone:
            self._dial(self.addresses.index(d.owner))
        elif d.owner and d.owner not in self.addresses:
            log.warning("controller %s says controller %s plans shard %d, but this worker "
                        "was not given it (controller setting %s): give every worker the "
                        "same list as the controllers' --controllers", was, d.owner,
                        d.shard, ",".join(self.addresses))
            self._dial(self._at + 1)
        at_once = bool(d.owner) and self.address != was and not self._moved_last
        self._moved_last = True
        log.info("controller %s: shard %d is planned by %s; dialling %s", was, d.shard,
                 d.owner or "no controller yet", self.address)
        if at_once:  # the book keeps the waiting updates for it (book.moving)
            for u in self.book.moved():
                self._send(u)

    def _lost(self, link: Any, exc: BaseException | None) -> None:
        if link is not None and link is not self._link:
            return
        self._link = None
        if self.book.refusal is not None:
            return
        if not self._moved_last:  # lost, not sent on: do not dial it again at once
            self._gone = self.address
        if self.book.moving and not self.book.closed:
            if self._reconnect_task is None:
                self._reconnect_task = asyncio.get_running_loop().create_task(
                    self._reconnect(at_once=True))
            return
        for u in self.book.lost(exc):
            self._send(u)
        if self._reconnect_task is None and not self.book.closed:
            self._reconnect_task = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self, at_once: bool = False) -> None:
        """Dial until a controller answers: every RECONNECT_EVERY seconds,
        the next in the list each time. `at_once`: a controller named the
        one to dial (a move, no outage yet): the first try is now, and only
        if it fails do the waiting updates fall back."""
        while not self.book.closed:
            if not at_once:
                await asyncio.sleep(RECONNECT_EVERY)
            for u, exc in self.book.expired(time.monotonic()):
                if not u.future.done():
                    u.future.set_exception(exc)
            try:
                link = await self._connect()
            except (OSError, MlfabricError) as exc:
                if at_once:  # the controller named is not there: an outage after all
                    at_once = False
                    for u in self.book.lost(exc):
                        self._send(u)
                if len(self.addresses) > 1:
                    self._gone = self.address
                    self._dial(self._at + 1)
                # Not answering is the outage itself; an answer that is not a
                # welcome (the controller restarted with another token or
                # job, another process took its port) is said, once each.
                if not isinstance(exc, ConnectError) and str(exc) != self._redial_error:
                    self._redial_error = str(exc)
                    log.warning("cannot rejoin the controller: %s (pushes go on as "
                                "controller_fallback %r says)", exc, self.book.fallback)
                continue
            self._link, self._reconnect_task = link, None
            for event in self.book.reconnected():
                link.send(event)
            return

    # -- sending ------------------------------------------------------------------------

    def _send(self, u: ControlledUpdate) -> None:
        if u.part is not None:  # the next chunk of a transfer under way, or all the rest
            u.part.advance(u.part.total if u.upto is None else u.upto)
            self._chunk_sent(u)
            return
        if u.sent is None:
            u.sent = time.monotonic()
        if u.via is not None:
            asyncio.get_running_loop().create_task(self._send_member(u))
            return
        if u.pace is not None:
            self._pace(u)
        try:
            codec: dict[str, Any] = {} if u.codec is None else {"codec": u.codec}
            server_future, u.part = self.client.send_push_part(u.arrays, u.base_version,
                                                               u.upto, uid=u.uid, **codec,
                                                               **u.order)
        except MlfabricError as exc:
            if not u.future.done():
                u.future.set_exception(exc)
            return
        sent_as = getattr(server_future, "sent_as", None)
        if sent_as is not None:  # compressed as it left: these parts, if it goes again
            u.future.sent_as = u.arrays = sent_as
        server_future.add_done_callback(lambda f: self._finish(u, f, u.sent or 0.0))
        if u.upto is not None and u.part is None:
            # Another frame is under way on the link: this one goes whole after it.
            report = self.book.finished_alone(u)
            if report is not None and self._link is not None:
                self._link.send(report)
        elif u.part is not None:
            self._chunk_sent(u)

    def _pace(self, u: ControlledUpdate) -> None:
        """Hold the server link to `u`'s pace until its answer, or for its
        go's `pace_seconds` if that is sooner (`_unpace`)."""
        assert u.pace is not None
        if self.client.pace(u.pace):
            self._paced.add(id(u))
            if u.pace_seconds is not None:
                asyncio.get_running_loop().call_later(u.pace_seconds, self._unpace, u)
            if self.book.metrics is not None:
                self.book.metrics.paced_pushes.inc()
        elif not self._pace_refused:
            self._pace_refused = True
            log.warning("the controller paced a push at %.0f bytes/s, and this platform "
                        "cannot pace a socket (Linux's SO_MAX_PACING_RATE): it goes as fast "
                        "as TCP allows, and may crowd out one that must land first", u.pace)

    def _unpace(self, u: ControlledUpdate) -> None:
        if id(u) in self._paced:
            self._paced.discard(id(u))
            if not self._paced:
                self.client.pace(None)

    def _chunk_sent(self, u: ControlledUpdate) -> None:
        """A chunk of `u` is handed to the link: once its bytes have left,
        tell the controller, and wait for its next grant (nothing to do once
        all of `u` is sent: the server's answer ends it)."""
        if u.part.whole or u.future.done():
            return
        if self._link is None:  # the controller is gone: nobody to wait for
            u.part.advance(u.part.total)
            return
        report = self.book.next_chunk(u)

        async def when_sent() -> None:
            await self.client.flushed()
            if self._link is not None:
                self._link.send(report)

        asyncio.get_running_loop().create_task(when_sent())

    async def _send_member(self, u: ControlledUpdate) -> None:
        """To the aggregator the controller chose; straight to the server
        (same uid) if it cannot be reached."""
        assert u.via is not None
        # Whole, with what the residuals held (they are emptied into it): if
        # the aggregator fails it, the same values go straight to the server.
        u.arrays = self.client.with_residual(u.arrays)
        u.future.sent_as = u.arrays  # what a replica and a failover re-send take
        try:
            link = await self._aggregators.get(u.via)
            fut = link.send_push(u.arrays, u.base_version,
                                  **self.book.member_fields(u, self.client.address))
        except MlfabricError as exc:
            self.book.via_failed(u, exc)
            self._send(u)
            return
        fut.add_done_callback(lambda f: self._finish(u, f, u.sent or 0.0))

    def _finish(self, u: ControlledUpdate, server_future: asyncio.Future[Any],
                started: float) -> None:
        self._unpace(u)  # its bytes have all landed, or never will
        if u.in_parts:
            # Failed or cancelled before all of it was let go: finish the
            # frame all the same, or the link would stay in the middle of it.
            progress = self.book.finished_alone(u)
            u.part.advance(u.part.total)
            if progress is not None and self._link is not None:
                self._link.send(progress)
        if u.future.done():
            return
        if server_future.cancelled():
            u.future.cancel()
            return
        exc = server_future.exception()
        if exc is not None and u.via is not None and not self.book.closed:
            # The aggregator failed it (or died): straight to the server, same uid.
            self.book.via_failed(u, exc)
            self._send(u)
            return
        if exc is not None:
            report = ControlBook.report_failed(u, time.monotonic() - started)
            if report is not None and self._link is not None:
                self._link.send(report)
            u.future.set_exception(exc)
            return
        outcome: PushOutcome = server_future.result()
        report = ControlBook.report(u, outcome, time.monotonic() - started)
        if report is not None and self._link is not None:
            self._link.send(report)
        u.future.set_result(outcome)

    async def close(self) -> None:
        if self._reconnect_task is not None:
            self._reconnect_task.cancel()
        link, self._link = self._link, None
        await self._aggregators.close()
        for u, exc in self.book.close():
            if not u.future.done():
                u.future.set_exception(exc)
        if link is not None:
            link.close()
            await link.closed


def controller_addresses(address: str) -> list[str]:
    """The `controller` setting: one "HOST:PORT", or every controller of a
    job with several, "HOST:PORT,HOST:PORT,...", each checked."""
    addresses = [a.strip() for a in address.split(",")]
    if any(not a for a in addresses) or len(set(addresses)) != len(addresses):
        raise ConfigError(f"controller setting {address!r}: give HOST:PORT, or every "
                          f"controller of the job once each, separated by commas (the "
                          f"controllers' --controllers list)")
    for a in addresses:
        parse_address(a)
    return addresses
