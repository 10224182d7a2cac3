"""PyTorch training loops through mlfabric: ``pip install 'mlfabric[torch]'``.

    import mlfabric, mlfabric.torch

    mlfabric.torch.save_init(model, "init.npz")        # once, for `mlfabric server --init`
    ps = mlfabric.connect("server:7070", job="digits", token_file="job.token")
    opt = mlfabric.torch.DistributedOptimizer(model, ps, lr=0.1)   # pulls the server's model
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()          # push the update; pull the newest model into `model`

The server's model is the module's ``named_parameters()`` as float32 arrays
under the same names (buffers such as BatchNorm's running statistics stay
local, or with ``sync_buffers=True`` go through the server too). ``step()``
pushes the update computed from the weights the module holds, tagged with
the version those weights were pulled at, and every ``pull_every`` steps
copies the newest model into the parameters in place
(``param.data.copy_``). CPU float32 parameters and updates are shared with
numpy without copies: an update is written into a buffer the push sends as
it is.

The update is ``-lr * grad`` (``lr=``), or, with ``local_optimizer=`` (any
``torch.optim.Optimizer`` over the module's parameters), the change that
optimizer's ``step()`` made: ``new_param - old_param``.

``DistributedOptimizer`` is itself a ``torch.optim.Optimizer`` (its param
groups and state are the local optimizer's), so LR schedulers, AMP's
``GradScaler`` and ``state_dict()`` checkpoints work as with any other; it
also takes Horovod's order, ``DistributedOptimizer(optimizer, ps,
named_parameters=model.named_parameters())``.

Outcomes: an update the server refuses (stale beyond ``tau_max``, or dropped
by the controller) is simply not applied; it is counted in ``dropped`` and
``dropped_reasons`` and ``step()`` goes on. A push that raises (a malformed
or non-finite update: ``InvalidUpdate``; the connection closing:
``ConnectionLost``; no answer within ``timeout``: ``TimeoutError``) makes
``step()`` raise it, after putting the parameters back to what they were
before the step (a local optimizer's internal state, such as momentum
buffers, keeps the step).
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import numpy as np

try:
    import torch
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        f"mlfabric.torch needs PyTorch ({exc}): pip install 'mlfabric[torch]'"
    ) from None

from .client.core import takes_including
from .client.outcome import PushOutcome
from .errors import ConfigError

__all__ = ["DistributedOptimizer", "Stats", "model_arrays", "save_init"]


def _named_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    params = list(module.named_parameters())
    if not params:
        raise ConfigError(f"{type(module).__name__} has no parameters to train through mlfabric")
    return params


def _float_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers that training changes and that can be averaged: BatchNorm's
    running mean and variance, not its integer batch count."""
    return [(name, b) for name, b in module.named_buffers() if b.is_floating_point()]


def model_arrays(module: torch.nn.Module, buffers: bool = False) -> dict[str, np.ndarray]:
    """The module's parameters (with `buffers`, and its floating-point
    buffers) as named float32 numpy arrays (copies), the layout the server's
    model must have."""
    tensors = _named_parameters(module) + (_float_buffers(module) if buffers else [])
    return {
        name: np.ascontiguousarray(p.detach().to("cpu", torch.float32).numpy(), dtype=np.float32)
        .copy()
        for name, p in tensors
    }


def save_init(module: torch.nn.Module, path: str | os.PathLike[str], buffers: bool = False
              ) -> None:
    """Write the module's parameters (with `buffers`, and its floating-point
    buffers, for ``DistributedOptimizer(..., sync_buffers=True)``) to `path`
    as an .npz of float32 arrays, for ``mlfabric server --init``. The file is
    written atomically."""
    arrays = model_arrays(module, buffers)
    target = os.fspath(path)
    tmp = f"{target}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@dataclass(frozen=True)
