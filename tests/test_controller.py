"""A live controller and parameter server; workers push through the controller."""

from __future__ import annotations

import json
import logging
import socket
import threading

import numpy as np
import pytest

import mlfabric
from mlfabric.control import PlanItem, Snapshot, fifo_policy
from mlfabric.controller import Controller
from mlfabric.errors import ConnectError, ConnectionLost
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cluster(loop_kind):
    """cluster(policy) -> (server thread, controller thread, model)."""
    threads = []

    def start(policy=fifo_policy, *, momentum=0.0, tau_max=None, port=0):
        model = make_model()
        server = ServerThread(ParameterStore(model, momentum=momentum, tau_max=tau_max),
                              loop_kind=loop_kind).__enter__()
        threads.append(server)
        controller = ServerThread(
            None, loop_kind=loop_kind, port=port,
            endpoint=Controller(policy, job=JOB, token=TOKEN, tau_max=tau_max)).__enter__()
        threads.append(controller)
        return server, controller, model

    yield start
    for t in reversed(threads):
        if t._thread.is_alive():
            t.__exit__(None, None, None)


def sample(metric, **labels):
    return metric.labels(**labels)._value.get() if labels else metric._value.get()


def test_pushes_go_through_the_controller_and_are_reported_back(cluster, caplog):
    server, controller, model = cluster(momentum=0.5)
    ref = Reference(model, 0.5)
    caplog.set_level(logging.INFO, logger="mlfabric.decisions")
    with mlfabric.connect(server.address, job=JOB, token=TOKEN,
                          controller=controller.address, host="worker-a") as ps:
        for i in range(5):
            u = random_update(model, seed=i)
            outcome = ps.push(u, base_version=i).result(10)
            ref.apply(u)
            assert (outcome.applied, outcome.version, outcome.delay) == (True, i + 1, 0)
            u["w"][:] = np.nan  # the caller may reuse its arrays once push() returned
        assert_model_equal(ps.pull(timeout=10)[1], ref.w)
    m = controller.metrics
    wait_until(lambda: m.actual_seconds._sum.get() > 0 and sample(m.requests) == 5)
    assert sample(m.directives, action="go") == 5
    wait_until(lambda: sum(b.get() for b in m.delay._buckets) == 5, what="5 delays reported")
    records = [json.loads(r.getMessage()) for r in caplog.records
               if r.name == "mlfabric.decisions"]
    gos = [r for r in records if r["event"] == "go"]
    assert len(gos) == 5 and all(r["host"] == "worker-a" for r in gos)
    assert {"position", "planned_seconds", "queue_wait", "server_version"} <= set(gos[0])


def test_a_dropped_update_comes_back_with_the_controllers_reason(cluster):
    def drop_all(snap: Snapshot) -> list[PlanItem]:
        return [PlanItem(t.id, drop="would_idle_server", detail="test") for t in snap.pending]

    server, controller, model = cluster(drop_all)
    with mlfabric.connect(server.address, job=JOB, token=TOKEN,
                          controller=controller.address) as ps:
        outcome = ps.push(model, base_version=0).result(10)
        assert not outcome.applied and outcome.delay is None
        assert outcome.reason == "dropped by the controller: would_idle_server: test"
        assert ps.pull(timeout=10)[0] == 0  # nothing reached the server
    assert sample(controller.metrics.drops, reason="would_idle_server") == 1
    assert sample(server.metrics.updates_applied) == 0


def test_a_planned_later_start_is_let_go_when_its_time_comes(cluster):
    gate = threading.Event()

    def hold_until_gate(snap: Snapshot) -> list[PlanItem]:
        start = snap.now if gate.is_set() else snap.now + 0.05
        return [PlanItem(t.id, start=start, position=0, planned_seconds=0.01)
                for t in snap.pending]

    server, controller, model = cluster(hold_until_gate)
    with mlfabric.connect(server.address, job=JOB, token=TOKEN,
                          controller=controller.address) as ps:
        fut = ps.push(model, base_version=0)
        wait_until(lambda: controller.metrics.decision_seconds._sum.get() > 0)
        assert not fut.done()  # held: re-planned every 50 ms, not let go
        gate.set()
        assert fut.result(10).applied


