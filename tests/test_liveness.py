"""Every push resolves within the client's push_timeout, whatever it waits
on: a controller that never lets it go (withdrawn, not sent, and the
controller forgets it), a server that never answers (the fate is unknown,
and the message says so), or a replica that never confirms (the push
completes with the server's outcome). Both clients, both loops."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import mlfabric
from mlfabric.controller.controller import Controller
from mlfabric.errors import ConfigError, PushTimeout
from mlfabric.replication.replica import ReplicaServer
from mlfabric.runtime.metrics import ServerMetrics
from mlfabric.scheduling.plan import PlanItem
from mlfabric.server.store import ParameterStore

from support import JOB, TOKEN, ServerThread, make_model, random_update


def never_policy(snap):
    """A controller that plans nothing: every transfer waits for ever."""
    return [PlanItem(t.id) for t in snap.pending]


class StuckChain:
    """Chain replication to a replica that never acknowledges: the server
    applies each push and then never answers it."""

    def forward(self, event, version):
        return asyncio.get_running_loop().create_future()

    async def close(self):
        pass


def test_a_push_the_controller_never_lets_go_is_withdrawn(loop_kind):
    model = make_model()
    controller_ep = Controller(never_policy, job=JOB, token=TOKEN, tau_max=None)
    with ServerThread(ParameterStore(model), loop_kind=loop_kind) as server, \
            ServerThread(None, endpoint=controller_ep, loop_kind=loop_kind) as controller, \
            mlfabric.connect(server.address, job=JOB, token=TOKEN,
                             controller=controller.address, push_timeout=0.5) as ps:
        started = time.monotonic()
        fut = ps.push(random_update(model, seed=1), base_version=0)
        with pytest.raises(PushTimeout, match=r"gave no directive for this update within "
                                              r"0\.5 s \(push_timeout\): it was not sent"):
            fut.result(10)
        assert 0.5 <= time.monotonic() - started < 3.0
        # The controller was told: nothing of it is left pending there.
        deadline = time.monotonic() + 5
        while controller.call(lambda: len(controller_ep.state.pending)):
            assert time.monotonic() < deadline, "the controller kept the withdrawn transfer"
            time.sleep(0.02)
        assert ps.pull(timeout=5)[0] == 0  # never sent, never applied


def test_a_push_the_server_never_answers_fails_saying_its_fate_is_unknown(loop_kind):
    model = make_model()
    with ServerThread(ParameterStore(model), loop_kind=loop_kind) as server:
        server.server.chain = StuckChain()
        with mlfabric.connect(server.address, job=JOB, token=TOKEN, push_timeout=0.5) as ps:
            fut = ps.push(random_update(model, seed=1), base_version=0)
            with pytest.raises(PushTimeout, match=rf"the server at {server.address} has not "
                                                  rf"answered this push within 0\.5 s "
                                                  rf"\(push_timeout\): it may or may not have "
                                                  rf"applied it"):
                fut.result(10)
            assert isinstance(fut.exception(), TimeoutError)  # catchable as one
            assert ps.pull(timeout=5)[0] == 1  # it was applied; the link still serves


def test_the_controller_forgets_a_transfer_whose_push_timed_out_at_the_server(loop_kind):
    """The worker tells the controller the transfer ended without an outcome,
    so it is not kept in flight (reserving link time, counted by the
    divergence gate) for ever."""
    from mlfabric.scheduling.plan import fifo_policy

    model = make_model()
    controller_ep = Controller(fifo_policy, job=JOB, token=TOKEN, tau_max=None)
    with ServerThread(ParameterStore(model), loop_kind=loop_kind) as server, \
            ServerThread(None, endpoint=controller_ep, loop_kind=loop_kind) as controller:
        server.server.chain = StuckChain()
        with mlfabric.connect(server.address, job=JOB, token=TOKEN,
                              controller=controller.address, push_timeout=0.5) as ps:
            fut = ps.push(random_update(model, seed=1), base_version=0)
            with pytest.raises(PushTimeout, match="may or may not have applied it"):
                fut.result(10)
            deadline = time.monotonic() + 5
            while controller.call(lambda: len(controller_ep.state.active)
                                  + len(controller_ep.state.pending)):
                assert time.monotonic() < deadline, "the controller kept the transfer"
                time.sleep(0.02)


def test_asyncio_client_pushes_resolve_within_push_timeout(run_async, loop_kind):
    from mlfabric.client import aio

    model = make_model()
    controller_ep = Controller(never_policy, job=JOB, token=TOKEN, tau_max=None)

    async def main(server, controller):
        async with await aio.connect(server.address, job=JOB, token=TOKEN,
                                     controller=controller.address, push_timeout=0.5) as ps:
            with pytest.raises(PushTimeout, match="gave no directive"):
                await ps.push(random_update(model, seed=1), base_version=0)
        server.server.chain = StuckChain()
        async with await aio.connect(server.address, job=JOB, token=TOKEN,
                                     push_timeout=0.5) as ps:
            with pytest.raises(PushTimeout, match="may or may not have applied it"):
                await ps.push(random_update(model, seed=2), base_version=0)

    with ServerThread(ParameterStore(model), loop_kind=loop_kind) as server, \
            ServerThread(None, endpoint=controller_ep, loop_kind=loop_kind) as controller:
        run_async(main(server, controller), timeout=20)


def test_a_replica_that_never_confirms_does_not_hold_the_push(loop_kind):
    """The replica holds update 1 behind a missing 0... here: its sequencer
    waits for a number no one sends, so it never answers; the push completes
    with the server's outcome after replica_timeout."""
    model = make_model()
    replica_ep = ReplicaServer(ParameterStore(model), job=JOB, token=TOKEN,
                               metrics=ServerMetrics())
    store = ParameterStore(model)
    store.apply(0, random_update(model, seed=0))  # version 1, never sent to the replica
    with ServerThread(store, loop_kind=loop_kind) as server, \
            ServerThread(None, endpoint=replica_ep, loop_kind=loop_kind) as replica, \
            mlfabric.connect(server.address, job=JOB, token=TOKEN, replica=replica.address,
                             replica_timeout=0.5) as ps:
        started = time.monotonic()
        outcome = ps.push(random_update(model, seed=1), base_version=1).result(10)
        waited = time.monotonic() - started
        assert (outcome.applied, outcome.version) == (True, 2)
        assert 0.5 <= waited < 3.0, waited
        # The replica still holds it, waiting for 1 (its gap is reported).
        assert replica.call(lambda: sorted(replica_ep.sequencer.pending)) == [2]
        assert replica.call(replica_ep.gap_seconds) > 0


@pytest.mark.parametrize("bad", [0, -1.0])
def test_push_timeout_must_be_positive(bad):
    with pytest.raises(ConfigError, match=f"push_timeout must be positive seconds .*got {bad}"):
        mlfabric.connect("127.0.0.1:1", job=JOB, token=TOKEN, push_timeout=bad)


def test_threads_of_the_blocking_client_end_with_it():
    model = make_model()
    before = threading.active_count()
    with ServerThread(ParameterStore(model)) as server:
        with mlfabric.connect(server.address, job=JOB, token=TOKEN, push_timeout=1.0) as ps:
            ps.pull(timeout=5)
        deadline = time.monotonic() + 5
        while threading.active_count() > before + 1:  # + the server's thread
            assert time.monotonic() < deadline, [t.name for t in threading.enumerate()]
            time.sleep(0.02)
