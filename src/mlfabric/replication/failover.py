"""Failover, the controller's side: heartbeats to the server, promotion of
the replica when they stop, and telling the workers.

`Heartbeat` is the decision (pure, a fake clock in tests): the server is
dead when it has not answered for `timeout` seconds after having answered
once (a server that never came up is not failed over: that is a deployment
error, reported as such in the log). `FailoverMonitor` carries it out.

The heartbeats also keep the divergence gate honest without relying on
workers: the server's answers carry the norm of every update it applied
(`on_server_pong`), the replica's its version, and a replica waiting for a
sequence number that will not come (its worker died after the server
applied it) says how long it has waited; after `gap_timeout` seconds the
monitor tells it to resync from the server's state (RESYNC), and reports
the version it took over (`on_resynced`).

Promotion names the server it replaces: the replica refuses it while it
still reaches that server itself, so a partition between the controller
and a live server does not make a second server. The monitor then goes
back to watching the server.

A monitor may start on a shard whose failover another controller already
carried out (a controller restarted with its old --server, or one taking
over another's shards: issue 34). So it first asks the replica its role:
one that answers as the server was promoted before, and is watched as the
server (`on_adopted`), not promoted again. A monitor taking over a shard
the job has been running on (`serving`) counts the server's silence from
its own start, as if it had answered once: the controller it replaces may
have seen its last answer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

from ..client.link import open_link
from ..errors import ConfigError, MlfabricError, ServerError
from ..runtime.loop import within
from ..wire.handshake import ClientHandshake
from ..wire.protocol import Error, Ping, Pong, Promote, Resync

DEFAULT_GAP_TIMEOUT = 1.0  # seconds a replica may wait for a sequence number
# Seconds a replica asked to take over spends checking the server itself.
PROMOTE_CHECK_TIMEOUT = 1.0
RESYNC_TIMEOUT = 60.0  # seconds to wait for a resync's answer before asking again

log = logging.getLogger("mlfabric.controller")


class Heartbeat:
    def __init__(self, timeout: float) -> None:
        if not timeout > 0:
            raise ConfigError(f"--heartbeat-timeout must be positive, got {timeout}")
        self.timeout = timeout
        self.last: float | None = None  # clock time of the last answer

    def heard(self, now: float) -> None:
        self.last = now

    def dead(self, now: float) -> bool:
        return self.last is not None and now - self.last > self.timeout


class FailoverMonitor:
    """Pings the server every `interval` s; after `timeout` s of silence,
    promotes the replica and calls `on_failover(replica_address, version,
    silent_since)`, then watches the promoted replica as the server. Until a
    new replica joins (`replica` set again) a lost server cannot be replaced.
    The replica is pinged too: when it is lost, `on_replica_lost(address)`.

    `since()`: the version above which the controller wants the norms of
    applied updates (None: none wanted); they arrive in the server's Pongs,
    passed to `on_server_pong(pong)`. Every Pong of the replica goes to
    `on_replica_pong(address, pong)` (the first on each connection carries
    its velocity); a resync it completed to `on_resynced(address, version,
    velocity)`."""

    def __init__(self, *, server: str, replica: str | None, job: str, token: bytes,
                 interval: float, timeout: float,
                 on_failover: Callable[[str, int, float], None],
                 on_server_up: Callable[[bool], None] = lambda up: None,
                 on_replica_lost: Callable[[str], None] = lambda address: None,
                 clock: Callable[[], float] | None = None,
                 since: Callable[[], int | None] = lambda: None,
                 on_server_pong: Callable[[Pong], None] = lambda pong: None,
                 on_replica_pong: Callable[[str, Pong], None] = lambda address, pong: None,
                 on_resynced: Callable[[str, int, float], None] = lambda a, v, n: None,
                 gap_timeout: float = DEFAULT_GAP_TIMEOUT,
                 on_adopted: Callable[[str, int], None] | None = None,
                 serving: bool = False) -> None:
        if not 0 < interval < timeout:
            raise ConfigError(f"--heartbeat-interval must be positive and below "
                              f"--heartbeat-timeout ({timeout}), got {interval}")
        if not gap_timeout > 0:
            raise ConfigError(f"--replica-gap-timeout must be positive, got {gap_timeout}")
        self.server: str = server
        self.replica: str | None = replica
        self.job, self.token = job, token
        self.interval = interval
        self.heartbeat = Heartbeat(timeout)
        self.on_failover = on_failover
        self.on_server_up = on_server_up
        self.on_replica_lost = on_replica_lost
        self.clock = clock or (lambda: asyncio.get_running_loop().time())
        self.since = since
        self.on_server_pong = on_server_pong
        self.on_replica_pong = on_replica_pong
        self.on_resynced = on_resynced
        self.gap_timeout = gap_timeout
        self.on_adopted = on_adopted
        self.serving = serving
        self.resyncs = 0  # RESYNCs sent
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self.run()), loop.create_task(self.run_replica())]

    async def close(self) -> None:
        for task in self._tasks:
            # Cancel until it ends: on Python 3.11, asyncio.wait_for (in
            # open_link) drops a cancellation that arrives as the connection
            # it waits for completes, and the heartbeat loop then ran on, so
            # a controller's close hung (seen in the failover tests).
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=self.interval)
            if not task.cancelled():
                task.exception()  # retrieved: the monitor is closing anyway

    async def run(self) -> None:
        if self.on_adopted is not None:
            await self._adopt_promoted()
        if self.serving:
            self.heartbeat.heard(self.clock())
        while True:
            await self.watch()
            replica = self.replica
            if replica is None:
                log.error("the server at %s is lost and there is no replica to promote: "
                          "start one (mlfabric server --role replica --join-from ...) or "
                          "restart the server from its checkpoint", self.server)
                while self.replica is None:
                    await asyncio.sleep(self.interval)
                replica = self.replica
            silent_since = self.heartbeat.last or self.clock()
            log.error("the server at %s has not answered for %.2f s: promoting the replica "
                      "at %s", self.server, self.heartbeat.timeout, replica)
            version = await self._promote(replica)
            if version is None:  # the replica still reaches the server: no failover
                self.heartbeat = Heartbeat(self.heartbeat.timeout)
                continue
            self.server = replica
            if self.replica == replica:  # not replaced by a join meanwhile
                self.replica = None
            self.heartbeat = Heartbeat(self.heartbeat.timeout)
            self.on_failover(replica, version, silent_since)

    async def _adopt_promoted(self) -> None:
        """If the replica already serves as the server (promoted before this
        monitor started), watch it as the server from now on."""
        replica = self.replica
        if replica is None:
            return
        answer: asyncio.Future[Pong] = asyncio.get_running_loop().create_future()

        def on_event(event: Any) -> None:
            if isinstance(event, Pong) and not answer.done():
                answer.set_result(event)

        try:
            link = await open_link(replica, self._hs(), self.heartbeat.timeout,
                                   "replica server", on_event=on_event)
            try:
                link.send(Ping(1))
                pong = await within(asyncio.shield(answer), self.heartbeat.timeout)
            finally:
                link.close()
        except (MlfabricError, TimeoutError):
            return  # not up (yet): its own heartbeats will say
        if pong.role != "server":
            return
        log.warning("the replica at %s already serves as the server at version %d (promoted "
                    "before this controller watched it): watching it as the server, not the "
                    "lost %s", replica, pong.version, self.server)
        self.server, self.replica = replica, None
        assert self.on_adopted is not None
        self.on_adopted(replica, pong.version)

    async def watch(self) -> None:
        """Return once the server is lost."""
        def ping(req: int, first: bool) -> Ping:
            return Ping(req, since=self.since())

        await self._beat(self.server, "parameter server", self.heartbeat, self.on_server_up,
                         lambda: False, ping, lambda link, pong: self.on_server_pong(pong))
        self.on_server_up(False)

    async def run_replica(self) -> None:
        """Ping the replica; when it is lost (not promoted, not replaced by a
        join), forget it and say so."""
        while True:
            replica = self.replica
            if replica is None:
                await asyncio.sleep(self.interval)
                continue
            hb = Heartbeat(self.heartbeat.timeout)
            await self._beat(replica, "replica server", hb, lambda up: None,
                             functools.partial(self._replaced, replica), self._replica_ping,
                             functools.partial(self._replica_pong, replica))
            if self.replica == replica:
                log.error("the replica at %s has not answered for %.2f s: the job runs "
                          "without one until another joins", replica, hb.timeout)
                self.replica = None
                self.on_replica_lost(replica)

    def _replaced(self, replica: str) -> bool:
        return self.replica != replica

    @staticmethod
    def _replica_ping(req: int, first: bool) -> Ping:
        # Its velocity once per connection: the gate's starting point.
        return Ping(req, velocity=True if first else None)

    def _replica_pong(self, replica: str, link: Any, pong: Pong) -> None:
        self.on_replica_pong(replica, pong)
        if pong.gap is None or pong.gap < self.gap_timeout:
            return
        now = self.clock()
        pending = getattr(link, "resync", None)
        if pending is not None and now - pending[1] < RESYNC_TIMEOUT:
            return  # one resync at a time
        self.resyncs += 1
        req = 1 << 40 | self.resyncs  # apart from the pings' numbers
        link.resync = (req, now)
        log.error("the replica at %s has waited %.2f s for an update that will not come "
                  "(its worker was lost after the server applied it): resyncing it from "
                  "the server at %s", replica, pong.gap, self.server)
        link.send(Resync(req=req, server=self.server))

    def _resync_answer(self, replica: str, link: Any, event: Any) -> bool:
        """Whether `event` answers the link's resync (and act on it)."""
        pending = getattr(link, "resync", None)
        if pending is None or getattr(event, "req", None) != pending[0]:
            return False
        link.resync = None
        if isinstance(event, Pong):
            log.warning("the replica at %s resynced from the server: now at version %d",
                        replica, event.version)
            self.on_resynced(replica, event.version, event.velocity or 0.0)
        elif isinstance(event, Error):
            log.error("the replica at %s could not resync: %s", replica, event.message)
        return True

    async def _beat(self, address: str, what: str, hb: Heartbeat,
                    on_up: Callable[[bool], None], stop: Callable[[], bool],
                    make_ping: Callable[[int, bool], Ping],
                    on_pong: Callable[[Any, Pong], None]) -> None:
        """Ping `address` every interval until `hb` says it is dead or `stop()`."""
        link: Any = None
        req = 0
        up = False
        first = True

        def on_event(event: Any) -> None:
            if self._resync_answer(address, link, event):
                hb.heard(self.clock())
            elif isinstance(event, Pong):
                hb.heard(self.clock())
                on_pong(link, event)

        try:
            while not hb.dead(self.clock()) and not stop():
                if link is None or link.transport is None:
                    try:
                        link = await open_link(address, self._hs(), hb.timeout, what,
                                               on_event=on_event)
                        link.resync = None
                        first = True
                        hb.heard(self.clock())
                    except MlfabricError as exc:
                        link = None
                        if hb.last is None:
                            log.warning("no heartbeat from the %s at %s yet: %s", what,
                                        address, exc)
                if link is not None and link.transport is not None:
                    req += 1
                    link.send(make_ping(req, first))
                    first = False
                now_up = link is not None and not hb.dead(self.clock())
                if now_up != up:
                    up = now_up
                    on_up(up)
                await asyncio.sleep(self.interval)
        finally:
            if link is not None:
                link.close()

    async def _promote(self, replica: str) -> int | None:
        """The version the replica was promoted at, or None when it refused
        because it still reaches the server (it says so; no failover)."""
        while True:
            answer: asyncio.Future[Pong | Error] = asyncio.get_running_loop().create_future()

            def on_event(event: Any, answer: asyncio.Future[Pong | Error] = answer) -> None:
                if isinstance(event, (Pong, Error)) and not answer.done():
                    answer.set_result(event)

            try:
                link = await open_link(replica, self._hs(), self.heartbeat.timeout,
                                       "replica server", on_event=on_event)
                try:
                    link.send(Promote(1, server=self.server))
                    # The replica first checks the server itself, then answers.
                    result = await within(asyncio.shield(answer), self.heartbeat.timeout
                                          + 2 * PROMOTE_CHECK_TIMEOUT)
                finally:
                    link.close()
                if isinstance(result, Error):
                    raise ServerError(result.message, result.code)
                return result.version
            except ServerError as exc:
                if exc.code == "server_alive":
                    log.error("not failing over: %s", exc)
                    return None
                log.error("the replica at %s refused promotion: %s; retrying", replica, exc)
            except (MlfabricError, TimeoutError) as exc:
                log.error("cannot promote the replica at %s: %s; retrying", replica, exc)
            await asyncio.sleep(self.interval)

    def _hs(self) -> ClientHandshake:
        return ClientHandshake(self.job, self.token, "mlfabric-controller")
