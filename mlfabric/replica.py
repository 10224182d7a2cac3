"""A replica of the parameter server: same state, updates in the server's order.

Every push to a replica carries the sequence number the server gave the
update (the version it produced). The replica holds early arrivals in a
`Sequencer` and applies strictly seq = version + 1, so it goes through the
very states the server went through, bit for bit. Each push is answered
when its update is applied (applied=True, version=seq), or at once when
that sequence number was applied before (applied=False, reason
"duplicate: ..."): an update is never applied twice, so re-sending after a
failure is always safe. Pulls are served as on the server.

Promotion (PROMOTE from the controller, when the server is gone): the
replica becomes the server. For `recovery` seconds it still takes numbered
pushes (updates the old server applied that are still on their way here)
and holds new, unnumbered ones; then it applies what it holds in sequence
order (a gap, an update no worker re-sent, is logged as lost and skipped),
then the held new pushes in arrival order, and from then on serves as a
server. Base versions the workers got from the old server are accepted even
if ahead of this one (delay 0).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import InvalidUpdate, SequenceGap
from .loop import within
from .metrics import ServerMetrics
from .protocol import Error, Pong, Promote, Push, PushResult, default_allocate
from .sequencer import Sequencer
from .server import ParameterServer, _ServerProtocol
from .store import ParameterStore

log = logging.getLogger("mlfabric.replica")

DEFAULT_MAX_PENDING = 64
DEFAULT_RECOVERY = 0.3  # seconds a promoted replica waits for numbered pushes


@dataclass
class _Held:
    """An update waiting for its turn, and the pushes to answer when applied."""

    event: Push
    waiters: list[tuple[_ReplicaProtocol, int]] = field(default_factory=list)


class ReplicaServer(ParameterServer):
    """Holds a copy of the model and applies sequenced pushes in order.

    >>> replica = ReplicaServer(ParameterStore(init), job="mnist", token=b"...")
    >>> host, port = await replica.start("127.0.0.1", 0)
    """

    role = "replica"
    log = log

    def __init__(self, store: ParameterStore, *, job: str, token: bytes,
                 metrics: ServerMetrics | None = None, handshake_timeout: float = 10.0,
                 max_pending: int = DEFAULT_MAX_PENDING,
                 recovery: float = DEFAULT_RECOVERY) -> None:
        """`max_pending`: how many updates may wait for an earlier one; a push
        further ahead is refused (code "seq_gap"), so memory stays bounded."""
        # Updates are applied whole: one may wait for its turn, so applying it
        # while it arrives would not help.
        super().__init__(store, job=job, token=token, metrics=metrics,
                         handshake_timeout=handshake_timeout, stage_min_bytes=None)
        # Pulls for an update are answered at once: updates reach a replica
        # in sequence, not staged.
        self.pull_waits = None
        self.sequencer: Sequencer[_Held] = Sequencer(store.version + 1,
                                                     max_pending=max_pending)
        self.recovery = recovery
        self.promoted = False  # PROMOTE received
        self.serving = False  # recovery over: a server now
        self._held_new: list[tuple[_ReplicaProtocol, Push]] = []

    def promote(self) -> None:
        """Become the server (see the module's docstring)."""
        if self.promoted:
            return
        self.promoted = True
        self.store.accept_future_base = True
        log.warning("promoted to server at version %d; taking re-sent updates for %.2f s",
                    self.store.version, self.recovery)
        asyncio.get_running_loop().call_later(self.recovery, self.end_recovery)

    def end_recovery(self) -> None:
        """Apply what is held, in sequence order, then serve as a server."""
        seq_held = sorted(self.sequencer.pending)
        missing = self.sequencer.missing()
        if missing:
            log.error("updates %s were applied by the lost server but reached neither this "
                      "replica nor a worker that could re-send them: lost", missing)
        for seq in seq_held:
            held = self.sequencer.pending.pop(seq)
            self._apply_one(self.store.version + 1, held)
        self.sequencer.reset(self.store.version + 1)
        self.serving = True
        self.role = "server"
        held_new, self._held_new = self._held_new, []
        for conn, event in held_new:
            conn.send(self.handle_push(event))
        self.metrics.version.set(self.store.version)
        self.metrics.replica_pending.set(0)
        log.warning("serving as the server from version %d", self.store.version)
    def make_protocol(self) -> _ReplicaProtocol:
        return _ReplicaProtocol(self)

    def handle_sequenced(self, conn: _ReplicaProtocol, event: Push) -> None:
        """Take one sequenced push; answer it now or when it is applied."""
        m = self.metrics
        if event.seq is None and self.promoted:
            self._held_new.append((conn, event))  # until recovery ends
            return
        if event.seq is not None and self.serving:
            m.updates_rejected.labels("misrouted").inc()
            conn.send(Error(
                code="misrouted", req=event.req,
                message=f"update {event.seq} of the lost server arrived after recovery ended "
                        f"(replica promoted); it was not applied: push it again without a "
                        f"sequence number"))
            return
        if event.seq is None:
            m.updates_rejected.labels("misrouted").inc()
            conn.send(Error(
                code="misrouted", req=event.req,
                message=f"this is a replica at version {self.store.version}: it applies only "
                        f"updates with the sequence number the server gave them; push to the "
                        f"server"))
            return
        try:
            self.store.check_layout((n, u.dtype, u.shape) for n, u in event.tensors.items())
            offer = self.sequencer.offer(event.seq, _Held(event))
        except InvalidUpdate as exc:
            m.updates_rejected.labels(exc.reason).inc()
            conn.send(Error(code=exc.reason, message=str(exc), req=event.req))
            return
        except SequenceGap as exc:
            m.updates_rejected.labels("seq_gap").inc()
            conn.send(Error(code="seq_gap", message=str(exc), req=event.req))
            return
        if offer == "applied":
            m.updates_rejected.labels("duplicate").inc()
            conn.send(PushResult(
                req=event.req, applied=False, version=self.store.version, delay=None,
                reason=f"duplicate: sequence number {event.seq} was already applied "
                       f"(replica at version {self.store.version})"))
            return
        held = self.sequencer.pending[event.seq]
        if offer == "held":
            m.updates_rejected.labels("duplicate").inc()
        held.waiters.append((conn, event.req))
        self._apply_ready()

    def _apply_ready(self) -> None:
        m = self.metrics
        for seq, held in self.sequencer.ready():
            self._apply_one(seq, held)
        m.version.set(self.store.version)
        m.replica_pending.set(len(self.sequencer.pending))

    def _apply_one(self, seq: int, held: _Held) -> None:
        ev = held.event
        outcome = self.store.apply_sequenced(seq, ev.base_version, ev.tensors)
        self.metrics.updates_applied.inc()
        self.metrics.delay.observe(outcome.delay or 0)
        for conn, req in held.waiters:
            conn.send(PushResult(req=req, applied=True, version=seq, delay=outcome.delay))


class _ReplicaProtocol(_ServerProtocol):
    """One connection to a replica (from the server, or from a worker)."""

    endpoint: ReplicaServer

    def handle(self, event: Any) -> None:
        replica = self.endpoint
        if isinstance(event, Push) and not (replica.serving and event.seq is None):
            replica.handle_sequenced(self, event)
        elif isinstance(event, Promote):
            replica.promote()
            self.send(Pong(req=event.req, role="server", version=replica.store.version))
        else:
            super().handle(event)

    def allocate(self, msg_type: Any, nbytes: int) -> Any:
        # A push may be held until earlier ones arrive: it needs its own buffer.
        return default_allocate(msg_type, nbytes)


async def fetch_state(address: str, *, job: str, token: bytes, timeout: float = 30.0,
                      max_pending: int = DEFAULT_MAX_PENDING) -> ParameterStore:
    """The whole state of the server at `address` (weights, momentum history,
    version), for a replica joining a running job."""
    from .aio import open_link
    from .client_core import Handshake
    from .protocol import HEADER, MAX_META_LEN, PREVIOUS_PREFIX, StateRequest, layout

    link = await open_link(address, Handshake(job, token, "mlfabric-replica"), timeout,
                           "parameter server")
    try:
        welcome = link.welcomed.result()
        nbytes = layout(welcome.tensors)[1]
        link.conn.max_frame_size = HEADER.size + MAX_META_LEN + 2 * nbytes + 128 * len(
            welcome.tensors)
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        req = link.requests.add("pull", answer)
        link.send(StateRequest(req))
        version, tensors = await within(answer, timeout)
    finally:
        link.close()
    weights = {n: np.array(a) for n, a in tensors.items() if not n.startswith(PREVIOUS_PREFIX)}
    store = ParameterStore(weights, momentum=welcome.momentum, version=version)
    for name in weights:
        store.previous[name][...] = tensors[PREVIOUS_PREFIX + name]
    return store


async def announce(controller: str, *, address: str, store: ParameterStore, job: str,
                   token: bytes, timeout: float = 30.0) -> None:
    """Tell the controller a replica serves at `address` from the store's version on."""
    from . import _core
    from .aio import open_link
    from .client_core import Handshake
    from .protocol import ReplicaJoin

    link = await open_link(controller, Handshake(job, token, "mlfabric-replica"), timeout,
                           "controller")
    velocity = float(np.sqrt(sum(
        _core.l2_norm_diff(w, store.previous[n]) ** 2 for n, w in store.weights.items())))
    link.send(ReplicaJoin(address=address, version=store.version, velocity=velocity))
    link.close()
    await link.closed
