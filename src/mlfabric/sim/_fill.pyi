"""Types of the simulator's progressive filling in mlfabric/sim/_fill.pyx."""

import numpy as np
from numpy.typing import NDArray

def max_min_rates(
    links: NDArray[np.intp],
    capacity: NDArray[np.float64],
    cap: NDArray[np.float64] | None = None,
) -> NDArray[np.float64]: ...
