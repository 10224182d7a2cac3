"""A blocking, authenticated socket to an mlfabric listener: the dial and the
handshake the blocking client (and `mlfabric status`) run before they frame
anything else on it."""

from __future__ import annotations

import socket
from typing import Any

from ..errors import ConnectError, ConnectionLost
from ..wire.protocol import NEED_DATA, Connection, Welcome
from .core import Handshake, parse_address


def dial(address: str, job: str, secret: bytes, name: str, timeout: float, *,
          what: str = "parameter server", command: str = "mlfabric server"
          ) -> tuple[socket.socket, Connection, Welcome]:
    """A connected, authenticated socket to the server at `address` (`what` and
    `command`, for errors: what is expected there, and what runs it)."""
    server_host, server_port = parse_address(address)
    try:
        sock = socket.create_connection((server_host, server_port), timeout=timeout)
    except OSError as exc:
        raise ConnectError(
            f"cannot reach the {what} at {address}: {exc.strerror or exc}; is "
            f"`{command}` running there?"
        ) from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Connection()
        welcome = handshake(sock, conn, Handshake(job, secret, name))
    except BaseException:
        sock.close()
        raise
    return sock, conn, welcome


def handshake(sock: socket.socket, conn: Connection, hs: Handshake) -> Welcome:
    def next_event() -> Any:
        while True:
            event = conn.next_event()
            if event is not NEED_DATA:
                return event
            try:
                data = sock.recv(1 << 16)
            except TimeoutError:
                raise ConnectError("the server did not complete the handshake in time") from None
            if not data:
                raise ConnectionLost("the server closed the connection during the handshake")
            conn.receive_data(data)

    try:
        sock.sendall(conn.send_bytes(hs.hello()))
        sock.sendall(conn.send_bytes(hs.on_challenge(next_event())))
        hs.verify_server()
        return hs.on_welcome(next_event())
    except OSError as exc:
        # A peer that dies mid-handshake resets the socket: callers fall back
        # on MlfabricError (an aggregator's members go straight to the server).
        raise ConnectionLost(f"the connection was lost during the handshake: "
                             f"{exc.strerror or exc}") from None
