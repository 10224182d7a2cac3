"""A replica of the parameter server: same state, updates in the server's order.

Every push to a replica carries the sequence number the server gave the
update (the version it produced). The replica holds early arrivals in a
`Sequencer` and applies strictly seq = version + 1, so it goes through the
very states the server went through, bit for bit. Each push is answered
when its update is applied (applied=True, version=seq), or at once when
that sequence number was applied before (applied=False, reason
"duplicate: ..."): an update is never applied twice, so re-sending after a
failure is always safe. Pulls are served as on the server.

A sequence number that will not come (its worker died after the server
applied it, before it fed the replica) would hold every later update here
forever. The replica says in each heartbeat answer how long it has waited
(`gap`), and the controller's failover monitor then tells it to RESYNC: it
takes the server's whole state (as a joining replica does), answers the
updates it held at or below that version as applied (the state holds them),
and goes on from there. A snapshot rather than fetching the one missing
update: the server keeps no applied updates (it applies in place, from
reused receive buffers), and keeping a history would cost it a model's
worth of memory per update; the snapshot costs two model transfers once,
and it heals any other way a replica can fall out of step too. Without a
controller, a gap is reported (metrics, log) but not healed; workers'
pushes do not wait on it beyond their replica timeout.

Promotion (PROMOTE from the controller, when the server is gone): the
replica first checks the server it would replace itself, and refuses
(code "server_alive") while that server still answers, unless the
promotion is forced: a partition between the controller and a live server
must not make a second server. Then the replica becomes the server. For
`recovery` seconds it still takes numbered pushes (updates the old server
applied that are still on their way here) and holds new, unnumbered ones;
then it applies what it holds in sequence order (a gap, an update no
worker re-sent, is logged as lost and skipped), then the held new pushes in
arrival order, and from then on serves as a server. Base versions the
workers got from the old server are accepted even
if ahead of this one (delay 0).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import kernels
from ..errors import ConnectionLost, InvalidUpdate, MlfabricError, SequenceGap
from ..runtime.loop import within
from ..runtime.metrics import ServerMetrics
from ..server.server import ParameterServer, ServerProtocol, velocity_norm
from ..server.store import ParameterStore
from ..wire import roles
from ..wire.protocol import (
    Error,
    MsgType,
    Ping,
    Pong,
    Promote,
    Push,
    PushResult,
    Resync,
    default_allocate,
)
from .failover import PROMOTE_CHECK_TIMEOUT
from .sequencer import Sequencer

log = logging.getLogger("mlfabric.replica")

DEFAULT_MAX_PENDING = 64
# The most --max-pending takes: each update waiting is held whole (1024 of a
# 100 MB model are 100 GB), and a replica that many updates behind is lost
# rather than reordering (issue 33: the flag had no upper bound).
MAX_PENDING_LIMIT = 1024
DEFAULT_RECOVERY = 0.3  # seconds a promoted replica waits for numbered pushes


@dataclass
class _Held:
    """An update waiting for its turn, and the pushes to answer when applied."""

    event: Push
    waiters: list[tuple[_ReplicaProtocol, int]] = field(default_factory=list)

    @property
    def fan_in(self) -> int:
        """1 for an update the server applied alone; k for a member of an
        aggregate of k (one step of k versions)."""
        return self.event.fan_in or 1

    def first(self, seq: int) -> int:
        """The first version of the step this update (held at `seq`) is part of."""
        return seq - (self.event.index or 0)


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
        # An aggregate's members are released together, as one step.
        self.sequencer: Sequencer[_Held] = Sequencer(store.version + 1, max_pending=max_pending,
                                                     span=lambda held: held.fan_in)
        self.recovery = recovery
        self.promoted = False  # PROMOTE received
        self.serving = False  # recovery over: a server now
        self._held_new: list[tuple[_ReplicaProtocol, Push]] = []
        self.gap_since: float | None = None  # time.monotonic() a missing seq was first seen
        # The sequence number of the push each connection is receiving: a
        # missing one that is still arriving (a large update on a slow link)
        # is no gap to heal.
        self.arriving: dict[_ReplicaProtocol, int] = {}
        self._resyncing = False
        self._checks: set[asyncio.Task[None]] = set()  # promotion checks, resyncs
        self.metrics.replica_gap.set_function(self.gap_seconds)

    def promote(self) -> None:
        """Become the server (see the module's docstring)."""
        if self.promoted:
            return
        self.promoted = True
        self.store.accept_future_base = True
        log.warning("promoted to server at version %d; taking re-sent updates for %.2f s",
                    self.store.version, self.recovery)
        asyncio.get_running_loop().call_later(self.recovery, self.end_recovery)

    def request_promotion(self, conn: _ReplicaProtocol, event: Promote) -> None:
        """PROMOTE: promote at once if forced (or done already), else only
        once this replica finds the server it would replace gone too."""
        if self.promoted or event.force:
            if event.force and not self.promoted:
                log.warning("promotion forced by %s (%s)", conn.client, conn.peer)
            self.promote()
            conn.send(Pong(req=event.req, role="server", version=self.store.version))
            return
        if event.server is None:
            self.metrics.promotions_refused.inc()
            conn.send(Error(code="promote_refused", req=event.req, message=(
                "a promotion must name the server it replaces (so this replica can check "
                "that it is gone) or be forced: mlfabric promote --force")))
            return
        self._spawn(self._check_then_promote(conn, event, event.server))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _check_then_promote(self, conn: _ReplicaProtocol, event: Promote,
                                  server: str) -> None:
        version = await server_answers(server, job=self.job, token=self.token,
                                       timeout=PROMOTE_CHECK_TIMEOUT)
        if version is not None and not self.promoted:
            self.metrics.promotions_refused.inc()
            log.error("refused promotion from %s: the server at %s still answers this replica "
                      "(version %d)", conn.client, server, version)
            conn.send(Error(code="server_alive", req=event.req, message=(
                f"the server at {server} still answers the replica (version {version}): the "
                f"replica stays a replica; if that server must be replaced anyway, stop it, "
                f"or force the promotion (mlfabric promote --force)")))
            return
        self.promote()
        conn.send(Pong(req=event.req, role="server", version=self.store.version))

    def pong(self, ping: Ping) -> Pong:
        pong = super().pong(ping)
        gap = self.gap_seconds()
        return dataclasses.replace(pong, gap=round(gap, 6)) if gap else pong

    def gap_seconds(self) -> float:
        """How long a missing sequence number has been waited for (0: none,
        or it is arriving). Also read by the metrics thread."""
        since = self.gap_since
        if since is None or self.promoted:
            return 0.0
        if self.sequencer.waiting_for() in list(self.arriving.values()):
            return 0.0
        return max(time.monotonic() - since, 0.0)

    def resync(self, conn: _ReplicaProtocol, event: Resync) -> None:
        """RESYNC: start over from the server's state (see the docstring)."""
        if self.promoted:
            conn.send(Error(code="promoted", req=event.req,
                            message="this replica was promoted: it is the server now"))
            return
        if self._resyncing:
            conn.send(Error(code="busy", req=event.req,
                            message="a resync is already under way; ask again later"))
            return
        self._resyncing = True
        self._spawn(self._resync(conn, event))

    async def _resync(self, conn: _ReplicaProtocol, event: Resync) -> None:
        try:
            fresh = await fetch_state(event.server, job=self.job, token=self.token)
        except (MlfabricError, TimeoutError, OSError) as exc:
            log.error("resync from %s failed: %s", event.server, exc)
            conn.send(Error(code="resync_failed", req=event.req,
                            message=f"could not take the state of {event.server}: {exc}"))
            return
        finally:
            self._resyncing = False
        store = self.store
        if self.promoted:
            conn.send(Error(code="promoted", req=event.req,
                            message="this replica was promoted during the resync"))
            return
        if fresh.specs != store.specs or fresh.momentum != store.momentum:
            conn.send(Error(code="resync_failed", req=event.req, message=(
                f"the server at {event.server} holds another model (tensors or momentum "
                f"differ): this replica was started from another --init or --momentum")))
            return
        if fresh.version > store.version:
            skipped = fresh.version - store.version
            for name, w in store.weights.items():
                w[...] = fresh.weights[name]
                store.previous[name][...] = fresh.previous[name]
            store.version = fresh.version
            # What was held at or below the new version is in the state.
            # (A state's version is a step's end: an aggregate is all in it or not.)
            for seq in sorted(s for s in self.sequencer.pending if s <= fresh.version):
                held = self.sequencer.pending.pop(seq)
                aggregate = held.fan_in > 1
                for c, req in held.waiters:
                    c.send(PushResult(req=req, applied=True,
                                      version=held.first(seq) + held.fan_in - 1, delay=None,
                                      fan_in=held.fan_in if aggregate else None,
                                      index=held.event.index if aggregate else None))
            self.sequencer.reset(fresh.version + 1)
            self.metrics.replica_resyncs.inc()
            log.warning("resynced from %s: version %d (%d updates taken from its state)",
                        event.server, store.version, skipped)
            self._apply_ready()
        conn.send(Pong(req=event.req, role="replica", version=store.version,
                       velocity=velocity_norm(store)))

    def end_recovery(self) -> None:
        """Apply what is held, in sequence order, then serve as a server."""
        seq_held = sorted(self.sequencer.pending)
        missing = self.sequencer.missing()
        if missing:
            log.error("updates %s were applied by the lost server but reached neither this "
                      "replica nor a worker that could re-send them: lost", missing)
        # In sequence order, an aggregate's members together: as one step,
        # renumbered from this replica's version on (with the members that
        # came, if some never did).
        steps: list[tuple[tuple[int, int], list[_Held]]] = []
        for seq in seq_held:
            held = self.sequencer.pending.pop(seq)
            step = (held.first(seq), held.fan_in)
            if held.fan_in > 1 and steps and steps[-1][0] == step:
                steps[-1][1].append(held)
            else:
                steps.append((step, [held]))
        for (_, fan_in), members in steps:
            if fan_in == 1:
                self._apply_one(self.store.version + 1, members[0])
            else:
                self._replay_aggregate(self.store.version + 1, members)
        self.sequencer.reset(self.store.version + 1)
        self.serving = True
        self.role = "server"
        held_new, self._held_new = self._held_new, []
        for conn, event in held_new:
            conn.send(self.handle_push(event))
        self.metrics.version.set(self.store.version)
        self.metrics.replica_pending.set(0)
        self.gap_since = None
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
        seq = event.seq
        misplaced = self._misplaced(seq, _Held(event))
        if misplaced is not None:
            m.updates_rejected.labels("out_of_order").inc()
            conn.send(Error(code="out_of_order", req=event.req, message=misplaced))
            return
        try:
            if event.codecs is not None:  # the parts its server decoded: the same bits
                event = dataclasses.replace(
                    event, tensors=self.store.decompress(event.codecs, event.tensors),
                    codecs=None)
            self.store.check_layout((n, u.dtype, u.shape) for n, u in event.tensors.items())
            offer = self.sequencer.offer(seq, _Held(event))
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
                reason=f"duplicate: sequence number {seq} was already applied "
                       f"(replica at version {self.store.version})"))
            return
        held = self.sequencer.pending[seq]
        if offer == "held":
            m.updates_rejected.labels("duplicate").inc()
        held.waiters.append((conn, event.req))
        self._apply_ready()

    def _misplaced(self, seq: int, held: _Held) -> str | None:
        """Why an update cannot take place `seq` (None: it can): a member of an
        aggregate must agree with the members of it held here, and the
        aggregate must fit the out-of-order buffer and be still ahead."""
        seqr = self.sequencer
        first, k = held.first(seq), held.fan_in
        if k > seqr.max_pending:
            return (f"update {seq} is a member of an aggregate of {k}, more than the "
                    f"{seqr.max_pending} updates this replica holds out of order: start it "
                    f"with --max-pending {k} or more")
        if first < seqr.next_seq <= seq:
            return (f"update {seq} is member {held.event.index} of an aggregate from version "
                    f"{first}, but this replica is past version {first - 1}")
        for other_seq, other in seqr.pending.items():
            o_first, o_k = other.first(other_seq), other.fan_in
            overlap = first <= o_first + o_k - 1 and o_first <= first + k - 1
            if overlap and (o_first, o_k) != (first, k):
                return (f"update {seq} says it is a step of {k} from version {first}, but the "
                        f"update held at {other_seq} says {o_k} from {o_first}")
        return None

    def _apply_ready(self) -> None:
        m = self.metrics
        members: list[_Held] = []
        for seq, held in self.sequencer.ready():
            if held.fan_in == 1:
                self._apply_one(seq, held)
                continue
            # The sequencer releases an aggregate's members together, in order.
            members.append(held)
            if len(members) == held.fan_in:
                self._replay_aggregate(seq - held.fan_in + 1, members)
                members = []
        assert not members, "an aggregate was released in part"
        m.version.set(self.store.version)
        m.replica_pending.set(len(self.sequencer.pending))
        # Something arrived ahead of a sequence number that has not: a gap.
        if self.sequencer.pending:
            if self.gap_since is None:
                self.gap_since = time.monotonic()  # the metric reads it from another thread
        else:
            self.gap_since = None

    async def close(self) -> None:
        for task in list(self._checks):
            task.cancel()
        if self._checks:
            await asyncio.wait(self._checks, timeout=5.0)
        await super().close()

    def _replay_aggregate(self, first: int, members: list[_Held]) -> None:
        """Apply members, in member order, as the one step the server took
        with their sum (a promoted replica may apply fewer than were summed:
        the others never came)."""
        outcome = self.store.apply_sequenced_aggregate(
            first, [(h.event.base_version, h.event.tensors) for h in members])
        m = self.metrics
        m.updates_applied.inc(len(members))
        m.aggregates_applied.inc()
        for index, (held, delay) in enumerate(zip(members, outcome.delays, strict=True)):
            m.delay.observe(delay)
            for conn, req in held.waiters:
                conn.send(PushResult(req=req, applied=True, version=outcome.version,
                                     delay=delay, fan_in=len(members), index=index))

    def _apply_one(self, seq: int, held: _Held) -> None:
        ev = held.event
        outcome = self.store.apply_sequenced(seq, ev.base_version, ev.tensors)
        self.metrics.updates_applied.inc()
        self.metrics.delay.observe(outcome.delay or 0)
        for conn, req in held.waiters:
            conn.send(PushResult(req=req, applied=True, version=seq, delay=outcome.delay))


