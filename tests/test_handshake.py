"""Both sides of the handshake (mlfabric.wire.handshake), sans I/O: every
event goes through the real codec as bytes, so the test also holds what
crosses the wire."""

from __future__ import annotations

import pytest

from mlfabric.errors import AuthenticationError, ProtocolError, ServerError
from mlfabric.wire.handshake import ClientHandshake, ServerHandshake, handshake_error
from mlfabric.wire.protocol import (
    NEED_DATA,
    Auth,
    Challenge,
    Connection,
    Error,
    Hello,
    Pull,
    Welcome,
)

from support import JOB as JOB_LIVE
from support import TOKEN as TOKEN_LIVE

JOB, TOKEN = "job", b"t" * 32


def over_the_wire(event):
    """`event` encoded by one Connection and decoded by another."""
    rx = Connection()
    rx.receive_data(Connection().send_bytes(event))
    got = rx.next_event()
    assert rx.next_event() is NEED_DATA
    return got


def converse(client: ClientHandshake, server: ServerHandshake):
    step = server.on_event(over_the_wire(client.hello()))
    if step.code is not None:
        return step
    auth = client.on_challenge(over_the_wire(step.send))
    return server.on_event(over_the_wire(auth))


def test_both_sides_agree_and_prove_each_other():
    client, server = ClientHandshake(JOB, TOKEN, "w0"), ServerHandshake(JOB, TOKEN, "server")
    hello = client.hello()
    assert (hello.job, hello.client, len(hello.nonce)) == (JOB, "w0", len(client.nonce))
    step = server.on_event(over_the_wire(hello))
    assert isinstance(step.send, Challenge) and server.stage == "auth"
    assert server.client == "w0"
    auth = client.on_challenge(over_the_wire(step.send))
    assert isinstance(auth, Auth) and client.server_verified
    client.verify_server()  # does not raise
    step = server.on_event(over_the_wire(auth))
    assert step.ready and step.code is None and server.stage == "ready"
    welcome = Welcome(version=3, tensors=(), tau_max=None, momentum=0.0, session="s")
    assert client.on_welcome(over_the_wire(welcome)) == welcome
    with pytest.raises(RuntimeError, match="the handshake is over"):
        server.on_event(auth)


def test_a_wrong_token_is_refused_by_both_sides():
    client = ClientHandshake(JOB, b"x" * 32, "w0")
    server = ServerHandshake(JOB, TOKEN, "server")
    step = converse(client, server)
    assert (step.code, step.why, server.stage) == ("auth", "wrong token", "refused")
    assert step.message == ("authentication failed: check the job name, the token file "
                            "and the address")
    # The client sent its proof all the same (the server counts the failure)
    # and then refuses the server's proof itself.
    assert not client.server_verified
    with pytest.raises(AuthenticationError, match="token"):
        client.verify_server()


def test_a_wrong_job_is_refused_as_a_wrong_token_and_named_only_in_the_log():
    """Issue 33: a refusal told a peer that had not authenticated the job's
    name. Now another job's hello gets a challenge as any, whose proof no
    token makes, and the same refusal as a wrong token: the peer learns
    neither the job's name nor whether the job it asked for is served."""
    wrong_job = ServerHandshake(JOB, TOKEN, "controller")
    client = ClientHandshake("other", TOKEN, "w0")
    step = converse(client, wrong_job)
    wrong_token = ServerHandshake(JOB, TOKEN, "controller")
    step2 = converse(ClientHandshake(JOB, b"y" * 32, "w0"), wrong_token)
    assert (step.code, step.message) == (step2.code, step2.message)
    assert f"'{JOB}'" not in step.message and "other" not in step.message
    assert (step.why, step2.why) == ("wrong job 'other'", "wrong token")
    # the challenge it got is as long as any, and its proof is no token's
    assert not client.server_verified
    with pytest.raises(AuthenticationError, match="did not prove it holds job 'other'"):
        client.verify_server()


@pytest.mark.parametrize("first", [Auth(proof=b"p" * 32), Pull(req=1)])
def test_anything_before_a_hello_is_a_protocol_error(first):
    step = ServerHandshake(JOB, TOKEN, "server").on_event(first)
    assert step.code == "protocol"
    assert step.message == f"expected a hello, got {type(first).__name__}"


def test_anything_but_an_auth_after_the_challenge_is_a_protocol_error():
    server = ServerHandshake(JOB, TOKEN, "server")
    server.on_event(ClientHandshake(JOB, TOKEN, "w0").hello())
    step = server.on_event(Hello(job=JOB, client="w0", nonce=b"n" * 16))
    assert (step.code, step.message) == ("protocol", "expected an auth message, got Hello")


def test_the_client_says_what_it_got_instead_and_what_the_server_said():
    client = ClientHandshake(JOB, TOKEN, "w0")
    with pytest.raises(ProtocolError, match="expected a challenge from the server, got Pull"):
        client.on_challenge(Pull(req=1))
    with pytest.raises(AuthenticationError, match=r"^nope$"):
        client.on_challenge(Error(code="auth", message="nope"))
    with pytest.raises(ProtocolError, match="expected a welcome from the server, got Pull"):
        client.on_welcome(Pull(req=1))
    err = handshake_error(Error(code="internal", message="boom"))
    assert isinstance(err, ServerError) and err.code == "internal"


# --- each role takes its own events (wire.roles), live ---------------------------


def _listener(role: str):
    from mlfabric.agent.aggregator import Aggregator
    from mlfabric.controller.controller import Controller
    from mlfabric.replication.replica import ReplicaServer
    from mlfabric.runtime.metrics import ServerMetrics
    from mlfabric.scheduling.plan import fifo_policy
    from mlfabric.server.store import ParameterStore

    from support import ServerThread, make_model

    if role == "server":
        return ServerThread(ParameterStore(make_model()))
    if role == "replica":
        return ServerThread(None, endpoint=ReplicaServer(
            ParameterStore(make_model()), job=JOB_LIVE, token=TOKEN_LIVE,
            metrics=ServerMetrics()))
    if role == "controller":
        return ServerThread(None, endpoint=Controller(fifo_policy, job=JOB_LIVE,
                                                      token=TOKEN_LIVE, tau_max=None))
    return ServerThread(None, endpoint=Aggregator(job=JOB_LIVE, token=TOKEN_LIVE))


@pytest.mark.parametrize("role, foreign", [
    ("server", "StatusRequest"), ("replica", "TransferDone"),
    ("controller", "Pull"), ("aggregator", "Ping")])
def test_a_listener_refuses_what_its_role_does_not_take(role, foreign):
    """After the handshake, an event of another role is a protocol error,
    answered as such and counted, before any handler sees it."""
    from mlfabric.wire import protocol as p
    from mlfabric.wire import roles

    from support import RawClient, sample

    events = {"StatusRequest": p.StatusRequest(req=1),
              "TransferDone": p.TransferDone(req=1, applied=True, version=1, delay=0,
                                             seconds=0.1),
              "Pull": p.Pull(req=1), "Ping": p.Ping(req=1)}
    event = events[foreign]
    assert not isinstance(event, getattr(roles, role.upper()))
    with _listener(role) as st:
        raw = RawClient(st.port)
        raw.send(event)
        answer = raw.recv_event()
        assert (answer.code, answer.message) == ("protocol", f"unexpected {foreign} message")
        assert raw.recv_event() is None  # and closed
        raw.close()
        metrics = st.server.metrics if hasattr(st, "server") else st.endpoint.metrics
        assert sample(metrics.protocol_errors) == 1
