"""Error feedback over a whole update (issue 35), without I/O.

A worker keeps one residual per tensor: what its compressed pushes have not
sent yet. `encode` sends a compressed form of update + residual and keeps
the rest; `fold` puts a whole update into the residuals, for an update the
controller dropped, so that its work goes with the next push instead of
being lost. For every tensor, after any sequence of encodes and folds,

    sum of what was sent (decoded) + residual == sum of the updates given

bit for bit for the casts and the sparsifiers when the sums themselves are
exact in float32 (tests/test_compression.py), to float32 rounding otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from ..errors import ConfigError
from ..kernels import norm_of
from .codecs import Codec, Encoded, parse


class ErrorFeedback:
    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.residual: dict[str, np.ndarray] = {}

    def _residual(self, name: str, x: np.ndarray) -> np.ndarray:
        if x.dtype != np.float32:
            raise ConfigError(f"compression works on float32 tensors; tensor {name!r} is "
                              f"{x.dtype}: cast the model to float32, or push it with "
                              f"compression off")
        r = self.residual.get(name)
        if r is None or r.shape != x.shape:
            r = self.residual[name] = np.zeros(x.shape, np.float32)
        return r

    def encode(self, update: Mapping[str, np.ndarray], codec: Codec | None = None
               ) -> dict[str, Encoded]:
        """Each tensor of `update` plus its residual, compressed (by `codec`
        for this push: the controller's choice; else this one's own); the
        residuals keep what was not sent. The update's arrays are not
        modified."""
        codec = codec or self.codec
        out = {}
        for name, x in update.items():
            r = self._residual(name, x)
            out[name] = codec.encode(np.ascontiguousarray(x), r, key=name)
        return out

    def fold(self, update: Mapping[str, np.ndarray]) -> None:
        """An update that was not sent (dropped): all of it waits in the
        residuals for the next push."""
        for name, x in update.items():
            r = self._residual(name, x)
            r += x

    def pending_norm(self, update: Mapping[str, np.ndarray]) -> float:
        """||update + residual||_2 over every tensor: what a push of `update`
        would carry (the significance filter's measure). Modifies nothing."""
        def pending() -> Iterator[np.ndarray]:
            for name, x in update.items():
                r = self.residual.get(name)
                sum_ = x if r is None or r.shape != x.shape else np.add(x, r, dtype=np.float32)
                yield np.ascontiguousarray(sum_, np.float32)

        return norm_of(pending())

    def norm(self) -> float:
        """||residual||_2 over every tensor: what waits to be sent."""
        return norm_of(self.residual.values())


def measure_encode(codec: Codec, shapes: Sequence[tuple[int, ...]], seed: int = 0) -> float:
    """The seconds `codec` takes to encode an update of tensors of `shapes`
    with error feedback, timed once on random data with a fresh codec of the
    same spec (the worker's own keeps its state: low rank's warm starts).
    What a worker offering compressed forms tells the controller before its
    first push; its pushes then measure the real thing."""
    rng = np.random.default_rng(seed)
    update = {str(i): rng.standard_normal(s, np.float32) for i, s in enumerate(shapes)}
    fresh = ErrorFeedback(parse(codec.spec))
    fresh.fold(update)  # a residual as a push after the first has (and the allocations)
    started = time.perf_counter()
    fresh.encode(update)
    return time.perf_counter() - started
