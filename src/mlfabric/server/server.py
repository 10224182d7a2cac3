"""The parameter server: the asyncio side of `ParameterStore`.

This module only moves bytes: each connection feeds received bytes to a
`protocol.Connection`, hands complete events to the store, and writes the
answers. Pushed tensors are received straight into a per-connection buffer
(BufferedProtocol), validated and applied in the event loop thread, so a pull
always sees the model between two updates, never half of one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from typing import Any, cast

import numpy as np

from .. import kernels
from ..errors import InvalidUpdate
from ..runtime.metrics import ServerMetrics
from ..transport.listener import Endpoint, EndpointProtocol
from ..wire import roles
from ..wire.protocol import (
    HEADER,
    MAX_META_LEN,
    MAX_NORMS,
    PREVIOUS_PREFIX,
    Error,
    Model,
    MsgType,
    Ping,
    Pong,
    Pull,
    PullCancel,
    Push,
    PushResult,
    StateRequest,
    Welcome,
    default_allocate,
)
from .holds import Holds
from .landings import LandingFeed
from .pulls import PullWaits
from .store import ParameterStore, StagedApply

log = logging.getLogger("mlfabric.server")

# Apply a push while it arrives once this many new bytes are in (large
# enough that per-chunk Python overhead vanishes, small enough to stay in
# cache and to overlap with the rest of the transfer).
STAGE_CHUNK = 1 << 19
# Pushes smaller than this are applied whole when complete.
STAGE_MIN_BYTES = 1 << 20
# Compute while bytes arrive only when reads are smaller than this: then the
# socket is drained and the loop would otherwise wait for the network. A
# larger read means data is backed up (the receiving CPU is the bottleneck,
# as on loopback), and computing now would only delay the transfer; the rest
# is computed when the last byte is in.
STAGE_IDLE_READ = 1 << 18


class ParameterServer(Endpoint):
    """Serves one job's model over TCP.

    >>> server = ParameterServer(store, job="mnist", token=b"...")
    >>> host, port = await server.start("127.0.0.1", 0)
    >>> await server.close()
    """

    role = "server"
    log = log

    def __init__(
        self,
        store: ParameterStore,
        *,
        job: str,
        token: bytes,
        metrics: ServerMetrics | None = None,
        handshake_timeout: float = 10.0,
        stage_min_bytes: int | None = STAGE_MIN_BYTES,
    ) -> None:
        """`stage_min_bytes`: pushes at least this large are applied while they
        arrive (None: always apply after the last byte)."""
        super().__init__(job=job, token=token,
                         metrics=metrics if metrics is not None else ServerMetrics(),
                         handshake_timeout=handshake_timeout,
                         max_frame_size=HEADER.size + MAX_META_LEN + store.nbytes)
        self.store = store
        self.stage_min_bytes = stage_min_bytes
        # Chain replication: set to a ChainLink to forward every applied update.
        self.chain: Any = None
        # Pulls for an update, held until it is applied (None: answered at once).
        self.pull_waits: PullWaits | None = PullWaits(self)
        # Pushes landed before the transfers their go named (`holds`).
        self.holds = Holds()
        self._held: dict[int, _Held] = {}  # by id(push)
        # The job's controllers told of each landing (`landings.LandingFeed`).
        self.landings: LandingFeed | None = None
        self.metrics.version.set(store.version)

    def make_protocol(self) -> ServerProtocol:
        return ServerProtocol(self)

    async def close(self) -> None:
        if self.landings is not None:
            await self.landings.close()
        await super().close()

    def welcome(self, conn: EndpointProtocol) -> Welcome:
        store = self.store
        return Welcome(session=secrets.token_hex(8), version=store.version,
                       tensors=store.specs, tau_max=store.tau_max, momentum=store.momentum,
                       shard=store.shard)

    # -- decisions on events (called by connections) --------------------------

    def handle_push(self, event: Push, staged: StagedApply | None = None,
                    data: memoryview | None = None) -> PushResult | Error:
        """Apply a received push; `staged` is its apply begun while it arrived."""
        answer = self._handle_push(event, staged, data)
        waits = self.pull_waits
        if waits is None:
            return answer
        if staged is not None and staged.committed:  # applied as staged
            waits.committed(staged)
            return answer
        if staged is not None:
            waits.voided()
        if isinstance(answer, PushResult) and answer.applied:
            waits.applied([event.uid] if event.members is None
                          else [uid for uid, _, _ in event.members])
        return answer

    def _handle_push(self, event: Push, staged: StagedApply | None,
                     data: memoryview | None) -> PushResult | Error:
        m = self.metrics
        if event.seq is not None:
            if staged is not None:
                staged.cancel()
            m.updates_rejected.labels("misrouted").inc()
            return Error(code="misrouted", req=event.req,
                         message=f"this is the server: push {event.req} carries sequence "
                                 f"number {event.seq}, which only a replica takes; push "
                                 f"without one")
        if event.members is not None and self.chain is not None:
            # The chain forwards each applied update as one sequence number;
            # an aggregate is k of them in one step, which it cannot carry.
            # Refused, its members go straight to the server one by one.
            if staged is not None:
                staged.cancel()
            m.updates_rejected.labels("misrouted").inc()
            return Error(code="misrouted", req=event.req,
                         message="this server replicates through a chain (--replicate-to), "
                                 "which carries single updates only: send the aggregate's "
                                 "members one by one (worker-driven replicas, --replica, "
                                 "replay aggregates)")
        if event.codecs is not None:
            if event.members is not None or event.group is not None:
                return Error(code="malformed", req=event.req,
                             message="a compressed push is a worker's own update: aggregates "
                                     "are not compressed")
            try:
                dense = self.store.decompress(event.codecs, event.tensors)
            except InvalidUpdate as exc:
                m.updates_rejected.labels(exc.reason).inc()
                return Error(code=exc.reason, message=str(exc), req=event.req)
            for _, codec in event.codecs:
                m.compressed_tensors.labels(codec).inc()
            event = dataclasses.replace(event, tensors=dense, codecs=None)
            staged, data = None, None  # never staged (store.stage_for)
        if event.members is not None:
            return self._apply_aggregate(event, staged, data)
        started = time.perf_counter()
        try:
            outcome, duplicate = self.store.apply_push(event, staged, data)
        except InvalidUpdate as exc:
            m.updates_rejected.labels(exc.reason).inc()
            return Error(code=exc.reason, message=str(exc), req=event.req)
        if duplicate:
            # Re-sent after its aggregate failed, but the aggregate was applied.
            m.updates_rejected.labels("duplicate").inc()
            return PushResult(req=event.req, applied=True, version=outcome.version,
                              delay=outcome.delay, fan_in=outcome.fan_in,
                              index=outcome.index)
        if outcome.applied:
            m.apply_seconds.observe(time.perf_counter() - started)
            m.updates_applied.inc()
            m.delay.observe(outcome.delay or 0)
            m.version.set(outcome.version)
        else:
            m.updates_rejected.labels("stale").inc()
        return PushResult(
            req=event.req,
            applied=outcome.applied,
            version=outcome.version,
            delay=outcome.delay,
            reason=outcome.reason,
        )

    def _apply_aggregate(self, event: Push, staged: StagedApply | None = None,
                         data: memoryview | None = None) -> PushResult | Error:
        """An aggregator's sum of k members: one step, version + k."""
        m = self.metrics
        assert event.members is not None
        started = time.perf_counter()
        try:
            outcome = self.store.apply_aggregate_push(event, staged, data)
        except InvalidUpdate as exc:
            m.updates_rejected.labels(exc.reason).inc()
            return Error(code=exc.reason, message=str(exc), req=event.req)
        if not outcome.applied:
            m.updates_rejected.labels("stale").inc()
            self.log.info("refused an aggregate of updates from %s: %s",
                          ", ".join(source for _, _, source in event.members), outcome.reason)
        else:
            m.apply_seconds.observe(time.perf_counter() - started)
            m.updates_applied.inc(len(event.members))
            m.aggregates_applied.inc()
            for delay in outcome.delays:
                m.delay.observe(delay)
            m.version.set(outcome.version)
        return PushResult(req=event.req, applied=outcome.applied, version=outcome.version,
                          delay=min(outcome.delays), reason=outcome.reason,
                          delays=outcome.delays)

    # -- the order the controller planned (holds.py) ------------------------------

    def hold(self, conn: ServerProtocol, event: Push) -> bool:
        """Hold `event`, landed before transfers its go named that have not
        (it would pass them, and they would be refused as stale), until they
        have or its `after_seconds` run out. False: apply it now."""
        if event.after is None or event.after_seconds is None:
            return False
        waits = self.holds.missing(event.after)
        if not waits:
            return False
        held = _Held(conn, event, time.monotonic())
        if not self.holds.hold(id(event), waits):
            self.log.warning("%d pushes are held already: push %d from %s is applied as it "
                             "landed, ahead of transfers %s", len(self.holds), event.req,
                             conn.client, sorted(waits))
            return False
        held.timer = asyncio.get_running_loop().call_later(
            event.after_seconds, self._hold_ended, id(event), "expired")
        self._held[id(event)] = held
        return True

    def landed(self, ticket: int | None) -> None:
        """The push of `ticket` has been applied or refused: the pushes held
        for it alone are applied, in the order they came."""
        if ticket is None:
            return
        for key in self.holds.landed(ticket):
            self._hold_ended(cast(int, key), "in_order", held=True)

    def _hold_ended(self, key: int, ended: str, held: bool = False) -> None:
        entry = self._held.pop(key, None)
        if entry is None or not (held or self.holds.drop(key)):
            return
        if entry.timer is not None:
            entry.timer.cancel()
        self.metrics.pushes_held.labels(ended).inc()
        self.metrics.push_hold_seconds.observe(time.monotonic() - entry.since)
        if ended == "lost":  # not applied: nothing waits for it any more
            self.landed(entry.event.ticket)
        else:
            entry.conn.finish_push(entry.event)

    def lost(self, conn: ServerProtocol) -> None:
        """`conn` closed: its held pushes are not applied (their workers
        learn nothing of them, as of a push whose bytes did not all come)."""
        for key in [k for k, h in self._held.items() if h.conn is conn]:
            self._hold_ended(key, "lost")

    def pong(self, ping: Ping) -> Pong:
        """A heartbeat's answer: alive at this version, with the norms of the
        updates applied above `ping.since` and the velocity when asked."""
        store = self.store
        fields: dict[str, Any] = {}
        if ping.since is not None:
            first, norms = store.norms_since(ping.since, MAX_NORMS)
            if norms:
                # A norm is infinite only with --allow-nonfinite: the wire
                # carries finite numbers, and 1e299 holds any gate back alike.
                fields.update(norms_from=first,
                              norms=tuple(n if n < 1e299 else 1e299 for n in norms))
                spans = store.spans_between(first, first + len(norms) - 1)
                if spans:
                    fields["spans"] = tuple(spans)
        if ping.velocity:
            fields["velocity"] = velocity_norm(store)
        return Pong(req=ping.req, role=self.role, version=store.version, **fields)

    def handle_pull(self, event: Pull) -> Model:
        """The model now (a pull for an update is held by `pull_waits`)."""
        version, tensors = self.store.snapshot()
        self.metrics.pulls.inc()
        return Model(req=event.req, version=version, tensors=tensors)


