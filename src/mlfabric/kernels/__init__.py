"""The numeric kernels (Cython, `_core.pyx`): fused, bit-exact loops over
float32/float64 arrays that the server, the replica, the aggregator and the
client call on whole models. Every kernel rounds exactly as the numpy
expression in its docstring (see `_core.pxd`)."""

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
    "scaled_add",
    "segments_l2_norm",
    "segments_momentum_into",
    "segments_stage",
    "sum_into",
]
