"""The worker side: the asyncio client (`aio`), the one implementation, and
the blocking `Client` (`blocking`) that runs it on a thread. What they use:
the link (`link`), request bookkeeping (`core`), controlled
pushes (`control_book`, `aio_control`), failover (`failover`), worker-driven
replication (`replica_feed`), transfer reports to the host's agent
(`agent_report`), the push futures (`futures`) and the named seams (`seams`)."""

from .blocking import Client, connect
from .futures import AsyncPushFuture, PushFuture
from .outcome import PushOutcome

__all__ = ["AsyncPushFuture", "Client", "PushFuture", "PushOutcome", "connect"]