class _ReplicaProtocol(ServerProtocol):
    """One connection to a replica (from the server, or from a worker)."""

    endpoint: ReplicaServer
    accepts = roles.REPLICA

    def handle(self, event: Any) -> None:
        replica = self.endpoint
        if isinstance(event, Push) and not (replica.serving and event.seq is None):
            replica.handle_sequenced(self, event)
        elif isinstance(event, Promote):
            replica.request_promotion(self, event)
        elif isinstance(event, Resync):
            replica.resync(self, event)
        else:
            super().handle(event)

    def allocate(self, msg_type: Any, nbytes: int) -> Any:
        # A push may be held until earlier ones arrive: it needs its own buffer.
        return default_allocate(msg_type, nbytes)

    def after_events(self) -> None:
        """Note which sequence number is arriving here (see `arriving`)."""
        super().after_events()
        partial = self.conn.receiving()
        seq = None
        if partial is not None and partial.msg_type is MsgType.PUSH:
            seq = partial.head.seq
        if seq is not None:
            self.endpoint.arriving[self] = seq
        else:
            self.endpoint.arriving.pop(self, None)

    def on_lost(self) -> None:
        self.endpoint.arriving.pop(self, None)
        super().on_lost()


async def server_answers(address: str, *, job: str, token: bytes, timeout: float
                         ) -> int | None:
    """The version of the server at `address` if it answers a heartbeat
    within `timeout` seconds, else None."""
    from ..client.link import open_link
    from ..wire.handshake import ClientHandshake

    answer: asyncio.Future[Pong] = asyncio.get_running_loop().create_future()

    def on_event(event: Any) -> None:
        if isinstance(event, Pong) and not answer.done():
            answer.set_result(event)

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        link = await open_link(address, ClientHandshake(job, token, "mlfabric-replica"), timeout,
                               "parameter server", on_event=on_event)
    except MlfabricError:
        return None
    try:
        link.send(Ping(1))
        pong = await within(asyncio.shield(answer), max(deadline - loop.time(), 1e-3))
    except (TimeoutError, MlfabricError):
        return None
    finally:
        link.close()
    return pong.version


