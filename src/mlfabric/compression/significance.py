"""The significance filter (issue 35, after Gaia), without I/O.

Gaia (Hsieh et al., NSDI'17) sends an update to a parameter only once it is
significant: once the updates accumulated for it reach a threshold relative
to the parameter's value. Until then they stay with the worker, and nothing
is lost: they go with a later push.

mlfabric decides per push, not per element: a push whose pending update
(the update plus the error-feedback residual) has a relative magnitude

    ||update + residual||_2 / ||model||_2

below the threshold is held: all of it is folded into the residual and
nothing goes on the wire. A push at or above it goes, with everything held
before it. Two reasons for the coarser grain:
- sending only the significant elements is what `topk` already does, and
  composes with this filter (`compression="topk:0.1"`, `significance=0.01`);
- the controller plans a transfer by a size it knows before the update is
  encoded, which an element-wise filter's output is not.

`model` is the model as this worker last pulled it: the filter holds nothing
before the first pull (it has nothing to measure against).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from ..errors import ConfigError
from ..kernels import norm_of


def check_threshold(threshold: float) -> float:
    """`threshold` as a float in (0, 1), or ConfigError saying what fits."""
    try:
        t = float(threshold)
    except (TypeError, ValueError):
        t = math.nan
    if not 0.0 < t < 1.0:
        raise ConfigError(f"significance {threshold!r}: the threshold is the smallest "
                          f"relative magnitude ||update|| / ||model|| that goes, in (0, 1); "
                          f"Gaia used 0.01 to 0.05")
    return t


class Significance:
    """Whether a pending update is significant enough to send."""

    def __init__(self, threshold: float) -> None:
        self.threshold = check_threshold(threshold)
        self.model_norm: float | None = None  # of the last model pulled

    def observe(self, model: Mapping[str, np.ndarray]) -> None:
        """The model as just pulled: what the next pushes are measured against."""
        self.model_norm = norm_of(model.values())

    def relative(self, pending_norm: float) -> float | None:
        """||pending|| / ||model|| (None: no model pulled yet, or a zero one:
        everything is significant against it)."""
        if not self.model_norm:
            return None
        return pending_norm / self.model_norm

    def holds(self, pending_norm: float) -> float | None:
        """The relative magnitude if the pending update is to be held (below
        the threshold), else None (it goes)."""
        rel = self.relative(pending_norm)
        return rel if rel is not None and rel < self.threshold else None

    def reason(self, relative: float) -> str:
        """The outcome's reason for a held push."""
        return (f"held: relative magnitude {relative:.3g} is below the significance "
                f"threshold {self.threshold:g}; kept in the residual for a later push")
