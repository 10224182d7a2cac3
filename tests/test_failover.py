"""Failover on real sockets: the server is lost mid-run, the controller
promotes the replica, the workers move there by themselves, and the final
model is a numpy replay of every acknowledged update in the order applied."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import mlfabric
from mlfabric.control import fifo_policy
from mlfabric.controller import Controller
from mlfabric.divergence import DivergenceGate
from mlfabric.failover import Heartbeat
from mlfabric.metrics import ServerMetrics
from mlfabric.replica import ReplicaServer
from mlfabric.store import ParameterStore

from support import (
    JOB,
    TOKEN,
    Reference,
    ServerThread,
    assert_model_equal,
    make_model,
    random_update,
    wait_until,
)


def test_heartbeat_declares_a_server_dead_only_after_it_answered_once():
    hb = Heartbeat(1.0)
    assert not hb.dead(100.0)  # never heard: not failed over
    hb.heard(100.0)
    assert not hb.dead(101.0)
    assert hb.dead(101.01)


@pytest.mark.parametrize("kill_after", [5, 17])
def test_workers_fail_over_to_the_promoted_replica_and_lose_nothing(kill_after):
    model = make_model()
    gamma = 0.9
    server = ServerThread(ParameterStore(model, momentum=gamma))
    replica_server = ReplicaServer(ParameterStore(model, momentum=gamma), job=JOB, token=TOKEN,
                                   metrics=ServerMetrics(), recovery=0.2)
    replica = ServerThread(None, endpoint=replica_server)
    controller_ep = Controller(fifo_policy, job=JOB, token=TOKEN, tau_max=None,
                               gate=DivergenceGate(gamma, 1e9))
    controller = ServerThread(None, endpoint=controller_ep)
    acked: dict[int, dict[str, np.ndarray]] = {}
    acked_at: list[float] = []
    lock = threading.Lock()
    killed = threading.Event()
    kill_time: list[float] = []
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            with mlfabric.connect(server.address, job=JOB, token=TOKEN,
                                  controller=controller.address, controller_fallback="wait",
                                  replica=replica.address, failover_timeout=10) as ps:
                for i in range(12):
                    version, _ = ps.pull(timeout=10)
                    u = random_update(model, seed=100 * w + i)
                    outcome = ps.push(u, base_version=version).result(20)
                    assert outcome.applied, outcome
                    with lock:
                        assert outcome.version not in acked, outcome
                        acked[outcome.version] = u
                        acked_at.append(time.monotonic())
                        if len(acked) == kill_after and not killed.is_set():
                            killed.set()
        except BaseException as exc:  # reported below
            errors.append(exc)

    with replica, controller:
        server.__enter__()
        controller.call(lambda: controller_ep.watch_server(
            server.address, replica.address, interval=0.05, timeout=0.3))
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(3)]
        for t in threads:
            t.start()
        assert killed.wait(30)
        kill_time.append(time.monotonic())
        server.__exit__(None, None, None)  # every connection to it drops
        for t in threads:
            t.join(60)
        assert not errors, errors
        final_version, final = replica.call(
            lambda: (replica_server.store.version,
                     {n: w.copy() for n, w in replica_server.store.weights.items()}))
        metrics = controller_ep.metrics
    assert sorted(acked) == list(range(1, 37)), sorted(acked)
    assert final_version == 36
    ref = Reference(model, gamma)
    for v in sorted(acked):
        ref.apply(acked[v])
    assert_model_equal(final, ref.w)
    assert metrics.failovers._value.get() == 1
    assert replica_server.serving
    resumed = min(t for t in acked_at if t > kill_time[0])
    assert resumed - kill_time[0] < 2.0


def test_sigkill_of_the_server_process(tmp_path):
    """The commands as deployed: `mlfabric server`, `mlfabric server --role
    replica`, `mlfabric controller --server --replica`; the server SIGKILLed."""
    import signal

    from test_replication import Serving, write_inputs

    model = make_model()
    gamma = 0.5
    init = write_inputs(tmp_path, model)
    replica = Serving(tmp_path, "--role", "replica", "--init", init, "--momentum", str(gamma))
    server = Serving(tmp_path, "--init", init, "--momentum", str(gamma), "--tau-max", "-1")
    controller = Serving(tmp_path, "--server", server.address, "--replica", replica.address,
                         "--heartbeat-interval", "0.1", "--heartbeat-timeout", "0.5",
                         "--policy", "fifo", "--tau-max", "-1", command="controller")
    acked: dict[int, dict[str, np.ndarray]] = {}
    acked_at: list[float] = []
    lock = threading.Lock()
    half = threading.Event()
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            with mlfabric.connect(server.address, job=JOB, token=TOKEN,
                                  controller=controller.address, controller_fallback="wait",
                                  replica=replica.address, failover_timeout=10) as ps:
                for i in range(10):
                    version, _ = ps.pull(timeout=10)
                    u = random_update(model, seed=100 * w + i)
                    outcome = ps.push(u, base_version=version).result(20)
                    assert outcome.applied, outcome
                    with lock:
                        acked[outcome.version] = u
                        acked_at.append(time.monotonic())
                        if len(acked) >= 12:
                            half.set()
        except BaseException as exc:
            errors.append(exc)

    try:
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(3)]
        for t in threads:
            t.start()
        assert half.wait(30)
        server.proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        for t in threads:
            t.join(60)
        assert not errors, errors
        with mlfabric.connect(replica.address, job=JOB, token=TOKEN) as ps:
            final_version, final = ps.pull(timeout=10)
    finally:
        server.stop()
        codes = [controller.stop(), replica.stop()]
    assert sorted(acked) == list(range(1, 31))
    assert final_version == 30
    ref = Reference(model, gamma)
    for v in sorted(acked):
        ref.apply(acked[v])
    assert_model_equal(final, ref.w)
    assert min(t for t in acked_at if t > killed_at) - killed_at < 2.0
    for code, err in codes:
        assert code == 0 and "Traceback" not in err, err
    assert "promoting the replica" in codes[0][1]


def test_new_replicas_join_from_a_snapshot_and_take_over_again():
    """Three servers lost in one run: after each failover a new replica joins
    from the promoted one's state, workers send it what they kept, and it is
    the one promoted at the next loss. (Workers run until told to stop: one
    that quits while no replica is attached takes its kept updates along,
    see docs/design.md.)"""
    import asyncio

    from mlfabric.replica import announce, fetch_state

    model = make_model()
    gamma = 0.9
    kills = 3
    stop = threading.Event()

    def new_replica(store):
        ep = ReplicaServer(store, job=JOB, token=TOKEN, metrics=ServerMetrics(), recovery=0.1)
        return ServerThread(None, endpoint=ep).__enter__()

    server = ServerThread(ParameterStore(model, momentum=gamma)).__enter__()
    replica = new_replica(ParameterStore(model, momentum=gamma))
    controller_ep = Controller(fifo_policy, job=JOB, token=TOKEN, tau_max=None,
                               gate=DivergenceGate(gamma, 1e9))
    controller = ServerThread(None, endpoint=controller_ep).__enter__()
    controller.call(lambda: controller_ep.watch_server(
        server.address, replica.address, interval=0.05, timeout=0.3))
    acked: dict[int, dict[str, np.ndarray]] = {}
    lock = threading.Lock()
    progress = threading.Condition(lock)
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            with mlfabric.connect(server.address, job=JOB, token=TOKEN,
                                  controller=controller.address, controller_fallback="wait",
                                  replica=replica.address, failover_timeout=10) as ps:
                for i in range(500):  # until the test says stop
                    if stop.is_set():
                        break
                    version, _ = ps.pull(timeout=10)
                    u = random_update(model, seed=100 * w + i)
                    outcome = ps.push(u, base_version=version).result(20)
                    assert outcome.applied, outcome
                    with progress:
                        assert outcome.version not in acked, outcome
                        acked[outcome.version] = u
                        progress.notify_all()
        except BaseException as exc:
            errors.append(exc)

    alive = [server, replica, controller]
    try:
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(3)]
        for t in threads:
            t.start()
        for k in range(kills):
            with progress:
                assert progress.wait_for(lambda k=k: len(acked) >= 8 * (k + 1), 30)
            server.__exit__(None, None, None)  # lost
            alive.remove(server)
            promoted = replica
            with progress:  # the promoted replica serves: training goes on
                n = len(acked)
                assert progress.wait_for(lambda n=n: len(acked) > n + 2, 10)
            server = promoted
            store = asyncio.run(fetch_state(promoted.address, job=JOB, token=TOKEN))
            replica = new_replica(store)
            alive.append(replica)
            asyncio.run(announce(controller.address, address=replica.address, store=store,
                                 job=JOB, token=TOKEN))
        with progress:
            n = len(acked)
            assert progress.wait_for(lambda n=n: len(acked) > n + 5, 10)
        stop.set()
        for t in threads:
            t.join(60)
        assert not errors, errors
        ep = server.server
        final_version, final = server.call(
            lambda: (ep.store.version, {n: w.copy() for n, w in ep.store.weights.items()}))
    finally:
        for st in alive:
            st.__exit__(None, None, None)
    assert controller_ep.metrics.failovers._value.get() == kills
    assert sorted(acked) == list(range(1, len(acked) + 1))
    assert final_version == len(acked)
    ref = Reference(model, gamma)
    for v in sorted(acked):
        ref.apply(acked[v])
    assert_model_equal(final, ref.w)


def test_training_through_two_server_losses_reaches_the_target_accuracy():
    """The demo model (scikit-learn digits) trained by 3 asynchronous workers
    while the server is lost twice (a replica joining in between) reaches the
    held-out accuracy a run without losses reaches (>= 0.9 here)."""
    import asyncio

    from mlfabric import demo_model as dm
    from mlfabric.replica import announce, fetch_state

    X, y, X_test, y_test = dm.load_digits_split()
    init = dm.init_params(seed=0)
    gamma, workers, steps = dm.DEFAULTS["gamma"], 3, 200

    def new_replica(store):
        ep = ReplicaServer(store, job=JOB, token=TOKEN, metrics=ServerMetrics(), recovery=0.1)
        return ServerThread(None, endpoint=ep).__enter__()

    server = ServerThread(ParameterStore(init, momentum=gamma, tau_max=8)).__enter__()
    replica = new_replica(ParameterStore(init, momentum=gamma))
    controller_ep = Controller(fifo_policy, job=JOB, token=TOKEN, tau_max=None)
    controller = ServerThread(None, endpoint=controller_ep).__enter__()
    controller.call(lambda: controller_ep.watch_server(
        server.address, replica.address, interval=0.05, timeout=0.3))
    applied = [0]
    lock = threading.Condition()
    errors: list[BaseException] = []

    def count(outcome):
        with lock:
            applied[0] += outcome.applied
            lock.notify_all()

    def worker(w: int) -> None:
        try:
            with mlfabric.connect(server.address, job=JOB, token=TOKEN,
                                  controller=controller.address, controller_fallback="wait",
                                  replica=replica.address, failover_timeout=10) as ps:
                Xs, ys = dm.shard(X, y, workers, w)
                dm.train_worker(ps, Xs, ys, steps=steps, batch_size=32,
                                eta=dm.DEFAULTS["eta"], seed=w, on_outcome=count)
        except BaseException as exc:
            errors.append(exc)

    alive = [server, replica, controller]
    try:
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(workers)]
        for t in threads:
            t.start()
        for k, at in enumerate((workers * steps // 3, 2 * workers * steps // 3)):
            with lock:
                assert lock.wait_for(lambda at=at: applied[0] >= at, 60)
            server.__exit__(None, None, None)
            alive.remove(server)
            server = replica
            if k == 0:
                promoted = server.server
                wait_until(lambda p=promoted: p.serving, 10, "the promotion")
                store = asyncio.run(fetch_state(server.address, job=JOB, token=TOKEN))
                replica = new_replica(store)
                alive.append(replica)
                asyncio.run(announce(controller.address, address=replica.address,
                                     store=store, job=JOB, token=TOKEN))
        for t in threads:
            t.join(120)
        assert not errors, errors
        ep = server.server
        final = server.call(lambda: {n: w.copy() for n, w in ep.store.weights.items()})
    finally:
        for st in alive:
            st.__exit__(None, None, None)
    assert controller_ep.metrics.failovers._value.get() == 2
    # 0.94-0.95 measured; the demo's own run without losses reaches 0.95-0.96
    # with 1,400 updates, this one has 600.
    assert dm.accuracy(final, X_test, y_test) >= 0.9


def test_a_lost_replica_does_not_stall_training_and_a_new_one_catches_up():
    """With a tight --div-max, server transfers wait for the replica; when the
    replica is lost the controller lets them go (no replica to diverge from),
    workers keep what the server acknowledges, and a replica joining later
    gets it and ends equal to the server."""
    import asyncio

    from mlfabric.replica import announce, fetch_state

    model = make_model()
    gamma = 0.9
    stop = threading.Event()

    def new_replica(store):
        ep = ReplicaServer(store, job=JOB, token=TOKEN, metrics=ServerMetrics())
        return ServerThread(None, endpoint=ep).__enter__()

    server = ServerThread(ParameterStore(model, momentum=gamma)).__enter__()
    replica = new_replica(ParameterStore(model, momentum=gamma))
    gate = DivergenceGate(gamma, 1e-9)  # every update waits for the replica
    controller_ep = Controller(fifo_policy, job=JOB, token=TOKEN, tau_max=None, gate=gate)
    controller = ServerThread(None, endpoint=controller_ep).__enter__()
    controller.call(lambda: controller_ep.watch_server(
        server.address, replica.address, interval=0.05, timeout=0.3))
    acked: dict[int, dict[str, np.ndarray]] = {}
    progress = threading.Condition()
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            with mlfabric.connect(server.address, job=JOB, token=TOKEN,
                                  controller=controller.address, controller_fallback="wait",
                                  replica=replica.address, failover_timeout=10) as ps:
                for i in range(500):
                    if stop.is_set():
                        break
                    version, _ = ps.pull(timeout=10)
                    u = random_update(model, seed=100 * w + i)
                    outcome = ps.push(u, base_version=version).result(20)
                    assert outcome.applied, outcome
                    with progress:
                        acked[outcome.version] = u
                        progress.notify_all()
        except BaseException as exc:
            errors.append(exc)

    def wait_acked(more: int) -> None:
        with progress:
            n = len(acked)
            assert progress.wait_for(lambda: len(acked) >= n + more, 10), "training stalled"

    alive = [server, replica, controller]
    try:
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(3)]
        for t in threads:
            t.start()
        wait_acked(10)
        replica.__exit__(None, None, None)
        alive.remove(replica)
        wait_until(lambda: controller_ep.metrics.replicas_lost._value.get() == 1, 10,
                   "the controller noticing the lost replica")
        wait_acked(10)  # not stalled behind the gate
        store = asyncio.run(fetch_state(server.address, job=JOB, token=TOKEN))
        replica = new_replica(store)
        alive.append(replica)
        asyncio.run(announce(controller.address, address=replica.address, store=store,
                             job=JOB, token=TOKEN))
        wait_acked(10)
        stop.set()
        for t in threads:
            t.join(60)
        assert not errors, errors
        sv, sw = server.call(lambda: (server.store.version,
                                      {n: w.copy() for n, w in server.store.weights.items()}))
        rep = replica.server.store
        rv, rw = replica.call(lambda: (rep.version,
                                       {n: w.copy() for n, w in rep.weights.items()}))
    finally:
        for st in alive:
            st.__exit__(None, None, None)
    assert sorted(acked) == list(range(1, len(acked) + 1)) and sv == len(acked)
    assert rv == sv  # everything acknowledged since the join is on the new replica
    ref = Reference(model, gamma)
    for v in sorted(acked):
        ref.apply(acked[v])
    assert_model_equal(sw, ref.w)
    assert_model_equal(rw, ref.w)
