"""The worker side: the blocking `Client` (`blocking`), the asyncio client
(`aio`), and what both share: request bookkeeping (`core`), controlled pushes
(`control_book`), failover (`failover`), worker-driven replication
(`replica_feed`) and transfer reports to the host's agent (`agent_report`)."""

from .blocking import Client, connect
from .outcome import PushOutcome

__all__ = ["Client", "PushOutcome", "connect"]
