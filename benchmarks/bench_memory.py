"""Memory a listener holds for abusive connections, and after they close (issue 33).

Each abuse runs against a real process started for it (`mlfabric agent`,
`mlfabric server` with a 16 MiB model and momentum), whose resident memory
(VmRSS, /proc/PID/status) is read before, at its peak while the abuse
holds, and after: once the process has closed every connection of the
abuse (its open descriptors back to their number before) and then
answered a new client (a login and an estimates request to the agent, a
handshake and a ping to the server), so the closes have been handled;
"closed in" is the time from the abuse's close to then.

* ``agent``: 500 connections to an agent's control port that never log
  in, every other one announcing a 1 MiB frame and sending 256 KiB of it,
  the rest a partial login frame; held open, then closed.
* ``pulls``: one authenticated client sends 256 pipelined pulls (7.8 KB
  of requests, 4 GiB of answers) and reads nothing, then disconnects.
* ``state``: one authenticated client sends 32 pipelined state requests
  (weights and momentum history: 32 MiB each) and reads nothing, then
  disconnects.
* ``pushes``: 16 authenticated clients each send half of a push of the
  whole model, then disconnect.

Before the limits (and with them, before a closed connection's buffers were
freed without waiting for the cyclic GC), the agent kept 534 MiB after its
500 connections closed, the server 4.2 GB after the pulls, 1.1 GB after
the state requests, and 150 MiB after the unfinished pushes.

    python benchmarks/bench_memory.py                  # 3 runs each, uvloop
    python benchmarks/bench_memory.py --loop asyncio --runs 5 --only agent
    python benchmarks/bench_memory.py --runs 1 --json  # machine-readable (tests/test_memory.py)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from mlfabric.transport.agent_login import blocking_login
from mlfabric.wire import agent_protocol as probe
from mlfabric.wire.agent_auth import cluster_credential
from mlfabric.wire.handshake import ClientHandshake
from mlfabric.wire.protocol import NEED_DATA, Connection, Ping, Pong, Pull, Push, StateRequest

JOB = "memjob"
TOKEN = "bnM7mD2m3tqXyW3Q9mHc8c3o2yZ0gq1nQ6bH5uVY3kE"  # random, as `mlfabric token new` makes
CLUSTER_TOKEN = "Jq2oS9l0mKf3n0W1dA2r7yXbT8cVpE5uHzL4gN6iQ1s"
MIB = 1 << 20
SCENARIOS = ("agent", "pulls", "state", "pushes")


def rss(pid: int) -> int:
    """The process's resident memory now, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout} s")
        time.sleep(0.01)


def secret(d: Path, name: str, text: str) -> Path:
    path = d / name
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


