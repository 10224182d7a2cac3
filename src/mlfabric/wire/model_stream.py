"""Which bytes of a MODEL frame's data block can be sent before the update
that makes the model has fully arrived, and those bytes; no I/O.

A pull for an update (`Pull(uid=..., wait=...)`) is answered with the model
that includes it. While that update is staged (applied piece by piece as its
bytes arrive, `store.StagedApply`), the next weights of the elements already
computed are final if the staging commits, so they can go out at once: the
worker receives the new model nearly as soon as the server has the update.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .protocol import TensorSpec


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
