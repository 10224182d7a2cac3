"""The client: `await mlfabric.aio.connect(...)`, and the engine the blocking
`mlfabric.connect()` runs on a thread of its own.

Same API as the blocking client with awaitables: `await ps.pull()`, and
`ps.push(...)` returns an `AsyncPushFuture` of the outcome at once. Pushed
arrays are handed to the transport without a copy: do not modify them until
the push's future is done.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import ssl
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..compression import Codec, ErrorFeedback, Significance, parse_offer
from ..compression import parse as parse_compression
from ..compression.feedback import measure_encode
from ..errors import ConfigError, ConnectionLost, MlfabricError
from ..runtime.metrics import ClientMetrics
from ..transport import tls
from ..wire.handshake import ClientHandshake
from ..wire.protocol import (
    PART_SEP,
    BlockPlan,
    Failover,
    FrameTensors,
    LaidOutTensors,
    Pull,
    PullCancel,
    Push,
    ReplicaAt,
    Scatter,
    layout,
    spec_of,
)
from ..wire.streamed import StreamedBlock
from .agent_report import TransferReporter, job_agent_key
from .aio_control import AsyncControlledPushes
from .compressed import CompressedParts
from .control_book import AGGREGATOR_COMMAND, AGGREGATOR_DIAL_TIMEOUT
from .core import (
    DEFAULT_PUSH_TIMEOUT,
    PULL_WAIT,
    check_base_version,
    check_push_timeout,
    check_update,
    default_client_name,
    laid_out,
    laid_out_update,
    parse_address,
    resolve_token,
    watch_period,
)
from .futures import AsyncPushFuture
from .link import FrameWriter, Link, LinkPool, PartFrame, open_link
from .outcome import PushOutcome

log = logging.getLogger("mlfabric.client")


async def connect(
    address: str,
    *,
    job: str,
    token: str | bytes | None = None,
    token_file: str | os.PathLike[str] | None = None,
    timeout: float = 10.0,
    name: str | None = None,
    metrics: ClientMetrics | None = None,
    controller: str | None = None,
    host: str | None = None,
    controller_fallback: str = "fifo",
    controller_timeout: float = 30.0,
    replica: str | None = None,
    failover_timeout: float = 30.0,
    replica_backlog: int = 64,
    replica_timeout: float = 10.0,
    push_timeout: float | None = DEFAULT_PUSH_TIMEOUT,
    agent: str | None = None,
    agent_key_file: str | os.PathLike[str] | None = None,
    tls_cert: str | os.PathLike[str] | None = None,
    tls_key: str | os.PathLike[str] | None = None,
    tls_ca: str | os.PathLike[str] | None = None,
    compression: str | None = None,
    significance: float | None = None,
) -> AsyncClient:
    """Connect to the parameter server at `address` ("HOST:PORT") for `job`.

    The controller arguments work as in mlfabric.connect(), and so do
    `replica` (worker-driven replication: a push's future resolves once the
    replica applied the update too, or after `replica_timeout` seconds
    without its answer), `failover_timeout` and `replica_backlog`: with both
    `controller` and `replica` the client fails over by itself to the replica
    the controller promotes, re-sends what the lost server never answered,
    and feeds a replica that joins later. Every push resolves within
    `push_timeout` seconds, and with `agent` ("HOST:PORT" of this host's
    `mlfabric agent`) pushes of 64 KiB or more are reported to it, logged in
    with the job's agent key from `agent_key_file`, as with mlfabric.connect()
    (which runs this client on a thread of its own). With `tls_cert`,
    `tls_key` and `tls_ca` (all three), every link this client opens (to the
    server, the controller, a replica, an aggregator, the agent) is mutual
    TLS, as with mlfabric.connect(). `compression` sends compressed updates
    with error feedback, and `significance` holds back pushes too small to
    matter, as with mlfabric.connect()."""
    check_push_timeout(push_timeout)
    offer = None if compression is None else parse_offer(compression)
    codec = None if compression is None or offer is not None else parse_compression(compression)
    tls_files = tls.files(tls_cert, tls_key, tls_ca, tls.SETTINGS)
    ctx = None if tls_files is None else tls.client_context(tls_files, tls.SETTINGS)
    agent_key = None if agent is None else job_agent_key(agent_key_file, job)
    secret = resolve_token(token, token_file)
    hs = ClientHandshake(job, secret, name or default_client_name())
    proto = await open_link(address, hs, timeout, "parameter server", metrics=metrics, tls=ctx)
    client = AsyncClient(proto)
    if codec is not None or offer is not None or significance is not None:
        try:
            if codec is not None or offer is not None:
                client.compress_with(codec, offer)
            if significance is not None:
                client.hold_insignificant(significance)
        except ConfigError:
            await client.close()
            raise
    client._dial = (job, secret, hs.name, timeout, metrics)
    client._tls, client._tls_ctx = tls_files, ctx
    if push_timeout is not None:
        client._watch_pushes(push_timeout)
    if agent is not None:
        assert agent_key is not None
        try:
            client._reporter = TransferReporter(agent, agent_key, name=hs.name, tls=ctx)
        except BaseException:
            await client.close()
            raise
        client._peer_host = proto.transport.get_extra_info("peername")[0]
    if replica is not None:
        from .replica_feed import ReplicaFeed, ReplicaFeeds

        try:
            replica_client = await connect(replica, job=job, token=secret, timeout=timeout,
                                           name=name, tls_cert=tls_cert, tls_key=tls_key,
                                           tls_ca=tls_ca)
        except BaseException:
            await client.close()
            raise
        mismatch = _replica_mismatch(client, replica_client)
        if mismatch is not None:
            await replica_client.close()
            await client.close()
            raise ConfigError(mismatch)
        client._replica_timeout = replica_timeout
        try:
            feed = ReplicaFeed(replica_client, parse_address(replica)[0],
                               timeout=replica_timeout,
                               schedule=asyncio.get_running_loop().call_later)
        except ConfigError:
            await replica_client.close()
            await client.close()
            raise
        client._feeds = ReplicaFeeds(feed)
        if controller is not None:
            from .failover import AsyncFailoverWait

            try:
                client._feeds = ReplicaFeeds(feed, replica_backlog)
                client._failover = AsyncFailoverWait(failover_timeout)
            except ConfigError:
                await client.close()
                raise
            feed.on_lost = client._feeds.lost
    if controller is not None:
        sock = proto.transport.get_extra_info("socket")
        controlled = AsyncControlledPushes(
            client, controller, ClientHandshake(job, secret, name or default_client_name()),
            aggregators=LinkPool(lambda address: dial(
                address, hs, AGGREGATOR_DIAL_TIMEOUT, "aggregator", command=AGGREGATOR_COMMAND,
                tls=ctx)),
            host=host or sock.getsockname()[0], dst=sock.getpeername()[0],
            fallback=controller_fallback, timeout=controller_timeout,
            shard=client.welcome_shard.index if client.welcome_shard is not None else None,
            # A compressed part is a fraction of its shard's block: it goes
            # whole, not a chunk at a time.
            chunk=client.welcome_shard.chunk
            if client.welcome_shard is not None and client.compression is None else 0,
            metrics=metrics, tls=ctx)
        try:
            controlled.book.options = client.options
            await controlled.start()
            fb = client.compression
            if fb is not None and not client.options and fb.codec.name != "none" \
                    and controlled.aggregators_offered():
                # The controller plans this worker's transfers at their
                # compressed size; through an aggregator they would go whole.
                raise ConfigError(
                    f"the controller at {controller} routes updates through aggregators, "
                    f"which sum whole updates, and compression={fb.codec.spec!r} makes "
                    f"every transfer compressed: connect with compression='adaptive' (the "
                    f"controller then sends grouped updates whole, others compressed as "
                    f"their deadlines need), or start the controller without --aggregator")
        except BaseException:
            await client.close()
            raise
        client._controlled = controlled
        if client._feeds is not None and client._feeds.current is not None:
            client._feeds.current.report = controlled.report_replicated
    return client


async def dial(address: str, hs: ClientHandshake, timeout: float, what: str,
               command: str | None = None, tls: ssl.SSLContext | None = None) -> AsyncClient:
    """An `AsyncClient` on a new link to `address` (a server or an aggregator)."""
    return AsyncClient(await open_link(address, hs, timeout, what, command=command, tls=tls))


def _replica_mismatch(server: AsyncClient, replica: AsyncClient) -> str | None:
    """Why `replica` cannot keep `server`'s model, or None: it must serve the
    same shard of the same partition (or, like it, the whole model)."""
    def what(info: Any) -> str:
        return "the whole model" if info is None else f"shard {info.index} of {info.count}"

    mine, theirs = server.welcome_shard, replica.welcome_shard
    if (mine is None) != (theirs is None) or (
            mine is not None and theirs is not None
            and (mine.index, mine.count, mine.digest) != (theirs.index, theirs.count,
                                                           theirs.digest)):
        same_place = (mine is not None and theirs is not None
                      and (mine.index, mine.count) == (theirs.index, theirs.count))
        return (f"the replica at {replica.address} keeps "
                f"{what(theirs) + ' of another partition' if same_place else what(theirs)}, "
                f"the server at {server.address} {what(mine)}: give each shard the replica "
                f"started with its --shard, the same --init and --chunk-bytes")
    if replica.specs != server.specs:
        return (f"the replica at {replica.address} keeps another model than the server at "
                f"{server.address}: start it with the server's --init")
    return None


class AsyncClient:
    """A connection to one parameter server, for asyncio programs."""

    def __init__(self, proto: Link) -> None:
        self._proto = proto
        welcome = proto.welcomed.result()
        self.address = proto.address
        self.specs = welcome.tensors
        self.tau_max = welcome.tau_max
        self.momentum = welcome.momentum
        self.session = welcome.session
        self.last_version = welcome.version
        self.welcome_shard = welcome.shard  # a sharded server's part (see client.sharded)
        self.block_layout = layout(self.specs)  # the frame layout of a whole update
        self.block_plan = BlockPlan.whole(self.specs)  # the same, sent from the arrays
        self._controlled: Any = None  # AsyncControlledPushes with a controller
        self._feeds: Any = None  # ReplicaFeeds with worker-driven replication
        self._failover: Any = None  # AsyncFailoverWait with a controller and a replica
        self._replica_timeout = 10.0  # seconds a push waits for the replica
        # (job, token, name, timeout, metrics), to connect to servers and
        # replicas the controller names later.
        self._dial: tuple[str, bytes, str, float, ClientMetrics | None] | None = None
        # What connect() was given, for the links the client opens later.
        self._tls: tls.TLSFiles | None = None
        self._tls_ctx: ssl.SSLContext | None = None
        # Replica changes the controller announced, acted on one at a time:
        # a join announced right after a failover must find the new server.
        self._changes: collections.deque[Failover | ReplicaAt] = collections.deque()
        self._changer: asyncio.Task[None] | None = None
        # Compressed pushes (issue 35): the residuals of error feedback, and
        # the bytes an update then takes on the wire (what the controller plans).
        self._compression: ErrorFeedback | None = None
        self.wire_bytes = self.block_layout[1]
        # compression="adaptive": the forms offered to the controller, (codec,
        # bytes, encode seconds), and their codecs by name (its go names one).
        self.options: tuple[tuple[str, int, float], ...] = ()
        self._offer: dict[str, Codec] = {}
        # significance=: pushes too small to matter wait in the residual (Gaia).
        self.significance: Significance | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._reporter: TransferReporter | None = None  # with an agent
        self._peer_host = ""

    def _watch_pushes(self, timeout: float) -> None:
        """Fail the pushes past `timeout` (see connect())."""
        async def watch() -> None:
            while True:
                await asyncio.sleep(watch_period(timeout))
                self._proto.requests.expire(timeout, self.address)
                if self._controlled is not None:
                    self._controlled.expire(timeout)

        self._watcher = asyncio.get_running_loop().create_task(watch())

    async def pull(self, *, including: asyncio.Future[PushOutcome] | None = None,
                   into: Scatter | None = None) -> tuple[int, dict[str, np.ndarray]]:
        """The model as (version, {name: array}), consistent at that version.

        With `including` (a future push() returned): the model once that
        update's outcome is known, with the update in it if it was applied;
        the server streams it while the update arrives, as for the blocking
        client's pull(including=...). Cancelling this call leaves the push
        alone.

        With `into`, the model's bytes are received straight into the
        scatter's runs and the arrays returned are its `tensors` (a sharded
        client receives every shard's part into the whole model so); if the
        server's tensor list is not the scatter's, into a buffer of their own.
        """
        if including is not None:
            return await self._pull_including(including, into)
        failover = self._failover
        generation = failover.generation if failover is not None else 0
        try:
            version, params = await self._request("pull", Pull, None, into)
        except ConnectionLost:
            if failover is None or not await failover.wait_past(generation):
                raise
            return await self.pull(into=into)  # from the promoted replica
        return self._pulled(version, params, into)

    def _pulled(self, version: int, params: dict[str, np.ndarray], into: Scatter | None
                ) -> tuple[int, dict[str, np.ndarray]]:
        self.last_version = max(self.last_version, version)
        if self.significance is not None and into is None:
            self.significance.observe(params)  # what the next pushes are measured against
        return version, params

    async def _pull_including(self, push: asyncio.Future[PushOutcome], into: Scatter | None
                              ) -> tuple[int, dict[str, np.ndarray]]:
        uid = getattr(push, "uid", None)
        held: asyncio.Future[Any] | None = None
        reqs: list[tuple[Link, int]] = []
        if uid is not None and not push.done():
            proto = self._proto

            def held_pull(req: int) -> Pull:
                reqs.append((proto, req))
                return Pull(req=req, uid=uid, wait=PULL_WAIT)
            try:
                held = self._request("pull", held_pull, None, into)
            except ConnectionLost:
                held = None  # the link is lost: the pull after the outcome fails over
        try:
            try:
                outcome: PushOutcome | None = await asyncio.shield(push)
            except Exception:
                outcome = None  # the push failed: the model as it is
            if held is not None and outcome is not None and outcome.applied:
                try:
                    version, params = await held
                except ConnectionLost:
                    return await self.pull(into=into)  # failover: from the promoted replica
                if version >= outcome.version:
                    return self._pulled(version, params, into)
        finally:
            self._give_up(reqs)  # unless answered: not applied, or cancelled
        return await self.pull(into=into)

    def _give_up(self, reqs: list[tuple[Link, int]]) -> None:
        """Ignore the held pull's answer, and tell the server to forget it
        (nothing for a pull already answered)."""
        for proto, req in reqs:
            if (proto is self._proto and proto.transport is not None
                    and proto.requests.discard(req)):
                proto.send(PullCancel(req=req))

    def push(
        self, update: Mapping[str, Any], *, base_version: int
    ) -> AsyncPushFuture:
        """Hand an update over; returns a future of its PushOutcome at once.

        The arrays are sent as they are, without a copy: do not modify them
        until the future is done, whatever the options (the client copies
        only what it must keep: updates that wait for the controller's go or
        for the replica). `await client.flushed()` says when the bytes have
        left, for a caller that wants its arrays back sooner."""
        base = check_base_version(base_version)
        return self.submit(self.prepare(update), base)

    def compress_with(self, codec: Codec | None, offer: tuple[Codec, ...] | None = None
                      ) -> None:
        """Send every update from now on compressed by `codec`, with error
        feedback: what a push does not send (or a dropped update) goes with
        the next ones. Or, with `offer` (compression="adaptive"), offer the
        controller those forms and send each update as its go says (whole,
        the residual with it, when it names none). A shard's server keeps
        flat pieces of the model's tensors: each piece is compressed as a
        tensor of its own (low rank then sends them whole: they are 1-D)."""
        wrong = [s.name for s in self.specs if s.dtype != np.float32]
        if wrong:
            raise ConfigError(f"compression works on float32 models; tensor {wrong[0]!r} of "
                              f"the server's model is not")
        def model_bytes(c: Codec) -> int:
            return sum(c.encoded_bytes(s.shape) for s in self.specs)

        if offer:
            # Each form's encoding time, timed once here on the model's shapes
            # and then by every push sent so (`note_encoded`): the controller
            # counts it against what the form saves on the wire.
            shapes = [s.shape for s in self.specs]
            self._offer = {c.spec: c for c in offer}
            self.options = tuple((c.spec, model_bytes(c), measure_encode(c, shapes))
                                 for c in offer)
            codec = parse_compression("none")
        assert codec is not None
        self._compression = ErrorFeedback(codec)
        self.wire_bytes = model_bytes(codec)

    def hold_insignificant(self, threshold: float) -> None:
        """Hold every push whose relative magnitude ||update + residual|| /
        ||model pulled last|| is below `threshold` (Gaia's filter,
        `compression.significance`): it is folded into the error-feedback
        residual and goes with a later push; its outcome is not applied,
        `folded`, with the reason. Without compression, the residual is kept
        and sent whole."""
        significance = Significance(threshold)
        if self._compression is None:
            self.compress_with(parse_compression("none"))
        self.significance = significance

    @property
    def compression(self) -> ErrorFeedback | None:
        """The residuals of compressed pushes (None: updates go whole)."""
        return self._compression

    def with_residual(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The update plus what waits in the residuals, whole, the residuals
        emptied: what a push through an aggregator carries (it sums whole
        updates), so that nothing waits there for a push that may never go
        straight to the server. Without compression, the update as it is."""
        if self._compression is None:
            return dict(arrays)
        whole = self._compression.encode(arrays, parse_compression("none"))
        return {n: e.arrays["v"].reshape(e.shape) for n, e in whole.items()}

    def dropped(self, arrays: Mapping[str, np.ndarray]) -> bool:
        """An update the controller dropped (never sent): with compression,
        all of it goes into the residuals, to go with the next push (True);
        without, it is lost (False)."""
        if self._compression is None:
            return False
        self._compression.fold(arrays)
        return True

    def prepare(self, update: Mapping[str, Any]) -> Mapping[str, np.ndarray]:
        """`update` checked against the model: its arrays; for many small
        tensors, laid out as one frame block (`core.laid_out_update`)."""
        if self._compression is not None:  # encoded when sent: each array by name
            return check_update(update, self.specs)
        fast = laid_out_update(update, self.specs, self.block_layout, self.block_plan)
        return fast if fast is not None else check_update(update, self.specs)

    @staticmethod
    def check_base(base_version: Any) -> int:
        """`base_version` as push() takes it, or TypeError/ValueError."""
        return check_base_version(base_version)

    def refusal(self) -> BaseException | None:
        """The error push() would raise now (a lost link with nothing to fail
        over to, or the controller's refusal of this worker), or None. Safe to
        call from another thread: it only reads."""
        if self._controlled is not None and self._controlled.book.refusal is not None:
            return self._controlled.book.refusal  # the controller refused this worker
        if self._feeds is not None or self._controlled is not None:
            return None  # parked for a failover, or the controller link reports it
        return self._link_error()

    def _link_error(self) -> BaseException | None:
        """Why the link cannot take a request now, or None."""
        proto = self._proto
        if proto.error is not None or proto.transport is None:
            return proto.error or ConnectionLost(f"the client for {self.address} is closed")
        return None

    def submit(self, arrays: Mapping[str, np.ndarray], base: int) -> AsyncPushFuture:
        """push() of an update it has already checked (`check_update`): the
        blocking client checks in the caller's thread, then submits here."""
        if self.significance is not None:
            held = self._hold(arrays, base)
            if held is not None:
                return held
        if self._feeds is not None:
            return self._push_replicated({n: a.copy() for n, a in arrays.items()}, base)
        if self._controlled is not None:
            return self._controlled.push(arrays, base, self.wire_bytes)
        return self.send_push(arrays, base)

    def _hold(self, arrays: Mapping[str, np.ndarray], base: int) -> AsyncPushFuture | None:
        """A push below the significance threshold, folded into the residual
        and answered at once (None: it goes)."""
        assert self.significance is not None and self._compression is not None
        relative = self.significance.holds(self._compression.pending_norm(arrays))
        if relative is None:
            return None
        metrics = self._proto.metrics
        if metrics is not None:
            metrics.pushes.labels("held").inc()
        return self.fold_held(arrays, base, self.significance.reason(relative))

    def fold_held(self, arrays: Mapping[str, np.ndarray], base: int, reason: str
                  ) -> AsyncPushFuture:
        """A push held back (by the significance filter: this client's, or a
        sharded client's over the whole model): folded into the residuals,
        and its outcome at once, not applied, `folded`, with `reason`."""
        assert self._compression is not None
        self._compression.fold(arrays)
        done = AsyncPushFuture(loop=asyncio.get_running_loop())
        done.set_result(PushOutcome(applied=False, version=self.last_version, delay=None,
                                    reason=reason, base_version=base, folded=True))
        return done

    def _push_replicated(self, arrays: Mapping[str, np.ndarray], base: int
                         ) -> AsyncPushFuture:
        """To the server, then, numbered with the version it produced,
        straight to the replica; resolved once the replica has it."""
        done = AsyncPushFuture(loop=asyncio.get_running_loop())
        self._push_to_server(arrays, base, done, via_controller=True)
        return done

    def _push_to_server(self, arrays: Mapping[str, np.ndarray], base: int,
                        done: asyncio.Future[PushOutcome], via_controller: bool) -> None:
        """An update the server never answered is parked for the failover,
        then re-sent straight to the promoted replica, without asking the
        controller again."""
        failover = self._failover
        generation = failover.generation if failover is not None else 0
        at: list[asyncio.Future[PushOutcome]] = []  # the push to the server, once made

        def sent() -> Mapping[str, np.ndarray]:
            """The update as it went to the server: compressed, its parts."""
            return (getattr(at[0], "sent_as", None) if at else None) or arrays

        def lost(exc: BaseException) -> None:
            if failover is not None and isinstance(exc, ConnectionLost):
                failover.park(generation, lambda: self._push_to_server(
                    sent(), base, done, via_controller=False), done)
            elif not done.done():
                done.set_exception(exc)

        if done.done():  # cancelled by the caller while parked
            return
        try:
            if via_controller and self._controlled is not None:
                at_server = self._controlled.push(arrays, base, self.wire_bytes)
            else:
                at_server = self.send_push(arrays, base)
        except MlfabricError as exc:
            lost(exc)
            return
        at.append(at_server)
        if isinstance(done, AsyncPushFuture) and done.uid is None:
            done.uid = getattr(at_server, "uid", None)  # for pull(including=...)

        def then(f: asyncio.Future[PushOutcome]) -> None:
            if done.done():
                return
            if f.cancelled():
                done.cancel()
                return
            exc = f.exception()
            if exc is not None:
                lost(exc)
                return
            outcome = f.result()
            update = sent()
            feed = self._feeds.acknowledged(update, base, outcome)
            if feed is not None:
                feed.replicate(update, base, outcome, done)
            else:
                done.set_result(outcome)

        at_server.add_done_callback(then)

    def replica_change(self, event: Failover | ReplicaAt) -> None:
        """The controller promoted the replica (move there) or a new replica
        joined (feed it)."""
        if self._failover is None:
            log.warning("controller reports a replica change (%s), but this client has no "
                        "replica configured: ignoring it", event)
            return
        if isinstance(event, Failover) and event.server == self.address:
            # Said again by a controller that took the shard over, in case
            # the one that promoted it could not say it: already done here.
            log.info("already served by %s (failed over to before)", event.server)
            return
        if isinstance(event, Failover) and self._controlled is not None:
            self._controlled.book.dst = parse_address(event.server)[0]
        self._changes.append(event)
        if self._changer is None:
            self._changer = asyncio.get_running_loop().create_task(self._change_loop())

    async def _change_loop(self) -> None:
        try:
            while self._changes:
                event = self._changes.popleft()
                try:
                    if isinstance(event, Failover):
                        await self._fail_over(event.server)
                    else:
                        await self._attach_replica(event.address, event.version)
                except MlfabricError as exc:
                    log.error("cannot act on %s: %s", event, exc)
        finally:
            self._changer = None

    async def _fail_over(self, address: str) -> None:
        """The controller promoted the replica at `address`: serve from it."""
        assert self._dial is not None and self._failover is not None
        job, secret, name, timeout, metrics = self._dial
        proto = await open_link(address, ClientHandshake(job, secret, name), timeout,
                                "parameter server", metrics=metrics, tls=self._tls_ctx)
        self._feeds.retire()  # before the first answer from the new server
        old, self._proto = self._proto, proto
        welcome = proto.welcomed.result()
        self.address, self.last_version = address, welcome.version
        old.close()
        log.warning("failed over to %s (version %d)", address, welcome.version)
        self._failover.advance()

    async def _attach_replica(self, address: str, version: int) -> None:
        """A new replica serves from `version`: send it the kept updates above
        that version, then every update the server acknowledges."""
        from .replica_feed import ReplicaFeed

        assert self._dial is not None
        current = self._feeds.current
        if current is not None and current.replica.address == address:
            # The same replica, resynced from the server: this client's feed
            # to it still stands.
            log.info("replica at %s serves from version %d; still feeding it", address, version)
            return
        job, secret, name, timeout, _ = self._dial
        t = self._tls
        replica = await connect(address, job=job, token=secret, name=name, timeout=timeout,
                                tls_cert=t.cert if t else None, tls_key=t.key if t else None,
                                tls_ca=t.ca if t else None)
        feed = ReplicaFeed(replica, parse_address(address)[0],
                           report=self._controlled.report_replicated
                           if self._controlled is not None else None,
                           timeout=self._replica_timeout,
                           schedule=asyncio.get_running_loop().call_later)
        feed.on_lost = self._feeds.lost
        kept = self._feeds.attach(feed, version)
        loop = asyncio.get_running_loop()
        for _, (arrays, base, outcome) in kept:
            feed.replicate(arrays, base, outcome, loop.create_future())
        log.warning("replica at %s joined from version %d; %d kept updates sent to it",
                    address, version, len(kept))

    def send_push(self, arrays: Mapping[str, np.ndarray], base: int, seq: int | None = None,
                  **fields: Any) -> AsyncPushFuture:
        """Send a push frame as given, without push()'s checks (`PushLink`).
        `fields`: a push's uid and aggregation fields (protocol.Push)."""
        return self.send_push_part(arrays, base, None, seq, **fields)[0]

    def send_push_part(self, arrays: Mapping[str, np.ndarray], base: int, upto: int | None,
                       seq: int | None = None, **fields: Any
                       ) -> tuple[AsyncPushFuture, PartFrame | None]:
        """`send_push`, with only the first `upto` bytes of the frame's data
        block sent now (None: all of it): the returned `PartFrame` sends the
        rest (it is None if the whole frame went, or waits to go whole
        behind another frame sent in parts)."""
        fut = AsyncPushFuture(loop=asyncio.get_running_loop())
        chosen = fields.pop("codec", None)  # the controller's choice (compression="adaptive")
        tensors: Mapping[str, np.ndarray]
        if isinstance(arrays, CompressedParts):  # encoded before: the same bits again
            tensors = arrays
            fields["codecs"] = arrays.codecs
        elif self._compression is not None and seq is None and "group" not in fields:
            # Encoded now, as it leaves: the residuals hold what no push sent yet.
            codec = self._offer.get(chosen) if chosen is not None else None
            if chosen is not None and codec is None:
                log.warning("the controller named compression %r, which this worker did not "
                            "offer (%s): sending the update whole", chosen,
                            ", ".join(self._offer) or "none")
            started = time.perf_counter()
            encoded = self._compression.encode(arrays, codec)
            if codec is not None:
                self.note_encoded(codec.spec, time.perf_counter() - started)
            tensors = fut.sent_as = CompressedParts(
                {f"{n}{PART_SEP}{p}": a for n, e in encoded.items() for p, a in e.arrays.items()},
                tuple((n, e.codec) for n, e in encoded.items()))
            fields["codecs"] = tensors.codecs
        else:
            tensors = laid_out(arrays, self.specs, self.block_layout)
        _, event = self._new_request(
            "push", lambda req: Push(req, base, tensors, seq, **fields), base, fut)
        part = None
        if upto is None:
            self._proto.send(event)
        else:
            part = self._proto.send_part(event, upto)
        fut.add_done_callback(self._note_version)
        if self._reporter is not None:
            nbytes = (len(tensors.data) if isinstance(tensors, FrameTensors)
                      else tensors.nbytes if isinstance(tensors, LaidOutTensors)
                      else sum(a.nbytes for a in arrays.values()))
            fut.add_done_callback(functools.partial(self._report, nbytes, time.monotonic()))
        return fut, part

    def note_encoded(self, spec: str, seconds: float) -> None:
        """A push went compressed by the offered form `spec` and took
        `seconds` to encode: the offer's estimate moves halfway to it (one
        slow encode, a page fault or a busy core, does not set it alone)."""
        self.options = tuple((c, n, (s + seconds) / 2 if c == spec else s)
                             for c, n, s in self.options)
        if self._controlled is not None:
            self._controlled.book.options = self.options

    def _report(self, nbytes: int, started: float, fut: asyncio.Future[Any]) -> None:
        """Tell the agent how long the push took (a sample of the path's rate)."""
        if self._reporter is not None and not fut.cancelled() and fut.exception() is None:
            self._reporter.report(self._peer_host, nbytes, time.monotonic() - started)

    def _note_version(self, fut: asyncio.Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.last_version = max(self.last_version, fut.result().version)

    def _request(self, kind: str, make_event: Any, base_version: int | None,
                 into: Scatter | None = None) -> Any:
        fut, event = self._new_request(kind, make_event, base_version, into=into)
        self._proto.send(event)
        return fut

    def _new_request(self, kind: str, make_event: Any, base_version: int | None,
                     fut: asyncio.Future[Any] | None = None, into: Scatter | None = None,
                     ) -> tuple[asyncio.Future[Any], Any]:
        """A future registered for the answer (`fut`, or a new one), and the
        event to send for it."""
        error = self._link_error()
        if error is not None:
            raise error
        proto = self._proto
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
        return fut, make_event(proto.requests.add(kind, fut, base_version, into))

    def request_streamed(self, kind: str, make_event: Any, base_version: int | None
                          ) -> tuple[asyncio.Future[Any], FrameWriter]:
        """Like `_request`, but only the frame's header and fields go out now:
        its data block follows through the returned writer, as it becomes
        final. Nothing else may be sent on this link until the writer is
        done (the caller serialises)."""
        fut, event = self._new_request(kind, make_event, base_version)
        proto = self._proto
        proto.write(proto.conn.send_head(event))
        specs = [spec_of(n, np.asarray(a)) for n, a in event.tensors.items()]
        return fut, FrameWriter(proto, StreamedBlock(specs))

    def pace(self, rate: float | None) -> bool:
        """Cap what this client's link to its server sends at `rate` bytes/s
        (None: no cap again): a controller's go beside a transfer that must
        land first. False where it cannot (`runtime.pacing`)."""
        return self._proto.pace(rate)

    async def flushed(self) -> None:
        """Wait until every byte handed to this client's link has gone to the
        operating system (what the blocking client waits for in push()). A
        lost link has nothing left to send: its error shows on the futures."""
        await self._proto.flushed()

    async def drain(self) -> None:
        """Wait until the link has sent what it was given: call it between
        pushes to bound the memory of queued updates."""
        await self._proto.can_write.wait()
        if self._proto.error is not None:
            raise self._proto.error

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self._controlled is not None:
            await self._controlled.close()
        if self._changer is not None:
            self._changer.cancel()
        if self._feeds is not None:
            for feed in self._feeds.all():
                await feed.aclose()
            self._feeds.warn_unprotected()
        if self._failover is not None:
            self._failover.close()
        if self._reporter is not None:
            self._reporter.close()
        self._proto.close()
        await self._proto.closed

    @property
    def closed(self) -> bool:
        return self._proto.transport is None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
