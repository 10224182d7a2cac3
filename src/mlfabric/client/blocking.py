"""The blocking client: `mlfabric.connect(...)`.

A façade over the asyncio client (`mlfabric.client.aio`), which runs on an
event loop of its own on a background thread (`runtime.loop_thread`): every
feature (controller routing, aggregation, worker-driven replication,
failover, replica joins, push timeouts, agent reports) is written once, in
asyncio, and this module only hands calls over and waits.

What a push promises about its arrays is the same whatever the options:
when `push()` returns, the update has been handed to the operating system
(or copied, when it has to wait for a controller's go or for a replica) and
the arrays may be modified. The asyncio client instead returns at once and
needs them unchanged until the push's future is done.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import ConnectionLost
from ..runtime.loop_thread import LoopThread
from ..runtime.metrics import ClientMetrics
from ..wire.protocol import FrameTensors, LaidOutTensors
from . import aio, sharded
from .core import DEFAULT_PUSH_TIMEOUT, Version
from .futures import PushFuture
from .outcome import PushOutcome


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
    agent_key_file: str | os.PathLike[str] | None = None,
    replica: str | None = None,
    failover_timeout: float = 30.0,
    replica_backlog: int = 64,
    replica_timeout: float = 10.0,
    push_timeout: float | None = DEFAULT_PUSH_TIMEOUT,
    tls_cert: str | os.PathLike[str] | None = None,
    tls_key: str | os.PathLike[str] | None = None,
    tls_ca: str | os.PathLike[str] | None = None,
    compression: str | None = None,
    significance: float | None = None,
) -> Client:
    """Connect to the parameter server at `address` ("HOST:PORT") for `job`.

    The job's token is given as `token` or read from `token_file`. Raises
    ConnectError if the server cannot be reached within `timeout` seconds and
    AuthenticationError if the token or job is wrong.

    With `controller` ("HOST:PORT" of `mlfabric controller`), every push asks
    the controller when to go. `host` names this worker's host in the
    controller's network picture (default: the local address of the
    connection to the server). A controller that refuses this worker
    (another job's, another token) or an address that is no controller (the
    server's, a metrics port) raises at connect: AuthenticationError,
    WrongPeer. Only where nothing answers (the controller is down, at
    connect or later), `controller_fallback="fifo"` sends updates straight to
    the server, unscheduled, with a warning, counting them in `metrics`
    (controller_unreachable, controller_fallback_updates) and reporting them
    to the controller once it answers (`mlfabric status` lists them);
    `"wait"` raises ConnectError at connect, and later waits up to
    `controller_timeout` seconds for it.

    With `agent` ("HOST:PORT" of this host's `mlfabric agent`), every push of
    64 KiB or more is reported to the agent as a measurement of the path to
    the server (never delaying the push), logged in with the job's agent key
    from `agent_key_file` (the operator makes it: `mlfabric token agent-key`).

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

    With `tls_cert`, `tls_key` and `tls_ca` (PEM files: this worker's
    certificate, its key, and the cluster's CA; all three or none), every
    link the client opens is mutual TLS: the listener must present a
    certificate the CA signed that names the host dialled, and is shown
    `tls_cert` in turn (`mlfabric tls init` makes them). The job's token is
    still checked inside it. A refusal on either side raises TLSError or
    ConnectionLost saying which side did not accept what.

    With `compression` ("fp16", "bf16", "topk:F", "randk:F" or "lowrank:R";
    see mlfabric.compression), every update goes compressed with error
    feedback: what a push leaves out stays in a residual per tensor and goes
    with the next pushes, and an update the controller drops is folded into
    it too (its outcome says `folded`), so nothing is lost. The controller
    plans each transfer at its compressed size. With "adaptive" (or
    "adaptive:A,B,..."), the worker offers the controller those compressed
    forms (by default fp16, topk:0.1, topk:0.01) and sends each update as
    its go says: whole unless the plan would drop it, else with the least
    compression that lets it go (`mlfabric controller --compression`). With sharded servers each
    shard's part is compressed on its own; a replica gets the same
    compressed parts as its server. Through an aggregator (adaptive only:
    a fixed codec with aggregators is a ConfigError at connect) an update
    goes whole, with what waited in the residuals.

    With `significance` (a threshold in (0, 1), e.g. 0.01), a push whose
    relative magnitude ||update + residual|| / ||model last pulled|| is
    below it is held, after Gaia (mlfabric.compression.significance): it is
    folded into the error-feedback residual and goes with a later push, and
    its outcome, at once, is not applied, `folded`, with the reason. With
    or without `compression`; over every shard at once.

    The asyncio client, `await mlfabric.aio.connect(...)`, takes the same
    arguments and behaves the same: this client runs it on a thread.
    """
    runner = LoopThread(name=f"mlfabric-client-{address}")
    try:
        engine = runner.run(sharded.connect(
            address, job=job, token=token, token_file=token_file, timeout=timeout, name=name,
            metrics=metrics, controller=controller, host=host,
            controller_fallback=controller_fallback, controller_timeout=controller_timeout,
            agent=agent, agent_key_file=agent_key_file, replica=replica,
            failover_timeout=failover_timeout,
            replica_backlog=replica_backlog, replica_timeout=replica_timeout,
            push_timeout=push_timeout, tls_cert=tls_cert, tls_key=tls_key, tls_ca=tls_ca,
            compression=compression, significance=significance))
    except BaseException:
        runner.stop()
        raise
    return Client(engine, runner, metrics)


# Updates up to this size are copied and handed to the loop without waiting
# (the link joins such a frame into one buffer anyway, a copy of its own).
SMALL_PUSH = 1 << 16


class Client:
    """A connection to one parameter server. Thread-safe; use as a context manager."""

    def __init__(self, engine: aio.AsyncClient | sharded.ShardedClient, runner: LoopThread,
                 metrics: ClientMetrics | None = None) -> None:
        self._engine = engine
        self._runner = runner
        self.metrics = metrics
        self.specs = engine.specs
        self.tau_max = engine.tau_max
        self.momentum = engine.momentum
        self.session = engine.session
        self._closed = False
        self._closing = threading.Lock()  # close() from two threads runs once

    @property
    def address(self) -> str:
        """The server's address (the promoted replica's after a failover)."""
        return self._engine.address

    @property
    def last_version(self) -> Version:
        """The newest server version this client has seen."""
        return self._engine.last_version

    # -- public API -------------------------------------------------------------

    def pull(self, timeout: float | None = None, *,
             including: concurrent.futures.Future[PushOutcome] | None = None,
             ) -> tuple[Version, dict[str, np.ndarray]]:
        """The model as (version, {name: array}), consistent at that version.

        With `including` (a future push() returned): the model once that
        update's outcome is known, and with the update in it if it was
        applied. The server then sends the new model while the update is
        still arriving, so a worker that pushes and then pulls gets it about
        one transfer sooner. Needs a controller (updates carry an id then);
        without one this waits for the outcome, then pulls.
        """
        if including is not None and not isinstance(including, concurrent.futures.Future):
            raise TypeError(f"including= takes the future push() returned, got "
                            f"{type(including).__name__}")
        self._check_open()
        try:
            return self._runner.run(self._pull(including), timeout)
        except TimeoutError:
            if including is not None and not including.done():
                raise TimeoutError(f"pull(including=...) got no outcome of the update within "
                                   f"{timeout} s") from None
            raise TimeoutError(
                f"pull() got no answer from {self.address} within {timeout} s") from None

    async def _pull(self, including: concurrent.futures.Future[PushOutcome] | None
                    ) -> tuple[Version, dict[str, np.ndarray]]:
        if including is None:
            return await self._engine.pull()
        if isinstance(including, PushFuture) and including.pushed is not None:
            # Submitted before this pull (the loop runs callbacks in order).
            return await self._engine.pull(including=including.pushed)
        # Any other future with a uid (as a test or a wrapper may hold): the
        # same, on this loop.
        pushed = asyncio.wrap_future(including)
        pushed.uid = getattr(including, "uid", None)  # type: ignore[attr-defined]
        return await self._engine.pull(including=pushed)

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectionLost(f"the client for {self.address} is closed")

    def push(self, update: Mapping[str, Any], *, base_version: Version) -> PushFuture:
        """Hand an update over; returns a future of its PushOutcome.

        `base_version` is the version of the model the update was computed on
        (the one pull() returned). When push() returns, the update has been
        handed to the operating system or copied, whatever the options: the
        arrays may be modified.
        """
        self._check_open()
        base = self._engine.check_base(base_version)
        arrays = self._engine.prepare(update)  # errors in the caller's thread
        refusal = self._engine.refusal()
        if refusal is not None:
            raise refusal
        result = PushFuture()
        result.add_done_callback(self._cancelled)
        if isinstance(arrays, FrameTensors):
            # Many small tensors, already copied into one block: nothing of
            # the caller's is sent, so nothing to wait for.
            self._runner.call_soon(self._submit, arrays, base, result)
        elif isinstance(arrays, LaidOutTensors):
            # Many small tensors sent straight from their arrays: wait, as
            # for one large tensor, until they have left.
            self._runner.run(self._submit_and_flush(arrays, base, result))
        elif sum(a.nbytes for a in arrays.values()) <= SMALL_PUSH:
            # A copy costs less than waiting for the loop to send it: hand it
            # over and return.
            copies = {n: a.copy() for n, a in arrays.items()}
            self._runner.call_soon(self._submit, copies, base, result)
        else:
            self._runner.run(self._submit_and_flush(arrays, base, result))
        return result

    def _submit(self, arrays: Mapping[str, np.ndarray], base: Any, result: PushFuture) -> None:
        """On the loop: push, and settle `result` as the push ends."""
        try:
            pushed = self._engine.submit(arrays, base)
        except BaseException as exc:
            _settle_error(result, exc)
            return
        result.attach(pushed)
        pushed.add_done_callback(lambda f: _settle(result, f))

    async def _submit_and_flush(self, arrays: Mapping[str, np.ndarray], base: Any,
                                result: PushFuture) -> None:
        self._submit(arrays, base, result)
        # The bytes of a frame not yet handed to the OS still point into the
        # arrays (uvloop does not copy): wait until the link has sent them.
        await self._engine.flushed()

    def _cancelled(self, result: concurrent.futures.Future[PushOutcome]) -> None:
        if result.cancelled() and isinstance(result, PushFuture) and result.pushed is not None:
            self._runner.call_soon(result.pushed.cancel)

    def close(self) -> None:
        """Close the connection; requests still waiting fail with ConnectionLost."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
        try:
            self._runner.run(self._engine.close(), 30.0)
        finally:
            self._runner.stop()

    @property
    def closed(self) -> bool:
        return self._closed or self._engine.closed

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<mlfabric.Client {self.address} {state} tensors={len(self.specs)}>"


def _settle_error(result: concurrent.futures.Future[PushOutcome], exc: BaseException) -> None:
    try:
        result.set_exception(exc)
    except concurrent.futures.InvalidStateError:
        pass  # cancelled by its owner meanwhile


def _settle(result: concurrent.futures.Future[PushOutcome], pushed: Any) -> None:
    """Give the blocking future the asyncio future's end (on the loop's thread)."""
    try:
        if pushed.cancelled():
            result.cancel()
        elif pushed.exception() is not None:
            result.set_exception(pushed.exception())
        else:
            result.set_result(pushed.result())
    except concurrent.futures.InvalidStateError:
        pass  # cancelled by its owner meanwhile
