"""A small model for the end-to-end demo: an MLP on scikit-learn's bundled digits.

Pure numpy. The only I/O is loading the digits data set that ships inside
scikit-learn (no download); install it with ``pip install 'mlfabric[demo]'``.

Model: 64 inputs -> ``hidden`` tanh units -> 10-way softmax, parameters
``w1`` (64, hidden), ``b1`` (hidden,), ``w2`` (hidden, 10), ``b2`` (10,), all
float32 and C-contiguous.

:func:`train_worker` runs one asynchronous worker against a parameter server:
pull the model, compute a gradient on a minibatch of the worker's shard, push
``{name: -eta * grad}`` tagged with the version it was computed on, and collect
the outcome. :data:`DEFAULTS` holds hyperparameters that reach >= 0.93 held-out
accuracy with 4 workers whose updates are several versions stale.
"""

from __future__ import annotations

import gzip
import importlib.util
import threading
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..client.core import takes_including
from ..errors import ConfigError

__all__ = [
    "DEFAULTS",
    "N_CLASSES",
    "N_FEATURES",
    "PARAM_NAMES",
    "accuracy",
    "init_params",
    "load_digits_split",
    "loss_and_grads",
    "predict",
    "shard",
    "train_worker",
]

N_FEATURES = 64
N_CLASSES = 10
PARAM_NAMES = ("w1", "b1", "w2", "b2")

#: Recommended settings for the demo. The server applies
#: ``w <- w + u + gamma * (w - w_prev)``, so the effective step is about
#: ``eta / (1 - gamma)``; asynchrony already acts like extra momentum, and with
#: updates several versions stale too large an effective step diverges. Checked
#: on a simulated server (tests/test_demo_model.py): 4 workers with delays 3-7
#: reach 0.95-0.96 held-out accuracy in 1,400 updates, and still >= 0.95 with
#: delays up to 16. Larger effective steps are fragile: eta 0.1 with gamma 0.7,
#: or eta 0.2 with gamma 0.5, diverge at delays 3-7, and eta 0.1 with gamma 0.5
#: diverges with 8 workers. With more workers (longer delays), lower ``eta``.
DEFAULTS: dict[str, Any] = {
    "workers": 4,  # asynchronous workers, one shard each
    "steps_per_worker": 350,  # pushes per worker: 4 * 350 = 1,400 updates in total
    "batch_size": 32,  # minibatch size drawn from the worker's shard
    "eta": 0.1,  # learning rate: each push is {name: -eta * grad}
    "gamma": 0.3,  # server momentum
    "tau_max": 8,  # the server rejects updates more than 8 versions stale
    "hidden": 64,  # hidden units
}


def load_digits_split(
    test_fraction: float = 0.25, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return ``(X_train, y_train, X_test, y_test)`` from scikit-learn's digits.

    Features are scaled from 0..16 to [0, 1] float32 with shape (n, 64); labels
    are int64 in 0..9. The split is stratified (each class contributes
    ``round(test_fraction * class_count)`` test samples) and depends only on
    ``seed``; both parts come out in a seeded random order.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test_fraction must be strictly between 0 and 1, got {test_fraction!r}")
    data, target = bundled_digits()
    X = np.ascontiguousarray(np.asarray(data, dtype=np.float32) / np.float32(16.0))
    y = np.asarray(target, dtype=np.int64)

    rng = np.random.default_rng(seed)
    train_idx: list[np.ndarray] = []
    test_idx: list[np.ndarray] = []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        n_test = round(test_fraction * idx.size)
        test_idx.append(idx[:n_test])
        train_idx.append(idx[n_test:])
    tr = rng.permutation(np.concatenate(train_idx))
    te = rng.permutation(np.concatenate(test_idx))
    return (
        np.ascontiguousarray(X[tr]),
        np.ascontiguousarray(y[tr]),
        np.ascontiguousarray(X[te]),
        np.ascontiguousarray(y[te]),
    )


def bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits, (1797 x 64 pixel values 0..16, labels).

    Read from the CSV scikit-learn ships, without importing scikit-learn:
    that import (scipy and the rest) takes 2.3 s of CPU on a small machine,
    once per worker process, where reading the file takes 30 ms. The same
    values as `sklearn.datasets.load_digits()` (tests/test_demo_model.py);
    if the file is not where this looks, through scikit-learn after all."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the demo needs scikit-learn: pip install 'mlfabric[demo]'")
    package = Path(next(iter(spec.submodule_search_locations)))
    path = package / "datasets" / "data" / "digits.csv.gz"
    if path.is_file():
        with gzip.open(path, "rt") as f:
            table = np.loadtxt(f, delimiter=",")
        return table[:, :-1], table[:, -1].astype(np.int64)
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ConfigError("the demo needs scikit-learn: pip install 'mlfabric[demo]'") from exc
    digits = load_digits()
    return digits.data, digits.target


