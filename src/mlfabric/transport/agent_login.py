"""Opening a connection to an agent's control API: dialling (over mutual TLS
when there are TLS settings, `transport.tls`), then the login
(wire.agent_auth), over asyncio streams or a blocking socket. The
controller, the agents' probe sessions, tools and the clients' transfer
reports open their connections with it, so a failed TLS handshake or a
refused login reads the same everywhere."""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import Any

from ..errors import ConnectionLost, MlfabricError, NotMlfabric
from ..runtime.loop import within
from ..wire import agent_protocol as probe
from ..wire.agent_auth import AgentCredential, AgentLogin
from .tls import process_client_context, tls_refused

READ_CHUNK = 1 << 16
WHAT = "agent"
COMMAND = "mlfabric agent"
_REQUIRES_TLS = ("it requires TLS (give --tls-cert, --tls-key and --tls-ca, or tls_cert, "
                 "tls_key and tls_ca)")


async def login(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                conn: probe.Connection, credential: AgentCredential, name: str) -> None:
    """Log in on an open control connection with `credential`
    (wire.agent_auth). `conn` is then protected: every frame either way
    carries its MAC."""
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


def _context(tls: ssl.SSLContext | None) -> ssl.SSLContext | None:
    """`tls`, else the process's own (a process started with --tls-* dials
    agents over TLS too), else None: plain TCP."""
    return tls if tls is not None else process_client_context()


def login_failed(exc: BaseException, address: str, secured: bool) -> BaseException:
    """What to raise for `exc`, raised during the login to the agent at
    `address` (`secured`: over TLS): a TLS problem gets a message that says
    which side refused what, as a job link's does (client.link); anything
    else is `exc` itself."""
    if isinstance(exc, ssl.SSLError):
        # The agent did not accept our certificate: TLS 1.3 tells after the
        # client's side of the handshake is done, on the first read.
        return tls_refused(exc, WHAT, address, COMMAND, by_us=False)
    lost = isinstance(exc, (ConnectionLost, ConnectionError))
    if secured and lost:
        # What an agent does to a certificate it does not accept (asyncio's
        # TLS layer closes without sending its alert).
        return ConnectionLost(
            f"the agent at {address} closed the connection right after the TLS handshake: "
            f"it did not accept this client's certificate (not signed by its --tls-ca; its "
            f"log says why), or it is shutting down; give tls_cert and tls_key (or "
            f"--tls-cert and --tls-key) signed by the cluster's CA")
    tls_alert = isinstance(exc, NotMlfabric) and exc.head[:1] == b"\x15"  # a TLS alert record
    if not secured and (lost or tls_alert):
        return ConnectionLost(
            f"the agent at {address} closed the connection during the login: perhaps "
            f"{_REQUIRES_TLS}, or it is shutting down")
    return exc


async def open_agent(host: str, port: int, credential: AgentCredential, name: str,
                     timeout: float, tls: ssl.SSLContext | None = None
                     ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, probe.Connection]:
    """Dial the agent at host:port and log in, each step within `timeout`:
    the streams and the (protected) connection. `tls`: a client context
    (`transport.tls.client_context`), the agent's certificate checked
    against `host`; None: the process's own, else plain TCP. An agent that
    cannot be reached raises OSError or TimeoutError; a failed TLS
    handshake TLSError (or ConnectionLost) saying which side refused what."""
    address = f"{host}:{port}"
    ctx = _context(tls)
    secured: dict[str, Any] = {} if ctx is None else {"ssl": ctx, "server_hostname": host}
    try:
        reader, writer = await within(asyncio.open_connection(host, port, **secured), timeout)
    except ssl.SSLError as exc:
        raise tls_refused(exc, WHAT, address, COMMAND, by_us=True) from None
    conn = probe.Connection()
    try:
        await within(login(reader, writer, conn, credential, name), timeout)
    except (MlfabricError, OSError) as exc:
        writer.close()
        mapped = login_failed(exc, address, ctx is not None)
        if mapped is exc:
            raise
        raise mapped from None
    except BaseException:
        writer.close()
        raise
    return reader, writer, conn


def open_agent_blocking(host: str, port: int, credential: AgentCredential, name: str,
                        timeout: float, tls: ssl.SSLContext | None = None
                        ) -> tuple[socket.socket, probe.Connection]:
    """`open_agent` on a blocking socket (`timeout` bounds the connect and
    each read): the socket, TLS-wrapped with a context, and the connection."""
    address = f"{host}:{port}"
    ctx = _context(tls)
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        sock.settimeout(timeout)
        if ctx is not None:
            try:
                sock = ctx.wrap_socket(sock, server_hostname=host)
            except ssl.SSLError as exc:
                raise tls_refused(exc, WHAT, address, COMMAND, by_us=True) from None
        conn = probe.Connection()
        try:
            blocking_login(sock, conn, credential, name)
        except (MlfabricError, OSError) as exc:
            mapped = login_failed(exc, address, ctx is not None)
            if mapped is exc:
                raise
            raise mapped from None
    except BaseException:
        sock.close()
        raise
    return sock, conn

