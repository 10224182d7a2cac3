"""mlfabric: network-aware communication for distributed ML training."""

from __future__ import annotations

__version__ = "0.1.0"
