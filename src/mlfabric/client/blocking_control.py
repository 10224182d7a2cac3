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
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import ConnectError, ConnectionLost, MlfabricError
from ..wire.protocol import NEED_DATA, Connection, Directive, Failover, ReplicaAt, ReplicaDone
from .control_book import (
    RECONNECT_EVERY,
    ControlBook,
    ControlledUpdate,
    controlled_update,
)
from .core import Handshake, parse_address
from .outcome import PushOutcome
from .socket_link import handshake

log = logging.getLogger("mlfabric.client")



class _Link:
    """One authenticated connection to the controller, with a reader thread."""

    def __init__(self, address: str, hs: Handshake, timeout: float,
                 on_directive: Callable[[_Link, Directive], None],
                 on_lost: Callable[[_Link, BaseException], None],
                 on_failover: Callable[[Failover | ReplicaAt], None]) -> None:
        host, port = parse_address(address)
        self.sock = socket.create_connection((host, port), timeout=timeout)
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conn = Connection()
            self.welcome = handshake(self.sock, self.conn, hs)
        except BaseException:
            self.sock.close()
            raise
        self.sock.settimeout(None)
        self._send_lock = threading.Lock()
        self._on_directive = on_directive
        self._on_lost = on_lost
        self._on_failover = on_failover
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
                    elif isinstance(event, (Failover, ReplicaAt)):
                        self._on_failover(event)
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
    """Pushes of one blocking client that go through the controller: the
    ControlBook decides, this class does the sockets and threads."""

    def __init__(self, client: Any, address: str, hs: Handshake, *,
                 dial_aggregator: Callable[[str], Any], host: str, dst: str,
                 fallback: str = "fifo", timeout: float = 30.0, aggregation: bool = True) -> None:
        """`dial_aggregator(address)`: a new blocking client to that aggregator."""
        self.book = ControlBook(address, host=host, dst=dst, fallback=fallback,
                                timeout=timeout, aggregation=aggregation)
        self.client = client
        self._dial_aggregator = dial_aggregator
        self._aggregators: dict[str, Any] = {}  # address -> Client
        self._agg_lock = threading.Lock()  # guards _aggregators (sender and dial-ahead threads)
        self.address = address
        self.hs = hs
        self._lock = threading.Lock()  # guards book and _link
        self._changes: queue.Queue[Failover | ReplicaAt] = queue.Queue()
        self._changer: threading.Thread | None = None
        self._link: _Link | None = None
        self._closed = threading.Event()
        self._reconnecting = False
        self._sendq: queue.Queue[ControlledUpdate | None] = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop, name="mlfabric-sender",
                                        daemon=True)
        self._sender.start()
        try:
            link = self._connect()
        except (OSError, MlfabricError) as exc:
            if fallback == "wait":
                self.close()
                raise ConnectError(
                    f"cannot reach the controller at {address}: {exc}; is `mlfabric "
                    f"controller` running there?") from None
            self._lost(None, exc)
        else:
            with self._lock:
                self._link = link
                self.book.reconnected()

    def _connect(self) -> _Link:
        link = _Link(self.address, self.hs, min(self.book.timeout, 10.0), self._directive,
                     self._lost, self._failover)
        if self.book.aggregation and link.welcome.aggregators:
            threading.Thread(target=self._dial_aggregators, args=(link.welcome.aggregators,),
                             name="mlfabric-aggregator-dial", daemon=True).start()
        return link

    def _dial_aggregators(self, addresses: tuple[str, ...]) -> None:
        """Dial every aggregator the controller may route through, ahead of
        use: on the loaded emulated cluster a member's first dial took a
        median 74 ms (up to 0.5 s) before its bytes could go."""
        for address in addresses:
            if self._closed.is_set():
                return
            try:
                self._aggregator(address)
            except (OSError, MlfabricError) as exc:  # dialled again when a member is due
                log.debug("aggregator %s not reached ahead of use: %s", address, exc)

    def push(self, arrays: dict[str, np.ndarray], base_version: int, nbytes: int
             ) -> concurrent.futures.Future[PushOutcome]:
        u = controlled_update(arrays, base_version, nbytes, concurrent.futures.Future())
        with self._lock:
            request, now = self.book.place(u)
            if request is not None:
                self._tell(request)
        for x in now:
            self._sendq.put(x)
        return u.future

    def _tell(self, event: Any) -> None:
        """Under self._lock. A failed send is noticed by the reader thread."""
        if self._link is not None:
            try:
                self._link.send(event)
            except OSError:
                pass

    def _failover(self, event: Failover | ReplicaAt) -> None:
        """The controller promoted the replica (the client moves there) or a
        new replica joined (the client feeds it); in a thread of its own, so
        connecting does not hold up directives. In order: a join announced
        right after a failover must find the client on the new server."""
        if not self.client.fails_over:
            log.warning("controller reports a replica change (%s), but this client has no "
                        "replica configured: ignoring it", event)
            return
        if isinstance(event, Failover):
            with self._lock:
                self.book.dst = parse_address(event.server)[0]
        self._changes.put(event)
        with self._lock:
            if self._changer is None or not self._changer.is_alive():
                self._changer = threading.Thread(target=self._change_loop,
                                                 name="mlfabric-failover", daemon=True)
                self._changer.start()

    def _change_loop(self) -> None:
        while True:
            try:
                event = self._changes.get(timeout=1.0)
            except queue.Empty:
                with self._lock:
                    if self._changes.empty():
                        self._changer = None
                        return
                continue
            try:
                if isinstance(event, Failover):
                    self.client.fail_over(event.server)
                else:
                    self.client.attach_replica(event.address, event.version)
            except MlfabricError as exc:
                log.error("cannot act on %s: %s", event, exc)

    def expire(self, timeout: float) -> None:
        """Withdraw the updates that have waited for a directive longer than
        `timeout` seconds, and fail them (the client's push_timeout)."""
        with self._lock:
            late = self.book.overdue(time.monotonic(), timeout)
            for _, report, _ in late:
                self._tell(report)
        for u, _, exc in late:
            if not u.future.done():
                u.future.set_exception(exc)

    def report_replicated(self, dst: str, version: int) -> None:
        """Tell the controller the replica at `dst` applied `version`."""
        with self._lock:
            self._tell(ReplicaDone(dst=dst, version=version))

    # -- controller events ----------------------------------------------------------

    def _directive(self, link: _Link, d: Directive) -> None:
        with self._lock:
            u, outcome = self.book.directive(d, self.client.last_version)
        if u is None:
            return
        if outcome is None:
            self._sendq.put(u)
        elif not u.future.done():
            u.future.set_result(outcome)

    def _lost(self, link: _Link | None, exc: BaseException) -> None:
        with self._lock:
            if link is not None and link is not self._link:
                return
            self._link = None
            now = self.book.lost(exc)
            start = not self._reconnecting and not self.book.closed
            self._reconnecting = self._reconnecting or start
        for u in now:
            self._sendq.put(u)
        if start:
            threading.Thread(target=self._reconnect, name="mlfabric-reconnect",
                             daemon=True).start()

    def _reconnect(self) -> None:
        while not self._closed.wait(RECONNECT_EVERY):
            with self._lock:
                expired = self.book.expired(time.monotonic())
            for u, exc in expired:
                if not u.future.done():
                    u.future.set_exception(exc)
            try:
                link = self._connect()
            except (OSError, MlfabricError):
                continue
            with self._lock:
                self._link, self._reconnecting = link, False
                for request in self.book.reconnected():
                    self._tell(request)
            return

    # -- sending ------------------------------------------------------------------------

    def _send_loop(self) -> None:
        while (u := self._sendq.get()) is not None:
            if u.sent is None:
                u.sent = time.monotonic()
            t0 = u.sent
            try:
                if u.via is not None:
                    try:
                        server_future = self._aggregator(u.via).send_push(
                            u.arrays, u.base_version,
                            **self.book.member_fields(u, self.client.address))
                    except MlfabricError as exc:
                        self.book.via_failed(u, exc)
                        server_future = self.client.send_push(u.arrays, u.base_version,
                                                               uid=u.uid)
                else:
                    server_future = self.client.send_push(u.arrays, u.base_version, uid=u.uid)
            except Exception as exc:  # this thread must outlive any one push
                if not isinstance(exc, MlfabricError):
                    log.exception("sending update %s failed", u.creq)
                u.future.set_exception(exc)
                continue
            server_future.add_done_callback(
                lambda f, u=u, t=t0: self._finish(u, f, t))

    def _aggregator(self, address: str) -> Any:
        """The link to the aggregator at `address`, dialled on first use (and
        again after it failed)."""
        def usable(link: Any) -> bool:
            return link is not None and not link.closed and not link.failed

        with self._agg_lock:
            known: Any = self._aggregators.get(address)
        if usable(known):
            return known
        new = self._dial_aggregator(address)
        with self._agg_lock:
            link: Any = self._aggregators.get(address)
            if not usable(link):
                self._aggregators[address] = link = new
        if link is not new:  # the other thread dialled it meanwhile
            new.close()
        if self._closed.is_set():  # close() may have run during the dial
            link.close()
        return link

    def _finish(self, u: ControlledUpdate, server_future: concurrent.futures.Future[Any],
                started: float) -> None:
        exc = server_future.exception()
        if exc is not None and u.via is not None and not self._closed.is_set():
            # The aggregator failed it (or died): straight to the server, same uid.
            self.book.via_failed(u, exc)
            self._sendq.put(u)
            return
        if exc is not None:
            report = ControlBook.report_failed(u, time.monotonic() - started)
            if report is not None:
                with self._lock:
                    self._tell(report)
            u.future.set_exception(exc)
            return
        outcome: PushOutcome = server_future.result()
        report = ControlBook.report(u, outcome, time.monotonic() - started)
        if report is not None:
            with self._lock:
                self._tell(report)
        u.future.set_result(outcome)

    def close(self) -> None:
        self._closed.set()
        self._sendq.put(None)
        with self._lock:
            link, self._link = self._link, None
            failed = self.book.close()
        if link is not None:
            link.close()
        for u, exc in failed:
            if not u.future.done():
                u.future.set_exception(exc)
        self._sender.join(10)
        with self._agg_lock:
            links = list(self._aggregators.values())
        for agg in links:
            agg.close()
