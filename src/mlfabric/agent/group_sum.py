"""An aggregator's sum of one group's members, without I/O (the asyncio side is
`aggregator.py`). Which transfers form a group is the controller's decision:
`mlfabric.scheduling.aggregation`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .. import kernels
from ..errors import ConfigError

SUM_CHUNK = 1 << 17  # elements (512 KiB of float32) summed at once while members arrive


class GroupSum:
    """The members of one group at an aggregator, and their sum.

    Each member's data block (its tensors laid out as on the wire) is
    received into a buffer of its own; the sum is accumulated in index order
    (u_0 + u_1 + ... + u_{k-1}, left to right with the sum_into kernel), so it
    is the same bit for bit whatever order the members' bytes arrive in, and
    a numpy replay reproduces it. The sum advances as the members' bytes
    arrive: every element all k members have received is summed once
    `SUM_CHUNK` new ones are in, so little is left to add when the last byte
    arrives. Members are kept apart (not summed into one accumulator on
    arrival) because only that order-fixed sum is reproducible, and because a
    member that never arrives must be left out of the aggregate."""

    def __init__(self, fan_in: int, nbytes: int, chunk: int = SUM_CHUNK) -> None:
        if fan_in < 1:
            raise ConfigError(f"a group needs at least one member, got fan_in={fan_in}")
        if nbytes % 4:
            raise ConfigError(f"members hold float32 tensors, so their size is a multiple "
                              f"of 4 bytes; got {nbytes}")
        self.fan_in = fan_in
        self.nbytes = nbytes
        self.chunk = chunk
        self.data: list[np.ndarray | None] = [None] * fan_in  # float32 view of each block
        self.received = [0] * fan_in  # bytes of each member in
        self.complete = [False] * fan_in
        self.acc = np.empty(nbytes // 4, np.float32)
        self.summed = 0  # acc[:summed] holds the sum of all k members

    def progress(self, index: int, block: np.ndarray | memoryview, received: int) -> None:
        """Member `index`'s data block (`nbytes` long) has `received` bytes in."""
        if self.data[index] is None:
            view = np.frombuffer(block, np.float32)
            if view.nbytes != self.nbytes:
                raise ConfigError(f"member {index} carries {view.nbytes} bytes, the group's "
                                  f"members {self.nbytes}")
            self.data[index] = view
        self.received[index] = max(self.received[index], received)
        self._advance(final=False)

    def member_done(self, index: int, block: np.ndarray | memoryview) -> None:
        self.progress(index, block, self.nbytes)
        self.complete[index] = True

    @property
    def all_in(self) -> bool:
        return all(self.complete)

    def _advance(self, final: bool) -> None:
        if any(d is None for d in self.data):
            return
        upto = min(self.received) // 4
        if upto - self.summed >= self.chunk or (final and upto > self.summed):
            kernels.sum_into(self.acc[self.summed:upto],
                           tuple(d[self.summed:upto] for d in self.data if d is not None))
            self.summed = upto

    def total(self) -> np.ndarray:
        """The sum of all k members (call when all are in)."""
        if not self.all_in:
            raise ConfigError("the group's sum is asked for before all its members are in")
        self._advance(final=True)
        return self.acc

    def total_of(self, indices: Sequence[int]) -> np.ndarray:
        """The sum of some complete members, in index order (a group that
        closes without all its members)."""
        members = [self.data[i] for i in sorted(indices) if self.complete[i]]
        if not indices or len(members) != len(indices):
            raise ConfigError(f"members {sorted(indices)} are not all complete")
        out = np.empty(self.nbytes // 4, np.float32)
        kernels.sum_into(out, tuple(m for m in members if m is not None))
        return out