@contextlib.contextmanager
def process(argv: list[str], ready: str, env: dict[str, str]) -> Iterator[tuple[int, str]]:
    """`mlfabric ...argv` running, up to its start line: (pid, that line)."""
    proc = subprocess.Popen([sys.executable, "-m", "mlfabric", "--log-level", "ERROR", *argv],
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    out = proc.stdout
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(out.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=60)
        if ready not in line:
            raise RuntimeError(f"mlfabric {argv[0]} did not start: {line!r}")
        yield proc.pid, line
    finally:
        proc.terminate()
        proc.wait(15)


def address(line: str, after: str) -> tuple[str, int]:
    host, port = line.split(after)[1].split()[0].rsplit(":", 1)
    return host, int(port)


class Measured:
    """RSS of process `pid` before, at the peak of, and after an abuse;
    `served()` shows the process answers a new client."""

    def __init__(self, pid: int, served: Callable[[], None]) -> None:
        self.pid = pid
        self.served = served
        self.fds = open_fds(pid)
        self.before = rss(pid)
        self.peak = self.before
        self.after = 0
        self.settle_s = 0.0

    def hold(self, seconds: float) -> None:
        """Sample RSS while the abuse holds, for its peak (a measurement over
        time, not a synchronisation: sampling can only miss a higher peak)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.peak = max(self.peak, rss(self.pid))
            time.sleep(0.05)

    def settle(self, timeout: float = 60.0) -> None:
        """RSS once the process has closed the abuse's connections and then
        served a new client: the callbacks of those closes ran before it.
        Call right after closing them: `settle_s` is how long that took."""
        start = time.monotonic()
        wait_for(lambda: open_fds(self.pid) <= self.fds, timeout,
                 "return to the descriptors open before")
        self.served()
        self.after = rss(self.pid)
        self.settle_s = time.monotonic() - start

    def figures(self) -> dict[str, float]:
        return {"before_mib": self.before / MIB, "peak_mib": self.peak / MIB,
                "after_mib": self.after / MIB, "held_mib": (self.after - self.before) / MIB,
                "settle_s": self.settle_s}


# -- the agent: connections that never log in ------------------------------------------


def abuse_agent(d: Path, env: dict[str, str], connections: int) -> dict[str, float]:
    token = secret(d, "cluster.token", CLUSTER_TOKEN)
    with process(["agent", "--name", "mem", "--listen", "127.0.0.1:0",
                  "--cluster-token-file", str(token)], "ready", env) as (pid, line):
        host, port = address(line, " ready on ")

        def served() -> None:
            with socket.create_connection((host, port), timeout=10) as sock:
                conn = probe.Connection()
                blocking_login(sock, conn, cluster_credential(CLUSTER_TOKEN.encode()), "bench")
                sock.sendall(conn.send(probe.GetEstimates(1)))
                while isinstance(ev := conn.next_event(), probe.NeedData):
                    conn.receive_data(sock.recv(1 << 16))
                assert isinstance(ev, probe.Estimates), ev

        served()
        m = Measured(pid, served)
        large = probe.HEADER.pack(probe.MAGIC, probe.VERSION, probe.MsgType.SET_PEERS, 0, MIB)
        login = probe.HEADER.pack(probe.MAGIC, probe.VERSION, probe.MsgType.LOGIN, 0, 4000)
        socks = []
        try:
            for i in range(connections):
                s = socket.create_connection((host, port))
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError, ConnectionError):
                    s.send(large + bytes(256 << 10) if i % 2 else login + bytes(100))
                socks.append(s)
            m.hold(1.0)
        finally:
            for s in socks:
                s.close()
        m.settle()
        return m.figures()


# -- the server: authenticated clients that read nothing, or leave mid-push -------------


def authenticated(host: str, port: int) -> tuple[socket.socket, Connection]:
    """A blocking socket through the job-token handshake, and its Connection."""
    # (60 s: before the limits, a server went on answering pulls whose
    # client had left, for seconds on end, before it served anyone else)
    sock = socket.create_connection((host, port), timeout=60)
    conn = Connection()

    def recv() -> object:
        while (event := conn.next_event()) is NEED_DATA:
            data = sock.recv(1 << 16)
            if not data:
                raise ConnectionError("the server closed the connection")
            conn.receive_data(data)
        return event

    hs = ClientHandshake(JOB, TOKEN.encode(), "bench-memory")
    sock.sendall(conn.send_bytes(hs.hello()))
    sock.sendall(conn.send_bytes(hs.on_challenge(recv())))
    hs.verify_server()
    conn.protect(*hs.frame_keys())
    hs.on_welcome(recv())
    sock.sendall(conn.send_bytes(Ping(req=0)))
    assert isinstance(recv(), Pong)
    return sock, conn


def abuse_server(d: Path, env: dict[str, str], what: str, count: int,
                 model_mib: int) -> dict[str, float]:
    token = secret(d, "job.token", TOKEN)
    np.savez(d / "model.npz", w=np.zeros((model_mib * MIB) // 4, np.float32))
    with process(["server", "--listen", "127.0.0.1:0", "--job", JOB, "--token-file",
                  str(token), "--init", str(d / "model.npz"), "--momentum", "0.9"],
                 "serving job", env) as (pid, line):
        host, port = address(line, " on ")

        def served() -> None:
            authenticated(host, port)[0].close()

        # A first client pulls the model: the baseline has served it once.
        fds = open_fds(pid)
        sock, conn = authenticated(host, port)
        sock.sendall(conn.send_bytes(Pull(req=1)))
        got = 0
        while got < model_mib * MIB:
            got += len(sock.recv(1 << 20))
        sock.close()
        wait_for(lambda: open_fds(pid) <= fds, 10, "the first client's connection closed")
        served()
        m = Measured(pid, served)
        if what == "pushes":
            update = {"w": np.zeros((model_mib * MIB) // 4, np.float32)}
            socks = []
            for _ in range(count):
                sock, conn = authenticated(host, port)
                frame = conn.send_bytes(Push(req=1, base_version=0, tensors=update))
                sock.sendall(frame[:len(frame) // 2])
                socks.append(sock)
        else:
            sock, conn = authenticated(host, port)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
            make = Pull if what == "pulls" else StateRequest
            sock.sendall(b"".join(conn.send_bytes(make(req=i)) for i in range(count)))
            socks = [sock]
        m.hold(1.0)
        for sock in socks:
            sock.close()
        m.settle()
        return m.figures()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs of each abuse (default: 3)")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                    help="the processes' event loop (MLFABRIC_LOOP; default: uvloop)")
    ap.add_argument("--only", choices=SCENARIOS, action="append",
                    help="run this abuse only (repeat for more)")
    ap.add_argument("--connections", type=int, default=500)
    ap.add_argument("--pulls", type=int, default=256)
    ap.add_argument("--states", type=int, default=32)
    ap.add_argument("--pushes", type=int, default=16)
    ap.add_argument("--model-mib", type=int, default=16)
    ap.add_argument("--json", action="store_true", help="print every run's figures as JSON")
    args = ap.parse_args()
    env = {**os.environ, "MLFABRIC_LOOP": args.loop}
    count = {"pulls": args.pulls, "state": args.states, "pushes": args.pushes}
    results: dict[str, list[dict[str, float]]] = {}
    for name in args.only or SCENARIOS:
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                r = (abuse_agent(Path(tmp), env, args.connections) if name == "agent" else
                     abuse_server(Path(tmp), env, name, count[name], args.model_mib))
            results.setdefault(name, []).append(r)
    if args.json:
        print(json.dumps(results))
        return
    labels = {"agent": f"agent: {args.connections} connections not logged in",
              "pulls": f"server: {args.pulls} pipelined pulls, not read",
              "state": f"server: {args.states} pipelined state requests, not read",
              "pushes": f"server: {args.pushes} clients leaving mid-push"}
    print(f"Resident memory of a process under abuse, MiB ({args.loop}; server model "
          f"{args.model_mib} MiB); median of {args.runs} runs, each run's 'held' in brackets")
    print(f"  {'abuse':<44} {'before':>7} {'peak':>7} {'after':>7} {'held':>7}"
          f" {'closed in':>10}")
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        each = ", ".join(f"{r['held_mib']:.1f}" for r in runs)
        print(f"  {labels[name]:<44} {med['before_mib']:7.1f} {med['peak_mib']:7.1f} "
              f"{med['after_mib']:7.1f} {med['held_mib']:7.1f} {med['settle_s']:8.2f} s"
              f"  ({each})")


if __name__ == "__main__":
    main()
