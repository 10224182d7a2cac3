"""Holding a controller's shards in etcd: the asyncio side of `ownership`.

Every `interval` (a quarter of the lease, at most 0.25 s) the controller
renews its lease, reads the job's keys and claims the free shards the
rules give it. It plans a shard only while its lease is sure to hold in
etcd: from each renewal it counts the TTL from when the renewal was *sent*
(etcd counts from when it arrived, later), and stops planning one interval
before that runs out. So two controllers never plan one shard at once, as
long as their clocks run at the same rate.

A controller killed outright keeps its shards until its lease expires in
etcd (the TTL, then up to 0.5 s for etcd's expiry sweep); the next
controller in each shard's order sees the key gone at its next read and
claims it. A controller stopped cleanly revokes its lease first, so its
shards move at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ConfigError
from . import ownership
from .etcd import EtcdClient, EtcdError

log = logging.getLogger("mlfabric.controller")

# What `on_change` gets: the shards this controller plans now, and every
# shard's owner's address as last read ("" for none).
OnChange = Callable[[frozenset[int], dict[int, str]], None]


class ShardLeases:
    def __init__(self, etcd: EtcdClient, *, job: str, me: str, controllers: Sequence[str],
                 shards: int, ttl: int = 2, on_change: OnChange | None = None,
                 metrics: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        """`me`: this controller's address as the workers dial it, one of
        `controllers` (all the job's, in the order the workers are given
        them). `shards`: the job's number of server shards (1 for one
        server: the controllers are then one active and the rest standing
        by)."""
        if me not in controllers:
            raise ConfigError(f"this controller's address {me!r} is not in --controllers "
                              f"{','.join(controllers)}: give every controller the same list, "
                              f"the one the workers are given, and --advertise the address "
                              f"workers reach this one at")
        if len(set(controllers)) != len(controllers):
            raise ConfigError(f"--controllers names an address twice: {','.join(controllers)}")
        if not 1 <= shards <= ownership.MAX_SHARDS:
            raise ConfigError(f"--shards must be 1..{ownership.MAX_SHARDS}, got {shards}")
        if not 1 <= ttl <= 3600:
            raise ConfigError(f"--lease-ttl must be 1..3600 seconds, got {ttl}")
        self.etcd, self.job, self.me = etcd, job, me
        self.controllers, self.shards, self.ttl = list(controllers), shards, ttl
        self.on_change = on_change
        self.metrics = metrics
        self.clock = clock
        self.interval = min(ttl / 4, 0.25)
        self.owned: frozenset[int] = frozenset()
        self.owners: dict[int, str] = {}
        # Every shard seen held by a controller (this one included) before
        # this one claimed it: a shard the job has been running on.
        self.ever_held: set[int] = set()
        self._lease: int | None = None
        self._ended: int | None = None  # a lease given up, to revoke
        self._registered_at: float | None = None
        self._expiry: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self._failing = ""  # the last etcd error, logged once until it changes

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
                if self._failing:
                    log.warning("etcd answers again (%s)", self.etcd.where())
                    self._failing = ""
            except EtcdError as exc:
                if str(exc) != self._failing:
                    log.warning("etcd: %s; this controller keeps its shards until its lease "
                                "would run out", exc)
                    self._failing = str(exc)
            except Exception:  # a bug here must not stop the renewals for good
                log.exception("shard leases: unexpected error; trying again")
            await asyncio.sleep(self.interval)

    async def tick(self) -> None:
        """Renew, read, claim: one round."""
        sent = self.clock()
        if self._lease is None:
            if self._ended is not None:
                # The keys of a lease given up early: free them now rather
                # than when it expires. Best effort: it expires anyway.
                ended, self._ended = self._ended, None
                try:
                    await self.etcd.revoke(ended)
                except EtcdError:
                    pass
            self._lease, granted = await self.etcd.grant(self.ttl)
            if granted != self.ttl:
                log.warning("etcd granted a lease of %d s for the %d s asked (its minimum is "
                            "1.5 election timeouts): shards move that much later after a "
                            "controller is lost", granted, self.ttl)
            self._registered_at = None
            self._hold_until(sent + granted)
        else:
            renewing = self._lease
            left = await self.etcd.keepalive(renewing)
            if self._lease != renewing:
                return  # given up meanwhile (the renewal came too late)
            if left <= 0:
                self._lost("etcd says its lease has expired")
                return
            self._hold_until(sent + left)
        lease = self._lease
        # The member key says this controller is live, so the others leave
        # its home shards to it.
        if self._registered_at is None and await self.etcd.create(
                ownership.member_key(self.job, self.me), self.me, lease):
            self._registered_at = self.clock()
        live, held = ownership.read(self.job, await self.etcd.range(ownership.prefix(self.job)),
                                    self.shards)
        self.ever_held |= held.keys()
        if self._registered_at is not None:
            settled = self.clock() - self._registered_at >= self.ttl
            for shard in ownership.claims(shards=self.shards, controllers=self.controllers,
                                          me=self.me, owned=held, live=live, settled=settled):
                if await self.etcd.create(ownership.shard_key(self.job, shard), self.me, lease):
                    held[shard] = (self.me, lease)
                    home = self.controllers[shard % len(self.controllers)]
                    if self.metrics is not None:
                        self.metrics.shards_claimed.inc()
                    if home != self.me:
                        log.warning("took over shard %d: its home controller %s is not live",
                                    shard, home)
        if self._lease != lease:
            return  # given up while reading: nothing is ours
        self._publish(ownership.owned_by(held, self.me, lease),
                      {s: owner for s, (owner, _) in held.items()})

    def _hold_until(self, valid_until: float) -> None:
        """Plan the shards until one interval before the lease may end in etcd."""
        if self._expiry is not None:
            self._expiry.cancel()
        delay = max(0.0, valid_until - self.interval - self.clock())
        self._expiry = asyncio.get_running_loop().call_later(
            delay, self._lost, "its lease was not renewed in time")

    def _lost(self, why: str) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self._ended, self._lease = self._lease, None
        if self.owned:
            log.error("this controller stops planning shards %s: %s (etcd at %s); it claims "
                      "free shards again once etcd answers", sorted(self.owned), why,
                      self.etcd.where())
            if self.metrics is not None:
                self.metrics.leases_lost.inc()
        self._publish(frozenset(), {s: o for s, o in self.owners.items() if o != self.me})

    def _publish(self, owned: frozenset[int], owners: dict[int, str]) -> None:
        changed = owned != self.owned
        self.owned, self.owners = owned, owners
        if self.metrics is not None:
            self.metrics.shards_owned.set(len(owned))
        if changed and self.on_change is not None:
            self.on_change(owned, owners)

    def owner(self, shard: int) -> str:
        return self.owners.get(shard, "")

    async def close(self) -> None:
        """Stop, and give the shards up at once: the lease is revoked, so the
        other controllers take them at their next read."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._expiry is not None:
            self._expiry.cancel()
        lease, self._lease = self._lease, None
        if lease is not None:
            try:
                await self.etcd.revoke(lease)
            except EtcdError as exc:
                log.warning("could not revoke the lease (%s): the shards move when it expires",
                            exc)
        self.owned = frozenset()
        await self.etcd.close()
