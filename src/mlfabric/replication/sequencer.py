"""Apply updates in the order the server assigned, whatever order they arrive in.

A replica must reach exactly the server's weights, and with momentum the
result depends on the order of updates (applying u1, u2 and u2, u1 differ
by gamma * (u1 - u2)). Each update sent to a replica carries its sequence
number: the server version it produced. `Sequencer` holds the updates that
arrived early and releases them strictly as seq = next, next + 1, ... Pure
bookkeeping: no I/O, no clock; the replica endpoint acts on its answers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, Literal, TypeVar

from ..errors import ConfigError, SequenceGap

T = TypeVar("T")

Offer = Literal["accepted", "held", "applied"]


class Sequencer(Generic[T]):
    """Releases items in sequence order from `next_seq` on.

    >>> s = Sequencer(1, max_pending=4)
    >>> s.offer(2, "b"), list(s.ready())
    ('accepted', [])
    >>> s.offer(1, "a"), list(s.ready())
    ('accepted', [(1, 'a'), (2, 'b')])
    """

    def __init__(self, next_seq: int, *, max_pending: int = 64) -> None:
        if max_pending < 1:
            raise ConfigError(f"the replica's out-of-order buffer must hold at least 1 "
                              f"update, got {max_pending}")
        self.next_seq = next_seq
        self.max_pending = max_pending
        self.pending: dict[int, T] = {}

    def offer(self, seq: int, item: T) -> Offer:
        """Take an update: "accepted" (new), "held" (already waiting here; this
        copy is ignored) or "applied" (already released: never apply it again).

        Raises SequenceGap when it is at least `max_pending` ahead of the next
        one to apply, so memory stays bounded while an earlier update is missing."""
        if seq < self.next_seq:
            return "applied"
        if seq in self.pending:
            return "held"
        if seq >= self.next_seq + self.max_pending:
            raise SequenceGap(
                f"update with sequence number {seq} arrived while the replica waits for "
                f"{self.next_seq}; it holds at most {self.max_pending} updates out of order "
                f"(--max-pending): send the missing updates {self.next_seq}..{seq - 1} first"
            )
        self.pending[seq] = item
        return "accepted"

    def ready(self) -> Iterator[tuple[int, T]]:
        """Release the updates that are next in sequence, in order; each is
        counted as applied when it is yielded."""
        while self.next_seq in self.pending:
            seq = self.next_seq
            item = self.pending.pop(seq)
            self.next_seq = seq + 1
            yield seq, item

    def missing(self) -> list[int]:
        """Sequence numbers below the highest held one that have not arrived."""
        if not self.pending:
            return []
        return [s for s in range(self.next_seq, max(self.pending)) if s not in self.pending]

    def reset(self, next_seq: int) -> None:
        """Start over at `next_seq` (after loading a snapshot), dropping what
        is held below it."""
        self.next_seq = next_seq
        self.pending = {s: v for s, v in self.pending.items() if s >= next_seq}
