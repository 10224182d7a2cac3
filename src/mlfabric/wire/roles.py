"""What each kind of listener takes from a peer once the handshake is done,
and what a dialling side calls each kind.

The listener refuses anything else as a protocol error before its handler
sees it, so a handler deals only with the events of its role. A replica
takes what a server takes, and promotion and resync orders too.

A listener's challenge names its role, so a client that dialled the wrong
kind of process (a controller given as the server, a server given as the
controller) says which answered and which it wanted (`wrong_role`); bytes
that are no mlfabric frame at all name the process too, when they can
(`foreign_peer`: an HTTP server, an mlfabric agent).
"""

from __future__ import annotations

from ..errors import WrongPeer
from . import agent_protocol
from .protocol import (
    FellBack,
    Landed,
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
                                ReplicaDone, StatusRequest, ShardAt, FellBack, Landed)
AGGREGATOR: tuple[type, ...] = (Push,)


def unexpected(event: object) -> str:
    """The protocol error for an event the listener's role does not take."""
    return f"unexpected {type(event).__name__} message"


# A listener's role as a dialling side names it.
KINDS = {"server": "a parameter server", "replica": "a replica server",
         "controller": "a controller", "aggregator": "an aggregator"}
# What a dialling side asks for (`client.link.open_link`'s `what`) -> the
# roles that serve it (a promoted replica is a server; a replica serves
# workers that replicate to it) and the command that runs one.
WANTED = {
    "parameter server": (("server", "replica"), "mlfabric server"),
    "replica server": (("replica", "server"), "mlfabric server --role replica"),
    "controller": (("controller",), "mlfabric controller"),
    "aggregator": (("aggregator",), "mlfabric agent --aggregate"),
}


def command_for(what: str) -> str:
    """The command that runs a `what` (for 'is it running there?' hints)."""
    wanted = WANTED.get(what)
    return wanted[1] if wanted is not None else f"mlfabric {what.split()[-1]}"


def _misdialled(address: str, found: str, what: str) -> WrongPeer:
    return WrongPeer(f"{address} is {found}, not {a(what)}: give the address of the job's "
                     f"`{command_for(what)}`", address)


def a(what: str) -> str:
    """`what` with its article: "a controller", "an aggregator"."""
    return f"{'an' if what[0] in 'aeiou' else 'a'} {what}"


def wrong_role(role: str, what: str, address: str) -> WrongPeer | None:
    """The error when the listener at `address`, dialled as a `what`, is of
    another `role` (its challenge says which), else None."""
    wanted = WANTED.get(what)
    if wanted is None or role in wanted[0]:
        return None
    return _misdialled(address, KINDS.get(role, f"an mlfabric {role!r}"), what)


def foreign_peer(head: bytes, what: str, address: str) -> WrongPeer:
    """The error when `address`, dialled as a `what`, answered the hello with
    `head`, bytes that are no mlfabric frame."""
    # An HTTP server answers a hello it took for a request line with a
    # status line, or, as Python's http.server does for a line it cannot
    # read as HTTP/1.x, with an HTML error page alone.
    if head.startswith(b"HTTP/") or head[:9].lower() == b"<!doctype" \
            or head[:5].lower() == b"<html":
        return _misdialled(address, "an HTTP server (a metrics port?)", what)
    # An agent answers a frame that is not its own with an error frame of its own.
    if head.startswith(agent_protocol.MAGIC):
        return _misdialled(address, "an mlfabric agent's port", what)
    return WrongPeer(f"{address} does not speak mlfabric's protocol (it answered "
                     f"{head[:24]!r}): give the address of the job's `{command_for(what)}`",
                     address)
