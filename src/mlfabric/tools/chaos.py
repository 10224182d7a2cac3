"""Faults on purpose: a whole job as real processes on loopback, killed at
random moments and in the windows that used to freeze it, then checked.

`python -m mlfabric.chaos run` starts a job the way docs/guide/deploying.md
does (the public commands: `mlfabric server`, `--role replica`, `mlfabric
controller --server --replica`, `mlfabric agent --aggregate`) and worker
processes that train with the public client API (`python -m mlfabric.chaos
worker`), then SIGKILLs processes and restores the job as an operator would:
a killed worker is replaced by a new one, a killed server is failed over by
the controller and a new replica joins the promoted one, a killed replica is
replaced by one joining the server, a killed controller or aggregator is
restarted on its port. Some faults hit on purpose the windows that froze
jobs before the liveness fixes (a lost worker, a replica waiting
for a sequence number that will not come):

- `lost-feed`: a worker whose connection to the replica goes through a
  proxy in this process; once its update was applied by the server (the
  client feeds the replica only then) the proxy holds the bytes and the
  worker is SIGKILLed: the replica never gets that sequence number;
- `join-in-recovery`: the server is killed and a new replica joins the
  moment the controller has promoted the old one;
- `worker-in-failover`: the server is killed and then a worker, during the
  promoted server's recovery.

Every worker logs each push's intent (before it is sent) and its outcome or
error, one JSON line each, flushed, so a SIGKILL loses nothing logged. At
the end `check()` asserts: no worker that lived to the end was stalled more
than `max_stall` seconds; every push of such a worker resolved, with no
error; no two acknowledged updates share a version; and the final model
(pulled from the server, and from the replica once it caught up) equals a
numpy replay of the applied updates. Versions nobody acknowledged belong to
killed workers' pushes that were applied but not answered: they are found
by a depth-first search over those pushes (each used once, within tau_max),
and the replay must then match bit for bit. With aggregators, members of an
aggregate are summed in an order the workers do not see, so that replay is
compared to float32 rounding (workload.replay).

This is tooling, not the library: tests/test_chaos.py runs a short form and
benchmarks/chaos.py the long one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .ports import free_port
from .token_cli import agent_secrets

JOB = "chaos"
TOKEN = b"LZOCIY7dpJlBseQd7WFHxOuZfBP-lw-b1w2dFVvkE7I"  # random (`mlfabric token new`)
SCALE = 0.01  # of the seeded updates
SERVING = ("serving job", "ready on")  # what each listening command prints when ready


def model_of(tensors: int, size: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"t{i}": rng.standard_normal(size, dtype=np.float32) for i in range(tensors)}


# -- one process of the job ---------------------------------------------------------


@dataclass
class Proc:
    """A process of the job: its command, log and (for a listener) address."""

    name: str
    kind: str  # server, replica, controller, aggregator, worker
    popen: subprocess.Popen[str]
    log: Path
    address: str | None = None
    wid: int | None = None  # a worker's id
    killed: bool = False

    def alive(self) -> bool:
        return self.popen.poll() is None


def _spawn(name: str, kind: str, argv: list[str], workdir: Path, *, wait_serving: bool,
           timeout: float = 30.0) -> Proc:
    log = workdir / f"{name}.log"
    err = open(log, "w")  # noqa: SIM115 - handed to the child, closed below
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    popen = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=err,
                             text=True, cwd=workdir, env=env, start_new_session=True)
    err.close()
    proc = Proc(name, kind, popen, log)
    if not wait_serving:
        assert popen.stdout is not None
        popen.stdout.close()
        return proc
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert popen.stdout is not None
        for line in popen.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            line = None
        if line is None:
            popen.kill()
            raise RuntimeError(f"{name} did not start: {log.read_text()[-2000:]}")
        if any(s in line for s in SERVING):
            proc.address = line.split(" on ")[1].split()[0].rstrip(":,")
            return proc


# -- a proxy that can hold a worker's push to the replica ---------------------------


class HoldingProxy:
    """TCP proxy on loopback (its own event loop, in a thread). After
    `arm()`, the next bytes a client sends upstream are held, never
    forwarded, and `held` is set: with a worker's replica connection through
    it, those bytes are an update the server already applied."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.held = threading.Event()
        self._armed = False
        self._writers: list[asyncio.StreamWriter] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.port = 0
        self._thread = threading.Thread(target=self._run, name="chaos-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the proxy did not start")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = self.upstream.rsplit(":", 1)
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return
        self._writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                       upstream: bool) -> None:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                while data := await src.read(1 << 16):
                    if upstream and self._armed:
                        self.held.set()
                        continue  # held: never forwarded
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))

    def arm(self) -> None:
        self._loop.call_soon_threadsafe(setattr, self, "_armed", True)

    def cut(self) -> None:
        """Close every connection through the proxy (what it held is lost)."""
        def close_all() -> None:
            for w in self._writers:
                w.close()
        self._loop.call_soon_threadsafe(close_all)

    def close(self) -> None:
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


