"""mlfabric: network-aware communication for distributed ML training.

    import mlfabric
    with mlfabric.connect("127.0.0.1:7070", job="mnist", token_file="job.token") as ps:
        version, params = ps.pull()
        outcome = ps.push(update, base_version=version).result(timeout=10)
"""

from __future__ import annotations

from .client.blocking import Client, connect
from .client.outcome import PushOutcome
from .errors import (
    AuthenticationError,
    ConfigError,
    ConnectError,
    ConnectionLost,
    InvalidUpdate,
    MlfabricError,
    ProtocolError,
    PushTimeout,
    ServerError,
)

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "Client",
    "ConfigError",
    "ConnectError",
    "ConnectionLost",
    "InvalidUpdate",
    "MlfabricError",
    "ProtocolError",
    "PushOutcome",
    "PushTimeout",
    "ServerError",
    "__version__",
    "connect",
]
