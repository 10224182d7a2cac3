"""Types of the scheduling kernel in mlfabric/scheduling/_stf.pyx."""

import numpy as np
from numpy.typing import NDArray

def schedule_stf(
    ready: float,
    size: NDArray[np.float64],
    up: NDArray[np.intp],
    down: NDArray[np.intp],
    pair: NDArray[np.intp],
    cap: NDArray[np.float64],
    dl: NDArray[np.intp],
    has_deadlines: bool,
    idle_factor: float,
    seg_lo: NDArray[np.intp],
    seg_t: NDArray[np.float64],
    seg_r: NDArray[np.float64],
    seg_f: NDArray[np.float64],
    start: NDArray[np.float64],
    rate: NDArray[np.float64],
    end: NDArray[np.float64],
    position: NDArray[np.intp],
    send_order: NDArray[np.intp],
    drop_order: NDArray[np.intp],
    reason: NDArray[np.int8],
    idle: NDArray[np.float64],
    displaced: NDArray[np.float64],
    plan_ahead: int = 0,
    horizon: float = ...,
) -> tuple[int, int, float]:
    """The "mlfabric" scheduling policy on arrays (mlfabric.schedule builds them):
    fills the per-update outputs and returns (number of sends, number of drops,
    the earliest start of a row left out by plan_ahead: inf if none)."""

def running_segments(
    now: float,
    capacity: NDArray[np.float64],
    ids: NDArray[np.int64],
    up: NDArray[np.intp],
    down: NDArray[np.intp],
    end: NDArray[np.float64],
    rate: NDArray[np.float64],
) -> tuple[NDArray[np.intp], NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """Every link's segments (seg_lo, seg_t, seg_r, seg_f) from the transfers
    running on them, as mlfabric.scheduling.schedule's _Link.load_running
    loads them."""

def stable_order(keys: tuple[NDArray[np.generic], ...]) -> NDArray[np.intp]:
    """np.lexsort((np.arange(n), *keys)): the indices by `keys`, the last the
    primary, ties by index; without a sort where the keys already say it."""
