"""The server's own report of each landing to the controller
(`mlfabric server --controller`, `server.landings.LandingFeed`): a real
server, controller and worker on loopback."""

from __future__ import annotations

import json
import logging

import pytest

import mlfabric
from mlfabric.controller.controller import Controller
from mlfabric.scheduling.plan import fifo_policy
from mlfabric.server.landings import LandingFeed
from mlfabric.server.store import ParameterStore
from mlfabric.wire.protocol import PushResult

from support import (
    JOB,
    TOKEN,
    ServerThread,
    free_port,
    make_model,
    random_update,
    sample,
    wait_until,
)


def _feed(server: ServerThread, controllers: list[str]) -> LandingFeed:
    """A feed on `server`'s loop, as `mlfabric server --controller` starts one."""
    feed = LandingFeed(controllers, job=JOB, token=TOKEN, shard=0, metrics=server.metrics)

    def start() -> None:
        server.server.landings = feed
        feed.start()

    server.call(start)
    return feed


def test_the_server_ends_each_transfer_at_the_controller_before_its_worker_reports(
        loop_kind, caplog):
    """The workers' reports are held back at the controller: each transfer
    ends all the same, at the version the server gave, as its landing
    comes from the server. Once the reports come, each transfer is counted
    once (the server's tally, the delays) and timed by its worker."""
    model = make_model()
    endpoint = Controller(fifo_policy, job=JOB, token=TOKEN, tau_max=None)
    done, held = endpoint.on_done, []
    endpoint.on_done = lambda conn, ev: held.append((conn, ev))  # type: ignore[method-assign]
    caplog.set_level(logging.INFO, logger="mlfabric.decisions")
    with ServerThread(ParameterStore(model), loop_kind=loop_kind) as server, \
            ServerThread(None, loop_kind=loop_kind, endpoint=endpoint) as controller:
        feed = _feed(server, [controller.address])
        wait_until(lambda: len(feed.links) == 1, what="the server's link to the controller")
        with mlfabric.connect(server.address, job=JOB, token=TOKEN,
                              controller=controller.address, host="worker-a") as ps:
            for i in range(3):
                outcome = ps.push(random_update(model, seed=i), base_version=i).result(10)
                assert (outcome.applied, outcome.version) == (True, i + 1)
            m = controller.metrics
            wait_until(lambda: sample(m.landings, result="first") == 3, what="3 landings")
            wait_until(lambda: len(held) == 3, what="the 3 workers' reports")
            state = endpoint.state
            assert controller.call(lambda: (len(state.active), state.version)) == (0, 3)
            assert sum(b.get() for b in m.delay._buckets) == 3
            controller.call(lambda: [done(conn, ev) for conn, ev in held])
            assert controller.call(lambda: state.servers["127.0.0.1"].applied) == 3
            assert sum(b.get() for b in m.delay._buckets) == 3  # not counted again
            assert m.actual_seconds._sum.get() > 0  # but timed
        assert sample(server.metrics.landings_reported, result="sent") == 3
        assert sample(m.landings, result="ignored") == 0
    events = [json.loads(r.getMessage()) for r in caplog.records
              if r.name == "mlfabric.decisions"]
    ends = [(e["event"], e["version"]) for e in events if e["event"] in ("landed", "done")]
    assert ends == [("landed", 1), ("landed", 2), ("landed", 3),
                    ("done", 1), ("done", 2), ("done", 3)]


def test_the_feed_dials_a_controller_that_starts_later_and_again_once_it_is_lost(loop_kind):
    """Nothing is queued while no controller is reached (the worker's report
    stands in): such a landing counts as unsent. A controller that starts
    later, or comes back after it was lost, is reached by the next dial."""
    port = free_port()
    answer = PushResult(req=1, applied=True, version=5, delay=0)
    with ServerThread(ParameterStore(make_model()), loop_kind=loop_kind) as server:
        feed = _feed(server, [f"127.0.0.1:{port}"])
        assert server.call(lambda: feed.report(7, 4, answer)) == 0
        assert sample(server.metrics.landings_reported, result="unsent") == 1
        for _ in range(2):  # a controller that starts late; then one that comes back
            endpoint = Controller(fifo_policy, job=JOB, token=TOKEN, tau_max=None)
            with ServerThread(None, loop_kind=loop_kind, endpoint=endpoint, port=port):
                wait_until(lambda: len(feed.links) == 1, timeout=15,
                           what="the feed's dial of the controller")
                assert server.call(lambda: feed.report(7, 4, answer)) == 1
                # Transfer 7 is no transfer of this controller's: ignored.
                wait_until(lambda e=endpoint: sample(e.metrics.landings, result="ignored") == 1)
            wait_until(lambda: not feed.links, what="the feed's loss of the controller")
        assert sample(server.metrics.landings_reported, result="sent") == 2


def test_a_landing_from_a_workers_link_is_a_protocol_error(loop_kind, run_async):
    """Only a server's landing reports end a transfer so: a worker's link
    that sends LANDED is closed, and the transfer stays."""
    import asyncio

    from mlfabric.client.link import open_link
    from mlfabric.wire.handshake import ClientHandshake
    from mlfabric.wire.protocol import Landed

    endpoint = Controller(fifo_policy, job=JOB, token=TOKEN, tau_max=None)
    with ServerThread(None, loop_kind=loop_kind, endpoint=endpoint) as controller:
        async def forge() -> None:
            link = await open_link(controller.address, ClientHandshake(JOB, TOKEN, "worker-a"),
                                   5.0, "controller")
            link.send(Landed(ticket=1, shard=0, base_version=0, version=1, applied=True))
            await asyncio.wait_for(asyncio.shield(link.closed), 5.0)

        run_async(forge())
        assert sample(endpoint.metrics.protocol_errors) == 1
        assert sample(endpoint.metrics.landings, result="first") == 0


def test_each_controller_numbers_its_tickets_from_its_own_random_start():
    """A server may report a landing, or hold a push, under the ticket of
    the controller that planned its shard before a hand-over, or before a
    restart: counted from the same start, the next controller's tickets
    would repeat those. Each starts at random instead; a state given a
    start counts up from it, and refuses one outside [1, MAX_FIRST_ID)."""
    from mlfabric.controller.state import MAX_FIRST_ID, ControlState

    def first_ticket(state: ControlState) -> int:
        t = state.request("w", 1, host="h", dst="s", nbytes=1, base_version=0, norm=1.0,
                          now=0.0)
        return t.id

    starts = {first_ticket(Controller(fifo_policy, job=JOB, token=TOKEN, tau_max=None).state)
              for _ in range(4)}
    assert len(starts) == 4 and all(1 <= s < MAX_FIRST_ID for s in starts)
    state = ControlState(fifo_policy, tau_max=None, first_id=MAX_FIRST_ID - 1)
    assert first_ticket(state) == MAX_FIRST_ID - 1
    assert first_ticket(ControlState(fifo_policy, tau_max=None)) == 1
    for bad in (0, MAX_FIRST_ID):
        with pytest.raises(ValueError, match=rf"first_id must be in \[1, {MAX_FIRST_ID}\), "
                                             rf"got {bad}"):
            ControlState(fifo_policy, tau_max=None, first_id=bad)