# -- the job ------------------------------------------------------------------------


@dataclass
class Settings:
    workers: int = 4
    config: str = "replicated"  # or "aggregated"
    tensors: int = 2
    size: int = 4096  # elements per tensor
    momentum: float = 0.5
    tau_max: int = 16
    div_max: float | None = 10.0
    step_pause: float = 0.02  # a worker's "compute" between pushes
    heartbeat: tuple[float, float] = (0.1, 0.5)  # controller's interval, timeout
    extra: dict[str, list[str]] = field(default_factory=dict)  # kind -> more flags


class Job:
    """The processes of one job, started and restored as an operator would."""

    def __init__(self, workdir: Path, settings: Settings, *, say: Any = print) -> None:
        self.dir = workdir
        self.s = settings
        self.say = say
        self.procs: list[Proc] = []
        self.proxies: list[HoldingProxy] = []
        self.server: Proc | None = None
        self.replica: Proc | None = None
        self.controller: Proc | None = None
        self.aggregators: list[Proc] = []
        self.controller_port = free_port()
        self.next_wid = 0
        self.model = model_of(settings.tensors, settings.size)
        self.token = workdir / "job.token"
        self.token.write_bytes(TOKEN)
        self.cluster_token, _ = agent_secrets(workdir, JOB)
        self.token.chmod(0o600)
        np.savez(workdir / "init.npz", **self.model)  # type: ignore[arg-type]
        self.stop_file = workdir / "stop"
        self.kills: dict[str, int] = {}  # SIGKILLs by kind of process
        self.windows: dict[str, int] = {}  # targeted windows hit

    # starting ------------------------------------------------------------------------

    def _listener(self, name: str, kind: str, command: list[str], *, port: int = 0) -> Proc:
        argv = ["-m", "mlfabric", *command, "--listen", f"127.0.0.1:{port}", "--job", JOB,
                "--token-file", str(self.token), *self.s.extra.get(kind, [])]
        proc = _spawn(name, kind, argv, self.dir, wait_serving=True)
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        s = self.s
        common = ["--init", "init.npz", "--momentum", str(s.momentum)]
        if s.config == "replicated":
            self.replica = self._listener("replica-0", "replica",
                                          ["server", "--role", "replica", *common])
        self.server = self._listener("server-0", "server",
                                     ["server", *common, "--tau-max", str(s.tau_max)])
        if s.config == "aggregated":
            for i in range(2):
                port = free_port()
                agg = self._listener(f"aggregator-{i}", "aggregator",
                                     self.aggregator_args(i, port), port=0)
                agg.address = f"127.0.0.1:{port}"
                agg.name = f"aggregator-{i}"
                self.aggregators.append(agg)
        self.start_controller()
        for _ in range(s.workers):
            self.start_worker()

    def aggregator_args(self, i: int, port: int | str) -> list[str]:
        """Aggregator i's command, on `port`: it forwards to the job's server only."""
        assert self.server is not None
        return ["agent", "--name", f"a{i}", "--cluster-token-file", str(self.cluster_token),
                "--aggregate", f"127.0.0.1:{port}", "--servers", str(self.server.address)]

    def controller_args(self) -> list[str]:
        s = self.s
        args = ["controller", "--tau-max", str(s.tau_max), "--decision-log", "decisions.jsonl"]
        if s.config == "replicated":
            assert self.server is not None
            args += ["--policy", "fifo", "--server", str(self.server.address),
                     "--heartbeat-interval", str(s.heartbeat[0]),
                     "--heartbeat-timeout", str(s.heartbeat[1])]
            assert self.replica is not None, "each fault is restored before the next"
            args += ["--replica", str(self.replica.address)]
            if s.div_max is not None:
                args += ["--div-max", str(s.div_max), "--momentum", str(s.momentum)]
        else:
            # The server's downlink planned slow, so groups form on loopback.
            args += ["--policy", "mlfabric", "--link", "127.0.0.1=1000/5",
                     "--max-fan-in", str(s.workers), "--group-wait", "0.2"]
            for i, agg in enumerate(self.aggregators):
                args += ["--aggregator", f"h{i}={agg.address}"]
        return args

    def start_controller(self) -> None:
        n = sum(p.kind == "controller" for p in self.procs)
        self.controller = self._listener(f"controller-{n}", "controller",
                                         self.controller_args(), port=self.controller_port)

    def start_worker(self, *, proxied: bool = False) -> Proc:
        wid = self.next_wid
        self.next_wid += 1
        assert self.server is not None and self.controller is not None
        argv = ["-m", "mlfabric.tools.chaos", "worker", "--id", str(wid),
                "--server", str(self.server.address), "--controller",
                str(self.controller.address), "--token-file", str(self.token),
                "--log", str(self.dir / f"worker-{wid}.jsonl"), "--stop-file",
                str(self.stop_file), "--pause", str(self.s.step_pause),
                "--host", f"w{wid}"]
        if self.replica is not None:
            replica = str(self.replica.address)
            if proxied:
                proxy = HoldingProxy(replica)
                self.proxies.append(proxy)
                replica = proxy.address
            argv += ["--replica", replica]
        proc = _spawn(f"worker-{wid}", "worker", argv, self.dir, wait_serving=False)
        proc.wid = wid
        self.procs.append(proc)
        return proc

    # faults ------------------------------------------------------------------------

    def kill(self, proc: Proc) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait(10)
        proc.killed = True
        self.kills[proc.kind] = self.kills.get(proc.kind, 0) + 1
        self.say(f"  killed {proc.name}")

    def workers(self) -> list[Proc]:
        return [p for p in self.procs if p.kind == "worker" and p.alive()]

    def wait_log(self, proc: Proc, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in proc.log.read_text():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{proc.name} did not log {text!r} within {timeout} s")
            time.sleep(0.02)

    def pushes(self, proc: Proc) -> int:
        path = self.dir / f"worker-{proc.wid}.jsonl"
        return path.read_text().count('"outcome"') if path.exists() else 0

    def wait_progress(self, n: int = 3, timeout: float = 20.0) -> None:
        """Until every live worker has `n` more outcomes (the job moves)."""
        start = {p.name: self.pushes(p) for p in self.workers()}
        deadline = time.monotonic() + timeout
        while any(self.pushes(p) < start[p.name] + n for p in self.workers()
                  if p.name in start):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the job made no progress for {timeout} s")
            time.sleep(0.05)

    def kill_worker(self) -> None:
        self.kill(random.choice(self.workers()))
        self.start_worker()

    def kill_server(self, *, then_worker: bool = False, join_delay: float = 0.0) -> None:
        """Kill the server; the controller promotes the replica; a new
        replica joins it (at once: inside the promoted server's recovery)."""
        assert self.server is not None and self.replica is not None
        assert self.controller is not None
        failovers = self.controller.log.read_text().count("failover:")
        self.kill(self.server)
        if then_worker:
            self.kill(random.choice(self.workers()))
        deadline = time.monotonic() + 15
        while self.controller.log.read_text().count("failover:") == failovers:
            if time.monotonic() > deadline:
                raise RuntimeError("the controller did not fail over within 15 s")
            time.sleep(0.01)
        self.server, self.replica = self.replica, None
        self.server.kind = "server"  # promoted: killing it now kills the server
        time.sleep(join_delay)
        self.join_replica()
        if then_worker:
            self.start_worker()

    def join_replica(self) -> None:
        assert self.server is not None and self.controller is not None
        n = sum(p.kind == "replica" for p in self.procs)
        self.replica = self._listener(
            f"replica-{n}", "replica",
            ["server", "--role", "replica", "--join-from", str(self.server.address),
             "--controller", str(self.controller.address)])

    def kill_replica(self) -> None:
        assert self.replica is not None and self.controller is not None
        self.kill(self.replica)
        self.replica = None
        self.wait_log(self.controller, "has not answered for", 10)
        self.join_replica()

    def kill_controller(self) -> None:
        assert self.controller is not None
        self.kill(self.controller)
        self.start_controller()

    def kill_aggregator(self) -> None:
        i = random.randrange(len(self.aggregators))
        agg = self.aggregators[i]
        self.kill(agg)
        port = agg.address.rsplit(":", 1)[1] if agg.address else "0"
        new = self._listener(f"{agg.name}-r{self.kills['aggregator']}", "aggregator",
                             self.aggregator_args(i, port))
        new.address = agg.address
        self.aggregators[i] = new

    def lost_feed(self) -> None:
        """A worker dies after the server applied its update, before the
        replica got it (the proxy holds it)."""
        proc = self.start_worker(proxied=True)
        proxy = self.proxies[-1]
        deadline = time.monotonic() + 20
        while self.pushes(proc) < 2:  # connected and feeding the replica
            if time.monotonic() > deadline or not proc.alive():
                raise RuntimeError(f"the proxied worker made no progress: "
                                   f"{proc.log.read_text()[-1500:]}")
            time.sleep(0.02)
        proxy.arm()
        if not proxy.held.wait(20):
            raise RuntimeError("the proxied worker sent nothing to the replica in 20 s")
        self.kill(proc)
        proxy.cut()
        self.windows["lost-feed"] = self.windows.get("lost-feed", 0) + 1

    # the end ------------------------------------------------------------------------

    def stop(self) -> None:
        self.stop_file.write_text("stop")
        deadline = time.monotonic() + 60
        for p in self.procs:
            if p.kind == "worker" and p.alive():
                try:
                    p.popen.wait(max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    self.say(f"  {p.name} did not stop: killed")
                    self.kill(p)

    def shutdown(self) -> None:
        """Every process and proxy gone, whatever happened."""
        for p in self.procs:
            if p.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.popen.wait(10)
        for proxy in self.proxies:
            proxy.close()


# -- the faults of a run --------------------------------------------------------------


def faults(job: Job, seconds: float, rng: random.Random, *, targeted: bool = True) -> None:
    """Random kills for `seconds`, after the targeted ones (if any)."""
    say = job.say
    if job.s.config == "replicated":
        plan: list[tuple[str, Any]] = []
        if targeted:
            plan = [("lost-feed", job.lost_feed),
                    ("join-in-recovery", job.kill_server),
                    ("worker-in-failover", lambda: job.kill_server(then_worker=True)),
                    ("lost-feed", job.lost_feed)]
        kinds = [("worker", job.kill_worker), ("server", job.kill_server),
                 ("replica", job.kill_replica), ("controller", job.kill_controller),
                 ("lost-feed", job.lost_feed)]
    else:
        plan = []
        kinds = [("aggregator", job.kill_aggregator), ("controller", job.kill_controller)]
    for name, act in plan:
        say(f"fault: {name}")
        act()
        if name != "lost-feed":  # counted where the window is known to be hit
            job.windows[name] = job.windows.get(name, 0) + 1
        job.wait_progress()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(rng.uniform(0.5, 2.0))
        name, act = rng.choice(kinds)
        say(f"fault: {name}")
        act()
        job.wait_progress()


# -- checking ------------------------------------------------------------------------


@dataclass
class Report:
    pushes: int = 0
    acked: int = 0
    errors: list[str] = field(default_factory=list)
    longest_stall: float = 0.0
    replay: str = ""
    final_version: int = 0
    kills: dict[str, int] = field(default_factory=dict)
    windows: dict[str, int] = field(default_factory=dict)
    unknown_filled: int = 0

    def line(self) -> str:
        kills = ", ".join(f"{k} {v}" for k, v in sorted(self.kills.items()))
        windows = ", ".join(f"{k} {v}" for k, v in sorted(self.windows.items()))
        return (f"kills survived: {kills or 'none'} (windows: {windows or 'none'}); "
                f"pushes {self.pushes}, acknowledged "
                f"{self.acked}, final version {self.final_version}; longest stall "
                f"{self.longest_stall:.2f} s; errors {len(self.errors)}; replay {self.replay}")


def read_log(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line cut by SIGKILL
            out.append(json.loads(line))
    return out


def check(job: Job, *, max_stall: float = 5.0) -> Report:
    """The invariants (see the module's docstring); raises AssertionError."""
    import mlfabric

    report = Report(kills=dict(job.kills), windows=dict(job.windows))
    records: list[dict[str, Any]] = []  # one per acknowledged update
    candidates: list[dict[str, Any]] = []  # killed workers' pushes of unknown fate
    for p in job.procs:
        if p.kind != "worker":
            continue
        events = read_log(job.dir / f"worker-{p.wid}.jsonl")
        intents = {e["step"]: e for e in events if e["event"] == "intent"}
        ended = {e["step"]: e for e in events if e["event"] in ("outcome", "error")}
        report.pushes += len(intents)
        for step, e in ended.items():
            if e["event"] == "outcome" and e["applied"]:
                records.append({"seed": p.wid, "step": step, "applied": True,
                                "version": e["version"], "base": intents[step]["base"]})
            elif e["event"] == "error" and not p.killed:
                report.errors.append(f"worker {p.wid} step {step}: {e['error']}")
        if p.killed:
            candidates += [{"seed": p.wid, "step": s, "base": i["base"]}
                           for s, i in intents.items() if s not in ended]
            continue
        missing = [s for s in intents if s not in ended]
        if missing:
            report.errors.append(f"worker {p.wid}: pushes {missing} never resolved")
        times = [e["t"] for e in events]
        for a, b in itertools.pairwise(times):
            report.longest_stall = max(report.longest_stall, b - a)
        for step, e in ended.items():
            report.longest_stall = max(report.longest_stall, e["t"] - intents[step]["t"])
    report.acked = len(records)
    assert job.server is not None
    with mlfabric.connect(str(job.server.address), job=JOB, token=TOKEN, timeout=10) as ps:
        version, final = ps.pull(timeout=30)
    report.final_version = version
    if job.s.config == "replicated":
        versions = [r["version"] for r in records]
        dup = sorted({v for v in versions if versions.count(v) > 1})
        assert not dup, f"acknowledged twice at versions {dup}"
        filled = replay_exact(job.model, records, candidates, final, version,
                              job.s.momentum, job.s.tau_max)
        report.unknown_filled = filled
        report.replay = f"bit for bit ({filled} unacknowledged updates placed by search)"
        if job.replica is not None:
            deadline = time.monotonic() + 20
            with mlfabric.connect(str(job.replica.address), job=JOB, token=TOKEN) as rs:
                while (got := rs.pull(timeout=30))[0] < version:
                    assert time.monotonic() < deadline, "the replica did not catch up in 20 s"
                    time.sleep(0.1)
            if got[0] == version:
                for n in final:
                    assert np.array_equal(got[1][n].view(np.uint32), final[n].view(np.uint32))
                report.replay += "; replica equal"
    else:
        from .workload import replay

        weights, v, _ = replay(records, job.model, job.s.momentum, SCALE)
        assert v == version, f"replayed to version {v}, the server is at {version}"
        # The members of an aggregate are summed in the aggregator's order,
        # which workers do not see: float32 sums in another order differ in
        # the last bits, and momentum carries that along over the run.
        for n in final:
            np.testing.assert_allclose(final[n], weights[n], rtol=1e-4, atol=1e-5)
        report.replay = "to float32 rounding (aggregates' member order is not logged)"
    assert not report.errors, report.errors
    assert report.longest_stall <= max_stall, (
        f"a worker was stalled {report.longest_stall:.2f} s (limit {max_stall} s)")
    return report


def replay_exact(init: dict[str, np.ndarray], records: list[dict[str, Any]],
                 candidates: list[dict[str, Any]], final: dict[str, np.ndarray],
                 final_version: int, momentum: float, tau_max: int | None,
                 max_leaves: int = 100_000) -> int:
    """Replay versions 1..final_version in numpy: acknowledged updates at
    their versions, the gaps filled by a depth-first search over
    `candidates` (each at most once, within tau_max), until the result is
    `final` bit for bit. Returns how many gaps were filled; raises
    AssertionError when no such history exists."""
    from ..scheduling.aggregation import apply_aggregate
    from .workload import seeded_update

    by_version = {r["version"]: r for r in records}
    extra = sorted(v for v in by_version if v > final_version)
    assert not extra, f"acknowledged versions {extra} are above the server's {final_version}"
    gaps = [v for v in range(1, final_version + 1) if v not in by_version]
    assert len(gaps) <= len(candidates), (
        f"versions {gaps[:10]} were applied but only {len(candidates)} pushes of killed "
        f"workers are of unknown fate")
    cache: dict[tuple[int, int], dict[str, np.ndarray]] = {}

    def update(r: dict[str, Any]) -> dict[str, np.ndarray]:
        key = (r["seed"], r["step"])
        if key not in cache:
            cache[key] = seeded_update(init, r["seed"], r["step"], SCALE)
        return cache[key]

    def same(w: dict[str, np.ndarray]) -> bool:
        return all(np.array_equal(w[n].view(np.uint32), final[n].view(np.uint32))
                   for n in final)

    leaves = 0

    def search(v: int, w: dict[str, np.ndarray], prev: dict[str, np.ndarray],
               used: frozenset[int]) -> int | None:
        nonlocal leaves
        while v <= final_version and v in by_version:
            w, prev, _, _ = apply_aggregate(w, prev, v - 1, [(update(by_version[v]), 0)],
                                            momentum)
            v += 1
        if v > final_version:
            leaves += 1
            return len(used) if same(w) else None
        for i, c in enumerate(candidates):
            if i in used or not (c["base"] < v and (
                    tau_max is None or v - 1 - c["base"] <= tau_max)):
                continue
            if leaves >= max_leaves:
                break
            w2, p2, _, _ = apply_aggregate(w, prev, v - 1, [(update(c), 0)], momentum)
            found = search(v + 1, w2, p2, used | {i})
            if found is not None:
                return found
        return None

    start = {n: a.copy() for n, a in init.items()}
    found = search(1, start, {n: a.copy() for n, a in init.items()}, frozenset())
    assert found is not None, (
        f"no history of the acknowledged updates, with versions {gaps[:10]} filled by "
        f"pushes of killed workers, gives the final model ({leaves} tried)")
    return found


# -- the worker process ------------------------------------------------------------


def worker_main(args: argparse.Namespace) -> int:
    import mlfabric

    from .workload import seeded_update

    like = dict(np.load(Path(args.token_file).parent / "init.npz"))
    out = open(args.log, "a", buffering=1)  # noqa: SIM115 - line-buffered, for ever

    def log(**event: Any) -> None:
        out.write(json.dumps({**event, "t": time.monotonic()}) + "\n")

    stop = Path(args.stop_file)
    with mlfabric.connect(args.server, job=JOB, token_file=args.token_file,
                          controller=args.controller, replica=args.replica, host=args.host,
                          failover_timeout=15, replica_timeout=10, push_timeout=30,
                          timeout=10) as ps:
        step = 0
        while not stop.exists():
            version, _ = ps.pull(timeout=30)
            u = seeded_update(like, args.id, step, SCALE)
            log(event="intent", step=step, base=version)
            try:
                outcome = ps.push(u, base_version=version).result(60)
            except Exception as exc:  # logged: the checker decides
                log(event="error", step=step, error=f"{type(exc).__name__}: {exc}")
            else:
                log(event="outcome", step=step, applied=outcome.applied,
                    version=outcome.version, reason=outcome.reason)
            step += 1
            time.sleep(args.pause)
    return 0


# -- command line --------------------------------------------------------------------


def run(settings: Settings, seconds: float, seed: int, workdir: Path, *,
        targeted: bool = True, max_stall: float = 5.0, say: Any = print) -> Report:
    """One whole run: start, faults, stop, check; every process gone after."""
    rng = random.Random(seed)
    random.seed(seed)
    say(f"chaos: config {settings.config}, {settings.workers} workers, seed {seed}, "
        f"{seconds:.0f} s of random faults, in {workdir}")
    job = Job(workdir, settings, say=say)
    try:
        job.start()
        job.wait_progress()
        faults(job, seconds, rng, targeted=targeted)
        job.wait_progress()
        job.stop()
        report = check(job, max_stall=max_stall)
    finally:
        job.shutdown()
    left = [p.name for p in job.procs if p.alive()]
    assert not left, f"processes left running: {left}"
    say(report.line())
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlfabric.chaos", description=__doc__.split(
        "\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker", help="one training process (started by `run`)")
    w.add_argument("--id", type=int, required=True)
    w.add_argument("--server", required=True)
    w.add_argument("--controller", required=True)
    w.add_argument("--replica", default=None)
    w.add_argument("--host", default=None)
    w.add_argument("--token-file", required=True)
    w.add_argument("--log", required=True)
    w.add_argument("--stop-file", required=True)
    w.add_argument("--pause", type=float, default=0.02)
    r = sub.add_parser("run", help="a job with faults, then the checks")
    r.add_argument("--config", choices=("replicated", "aggregated"), default="replicated")
    r.add_argument("--seconds", type=float, default=60.0)
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--workers", type=int, default=4)
    r.add_argument("--div-max", type=float, default=10.0)
    r.add_argument("--dir", default=None, help="keep the logs here (default: a temp dir)")
    args = p.parse_args(argv)
    if args.command == "worker":
        return worker_main(args)
    import tempfile

    settings = Settings(workers=args.workers, config=args.config,
                        div_max=args.div_max if args.div_max > 0 else None)
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
        run(settings, args.seconds, args.seed, Path(args.dir))
    else:
        with tempfile.TemporaryDirectory(prefix="mlfabric-chaos-") as d:
            run(settings, args.seconds, args.seed, Path(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
