from typing import Any

import numpy as np
from numpy.typing import NDArray

_IndexArray = NDArray[np.intp]

def sendv(fd: int, head: bytes, arrays: list[Any], index: _IndexArray, starts: _IndexArray,
          lengths: _IndexArray, offsets: _IndexArray, total: int) -> int:
    """Write head and the planned block to a non-blocking socket; bytes written."""

def rest(arrays: list[Any], index: _IndexArray, starts: _IndexArray, lengths: _IndexArray,
         offsets: _IndexArray, total: int, skip: int) -> memoryview:
    """Bytes skip.. of the planned block, copied."""
