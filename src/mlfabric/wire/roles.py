"""What each kind of listener takes from a peer once the handshake is done.

The listener refuses anything else as a protocol error before its handler
sees it, so a handler deals only with the events of its role. A replica
takes what a server takes, and promotion and resync orders too.
"""

from __future__ import annotations

from .protocol import (
    Ping,
    Promote,
    Pull,
    PullCancel,
    Push,
    ReplicaDone,
    ReplicaJoin,
    Resync,
    ShardAt,
    StateRequest,
    StatusRequest,
    TransferDone,
    TransferProgress,
    TransferRequest,
)

SERVER: tuple[type, ...] = (Push, Pull, PullCancel, StateRequest, Ping)
REPLICA: tuple[type, ...] = (*SERVER, Promote, Resync)
CONTROLLER: tuple[type, ...] = (TransferRequest, TransferDone, TransferProgress, ReplicaJoin,
                                ReplicaDone, StatusRequest, ShardAt)
AGGREGATOR: tuple[type, ...] = (Push,)


def unexpected(event: object) -> str:
    """The protocol error for an event the listener's role does not take."""
    return f"unexpected {type(event).__name__} message"
