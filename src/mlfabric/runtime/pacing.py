"""A TCP socket's sending rate, capped by the kernel (Linux's
SO_MAX_PACING_RATE).

The controller paces a transfer it lets go beside one that must land first
(`scheduling.observed.pace`): the worker's socket then sends at most that
many bytes a second, whatever room TCP finds. Linux paces TCP itself since
4.13 (with the fq qdisc, fq does it), spreading packets over time rather
than sending a window at once. The rate counts what goes on the wire: data
with its TCP and IP headers.
"""

from __future__ import annotations

import socket
import struct
import sys
from typing import Any

# Not in Python's socket module; Linux's value on every architecture.
SO_MAX_PACING_RATE: int | None = getattr(socket, "SO_MAX_PACING_RATE",
                                         47 if sys.platform == "linux" else None)
UNPACED = 2**64 - 1  # the option's "no cap"
_U64 = struct.Struct("=Q")


def set_pace(sock: Any, rate: float | None) -> bool:
    """Cap what `sock` sends at `rate` bytes/s (None: no cap). False where the
    platform cannot pace a socket (nothing is changed then)."""
    if SO_MAX_PACING_RATE is None:
        return False
    value = UNPACED if rate is None else max(1, min(int(rate), UNPACED - 1))
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, _U64.pack(value))
    except OSError:
        return False
    return True


def pace_of(sock: Any) -> int | None:
    """The cap `sock` sends under, bytes/s (None: none, or not known here)."""
    if SO_MAX_PACING_RATE is None:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, _U64.size)
    except OSError:
        return None
    value: int = _U64.unpack(raw)[0]
    return None if value == UNPACED else value
