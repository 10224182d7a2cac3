"""Who may use an agent's control API (issue 33).

Measured before: without any token a client could replace an agent's peers
(its probe trains then went to any address named), plant a transfer report
that set a path to 8,000 Tbit/s, read every estimate, and with 300 fake
Hellos stop another agent's probing. Now every control connection logs in:
the cluster token (peer agents, the operator) or a job's agent key (read
estimates, report transfers). Real agents, really started, on loopback.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from mlfabric.agent.daemon import Agent, AgentClient, AgentConfig
from mlfabric.agent.estimator import ProbeConfig
from mlfabric.cli import main as cli_main
from mlfabric.errors import AuthenticationError, ConfigError, IntegrityError
from mlfabric.runtime.metrics import AgentMetrics
from mlfabric.wire import agent_auth
from mlfabric.wire import agent_protocol as probe
from mlfabric.wire.agent_auth import AgentCredential, AgentGate, AgentLogin

from support import (
    CLUSTER,
    CLUSTER_TOKEN,
    JOB,
    JOB_AGENT_KEY,
    WRONG_TOKEN,
    cluster_token_file,
    free_port,
    sample,
)

LOCAL = "127.0.0.1"


def _config(name: str, **kw) -> AgentConfig:
    return AgentConfig(name=name, cluster_token=CLUSTER_TOKEN, host=LOCAL, port=0,
                       counters=None, backoff_max=0.2,
                       probe=ProbeConfig(max_packets=64, initial_bps=50e6, stale_after=0.5),
                       **kw)


async def _pair(**kw) -> tuple[Agent, Agent]:
    a, b = Agent(_config("a", **kw)), Agent(_config("b", **kw))
    await a.start()
    await b.start()
    a.set_peers({"b": (LOCAL, b.port)})
    b.set_peers({"a": (LOCAL, a.port)})
    return a, b


async def _measured(agent: Agent, peer: str) -> None:
    """Until `agent` has a fresh estimate of `peer` (bounded: 5 s)."""
    deadline = asyncio.get_running_loop().time() + 5
    while agent.estimates()[peer][0].stale:
        await agent.wait_trains(peer, 1, max(0.01, deadline - asyncio.get_running_loop().time()))


async def _stop(*agents: Agent) -> None:
    for ag in agents:
        await asyncio.wait_for(ag.stop(), 10)


def _gate_login(gate: AgentGate, credential: AgentCredential) -> probe.Event | None:
    """Run a login through `gate`; the agent's last answer."""
    flow = AgentLogin(credential, "w0")
    step = gate.on_event(flow.login())
    if step.refused:
        return step.send
    step = gate.on_event(flow.on_challenge(step.send))
    return step.send


# --- the login, without I/O ----------------------------------------------------


def test_each_role_may_send_what_it_needs_and_nothing_more() -> None:
    gate = AgentGate(CLUSTER_TOKEN)
    assert _gate_login(gate, JOB_AGENT_KEY) == probe.Ack(0)
    assert (gate.role, gate.job) == ("job", JOB)
    assert gate.on_event(probe.GetEstimates(7)).serve
    assert gate.on_event(probe.TransferReport("h1", 1 << 20, 0.1)).serve
    step = gate.on_event(probe.SetPeers(8, ()))
    assert step.refused == "forbidden" and not step.serve
    assert step.send == probe.Error(8, "SetPeers is not allowed with job 'testjob''s agent key: "
                                    + agent_auth.KEY_ADVICE)
    assert gate.stage == "refused"  # and the connection closes

    gate = AgentGate(CLUSTER_TOKEN)
    assert _gate_login(gate, CLUSTER) == probe.Ack(0)
    for ev in (probe.Hello("h1", 1), probe.SetPeers(1, ()), probe.GetEstimates(2),
               probe.Ping(1, 2), probe.TransferReport("h1", 1 << 20, 0.1)):
        assert gate.on_event(ev).serve, ev
    # what only an agent sends to the one that opened the connection
    assert gate.on_event(probe.TrainReport(1, 1, 1, 0.0, False, ())).refused == "forbidden"


def test_a_login_keys_the_frame_macs_per_connection_and_direction() -> None:
    """The agent's (send, receive) keys are the client's (receive, send):
    each reads what the other sends; a frame sent back to its sender, or one
    from another connection of the same credential, fails its check."""
    keys = []
    for _ in range(2):
        gate, flow = AgentGate(CLUSTER_TOKEN), AgentLogin(JOB_AGENT_KEY, "w0")
        with pytest.raises(RuntimeError, match="no frame keys before"):
            flow.frame_keys()
        challenge = gate.on_event(flow.login()).send
        step = gate.on_event(flow.on_challenge(challenge))
        assert step.send == probe.Ack(0) and step.keys is not None
        assert step.keys == tuple(reversed(flow.frame_keys()))
        assert step.keys[0] != step.keys[1]
        keys.append(flow.frame_keys())
    assert not set(keys[0]) & set(keys[1])  # fresh per connection
    client, agent = probe.Connection(), probe.Connection()
    client.protect(*keys[0])
    agent.protect(keys[0][1], keys[0][0])
    agent.receive_data(client.send(probe.GetEstimates(3)))
    assert agent.next_event() == probe.GetEstimates(3)
    other = probe.Connection()
    other.protect(*keys[1])
    agent.receive_data(other.send(probe.GetEstimates(4)))
    with pytest.raises(IntegrityError):
        agent.next_event()
    # a wrong proof is refused before any keys
    gate = AgentGate(CLUSTER_TOKEN)
    gate.on_event(AgentLogin(CLUSTER, "x").login())
    assert gate.on_event(probe.Prove(bytes(32))).keys is None


