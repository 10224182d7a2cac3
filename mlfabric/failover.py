"""Failover, the controller's side: heartbeats to the server, promotion of
the replica when they stop, and telling the workers.

`Heartbeat` is the decision (pure, a fake clock in tests): the server is
dead when it has not answered for `timeout` seconds after having answered
once (a server that never came up is not failed over: that is a deployment
error, reported as such in the log). `FailoverMonitor` carries it out.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

from .aio import open_link
from .client_core import Handshake
from .errors import ConfigError, MlfabricError
from .loop import within
from .protocol import Ping, Pong, Promote

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
    The replica is pinged too: when it is lost, `on_replica_lost(address)`."""

    def __init__(self, *, server: str, replica: str, job: str, token: bytes,
                 interval: float, timeout: float,
                 on_failover: Callable[[str, int, float], None],
                 on_server_up: Callable[[bool], None] = lambda up: None,
                 on_replica_lost: Callable[[str], None] = lambda address: None,
                 clock: Callable[[], float] | None = None) -> None:
        if not 0 < interval < timeout:
            raise ConfigError(f"--heartbeat-interval must be positive and below "
                              f"--heartbeat-timeout ({timeout}), got {interval}")
        self.server: str = server
        self.replica: str | None = replica
        self.job, self.token = job, token
        self.interval = interval
        self.heartbeat = Heartbeat(timeout)
        self.on_failover = on_failover
        self.on_server_up = on_server_up
        self.on_replica_lost = on_replica_lost
        self.clock = clock or (lambda: asyncio.get_running_loop().time())
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
            self.server = replica
            if self.replica == replica:  # not replaced by a join meanwhile
                self.replica = None
            self.heartbeat = Heartbeat(self.heartbeat.timeout)
            self.on_failover(replica, version, silent_since)

    async def watch(self) -> None:
        """Return once the server is lost."""
        await self._beat(self.server, "parameter server", self.heartbeat, self.on_server_up,
                         lambda: False)
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
                             functools.partial(self._replaced, replica))
            if self.replica == replica:
                log.error("the replica at %s has not answered for %.2f s: the job runs "
                          "without one until another joins", replica, hb.timeout)
                self.replica = None
                self.on_replica_lost(replica)

    def _replaced(self, replica: str) -> bool:
        return self.replica != replica

    async def _beat(self, address: str, what: str, hb: Heartbeat,
                    on_up: Callable[[bool], None], stop: Callable[[], bool]) -> None:
        """Ping `address` every interval until `hb` says it is dead or `stop()`."""
        link: Any = None
        req = 0
        up = False

        def on_event(event: Any) -> None:
            if isinstance(event, Pong):
                hb.heard(self.clock())

        try:
            while not hb.dead(self.clock()) and not stop():
                if link is None or link.transport is None:
                    try:
                        link = await open_link(address, self._hs(), hb.timeout, what,
                                               on_event=on_event)
                        hb.heard(self.clock())
                    except MlfabricError as exc:
                        link = None
                        if hb.last is None:
                            log.warning("no heartbeat from the %s at %s yet: %s", what,
                                        address, exc)
                if link is not None and link.transport is not None:
                    req += 1
                    link.send(Ping(req))
                now_up = link is not None and not hb.dead(self.clock())
                if now_up != up:
                    up = now_up
                    on_up(up)
                await asyncio.sleep(self.interval)
        finally:
            if link is not None:
                link.close()

    async def _promote(self, replica: str) -> int:
        answer: asyncio.Future[Pong] = asyncio.get_running_loop().create_future()

        def on_event(event: Any) -> None:
            if isinstance(event, Pong) and not answer.done():
                answer.set_result(event)

        while True:
            try:
                link = await open_link(replica, self._hs(), self.heartbeat.timeout,
                                       "replica server", on_event=on_event)
                link.send(Promote(1))
                pong = await within(asyncio.shield(answer), self.heartbeat.timeout)
                link.close()
                return pong.version
            except (MlfabricError, TimeoutError) as exc:
                log.error("cannot promote the replica at %s: %s; retrying", replica, exc)
                await asyncio.sleep(self.interval)

    def _hs(self) -> Handshake:
        return Handshake(self.job, self.token, "mlfabric-controller")
