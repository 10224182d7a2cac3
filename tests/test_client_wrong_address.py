"""A client given the wrong address says what answered and what it wanted
(issue 33), live: a controller's, an aggregator's, an agent's or a metrics
port given as the server; the server's, a metrics port or an agent's given
as the controller, or a controller that refuses the worker (another job's,
another token), which used to leave the worker training unscheduled with
one log line ("unreachable")."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from prometheus_client import CollectorRegistry, start_http_server

import mlfabric
from mlfabric import config
from mlfabric.agent.aggregator import Aggregator
from mlfabric.agent.daemon import Agent, AgentConfig
from mlfabric.client import aio
from mlfabric.controller.controller import Controller
from mlfabric.controller.status_cli import fetch_status
from mlfabric.errors import AuthenticationError, ConfigError, WrongPeer
from mlfabric.runtime.loop_thread import LoopThread
from mlfabric.scheduling.plan import fifo_policy
from mlfabric.server.store import ParameterStore

from support import (
    CLUSTER_TOKEN,
    JOB,
    TOKEN,
    WRONG_TOKEN,
    ServerThread,
    free_port,
    make_model,
    sample,
)


@contextlib.contextmanager
def metrics_port():
    """A Prometheus metrics port, as every mlfabric command serves one."""
    httpd, thread = start_http_server(free_port(), addr="127.0.0.1",
                                      registry=CollectorRegistry())
    try:
        yield f"127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)


@contextlib.contextmanager
def agent_port():
    """An agent's control port (the agent on a loop of its own)."""
    runner = LoopThread(name="test-agent")
    agent = Agent(AgentConfig("hA", cluster_token=CLUSTER_TOKEN, host="127.0.0.1", port=0,
                              counters=None))
    try:
        runner.run(agent.start(), 10)
        yield f"127.0.0.1:{agent.port}"
    finally:
        runner.run(agent.stop(), 10)
        runner.stop()


@contextlib.contextmanager
def listener(kind: str):
    """(address, endpoint or None) of a process of `kind`."""
    if kind == "controller":
        with ServerThread(None, endpoint=Controller(fifo_policy, job=JOB, token=TOKEN,
                                                    tau_max=None)) as st:
            yield st.address, st.server
    elif kind == "aggregator":
        with ServerThread(None, endpoint=Aggregator(job=JOB, token=TOKEN,
                                                    servers=["127.0.0.1:1"])) as st:
            yield st.address, st.server
    elif kind == "metrics":
        with metrics_port() as address:
            yield address, None
    else:
        with agent_port() as address:
            yield address, None


FOUND = {"controller": "a controller", "aggregator": "an aggregator",
         "metrics": "an HTTP server (a metrics port?)", "agent": "an mlfabric agent's port"}


@pytest.mark.parametrize("kind", list(FOUND))
def test_a_client_given_another_process_as_its_server_names_it(kind):
    """Before: 'unexpected Pull message' from a controller or aggregator (after
    a handshake that succeeded), 'handshake not completed in time' from a
    metrics port, 'closed the connection during the handshake' from an agent.
    Now one line at connect, and nothing is sent to a listener of another role
    past its challenge: it never counts the client as connected."""
    with listener(kind) as (address, endpoint):
        with pytest.raises(WrongPeer) as exc:
            mlfabric.connect(address, job=JOB, token=TOKEN, timeout=5)
        assert str(exc.value) == (f"{address} is {FOUND[kind]}, not a parameter server: give "
                                  f"the address of the job's `mlfabric server`")
        assert exc.value.address == address
        if endpoint is not None:
            assert sample(endpoint.metrics.connected_clients) == 0
            assert sample(endpoint.metrics.auth_failures) == 0


def test_the_asyncio_client_names_it_too():
    async def main(address: str) -> None:
        with pytest.raises(WrongPeer, match=rf"^{address} is a controller, not a parameter "
                                            r"server: give the address of the job's "
                                            r"`mlfabric server`$"):
            await aio.connect(address, job=JOB, token=TOKEN, timeout=5)

    with listener("controller") as (address, _):
        asyncio.run(main(address))


def test_config_connect_names_the_setting_that_holds_the_address(tmp_path):
    token_file = tmp_path / "job.token"
    token_file.write_bytes(TOKEN)
    token_file.chmod(0o600)
    with metrics_port() as address:
        s = config.resolve({"token_file": str(token_file)},
                           environ={"MLFABRIC_SERVER": address, "MLFABRIC_JOB": JOB})
        with pytest.raises(ConfigError) as exc:
            config.connect(s)
    assert str(exc.value) == (
        f"{address} is an HTTP server (a metrics port?), not a parameter server: give the "
        f"address of the job's `mlfabric server` (setting server (from MLFABRIC_SERVER))")


