"""Loopback ports for processes started later (the chaos run, the tests)."""

from __future__ import annotations

import random
import socket

_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback port free now, for a process or endpoint to bind later.

    Not one from bind(("", 0)): the kernel gives those, and the local ports of
    outgoing connections, from its ephemeral range, so a port found that way and
    released can be taken again before it is bound (CI saw a server's bind to
    port 0 take the port reserved for the controller started next, and a
    chaos run's aggregator find its port taken). Below the range only an
    explicit bind can take it, and no port is handed out twice by one process.
    """
    low = _ephemeral_low()
    candidates = [p for p in range(max(1024, low - 10000), low) if p not in _handed_out]
    for port in random.sample(candidates, min(200, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port found below the ephemeral range ({low})")
