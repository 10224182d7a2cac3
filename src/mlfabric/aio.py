"""The asyncio client, public path: `await mlfabric.aio.connect(...)`.

It lives in `mlfabric.client.aio`; this module names what users import.
"""

from .client.aio import AsyncClient, connect
from .client.futures import AsyncPushFuture

__all__ = ["AsyncClient", "AsyncPushFuture", "connect"]
