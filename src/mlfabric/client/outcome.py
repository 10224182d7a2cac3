"""What a push comes back with."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PushOutcome:
    """What happened to one pushed update.

    applied: whether the server applied it.
    version: the server's version after applying it (or its version then, if not).
    delay: the server's version at apply minus `base_version` (the staleness).
    reason: why it was not applied (None when applied).
    """

    applied: bool
    version: int
    delay: int | None
    reason: str | None = None
    base_version: int | None = None