def test_a_request_before_the_login_is_refused_and_says_how_to_log_in() -> None:
    step = AgentGate(CLUSTER_TOKEN).on_event(probe.SetPeers(5, ()))
    assert step.refused == "unauthenticated" and not step.serve
    assert isinstance(step.send, probe.Error) and step.send.request_id == 5
    assert step.send.message.startswith("log in first: this agent serves only authenticated "
                                        "clients (SetPeers before a login); read estimates")


def test_a_wrong_key_is_refused_and_the_agent_proves_nothing_to_its_holder() -> None:
    # a client with the wrong cluster token: the agent's proof does not check out
    gate = AgentGate(CLUSTER_TOKEN)
    flow = AgentLogin(agent_auth.cluster_credential(WRONG_TOKEN), "x")
    challenge = gate.on_event(flow.login()).send
    with pytest.raises(AuthenticationError, match="the agent did not prove it holds the "
                                                  "cluster token: check the cluster token"):
        flow.on_challenge(challenge)
    # a client that answers anyway is refused, and counted as "auth"
    wrong = probe.Prove(b"\0" * 32)
    step = gate.on_event(wrong)
    assert step.refused == "auth" and gate.role is None
    assert step.send == probe.Error(0, "authentication failed: check the cluster token or the "
                                       "job's agent key, and the address")
    # another job's key is no key for this job
    other = AgentCredential("job", JOB, agent_auth.derive_job_key(CLUSTER_TOKEN, "other"))
    with pytest.raises(AuthenticationError, match="check the job's agent key file"):
        _gate_login(AgentGate(CLUSTER_TOKEN), other)


def test_job_keys_round_trip_through_their_file_and_bind_the_job(tmp_path) -> None:
    text = agent_auth.format_job_key(CLUSTER_TOKEN, "digits")
    assert text.startswith("mlfabric-agent-key-v1:digits:") and CLUSTER_TOKEN.decode() not in text
    key = agent_auth.parse_job_key(text, "k")
    assert key == AgentCredential("job", "digits",
                                  agent_auth.derive_job_key(CLUSTER_TOKEN, "digits"))
    assert agent_auth.derive_job_key(CLUSTER_TOKEN, "digits") != \
        agent_auth.derive_job_key(CLUSTER_TOKEN, "digits2")
    assert "key=" not in repr(key) and repr(key) == "AgentCredential(role='job', job='digits')"
    with pytest.raises(ConfigError, match="is not an agent key"):
        agent_auth.parse_job_key("hello", "k")
    with pytest.raises(ConfigError, match="holds a damaged key"):
        agent_auth.parse_job_key(text[:-5], "k")
    with pytest.raises(ConfigError, match="cannot have an agent key"):
        agent_auth.format_job_key(CLUSTER_TOKEN, "a:b")
    with pytest.raises(ConfigError, match="does not exist: the operator makes it"):
        agent_auth.load_job_key(tmp_path / "missing")


def test_token_agent_key_command(tmp_path, capsys) -> None:
    out = tmp_path / "digits.key"
    argv = ["token", "agent-key", "--cluster-token-file", str(cluster_token_file()),
            "--job", "digits", str(out)]
    assert cli_main(argv) == 0
    assert capsys.readouterr().out == f"wrote job 'digits''s agent key to {out} (mode 0600)\n"
    assert agent_auth.load_job_key(out).key == agent_auth.derive_job_key(CLUSTER_TOKEN, "digits")
    assert (out.stat().st_mode & 0o777) == 0o600
    assert cli_main(argv) == 2  # kept
    assert "exists: keep it, or replace it with --force" in capsys.readouterr().err


# --- a real agent ---------------------------------------------------------------------