class ServerProtocol(EndpointProtocol):
    """One client connection of a parameter server: pulls and pushes."""

    endpoint: ParameterServer
    accepts = roles.SERVER

    def __init__(self, server: ParameterServer) -> None:
        super().__init__(server)
        self.server = server
        self._push_buffer: np.ndarray | None = None
        self._staged: StagedApply | None = None
        self._staged_frame: Any = None  # the data block the staging belongs to
        self.waits: list[Any] = []  # this connection's pulls held in server.pull_waits
        # A streamed MODEL frame is open on this connection: other answers wait.
        self.streaming = False
        self._queued: list[Any] = []

    def handle(self, event: Any) -> None:
        server = self.server
        if isinstance(event, Push):
            staged, data = self._staged, self._staged_frame
            self._staged = self._staged_frame = None
            if staged is None and server.hold(self, event):
                self._push_buffer = None  # its tensors live there until it is applied
                return
            self.finish_push(event, staged, data)
        elif isinstance(event, Pull):
            if event.uid is not None and server.pull_waits is not None:
                server.pull_waits.pull(self, event)
            else:
                self.send(server.handle_pull(event))
        elif isinstance(event, PullCancel):
            if server.pull_waits is not None:  # a replica answers every pull at once
                server.pull_waits.cancel(self, event.req)
        elif isinstance(event, StateRequest):
            ckpt = server.store.checkpoint(server.job)
            tensors = {**ckpt.weights,
                       **{PREVIOUS_PREFIX + n: p for n, p in ckpt.previous.items()}}
            self.send(Model(req=event.req, version=ckpt.version, tensors=tensors))
        elif isinstance(event, Ping):
            self.send(server.pong(event))

    def finish_push(self, event: Push, staged: StagedApply | None = None,
                    data: Any = None) -> None:
        """Apply `event` (or refuse it) and answer; then the pushes held for
        it may go (`ParameterServer.landed`)."""
        server = self.server
        answer = server.handle_push(event, staged, data)
        if (server.landings is not None and event.ticket is not None and server.role == "server"
                and event.members is None and isinstance(answer, PushResult)):
            # (A replica reports once promoted: before, its pushes are copies.)
            server.landings.report(event.ticket, event.base_version, answer)
        if isinstance(answer, Error):
            self.log.warning("refused push %d from %s (%s): %s", event.req, self.client,
                             self.peer, answer.message)
        elif server.chain is not None and answer.applied:
            # Acknowledge once the replica has it too.
            forwarded = server.chain.forward(event, answer.version)
            if forwarded is not None:
                forwarded.add_done_callback(lambda _: self.send(answer))
                server.landed(event.ticket)
                return
        self.send(answer)
        server.landed(event.ticket)

    def after_events(self) -> None:
        """Apply the push that is arriving as far as its bytes have come."""
        partial = self.conn.receiving()
        if partial is None or partial.msg_type is not MsgType.PUSH:
            return
        if partial.data is not self._staged_frame:
            self._staged_frame = partial.data
            self._staged = None
            # The store decides whether it is applied as it arrives.
            self._staged = self.server.store.stage_for(
                partial.head, partial.specs, len(partial.data), self.server.stage_min_bytes)
            if self._staged is not None and self.server.pull_waits is not None:
                self.server.pull_waits.began(self._staged)
        staged = self._staged
        if (staged is not None and self.last_read < STAGE_IDLE_READ
                and partial.received - staged.fed >= STAGE_CHUNK):
            staged.feed(partial.data, partial.received)
            if self.server.pull_waits is not None:
                self.server.pull_waits.fed()

    def on_lost(self) -> None:
        waits, staged = self.server.pull_waits, self._staged
        if staged is not None:
            staged.cancel()
            self._staged = self._staged_frame = None
            if waits is not None and waits.stream is not None and waits.stream.staged is staged:
                waits.voided()
        if waits is not None:
            waits.lost(self)
        self.server.lost(self)
        self._push_buffer = None
        self._queued = []

    # -- a streamed MODEL frame (server_pulls) ------------------------------------

    def send(self, event: Any) -> None:
        if self.streaming:
            self._queued.append(event)  # after the streamed frame
        else:
            super().send(event)

    def stream_begin(self, model: Model) -> None:
        """Write the head of `model`'s frame; its data block follows through
        write_raw(), then stream_end()."""
        self._write(self.conn.send_head(model))
        self.streaming = True

    def write_raw(self, data: Any) -> None:
        """Bytes of the streamed frame's data block."""
        self.conn.stream_data(data)
        self._write(data)

    def _write(self, data: Any) -> None:
        if self.transport is not None:
            self.transport.write(data)
            self.endpoint.metrics.sent_bytes.inc(len(data))

    def stream_end(self, end: Any) -> None:
        self.streaming = False
        trailer = self.conn.stream_trailer()  # the streamed frame's MAC
        if trailer:
            self._write(trailer)
        self.send(end)
        queued, self._queued = self._queued, []
        for event in queued:
            self.send(event)

    def allocate(self, msg_type: MsgType, nbytes: int) -> Any:
        if msg_type is MsgType.PUSH and self.stage == "ready" and self.server.chain is None:
            # One buffer per connection, reused: a push is applied before the
            # next frame is parsed, so its bytes are no longer needed by then
            # (with chain replication they are, until forwarded: fresh buffers).
            if self._push_buffer is None or len(self._push_buffer) < nbytes:
                self._push_buffer = np.empty(max(nbytes, self.server.store.nbytes), np.uint8)
            return self._push_buffer
        return default_allocate(msg_type, nbytes)


@dataclasses.dataclass(eq=False)
class _Held:
    """A push held for the transfers its go named (`ParameterServer.hold`)."""

    conn: ServerProtocol
    event: Push
    since: float  # time.monotonic() when it landed
    timer: Any = None  # its after_seconds' asyncio.TimerHandle


def velocity_norm(store: ParameterStore) -> float:
    """||w - w_prev||_2 over the whole model (the divergence bound's start).
    Without momentum the store keeps no w_prev (and the bound weighs the
    velocity by gamma = 0): 0."""
    if not store.momentum:
        return 0.0
    total = sum(kernels.l2_norm_diff(w, store.previous[n]) ** 2 for n, w in store.weights.items())
    v = float(np.sqrt(total))
    return v if v < 1e299 else 1e299
