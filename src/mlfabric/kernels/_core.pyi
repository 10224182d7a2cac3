"""Types of the Cython kernels in src/mlfabric/kernels/_core.pyx (see its docstring).

Every array argument is a C-contiguous numpy array of dtype float32 or
float64, all of one dtype and one shape; outputs must be writable. The dtype
check is at run time (TypeError), since NDArray cannot say "same dtype for
all arguments".
"""

from collections.abc import Iterable
from typing import Any

import numpy as np
from numpy.typing import NDArray

_FloatArray = NDArray[np.floating[Any]]
_IndexArray = NDArray[np.intp]

# Loops over at least this many elements release the GIL.
NOGIL_MIN_ELEMENTS: int

def momentum_apply(w: _FloatArray, prev: _FloatArray, u: _FloatArray, gamma: float) -> None:
    """In place: new = (w + u) + g*(w - prev); prev[...] = old w; w[...] = new."""

def momentum_into(
    out: _FloatArray, w: _FloatArray, prev: _FloatArray | None, u: _FloatArray, gamma: float
) -> bool:
    """out[...] = (w + u) + g*(w - prev), or w + u if prev is None; w, prev and
    u are only read. True iff every element written is finite."""

def sum_into(out: _FloatArray, arrays: Iterable[_FloatArray], accumulate: bool = False) -> None:
    """out[...] = a0 + a1 + ... left to right (out + a0 + ... if accumulate)."""

def scaled_add(y: _FloatArray, x: _FloatArray, alpha: float) -> None:
    """y[...] = y + a*x with a = alpha cast to the array dtype."""

def l2_norm(x: _FloatArray) -> float:
    """sqrt(sum(x_i**2)), squared and summed in double."""

def l2_norm_diff(a: _FloatArray, b: _FloatArray) -> float:
    """||a - b||_2 with the difference taken in double."""

def all_finite(x: _FloatArray) -> bool:
    """True iff x holds no NaN, +Inf or -Inf."""

def segments_l2_norm(x: _FloatArray, starts: _IndexArray, counts: _IndexArray
                     ) -> tuple[float, int]:
    """(sqrt(sum of l2_norm(segment) ** 2), first non-finite segment or -1)."""

def segments_momentum_into(out: _FloatArray, w: _FloatArray, prev: _FloatArray | None,
                           u: _FloatArray, gamma: float, starts: _IndexArray,
                           counts: _IndexArray) -> int:
    """momentum_into on every segment; -1, or the first segment written non-finite."""

def segments_stage(out: _FloatArray, w: _FloatArray, prev: _FloatArray | None, u: _FloatArray,
                   gamma: float, starts: _IndexArray, counts: _IndexArray, done: _IndexArray,
                   squares: NDArray[np.float64], received: int, check: bool) -> int:
    """StagedApply.feed over segments; -1, or the first segment that voids the staging."""

def gather(out: NDArray[np.uint8], arrays: Iterable[Any], offsets: Iterable[int]) -> None:
    """Copy each C-contiguous array's bytes into out at its offset."""

def check_gather(update: Any, names: list[str], shapes: list[tuple[int, ...]],
                 offsets: list[int], out: NDArray[np.uint8]) -> bool:
    """Check a dict of float32 arrays against names/shapes and gather it into out."""

def check_laid_out(update: Any, names: list[str], shapes: list[tuple[int, ...]]
                   ) -> list[NDArray[np.float32]] | None:
    """check_gather's check without the copy: the arrays in order, or None."""

def copy_ranges(dst: NDArray[np.uint8], dst_offsets: _IndexArray, src: NDArray[np.uint8],
                src_offsets: _IndexArray, lengths: _IndexArray) -> None:
    """dst[dst_offsets[k]:+lengths[k]] = src[src_offsets[k]:+lengths[k]]."""
