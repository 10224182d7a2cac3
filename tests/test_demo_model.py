"""Tests of the demo model (mlfabric.tools.demo_model): data split, MLP gradients, worker loop.

The end-to-end convergence test runs against a SIMULATED parameter server
(``SimulatedServer`` below): an in-process, pure-numpy stand-in that applies the
same momentum rule, version counting and tau_max rejection as the real server,
and forces staleness by scheduling the worker threads round-robin. It validates
the hyperparameters in ``DEFAULTS``; it does not exercise the real server.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import pytest

from mlfabric.errors import ConfigError
from mlfabric.tools import demo_model as dm


@pytest.fixture(scope="module")
def split():
    return dm.load_digits_split()


# --------------------------------------------------------------------------- data


def test_split_shapes_dtypes_and_range(split):
    X_tr, y_tr, X_te, y_te = split
    assert X_tr.shape[1] == X_te.shape[1] == dm.N_FEATURES
    assert len(X_tr) == len(y_tr) and len(X_te) == len(y_te)
    assert len(X_tr) + len(X_te) == 1797
    assert abs(len(X_te) / 1797 - 0.25) < 0.01
    assert X_tr.dtype == X_te.dtype == np.float32
    assert X_tr.flags.c_contiguous and X_te.flags.c_contiguous
    assert y_tr.dtype == y_te.dtype == np.int64
    for X in (X_tr, X_te):
        assert X.min() == 0.0 and X.max() == 1.0
    assert set(np.unique(y_tr)) == set(np.unique(y_te)) == set(range(10))


def test_split_is_stratified(split):
    _, y_tr, _, y_te = split
    tr = np.bincount(y_tr, minlength=10) / len(y_tr)
    te = np.bincount(y_te, minlength=10) / len(y_te)
    assert np.abs(tr - te).max() < 0.01


def test_split_is_deterministic_and_seeded(split):
    again = dm.load_digits_split()
    for a, b in zip(split, again, strict=True):
        np.testing.assert_array_equal(a, b)
    other = dm.load_digits_split(seed=1)
    assert not np.array_equal(split[1], other[1])


def test_split_train_and_test_are_disjoint(split):
    X_tr, _, X_te, _ = split
    # Rows are identified by their original index: reload and match byte patterns
    # of whole rows, counting duplicates (the raw data has a few identical images).
    from sklearn.datasets import load_digits

    raw = (load_digits().data / 16.0).astype(np.float32)
    keys = {}
    for row in raw:
        keys[row.tobytes()] = keys.get(row.tobytes(), 0) + 1
    used = {}
    for row in np.concatenate([X_tr, X_te]):
        used[row.tobytes()] = used.get(row.tobytes(), 0) + 1
    # Every raw row is used exactly as often as it occurs: no row in both parts
    # (that would double-count it) and no row missing.
    assert used == keys


def test_split_rejects_bad_fraction():
    with pytest.raises(ConfigError, match="test_fraction"):
        dm.load_digits_split(test_fraction=1.0)


def test_missing_sklearn_raises_config_error(monkeypatch):
    import builtins
    import importlib.util

    real_import = builtins.__import__
    real_find = importlib.util.find_spec

    def fake_import(name, *args, **kwargs):
        if name == "sklearn" or name.startswith("sklearn."):
            raise ImportError("No module named 'sklearn'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "sklearn" else real_find(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'mlfabric\[demo\]'"):
        dm.load_digits_split()


def test_the_digits_read_from_sklearns_file_are_load_digits(monkeypatch, tmp_path):
    """Read without importing scikit-learn (30 ms, not 2.3 s per worker),
    the same values; where the file is not found, through scikit-learn."""
    import importlib.machinery
    import importlib.util
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    digits = load_digits()
    data, target = dm.bundled_digits()
    np.testing.assert_array_equal(data, digits.data)
    np.testing.assert_array_equal(target, digits.target)
    code = ("import sys; from mlfabric.tools import demo_model as dm; dm.load_digits_split(); "
            "print('sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "False", out.stderr
    moved = importlib.machinery.ModuleSpec("sklearn", None, is_package=True)
    moved.submodule_search_locations = [str(tmp_path)]  # no datasets/data/digits.csv.gz
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: moved if name == "sklearn" else real_find(name, *a))
    data, target = dm.bundled_digits()
    np.testing.assert_array_equal(data, digits.data)
    np.testing.assert_array_equal(target, digits.target)


@pytest.mark.parametrize("n_workers", [1, 3, 4, 7])
def test_shards_are_disjoint_and_cover(split, n_workers):
    X_tr, y_tr, _, _ = split
    ids = np.arange(len(X_tr))
    seen = []
    for i in range(n_workers):
        Xs, ys = dm.shard(X_tr, y_tr, n_workers, i)
        ids_s, _ = dm.shard(ids, ids, n_workers, i)
        np.testing.assert_array_equal(Xs, X_tr[ids_s])
        np.testing.assert_array_equal(ys, y_tr[ids_s])
        again, _ = dm.shard(X_tr, y_tr, n_workers, i)
        np.testing.assert_array_equal(Xs, again)
        seen.append(ids_s)
    allids = np.concatenate(seen)
    assert len(allids) == len(X_tr)
    np.testing.assert_array_equal(np.sort(allids), ids)
    sizes = [len(s) for s in seen]
    assert max(sizes) - min(sizes) <= 1


def test_shard_rejects_bad_arguments(split):
    X_tr, y_tr, _, _ = split
    with pytest.raises(ConfigError):
        dm.shard(X_tr, y_tr, 0, 0)
    with pytest.raises(ConfigError):
        dm.shard(X_tr, y_tr, 4, 4)
    with pytest.raises(ConfigError):
        dm.shard(X_tr, y_tr[:-1], 4, 0)


# -------------------------------------------------------------------------- model


def test_init_params_layout():
    p = dm.init_params(hidden=32, seed=3)
    assert list(p) == list(dm.PARAM_NAMES)
    shapes = {"w1": (64, 32), "b1": (32,), "w2": (32, 10), "b2": (10,)}
    for name, arr in p.items():
        assert arr.shape == shapes[name]
        assert arr.dtype == np.float32
        assert arr.flags.c_contiguous
    q = dm.init_params(hidden=32, seed=3)
    for name in p:
        np.testing.assert_array_equal(p[name], q[name])
    assert not np.array_equal(p["w1"], dm.init_params(hidden=32, seed=4)["w1"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_init_params_are_near_chance(split, seed):
    _, _, X_te, y_te = split
    p = dm.init_params(seed=seed)
    acc = dm.accuracy(p, X_te, y_te)
    assert acc < 0.3
    loss, _ = dm.loss_and_grads(p, X_te, y_te)
    assert abs(loss - np.log(10)) < 0.05


@pytest.mark.parametrize("seed", [0, 1])
def test_gradients_match_finite_differences(split, seed):
    X_tr, y_tr, _, _ = split
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(X_tr), size=16, replace=False)
    X, y = X_tr[idx].astype(np.float64), y_tr[idx]
    # Larger w2 than at init so every tensor has a sizeable gradient.
    params = {k: v.astype(np.float64) for k, v in dm.init_params(hidden=16, seed=seed).items()}
    params["w2"] = rng.normal(0.0, 0.5, size=params["w2"].shape)
    params["b1"] = rng.normal(0.0, 0.1, size=params["b1"].shape)
    _, grads = dm.loss_and_grads(params, X, y)
    eps = 1e-6
    for name, arr in params.items():
        assert grads[name].shape == arr.shape and grads[name].dtype == np.float64
        for flat in rng.choice(arr.size, size=min(6, arr.size), replace=False):
            coord = np.unravel_index(flat, arr.shape)
            orig = arr[coord]
            arr[coord] = orig + eps
            up, _ = dm.loss_and_grads(params, X, y)
            arr[coord] = orig - eps
            down, _ = dm.loss_and_grads(params, X, y)
            arr[coord] = orig
            numeric = (up - down) / (2 * eps)
            assert grads[name][coord] == pytest.approx(numeric, rel=1e-5, abs=1e-8), (
                name,
                coord,
            )


def test_loss_is_stable_for_huge_logits():
    p = {k: v.astype(np.float64) for k, v in dm.init_params(hidden=8).items()}
    p["b2"][:] = [1e4, -1e4, 0, 0, 0, 0, 0, 0, 0, 0]
    X = np.zeros((2, 64))
    loss, grads = dm.loss_and_grads(p, X, np.array([0, 1]))
    assert np.isfinite(loss) and all(np.isfinite(g).all() for g in grads.values())
    assert loss == pytest.approx(2e4 / 2, rel=1e-9)  # 0 for row 0, 2e4 for row 1
    assert dm.predict(p, X).tolist() == [0, 0]
    assert dm.accuracy(p, X, np.array([0, 1])) == 0.5


def test_float32_gradients_stay_float32(split):
    X_tr, y_tr, _, _ = split
    p = dm.init_params()
    loss, grads = dm.loss_and_grads(p, X_tr[:32], y_tr[:32])
    assert isinstance(loss, float)
    for name in p:
        assert grads[name].dtype == np.float32 and grads[name].flags.c_contiguous


# ------------------------------------------------------------ simulated server


@dataclass(frozen=True)
class Outcome:
    applied: bool
    version: int
    delay: int
    reason: str | None


def _done(outcome: Outcome) -> Future:
    fut: Future = Future()
    fut.set_result(outcome)
    return fut


class SimulatedServer:
    """SIMULATION of the asynchronous parameter server, for tests only.

    Pure numpy, in-process. ``apply`` uses the server's rule
    ``w_{t+1} = w_t + u + gamma * (w_t - w_{t-1})``, advances the version by one
    per applied update and rejects updates whose delay exceeds ``tau_max``.

    Staleness is forced deterministically: ``port(i)`` gives worker ``i`` a
    pull/push object, and the workers (one thread each) take turns round-robin,
    each doing "push the previous gradient, then pull" on its turn. With ``n``
    workers every push therefore lands ``n - 1`` versions after the model it was
    computed on; each pull additionally returns a model up to ``extra_staleness``
    versions older than the newest (seeded), giving delays of ``n - 1`` to
    ``n - 1 + extra_staleness``.
    """

    def __init__(self, params, *, gamma, tau_max, n_workers, steps, extra_staleness=0, seed=0):
        self.w = {k: np.array(v, dtype=np.float32) for k, v in params.items()}
        self.prev = {k: v.copy() for k, v in self.w.items()}
        self.gamma = np.float32(gamma)
        self.tau_max = tau_max
        self.version = 0
        self.history = {0: self._snapshot()}
        self.extra = extra_staleness
        self.rng = np.random.default_rng(seed)
        self.n_workers = n_workers
        self.steps = steps
        self.pushes = [0] * n_workers
        self.turn = 0
        self.cond = threading.Condition()
        self.delays: list[int] = []

    def _snapshot(self):
        snap = {k: v.copy() for k, v in self.w.items()}
        for v in snap.values():
            v.flags.writeable = False
        return snap

    def apply(self, update, base_version) -> Outcome:
        delay = self.version - base_version
        self.delays.append(delay)
        if delay > self.tau_max:
            return Outcome(False, self.version, delay, f"stale: delay {delay} > {self.tau_max}")
        for k, w in self.w.items():
            new = w + update[k] + self.gamma * (w - self.prev[k])
            self.prev[k] = w
            self.w[k] = new
        self.version += 1
        self.history[self.version] = self._snapshot()
        old = self.version - self.extra - 2
        if old > 0:  # version 0 stays: it is every worker's first pull
            self.history.pop(old, None)
        return Outcome(True, self.version, delay, None)

    def _advance(self):
        for _ in range(self.n_workers):
            self.turn = (self.turn + 1) % self.n_workers
            if self.pushes[self.turn] < self.steps:
                return
        self.turn = -1

    def _wait_turn(self, i):
        if not self.cond.wait_for(lambda: self.turn == i, timeout=10.0):
            raise RuntimeError(f"simulated worker {i} never got its turn")

    def port(self, i):
        server = self

        class Port:
            first = True

            def pull(self):
                with server.cond:
                    if self.first:  # everyone starts from version 0
                        self.first = False
                        return 0, server.history[0]
                    server._wait_turn(i)
                    v = max(0, server.version - int(server.rng.integers(0, server.extra + 1)))
                    snap = server.history[v]
                    server._advance()
                    server.cond.notify_all()
                    return v, snap

            def push(self, update, base_version):
                with server.cond:
                    server._wait_turn(i)
                    outcome = server.apply(update, base_version)
                    server.pushes[i] += 1
                    if server.pushes[i] == server.steps:  # no pull follows the last push
                        server._advance()
                        server.cond.notify_all()
                    return _done(outcome)

        return Port()


def run_simulation(split, *, seed, extra_staleness=4, **overrides):
    """Train the demo model with DEFAULTS (plus overrides) on the simulated server."""
    cfg = {**dm.DEFAULTS, **overrides}
    X_tr, y_tr, X_te, y_te = split
    n = cfg["workers"]
    server = SimulatedServer(
        dm.init_params(hidden=cfg["hidden"], seed=seed),
        gamma=cfg["gamma"],
        tau_max=cfg["tau_max"],
        n_workers=n,
        steps=cfg["steps_per_worker"],
        extra_staleness=extra_staleness,
        seed=seed,
    )
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def work(i):
        try:
            Xs, ys = dm.shard(X_tr, y_tr, n, i)
            results[i] = dm.train_worker(
                server.port(i),
                Xs,
                ys,
                steps=cfg["steps_per_worker"],
                batch_size=cfg["batch_size"],
                eta=cfg["eta"],
                seed=seed * 1000 + i,
            )
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)
            with server.cond:
                server.turn = -2
                server.cond.notify_all()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return dm.accuracy(server.w, X_te, y_te), server, results


def test_defaults_are_sane():
    d = dm.DEFAULTS
    assert d["workers"] == 4
    assert d["workers"] * d["steps_per_worker"] <= 1500
    assert 0.0 <= d["gamma"] < 1.0
    assert d["tau_max"] >= 4
    assert d["eta"] > 0 and d["batch_size"] >= 1 and d["hidden"] >= 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_simulated_async_training_with_defaults_reaches_093(split, seed):
    """SIMULATION: 4 stale workers (delays 3-7) with DEFAULTS reach >= 0.93 held out."""
    acc, server, results = run_simulation(split, seed=seed)
    d = dm.DEFAULTS
    total = d["workers"] * d["steps_per_worker"]
    outcomes = [o for i in sorted(results) for o in results[i]]
    assert len(outcomes) == total
    assert all(o.applied for o in outcomes)  # delays stay within tau_max
    assert server.version == total
    delays = np.array(server.delays[d["workers"] :])  # after the start-up round
    assert delays.min() >= d["workers"] - 1 and delays.max() >= d["workers"] + 1
    assert acc >= 0.93, f"seed {seed}: held-out accuracy {acc:.4f}"


def test_simulation_rejects_updates_beyond_tau_max(split):
    """SIMULATION: with tau_max below the forced delay (3) pushes get rejected, the
    version only counts applied ones, and every worker reports every outcome."""
    _, server, results = run_simulation(
        split, seed=0, extra_staleness=0, tau_max=2, steps_per_worker=5
    )
    outcomes = [o for i in sorted(results) for o in results[i]]
    assert len(outcomes) == 20
    assert all(o.applied == (o.delay <= 2) for o in outcomes)
    assert all(o.reason for o in outcomes if not o.applied)
    # The schedule is deterministic: worker 3 always pushes 3 versions late, so all
    # of its pushes are rejected; the others land 2 versions late (at start-up 0, 1).
    assert not any(o.applied for o in results[3])
    assert all(o.applied for i in range(3) for o in results[i])
    assert server.version == 15


def test_simulated_server_applies_the_momentum_rule():
    """SIMULATION self-check: the stand-in follows the server's update rule."""
    w0 = {"a": np.array([1.0, 2.0], dtype=np.float32)}
    sim = SimulatedServer(w0, gamma=0.5, tau_max=1, n_workers=1, steps=10)
    u = {"a": np.array([0.5, -1.0], dtype=np.float32)}
    assert sim.apply(u, 0) == Outcome(True, 1, 0, None)
    np.testing.assert_array_equal(sim.w["a"], [1.5, 1.0])  # w1 = w0 + u
    assert sim.apply(u, 0) == Outcome(True, 2, 1, None)
    # w2 = w1 + u + 0.5 * (w1 - w0) = [1.5, 1.0] + [0.5, -1.0] + [0.25, -0.5]
    np.testing.assert_array_equal(sim.w["a"], [2.25, -0.5])
    out = sim.apply(u, 0)  # delay 2 > tau_max 1
    assert not out.applied and out.delay == 2 and out.version == 2 and out.reason
    np.testing.assert_array_equal(sim.w["a"], [2.25, -0.5])
    np.testing.assert_array_equal(sim.history[1]["a"], [1.5, 1.0])


