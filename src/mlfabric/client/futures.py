"""The futures a push returns: stdlib futures that also carry the update's uid.

The uid names the update at the server when it went through a controller
(the server applies an update at most once, by uid); `pull(including=...)`
sends it so the server answers with the model that includes the update.
Without a controller it is None.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Mapping
from typing import TYPE_CHECKING

from .outcome import PushOutcome

if TYPE_CHECKING:
    import numpy as np


class AsyncPushFuture(asyncio.Future[PushOutcome]):
    """The asyncio client's push: resolves to the update's `PushOutcome`."""

    uid: str | None = None
    # A compressed push: its parts as they went (client.compressed).
    sent_as: Mapping[str, np.ndarray] | None = None


class PushFuture(concurrent.futures.Future[PushOutcome]):
    """The blocking client's push: resolves to the update's `PushOutcome`."""

    uid: str | None = None
    # The asyncio client's future of the same push, on the client's loop
    # (set there, before any later call of the caller runs on it).
    pushed: asyncio.Future[PushOutcome] | None = None

    def attach(self, pushed: asyncio.Future[PushOutcome]) -> None:
        self.pushed = pushed
        self.uid = getattr(pushed, "uid", None)
