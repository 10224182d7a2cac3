"""Both sides of the handshake (mlfabric.wire.handshake), sans I/O: every
event goes through the real codec as bytes, so the test also holds what
crosses the wire."""

from __future__ import annotations

import pytest

from mlfabric.errors import AuthenticationError, ProtocolError, ServerError
from mlfabric.wire import auth
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
    # The client checked the server's proof first and sent none of its own,
    # only a refusal the server counts (issue 33).
    assert not client.server_verified
    with pytest.raises(AuthenticationError, match="token"):
        client.verify_server()


def test_a_listener_that_has_not_proven_itself_gets_no_proof():
    """Issue 33: the client proved itself first, so any listener it was
    steered to got an HMAC of the token over nonces it chose, to test token
    guesses against offline. Now a challenge with a wrong proof is answered
    with a refusal that carries nothing made with the token."""
    client = ClientHandshake(JOB, TOKEN, "w0")
    client.hello()
    nonce = b"n" * auth.NONCE_BYTES
    forged = Challenge(nonce=nonce, proof=b"\0" * 32, role="server")
    answer = over_the_wire(client.on_challenge(over_the_wire(forged)))
    assert answer == Error(code="auth", message="authentication failed: this listener did "
                                                "not prove it holds the job's token")
    with pytest.raises(AuthenticationError, match="did not prove it holds job 'job'"):
        client.verify_server()
    # the same challenge with the right proof is answered with the client's
    right = Challenge(nonce=nonce, role="server",
                      proof=auth.server_proof(TOKEN, JOB, client.nonce, nonce))
    answer = client.on_challenge(over_the_wire(right))
    assert answer == Auth(proof=auth.client_proof(TOKEN, JOB, client.nonce, nonce))


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
    step = server.on_event(Hello(job=JOB, client="w0", nonce=b"n" * auth.NONCE_BYTES))
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
    return ServerThread(None, endpoint=Aggregator(job=JOB_LIVE, token=TOKEN_LIVE,
                                                  servers=["127.0.0.1:1"]))


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


# --- the wrong kind of listener is named (issue 33) ------------------------------


@pytest.mark.parametrize("role", ["server", "replica", "controller", "aggregator"])
def test_the_challenge_names_the_listeners_role_whatever_the_job(role):
    """The role is no secret: a hello for another job gets it too, and still
    learns nothing of the listener's job."""
    for job in (JOB, "other"):
        step = ServerHandshake(JOB, TOKEN, role).on_event(
            over_the_wire(ClientHandshake(job, TOKEN, "w0").hello()))
        challenge = over_the_wire(step.send)
        assert isinstance(challenge, Challenge) and challenge.role == role


def test_a_hello_ends_with_a_newline_so_that_an_http_server_answers_it():
    """An HTTP server reads a request line up to its newline: the hello's
    fields end with one, so a metrics port answers (400) instead of waiting."""
    from mlfabric.wire.protocol import HEADER

    data = Connection().send_bytes(ClientHandshake(JOB, TOKEN, "w0").hello())
    assert data.endswith(b"}\n") and b"\n" not in data[HEADER.size:-1]
    assert isinstance(over_the_wire(ClientHandshake(JOB, TOKEN, "w0").hello()), Hello)


@pytest.mark.parametrize("role, what, found", [
    ("controller", "parameter server", "a controller"),
    ("aggregator", "parameter server", "an aggregator"),
    ("server", "controller", "a parameter server"),
    ("replica", "controller", "a replica server"),
    ("server", "aggregator", "a parameter server"),
    ("controller", "replica server", "a controller"),
])
def test_a_listener_of_another_role_is_named_with_what_was_wanted(role, what, found):
    from mlfabric.errors import WrongPeer
    from mlfabric.wire.roles import command_for, wrong_role

    err = wrong_role(role, what, "10.0.0.5:7071")
    assert isinstance(err, WrongPeer) and err.address == "10.0.0.5:7071"
    article = "an" if what[0] in "aeiou" else "a"
    assert str(err) == (f"10.0.0.5:7071 is {found}, not {article} {what}: give the address "
                        f"of the job's `{command_for(what)}`")


@pytest.mark.parametrize("role, what", [
    ("server", "parameter server"), ("replica", "parameter server"),
    ("server", "replica server"), ("replica", "replica server"),
    ("controller", "controller"), ("aggregator", "aggregator"),
    ("controller", "something new")])
def test_the_roles_that_serve_what_was_wanted_pass(role, what):
    """A replica serves workers that replicate to it, and a promoted replica
    is a server: both answer for either; a kind the table does not know is
    not checked."""
    from mlfabric.wire.roles import wrong_role

    assert wrong_role(role, what, "h:1") is None


@pytest.mark.parametrize("head, found", [
    (b"HTTP/1.1 400 Bad Request\r\n", "an HTTP server (a metrics port?)"),
    (b"HTTP/1.0 400 Bad request version\r\n", "an HTTP server (a metrics port?)"),
    # Python's http.server answers a line it cannot read as HTTP/1.x with the
    # error page alone (as to HTTP/0.9): that is what a metrics port does.
    (b'<!DOCTYPE HTML>\n<html lang="en">', "an HTTP server (a metrics port?)"),
    (b"<html><body>400</body></html>", "an HTTP server (a metrics port?)"),
])
def test_bytes_of_an_http_server_are_named(head, found):
    from mlfabric.wire.roles import foreign_peer

    assert str(foreign_peer(head, "parameter server", "h:9471")) == (
        f"h:9471 is {found}, not a parameter server: give the address of the job's "
        f"`mlfabric server`")


def test_an_agents_error_frame_is_named():
    from mlfabric.wire import agent_protocol as probe
    from mlfabric.wire.roles import foreign_peer

    head = probe.Connection().send(probe.Error(0, "bad frame magic b'MLFB'"))
    assert str(foreign_peer(head, "controller", "h:7400")) == (
        "h:7400 is an mlfabric agent's port, not a controller: give the address of the "
        "job's `mlfabric controller`")


def test_other_bytes_are_shown_as_they_came():
    from mlfabric.wire.roles import foreign_peer

    assert str(foreign_peer(b"SSH-2.0-OpenSSH_9.6\r\n", "parameter server", "h:22")) == (
        "h:22 does not speak mlfabric's protocol (it answered b'SSH-2.0-OpenSSH_9.6\\r\\n'): "
        "give the address of the job's `mlfabric server`")


def test_bad_magic_keeps_the_first_bytes_for_the_diagnosis():
    from mlfabric.errors import NotMlfabric

    rx = Connection()
    page = b"<!DOCTYPE HTML>\n<html lang='en'>" + b"x" * 200
    rx.receive_data(page)
    with pytest.raises(NotMlfabric, match="bad frame magic") as exc:
        rx.next_event()
    assert exc.value.head == page[:64]
