"""The client's internal seams, named: what each collaborator needs of the
other, as `typing.Protocol`s, so a change on one side is checked on the other.

- `PushLink`: where a push frame goes (a server, a replica or an aggregator).
  `send_push` sends the frame as given, without the checks of `push()`:
  arrays are sent as they are and must stay unchanged until the future is done.
- `ReplicaSink`: what worker-driven replication sends each applied update to.
  The blocking client answers with `concurrent.futures.Future`s, the asyncio
  client with `asyncio.Future`s: both have the `Answer` methods used here.
- `ControlledClient`: what the link to the controller needs of the asyncio
  client it routes pushes for (a push sent a chunk at a time among it).
- `ServerConnection`: what the aggregator needs of its link to the server: a
  request whose data block follows as it becomes final.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ..wire.protocol import Failover, ReplicaAt
from .link import FrameWriter, PartFrame
from .outcome import PushOutcome


class Answer(Protocol):
    """The part of a future `ReplicaSink` answers with that its callers use."""

    def add_done_callback(self, fn: Callable[[Any], object], /) -> None: ...

    def cancelled(self) -> bool: ...

    def exception(self) -> BaseException | None: ...

    def result(self) -> PushOutcome: ...


class ReplicaSink(Protocol):
    address: str

    def send_push(self, arrays: dict[str, np.ndarray], base: int, seq: int | None = None,
                  **fields: Any) -> Answer: ...


class PushLink(Protocol):
    address: str

    @property
    def closed(self) -> bool: ...

    def send_push(self, arrays: dict[str, np.ndarray], base: int, seq: int | None = None,
                  **fields: Any) -> asyncio.Future[PushOutcome]: ...

    async def close(self) -> None: ...


class ControlledClient(Protocol):
    address: str
    last_version: int

    def send_push(self, arrays: dict[str, np.ndarray], base: int, seq: int | None = None,
                  **fields: Any) -> asyncio.Future[PushOutcome]: ...

    def send_push_part(self, arrays: dict[str, np.ndarray], base: int, upto: int | None,
                       seq: int | None = None, **fields: Any
                       ) -> tuple[asyncio.Future[PushOutcome], PartFrame | None]: ...

    async def flushed(self) -> None: ...

    def pace(self, rate: float | None) -> bool: ...

    def replica_change(self, event: Failover | ReplicaAt) -> None: ...

    def dropped(self, arrays: dict[str, np.ndarray]) -> bool: ...

    def with_residual(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


class ServerConnection(Protocol):
    address: str
    tau_max: int | None

    @property
    def closed(self) -> bool: ...

    def request_streamed(self, kind: str, make_event: Any, base_version: int | None
                         ) -> tuple[asyncio.Future[Any], FrameWriter]: ...

    async def close(self) -> None: ...
