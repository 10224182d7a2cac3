"""A client's updates that go through the controller, without I/O.

The client keeps one `ControlBook`: which updates
were asked for and await a directive, which wait for the controller to come
back, and what each controller event means for them. The clients only carry
the answers out: send a request, send an update to the server, resolve a
future. Callers serialise access (the client's event loop does).

Without its controller a worker trains unscheduled, so that is never silent
(issue 33): a warning when the controller is lost (or unreachable at
connect) and when the first update goes without it, the client's metrics
(`controller_unreachable`, `controller_fallback_updates`), and, once the
controller is back, a `FellBack` report of what went without it, which
`mlfabric status` shows. A controller that refuses the worker is no outage:
`refuse` fails the worker's pushes with its reason instead.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import kernels
from ..errors import ConfigError, ConnectionLost, MlfabricError, PushTimeout, ServerError
from ..runtime.metrics import ClientMetrics
from ..wire.protocol import (
    Directive,
    FellBack,
    TransferDone,
    TransferProgress,
    TransferRequest,
)
from .outcome import PushOutcome

log = logging.getLogger("mlfabric.client")

FALLBACKS = ("fifo", "wait")
RECONNECT_EVERY = 0.5  # seconds between attempts to reach a lost controller
AGGREGATOR_DIAL_TIMEOUT = 2.0  # seconds; past it, a member goes straight to the server
AGGREGATOR_COMMAND = "mlfabric agent --aggregate"  # what runs one, for dial errors


@dataclass
class ControlledUpdate:
    arrays: dict[str, np.ndarray]
    base_version: int
    nbytes: int
    norm: float
    future: Any  # concurrent.futures.Future or asyncio.Future of a PushOutcome
    requested: float = field(default_factory=time.monotonic)
    creq: int | None = None  # the controller's request id, once asked
    uid: str | None = None  # unique: a server applies it at most once
    # Set by a "go" through an aggregator (cleared when it fails the update):
    via: str | None = None
    member: dict[str, Any] = field(default_factory=dict)  # group, fan_in, index
    via_failed: str | None = None  # why the aggregator did not deliver it
    sent: float | None = None  # when it was first sent (a re-send keeps it)
    # A chunked transfer: the data bytes the controller let go so far (None:
    # all), and once its first chunk is sent, the frame that sends the rest
    # (a `link.PartFrame`).
    upto: int | None = None
    part: Any = None
    codec: str | None = None  # the compressed form its go named (None: the client's own)
    pace: float | None = None  # bytes/s its go holds it to (None: as TCP allows) ...
    pace_seconds: float | None = None  # ... for so long from its go (None: until answered)
    # Its go's ticket, and the transfers the server is to apply first, for
    # at most so long (the push carries them: `protocol.Push.after`).
    order: dict[str, Any] = field(default_factory=dict)

    @property
    def in_parts(self) -> bool:
        """Part of its frame is sent and the rest waits for the controller:
        it can no longer be withdrawn, only finished."""
        return self.part is not None and not self.part.whole


def controlled_update(arrays: dict[str, np.ndarray], base_version: int, nbytes: int,
                      future: Any) -> ControlledUpdate:
    """Copy the arrays (they are sent later; the caller may reuse its own) and
    take the update's norm for the controller."""
    copies = {n: a.copy() for n, a in arrays.items()}
    norm = kernels.norm_of(a.reshape(-1) for a in copies.values())  # as the server does
    return ControlledUpdate(copies, base_version, nbytes, norm, future)


