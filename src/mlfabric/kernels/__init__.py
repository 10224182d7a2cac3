"""The numeric kernels (Cython, `_core.pyx`): fused, bit-exact loops over
float32/float64 arrays that the server, the replica, the aggregator and the
client call on whole models. Every kernel rounds exactly as the numpy
expression in its docstring (see `_core.pxd`)."""

import math
from collections.abc import Iterable

import numpy as np

from ._core import (
    NOGIL_MIN_ELEMENTS,
    all_finite,
    check_gather,
    check_laid_out,
    copy_ranges,
    gather,
    l2_norm,
    l2_norm_diff,
    momentum_apply,
    momentum_into,
    scaled_add,
    segments_l2_norm,
    segments_momentum_into,
    segments_stage,
    sum_into,
)

__all__ = [
    "NOGIL_MIN_ELEMENTS",
    "all_finite",
    "check_gather",
    "check_laid_out",
    "copy_ranges",
    "gather",
    "l2_norm",
    "l2_norm_diff",
    "momentum_apply",
    "momentum_into",
    "norm_of",
    "scaled_add",
    "segments_l2_norm",
    "segments_momentum_into",
    "segments_stage",
    "sum_into",
]


def norm_of(tensors: Iterable[np.ndarray]) -> float:
    """The norm of an update (or a model) of several tensors: sqrt of the
    sum, in order, of n * n for each tensor's `l2_norm` n, as
    `segments_l2_norm` computes it over a flat frame. The one definition
    workers, servers and the significance filter share, so their norms agree
    bit for bit: a product, not `n ** 2` (glibc's pow(x, 2) is one bit off
    x * x for about 1 x in 1,200)."""
    total = 0.0
    for t in tensors:
        n = l2_norm(t)
        total += n * n
    return math.sqrt(total)
