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
    fan_in, index: it was applied as member `index` of an aggregate of
        `fan_in` updates, one step that took the server from version -
        fan_in to `version` (None when applied alone).
    folded: with compression, a dropped update was folded into the
        error-feedback residual: its contribution goes with the next push,
        nothing of it is lost (issue 35).
    """

    applied: bool
    version: int
    delay: int | None
    reason: str | None = None
    base_version: int | None = None
    fan_in: int | None = None
    index: int | None = None
    folded: bool = False

    @property
    def seq(self) -> int:
        """The version this update holds in the server's order: its own for
        an update applied alone; for member `index` of an aggregate, the
        aggregate's first version plus `index` (where a replica takes it)."""
        if self.fan_in is None or self.index is None:
            return self.version
        return self.version - self.fan_in + 1 + self.index
