"""Who may use an agent's control API, and how they prove it, without I/O.

An agent serves every job on its host, so it cannot hold each job's token.
Two kinds of credential open its control connections (issue 33):

* the **cluster token** (`mlfabric agent --cluster-token-file`), the
  operator's secret, which every agent of the cluster holds: peer agents open
  probe sessions with it, and the operator's tools change an agent's peers;
* a job's **agent key**, derived from the cluster token for one job
  (`mlfabric token agent-key`): the job's controller reads estimates with it
  and its workers report their transfers. It cannot open probe sessions or
  change peers, and one job's key says nothing about another's or about the
  cluster token (an HMAC of the job's name under the cluster token).

Every control connection opens with a login, as the job handshake
(`wire.handshake`) does: LOGIN(role, job, name, nonce) -> CHALLENGE(nonce',
agent proof) -> PROVE(client proof) -> ACK(0), or ERROR(0, why) and close.
Both sides prove they hold the key by an HMAC over both nonces; the key never
crosses the wire. Keys are random (the cluster token is checked as a job
token is, `auth.load_token`; a job key is an HMAC output), so a recorded
login is no oracle for them.

From the proof on, every frame carries a MAC (`agent_protocol.Connection.
protect`), under keys derived as a job session's are (`auth.frame_keys`)
from the credential's key, the role and job, and both nonces: one key per
direction, fresh per connection. The agent protects the connection before
its ACK(0); the client right after sending its proof (an ERROR refusing
that proof still comes plain).

`AgentGate` is the agent's side: one `GateStep` per event a client sends,
saying what to answer, and whether the event may be served or the
connection must close (counted, and nothing changed).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from ..errors import AuthenticationError, ConfigError
from . import agent_protocol as probe
from . import auth

CLUSTER: Final = "cluster"
JOB: Final = "job"
KEY_PREFIX: Final = "mlfabric-agent-key-v1"
MAX_JOB: Final = 128

# What each role may send once logged in. Peer agents and the operator hold
# the cluster token; a job's members read estimates and report transfers.
_ALLOWED: Final = {
    CLUSTER: (probe.Hello, probe.Ping, probe.GetEstimates, probe.TransferReport,
              probe.SetPeers),
    JOB: (probe.Ping, probe.GetEstimates, probe.TransferReport),
}
KEY_ADVICE: Final = (
    "read estimates and report transfers with the job's agent key (`mlfabric token agent-key "
    "--cluster-token-file FILE --job JOB KEYFILE`); open probe sessions and set peers with "
    "the cluster token"
)


@dataclass(frozen=True)
class AgentCredential:
    """What a client logs in to an agent with: the cluster token (role
    "cluster"), or one job's agent key (role "job", with its job)."""

    role: str
    job: str
    key: bytes

    def __repr__(self) -> str:  # never the key
        return f"AgentCredential(role={self.role!r}, job={self.job!r})"


def cluster_credential(token: bytes) -> AgentCredential:
    return AgentCredential(CLUSTER, "", token)


def derive_job_key(cluster_token: bytes, job: str) -> bytes:
    """Job `job`'s agent key: 256 bits no one derives without the cluster token."""
    return hmac.new(cluster_token, b"mlfabric-agent-job-key-v1\x00" + job.encode(),
                    hashlib.sha256).digest()


def format_job_key(cluster_token: bytes, job: str) -> str:
    """The text of job `job`'s agent key file: prefix, job, key (one line)."""
    _check_job(job)
    key = base64.urlsafe_b64encode(derive_job_key(cluster_token, job)).decode().rstrip("=")
    return f"{KEY_PREFIX}:{job}:{key}"


def parse_job_key(text: str, where: str) -> AgentCredential:
    """The credential in an agent key file's text (`where`: for messages)."""
    prefix, _, rest = text.strip().partition(":")
    job, _, key = rest.rpartition(":")
    if prefix != KEY_PREFIX or not job or not key:
        raise ConfigError(f"{where} is not an agent key (it should read '{KEY_PREFIX}:JOB:KEY'): "
                          f"make one with `mlfabric token agent-key`")
    try:
        raw = base64.urlsafe_b64decode(key + "=" * (-len(key) % 4))
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32:
        raise ConfigError(f"{where} holds a damaged key (not 32 bytes of base64url): make it "
                          f"again with `mlfabric token agent-key`")
    return AgentCredential(JOB, job, raw)


def load_job_key(path: str | os.PathLike[str]) -> AgentCredential:
    p = Path(path)
    try:
        text = p.read_text(encoding="ascii")
    except FileNotFoundError:
        raise ConfigError(f"agent key file {str(p)!r} does not exist: the operator makes it "
                          f"with `mlfabric token agent-key`") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read agent key file {str(p)!r}: {exc}") from None
    return parse_job_key(text, f"agent key file {str(p)!r}")


def _check_job(job: str) -> str:
    if not job.strip() or len(job.encode()) > MAX_JOB or ":" in job:
        raise ConfigError(f"job name {job!r} cannot have an agent key: it must be 1-{MAX_JOB} "
                          f"bytes, not blank, without ':'")
    return job


def _context(role: str, job: str) -> str:
    """What the proofs bind besides the nonces: the role and the job."""
    return f"agent-login:{role}:{job}"


# --- the client's side ---------------------------------------------------------


