"""The handshake every mlfabric connection opens with, both sides, without I/O.

    client                          listener (server, replica, controller, aggregator)
    HELLO(job, name, nonce)   ->
                              <-    CHALLENGE(nonce', server proof, role)
    AUTH(client proof)        ->    (only once the server proof is checked; else
                                     ERROR(auth), which carries no proof, and close)
                              <-    WELCOME(...)  or  ERROR(auth | protocol) and close

Each side proves it holds the job's token (`auth`): the token never crosses
the wire. The listener proves itself first, and a client sends its own
proof only to a listener whose proof it checked (issue 33): an impostor a
client was steered to (an aggregator dialling the server a member names)
gets no proof made with the token, so nothing to test token guesses
against offline. A peer that has not authenticated learns nothing from a refusal:
a hello for another job gets a challenge as any (its proof made with a
random key), and a wrong job and a wrong token are refused with the same
words, so the refusal neither names the listener's job nor says whether
the job asked for is served here (issue 33). The listener's own log says
which it was. The challenge names the listener's role (server, replica,
controller, aggregator): no secret, and it lets a client that dialled the
wrong kind of process say so (`roles.wrong_role`) instead of failing later
on a message that listener does not take. `ClientHandshake` is the
dialling side, one step per event the listener sends; `ServerHandshake`
the listening side, one `Step` per event the peer sends, saying what to
send, whom to refuse and why, or that the peer is in. The transports only
carry the steps out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import AuthenticationError, MlfabricError, ProtocolError, ServerError
from . import auth
from .protocol import Auth, Challenge, Error, Hello, Welcome


def handshake_error(event: Error) -> MlfabricError:
    """The exception for an ERROR a listener answers the handshake with."""
    if event.code == "auth":
        return AuthenticationError(event.message)
    if event.code == "protocol":
        return ProtocolError(event.message)
    return ServerError(f"{event.message} (server error code {event.code!r})", code=event.code)


#: What a client tells a listener whose proof it did not accept (no more than
#: that: the listener's own log says a wrong token or job).
REFUSED_LISTENER = "authentication failed: this listener did not prove it holds the job's token"


class ClientHandshake:
    """The dialling side: `hello()`, then `on_challenge(event)` (the AUTH to
    send), `verify_server()`, then `on_welcome(event)`."""

    def __init__(self, job: str, token: bytes, name: str) -> None:
        self.job = job
        self.token = token
        self.name = name
        self.nonce = auth.new_nonce()
        self.server_nonce: bytes | None = None
        self.server_verified = False

    def hello(self) -> Hello:
        return Hello(job=self.job, client=self.name, nonce=self.nonce)

    def on_challenge(self, event: Any) -> Auth | Error:
        """The event to send: the Auth with this client's proof if the
        listener's proof is right; otherwise an ERROR(auth) that carries no
        proof (then `verify_server()` raises). The ERROR lets the listener
        log and count the mismatch, as it does a wrong proof."""
        if isinstance(event, Error):
            raise handshake_error(event)
        if not isinstance(event, Challenge):
            raise ProtocolError(f"expected a challenge from the server, got {type(event).__name__}")
        expected = auth.server_proof(self.token, self.job, self.nonce, event.nonce)
        self.server_verified = auth.proofs_match(expected, event.proof)
        self.server_nonce = event.nonce
        if not self.server_verified:
            return Error(code="auth", message=REFUSED_LISTENER)
        return Auth(proof=auth.client_proof(self.token, self.job, self.nonce, event.nonce))

    def frame_keys(self) -> tuple[bytes, bytes]:
        """(send, receive) keys of this session's frame MACs, once the
        challenge is answered (`Connection.protect`)."""
        assert self.server_nonce is not None, "no challenge answered yet"
        c2s, s2c = auth.frame_keys(self.token, self.job, self.nonce, self.server_nonce)
        return c2s, s2c

    def verify_server(self, what: str = "server", address: str | None = None) -> None:
        """Raise unless the listener (a `what` at `address`) proved it holds the token."""
        if not self.server_verified:
            at = f" at {address}" if address is not None else ""
            raise AuthenticationError(
                f"authentication failed: the {what}{at} did not prove it holds job "
                f"{self.job!r}'s token; check the token file, the job name and that the "
                f"address is the job's {what}"
            )

    def on_welcome(self, event: Any) -> Welcome:
        if isinstance(event, Error):
            raise handshake_error(event)
        if not isinstance(event, Welcome):
            raise ProtocolError(f"expected a welcome from the server, got {type(event).__name__}")
        return event


@dataclass(frozen=True)
class Step:
    """What the listener does after one event of the handshake: send `send`,
    or refuse with ERROR(`code`, `message`) and close (`why`: for its log),
    or, `ready`, welcome the peer."""

    send: Any = None
    code: str | None = None
    message: str = ""
    why: str = ""
    ready: bool = False


class ServerHandshake:
    """The listening side, for a `role` ("server", "replica", "controller",
    "aggregator") of `job`. `stage`: hello -> auth -> ready (or refused)."""

    def __init__(self, job: str, token: bytes, role: str) -> None:
        self.job = job
        self.token = token
        self.role = role
        self.stage = "hello"
        self.client = "?"  # the peer's name, from its hello
        self._other_job: str | None = None  # the job a hello asked for, if not ours
        self._nonce = b""
        self._client_nonce = b""

    def on_event(self, event: Any) -> Step:
        if self.stage == "hello":
            if not isinstance(event, Hello):
                return self._refuse("protocol", f"expected a hello, got {type(event).__name__}")
            self.client = event.client
            # Another job's hello goes on as any, with a proof no token
            # makes: it is refused at its auth, as a wrong token is.
            self._other_job = event.job if event.job != self.job else None
            self._client_nonce = event.nonce
            self._nonce = auth.new_nonce()
            key = self.token if self._other_job is None else auth.new_nonce()
            proof = auth.server_proof(key, self.job, event.nonce, self._nonce)
            self.stage = "auth"
            return Step(send=Challenge(nonce=self._nonce, proof=proof, role=self.role))
        if self.stage != "auth":
            raise RuntimeError(f"the handshake is over ({self.stage}): no more events for it")
        # A client that did not accept this listener's proof says so
        # (ClientHandshake.on_challenge) instead of sending its own: a token
        # or job mismatch, refused and counted as a wrong proof is.
        refused_us = isinstance(event, Error) and event.code == "auth"
        if not isinstance(event, Auth) and not refused_us:
            return self._refuse("protocol",
                                f"expected an auth message, got {type(event).__name__}")
        if refused_us or self._other_job is not None or not auth.proofs_match(
                auth.client_proof(self.token, self.job, self._client_nonce, self._nonce),
                event.proof):
            return self._refuse(
                "auth",
                "authentication failed: check the job name, the token file and the address",
                why="wrong token" if self._other_job is None else
                f"wrong job {self._other_job!r}")
        self.stage = "ready"
        return Step(ready=True)

    def frame_keys(self) -> tuple[bytes, bytes]:
        """(send, receive) keys of this session's frame MACs, once the peer
        is in (`Connection.protect`)."""
        assert self.stage == "ready", "the peer is not in"
        c2s, s2c = auth.frame_keys(self.token, self.job, self._client_nonce, self._nonce)
        return s2c, c2s

    def _refuse(self, code: str, message: str, why: str = "") -> Step:
        self.stage = "refused"
        return Step(code=code, message=message, why=why or message)