async def _raw(port: int, *events: probe.Event) -> list[probe.Event]:
    """Send `events` on a fresh control connection; what came back until it closed."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(LOCAL, port), 2)
    conn = probe.Connection()
    for ev in events:
        writer.write(conn.send(ev))
    await writer.drain()
    conn.receive_data(await asyncio.wait_for(reader.read(), 5))
    conn.receive_data(b"")
    writer.close()
    got = []
    while not isinstance(ev := conn.next_event(), probe.ConnectionClosed):
        got.append(ev)
    return got


def test_unauthenticated_requests_change_nothing_and_are_counted(run_async) -> None:
    """Today's attacks, without a login: a new peer list, a planted 400 Gbit/s
    transfer report, reading the estimates. Each is refused and counted; the
    peers, the estimate and the probing are as they were."""

    async def main() -> None:
        metrics = AgentMetrics()
        a = Agent(_config("a"), metrics=metrics)
        b = Agent(_config("b"))
        await a.start()
        await b.start()
        a.set_peers({"b": (LOCAL, b.port)})
        try:
            await _measured(a, "b")
            before = a.estimates()["b"]
            attacks = [probe.SetPeers(1, (probe.PeerAddress("evil", "192.0.2.1", 9),)),
                       probe.TransferReport("b", 50 << 20, 0.001),
                       probe.GetEstimates(2)]
            for ev in attacks:
                (answer,) = await _raw(a.port, ev)
                assert isinstance(answer, probe.Error), answer
                assert answer.message.startswith("log in first"), answer.message
            assert sample(metrics.refused, reason="unauthenticated") == 3
            assert sample(metrics.transfer_reports, result="accepted") == 0
            assert list(a.estimates()) == ["b"]
            assert a.estimates()["b"][0].bandwidth_bps <= 2 * max(before[0].bandwidth_bps, 1e9)
            # the job's key reads; it may not change the peers
            async with await AgentClient.connect(LOCAL, a.port, JOB_AGENT_KEY) as client:
                assert [e.peer for e in (await client.estimates()).estimates] == ["b"]
            async with await AgentClient.connect(LOCAL, a.port, JOB_AGENT_KEY) as client:
                with pytest.raises(ConfigError, match="SetPeers is not allowed with job "
                                                      "'testjob''s agent key"):
                    await client.set_peers({"evil": ("192.0.2.1", 9)})
            assert sample(metrics.refused, reason="forbidden") == 1
            assert list(a.estimates()) == ["b"]
            # the cluster token may
            async with await AgentClient.connect(LOCAL, a.port, CLUSTER) as client:
                await client.set_peers({"b": (LOCAL, b.port), "c": (LOCAL, 9)})
            assert sorted(a.estimates()) == ["b", "c"]
        finally:
            await _stop(a, b)

    run_async(main())


def test_a_wrong_key_is_an_error_on_both_sides(run_async) -> None:
    async def main() -> None:
        metrics = AgentMetrics()
        a = Agent(_config("a"), metrics=metrics)
        await a.start()
        try:
            with pytest.raises(AuthenticationError, match="the agent did not prove it holds "
                                                          "the cluster token: check the job's "
                                                          "agent key file"):
                await AgentClient.connect(LOCAL, a.port, AgentCredential(
                    "job", JOB, agent_auth.derive_job_key(WRONG_TOKEN, JOB)))
            # a client that sends a proof anyway
            flow = AgentLogin(agent_auth.cluster_credential(WRONG_TOKEN), "x")
            got = await _raw(a.port, flow.login(), probe.Prove(b"\0" * 32))
            assert isinstance(got[0], probe.Challenge)
            assert got[1] == probe.Error(0, "authentication failed: check the cluster token "
                                            "or the job's agent key, and the address")
            assert sample(metrics.refused, reason="auth") == 1
        finally:
            await _stop(a)

    run_async(main())


def test_fake_hellos_and_idle_connections_do_not_stop_probing(run_async) -> None:
    """300 fake Hellos stopped another agent's capacity sampling (4.3 samples/s
    fell to 0). Now a Hello needs the cluster token, and a connection that does
    not log in is closed after the login timeout."""

    async def main() -> None:
        metrics = AgentMetrics()
        a, b = await _pair(login_timeout=0.5)
        b.metrics = metrics
        try:
            await _measured(a, "b")
            fakes = [asyncio.open_connection(LOCAL, b.port) for _ in range(100)]
            streams = await asyncio.gather(*fakes)
            for i, (_, w) in enumerate(streams):
                w.write(probe.Connection().send(probe.Hello("a", 1000 + i)))
            idle = [await asyncio.open_connection(LOCAL, b.port) for _ in range(20)]
            # probing goes on meanwhile: a's trains are answered by b
            await a.wait_trains("b", 3, timeout=10)
            assert not a.estimates()["b"][0].stale
            for r, _ in idle:  # closed by b, unanswered, after the login timeout
                assert await asyncio.wait_for(r.read(), 5) == b""
            assert sample(metrics.refused, reason="unauthenticated") == 100
            assert sample(metrics.refused, reason="login-timeout") == 20
            for _, w in [*streams, *idle]:
                w.close()
        finally:
            await _stop(a, b)

    run_async(main())


def test_an_agent_without_a_cluster_token_does_not_start(tmp_path) -> None:
    argv = [sys.executable, "-m", "mlfabric", "agent", "--name", "a",
            "--listen", f"{LOCAL}:{free_port()}"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "mlfabric agent: error: an agent needs --cluster-token-file PATH: the cluster's secret, "
        "which every agent holds (make it once with `mlfabric token new cluster.token` and "
        "copy it to every host)")
    weak = tmp_path / "cluster.token"
    weak.write_text("our-cluster-secret-2026")
    proc = subprocess.run([*argv, "--cluster-token-file", str(weak)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "looks chosen by a person, not random" in proc.stderr
