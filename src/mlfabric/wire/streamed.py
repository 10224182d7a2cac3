"""Streamed data blocks, without I/O: a frame whose head goes out first
(`Connection.send_head`) and whose data block follows as its bytes become
final, written through a `StreamedBlock`.

Two senders use it. The server answers a pull for an update with a MODEL
frame (`streamed=True`) while that update is staged (applied piece by piece
as its bytes arrive, `store.StagedApply`): the next weights of the elements
already computed are final if the staging commits, so they go out at once,
and if the staging turns void the block is completed with zeros and a
MODEL_END says it does not hold. The aggregator forwards an aggregate's PUSH
while its members' bytes are still arriving. The block knows the layout:
offsets, the zero padding between tensors and the zeros of a void end are
here, not in the senders.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .protocol import TensorSpec, layout


def final_prefix(specs: Sequence[TensorSpec], offsets: Sequence[int], total: int,
                 computed: Mapping[str, int]) -> int:
    """How many leading bytes of the data block (tensors `specs` at
    `offsets`, `total` bytes long) are computed, given the elements computed
    per tensor; padding before a tensor counts once the tensor has begun."""
    for spec, off in zip(specs, offsets, strict=True):
        count = spec.nbytes // spec.dtype.itemsize
        done = computed.get(spec.name, 0)
        if done < count:
            return off + done * spec.dtype.itemsize
    return total


def block_bytes(arrays: Mapping[str, np.ndarray], specs: Sequence[TensorSpec],
                offsets: Sequence[int], start: int, end: int) -> bytearray:
    """Bytes [start, end) of the data block that holds `arrays` (zero padding
    between tensors), as one copy: the arrays may change once this returns."""
    out = bytearray(end - start)
    for spec, off in zip(specs, offsets, strict=True):
        lo, hi = max(start, off), min(end, off + spec.nbytes)
        if lo >= hi:
            continue
        src = np.ascontiguousarray(arrays[spec.name]).data.cast("B")
        out[lo - start:hi - start] = src[lo - off:hi - off]
    return out


class StreamedBlock:
    """The data block of one streamed frame (tensors `specs`), sent in order.

    `sent` bytes have been handed out; each method hands out the next ones, up
    to `upto`, and refuses to go past the end or back. Several connections may
    receive the same block (the server streams one model to every puller of
    an update): they all get the same bytes in the same order."""

    def __init__(self, specs: Sequence[TensorSpec]) -> None:
        self.specs = tuple(specs)
        offsets, self.total = layout(self.specs)
        self.offsets = tuple(offsets)
        self.sent = 0

    @property
    def done(self) -> bool:
        return self.sent >= self.total

    def final_prefix(self, computed: Mapping[str, int]) -> int:
        """How far the block is final, given the elements computed per tensor."""
        return final_prefix(self.specs, self.offsets, self.total, computed)

    def _take(self, upto: int) -> tuple[int, int]:
        if not self.sent <= upto <= self.total:
            raise ValueError(f"a streamed block goes forward within its {self.total} bytes: "
                             f"{self.sent} sent, asked up to {upto}")
        start, self.sent = self.sent, upto
        return start, upto

    def from_arrays(self, arrays: Mapping[str, np.ndarray], upto: int) -> bytearray:
        """The next bytes up to `upto`, copied from per-tensor `arrays` (with
        the zero padding between tensors): the arrays may change afterwards."""
        start, end = self._take(upto)
        return block_bytes(arrays, self.specs, self.offsets, start, end)

    def replay(self, arrays: Mapping[str, np.ndarray]) -> bytearray:
        """The bytes sent so far, again (for a receiver that joins late), from
        the arrays they were taken from."""
        return block_bytes(arrays, self.specs, self.offsets, 0, self.sent)

    def from_block(self, block: memoryview, upto: int) -> memoryview:
        """The next bytes up to `upto` of a contiguous data block laid out as
        on the wire (not copied)."""
        if len(block) != self.total:
            raise ValueError(f"a {len(block)}-byte block for a {self.total}-byte frame")
        start, end = self._take(upto)
        return block[start:end]

    def void(self) -> bytes:
        """Zeros for the rest of the block: what was streamed does not hold
        (the frame still ends whole, so the connection stays in step)."""
        start, end = self._take(self.total)
        return bytes(end - start)