class Stats:
    """What happened to this worker's pushes so far."""

    steps: int  # step() calls that pushed
    applied: int  # updates the server applied
    dropped: int  # updates refused as stale or dropped by the controller
    dropped_reasons: dict[str, int]  # by kind: "stale", "dropped by the controller"
    last_delay: int | None  # staleness of the newest applied update, in versions
    delays: dict[int, int]  # histogram of applied updates' delays
    version: int  # version of the model the module's parameters were pulled at
    in_flight: int  # pushes whose outcome is not collected yet


class DistributedOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that trains `module` through a parameter server.

    module: the model, whose ``named_parameters()`` name the server's tensors.
        Or, in Horovod's order, the local optimizer first:
        ``DistributedOptimizer(optimizer, ps,
        named_parameters=model.named_parameters())``.
    ps: an ``mlfabric.connect(...)`` client whose server holds this module's
        parameters (``save_init`` writes the file to start it with).
    lr: plain SGD, the update is ``-lr * grad`` (a parameter without a
        gradient contributes zeros); ``lr`` is the param groups' learning
        rate, so LR schedulers change it.
    local_optimizer: any torch optimizer over the module's parameters; the
        update is the change its ``step()`` makes. Give exactly one of the two.
    sync_buffers: also train the module's floating-point buffers (BatchNorm's
        running mean and variance) through the server: each push carries the
        change this worker's forward passes made to them since its last pull,
        and each pull brings back the job's, so every worker normalises with
        statistics of every worker's data (the server's model must hold them:
        ``save_init(model, path, buffers=True)``). DDP instead broadcasts rank
        0's buffers; a parameter server has no rank 0, and a sum of every
        worker's running-average steps settles where their batches' mean is.
        Default False: buffers stay local.
        Its ``param_groups`` and ``state`` are this optimizer's: schedulers,
        ``GradScaler`` and ``state_dict()`` / ``load_state_dict()`` act on it.
    pull_every: pull the newest model into the module every N steps (1: after
        every push); 0: only when ``pull()`` is called. Between pulls the
        module keeps its own updates, so training goes on locally. With
        ``max_in_flight=1`` the pull goes out with the push
        (``ps.pull(including=future)``): through a controller, the server
        streams the model with this step's update in it while it arrives.
    max_in_flight: how many pushes may await their outcome; 1 (default) means
        ``step()`` returns once its push's outcome is known.
    timeout: seconds to wait for a push's outcome or a pull's answer.

    Construction pulls the server's model into the module, so every worker
    starts from the same weights.
    """

    def __init__(
        self,
        module: torch.nn.Module | torch.optim.Optimizer,
        ps: Any = None,
        *,
        lr: float | None = None,
        local_optimizer: torch.optim.Optimizer | None = None,
        named_parameters: Any = None,
        sync_buffers: bool = False,
        pull_every: int = 1,
        max_in_flight: int = 1,
        timeout: float | None = 60.0,
    ) -> None:
        named, module, local_optimizer = _what_to_train(module, local_optimizer,
                                                        named_parameters)
        if ps is None:
            raise ConfigError("give DistributedOptimizer the job's client: "
                              "ps=mlfabric.connect(...) (or mlfabric.config.connect())")
        if (lr is None) == (local_optimizer is None):
            raise ConfigError(
                "give DistributedOptimizer exactly one of lr=... (plain SGD) or "
                "local_optimizer=torch.optim.X(model.parameters(), ...)"
            )
        if lr is not None and (isinstance(lr, bool) or not isinstance(lr, int | float)
                               or not lr > 0):
            raise ConfigError(f"lr must be a positive number, got {lr!r}")
        if isinstance(pull_every, bool) or not isinstance(pull_every, int) or pull_every < 0:
            raise ConfigError(f"pull_every must be an integer >= 0, got {pull_every!r}")
        if (isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int)
                or max_in_flight < 1):
            raise ConfigError(f"max_in_flight must be an integer >= 1, got {max_in_flight!r}")
        self._params = dict(named)
        # sync_buffers: the module's floating-point buffers (BatchNorm's running
        # statistics) go through the server too: each step pushes the change
        # this worker's forward passes made to them, and a pull brings back
        # the job's. Without it they stay local, as before.
        if sync_buffers and module is None:
            raise ConfigError("sync_buffers needs the module (DistributedOptimizer(model, ps, "
                              "..., sync_buffers=True)): Horovod's order names parameters only")
        self._buffers = dict(_float_buffers(module)) if sync_buffers and module is not None else {}
        if sync_buffers and not self._buffers:
            raise ConfigError(f"sync_buffers=True, but {type(module).__name__} has no "
                              f"floating-point buffers to synchronise")
        if local_optimizer is None:
            assert lr is not None
            super().__init__(list(self._params.values()), {"lr": float(lr)})
        else:
            # The local optimizer's groups and state are this optimizer's (the
            # same objects): a scheduler's lr, GradScaler's unscaling and a
            # loaded state_dict reach the optimizer that steps.
            super().__init__(list(self._params.values()), dict(local_optimizer.defaults))
            self._share(local_optimizer)
        self.module = module
        self.ps = ps
        self.local_optimizer = local_optimizer
        self.pull_every = pull_every
        self.max_in_flight = max_in_flight
        self.timeout = timeout
        self._pull_including = takes_including(ps.pull)
        if local_optimizer is not None:
            ours = {id(p) for p in self._params.values()}
            for group in local_optimizer.param_groups:
                for p in group["params"]:
                    if id(p) not in ours:
                        raise ConfigError(
                            "local_optimizer holds a tensor that is not a parameter of the "
                            "module; build it from model.parameters()"
                        )
        self._check_layout()
        # One reusable float32 buffer per parameter for the update: a numpy
        # array and a torch tensor sharing its memory. push() has written it
        # to the socket when it returns, so the next step may overwrite it.
        self._update_np = {n: np.empty(tuple(p.shape), np.float32)
                           for n, p in {**self._params, **self._buffers}.items()}
        self._update = {n: torch.from_numpy(a) for n, a in self._update_np.items()}
        self._base: dict[str, torch.Tensor] = {}  # the weights the next update starts from
        self._buffer_base: dict[str, torch.Tensor] = {}  # the buffers as last pulled or pushed
        self._in_flight: deque[Future[PushOutcome]] = deque()
        self.version = -1
        self.steps = 0
        self.applied = 0
        self.dropped = 0
        self.dropped_reasons: Counter[str] = Counter()
        self.delays: Counter[int] = Counter()
        self.last_outcome: PushOutcome | None = None
        self.last_delay: int | None = None
        self.pull()

    # -- the training-loop API ------------------------------------------------------------

    @property
    def lr(self) -> float | None:
        """Plain SGD's learning rate (the first param group's, which a
        scheduler sets); None with a local optimizer."""
        return None if self.local_optimizer is not None else float(self.param_groups[0]["lr"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.local_optimizer is not None:
            self.local_optimizer.zero_grad(set_to_none=set_to_none)
        else:
            super().zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The local optimizer's state dict (plain SGD: its param groups),
        as ``torch.optim.Optimizer.state_dict`` gives it."""
        if self.local_optimizer is not None:
            return self.local_optimizer.state_dict()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.local_optimizer is not None:
            self.local_optimizer.load_state_dict(state_dict)
            self._share(self.local_optimizer)  # loading replaced its groups and state
        else:
            super().load_state_dict(state_dict)

    def _share(self, local: torch.optim.Optimizer) -> None:
        self.param_groups = local.param_groups
        self.state = local.state
        self.defaults = local.defaults

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> PushOutcome | None:
        """Compute the local update, push it with the version of the weights
        it was computed on, and pull the newest model when the cadence says.

        `closure` (re-evaluates the loss, e.g. for LBFGS) is passed to the
        local optimizer, or called with gradients enabled before the SGD update.
        Returns this step's outcome when it is known (always with
        max_in_flight=1), else None."""
        if self.local_optimizer is not None:
            self.local_optimizer.step(closure)
            for name, p in self._params.items():
                _difference(self._update[name], p.detach(), self._base[name])
        else:
            if closure is not None:
                with torch.enable_grad():
                    closure()
            lr_of = {id(p): float(g["lr"]) for g in self.param_groups for p in g["params"]}
            for name, p in self._params.items():
                if p.grad is None:
                    self._update[name].zero_()
                else:
                    _scaled(self._update[name], p.grad.detach(), -lr_of[id(p)])
        for name, b in self._buffers.items():  # what this worker's forward passes changed
            _difference(self._update[name], b.detach(), self._buffer_base[name])
        pull_now = bool(self.pull_every) and (self.steps + 1) % self.pull_every == 0
        pulled = None
        try:
            future = self.ps.push(self._update_np, base_version=self.version)
            self._in_flight.append(future)
            self.steps += 1
            if pull_now and self.max_in_flight == 1 and self._pull_including:
                # Asked for with the push: the server may stream the model
                # with this update in it while the update still arrives.
                pulled = self._fetch(including=future)
            while len(self._in_flight) >= self.max_in_flight:
                self._collect(self._in_flight.popleft())
        except BaseException:
            self._restore()
            raise
        outcome = self.last_outcome if not self._in_flight else None
        if pulled is not None:
            self._load(*pulled)
        elif pull_now:
            self.pull()
        else:
            self._keep_local()
        return outcome

    @torch.no_grad()
    def pull(self) -> int:
        """Copy the server's newest model into the module's parameters in
        place; returns its version (also ``self.version``)."""
        return self._load(*self._fetch())

    def _fetch(self, including: Future[PushOutcome] | None = None
               ) -> tuple[int, dict[str, np.ndarray]]:
        try:
            if including is None:
                pulled: tuple[int, dict[str, np.ndarray]] = self.ps.pull(timeout=self.timeout)
            else:
                pulled = self.ps.pull(timeout=self.timeout, including=including)
        except TimeoutError:
            raise TimeoutError(
                f"pull() got no answer from the server within {self.timeout} s "
                f"(DistributedOptimizer timeout=)"
            ) from None
        return pulled

    def _load(self, version: int, arrays: dict[str, np.ndarray]) -> int:
        for name, p in self._params.items():
            pulled = torch.from_numpy(arrays[name])  # shares the array's memory
            p.data.copy_(pulled)
            if self.local_optimizer is not None:
                if p.device.type == "cpu" and p.dtype == torch.float32:
                    self._base[name] = pulled  # exact copy of p: no extra copy needed
                else:
                    self._base[name] = p.detach().clone()
        for name, b in self._buffers.items():
            pulled = torch.from_numpy(arrays[name])
            b.copy_(pulled)
            self._buffer_base[name] = pulled if _direct(b) else b.detach().clone()
        self.version = version
        return version

    def flush(self) -> None:
        """Wait for the outcomes of every push still in flight."""
        while self._in_flight:
            self._collect(self._in_flight.popleft())

    def stats(self) -> Stats:
        return Stats(
            steps=self.steps, applied=self.applied, dropped=self.dropped,
            dropped_reasons=dict(self.dropped_reasons), last_delay=self.last_delay,
            delays=dict(sorted(self.delays.items())), version=self.version,
            in_flight=len(self._in_flight),
        )

    def __repr__(self) -> str:
        how = f"lr={self.lr}" if self.lr is not None else type(self.local_optimizer).__name__
        return (f"<mlfabric.torch.DistributedOptimizer {how} version={self.version} "
                f"applied={self.applied} dropped={self.dropped}>")

    # -- internals --------------------------------------------------------------

    def _check_layout(self) -> None:
        specs = {spec.name: spec for spec in self.ps.specs}
        ours = {name: tuple(p.shape) for name, p in {**self._params, **self._buffers}.items()}
        missing = sorted(set(ours) - set(specs))
        extra = sorted(set(specs) - set(ours))
        fix = ("start the server with --init written by mlfabric.torch.save_init(model, path"
               + (", buffers=True)" if self._buffers else ")"))
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"the server has no tensor {', '.join(map(repr, missing[:3]))}")
            if extra:
                what = "parameter or synchronised buffer" if self._buffers else "parameter"
                parts.append(f"the module has no {what} {', '.join(map(repr, extra[:3]))}")
            raise ConfigError(f"the server's model does not match the module: "
                              f"{'; '.join(parts)}; {fix}")
        for name, shape in ours.items():
            spec = specs[name]
            if tuple(spec.shape) != shape:
                raise ConfigError(
                    f"the server's tensor {name!r} has shape {tuple(spec.shape)}, the module's "
                    f"parameter {shape}; {fix}"
                )

    def _collect(self, future: Future[PushOutcome]) -> None:
        try:
            outcome = future.result(self.timeout)
        except FutureTimeout:
            raise TimeoutError(
                f"no outcome for a push within {self.timeout} s (DistributedOptimizer timeout=)"
            ) from None
        self.last_outcome = outcome
        if outcome.applied:
            self.applied += 1
            self.last_delay = outcome.delay
            if outcome.delay is not None:
                self.delays[outcome.delay] += 1
        else:
            self.dropped += 1
            # Keyed by the reason's kind: "stale", "dropped by the controller".
            self.dropped_reasons[(outcome.reason or "unknown").split(":", 1)[0]] += 1

    def _restore(self) -> None:
        """Undo this step's local change to the parameters."""
        if self.local_optimizer is not None:
            for name, p in self._params.items():
                p.data.copy_(self._base[name])

    def _keep_local(self) -> None:
        """No pull this step: the module keeps training on its own weights."""
        if self.local_optimizer is not None:
            for name, p in self._params.items():
                base = self._base[name]
                if base.shape == p.shape and base.dtype == p.dtype and base.device == p.device:
                    base.copy_(p.detach())
                else:
                    self._base[name] = p.detach().clone()
        else:
            for name, p in self._params.items():
                p.data.add_(self._update[name].to(p.device, p.dtype))
        for name, b in self._buffers.items():  # pushed: the next push starts from here
            self._buffer_base[name] = b.detach().clone()


