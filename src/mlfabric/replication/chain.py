"""Chain replication: the server forwards each update it applied to its replica.

The policy users compare worker-driven replication with: every update
crosses the server's uplink a second time. The server numbers each update
with the version it produced and answers the worker only once the replica
has applied it too, so an acknowledged update is on both (the guarantee
worker-driven replication gives). If the replica goes away the server keeps
serving alone, says so in its log and in `mlfabric_server_replica_connected`,
and acknowledges on its own apply from then on.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..client.link import Link, open_link
from ..errors import ConfigError
from ..runtime.metrics import ServerMetrics
from ..server.store import ParameterStore
from ..wire.handshake import ClientHandshake
from ..wire.protocol import Push

log = logging.getLogger("mlfabric.server")

ACK_TIMEOUT = 10.0  # seconds the replica may take to acknowledge a forwarded update


class ChainLink:
    """The server's connection to its replica."""

    def __init__(self, proto: Link, metrics: ServerMetrics, *,
                 ack_timeout: float = ACK_TIMEOUT) -> None:
        """`ack_timeout`: a replica that has not acknowledged an update this
        many seconds after it was sent is given up (the server then answers
        its workers alone), so a hung replica cannot hold every push."""
        self.proto = proto
        self.ack_timeout = ack_timeout
        self.address = proto.address
        self.metrics = metrics
        self.forwarded = 0  # highest sequence number sent
        self.acked = 0  # highest sequence number the replica applied
        self.broken = False
        metrics.replica_connected.set(1)

    @classmethod
    async def connect(cls, address: str, *, job: str, token: bytes, store: ParameterStore,
                      metrics: ServerMetrics, timeout: float = 10.0) -> ChainLink:
        """Connect to the replica at `address`; it must hold the same model
        (tensors, momentum, version) as `store`."""
        version = store.version
        hs = ClientHandshake(job, token, "mlfabric-server")
        holder: list[ChainLink] = []
        proto = await open_link(address, hs, timeout, "replica server",
                                on_lost=lambda p, exc: holder[0]._lost(exc) if holder else None)
        welcome = proto.welcomed.result()
        mismatch = None
        if welcome.version != version:
            mismatch = f"is at version {welcome.version}, this server at {version}"
        elif tuple(welcome.tensors) != tuple(store.specs):
            mismatch = "holds other tensors than this server"
        elif welcome.momentum != store.momentum:
            mismatch = f"has momentum {welcome.momentum}, this server {store.momentum}"
        if mismatch is not None:
            proto.close()
            raise ConfigError(f"the replica at {address} {mismatch}: start both from the "
                              f"same --init or checkpoint and --momentum")
        link = cls(proto, metrics)
        link.forwarded = link.acked = version
        holder.append(link)
        return link

    def forward(self, event: Push, seq: int) -> asyncio.Future[Any] | None:
        """Send the update the server applied as version `seq`; a future of the
        replica's outcome, or None when there is no replica any more.

        `event.tensors` must stay unmodified until the future is done."""
        proto = self.proto
        if self.broken or proto.transport is None:
            return None
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        req = proto.requests.add("push", fut, event.base_version)
        size = proto.send(Push(req, event.base_version, event.tensors, seq=seq))
        self.metrics.replication_sent_bytes.inc(size)
        self.forwarded = max(self.forwarded, seq)
        self.metrics.replica_lag.set(self.forwarded - self.acked)
        fut.add_done_callback(self._answered)
        handle = asyncio.get_running_loop().call_later(self.ack_timeout, self._overdue, fut, seq)
        fut.add_done_callback(lambda _: handle.cancel())
        return fut

    def _overdue(self, fut: asyncio.Future[Any], seq: int) -> None:
        if not fut.done():
            self._fail(f"the replica at {self.address} has not acknowledged update {seq} "
                       f"within {self.ack_timeout:g} s")

    def _answered(self, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self._fail(f"the replica refused an update: {exc}")
            return
        self.acked = max(self.acked, fut.result().version)
        self.metrics.replica_lag.set(self.forwarded - self.acked)

    def _lost(self, exc: BaseException | None) -> None:
        self._fail(f"lost the connection to the replica at {self.address}: {exc}")

    def _fail(self, why: str) -> None:
        if not self.broken:
            self.broken = True
            self.metrics.replica_connected.set(0)
            log.error("%s; serving without a replica from version %d on", why, self.acked)
            self.proto.close()

    async def close(self) -> None:
        self.broken = True
        self.metrics.replica_connected.set(0)
        self.proto.close()
        await self.proto.closed