def test_status_given_the_servers_address_names_it():
    with ServerThread(ParameterStore(make_model())) as server:
        address = server.address
        with pytest.raises(WrongPeer) as exc:
            fetch_status(address, JOB, TOKEN, timeout=5)
    assert str(exc.value) == (
        f"{address} is a parameter server, not a controller: give the address of the job's "
        f"`mlfabric controller` (--controller)")


def test_a_replica_still_serves_as_a_parameter_server():
    """A worker connects to a replica too (worker-driven replication, and a
    promoted replica after a failover): that role passes."""
    from mlfabric.replication.replica import ReplicaServer
    from mlfabric.runtime.metrics import ServerMetrics

    replica = ReplicaServer(ParameterStore(make_model()), job=JOB, token=TOKEN,
                            metrics=ServerMetrics())
    with ServerThread(None, endpoint=replica) as st, \
            mlfabric.connect(st.address, job=JOB, token=TOKEN, timeout=5) as ps:
        assert ps.pull(timeout=10)[0] == 0


# --- the wrong controller: an error at connect, never a silent fallback -----------


@contextlib.contextmanager
def not_a_controller(kind: str, server: ServerThread):
    """The address of something that is no controller of the job."""
    if kind == "server":
        yield server.address
    else:
        with listener(kind) as (address, _):
            yield address


NOT_A_CONTROLLER = {"server": "a parameter server", "aggregator": "an aggregator",
                    "metrics": "an HTTP server (a metrics port?)",
                    "agent": "an mlfabric agent's port"}


@pytest.mark.parametrize("fallback", ["fifo", "wait"])
@pytest.mark.parametrize("kind", list(NOT_A_CONTROLLER))
def test_a_worker_given_another_process_as_its_controller_fails_at_connect(kind, fallback):
    """Whatever the fallback: 'fifo' is for a controller that does not
    answer, and these answer."""
    with ServerThread(ParameterStore(make_model())) as server, \
            not_a_controller(kind, server) as address:
        with pytest.raises(WrongPeer) as exc:
            mlfabric.connect(server.address, job=JOB, token=TOKEN, controller=address,
                             controller_fallback=fallback, timeout=5)
        assert str(exc.value) == (f"{address} is {NOT_A_CONTROLLER[kind]}, not a controller: "
                                  f"give the address of the job's `mlfabric controller`")


@pytest.mark.parametrize("fallback", ["fifo", "wait"])
@pytest.mark.parametrize("other", ["job", "token"])
def test_a_controller_that_refuses_the_worker_is_an_error_at_connect(other, fallback):
    """Another job's controller, or the job's with another token: both look
    the same to the worker (the controller names neither its job nor why),
    and neither lets the worker in."""
    ctl = Controller(fifo_policy, job="other" if other == "job" else JOB,
                     token=TOKEN if other == "job" else WRONG_TOKEN, tau_max=None)
    with ServerThread(ParameterStore(make_model())) as server, \
            ServerThread(None, endpoint=ctl) as controller:
        with pytest.raises(AuthenticationError) as exc:
            mlfabric.connect(server.address, job=JOB, token=TOKEN,
                             controller=controller.address, controller_fallback=fallback,
                             timeout=5)
        assert str(exc.value) == (
            f"authentication failed: the controller at {controller.address} did not prove it "
            f"holds job '{JOB}''s token; check the token file, the job name and that the "
            f"address is the job's controller")
        assert controller.call(lambda: len(ctl.state.workers)) == 0  # it never let it in


def test_config_connect_names_the_controller_setting(tmp_path):
    token_file = tmp_path / "job.token"
    token_file.write_bytes(TOKEN)
    token_file.chmod(0o600)
    with ServerThread(ParameterStore(make_model())) as server:
        address = server.address
        s = config.resolve({"token_file": str(token_file)},
                           environ={"MLFABRIC_SERVER": address, "MLFABRIC_JOB": JOB,
                                    "MLFABRIC_CONTROLLER": address})
        with pytest.raises(ConfigError) as exc:
            config.connect(s)
    assert str(exc.value) == (
        f"{address} is a parameter server, not a controller: give the address of the job's "
        f"`mlfabric controller` (setting controller (from MLFABRIC_CONTROLLER))")
