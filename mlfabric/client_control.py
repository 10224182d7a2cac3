"""A blocking client's link to the job's controller.

With a controller, `push()` does not send the update itself: it asks the
controller (TRANSFER_REQUEST with size, base version, norm, source and
destination), sends when the DIRECTIVE says go, and reports the outcome back
(TRANSFER_DONE). A drop resolves the push's future with `applied=False` and
the controller's reason. Nothing is lost silently when the controller goes
away: with `fallback="fifo"` waiting updates are sent at once (with a
warning) until it is back; with `fallback="wait"` they wait for it up to
`timeout` seconds and then fail with ConnectionLost.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import math
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _core
from .client_core import Handshake, parse_address
from .errors import ConfigError, ConnectError, ConnectionLost, MlfabricError
from .outcome import PushOutcome
from .protocol import NEED_DATA, Connection, Directive, TransferDone, TransferRequest

log = logging.getLogger("mlfabric.client")

FALLBACKS = ("fifo", "wait")
_RECONNECT_EVERY = 0.5


@dataclass
class _Entry:
    arrays: dict[str, np.ndarray]
    base_version: int
    nbytes: int
    norm: float
    future: concurrent.futures.Future[PushOutcome] = field(
        default_factory=concurrent.futures.Future)
    requested: float = field(default_factory=time.monotonic)
    creq: int | None = None  # the controller's request id, once asked


class _Link:
    """One authenticated connection to the controller, with a reader thread."""

    def __init__(self, address: str, hs: Handshake, timeout: float,
                 on_directive: Callable[[_Link, Directive], None],
                 on_lost: Callable[[_Link, BaseException], None]) -> None:
        from .client import _handshake

        host, port = parse_address(address)
        self.sock = socket.create_connection((host, port), timeout=timeout)
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conn = Connection()
            self.welcome = _handshake(self.sock, self.conn, hs)
        except BaseException:
            self.sock.close()
            raise
        self.sock.settimeout(None)
        self._send_lock = threading.Lock()
        self._on_directive = on_directive
        self._on_lost = on_lost
        self.closed = False
        threading.Thread(target=self._read, name=f"mlfabric-controller-{address}",
                         daemon=True).start()

    def send(self, event: Any) -> None:
        data = self.conn.send_bytes(event)
        with self._send_lock:
            self.sock.sendall(data)

    def _read(self) -> None:
        error: BaseException = ConnectionLost("the controller closed the connection")
        try:
            while True:
                n = self.sock.recv_into(self.conn.get_buffer())
                if n == 0:
                    break
                self.conn.buffer_updated(n)
                while (event := self.conn.next_event()) is not NEED_DATA:
                    if isinstance(event, Directive):
                        self._on_directive(self, event)
                    else:
                        raise MlfabricError(f"controller sent {type(event).__name__}")
        except (OSError, MlfabricError) as exc:
            error = exc
        self._on_lost(self, error)

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class ControlledPushes:
    """Pushes of one client that go through the controller."""

    def __init__(self, client: Any, address: str, hs: Handshake, *, host: str, dst: str,
                 fallback: str = "fifo", timeout: float = 30.0) -> None:
        if fallback not in FALLBACKS:
            raise ConfigError(f"controller fallback must be one of {FALLBACKS}, got {fallback!r}")
        self.client = client
        self.address = address
        self.hs = hs
        self.host = host
        self.dst = dst
        self.fallback = fallback
        self.timeout = timeout
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._asked: dict[int, _Entry] = {}  # waiting for a directive
        self._orphans: list[_Entry] = []  # waiting for the controller to come back
        self._link: _Link | None = None
        self._closed = threading.Event()
        self._reconnecting = False
        self._warned = False
        self._sendq: queue.Queue[_Entry | None] = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop, name="mlfabric-sender",
                                        daemon=True)
        self._sender.start()
        try:
            self._link = self._connect()
        except (OSError, MlfabricError) as exc:
            if fallback == "wait":
                self.close()
                raise ConnectError(
                    f"cannot reach the controller at {address}: {exc}; is `mlfabric "
                    f"controller` running there?") from None
            self._lost(None, exc)

    def _connect(self) -> _Link:
        return _Link(self.address, self.hs, min(self.timeout, 10.0), self._directive, self._lost)

    # -- push ---------------------------------------------------------------------

    def push(self, arrays: dict[str, np.ndarray], base_version: int, nbytes: int
             ) -> concurrent.futures.Future[PushOutcome]:
        # Sent later: copy, so the caller may reuse its arrays once push() returns.
        copies = {n: a.copy() for n, a in arrays.items()}
        norm = math.sqrt(sum(_core.l2_norm(a.reshape(-1)) ** 2 for a in copies.values()))
        entry = _Entry(copies, base_version, nbytes, norm)
        with self._lock:
            if self._closed.is_set():
                raise ConnectionLost("the client is closed")
            if self._link is None:
                self._without_controller([entry])
            else:
                self._ask(self._link, entry)
        return entry.future

    def _ask(self, link: _Link, entry: _Entry) -> None:
        """Under self._lock."""
        entry.creq = next(self._ids)
        self._asked[entry.creq] = entry
        try:
            link.send(TransferRequest(req=entry.creq, host=self.host, dst=self.dst,
                                      nbytes=entry.nbytes, base_version=entry.base_version,
                                      norm=entry.norm))
        except OSError:
            pass  # the reader thread notices the loss and re-homes the entry

    def _without_controller(self, entries: list[_Entry]) -> None:
        """Under self._lock: the controller is away."""
        if not entries:
            return
        if self.fallback == "fifo":
            if not self._warned:
                log.warning("controller %s unreachable: sending updates at once (fifo) "
                            "until it is back", self.address)
                self._warned = True
            for e in entries:
                e.creq = None
                self._sendq.put(e)
        else:
            self._orphans.extend(entries)

    # -- controller events ----------------------------------------------------------

    def _directive(self, link: _Link, d: Directive) -> None:
        with self._lock:
            entry = self._asked.pop(d.req, None)
        if entry is None:
            log.warning("controller sent a directive for unknown request %d", d.req)
            return
        if d.action == "go":
            self._sendq.put(entry)
        else:
            outcome = PushOutcome(applied=False, version=self.client.last_version, delay=None,
                                  reason=f"dropped by the controller: {d.reason}",
                                  base_version=entry.base_version)
            if not entry.future.done():
                entry.future.set_result(outcome)

    def _lost(self, link: _Link | None, exc: BaseException) -> None:
        with self._lock:
            if link is not None and link is not self._link:
                return
            self._link = None
            stranded = list(self._asked.values())
            self._asked.clear()
            if self._closed.is_set():
                for e in stranded:
                    if not e.future.done():
                        e.future.set_exception(ConnectionLost("the client was closed"))
                return
            log.warning("lost the controller %s (%s); %d updates waiting", self.address, exc,
                        len(stranded))
            self._without_controller(stranded)
            if not self._reconnecting:
                self._reconnecting = True
                threading.Thread(target=self._reconnect, name="mlfabric-reconnect",
                                 daemon=True).start()

    def _reconnect(self) -> None:
        while not self._closed.wait(_RECONNECT_EVERY):
            self._expire_orphans()
            try:
                link = self._connect()
            except (OSError, MlfabricError):
                continue
            with self._lock:
                self._link, self._reconnecting, self._warned = link, False, False
                orphans, self._orphans = self._orphans, []
                for e in orphans:
                    self._ask(link, e)
            log.info("controller %s is back; %d waiting updates re-requested", self.address,
                     len(orphans))
            return

    def _expire_orphans(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [e for e in self._orphans if now - e.requested > self.timeout]
            self._orphans = [e for e in self._orphans if now - e.requested <= self.timeout]
        for e in expired:
            if not e.future.done():
                e.future.set_exception(ConnectionLost(
                    f"the controller {self.address} was unreachable for {self.timeout:.0f} s; "
                    f"this update was not sent"))

    # -- sending ------------------------------------------------------------------------

    def _send_loop(self) -> None:
        while (entry := self._sendq.get()) is not None:
            started = time.monotonic()
            try:
                server_future = self.client._send_push(entry.arrays, entry.base_version)
            except MlfabricError as exc:
                entry.future.set_exception(exc)
                continue
            server_future.add_done_callback(
                lambda f, e=entry, t=started: self._finish(e, f, t))

    def _finish(self, entry: _Entry, server_future: concurrent.futures.Future[Any],
                started: float) -> None:
        exc = server_future.exception()
        if exc is not None:
            entry.future.set_exception(exc)
            return
        outcome: PushOutcome = server_future.result()
        with self._lock:
            link = self._link
        if entry.creq is not None and link is not None:
            try:
                link.send(TransferDone(req=entry.creq, applied=outcome.applied,
                                       version=outcome.version, delay=outcome.delay,
                                       seconds=time.monotonic() - started))
            except OSError:
                pass
        entry.future.set_result(outcome)

    def close(self) -> None:
        self._closed.set()
        self._sendq.put(None)
        with self._lock:
            link, self._link = self._link, None
            pending = [*self._asked.values(), *self._orphans]
            self._asked.clear()
            self._orphans = []
        if link is not None:
            link.close()
        for e in pending:
            if not e.future.done():
                e.future.set_exception(ConnectionLost("the client was closed before the "
                                                      "controller let this update go"))
        self._sender.join(10)