# --------------------------------------------------------------- worker loop


class RecordingServer:
    """Synchronous fake: applies updates with plain addition, records calls."""

    def __init__(self, params, *, reject=False, defer=False):
        self.w = {k: v.copy() for k, v in params.items()}
        self.version = 0
        self.reject = reject
        self.defer = defer
        self.log: list[tuple] = []
        self.pending: list[tuple[Future, dict, int]] = []

    def pull(self):
        self.log.append(("pull", self.version))
        return self.version, {k: v.copy() for k, v in self.w.items()}

    def _apply(self, update, base_version):
        if self.reject:
            return Outcome(False, self.version, self.version - base_version, "rejected")
        for k in self.w:
            self.w[k] += update[k]
        self.version += 1
        return Outcome(True, self.version, self.version - 1 - base_version, None)

    def push(self, update, base_version):
        self.log.append(("push", base_version))
        for name, u in update.items():
            assert u.dtype == np.float32 and u.flags.c_contiguous, name
        if not self.defer:
            return _done(self._apply(update, base_version))
        server = self
        fut: Future = Future()

        class Deferred:
            def result(self, timeout=None):
                # Resolve lazily, so several pushes can be outstanding at once.
                if not fut.done():
                    server.log.append(("resolve", base_version))
                    fut.set_result(server._apply(update, base_version))
                return fut.result(timeout)

        return Deferred()


