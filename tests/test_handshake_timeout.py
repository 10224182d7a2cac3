"""--handshake-timeout on every listening command: accepted, checked, applied.

A peer that connects and never proves it holds the token is dropped after
the configured time, not the default 10 s."""

from __future__ import annotations

import queue
import re
import signal
import socket
import subprocess
import threading
import time

import pytest

from support import JOB, TOKEN, cluster_token_file, free_port
from test_cli import Server, mlfabric_cmd


def token_file(tmp_path):
    token = tmp_path / "job.token"
    token.write_bytes(TOKEN)
    token.chmod(0o600)
    return token


def command(kind: str, tmp_path, *extra: str) -> list[str]:
    token = str(token_file(tmp_path))
    if kind == "controller":
        return mlfabric_cmd("controller", "--listen", "127.0.0.1:0", "--job", JOB,
                            "--token-file", token, *extra)
    assert kind == "aggregator"
    return mlfabric_cmd("agent", "--name", "a1", "--listen", f"127.0.0.1:{free_port()}",
                        "--cluster-token-file", str(cluster_token_file()),
                        "--aggregate", f"127.0.0.1:{free_port()}", "--job", JOB,
                        "--token-file", token, "--servers", "127.0.0.1:7070", *extra)


class Process:
    """A listening command in a subprocess, with the address its ready line names."""

    def __init__(self, argv: list[str], cwd, pattern: str) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=cwd)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout]
                         + [lines.put(None)], daemon=True).start()
        line = lines.get(timeout=30)
        if line is None:
            self.proc.wait(10)
            pytest.fail(self.proc.stderr.read())
        m = re.search(pattern, line)
        assert m, line
        self.address = m.group(1)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(15)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(5)


def seconds_until_dropped(address: str) -> float:
    """Connect, send nothing, and time how long until the listener closes."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as silent:
        started = time.monotonic()
        silent.settimeout(5.0)  # bounded: well under the default 10 s
        try:
            while silent.recv(1 << 16):
                pass  # a challenge, if the listener sends one first; then EOF
        except ConnectionResetError:
            pass
        return time.monotonic() - started


def test_the_server_drops_a_silent_peer_after_the_configured_time(tmp_path):
    server = Server(tmp_path, "--handshake-timeout", "0.5")
    try:
        waited = seconds_until_dropped(server.address)
    finally:
        server.stop()
    assert 0.45 <= waited < 3.0, waited


@pytest.mark.parametrize(("kind", "pattern"), [
    ("controller", r"serving job '[^']+' on (\S+)"),
    ("aggregator", r"aggregating job '[^']+' on (\S+)"),
])
def test_the_controller_and_aggregator_drop_a_silent_peer_after_the_configured_time(
        tmp_path, kind, pattern):
    proc = Process(command(kind, tmp_path, "--handshake-timeout", "0.5"), tmp_path, pattern)
    try:
        waited = seconds_until_dropped(proc.address)
    finally:
        assert proc.stop() == 0
    assert 0.45 <= waited < 3.0, waited


@pytest.mark.parametrize("kind", ["server", "controller", "aggregator"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_handshake_timeout_that_is_not_positive_is_refused(tmp_path, kind, value):
    if kind == "server":
        argv = mlfabric_cmd("server", "--listen", "127.0.0.1:0", "--job", JOB, "--token-file",
                            str(token_file(tmp_path)), "--init", "unused.npz",
                            "--handshake-timeout", value)
    else:
        argv = command(kind, tmp_path, "--handshake-timeout", value)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    shown = float(value)
    assert (f"error: --handshake-timeout must be a positive number of seconds, got {shown}"
            in proc.stderr), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_the_agent_refuses_a_handshake_timeout_without_its_aggregator(tmp_path):
    """The agent's own port has no handshake: the flag would do nothing."""
    proc = subprocess.run(
        mlfabric_cmd("agent", "--listen", f"127.0.0.1:{free_port()}",
                     "--handshake-timeout", "5"),
        capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert ("mlfabric agent: error: --job, --token-file, --servers, --group-timeout and "
            "--handshake-timeout belong to --aggregate HOST:PORT (the agent's aggregator); "
            "give it too") in proc.stderr
