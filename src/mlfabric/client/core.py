"""What the client needs without I/O.

The handshake steps, the table of requests awaiting an answer, and the
checks on what a user hands to pull/push (the blocking client runs them in
the caller's thread). Futures here are anything with `done()`,
`set_result()` and `set_exception()`.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np

from .. import kernels
from ..errors import (
    ConfigError,
    ConnectionLost,
    InvalidUpdate,
    MlfabricError,
    ProtocolError,
    PushTimeout,
)
from ..runtime.metrics import REJECT_REASONS, ClientMetrics
from ..wire import auth
from ..wire.handshake import handshake_error
from ..wire.protocol import (
    BlockPlan,
    Error,
    FrameTensors,
    LaidOutTensors,
    Model,
    ModelEnd,
    PushResult,
    Scatter,
    TensorSpec,
)
from .outcome import PushOutcome

log = logging.getLogger("mlfabric.client")


def parse_address(address: str) -> tuple[str, int]:
    """'HOST:PORT' or '[IPv6]:PORT' -> (host, port)."""
    if not isinstance(address, str) or ":" not in address:
        raise ConfigError(f"address must be HOST:PORT, got {address!r}")
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not host or not 0 <= port <= 65535:
        raise ConfigError(f"address must be HOST:PORT with a port in 0..65535, got {address!r}")
    return host, port


def resolve_token(token: str | bytes | None, token_file: str | os.PathLike[str] | None) -> bytes:
    if (token is None) == (token_file is None):
        raise ConfigError("give the job's token as exactly one of token=... or token_file=...")
    if token_file is not None:
        return auth.load_token(token_file)
    assert token is not None
    return auth.as_token(token)


def default_client_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def error_from_event(event: Error, context: str = "") -> MlfabricError:
    """The exception a client raises for an Error answer."""
    message = f"{context}{event.message}"
    if event.code in REJECT_REASONS:
        return InvalidUpdate(message, reason=event.code)
    # auth, protocol and server errors map as during the handshake
    return handshake_error(Error(code=event.code, message=message, req=event.req))


@dataclass(frozen=True)
class _SpecsIndex:
    """What checking an update against a tensor list needs, made once per
    list object (a client's specs): {name: spec}, the names and the shapes."""

    specs: tuple[TensorSpec, ...]
    by_name: dict[str, TensorSpec]
    names: list[str]
    shapes: list[tuple[int, ...]]


_SPECS_INDEX: dict[int, _SpecsIndex] = {}


def _index(specs: tuple[TensorSpec, ...]) -> _SpecsIndex:
    hit = _SPECS_INDEX.get(id(specs))
    if hit is None or hit.specs is not specs:  # held, so its id is not reused meanwhile
        if len(_SPECS_INDEX) >= 64:
            _SPECS_INDEX.clear()
        hit = _SPECS_INDEX[id(specs)] = _SpecsIndex(
            specs, {s.name: s for s in specs}, [s.name for s in specs], [s.shape for s in specs])
    return hit


def check_update(
    update: Mapping[str, Any], specs: tuple[TensorSpec, ...]
) -> dict[str, np.ndarray]:
    """The update as C-contiguous numpy arrays, checked against the model's layout.

    Catches mistakes before any byte is sent, with the same messages the
    server would give. Accepts numpy arrays and CPU tensors (shared, not copied).
    """
    if not isinstance(update, Mapping):
        raise TypeError(f"push() takes a mapping of tensor name to array, got {type(update)}")
    by_name = _index(specs).by_name
    arrays: dict[str, np.ndarray] = {}
    for name, value in update.items():
        if name not in by_name:
            raise InvalidUpdate(
                f"unknown tensor {name!r}; the model's tensors are {sorted(by_name)}",
                reason="unknown_tensor",
            )
        if hasattr(value, "detach"):  # a torch tensor: share its memory with numpy
            value = value.detach().numpy()
        arr = np.asarray(value)
        spec = by_name[name]
        if arr.dtype != spec.dtype:
            raise InvalidUpdate(
                f"tensor {name!r} is {arr.dtype}, the model's is {spec.dtype}: push "
                f"arr.astype(np.{spec.dtype.name})",
                reason="bad_dtype",
            )
        if arr.shape != spec.shape:
            raise InvalidUpdate(
                f"tensor {name!r} has shape {arr.shape}, the model's is {spec.shape}",
                reason="bad_shape",
            )
        arrays[name] = arr if arr.flags.c_contiguous else np.array(arr, order="C")
    # Every name was found among the model's, once each: as many means all.
    missing = [] if len(arrays) == len(specs) else [s.name for s in specs
                                                    if s.name not in arrays]
    if missing:
        raise InvalidUpdate(
            f"update lacks tensor {missing[0]!r}: push a value for every tensor of the model "
            f"(zeros where nothing changes)",
            reason="unknown_tensor",
        )
    return arrays


# A model version: an int from one server; from a sharded job's servers, a
# tuple of the shards' versions (client/sharded.py). Typed Any so that code
# written for one server (comparing, storing versions as ints) type-checks
# unchanged: a union would make every caller narrow it.
Version: TypeAlias = Any


# An update of many small tensors goes out as one frame data block, not as a
# buffer per tensor, which costs the encoder and the transport a few
# microseconds each: for at least this many tensors of at most this mean size.
GATHER_MIN_TENSORS = 16
GATHER_MEAN_BYTES = 1 << 16
# Up to this many bytes, the block is gathered: copied into one buffer, which
# costs less than waiting for the link to send it (the caller may reuse its
# arrays at once). Above, it goes straight from the arrays (`LaidOutTensors`,
# one sendmsg): the copy would be bound by memory bandwidth and cost about
# as much as sending.
GATHER_MAX_BYTES = 1 << 16


def _pays(specs: tuple[TensorSpec, ...], total: int) -> bool:
    n = len(specs)
    return n >= GATHER_MIN_TENSORS and total <= n * GATHER_MEAN_BYTES


def laid_out_update(update: Any, specs: tuple[TensorSpec, ...], block: tuple[list[int], int],
                    plan: BlockPlan) -> FrameTensors | LaidOutTensors | None:
    """`update` checked in a single pass in C and laid out as one frame data
    block, when that pays (see above) and it is a dict of C-contiguous
    float32 arrays naming the model's tensors in order: gathered into a copy
    up to GATHER_MAX_BYTES, else its arrays as they are (`plan`: the whole
    tensors in their frame layout). Else None (check_update then checks it,
    and names what is wrong)."""
    offsets, total = block
    if not _pays(specs, total) or type(update) is not dict:
        return None
    index = _index(specs)
    if total > GATHER_MAX_BYTES:
        arrays = kernels.check_laid_out(update, index.names, index.shapes)
        return None if arrays is None else LaidOutTensors(specs, arrays, plan)
    data = np.empty(total, np.uint8)  # check_gather zeroes the padding
    if not kernels.check_gather(update, index.names, index.shapes, offsets, data):
        return None
    return FrameTensors(specs, offsets, data)


def laid_out(arrays: Mapping[str, np.ndarray], specs: tuple[TensorSpec, ...],
             block: tuple[list[int], int]) -> Mapping[str, np.ndarray]:
    """`arrays` (checked against `specs`, whose frame layout is `block`:
    offsets and size) as one laid-out data block when that pays, else as
    they are. Only an update naming the tensors in the model's order is
    gathered: a server whose store has that layout then applies the block as
    it is, too."""
    offsets, total = block
    if (isinstance(arrays, (FrameTensors, LaidOutTensors)) or not _pays(specs, total)
            or len(arrays) != len(specs)):
        return arrays
    if list(arrays) != _index(specs).names:
        return arrays
    data = np.zeros(total, np.uint8)
    kernels.gather(data, list(arrays.values()), offsets)
    return FrameTensors(specs, offsets, data)


def check_base_version(base_version: Any) -> int:
    if type(base_version) is not int and not isinstance(base_version, np.integer):
        raise TypeError(
            f"base_version must be the int version returned by pull(), got {base_version!r}"
        )
    if base_version < 0:
        raise ValueError(f"base_version must be >= 0, got {base_version}")
    return int(base_version)


def takes_including(pull: Any) -> bool:
    """Whether a client's pull() takes `including=` (mlfabric's clients do; a
    stand-in a user passes may not)."""
    try:
        return "including" in inspect.signature(pull).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


@dataclass
class _Pending:
    kind: str  # "pull" or "push"
    future: Any
    base_version: int | None
    started: float
    streamed: Model | None = None  # a streamed model awaiting its MODEL_END
    into: Scatter | None = None  # where a pull's model goes (else a buffer of its own)


# Requests given up on (a pull that timed out) whose late answers are ignored.
DISCARDED_KEPT = 1024

# How long the server may hold a pull for an update before answering with
# the model as it is (an update queued longer is pulled for again).
PULL_WAIT = 30.0


class RequestTable:
    """Requests awaiting an answer, and how each answer resolves its future."""

    def __init__(self, metrics: ClientMetrics | None = None) -> None:
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._discarded: OrderedDict[int, None] = OrderedDict()
        self.metrics = metrics

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, kind: str, future: Any, base_version: int | None = None,
            into: Scatter | None = None) -> int:
        req = next(self._ids)
        self._pending[req] = _Pending(kind, future, base_version, time.perf_counter(),
                                      into=into)
        return req

    def scatter_for(self, head: Any) -> Scatter | None:
        """Where the model answering a pending pull goes (Connection.scatter_for);
        the answer to a request given up on gets a buffer of its own."""
        pending = self._pending.get(getattr(head, "req", None))  # type: ignore[arg-type]
        return pending.into if pending is not None and pending.kind == "pull" else None

    def discard(self, req: int) -> bool:
        """Give up on a request: an answer that still comes is ignored. False
        if it was not awaiting an answer."""
        if self._pending.pop(req, None) is None:
            return False
        self._discarded[req] = None
        while len(self._discarded) > DISCARDED_KEPT:
            self._discarded.popitem(last=False)
        return True

    def dispatch(self, event: Any) -> None:
        """Resolve the future an answer belongs to. Raises ProtocolError for an
        answer to no request, or a connection-wide Error's exception."""
        req = getattr(event, "req", None)
        if isinstance(event, Error) and req is None:
            raise error_from_event(event, "server closed the connection: ")
        pending = self._pending.pop(req, None) if req is not None else None
        if pending is None:
            if req in self._discarded:
                return
            raise ProtocolError(f"server sent {type(event).__name__} for unknown request {req}")
        if isinstance(event, Model) and event.streamed and pending.kind == "pull":
            pending.streamed = event  # it holds once its MODEL_END says so
            self._pending[event.req] = pending
            return
        if isinstance(event, ModelEnd) and pending.kind == "pull":
            model, pending.streamed = pending.streamed, None
            if model is None:
                raise ProtocolError(f"server ended a streamed model for request {req} it "
                                    f"never began")
            if not event.ok:
                self._pending[event.req] = pending  # the pull is still open
                return
            event = model
        fut = pending.future
        elapsed = time.perf_counter() - pending.started
        m = self.metrics
        if isinstance(event, Error):
            if m is not None and pending.kind == "push":
                m.pushes.labels("error").inc()
            if not fut.done():
                fut.set_exception(error_from_event(event, f"{pending.kind} refused: "))
        elif isinstance(event, PushResult) and pending.kind == "push":
            outcome = PushOutcome(
                applied=event.applied,
                version=event.version,
                delay=event.delay,
                reason=event.reason,
                base_version=pending.base_version,
                fan_in=event.fan_in,
                index=event.index,
            )
            if m is not None:
                m.push_seconds.observe(elapsed)
                m.pushes.labels("applied" if event.applied else "rejected").inc()
            if not fut.done():
                fut.set_result(outcome)
        elif isinstance(event, PushResult) and pending.kind == "aggregate":
            if not fut.done():
                fut.set_result(event)  # the aggregator needs every member's delay
        elif isinstance(event, Model) and pending.kind == "pull":
            if m is not None:
                m.pull_seconds.observe(elapsed)
            if not fut.done():
                # A model received into the pull's scatter is its tensors, as they are.
                into = pending.into
                fut.set_result((event.version, event.tensors
                                if into is not None and event.tensors is into.tensors
                                else dict(event.tensors)))
        else:
            raise ProtocolError(
                f"server answered a {pending.kind} with {type(event).__name__}"
            )

    def expire(self, timeout: float, address: str) -> int:
        """Fail the pushes that have waited for an answer longer than
        `timeout` seconds with PushTimeout (a late answer is then ignored);
        how many."""
        now = time.perf_counter()
        late = [req for req, p in self._pending.items()
                if p.kind == "push" and now - p.started > timeout]
        for req in late:
            future = self._pending[req].future
            self.discard(req)
            if not future.done():
                future.set_exception(PushTimeout(
                    f"the server at {address} has not answered this push within {timeout:g} s "
                    f"(push_timeout): it may or may not have applied it; pull() to see the "
                    f"server's version, and raise push_timeout if pushes are this slow"))
        return len(late)

    def fail_all(self, exc: BaseException) -> None:
        pending, self._pending = self._pending, {}
        for p in pending.values():
            if not p.future.done():
                p.future.set_exception(exc)


DEFAULT_PUSH_TIMEOUT = 600.0  # seconds a push may wait for its outcome


def check_push_timeout(push_timeout: float | None) -> float | None:
    if push_timeout is not None and not push_timeout > 0:
        raise ConfigError(f"push_timeout must be positive seconds (or None for no bound), got "
                          f"{push_timeout}")
    return push_timeout


def watch_period(push_timeout: float) -> float:
    """How often a client looks for pushes past their timeout."""
    return min(1.0, push_timeout / 4)


def connection_lost_error(address: str, exc: BaseException | None) -> ConnectionLost:
    detail = f": {exc}" if exc else ""
    return ConnectionLost(
        f"connection to {address} closed before the answer arrived{detail}; the request may "
        f"or may not have been applied: reconnect and pull() to see the server's version"
    )
