"""Pulls for an update, held by the parameter server until the model
includes it, and streamed while that update is still arriving.

A worker that pushes and then needs the model with its update in it sends
`Pull(uid=..., wait=...)` right after the push. The server holds it. When a
staging (`store.StagedApply`) that applies `uid` begins, the server writes a
MODEL frame (`streamed=True`) to every such puller and sends each stretch of
the next weights as soon as it is computed; on commit it sends the rest and
`ModelEnd(ok=True)`. So the pulls leave the server while the update arrives,
instead of queueing on its uplink after it is applied.

If the staging turns void (NaN, the model moved on, the sender vanished),
the frame is completed with zeros and `ModelEnd(ok=False)`: the pull stays
open, and the update applied whole answers it with a plain MODEL. So does an
update applied whole from the start. A pull held `wait` seconds without its
update applied gets the model as it is; one the client cancels
(`PullCancel`: its update was dropped) is forgotten.

A connection carries one streamed frame at a time; its other answers queue
until the frame ends (`ServerProtocol.stream_begin`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..wire.protocol import Error, Model, ModelEnd, Pull
from ..wire.streamed import StreamedBlock
from .store import StagedApply

# Pulls one connection may have held at once: each is answered with a whole
# model when its update lands, whether or not the peer reads (issue 33: one
# client's 256 pipelined pulls held 4.2 GB). A worker holds one per push in
# flight.
MAX_HELD_PER_CONNECTION = 8


@dataclass(eq=False)
class _Waiter:
    proto: Any  # the server connection the pull came on
    req: int
    uid: str
    timer: asyncio.TimerHandle | None = None
    streaming: bool = False
    expired: bool = False  # held `wait` seconds: answered as soon as it is not streaming
    cancelled: bool = False  # the client gave up while it streamed: forgotten when it ends


@dataclass(eq=False)
class _Stream:
    staged: StagedApply
    waiters: list[_Waiter]
    block: StreamedBlock  # the data block every waiter receives, in step


class PullWaits:
    """The held pulls of one server, and the model stream of the current staging."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.store = server.store
        self.metrics = server.metrics
        self.waiting: dict[str, list[_Waiter]] = {}
        self.stream: _Stream | None = None

    def pull(self, proto: Any, event: Pull) -> None:
        """Hold `event` (which has a uid) until its update is applied."""
        assert event.uid is not None and event.wait is not None
        if self.store.applied_before(event.uid) is not None:
            self._answer(proto, event.req)
            return
        if len(proto.waits) >= MAX_HELD_PER_CONNECTION:
            proto.send(Error(code="too_many_pulls", req=event.req, message=(
                f"{len(proto.waits)} pulls for updates are held on this connection already "
                f"(at most {MAX_HELD_PER_CONNECTION}): wait for their answers")))
            return
        w = _Waiter(proto, event.req, event.uid)
        w.timer = asyncio.get_running_loop().call_later(event.wait, self._expire, w)
        self.waiting.setdefault(event.uid, []).append(w)
        proto.waits.append(w)
        self.metrics.pulls_held.inc()
        staged = self.store.staged
        if staged is not None and event.uid in staged.uids and staged.valid:
            self._join(staged, [w])

    def began(self, staged: StagedApply) -> None:
        """A staging began: stream its model to those waiting for its updates."""
        waiters = [w for uid in staged.uids for w in self.waiting.get(uid, ())]
        if waiters:
            self._join(staged, waiters)

    def fed(self) -> None:
        """The staging computed more: send what is now final."""
        s = self.stream
        if s is None or s.staged is not self.store.staged or not s.staged.valid:
            return
        end = s.block.final_prefix(s.staged.computed())
        if end > s.block.sent:
            data = s.block.from_arrays(self.store.spare, end)
            for w in s.waiters:
                w.proto.write_raw(data)

    def committed(self, staged: StagedApply) -> None:
        """`staged` was applied: the store's weights are the streamed model."""
        s = self.stream
        if s is not None and s.staged is staged:
            self.stream = None
            if not s.block.done:
                data = s.block.from_arrays(self.store.weights, s.block.total)
                for w in s.waiters:
                    w.proto.write_raw(data)
            for w in s.waiters:
                w.streaming = False
                self._forget(w)
                w.proto.stream_end(ModelEnd(req=w.req, ok=True))
            self.metrics.pulls_streamed.inc(len(s.waiters))
        self.applied(staged.uids)

    def voided(self) -> None:
        """The staging being streamed ended without being applied: complete
        the frames with zeros, say they do not hold, and hold the pulls again."""
        s, self.stream = self.stream, None
        if s is None:
            return
        filler = s.block.void()
        for w in s.waiters:
            w.streaming = False
            if filler:
                w.proto.write_raw(filler)
            w.proto.stream_end(ModelEnd(req=w.req, ok=False))
            if w.cancelled:
                self._forget(w)
            elif w.expired:
                self._forget(w)
                self._answer(w.proto, w.req)
        self.metrics.streams_voided.inc()

    def applied(self, uids: Iterable[str | None]) -> None:
        """Updates `uids` were applied: answer the pulls still held for them."""
        if self.stream is not None and self.stream.staged is not self.store.staged:
            self.voided()  # a staging that ended without a word (cancelled)
        for uid in uids:
            for w in list(self.waiting.get(uid or "", ())):
                if not w.streaming:  # one streamed on its connection first
                    self._forget(w)
                    self._answer(w.proto, w.req)

    def cancel(self, proto: Any, req: int) -> None:
        """The client gave up pull `req` (its update was dropped, or it timed
        out): forget it, so that no model goes out for it later. A stream
        already under way still ends with its ModelEnd."""
        for w in proto.waits:
            if w.req == req:
                self.metrics.pulls_cancelled.inc()
                if w.streaming:
                    w.cancelled = True
                    if w.timer is not None:
                        w.timer.cancel()
                        w.timer = None
                else:
                    self._forget(w)
                return

    def lost(self, proto: Any) -> None:
        """`proto`'s connection is gone: drop its held pulls."""
        for w in proto.waits[:]:
            self._forget(w)
            if self.stream is not None and w in self.stream.waiters:
                self.stream.waiters.remove(w)

    # -- internals ------------------------------------------------------------------

    def _join(self, staged: StagedApply, waiters: list[_Waiter]) -> None:
        s = self.stream
        if s is None or s.staged is not staged:
            self.voided()
            s = self.stream = _Stream(staged, [], StreamedBlock(self.store.specs))
        catch_up = s.block.replay(self.store.spare) if s.block.sent else None
        for w in waiters:
            if w.streaming or w.proto.streaming:
                continue  # answered plainly once applied
            w.streaming = True
            w.proto.stream_begin(Model(req=w.req, version=staged.next_version,
                                       tensors=self.store.weights, streamed=True))
            if catch_up is not None:
                w.proto.write_raw(catch_up)
            s.waiters.append(w)

    def _expire(self, w: _Waiter) -> None:
        w.timer = None
        self.metrics.pulls_expired.inc()
        if w.streaming:
            w.expired = True
            return
        self._forget(w)
        self._answer(w.proto, w.req)

    def _forget(self, w: _Waiter) -> None:
        if w.timer is not None:
            w.timer.cancel()
            w.timer = None
        held = self.waiting.get(w.uid)
        if held is not None and w in held:
            held.remove(w)
            if not held:
                del self.waiting[w.uid]
            self.metrics.pulls_held.dec()
        if w in w.proto.waits:
            w.proto.waits.remove(w)

    def _answer(self, proto: Any, req: int) -> None:
        proto.send(self.server.handle_pull(Pull(req=req)))
