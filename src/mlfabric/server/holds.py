"""Pushes a server holds back so as not to pass the transfers their go named.

A controller lets a transfer go with the ids of the transfers running into
the same server that would be refused as stale if it landed before them
(`scheduling.observed.RunningOrder.must_follow`); every push it lets go
carries its own id, its ticket. A push that lands while some of those have
not is held until they have (applied or refused), or until its
`after_seconds` run out: the order the plan assumed, kept where TCP's
unfair sharing or an unannounced slow link broke it on the wire.

Pure bookkeeping: `ParameterServer` holds, times and applies.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

# Tickets remembered as landed. A go names transfers running when it was
# given, so a ticket is looked up within a few transfer times of landing;
# at 7,000 landings a second (10,000 simulated workers) 16,384 is over 2 s.
LANDED_MEMORY = 1 << 14
# Pushes held at once, at most: each holds its buffer (a model's worth of
# bytes). Past it a push is applied as it lands (the guard's order alone).
MAX_HELD = 1024


class Holds:
    """The tickets landed lately and the pushes waiting for others."""

    def __init__(self, *, memory: int = LANDED_MEMORY, limit: int = MAX_HELD) -> None:
        if memory < 1 or limit < 0:
            raise ValueError(f"memory must be >= 1 and limit >= 0, got {memory} and {limit}")
        self.memory, self.limit = memory, limit
        self._landed: OrderedDict[int, None] = OrderedDict()
        self._waits: dict[Hashable, set[int]] = {}  # held push -> tickets it waits for
        self._waiting: dict[int, list[Hashable]] = {}  # ticket -> held pushes, in order held

    def __len__(self) -> int:
        return len(self._waits)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._waits

    def missing(self, after: Iterable[int]) -> set[int]:
        """The tickets of `after` not landed."""
        return {t for t in after if t not in self._landed}

    def hold(self, key: Hashable, waits: set[int]) -> bool:
        """Hold `key` until every ticket of `waits` (not empty) has landed;
        False (not held) if `limit` pushes are held already."""
        if not waits:
            raise ValueError("a push is held for at least one ticket")
        if key in self._waits:
            raise ValueError(f"{key!r} is held already")
        if len(self._waits) >= self.limit:
            return False
        self._waits[key] = set(waits)
        for ticket in waits:
            self._waiting.setdefault(ticket, []).append(key)
        return True

    def landed(self, ticket: int) -> list[Hashable]:
        """`ticket`'s push has been applied or refused (or will never be):
        the held pushes that waited for it alone, in the order held."""
        self._landed[ticket] = None
        self._landed.move_to_end(ticket)
        while len(self._landed) > self.memory:
            self._landed.popitem(last=False)
        free = []
        for key in self._waiting.pop(ticket, ()):
            waits = self._waits.get(key)
            if waits is None:
                continue  # dropped meanwhile
            waits.discard(ticket)
            if not waits:
                del self._waits[key]
                free.append(key)
        return free

    def drop(self, key: Hashable) -> bool:
        """Stop holding `key` (its wait ran out, or its connection closed):
        whether it was held."""
        waits = self._waits.pop(key, None)
        if waits is None:
            return False
        for ticket in waits:
            keys = self._waiting.get(ticket)
            if keys is not None:
                keys.remove(key)
                if not keys:
                    del self._waiting[ticket]
        return True
