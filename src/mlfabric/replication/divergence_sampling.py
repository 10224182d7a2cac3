"""Measured divergence: the server compares its weights with the replica's.

Every `interval` seconds the server pulls the replica's model and computes
||w_server - w_replica||_2 with the `l2_norm_diff` kernel against its own
weights at the moment the answer arrives (between two applies: the event
loop applies nothing meanwhile). The replica's model is the one it held when
it answered, one network trip earlier; the replica only moves forward, so
the sample pairs the server's state with a replica state at most one trip
old, and records both versions. Off by default: each sample moves a whole
model over the server's downlink.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from .. import kernels
from ..client.link import open_link
from ..errors import ConfigError, MlfabricError
from ..runtime.loop import within
from ..runtime.metrics import ServerMetrics
from ..server.store import ParameterStore
from ..wire.handshake import ClientHandshake
from ..wire.protocol import Pull

log = logging.getLogger("mlfabric.server")


def divergence(a: dict[str, Any], b: dict[str, Any]) -> float:
    """||a - b||_2 over all tensors, with the kernel."""
    return math.sqrt(sum(kernels.l2_norm_diff(a[n].reshape(-1), b[n].reshape(-1)) ** 2
                         for n in a))


class ReplicaSampler:
    def __init__(self, store: ParameterStore, replica: str, *, job: str, token: bytes,
                 interval: float, metrics: ServerMetrics) -> None:
        if not interval > 0:
            raise ConfigError(f"--sample-interval must be positive, got {interval}")
        self.store = store
        self.replica = replica
        self.job, self.token = job, token
        self.interval = interval
        self.metrics = metrics
        self.samples: list[tuple[int, int, float]] = []  # (server v, replica v, divergence)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def sample(self, link: Any) -> tuple[int, int, float]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        req = link.requests.add("pull", fut)
        link.send(Pull(req))
        replica_version, tensors = await within(fut, 30.0)
        # No await from here on: the server's weights are of one instant.
        server_version = self.store.version
        d = divergence(self.store.weights, tensors)
        m = self.metrics
        m.replica_divergence.set(d)
        m.replica_divergence_lag.set(server_version - replica_version)
        m.replica_divergence_samples.inc()
        self.samples = [*self.samples[-999:], (server_version, replica_version, d)]
        return server_version, replica_version, d

    async def run(self) -> None:
        link: Any = None
        while True:
            try:
                if link is None or link.transport is None:
                    hs = ClientHandshake(self.job, self.token, "mlfabric-sampler")
                    link = await open_link(self.replica, hs, 10.0, "replica server")
                await self.sample(link)
            except (MlfabricError, TimeoutError) as exc:
                log.warning("cannot sample the replica at %s: %s", self.replica, exc)
                link = None
            await asyncio.sleep(self.interval)
