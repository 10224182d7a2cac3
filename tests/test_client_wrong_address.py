"""A client given the wrong address says what answered and what it wanted
(issue 33), live: a controller's, an aggregator's, an agent's or a metrics
port given as the server, the server's given as the controller."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest
from prometheus_client import CollectorRegistry, start_http_server

import mlfabric
from mlfabric import config
from mlfabric.agent.aggregator import Aggregator
from mlfabric.agent.daemon import Agent, AgentConfig
from mlfabric.client import aio
from mlfabric.controller.controller import Controller
from mlfabric.controller.status_cli import fetch_status
from mlfabric.errors import ConfigError, WrongPeer
from mlfabric.runtime.loop_thread import LoopThread
from mlfabric.scheduling.plan import fifo_policy
from mlfabric.server.store import ParameterStore

from support import JOB, TOKEN, ServerThread, free_port, make_model, sample


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
    # Only the port matters here; the agent's control API takes a cluster
    # token once its login (a change under way beside this one) is in.
    login = ({"cluster_token": TOKEN} if "cluster_token" in
             {f.name for f in dataclasses.fields(AgentConfig)} else {})
    agent = Agent(AgentConfig("hA", host="127.0.0.1", port=0, counters=None, **login))
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
        with ServerThread(None, endpoint=Aggregator(job=JOB, token=TOKEN)) as st:
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
