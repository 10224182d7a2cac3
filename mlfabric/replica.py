"""A replica of the parameter server: same state, updates in the server's order.

Every push to a replica carries the sequence number the server gave the
update (the version it produced). The replica holds early arrivals in a
`Sequencer` and applies strictly seq = version + 1, so it goes through the
very states the server went through, bit for bit. Each push is answered
when its update is applied (applied=True, version=seq), or at once when
that sequence number was applied before (applied=False, reason
"duplicate: ..."): an update is never applied twice, so re-sending after a
failure is always safe. Pulls are served as on the server.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidUpdate, SequenceGap
from .metrics import ServerMetrics
from .protocol import Error, Push, PushResult, default_allocate
from .sequencer import Sequencer
from .server import ParameterServer, _ServerProtocol
from .store import ParameterStore

log = logging.getLogger("mlfabric.replica")

DEFAULT_MAX_PENDING = 64


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
                 max_pending: int = DEFAULT_MAX_PENDING) -> None:
        """`max_pending`: how many updates may wait for an earlier one; a push
        further ahead is refused (code "seq_gap"), so memory stays bounded."""
        # Updates are applied whole: one may wait for its turn, so applying it
        # while it arrives would not help.
        super().__init__(store, job=job, token=token, metrics=metrics,
                         handshake_timeout=handshake_timeout, stage_min_bytes=None)
        self.sequencer: Sequencer[_Held] = Sequencer(store.version + 1,
                                                     max_pending=max_pending)

    def make_protocol(self) -> _ReplicaProtocol:
        return _ReplicaProtocol(self)

    def handle_sequenced(self, conn: _ReplicaProtocol, event: Push) -> None:
        """Take one sequenced push; answer it now or when it is applied."""
        m = self.metrics
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
            ev = held.event
            outcome = self.store.apply_sequenced(seq, ev.base_version, ev.tensors)
            m.updates_applied.inc()
            m.delay.observe(outcome.delay or 0)
            for conn, req in held.waiters:
                conn.send(PushResult(req=req, applied=True, version=seq, delay=outcome.delay))
        m.version.set(self.store.version)
        m.replica_pending.set(len(self.sequencer.pending))


class _ReplicaProtocol(_ServerProtocol):
    """One connection to a replica (from the server, or from a worker)."""

    endpoint: ReplicaServer

    def handle(self, event: Any) -> None:
        if isinstance(event, Push):
            self.endpoint.handle_sequenced(self, event)
        else:
            super().handle(event)

    def allocate(self, msg_type: Any, nbytes: int) -> Any:
        # A push may be held until earlier ones arrive: it needs its own buffer.
        return default_allocate(msg_type, nbytes)
