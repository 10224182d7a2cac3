"""Logging in to an agent's control API (wire.agent_auth), over asyncio
streams or a blocking socket: the controller, the agents' probe sessions,
tools and the clients' transfer reports open their connections with it."""

from __future__ import annotations

import asyncio
import socket

from ..errors import ConnectionLost
from ..wire import agent_protocol as probe
from ..wire.agent_auth import AgentCredential, AgentLogin

READ_CHUNK = 1 << 16


async def login(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                conn: probe.Connection, credential: AgentCredential, name: str) -> None:
    """Open a control connection: log in with `credential` (wire.agent_auth).
    `conn` is then protected: every frame either way carries its MAC."""
    flow = AgentLogin(credential, name)

    async def next_event() -> probe.Event:
        while True:
            ev = conn.next_event()
            if isinstance(ev, probe.ConnectionClosed):
                raise ConnectionLost("the agent closed the connection during the login")
            if not isinstance(ev, probe.NeedData):
                return ev
            conn.receive_data(await reader.read(READ_CHUNK))

    writer.write(conn.send(flow.login()))
    writer.write(conn.send(flow.on_challenge(await next_event())))
    # Every frame from here on carries its MAC (the agent's refusal of the
    # proof just sent, a plain ERROR, excepted).
    conn.protect(*flow.frame_keys(), plain_error=True)
    flow.on_welcome(await next_event())


def blocking_login(sock: socket.socket, conn: probe.Connection, credential: AgentCredential,
                   name: str) -> None:
    """`login` on a blocking socket (its timeout bounds each read)."""
    flow = AgentLogin(credential, name)

    def next_event() -> probe.Event:
        while True:
            ev = conn.next_event()
            if isinstance(ev, probe.ConnectionClosed):
                raise ConnectionLost("the agent closed the connection during the login")
            if not isinstance(ev, probe.NeedData):
                return ev
            conn.receive_data(sock.recv(READ_CHUNK))

    sock.sendall(conn.send(flow.login()))
    sock.sendall(conn.send(flow.on_challenge(next_event())))
    conn.protect(*flow.frame_keys(), plain_error=True)
    flow.on_welcome(next_event())
