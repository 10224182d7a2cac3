"""The aggregator: the asyncio side of `aggregation.GroupSum` (issue 5).

It runs inside `mlfabric agent --aggregate HOST:PORT` and speaks the job's
protocol with its token. Workers the controller routed through it push
their update here as member `index` of group `group` (`fan_in` members,
bound for the server `dst`); each member is received straight into a buffer
of its own and summed, in index order, as its bytes arrive. When all members
are in, one aggregate (their sum, with the list of members) goes to the
server, and each member is answered with its own outcome (applied, the
version, its delay).

Nothing is lost and nothing is applied twice: when the aggregate is not
applied (the server refused it, the server link failed, or the group timed
out waiting for a member), every member still waiting is answered with
`aggregate_failed`, and its worker sends the update straight to the server
with the same uid (a server applies a uid at most once). A member that
arrives after its group closed gets the same answer. If the aggregator dies,
its workers see the connection drop and do the same.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .aggregation import GroupSum
from .client_core import Handshake
from .endpoint import Endpoint, EndpointProtocol
from .errors import ConfigError, MlfabricError
from .metrics import AggregatorMetrics
from .protocol import (
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

log = logging.getLogger("mlfabric.aggregator")

GROUP_TIMEOUT = 2.0  # seconds from a group's first member to giving up on the rest
SERVER_DIAL_TIMEOUT = 10.0  # seconds to reach the server with an aggregate's link
MAX_UPDATE_BYTES = 1 << 32
_CLOSED_MEMORY = 4096  # closed groups remembered, so a late member is told at once
FAILED = "aggregate_failed"  # the aggregator could not deliver: re-send, and say so
REFUSED = "aggregate_refused"  # the server refused the aggregate: re-send, no one's fault


@dataclass
class _Member:
    conn: _AggregatorProtocol
    req: int
    uid: str
    base_version: int


@dataclass
class _Group:
    key: tuple[str, int]  # (server address, group id)
    specs: tuple[TensorSpec, ...]
    sum: GroupSum
    started: float
    members: dict[int, _Member] = field(default_factory=dict)
    timer: asyncio.TimerHandle | None = None


class Aggregator(Endpoint):
    """Sums groups of one job's updates and forwards each as one aggregate.

    >>> agg = Aggregator(job="mnist", token=b"...")
    >>> host, port = await agg.start("0.0.0.0", 7401)
    >>> await agg.close()
    """

    role = "aggregator"
    log = log

    def __init__(self, *, job: str, token: bytes, metrics: AggregatorMetrics | None = None,
                 group_timeout: float = GROUP_TIMEOUT, max_update_bytes: int = MAX_UPDATE_BYTES,
                 handshake_timeout: float = 10.0, name: str = "aggregator") -> None:
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
        self._links: dict[str, asyncio.Task[Any]] = {}
        self._forwards: set[asyncio.Task[None]] = set()

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

    def closed_reason(self, key: tuple[str, int]) -> str | None:
        return self._closed.get(key)

    def _close(self, group: _Group, reason: str) -> None:
        self.groups.pop(group.key, None)
        if group.timer is not None:
            group.timer.cancel()
        self._closed[group.key] = reason
        while len(self._closed) > _CLOSED_MEMORY:
            self._closed.popitem(last=False)

    def member_in(self, group: _Group) -> None:
        if group.sum.all_in:
            self.metrics.gather_seconds.observe(time.monotonic() - group.started)
            self._close(group, "its aggregate was forwarded")
            self._forward(group, group.sum.total())

    def _expire(self, key: tuple[str, int]) -> None:
        """A member did not arrive in time: forward what is in, and tell the
        late ones (now or when they arrive) to go straight to the server."""
        group = self.groups.get(key)
        if group is None:
            return
        self.metrics.group_timeouts.inc()
        self.metrics.gather_seconds.observe(time.monotonic() - group.started)
        missing = sorted(set(range(group.sum.fan_in)) - set(group.members))
        log.warning("group %d for %s: members %s did not arrive within %.1f s; forwarding the "
                    "other %d", key[1], key[0], missing, self.group_timeout, len(group.members))
        self._close(group, f"it timed out after {self.group_timeout:.1f} s without member(s) "
                           f"{missing}")
        if group.members:
            self._forward(group, group.sum.total_of(list(group.members)))

    # -- forwarding ----------------------------------------------------------------

    def _forward(self, group: _Group, total: np.ndarray) -> None:
        task = asyncio.get_running_loop().create_task(self._send_aggregate(group, total))
        self._forwards.add(task)
        task.add_done_callback(self._forwards.discard)

    def _dial_ahead(self, dst: str) -> None:
        from .aio import dial_ahead

        dial_ahead(self._links, dst, self._handshake(), SERVER_DIAL_TIMEOUT, "parameter server")

    async def _link(self, dst: str) -> Any:
        from .aio import reuse_or_dial

        return await reuse_or_dial(self._links, dst, self._handshake(), SERVER_DIAL_TIMEOUT,
                                   "parameter server")

    def _handshake(self) -> Handshake:
        return Handshake(self.job, self.token, f"{self.name} aggregator")

    async def _send_aggregate(self, group: _Group, total: np.ndarray) -> None:
        m = self.metrics
        members = [group.members[i] for i in sorted(group.members)]
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
            result = await server._request(
                "aggregate", lambda req: Push(req, base, tensors, members=push_members), base)
        except (OSError, MlfabricError) as exc:
            # A lost link is dialled again next time (reuse_or_dial); one
            # that carried a refusal is still good and is kept.
            m.aggregates.labels("failed").inc()
            self._fail(members, f"the aggregate could not be delivered to {dst}: {exc}")
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
        for mb, delay in zip(members, result.delays, strict=True):
            mb.conn.send(PushResult(req=mb.req, applied=True, version=result.version,
                                    delay=delay))

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
        from .aio import close_links

        await close_links(self._links)
        await super().close()


class _AggregatorProtocol(EndpointProtocol):
    """One worker's connection to the aggregator."""

    endpoint: Aggregator

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
        meta = partial.meta
        key, fan_in, index = (meta.get("dst"), meta.get("group")), meta.get("fan_in"), \
            meta.get("index")
        if not (isinstance(key[0], str) and type(key[1]) is int and type(fan_in) is int
                and type(index) is int and 0 <= index < fan_in):
            return  # checked properly when the frame is complete
        group = self.aggregator.group_for(key, fan_in, len(partial.data),  # type: ignore[arg-type]
                                          partial.specs)
        if (group is not None and group.specs == partial.specs and index not in group.members
                and group.sum.fan_in == fan_in):
            group.sum.progress(index, partial.data, partial.received)

    def handle(self, event: Any) -> None:
        if not isinstance(event, Push):
            self.protocol_error(f"an aggregator takes pushes only, got {type(event).__name__}")
            return
        agg = self.aggregator
        if event.group is None or event.uid is None or event.dst is None:
            self._refuse(event, "misrouted", "this is an aggregator: push here only what the "
                                             "controller routed through it (with its group)")
            return
        assert event.fan_in is not None and event.index is not None
        key = (event.dst, event.group)
        specs = tuple(spec_of(n, a) for n, a in event.tensors.items())
        if any(sp.dtype != np.dtype("<f4") for sp in specs):
            self._refuse(event, "bad_dtype", "aggregates hold float32 tensors only")
            return
        block = self._block
        assert block is not None
        group = agg.group_for(key, event.fan_in, len(block), specs)
        if group is None:
            agg.metrics.late_members.inc()
            self.send(Error(code=FAILED, req=event.req,
                            message=f"group {event.group} is closed: "
                                    f"{agg.closed_reason(key)}; send update {event.uid} "
                                    f"straight to the server"))
            return
        problem = None
        if group.sum.fan_in != event.fan_in:
            problem = f"fan_in {event.fan_in}, the group's is {group.sum.fan_in}"
        elif event.index in group.members:
            problem = f"index {event.index} is taken by update {group.members[event.index].uid}"
        elif group.specs != specs:
            problem = "its tensors differ from the group's first member's"
        if problem is not None:
            self.send(Error(code=FAILED, req=event.req,
                            message=f"update {event.uid} does not fit group {event.group} "
                                    f"({problem}); send it straight to the server"))
            return
        group.sum.member_done(event.index, block)
        group.members[event.index] = _Member(self, event.req, event.uid, event.base_version)
        agg.member_in(group)

    def _refuse(self, event: Push, code: str, message: str) -> None:
        self.log.warning("refused push %d from %s (%s): %s", event.req, self.client, self.peer,
                         message)
        self.send(Error(code=code, req=event.req, message=message))
