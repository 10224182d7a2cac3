"""A worker without its controller is never silent (issue 33), live: where
nothing answers at the controller's address, at connect or later, a worker
with controller_fallback "fifo" goes on pushing straight to the server, and
says so in its log and its metrics; once the controller answers, the
worker reports the time and updates without it, and `mlfabric status`
shows them (and the workers that disconnected)."""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

import pytest

import mlfabric
from mlfabric.controller.controller import Controller
from mlfabric.controller.status_cli import fetch_status, format_status
from mlfabric.runtime.metrics import ClientMetrics
from mlfabric.scheduling.plan import fifo_policy
from mlfabric.server.store import ParameterStore

from support import JOB, TOKEN, ServerThread, free_port, make_model, sample


class WatchedController(Controller):
    """A controller that says when a worker came back and when one left."""

    def __init__(self) -> None:
        super().__init__(fifo_policy, job=JOB, token=TOKEN, tau_max=None)
        self.back = threading.Event()
        self.left = threading.Event()

    def on_fell_back(self, conn: Any, ev: Any) -> None:
        super().on_fell_back(conn, ev)
        self.back.set()

    def on_lost(self, conn: Any) -> None:
        super().on_lost(conn)
        if conn.client == "w1":
            self.left.set()


def status_lines(address: str) -> list[str]:
    return format_status(fetch_status(address, JOB, TOKEN, timeout=10), address).splitlines()


def without_it(lines: list[str], updates: int) -> None:
    """The status lists w1 among the workers that came back, with `updates`."""
    i = lines.index("workers that went on without this controller (it did not answer them) "
                    "and came back:")
    assert lines[i + 1].split() == ["name", "host", "updates", "sent", "straight", "to", "the",
                                    "server", "time", "without", "it"]
    assert re.fullmatch(rf"  w1 \(127\.0\.0\.1:\d+\)\s+127\.0\.0\.1\s+{updates}\s+\d+\.\d s",
                        lines[i + 2]), lines[i + 2]


def test_a_controller_down_at_connect_is_a_warning_a_metric_and_then_a_status_line(caplog):
    caplog.set_level(logging.WARNING, logger="mlfabric.client")
    model = make_model()
    port = free_port()
    address = f"127.0.0.1:{port}"
    metrics = ClientMetrics()
    with ServerThread(ParameterStore(make_model())) as server, \
            mlfabric.connect(server.address, job=JOB, token=TOKEN, name="w1",
                             controller=address, metrics=metrics) as ps:
        # (the refusal's words are the event loop's: uvloop's and asyncio's differ)
        assert re.search(rf"controller {address} unreachable at connect \(cannot reach the "
                         rf"controller at {address}: .+; is `mlfabric controller` running "
                         rf"there\?\): pushes go straight to the server, unscheduled "
                         rf"\(controller_fallback 'fifo'\), until it answers \(dialled every "
                         rf"0\.5 s\)", caplog.text), caplog.text
        assert sample(metrics.controller_unreachable) == 1
        for version in range(2):
            assert ps.push(model, base_version=version).result(10).applied
        assert sample(metrics.controller_fallback_updates) == 2
        assert sample(server.metrics.updates_applied) == 2
        ctl = WatchedController()
        with ServerThread(None, endpoint=ctl, port=port) as controller:
            assert ctl.back.wait(10), "the worker did not dial the controller again"
            assert sample(metrics.controller_unreachable) == 0
            # Scheduled again: this push goes through the controller.
            assert ps.push(model, base_version=2).result(10).applied
            assert sample(controller.metrics.requests) == 1
            assert sample(metrics.controller_fallback_updates) == 2
            without_it(status_lines(address), updates=2)
            ps.close()
            assert ctl.left.wait(10)
            lines = status_lines(address)
            i = lines.index("disconnected workers (finished, died, or lost this controller: "
                            "with controller_fallback 'fifo' those send straight to the "
                            "server until they reconnect):")
            assert re.fullmatch(r"  w1 \(127\.0\.0\.1:\d+\)\s+127\.0\.0\.1\s+1\s+\d+\.\d s ago",
                                lines[i + 2]), lines[i + 2]
    assert "answers after" in caplog.text and "2 updates went straight to the server" \
        in caplog.text


def test_a_controller_lost_later_is_loud_and_reported_when_it_answers_again(caplog):
    caplog.set_level(logging.WARNING, logger="mlfabric.client")
    model = make_model()
    port = free_port()
    address = f"127.0.0.1:{port}"
    metrics = ClientMetrics()
    first = ServerThread(None, endpoint=WatchedController(), port=port).__enter__()
    try:
        with ServerThread(ParameterStore(make_model())) as server, \
                mlfabric.connect(server.address, job=JOB, token=TOKEN, name="w1",
                                 controller=address, metrics=metrics) as ps:
            assert ps.push(model, base_version=0).result(10).applied
            assert sample(first.metrics.requests) == 1
            assert sample(metrics.controller_unreachable) == 0
            first.__exit__(None, None, None)  # the controller dies
            assert ps.push(model, base_version=1).result(10).applied  # unscheduled
            assert sample(metrics.controller_fallback_updates) == 1
            assert sample(metrics.controller_unreachable) == 1
            assert "sending updates at once (fifo) until it is back, unscheduled" in caplog.text
            ctl = WatchedController()
            with ServerThread(None, endpoint=ctl, port=port):
                assert ctl.back.wait(10), "the worker did not dial the controller again"
                assert sample(metrics.controller_unreachable) == 0
                assert ps.push(model, base_version=2).result(10).applied
                without_it(status_lines(address), updates=1)
    finally:
        if first._thread.is_alive():  # stopped above unless a check failed first
            first.__exit__(None, None, None)


@pytest.mark.parametrize("fallback", ["fifo", "wait"])
def test_a_controller_that_stops_answering_the_handshake_is_an_outage(fallback):
    """Something accepts the connection and says nothing (a hung or stopped
    controller): no answer is no refusal. 'fifo' goes on without it, as
    where nothing listens; 'wait' raises at connect, naming it."""
    import socket

    from mlfabric.errors import ConnectError

    with ServerThread(ParameterStore(make_model())) as server, socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        address = f"127.0.0.1:{mute.getsockname()[1]}"
        metrics = ClientMetrics()
        if fallback == "wait":
            with pytest.raises(ConnectError) as exc:
                mlfabric.connect(server.address, job=JOB, token=TOKEN, controller=address,
                                 controller_fallback="wait", controller_timeout=0.2)
            assert str(exc.value) == (
                f"the controller at {address} accepted the connection but did not answer the "
                f"handshake within 0.2 s: it is hung, or not `mlfabric controller`")
            return
        with mlfabric.connect(server.address, job=JOB, token=TOKEN, controller=address,
                              controller_timeout=0.2, metrics=metrics) as ps:
            assert sample(metrics.controller_unreachable) == 1
            assert ps.push(make_model(), base_version=0).result(10).applied
            assert sample(metrics.controller_fallback_updates) == 1
