"""The in-network aggregator: the asyncio side of `aggregation.GroupSum`.

It runs inside `mlfabric agent --aggregate HOST:PORT` and speaks the job's
protocol with its token. Workers the controller routed through it push
their update here as member `index` of group `group` (`fan_in` members,
bound for the server `dst`); each member is received straight into a buffer
of its own and summed, in index order, as its bytes arrive. One aggregate
(their sum, with the list of members) goes to the server, and each member is
answered with its own outcome (applied, the version, its delay).

The aggregate is streamed: once every member's update has begun to arrive
(so the list of members is known), its frame goes out and each stretch of
the sum follows as soon as all members' bytes for it are in. The forward
into the server, usually the slowest link, then overlaps the gather instead
of following it. A group that cannot finish (a member stalls past the group
timeout or disconnects, the server link fails) drops its partial frame with
the link, so the server never applies part of one.

Nothing is lost and nothing is applied twice: when the aggregate is not
applied (the server refused it, the server link failed, or the group timed
out waiting for a member), every member still waiting is answered with
`aggregate_failed`, and its worker sends the update straight to the server
with the same uid (a server applies a uid at most once). A member that
arrives after its group closed gets the same answer. If the aggregator dies,
its workers see the connection drop and do the same.

It forwards only to the servers it was configured with (`servers`, the
operator's `--servers`; issue 33): a member whose `dst` is not one of them
is answered `dst_not_allowed` and nothing is dialled, so an authenticated
worker cannot make the aggregator connect anywhere else. Its worker then
sends the update straight to the server it is connected to, as after any
other failure of the aggregator.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..client.aio import dial
from ..client.link import LinkPool
from ..client.seams import ServerConnection
from ..errors import ConfigError, ConnectionLost, MlfabricError
from ..runtime.metrics import AggregatorMetrics
from ..transport.listener import Endpoint, EndpointProtocol, LogLimiter
from ..wire import roles
from ..wire.handshake import ClientHandshake
from ..wire.protocol import (
    HEADER,
    MAX_META_LEN,
    Error,
    MsgType,
    Push,
    PushResult,
    TensorSpec,
    Welcome,
    default_allocate,
    layout,
    spec_of,
)
from .destinations import Destinations
from .group_sum import GroupSum

log = logging.getLogger("mlfabric.aggregator")

GROUP_TIMEOUT = 2.0  # seconds from a group's first member to giving up on the rest
SERVER_DIAL_TIMEOUT = 10.0  # seconds to reach the server with an aggregate's link
MAX_UPDATE_BYTES = 1 << 32
_CLOSED_MEMORY = 4096  # closed groups remembered, so a late member is told at once
FAILED = "aggregate_failed"  # the aggregator could not deliver: re-send, and say so
REFUSED = "aggregate_refused"  # the server refused the aggregate: re-send, no one's fault
DST_REFUSED = "dst_not_allowed"  # the member named a server not on the list: nothing dialled


@dataclass
class _Member:
    conn: _AggregatorProtocol
    req: int
    uid: str
    base_version: int
    index: int


@dataclass
class _Group:
    key: tuple[str, int]  # (server address as configured, group id)
    specs: tuple[TensorSpec, ...]
    sum: GroupSum
    started: float
    members: dict[int, _Member] = field(default_factory=dict)  # received whole
    heads: dict[int, _Member] = field(default_factory=dict)  # begun to arrive
    timer: asyncio.TimerHandle | None = None
    progress: asyncio.Event = field(default_factory=asyncio.Event)  # more of the sum is final
    given_up: str | None = None  # why a streamed aggregate must be abandoned

    @property
    def streaming(self) -> bool:
        """Every member has begun, so the aggregate is on its way (heads only grow)."""
        return len(self.heads) == self.sum.fan_in


class Aggregator(Endpoint):
    """Sums groups of one job's updates and forwards each as one aggregate.

    `servers`: every address it may forward to (the job's servers, shards
    and replicas, as their workers name them); a member bound anywhere else
    is refused and nothing is dialled.

    >>> agg = Aggregator(job="mnist", token=b"...", servers=["10.0.0.1:7070"])
    >>> host, port = await agg.start("0.0.0.0", 7401)
    >>> await agg.close()
    """

    role = "aggregator"
    log = log

    def __init__(self, *, job: str, token: bytes, servers: Iterable[str],
                 metrics: AggregatorMetrics | None = None,
                 group_timeout: float = GROUP_TIMEOUT, max_update_bytes: int = MAX_UPDATE_BYTES,
                 handshake_timeout: float = 10.0, name: str = "aggregator") -> None:
        self.destinations = Destinations(servers)
        if not group_timeout > 0:
            raise ConfigError(f"group timeout must be positive seconds, got {group_timeout}")
        super().__init__(job=job, token=token,
                         metrics=metrics if metrics is not None else AggregatorMetrics(),
                         handshake_timeout=handshake_timeout,
                         max_frame_size=HEADER.size + MAX_META_LEN + max_update_bytes)
        self.group_timeout = group_timeout
        self.name = name
        self.groups: dict[tuple[str, int], _Group] = {}
        self._closed: OrderedDict[tuple[str, int], str] = OrderedDict()
        # One link per server, dialled ahead when a group opens.
        self._links: LinkPool[ServerConnection] = LinkPool(lambda address: dial(
            address, self._handshake(), SERVER_DIAL_TIMEOUT, "parameter server"))
        self._writing: dict[str, asyncio.Lock] = {}  # one frame at a time on a server link
        self._forwards: set[asyncio.Task[None]] = set()
        # Off-list destinations are logged apart from the listener's
        # refusals: a flood of one must not hide the other.
        self.dst_refusals = LogLimiter(log)

    def make_protocol(self) -> _AggregatorProtocol:
        return _AggregatorProtocol(self)

    def welcome(self, conn: EndpointProtocol) -> Welcome:
        return Welcome(session=secrets.token_hex(8), version=0, tensors=())

    # -- groups -------------------------------------------------------------------

    def group_for(self, key: tuple[str, int], fan_in: int, nbytes: int,
                  specs: tuple[TensorSpec, ...]) -> _Group | None:
        """The open group `key`, created on its first member; None if closed."""
        group = self.groups.get(key)
        if group is None and key not in self._closed:
            group = _Group(key, specs, GroupSum(fan_in, nbytes), time.monotonic())
            # The link to the server is dialled while the members arrive, not
            # after: a first dial took 0.1-0.8 s on the loaded emulated cluster.
            self._dial_ahead(key[0])
            group.timer = asyncio.get_running_loop().call_later(
                self.group_timeout, self._expire, key)
            self.groups[key] = group
        return group

    def refuse_dst(self, conn: _AggregatorProtocol, event: Push) -> None:
        """A member bound for a server not on the list: refused, counted,
        logged (rate-limited); no group is opened and nothing is dialled."""
        self.metrics.dst_refused.inc()
        self.dst_refusals.warning(
            "refused push %d from %s (%s): its destination %r is not one of this "
            "aggregator's servers (%s); nothing was dialled. If it is a server of the job, "
            "add it to --servers as the workers name it", event.req, conn.client, conn.peer,
            event.dst, self.destinations)
        conn.send(Error(code=DST_REFUSED, req=event.req,
                        message=f"this aggregator does not forward to {event.dst!r}: it is "
                                f"not one of its servers (mlfabric agent --servers); send "
                                f"update {event.uid} straight to the server"))

    def closed_reason(self, key: tuple[str, int]) -> str | None:
        return self._closed.get(key)

    def _close(self, group: _Group, reason: str) -> None:
        self.groups.pop(group.key, None)
        if group.timer is not None:
            group.timer.cancel()
        self._closed[group.key] = reason
        while len(self._closed) > _CLOSED_MEMORY:
            self._closed.popitem(last=False)

    def member_started(self, group: _Group, member: _Member) -> None:
        """A member's update has begun to arrive; with every member's begun,
        the aggregate starts out to the server."""
        group.heads[member.index] = member
        if group.streaming:  # this was the last to begin: each index begins once
            members = [group.heads[i] for i in range(group.sum.fan_in)]
            self._forward(group, members, group.sum.acc, lambda: 4 * group.sum.summed)

    def member_in(self, group: _Group) -> None:
        if group.sum.all_in:
            self.metrics.gather_seconds.observe(time.monotonic() - group.started)
            self._close(group, "its aggregate was forwarded")
            group.sum.total()  # sums the rest
            assert group.streaming  # every member has begun
            group.progress.set()

    def member_lost(self, group: _Group, member: _Member) -> None:
        """A member's connection dropped mid-update: a streamed aggregate
        cannot be finished, so it is given up now rather than at the timeout."""
        if group.streaming and group.key in self.groups:
            self._give_up(group, f"member {member.index} ({member.conn.client}) disconnected "
                                 f"before its update was in")

    def _give_up(self, group: _Group, why: str) -> None:
        """Stop a streamed group: its partial frame is dropped with the link,
        and every member is told to go straight to the server (those still
        arriving when their update is in)."""
        self._close(group, why)
        group.given_up = why
        group.progress.set()

    def _expire(self, key: tuple[str, int]) -> None:
        """A member did not arrive in time: forward what is in, and tell the
        late ones (now or when they arrive) to go straight to the server."""
        group = self.groups.get(key)
        if group is None:
            return
        self.metrics.group_timeouts.inc()
        self.metrics.gather_seconds.observe(time.monotonic() - group.started)
        missing = sorted(set(range(group.sum.fan_in)) - set(group.members))
        if group.streaming:
            # Its frame went out as a sum of all members: it cannot become a
            # smaller aggregate, so no aggregate is applied this time.
            log.warning("group %d for %s: members %s did not finish within %.1f s; its "
                        "streamed aggregate is abandoned and the members go straight to the "
                        "server", key[1], key[0], missing, self.group_timeout)
            self._give_up(group, f"it timed out after {self.group_timeout:.1f} s without "
                                 f"member(s) {missing}")
            return
        log.warning("group %d for %s: members %s did not arrive within %.1f s; forwarding the "
                    "other %d", key[1], key[0], missing, self.group_timeout, len(group.members))
        self._close(group, f"it timed out after {self.group_timeout:.1f} s without member(s) "
                           f"{missing}")
        if group.members:
            members = [group.members[i] for i in sorted(group.members)]
            total = group.sum.total_of(list(group.members))
            self._forward(group, members, total, lambda: total.nbytes)

    # -- forwarding ----------------------------------------------------------------

    def _forward(self, group: _Group, members: list[_Member], total: np.ndarray,
                 final: Any) -> None:
        """Send `total`, the sum of `members`, to the server; `final()`: how
        many of its bytes are summed for good (all, unless streamed)."""
        task = asyncio.get_running_loop().create_task(
            self._send_aggregate(group, members, total, final))
        self._forwards.add(task)
        task.add_done_callback(self._forwards.discard)

    def _dial_ahead(self, dst: str) -> None:
        self._links.ahead(dst)

    async def _link(self, dst: str) -> ServerConnection:
        return await self._links.get(dst)

    def _handshake(self) -> ClientHandshake:
        return ClientHandshake(self.job, self.token, f"{self.name} aggregator")

    async def _send_aggregate(self, group: _Group, members: list[_Member], total: np.ndarray,
                              final: Any) -> None:
        m = self.metrics
        offsets, _ = layout(group.specs)
        data = total.view(np.uint8)
        tensors = {sp.name: np.frombuffer(data, np.float32, count=sp.nbytes // 4,
                                          offset=off).reshape(sp.shape)
                   for sp, off in zip(group.specs, offsets, strict=True)}
        push_members = tuple((mb.uid, mb.base_version, mb.conn.client) for mb in members)
        base = min(mb.base_version for mb in members)
        dst = group.key[0]
        forwarded = time.monotonic()
        try:
            server = await self._link(dst)
            async with self._writing.setdefault(dst, asyncio.Lock()):
                answer, frame = server.request_streamed(
                    "aggregate", lambda req: Push(req, base, tensors, members=push_members), base)
                try:
                    await self._stream(group, frame, data, final)
                except BaseException:
                    # A partial frame must not stay on the link (the server
                    # would read the next frame as its rest): drop the link.
                    frame.abort()
                    answer.add_done_callback(lambda f: f.cancelled() or f.exception())  # dropped
                    self._links.forget(dst, server)  # it closes a moment later
                    raise
            result = await answer
        except (OSError, MlfabricError) as exc:
            # A lost link is dialled again next time (LinkPool.get); one
            # that carried a refusal is still good and is kept.
            m.aggregates.labels("failed").inc()
            why = (f"the aggregate could not be delivered to {dst}: {exc}"
                   if group.given_up is None else f"its aggregate was abandoned: {exc}")
            self._abandon(group, members, why)
            return
        except Exception:  # a bug: the members must still hear, or their workers hang
            log.exception("internal error forwarding group %d to %s", group.key[1], dst)
            m.aggregates.labels("failed").inc()
            self._abandon(group, members, "internal aggregator error (see its log)")
            return
        assert isinstance(result, PushResult)
        answered = time.monotonic()
        m.forward_seconds.observe(answered - forwarded)
        m.aggregation_seconds.observe(answered - group.started)
        if not result.applied or result.delays is None or len(result.delays) != len(members):
            m.aggregates.labels("refused").inc()
            self._refused(members, result, server.tau_max)
            return
        m.aggregates.labels("applied").inc()
        m.fan_in.observe(len(members))
        m.members.inc(len(members))
        m.saved_bytes.inc((len(members) - 1) * total.nbytes)
        for index, (mb, delay) in enumerate(zip(members, result.delays, strict=True)):
            # Its place in the aggregate, for its worker's replica.
            mb.conn.send(PushResult(req=mb.req, applied=True, version=result.version,
                                    delay=delay, fan_in=len(members), index=index))

    async def _stream(self, group: _Group, frame: Any, data: np.ndarray, final: Any) -> None:
        """Write the aggregate's bytes as they become final; raises if the
        group is given up first."""
        if frame.nbytes != data.nbytes:  # would wait forever for bytes that never come
            raise AssertionError(f"a {frame.nbytes}-byte frame for a {data.nbytes}-byte sum")
        while frame.sent < frame.nbytes:
            if group.given_up is not None:
                raise ConnectionLost(group.given_up)
            upto = final()
            if upto > frame.sent:
                if not group.sum.all_in:
                    self.metrics.streamed_bytes.inc(upto - frame.sent)
                frame.write(data.data.cast("B"), upto)
            else:
                group.progress.clear()
                await group.progress.wait()

    def _abandon(self, group: _Group, members: list[_Member], why: str) -> None:
        if group.key in self.groups:  # streamed, members still arriving
            self._close(group, why)
        self._fail([mb for mb in members if group.sum.complete[mb.index]], why)

    def _refused(self, members: list[_Member], result: PushResult, tau_max: int | None) -> None:
        """The server refused the aggregate (a member past tau_max): the stale
        members are answered as such (alone they would be refused too), the
        others go straight to the server, judged one by one."""
        delays = result.delays if result.delays is not None and len(result.delays) == len(
            members) else (None,) * len(members)
        log.info("the server refused an aggregate of %d members: %s", len(members),
                 result.reason)
        for mb, delay in zip(members, delays, strict=True):
            if delay is not None and tau_max is not None and delay > tau_max:
                mb.conn.send(PushResult(
                    req=mb.req, applied=False, version=result.version, delay=delay,
                    reason=f"stale: delay {delay} exceeds tau_max {tau_max}; pull a fresher "
                           f"model (its aggregate was refused)"))
            else:
                mb.conn.send(Error(code=REFUSED, req=mb.req,
                                   message=f"the server refused the aggregate ({result.reason}); "
                                           f"send update {mb.uid} straight to the server"))

    def _fail(self, members: list[_Member], why: str) -> None:
        """Members still arriving are told when their update is in (the group is closed)."""
        log.warning("%s; %d members go straight to the server", why, len(members))
        for mb in members:
            mb.conn.send(Error(code=FAILED, req=mb.req,
                               message=f"{why}; send update {mb.uid} straight to the server"))

    async def close(self) -> None:
        for group in list(self.groups.values()):
            self._close(group, "the aggregator stopped")
            self._fail(list(group.members.values()), "the aggregator stopped")
        for forward in list(self._forwards):
            forward.cancel()
        await self._links.close()
        await super().close()


class _AggregatorProtocol(EndpointProtocol):
    """One worker's connection to the aggregator."""

    endpoint: Aggregator
    accepts = roles.AGGREGATOR

    def __init__(self, aggregator: Aggregator) -> None:
        super().__init__(aggregator)
        self.aggregator = aggregator
        self._block: np.ndarray | None = None  # the data block of the frame arriving

    def allocate(self, msg_type: MsgType, nbytes: int) -> Any:
        # A fresh buffer per member: it is kept until its group is summed.
        block = default_allocate(msg_type, nbytes)
        if msg_type is MsgType.PUSH:
            self._block = block
        return block

    def after_events(self) -> None:
        """Sum what the members of this push's group have received so far."""
        partial = self.conn.receiving()
        if partial is None or partial.msg_type is not MsgType.PUSH:
            return
        push = partial.head
        fan_in, index = push.fan_in, push.index
        req, uid, base = push.req, push.uid, push.base_version
        if (push.dst is None or push.group is None or fan_in is None or index is None
                or uid is None
                or not all(sp.dtype == np.dtype("<f4") for sp in partial.specs)):
            return  # not an aggregation member: refused when the frame is complete
        agg = self.aggregator
        dst = agg.destinations.match(push.dst)
        if dst is None:
            return  # no group, no dial: refused when the frame is complete
        key = (dst, push.group)
        group = agg.group_for(key, fan_in, len(partial.data),
                              partial.specs)
        if group is None or group.specs != partial.specs or group.sum.fan_in != fan_in:
            return
        head = group.heads.get(index)
        if head is None:
            head = _Member(self, req, uid, base, index)
            agg.member_started(group, head)
        elif head.conn is not self or head.req != req:
            return  # the index is taken: refused when the frame is complete
        group.sum.progress(index, partial.data, partial.received)
        group.progress.set()

    def on_lost(self) -> None:
        for group in list(self.aggregator.groups.values()):
            for index, head in group.heads.items():
                if head.conn is self and index not in group.members:
                    self.aggregator.member_lost(group, head)
                    break

    def handle(self, event: Any) -> None:
        agg = self.aggregator
        # This frame's own data block: a push without one allocates none, and
        # the last push's must not stand in for it (found by the fuzz test).
        block, self._block = self._block, None
        if event.group is None or event.uid is None or event.dst is None:
            self._refuse(event, "misrouted", "this is an aggregator: push here only what the "
                                             "controller routed through it (with its group)")
            return
        assert event.fan_in is not None and event.index is not None
        dst = agg.destinations.match(event.dst)
        if dst is None:
            agg.refuse_dst(self, event)
            return
        key = (dst, event.group)
        specs = tuple(spec_of(n, a) for n, a in event.tensors.items())
        if any(sp.dtype != np.dtype("<f4") for sp in specs):
            self._refuse(event, "bad_dtype", "aggregates hold float32 tensors only")
            return
        if not specs or block is None:
            self._refuse(event, "empty", "an aggregation member carries its update's tensors; "
                                         "this one has none")
            return
        group = agg.group_for(key, event.fan_in, len(block), specs)
        if group is None:
            agg.metrics.late_members.inc()
            self.send(Error(code=FAILED, req=event.req,
                            message=f"group {event.group} is closed: "
                                    f"{agg.closed_reason(key)}; send update {event.uid} "
                                    f"straight to the server"))
            return
        problem = None
        head = group.heads.get(event.index)
        if group.sum.fan_in != event.fan_in:
            problem = f"fan_in {event.fan_in}, the group's is {group.sum.fan_in}"
        elif event.index in group.members or (head is not None and (
                head.conn is not self or head.req != event.req)):
            taken = group.members.get(event.index) or head
            assert taken is not None
            problem = f"index {event.index} is taken by update {taken.uid}"
        elif group.specs != specs:
            problem = "its tensors differ from the group's first member's"
        if problem is not None:
            self.send(Error(code=FAILED, req=event.req,
                            message=f"update {event.uid} does not fit group {event.group} "
                                    f"({problem}); send it straight to the server"))
            return
        group.sum.member_done(event.index, block)
        member = _Member(self, event.req, event.uid, event.base_version, event.index)
        group.members[event.index] = member
        if head is None:
            agg.member_started(group, member)
        agg.member_in(group)

    def _refuse(self, event: Push, code: str, message: str) -> None:
        self.log.warning("refused push %d from %s (%s): %s", event.req, self.client, self.peer,
                         message)
        self.send(Error(code=code, req=event.req, message=message))