class AgentLogin:
    """The dialling side: `login()`, then `on_challenge(event)` (the PROVE to
    send, after checking the agent's proof), then `on_welcome(event)`."""

    def __init__(self, credential: AgentCredential, name: str) -> None:
        self.credential = credential
        self.name = name
        self.nonce = auth.new_nonce()
        self._server_nonce: bytes | None = None

    def login(self) -> probe.Login:
        c = self.credential
        return probe.Login(c.role, c.job, self.name, self.nonce)

    def on_challenge(self, event: probe.Event) -> probe.Prove:
        c = self.credential
        if isinstance(event, probe.Error):
            raise AuthenticationError(f"the agent refused the login: {event.message}")
        if not isinstance(event, probe.Challenge):
            raise AuthenticationError(f"expected the agent's challenge, got "
                                      f"{type(event).__name__}")
        ctx = _context(c.role, c.job)
        if not auth.proofs_match(auth.server_proof(c.key, ctx, self.nonce, event.nonce),
                                 event.proof):
            # (the agent learns nothing from a proof it cannot check either:
            # the connection closes without one)
            raise AuthenticationError(
                "the agent did not prove it holds the cluster token: check the "
                + ("cluster token file" if c.role == CLUSTER else "job's agent key file")
                + " and the agent's address")
        self._server_nonce = event.nonce
        return probe.Prove(auth.client_proof(c.key, ctx, self.nonce, event.nonce))

    def frame_keys(self) -> tuple[bytes, bytes]:
        """(send, receive) keys of this connection's frame MACs, once the
        agent's challenge has checked out (`on_challenge`)."""
        if self._server_nonce is None:
            raise RuntimeError("no frame keys before the agent's challenge checked out")
        c = self.credential
        to_agent, from_agent = auth.frame_keys(c.key, _context(c.role, c.job), self.nonce,
                                               self._server_nonce)
        return to_agent, from_agent

    @staticmethod
    def on_welcome(event: probe.Event) -> None:
        if isinstance(event, probe.Error):
            raise AuthenticationError(f"the agent refused the login: {event.message}")
        if not isinstance(event, probe.Ack):
            raise AuthenticationError(f"expected the agent's welcome, got {type(event).__name__}")


# --- the agent's side -----------------------------------------------------------


@dataclass(frozen=True)
class GateStep:
    """What the agent does with one event: answer `send` (if any); `serve`
    the event; or refuse it (`refused`: the reason counted, e.g. "auth") and
    close the connection after `send`. `keys`: at the login's success, the
    (send, receive) keys to protect the connection with before `send`."""

    send: probe.Event | None = None
    serve: bool = False
    refused: str | None = None
    why: str = ""  # for the agent's log
    keys: tuple[bytes, bytes] | None = field(default=None, repr=False)


class AgentGate:
    """One control connection's login and permissions, agent side.
    `role` and `job` say who logged in (None before)."""

    def __init__(self, cluster_token: bytes) -> None:
        self._cluster_token = cluster_token
        self.stage = "login"
        self.role: str | None = None
        self.job = ""
        self.client = "?"
        self._key = b""
        self._nonce = b""
        self._client_nonce = b""

    def on_event(self, event: probe.Event) -> GateStep:
        if self.stage == "login":
            if not isinstance(event, probe.Login):
                rid = getattr(event, "request_id", 0)
                return self._refuse("unauthenticated", probe.Error(
                    rid, f"log in first: this agent serves only authenticated clients "
                         f"({type(event).__name__} before a login); {KEY_ADVICE}"))
            return self._on_login(event)
        if self.stage == "prove":
            if not isinstance(event, probe.Prove):
                return self._refuse("unauthenticated", probe.Error(
                    0, f"expected the login's proof, got {type(event).__name__}"))
            expected = auth.client_proof(self._key, _context(self.role or "", self.job),
                                         self._client_nonce, self._nonce)
            if not auth.proofs_match(expected, event.proof):
                self.role = None
                return self._refuse("auth", probe.Error(
                    0, "authentication failed: check the cluster token or the job's agent key, "
                       "and the address"), why="wrong key")
            self.stage = "ready"
            to_agent, from_agent = auth.frame_keys(
                self._key, _context(self.role or "", self.job), self._client_nonce, self._nonce)
            return GateStep(send=probe.Ack(0), keys=(from_agent, to_agent))
        if self.stage != "ready":
            raise RuntimeError(f"the connection was refused ({self.stage}): no more events")
        assert self.role is not None
        if isinstance(event, _ALLOWED[self.role]):
            return GateStep(serve=True)
        rid = getattr(event, "request_id", 0)
        who = "the cluster token" if self.role == CLUSTER else f"job {self.job!r}'s agent key"
        return self._refuse("forbidden", probe.Error(
            rid, f"{type(event).__name__} is not allowed with {who}: {KEY_ADVICE}"))

    def _on_login(self, event: probe.Login) -> GateStep:
        self.client = event.name
        if event.role == CLUSTER and not event.job:
            self._key = self._cluster_token
        elif event.role == JOB and event.job and len(event.job.encode()) <= MAX_JOB:
            self._key = derive_job_key(self._cluster_token, event.job)
        else:
            return self._refuse("unauthenticated", probe.Error(
                0, f"unknown login role {event.role!r} (job {event.job!r}): log in as "
                   f"'cluster' or as 'job' with the job's name"))
        self.role, self.job = event.role, event.job
        self._client_nonce = event.nonce
        self._nonce = auth.new_nonce()
        self.stage = "prove"
        proof = auth.server_proof(self._key, _context(self.role, self.job), event.nonce,
                                  self._nonce)
        return GateStep(send=probe.Challenge(self._nonce, proof))

    def _refuse(self, reason: str, answer: probe.Error, why: str = "") -> GateStep:
        self.stage = "refused"
        return GateStep(send=answer, refused=reason, why=why or answer.message)