def test_worker_pushes_negative_eta_gradient(split):
    X_tr, y_tr, _, _ = split
    p0 = dm.init_params(hidden=8, seed=0)
    server = RecordingServer(p0)
    Xs, ys = X_tr[:10], y_tr[:10]
    outcomes = dm.train_worker(server, Xs, ys, steps=1, batch_size=10, eta=0.5, seed=0)
    assert [o.applied for o in outcomes] == [True]
    _, grads = dm.loss_and_grads(p0, Xs, ys)  # batch = whole set, any order
    for k in p0:
        np.testing.assert_allclose(server.w[k], p0[k] - 0.5 * grads[k], rtol=1e-5, atol=1e-7)


def test_worker_training_reduces_loss_and_calls_on_outcome(split):
    X_tr, y_tr, X_te, y_te = split
    p0 = dm.init_params(seed=0)
    server = RecordingServer(p0)
    seen = []
    outcomes = dm.train_worker(
        server, X_tr, y_tr, steps=60, batch_size=32, eta=0.3, seed=0, on_outcome=seen.append
    )
    assert len(outcomes) == 60 and seen == outcomes
    assert [o.version for o in outcomes] == list(range(1, 61))
    assert dm.loss_and_grads(server.w, X_te, y_te)[0] < 0.8 * np.log(10)
    # max_in_flight=1: strictly pull, push, pull, push ...
    assert [e[0] for e in server.log] == ["pull", "push"] * 60


