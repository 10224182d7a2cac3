"""The blocking client: `mlfabric.connect(...)`.

It drives the same sans-I/O `protocol.Connection` as the asyncio code over a
plain blocking socket. `push()` writes the update in the calling thread, so
when it returns the arrays have been handed to the kernel and may be reused;
the outcome arrives later on a future. One reader thread receives answers
straight into their buffers and resolves the futures.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import ConfigError, ConnectionLost, MlfabricError, ProtocolError
from ..runtime.metrics import ClientMetrics
from ..wire.protocol import (
    HEADER,
    MAX_META_LEN,
    NEED_DATA,
    Connection,
    Pull,
    PullCancel,
    Push,
    Welcome,
    layout,
)
from .control_book import AGGREGATOR_COMMAND, AGGREGATOR_DIAL_TIMEOUT
from .core import (
    DEFAULT_PUSH_TIMEOUT,
    PULL_WAIT,
    Handshake,
    RequestTable,
    TimerThread,
    check_base_version,
    check_push_timeout,
    check_update,
    connection_lost_error,
    default_client_name,
    parse_address,
    resolve_token,
    watch_period,
)
from .outcome import PushOutcome
from .socket_link import dial

log = logging.getLogger("mlfabric.client")

_JOIN_LIMIT = 1 << 16


def connect(
    address: str,
    *,
    job: str,
    token: str | bytes | None = None,
    token_file: str | os.PathLike[str] | None = None,
    timeout: float = 10.0,
    name: str | None = None,
    metrics: ClientMetrics | None = None,
    controller: str | None = None,
    host: str | None = None,
    controller_fallback: str = "fifo",
    controller_timeout: float = 30.0,
    agent: str | None = None,
    replica: str | None = None,
    failover_timeout: float = 30.0,
    replica_backlog: int = 64,
    replica_timeout: float = 10.0,
    push_timeout: float | None = DEFAULT_PUSH_TIMEOUT,
) -> Client:
    """Connect to the parameter server at `address` ("HOST:PORT") for `job`.

    The job's token is given as `token` or read from `token_file`. Raises
    ConnectError if the server cannot be reached within `timeout` seconds and
    AuthenticationError if the token or job is wrong.

    With `controller` ("HOST:PORT" of `mlfabric controller`), every push asks
    the controller when to go (see mlfabric.client.blocking_control). `host` names
    this worker's host in the controller's network picture (default: the
    local address of the connection to the server). If the controller is
    unreachable, `controller_fallback="fifo"` sends updates at once with a
    warning, `"wait"` waits up to `controller_timeout` seconds for it.

    With `agent` ("HOST:PORT" of this host's `mlfabric agent`), every push of
    64 KiB or more is reported to the agent as a measurement of the path to
    the server (never delaying the push).

    With `replica` ("HOST:PORT" of `mlfabric server --role replica`), every
    update the server applied is also sent from here straight to the replica
    with the server's version as its sequence number (worker-driven
    replication); the push's future resolves once the replica has it too.
    push() then copies the update, which is kept until both sides have it.
    With both `controller` and `replica`, the client also fails over by
    itself: when the controller says the replica was promoted, it connects
    there, re-sends the updates the lost server never answered, and pull()
    and push() carry on; they wait up to `failover_timeout` seconds for that.
    Until a new replica joins, the newest `replica_backlog` updates the
    server acknowledged are kept, to be sent to it when it does. A replica
    that has not answered an update within `replica_timeout` seconds does
    not hold the push: it resolves with the server's outcome, and the update
    stays kept for the replica.

    Every push resolves within `push_timeout` seconds (None: no bound): one
    still waiting for the controller's directive then is withdrawn and fails
    with PushTimeout (not sent); one the server has not answered fails with
    PushTimeout too (applied or not, unknown: pull() to see).
    """
    check_push_timeout(push_timeout)
    secret = resolve_token(token, token_file)
    name = name or default_client_name()
    sock, conn, welcome = dial(address, job, secret, name, timeout)
    client = Client(sock, conn, welcome, address, metrics)
    client._dial_args = (job, secret, name, timeout)
    client._timer = TimerThread()
    if push_timeout is not None:
        client._push_timeout = push_timeout
        client._timer.every(watch_period(push_timeout), client._expire_pushes)
    if replica is not None:
        from .replica_feed import ReplicaFeed, ReplicaFeeds

        try:
            replica_client = connect(replica, job=job, token=secret, timeout=timeout,
                                     name=name)
        except BaseException:
            client.close()
            raise
        try:
            client._replica_timeout = replica_timeout
            client._feeds = ReplicaFeeds(ReplicaFeed(
                replica_client, parse_address(replica)[0], timeout=replica_timeout,
                schedule=client._timer.schedule))
        except ConfigError:
            replica_client.close()
            client.close()
            raise
    if agent is not None:
        from .agent_report import TransferReporter

        client._reporter = TransferReporter(agent)
        client._peer_host = sock.getpeername()[0]
    if controller is not None:
        from .blocking_control import ControlledPushes

        try:
            def dial_aggregator(address: str) -> Client:
                sock, conn, welcome = dial(address, job, secret, name,
                                           min(timeout, AGGREGATOR_DIAL_TIMEOUT),
                                           what="aggregator", command=AGGREGATOR_COMMAND)
                return Client(sock, conn, welcome, address)

            client._controlled = ControlledPushes(
                client, controller, Handshake(job, secret, name or default_client_name()),
                dial_aggregator=dial_aggregator,
                host=host or sock.getsockname()[0], dst=sock.getpeername()[0],
                fallback=controller_fallback, timeout=controller_timeout,
                aggregation=replica is None)
        except BaseException:
            client.close()
            raise
        if client._feeds is not None:
            from .failover import FailoverWait
            from .replica_feed import ReplicaFeeds

            feed = client._feeds.current
            assert feed is not None
            try:
                client._feeds = ReplicaFeeds(feed, replica_backlog)
                client._failover = FailoverWait(failover_timeout)
            except ConfigError:
                client.close()
                raise
            feed.report = client._controlled.report_replicated
            feed.on_lost = client._feeds.lost
    return client


class Client:
    """A connection to one parameter server. Thread-safe; use as a context manager."""

    def __init__(
        self,
        sock: socket.socket,
        conn: Connection,
        welcome: Welcome,
        address: str,
        metrics: ClientMetrics | None = None,
    ) -> None:
        self.address = address
        self.specs = welcome.tensors
        self.tau_max = welcome.tau_max
        self.momentum = welcome.momentum
        self.session = welcome.session
        self.metrics = metrics
        self._sock = sock
        self._conn = conn
        conn.max_frame_size = HEADER.size + MAX_META_LEN + layout(self.specs)[1]
        self._requests = RequestTable(metrics)
        self._lock = threading.Lock()  # guards the request table
        self._send_lock = threading.Lock()  # one frame on the wire at a time
        self._closed = False
        self._error: BaseException | None = None
        self._controlled: Any = None  # ControlledPushes when a controller is used
        self._reporter: Any = None  # TransferReporter when an agent is given
        self._feeds: Any = None  # ReplicaFeeds with worker-driven replication
        self._failover: Any = None  # FailoverWait with a controller and a replica
        self._timer: Any = None  # TimerThread for replica timeouts
        self._replica_timeout = 10.0
        self._push_timeout: float | None = None
        self._dial_args: tuple[str, bytes, str, float] | None = None
        self._peer_host = ""
        self.last_version = welcome.version  # newest server version seen
        sock.settimeout(None)
        self._reader = threading.Thread(
            target=self._read_loop, args=(sock, conn, self._requests),
            name=f"mlfabric-reader-{address}", daemon=True)
        self._reader.start()

    # -- public API -------------------------------------------------------------

    def pull(self, timeout: float | None = None, *,
             including: concurrent.futures.Future[PushOutcome] | None = None,
             ) -> tuple[int, dict[str, np.ndarray]]:
        """The model as (version, {name: array}), consistent at that version.

        With `including` (a future push() returned): the model once that
        update's outcome is known, and with the update in it if it was
        applied. The server then sends the new model while the update is
        still arriving, so a worker that pushes and then pulls gets it about
        one transfer sooner. Needs a controller (updates carry an id then);
        without one this waits for the outcome, then pulls.
        """
        if including is not None:
            return self._pull_including(including, timeout)
        failover = self._failover
        generation = failover.generation if failover is not None else 0
        try:
            fut = self._request("pull", Pull, None)
            version, params = fut.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"pull() got no answer from {self.address} within {timeout} s"
            ) from None
        except ConnectionLost:
            if failover is None or not failover.wait_past(generation):
                raise
            return self.pull(timeout)  # from the promoted replica
        self.last_version = max(self.last_version, version)
        return version, params

    def _pull_including(self, push: concurrent.futures.Future[PushOutcome],
                        timeout: float | None) -> tuple[int, dict[str, np.ndarray]]:
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        uid = getattr(push, "uid", None)
        held: concurrent.futures.Future[Any] | None = None
        reqs: list[tuple[RequestTable, int]] = []
        if uid is not None and not push.done():
            wait = PULL_WAIT if timeout is None else min(max(timeout, 1e-3), PULL_WAIT)

            def held_pull(req: int) -> Pull:
                reqs.append((self._requests, req))
                return Pull(req=req, uid=uid, wait=wait)
            held = self._request("pull", held_pull, None)
        try:
            try:
                outcome = push.result(left())
            except concurrent.futures.TimeoutError:
                raise TimeoutError(f"pull(including=...) got no outcome of the update within "
                                   f"{timeout} s") from None
            except Exception:
                outcome = None  # the push failed: the model as it is
            if held is not None and outcome is not None and outcome.applied:
                try:
                    version, params = held.result(left())
                except concurrent.futures.TimeoutError:
                    raise TimeoutError(f"pull() got no answer from {self.address} within "
                                       f"{timeout} s") from None
                except ConnectionLost:
                    return self.pull(left())  # failover: from the promoted replica
                if version >= outcome.version:
                    self.last_version = max(self.last_version, version)
                    return version, params
        finally:
            self._give_up(reqs)  # unless answered: not applied, or timed out
        return self.pull(left())

    def _give_up(self, reqs: list[tuple[RequestTable, int]]) -> None:
        """Ignore the held pull's answer, and tell the server to forget it,
        else it sends the whole model once the pull's wait runs out (nothing
        for a pull already answered)."""
        with self._lock:
            cancel = [req for table, req in reqs
                      if table is self._requests and table.discard(req)]
            sock, conn = self._sock, self._conn
        try:
            for req in cancel:
                self._send_parts(sock, conn.send(PullCancel(req=req)))
        except OSError:
            pass  # the link is gone, and the held pull with it

    def push(
        self, update: Mapping[str, Any], *, base_version: int
    ) -> concurrent.futures.Future[PushOutcome]:
        """Hand an update over; returns a future of its PushOutcome at once.

        `base_version` is the version of the model the update was computed on
        (the one pull() returned). When push() returns, the arrays have been
        written to the socket and may be modified.
        """
        base = check_base_version(base_version)
        arrays = check_update(update, self.specs)
        if self._feeds is not None:
            return self._push_replicated({n: a.copy() for n, a in arrays.items()}, base)
        if self._controlled is not None:
            return self._controlled.push(arrays, base, layout(self.specs)[1])
        return self.send_push(arrays, base)

    def _push_replicated(self, arrays: dict[str, np.ndarray], base: int
                         ) -> concurrent.futures.Future[PushOutcome]:
        done: concurrent.futures.Future[PushOutcome] = concurrent.futures.Future()
        self._push_to_server(arrays, base, done, via_controller=True)
        return done

    def _push_to_server(self, arrays: dict[str, np.ndarray], base: int,
                        done: concurrent.futures.Future[PushOutcome],
                        via_controller: bool) -> None:
        """Send to the server, then to the replica if there is one; an update
        the server never answered is kept for the failover (re-sent directly
        to the promoted replica, without asking the controller again)."""
        failover = self._failover
        generation = failover.generation if failover is not None else 0

        def lost(exc: BaseException) -> None:
            if failover is not None and isinstance(exc, ConnectionLost):
                failover.park(generation, lambda: self._push_to_server(
                    arrays, base, done, via_controller=False), done)
            else:
                done.set_exception(exc)

        try:
            if via_controller and self._controlled is not None:
                at_server = self._controlled.push(arrays, base, layout(self.specs)[1])
            else:
                at_server = self.send_push(arrays, base)
        except MlfabricError as exc:
            lost(exc)
            return

        def then(f: concurrent.futures.Future[PushOutcome]) -> None:
            exc = f.exception()
            if exc is not None:
                lost(exc)
                return
            outcome = f.result()
            feed = self._feeds.acknowledged(arrays, base, outcome)
            if feed is not None:
                feed.replicate(arrays, base, outcome, done)
            else:
                done.set_result(outcome)

        at_server.add_done_callback(then)

    def _expire_pushes(self) -> None:
        """Fail the pushes past push_timeout (see connect())."""
        timeout = self._push_timeout
        if timeout is None:
            return
        with self._lock:
            self._requests.expire(timeout, self.address)
        if self._controlled is not None:
            self._controlled.expire(timeout)

    @property
    def fails_over(self) -> bool:
        """Whether this client follows the controller to a promoted replica
        (it has both a controller and a replica)."""
        return self._failover is not None

    @property
    def failed(self) -> bool:
        """Whether this client's connection failed (it then refuses requests)."""
        return self._error is not None

    def fail_over(self, address: str) -> None:
        """The controller promoted the replica at `address`: serve from it."""
        assert self._dial_args is not None and self._failover is not None
        sock, conn, welcome = dial(address, *self._dial_args)
        # Before the first answer from the new server. The feed stays open
        # until the updates on their way to it are answered.
        self._feeds.retire()
        with self._lock:
            old = self._sock
            self._sock, self._conn = sock, conn
            self._requests = RequestTable(self.metrics)
            self.address, self._error = address, None
            self.last_version = welcome.version
            conn.max_frame_size = HEADER.size + MAX_META_LEN + layout(self.specs)[1]
            sock.settimeout(None)
            self._reader = threading.Thread(
                target=self._read_loop, args=(sock, conn, self._requests),
                name=f"mlfabric-reader-{address}", daemon=True)
            self._reader.start()
        try:
            old.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        log.warning("failed over to %s (version %d)", address, welcome.version)
        self._failover.advance()

    def attach_replica(self, address: str, version: int) -> None:
        """A new replica serves from `version`: send it the kept updates above
        that version, then every update the server acknowledges."""
        from .replica_feed import ReplicaFeed

        assert self._dial_args is not None
        current = self._feeds.current
        if current is not None and current.replica.address == address:
            # The same replica, resynced from the server: this client's feed
            # to it still stands.
            log.info("replica at %s serves from version %d; still feeding it", address, version)
            return
        job, secret, name, timeout = self._dial_args
        replica = connect(address, job=job, token=secret, name=name, timeout=timeout)
        feed = ReplicaFeed(replica, parse_address(address)[0],
                           report=self._controlled.report_replicated
                           if self._controlled is not None else None,
                           timeout=self._replica_timeout,
                           schedule=self._timer.schedule if self._timer is not None else None)
        feed.on_lost = self._feeds.lost
        kept = self._feeds.attach(feed, version)
        for v, (arrays, base) in kept:
            feed.replicate(arrays, base, PushOutcome(True, v, None, None, base),
                           concurrent.futures.Future())
        log.warning("replica at %s joined from version %d; %d kept updates sent to it",
                    address, version, len(kept))

    def send_push(self, arrays: dict[str, np.ndarray], base: int, seq: int | None = None,
                   **fields: Any) -> concurrent.futures.Future[PushOutcome]:
        """`fields`: a push's uid and aggregation fields (protocol.Push)."""
        started = time.monotonic()
        fut: concurrent.futures.Future[PushOutcome] = self._request(
            "push", lambda req: Push(req, base, arrays, seq, **fields), base)
        fut.add_done_callback(self._note_version)
        if self._reporter is not None:
            nbytes = sum(a.nbytes for a in arrays.values())
            fut.add_done_callback(functools.partial(self._report, nbytes, started))
        return fut

    def _report(self, nbytes: int, started: float, fut: concurrent.futures.Future[Any]) -> None:
        """Tell the agent how long the push took (a sample of the path's rate)."""
        if not fut.cancelled() and fut.exception() is None:
            self._reporter.report(self._peer_host, nbytes, time.monotonic() - started)

    def _note_version(self, fut: concurrent.futures.Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.last_version = max(self.last_version, fut.result().version)

    def close(self) -> None:
        """Close the connection; requests still waiting fail with ConnectionLost."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._controlled is not None:
            self._controlled.close()
        if self._reporter is not None:
            self._reporter.close()
        if self._feeds is not None:
            for feed in self._feeds.all():
                feed.close()
            self._feeds.warn_unprotected()
        if self._failover is not None:
            self._failover.close()
        if self._timer is not None:
            self._timer.close()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._reader.join(timeout=10)
        self._sock.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<mlfabric.Client {self.address} {state} tensors={len(self.specs)}>"

    # -- internals --------------------------------------------------------------

    def _request(self, kind: str, make_event: Any, base_version: int | None) -> Any:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._closed or self._error is not None:
                raise self._error or ConnectionLost(f"the client for {self.address} is closed")
            req = self._requests.add(kind, fut, base_version)
            sock, conn, requests, address = self._sock, self._conn, self._requests, self.address
        try:
            self._send_parts(sock, conn.send(make_event(req)))
        except OSError as exc:
            with self._lock:
                requests.discard(req)
            raise connection_lost_error(address, exc) from None
        return fut

    def _send_parts(self, sock: socket.socket, parts: list[Any]) -> None:
        """One frame onto `sock`, whole (frames from several threads do not mix)."""
        size = sum(len(p) for p in parts)
        with self._send_lock:
            if size <= _JOIN_LIMIT:
                sock.sendall(b"".join(parts))
            else:
                for part in parts:
                    sock.sendall(part)
        if self.metrics is not None:
            self.metrics.sent_bytes.inc(size)

    def _read_loop(self, sock: socket.socket, conn: Connection, requests: RequestTable) -> None:
        error: BaseException
        try:
            while True:
                buf = conn.get_buffer()
                n = sock.recv_into(buf)
                if n == 0:
                    error = connection_lost_error(self.address, None)
                    break
                conn.buffer_updated(n)
                if self.metrics is not None:
                    self.metrics.received_bytes.inc(n)
                while (event := conn.next_event()) is not NEED_DATA:
                    with self._lock:
                        requests.dispatch(event)
        except (MlfabricError, ProtocolError) as exc:
            error = exc
        except OSError as exc:
            error = connection_lost_error(self.address, exc)
        if self._closed:
            error = ConnectionLost(f"the client for {self.address} was closed")
        elif sock is self._sock:
            log.warning("connection to %s ended: %s", self.address, error)
        with self._lock:
            if sock is self._sock:  # not a connection already replaced by a failover
                self._error = error
            requests.fail_all(error)