async def fetch_state(address: str, *, job: str, token: bytes, timeout: float = 30.0,
                      max_pending: int = DEFAULT_MAX_PENDING) -> ParameterStore:
    """The whole state of the server at `address` (weights, momentum history,
    version), for a replica joining a running job."""
    from ..client.link import open_link
    from ..wire.handshake import ClientHandshake
    from ..wire.protocol import HEADER, MAX_META_LEN, PREVIOUS_PREFIX, StateRequest, layout

    link = await open_link(address, ClientHandshake(job, token, "mlfabric-replica"), timeout,
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
    store.shard = welcome.shard  # a shard's state: the replica keeps that shard
    return store


async def announce(controllers: str | Sequence[str], *, address: str, store: ParameterStore,
                   job: str, token: bytes, server: str | None = None,
                   timeout: float = 30.0) -> None:
    """Tell the job's controllers a replica serves at `address` from the
    store's version on, having taken its state from `server`. Each is told
    (with several, the one planning the replica's shard acts; the others
    note it for when they take the shard over); an error only when none
    could be."""
    from ..client.link import open_link
    from ..wire.handshake import ClientHandshake
    from ..wire.protocol import ReplicaJoin

    if isinstance(controllers, str):
        controllers = [controllers]
    velocity = float(np.sqrt(sum(
        kernels.l2_norm_diff(w, store.previous[n]) ** 2 for n, w in store.weights.items())))
    join = ReplicaJoin(address=address, version=store.version, velocity=velocity,
                       shard=None if store.shard is None else store.shard.index, server=server)
    failed: list[str] = []
    for controller in controllers:
        try:
            link = await open_link(controller, ClientHandshake(job, token, "mlfabric-replica"),
                                   timeout, "controller")
        except MlfabricError as exc:
            if len(controllers) == 1:
                raise
            log.warning("could not tell the controller at %s of this replica: %s", controller,
                        exc)
            failed.append(f"{controller}: {exc}")
            continue
        link.send(join)
        link.close()
        await link.closed
    if len(failed) == len(controllers):
        raise ConnectionLost(f"no controller could be told of this replica: "
                             f"{'; '.join(failed)}")