def test_controller_loss_with_fifo_fallback_sends_waiting_updates(cluster, caplog):
    def never(snap: Snapshot) -> list[PlanItem]:
        return [PlanItem(t.id, start=snap.now + 3600) for t in snap.pending]

    server, controller, model = cluster(never)
    with mlfabric.connect(server.address, job=JOB, token=TOKEN,
                          controller=controller.address, controller_fallback="fifo") as ps:
        futures = [ps.push(model, base_version=0) for _ in range(3)]
        wait_until(lambda: sample(controller.metrics.requests) == 3)
        controller.__exit__(None, None, None)  # the controller dies
        assert [f.result(10).applied for f in futures] == [True, True, True]
        assert ps.push(model, base_version=3).result(10).applied  # still works without it
    assert "sending updates at once (fifo)" in caplog.text


def test_controller_loss_with_wait_fallback_resends_after_restart(cluster, loop_kind):
    port = free_port()
    hold = threading.Event()

    def hold_then_go(snap: Snapshot) -> list[PlanItem]:
        start = snap.now if hold.is_set() else snap.now + 3600
        return [PlanItem(t.id, start=start) for t in snap.pending]

    server, controller, model = cluster(hold_then_go, port=port)
    with mlfabric.connect(server.address, job=JOB, token=TOKEN,
                          controller=controller.address, controller_fallback="wait") as ps:
        fut = ps.push(model, base_version=0)
        wait_until(lambda: sample(controller.metrics.requests) == 1)
        controller.__exit__(None, None, None)
        hold.set()
        restarted = ServerThread(None, loop_kind=loop_kind, port=port, endpoint=Controller(
            hold_then_go, job=JOB, token=TOKEN, tau_max=None))
        with restarted:
            assert fut.result(15).applied  # re-requested from the new controller
            assert sample(restarted.metrics.requests) == 1


def test_wait_fallback_gives_up_with_a_reason(cluster):
    def never(snap: Snapshot) -> list[PlanItem]:
        return [PlanItem(t.id, start=snap.now + 3600) for t in snap.pending]

    server, controller, model = cluster(never)
    with mlfabric.connect(server.address, job=JOB, token=TOKEN,
                          controller=controller.address, controller_fallback="wait",
                          controller_timeout=0.5) as ps:
        fut = ps.push(model, base_version=0)
        wait_until(lambda: sample(controller.metrics.requests) == 1)
        controller.__exit__(None, None, None)
        with pytest.raises(ConnectionLost, match="unreachable for 0 s; this update was not"):
            fut.result(15)
        assert ps.pull(timeout=10)[0] == 0


def test_unreachable_controller_at_connect(cluster, caplog):
    server, _, model = cluster()
    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(ConnectError, match="cannot reach the controller"):
        mlfabric.connect(server.address, job=JOB, token=TOKEN, controller=dead,
                         controller_fallback="wait", controller_timeout=1)
    with mlfabric.connect(server.address, job=JOB, token=TOKEN, controller=dead) as ps:
        assert ps.push(model, base_version=0).result(10).applied
    assert "unreachable: sending updates at once" in caplog.text


def test_closing_the_client_fails_updates_still_waiting(cluster):
    def never(snap: Snapshot) -> list[PlanItem]:
        return [PlanItem(t.id, start=snap.now + 3600) for t in snap.pending]

    server, controller, model = cluster(never)
    ps = mlfabric.connect(server.address, job=JOB, token=TOKEN, controller=controller.address)
    fut = ps.push(model, base_version=0)
    ps.close()
    with pytest.raises(ConnectionLost, match="closed before the controller let this update go"):
        fut.result(10)
    wait_until(lambda: controller.metrics.pending._value.get() == 0, what="forgotten")