class ControlBook:
    def __init__(self, address: str, *, host: str, dst: str, fallback: str,
                 timeout: float, shard: int = 0, chunk: int = 0,
                 metrics: ClientMetrics | None = None) -> None:
        """`shard`: the index of the server shard this client's transfers go
        to. `chunk` > 0: the controller may let them go that many bytes at a
        time. `metrics`: the client's, which count the time and the updates
        without the controller."""
        if fallback not in FALLBACKS:
            raise ConfigError(f"controller fallback must be one of {FALLBACKS}, got {fallback!r}")
        self.address = address
        self.host = host
        self.dst = dst
        self.fallback = fallback
        self.timeout = timeout
        self.connected = False
        self.closed = False
        self._ids = itertools.count(1)
        self._asked: dict[int, ControlledUpdate] = {}  # waiting for a directive
        self._orphans: list[ControlledUpdate] = []  # waiting for the controller to return
        self._warned = False
        self.shard = shard
        self.chunk = chunk
        # The compressed forms this worker offers the controller, (codec,
        # bytes, encode seconds), from the least compressed
        # (compression="adaptive").
        self.options: tuple[tuple[str, int, float], ...] = ()
        self._uid_prefix = secrets.token_hex(8)
        self._uids = itertools.count(1)
        self._failed_aggregators: set[str] = set()  # warned about once each
        self.metrics = metrics
        self.ever_connected = False
        self.down_since: float | None = None  # when the controller was lost, while it is
        # Since connect: updates sent straight to the server without the
        # controller, and the time without it up to its last return.
        self.fell_back_updates = 0
        self.fell_back_seconds = 0.0
        # Set when the controller refused this worker: every push fails with it.
        self.refusal: MlfabricError | None = None
        # Set from a controller's Moved (another plans this shard) until the
        # next one answers or cannot be reached.
        self.moving = False

    def ask(self, u: ControlledUpdate) -> TransferRequest:
        u.creq = next(self._ids)
        self._asked[u.creq] = u
        return TransferRequest(req=u.creq, host=self.host, dst=self.dst, nbytes=u.nbytes,
                               base_version=u.base_version, norm=u.norm, shard=self.shard,
                               chunk=self.chunk, options=self.options or None)

    def place(self, u: ControlledUpdate) -> tuple[TransferRequest | None, list[ControlledUpdate]]:
        """A new update: the request to send the controller, or (without one)
        the updates to send to the server now."""
        if self.refusal is not None:
            raise self.refusal
        if self.closed:
            raise ConnectionLost("the client is closed")
        u.uid = f"{self._uid_prefix}-{next(self._uids)}"
        u.future.uid = u.uid  # for the clients' pull(including=...)
        if self.connected:
            return self.ask(u), []
        if self.moving:  # another controller is being dialled: ask it
            self._orphans.append(u)
            return None, []
        return None, self._without_controller([u])

    def _without_controller(self, updates: list[ControlledUpdate]) -> list[ControlledUpdate]:
        if not updates:
            return []
        if self.fallback == "wait":
            self._orphans.extend(updates)
            return []
        if not self._warned:
            log.warning("controller %s unreachable: sending updates at once (fifo) until it "
                        "is back, unscheduled (counted in "
                        "mlfabric_client_controller_fallback_updates_total)", self.address)
            self._warned = True
        for u in updates:
            u.creq = None
        self.fell_back_updates += len(updates)
        if self.metrics is not None:
            self.metrics.controller_fallback_updates.inc(len(updates))
        return updates

    def directive(self, d: Directive, last_version: int
                  ) -> tuple[ControlledUpdate | None, PushOutcome | None]:
        """(update to send now, None) for go; (update, its outcome) for a drop."""
        u = self._asked.pop(d.req, None)
        if u is None:
            log.warning("controller sent a directive for unknown request %d", d.req)
            return None, None
        if u.part is not None:
            # The next chunk of a transfer under way (a drop cannot stop it:
            # its frame is part sent; the controller never sends one).
            u.upto = d.upto if d.action == "go" else None
            return u, None
        if d.action == "go":
            u.upto = d.upto
            u.codec = d.codec
            u.pace, u.pace_seconds = d.pace, d.pace_seconds
            u.order = {k: v for k, v in (("ticket", d.ticket), ("after", d.after),
                                         ("after_seconds", d.after_seconds)) if v is not None}
            if d.via is not None:
                u.via = d.via
                u.member = {"group": d.group, "fan_in": d.fan_in, "index": d.index}
            return u, None
        return u, PushOutcome(applied=False, version=last_version, delay=None,
                              reason=f"dropped by the controller: {d.reason}",
                              base_version=u.base_version)

    def next_chunk(self, u: ControlledUpdate) -> TransferProgress:
        """`u`'s grant so far has been sent: it waits for the next one (the
        report to send the controller once those bytes have left)."""
        assert u.creq is not None and u.part is not None
        self._asked[u.creq] = u
        return TransferProgress(req=u.creq, sent=u.part.sent)

    def finished_alone(self, u: ControlledUpdate) -> TransferProgress | None:
        """`u` was sent whole without waiting for the controller's grants
        (its frame could not wait): the report that says so, if asked for."""
        if u.creq is None:
            return None
        self._asked.pop(u.creq, None)
        return TransferProgress(req=u.creq, sent=u.nbytes)

    def lost(self, exc: BaseException | None, now: float | None = None
             ) -> list[ControlledUpdate]:
        """The controller went away, or could not be reached at connect: the
        updates to send to the server now (those sent in part among them,
        whatever the fallback: the rest of their frame holds up the server's
        link)."""
        self.connected = False
        stranded = list(self._asked.values())
        self._asked.clear()
        if self.moving:  # the controller named could not be reached either
            self.moving = False
            stranded += self._orphans
            self._orphans = []
        if self.closed:
            return [u for u in stranded if u.in_parts]
        if self.down_since is None:
            self.down_since = time.monotonic() if now is None else now
            if self.metrics is not None:
                self.metrics.controller_unreachable.inc()
        if self.ever_connected:
            log.warning("lost the controller %s (%s); %d updates waiting", self.address, exc,
                        len(stranded))
        else:  # (with fallback "wait", connect() raises instead)
            log.warning("controller %s unreachable at connect (%s): pushes go straight to the "
                        "server, unscheduled (controller_fallback 'fifo'), until it answers "
                        "(dialled every %g s)", self.address, exc, RECONNECT_EVERY)
        for u in stranded:
            u.upto = None
        return ([u for u in stranded if u.in_parts]
                + self._without_controller([u for u in stranded if not u.in_parts]))

    def moved(self) -> list[ControlledUpdate]:
        """The controller said another one plans this shard, and is closing
        the link. Not an outage: the updates that waited for its directive
        wait for the next controller's (asked again once it answers; no
        fallback meanwhile). Returns those sent in part, to finish now
        (their frame holds up the server's link)."""
        self.connected, self.moving = False, True
        stranded = list(self._asked.values())
        self._asked.clear()
        for u in stranded:
            u.upto = None
        self._orphans.extend(u for u in stranded if not u.in_parts)
        return [u for u in stranded if u.in_parts]

    def reconnected(self, now: float | None = None) -> list[FellBack | TransferRequest]:
        """The controller answers (again): what to send it, first a report
        of the time and updates without it if there was any, then requests
        for the updates that waited for it."""
        self.connected, self._warned, self.ever_connected = True, False, True
        self.moving = False
        report: list[FellBack | TransferRequest] = []
        if self.down_since is not None:
            down = max(0.0, (time.monotonic() if now is None else now) - self.down_since)
            self.down_since = None
            self.fell_back_seconds += down
            if self.metrics is not None:
                self.metrics.controller_unreachable.dec()
            log.warning("controller %s answers after %.1f s without it; %d updates went "
                        "straight to the server since connect", self.address, down,
                        self.fell_back_updates)
            report.append(FellBack(updates=self.fell_back_updates,
                                   seconds=self.fell_back_seconds))
        orphans, self._orphans = self._orphans, []
        if orphans:
            log.info("controller %s is back; %d waiting updates re-requested", self.address,
                     len(orphans))
        return report + [self.ask(u) for u in orphans]

    def refuse(self, exc: MlfabricError) -> list[ControlledUpdate]:
        """The controller refused this worker (a setting of one of them is
        wrong): no fallback, every push fails with `exc` from now on. The
        updates that waited for it, to fail with `exc` (those sent in part
        are finished by the server's answer)."""
        self.refusal = exc
        self.connected = False
        waiting = [*(u for u in self._asked.values() if not u.in_parts), *self._orphans]
        self._asked.clear()
        self._orphans = []
        return waiting

    def expired(self, now: float) -> list[tuple[ControlledUpdate, ConnectionLost]]:
        """Updates that waited for the controller longer than the timeout."""
        keep, gone = [], []
        for u in self._orphans:
            if now - u.requested <= self.timeout:
                keep.append(u)
            else:
                gone.append((u, ConnectionLost(
                    f"the controller {self.address} was unreachable for {self.timeout:.0f} s; "
                    f"this update was not sent")))
        self._orphans = keep
        return gone

    def overdue(self, now: float, timeout: float
                ) -> list[tuple[ControlledUpdate, TransferDone, PushTimeout]]:
        """Updates asked for more than `timeout` seconds ago with no directive
        yet: withdrawn (a late directive for one is ignored), each with the
        report that tells the controller to forget it and the error to fail
        it with."""
        # One sent in part is past withdrawing: the server's answer (or its
        # own push_timeout there) ends it.
        late = [u for u in self._asked.values()
                if now - u.requested > timeout and not u.in_parts]
        out = []
        for u in late:
            assert u.creq is not None
            del self._asked[u.creq]
            out.append((u, TransferDone(req=u.creq, applied=False, version=0, delay=None,
                                        seconds=0.0),
                        PushTimeout(f"the controller {self.address} gave no directive for this "
                                    f"update within {timeout:g} s (push_timeout): it was not "
                                    f"sent; see `mlfabric status` for what the controller is "
                                    f"waiting on, and raise push_timeout if the job's transfers "
                                    f"are this slow")))
        return out

    def close(self) -> list[tuple[ControlledUpdate, ConnectionLost]]:
        """Updates that will never be sent, with the error to fail them with."""
        self.closed, self.connected = True, False
        if self.down_since is not None and self.metrics is not None:
            self.metrics.controller_unreachable.dec()  # this client no longer counts
        self.down_since = None
        waiting = [*(u for u in self._asked.values() if not u.in_parts), *self._orphans]
        self._asked.clear()
        self._orphans = []
        return [(u, ConnectionLost("the client was closed before the controller let this "
                                   "update go")) for u in waiting]

    def member_fields(self, u: ControlledUpdate, server: str) -> dict[str, Any]:
        """The push fields of `u` as a member of its group at the aggregator."""
        return {"uid": u.uid, "dst": server, **u.member}

    def via_failed(self, u: ControlledUpdate, exc: BaseException) -> None:
        """The aggregator did not deliver `u` (it failed it, or died), or the
        server refused its aggregate: `u` now goes straight to the server with
        its uid, so it is applied once whether or not the aggregate was (the
        server remembers uids). Only a failure of the aggregator is reported
        to the controller as one (`via_failed`)."""
        via, u.via, u.member = u.via, None, {}
        if isinstance(exc, ServerError) and exc.code == "aggregate_refused":
            log.info("the server refused the aggregate update %s was part of: sending it "
                     "straight to the server", u.uid)
            return
        u.via_failed = f"{type(exc).__name__}: {exc}"[:200]
        if via not in self._failed_aggregators:
            self._failed_aggregators.add(str(via))
            log.warning("aggregator %s did not deliver an update (%s): sending it straight to "
                        "the server; the controller is told", via, u.via_failed)

    @staticmethod
    def report(u: ControlledUpdate, outcome: PushOutcome, seconds: float) -> TransferDone | None:
        if u.creq is None:
            return None  # sent without the controller: nothing to report
        # A member of an aggregate says so: the divergence gate counts the
        # aggregate as one step of k versions.
        fan_in = outcome.fan_in if outcome.applied and (outcome.fan_in or 1) > 1 else None
        return TransferDone(req=u.creq, applied=outcome.applied, version=outcome.version,
                            delay=outcome.delay, seconds=seconds, via_failed=u.via_failed,
                            fan_in=fan_in)

    @staticmethod
    def report_failed(u: ControlledUpdate, seconds: float) -> TransferDone | None:
        """The transfer ended without an outcome (the connection was lost,
        or the server did not answer within push_timeout): the controller
        must not keep it in flight for ever. Reported as not applied (as far
        as anyone knows)."""
        if u.creq is None:
            return None
        return TransferDone(req=u.creq, applied=False, version=0, delay=None, seconds=seconds,
                            via_failed=u.via_failed)
