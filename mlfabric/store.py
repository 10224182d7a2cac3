"""The parameter server's model state and update rule, without I/O.

`ParameterStore` holds the named tensors, the previous weights (for
momentum) and the version. It decides whether a push is applied and applies
it with the Cython kernels:

    w_{t+1} = w_t + u + gamma * (w_t - w_{t-1})

Every applied update advances the version by one. The delay of an update is
the version it is applied to minus the version it was computed on.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from . import _core
from .errors import ConfigError, InvalidUpdate
from .outcome import PushOutcome
from .protocol import TensorSpec, layout

MODEL_DTYPE = np.dtype(np.float32)


class ParameterStore:
    """Named float32 tensors, their previous values and a version counter."""

    def __init__(
        self,
        tensors: Mapping[str, np.ndarray],
        *,
        momentum: float = 0.0,
        tau_max: int | None = None,
        allow_nonfinite: bool = False,
        version: int = 0,
    ) -> None:
        if not tensors:
            raise ConfigError("the model has no tensors: give at least one named float32 array")
        if not 0.0 <= momentum < 1.0:
            raise ConfigError(f"momentum must be in [0, 1), got {momentum}")
        if tau_max is not None and tau_max < 0:
            raise ConfigError(f"tau_max must be >= 0 (or None for no bound), got {tau_max}")
        self.weights: dict[str, np.ndarray] = {}
        for name, value in tensors.items():
            arr = np.asarray(value)
            if arr.dtype != MODEL_DTYPE:
                raise ConfigError(
                    f"tensor {name!r} is {arr.dtype}; mlfabric serves float32 tensors: "
                    f"convert with arr.astype(np.float32)"
                )
            if not np.all(np.isfinite(arr)):
                raise ConfigError(f"tensor {name!r} holds NaN or Inf values")
            self.weights[name] = np.array(arr, dtype=MODEL_DTYPE, order="C", copy=True)
        # w_{t-1}: equal to w_0 at the start, so the first update has no momentum term.
        self.previous = {n: w.copy() for n, w in self.weights.items()}
        self.momentum = float(momentum)
        self.tau_max = tau_max
        self.allow_nonfinite = allow_nonfinite
        self.version = version
        self.specs = tuple(
            TensorSpec(n, MODEL_DTYPE.newbyteorder("<"), w.shape) for n, w in self.weights.items()
        )
        self.nbytes = layout(self.specs)[1]

    def validate(self, base_version: int, update: Mapping[str, np.ndarray]) -> None:
        """Raise InvalidUpdate if `update` cannot be applied to this model."""
        unknown = [n for n in update if n not in self.weights]
        if unknown:
            raise InvalidUpdate(
                f"unknown tensor {unknown[0]!r}; the model's tensors are "
                f"{sorted(self.weights)}",
                reason="unknown_tensor",
            )
        missing = [n for n in self.weights if n not in update]
        if missing:
            raise InvalidUpdate(
                f"update lacks tensor {missing[0]!r}: push a value for every tensor of the "
                f"model (zeros where nothing changes)",
                reason="unknown_tensor",
            )
        for name, u in update.items():
            w = self.weights[name]
            if u.dtype != MODEL_DTYPE:
                raise InvalidUpdate(
                    f"tensor {name!r} is {u.dtype}, the model's is float32: push "
                    f"arr.astype(np.float32)",
                    reason="bad_dtype",
                )
            if u.shape != w.shape:
                raise InvalidUpdate(
                    f"tensor {name!r} has shape {u.shape}, the model's is {w.shape}",
                    reason="bad_shape",
                )
        if base_version > self.version:
            raise InvalidUpdate(
                f"base_version {base_version} is ahead of the server's version "
                f"{self.version}: pass the version that pull() returned",
                reason="future_version",
            )
        if not self.allow_nonfinite:
            for name, u in update.items():
                if not _core.all_finite(np.ascontiguousarray(u)):
                    raise InvalidUpdate(
                        f"tensor {name!r} holds NaN or Inf; the update was not applied "
                        f"(check the learning rate and loss for divergence)",
                        reason="nonfinite",
                    )

    def apply(self, base_version: int, update: Mapping[str, np.ndarray]) -> PushOutcome:
        """Validate, check staleness, and apply one update.

        Raises InvalidUpdate (model untouched) for a malformed update; returns
        an outcome with applied=False for one that is too stale.
        """
        self.validate(base_version, update)
        delay = self.version - base_version
        if self.tau_max is not None and delay > self.tau_max:
            return PushOutcome(
                applied=False,
                version=self.version,
                delay=delay,
                reason=f"stale: delay {delay} exceeds tau_max {self.tau_max}; pull a "
                f"fresher model",
                base_version=base_version,
            )
        gamma = self.momentum
        for name, w in self.weights.items():
            u = np.ascontiguousarray(update[name])
            if gamma:
                _core.momentum_apply(w, self.previous[name], u, gamma)
            else:
                _core.scaled_add(w, u, 1.0)
        self.version += 1
        return PushOutcome(
            applied=True, version=self.version, delay=delay, base_version=base_version
        )

    def snapshot(self) -> tuple[int, dict[str, np.ndarray]]:
        """A consistent copy of the model at the current version."""
        return self.version, {n: w.copy() for n, w in self.weights.items()}