def test_worker_reports_rejected_outcomes(split):
    X_tr, y_tr, _, _ = split
    p0 = dm.init_params(seed=0)
    server = RecordingServer(p0, reject=True)
    outcomes = dm.train_worker(server, X_tr, y_tr, steps=7, batch_size=16, eta=0.1, seed=0)
    assert len(outcomes) == 7 and not any(o.applied for o in outcomes)
    for k in p0:
        np.testing.assert_array_equal(server.w[k], p0[k])


def test_worker_max_in_flight_pipelines(split):
    X_tr, y_tr, _, _ = split
    server = RecordingServer(dm.init_params(hidden=8), defer=True)
    outcomes = dm.train_worker(
        server, X_tr, y_tr, steps=5, batch_size=8, eta=0.1, seed=0, max_in_flight=2
    )
    assert len(outcomes) == 5 and all(o.applied for o in outcomes)
    kinds = [e[0] for e in server.log]
    # The second pull happens before the first push is resolved.
    assert kinds[:4] == ["pull", "push", "pull", "push"]
    assert kinds.count("resolve") == 5 and kinds[-1] == "resolve"


def test_worker_stops_when_event_is_set(split):
    X_tr, y_tr, _, _ = split
    server = RecordingServer(dm.init_params(hidden=8))
    stop = threading.Event()

    def on_outcome(o):
        if o.version == 3:
            stop.set()

    outcomes = dm.train_worker(
        server,
        X_tr,
        y_tr,
        steps=100,
        batch_size=8,
        eta=0.1,
        seed=0,
        on_outcome=on_outcome,
        stop=stop,
    )
    assert len(outcomes) == 3
    assert server.version == 3


def test_worker_rejects_bad_arguments(split):
    X_tr, y_tr, _, _ = split
    server = RecordingServer(dm.init_params(hidden=8))
    for kwargs in ({"steps": -1}, {"batch_size": 0}, {"max_in_flight": 0}):
        args = {"steps": 1, "batch_size": 8, "eta": 0.1, "seed": 0, **kwargs}
        with pytest.raises(ConfigError):
            dm.train_worker(server, X_tr, y_tr, **args)
    assert server.log == []