def init_params(hidden: int = 64, seed: int = 0) -> dict[str, np.ndarray]:
    """Fresh parameters: Glorot-scaled ``w1``, small ``w2`` (initial loss ~ ln 10),
    zero biases. float32, C-contiguous, deterministic in ``seed``."""
    if hidden < 1:
        raise ConfigError(f"hidden must be a positive number of units, got {hidden!r}")
    rng = np.random.default_rng(seed)
    std1 = np.sqrt(2.0 / (N_FEATURES + hidden))
    std2 = 0.1 * np.sqrt(2.0 / (hidden + N_CLASSES))
    params = {
        "w1": rng.normal(0.0, std1, size=(N_FEATURES, hidden)),
        "b1": np.zeros(hidden),
        "w2": rng.normal(0.0, std2, size=(hidden, N_CLASSES)),
        "b2": np.zeros(N_CLASSES),
    }
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in params.items()}


def _forward(params: Mapping[str, np.ndarray], X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    w1 = params["w1"]
    X = np.asarray(X, dtype=w1.dtype)
    h = np.tanh(X @ w1 + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    return h, logits


def loss_and_grads(
    params: Mapping[str, np.ndarray], X: np.ndarray, y: np.ndarray
) -> tuple[float, dict[str, np.ndarray]]:
    """Mean softmax cross-entropy over the batch and its gradient per parameter.

    Computed in the dtype of ``params["w1"]`` (float32 normally, float64 for
    gradient checks); the gradients have the parameters' shapes and dtype.
    """
    y = np.asarray(y)
    n = y.shape[0]
    if n == 0:
        raise ConfigError("loss_and_grads needs a non-empty batch")
    w1 = params["w1"]
    X = np.asarray(X, dtype=w1.dtype)
    h, logits = _forward(params, X)
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    sumexp = exp.sum(axis=1, keepdims=True)
    log_probs = shifted - np.log(sumexp)
    rows = np.arange(n)
    loss = float(-log_probs[rows, y].mean())

    dlogits = exp / sumexp
    dlogits[rows, y] -= 1.0
    dlogits /= n
    dw2 = h.T @ dlogits
    db2 = dlogits.sum(axis=0)
    dh = dlogits @ params["w2"].T
    dpre = dh * (1.0 - h * h)
    dw1 = X.T @ dpre
    db1 = dpre.sum(axis=0)
    grads = {"w1": dw1, "b1": db1, "w2": dw2, "b2": db2}
    return loss, {k: np.ascontiguousarray(g, dtype=params[k].dtype) for k, g in grads.items()}


def predict(params: Mapping[str, np.ndarray], X: np.ndarray) -> np.ndarray:
    """Predicted class (int64) for each row of ``X``."""
    _, logits = _forward(params, X)
    return np.asarray(logits.argmax(axis=1), dtype=np.int64)


def accuracy(params: Mapping[str, np.ndarray], X: np.ndarray, y: np.ndarray) -> float:
    """Fraction of rows of ``X`` whose predicted class equals ``y``."""
    y = np.asarray(y)
    if y.shape[0] == 0:
        raise ConfigError("accuracy needs at least one sample")
    return float(np.mean(predict(params, X) == y))


def shard(
    X: np.ndarray, y: np.ndarray, n_workers: int, index: int
) -> tuple[np.ndarray, np.ndarray]:
    """Worker ``index``'s shard: rows ``index, index + n_workers, ...``.

    The shards of ``0 .. n_workers-1`` are disjoint and together cover every row;
    their sizes differ by at most one.
    """
    if n_workers < 1:
        raise ConfigError(f"n_workers must be at least 1, got {n_workers!r}")
    if not 0 <= index < n_workers:
        raise ConfigError(f"shard index must be in 0..{n_workers - 1}, got {index!r}")
    if len(X) != len(y):
        raise ConfigError(f"X has {len(X)} rows but y has {len(y)}")
    if len(X) < n_workers:
        raise ConfigError(f"cannot split {len(X)} rows into {n_workers} non-empty shards")
    return np.ascontiguousarray(X[index::n_workers]), np.ascontiguousarray(y[index::n_workers])


def _batches(n: int, batch_size: int, rng: np.random.Generator):
    """Endless minibatch indices: reshuffle each epoch, consecutive slices."""
    while True:
        perm = rng.permutation(n)
        for start in range(0, n - batch_size + 1, batch_size):
            yield perm[start : start + batch_size]


def train_worker(
    ps: Any,
    X: np.ndarray,
    y: np.ndarray,
    *,
    steps: int,
    batch_size: int,
    eta: float,
    seed: int,
    on_outcome: Callable[[Any], None] | None = None,
    stop: threading.Event | None = None,
    max_in_flight: int = 1,
    timeout: float | None = 30.0,
    pull_with_push: bool = True,
) -> list[Any]:
    """Run one asynchronous worker for ``steps`` pushes; return every outcome.

    Each step: ``version, params = ps.pull()``, gradient of the loss on a
    minibatch of ``(X, y)``, ``ps.push({name: -eta * grad}, base_version=version)``.
    ``ps`` is any object with those two methods; ``push`` returns a future whose
    ``result(timeout)`` is the outcome (``.applied``, ``.version``, ``.delay``,
    ``.reason``). Outcomes are returned in push order whether applied or not,
    and each is passed to ``on_outcome`` as soon as it is known.

    ``max_in_flight=1`` waits for a push's outcome before the next pull; larger
    values let up to that many pushes await their outcome at once. With
    ``max_in_flight=1`` and a ``ps.pull`` that takes ``including`` (mlfabric's
    client), the next model is pulled with ``ps.pull(including=future)``: the
    same model, sent while the update still travels (``pull_with_push=False``
    turns that off, as a plain parameter server's worker). If ``stop`` is set
    the worker pushes nothing more, collects the outcomes already in flight
    and returns. A ``result`` that times out raises ``TimeoutError``.
    """
    if steps < 0:
        raise ConfigError(f"steps must be >= 0, got {steps!r}")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size!r}")
    if max_in_flight < 1:
        raise ConfigError(f"max_in_flight must be >= 1, got {max_in_flight!r}")
    if len(X) != len(y) or len(X) == 0:
        raise ConfigError(f"need matching non-empty X and y, got {len(X)} and {len(y)} rows")
    batch_size = min(batch_size, len(X))
    eta32 = np.float32(eta)
    rng = np.random.default_rng(seed)
    batches = _batches(len(X), batch_size, rng)
    in_flight: deque[Any] = deque()
    outcomes: list[Any] = []
    pull_including = pull_with_push and max_in_flight == 1 and takes_including(ps.pull)
    pulled = None

    def collect() -> None:
        outcome = in_flight.popleft().result(timeout)
        outcomes.append(outcome)
        if on_outcome is not None:
            on_outcome(outcome)

    for step in range(steps):
        if stop is not None and stop.is_set():
            break
        version, params = pulled if pulled is not None else ps.pull()
        pulled = None
        idx = next(batches)
        _, grads = loss_and_grads(params, X[idx], y[idx])
        update = {
            name: np.ascontiguousarray(-eta32 * g, dtype=np.float32) for name, g in grads.items()
        }
        in_flight.append(ps.push(update, base_version=version))
        if pull_including and step + 1 < steps and not (stop is not None and stop.is_set()):
            pulled = ps.pull(timeout=timeout, including=in_flight[0])
        while len(in_flight) >= max_in_flight:
            collect()
    while in_flight:
        collect()
    return outcomes
