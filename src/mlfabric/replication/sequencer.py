"""Apply updates in the order the server assigned, whatever order they arrive in.

A replica must reach exactly the server's weights, and with momentum the
result depends on the order of updates (applying u1, u2 and u2, u1 differ
by gamma * (u1 - u2)). Each update sent to a replica carries its sequence
number: the server version it produced. `Sequencer` holds the updates that
arrived early and releases them strictly as seq = next, next + 1, ... Pure
bookkeeping: no I/O, no clock; the replica endpoint acts on its answers.

An aggregate the server applied as one step of k versions is released only
whole: its first item names its `span` (k), and it waits until all k are
held, so the replica never stands between two versions of one step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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

    def __init__(self, next_seq: int, *, max_pending: int = 64,
                 span: Callable[[T], int] | None = None) -> None:
        """`span(item)`: how many consecutive sequence numbers, from the
        item's own, are released together (None: one each)."""
        if max_pending < 1:
            raise ConfigError(f"the replica's out-of-order buffer must hold at least 1 "
                              f"update, got {max_pending}")
        self.next_seq = next_seq
        self.max_pending = max_pending
        self.pending: dict[int, T] = {}
        self.span = span

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
        counted as applied when it is yielded. The items of a span come out
        one after another, only once all of them are held."""
        while self.next_seq in self.pending:
            first = self.next_seq
            k = 1 if self.span is None else self.span(self.pending[first])
            if any(first + j not in self.pending for j in range(1, k)):
                return
            for seq in range(first, first + k):
                item = self.pending.pop(seq)
                self.next_seq = seq + 1
                yield seq, item

    def waiting_for(self) -> int:
        """The sequence number whose absence holds the next release back."""
        seq = self.next_seq
        if seq in self.pending and self.span is not None:
            k = self.span(self.pending[seq])
            return next((seq + j for j in range(1, k) if seq + j not in self.pending), seq)
        return seq

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