def _what_to_train(first: Any, local_optimizer: torch.optim.Optimizer | None,
                   named_parameters: Any
                   ) -> tuple[list[tuple[str, torch.nn.Parameter]], torch.nn.Module | None,
                              torch.optim.Optimizer | None]:
    """(named parameters, module, local optimizer) from mlfabric's argument
    order, DistributedOptimizer(module, ps, ...), or Horovod's,
    DistributedOptimizer(optimizer, ps, named_parameters=...)."""
    if isinstance(first, torch.nn.Module):
        if named_parameters is not None:
            raise ConfigError("named_parameters= goes with an optimizer first (Horovod's "
                              "order); with the module first, its own names are used")
        return _named_parameters(first), first, local_optimizer
    if isinstance(first, torch.optim.Optimizer):
        if local_optimizer is not None:
            raise ConfigError("the optimizer is given twice: first and as local_optimizer=")
        if named_parameters is None:
            raise ConfigError(
                "with an optimizer first (Horovod's order), give "
                "named_parameters=model.named_parameters(): they name the server's tensors")
        named = list(named_parameters)
        if not named or not all(isinstance(n, str) and isinstance(p, torch.nn.Parameter)
                                for n, p in named):
            raise ConfigError("named_parameters must be (name, parameter) pairs, as "
                              "model.named_parameters() gives them")
        return named, None, first
    raise ConfigError(
        f"DistributedOptimizer takes the model first (DistributedOptimizer(model, ps, "
        f"lr=0.1)) or, in Horovod's order, an optimizer (DistributedOptimizer(optimizer, ps, "
        f"named_parameters=model.named_parameters())); got {type(first).__name__}")


def _direct(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32


def _difference(out: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> None:
    """out <- new - old, straight into the float32 CPU buffer when possible."""
    if _direct(new) and _direct(old):
        torch.sub(new, old, out=out)
    else:
        out.copy_(new - old)


def _scaled(out: torch.Tensor, grad: torch.Tensor, factor: float) -> None:
    """out <- factor * grad, computed in float32 like np.float32(factor) * grad."""
    if _direct(grad):
        torch.mul(grad, factor, out=out)
    else:
        out.copy_(grad.to(torch.float32) * factor)
