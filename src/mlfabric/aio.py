"""The asyncio client, public path: `await mlfabric.aio.connect(...)`.

It lives in `mlfabric.client.aio`; this module names what users import.
"""

from .client.aio import AsyncClient
from .client.futures import AsyncPushFuture
from .client.sharded import ShardedClient, ShardedOutcome, connect

__all__ = ["AsyncClient", "AsyncPushFuture", "ShardedClient", "ShardedOutcome", "connect"]
