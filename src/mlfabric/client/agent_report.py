"""Clients tell their host's agent about real transfers.

A finished push is a measurement of the path to the server (bytes over
seconds: a lower bound of what the path delivers); the agent uses it as a
passive sample (mlfabric.agent.estimator). Reporting is telemetry: it never delays
or fails a push. Reports go from a background thread through a bounded
queue; if the agent is unreachable they are dropped, with one warning. The
reporter logs in with the job's agent key (wire.agent_auth); a key the agent
refuses is a warning too, and the client goes on without reports. With the
client's TLS settings it dials the agent over mutual TLS (an agent started
with --tls-*).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import ssl
import threading

from ..errors import ConfigError, MlfabricError
from ..transport.agent_login import open_agent_blocking
from ..wire import agent_protocol as probe
from ..wire.agent_auth import AgentCredential, load_job_key
from .core import parse_address

log = logging.getLogger("mlfabric.client")

# Smaller transfers are dominated by latency, not bandwidth: not reported.
MIN_REPORT_BYTES = 1 << 16
_QUEUE = 1024


def job_agent_key(path: str | os.PathLike[str] | None, job: str) -> AgentCredential:
    """Job `job`'s agent key from `path`, for reporting to an agent."""
    if path is None:
        raise ConfigError("agent= needs agent_key_file=: the agent serves only clients that "
                          "log in; the operator makes the job's key with `mlfabric token "
                          f"agent-key --cluster-token-file FILE --job {job} KEYFILE`")
    key = load_job_key(path)
    if key.job != job:
        raise ConfigError(f"agent key file {str(path)!r} is job {key.job!r}'s, not job "
                          f"{job!r}'s: make this job's with `mlfabric token agent-key --job "
                          f"{job}`")
    return key


class TransferReporter:
    def __init__(self, address: str, credential: AgentCredential, timeout: float = 0.5,
                 name: str = "client", tls: ssl.SSLContext | None = None) -> None:
        """`tls`: the client context to dial the agent with (None: the
        process's own, `transport.tls.use_for_process`, else plain TCP)."""
        self.address = address
        self.credential = credential
        self.name = name
        self.tls = tls
        self._host, self._port = parse_address(address)
        self._timeout = timeout
        self._queue: queue.Queue[probe.TransferReport | None] = queue.Queue(_QUEUE)
        self._warned = False
        self.sent = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="mlfabric-agent-report",
                                        daemon=True)
        self._thread.start()

    def report(self, peer: str, nbytes: int, seconds: float) -> None:
        if nbytes < MIN_REPORT_BYTES or not seconds > 0:
            return
        try:
            self._queue.put_nowait(probe.TransferReport(peer, nbytes, seconds))
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        sock: socket.socket | None = None
        conn = probe.Connection()
        while (event := self._queue.get()) is not None:
            try:
                if sock is None:
                    sock, conn = open_agent_blocking(self._host, self._port, self.credential,
                                                     self.name, self._timeout, self.tls)
                sock.sendall(conn.send(event))
                self.sent += 1
                self._warned = False
            except (OSError, MlfabricError) as exc:
                self.dropped += 1
                if sock is not None:
                    sock.close()
                sock = None
                if not self._warned:
                    log.warning("cannot report transfers to the agent at %s (%s); dropping "
                                "reports until it answers", self.address, exc)
                    self._warned = True
        if sock is not None:
            sock.close()

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (bounded by `timeout`), then stop."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
