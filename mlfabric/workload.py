"""A synthetic training workload for measuring transfer scheduling.

`python -m mlfabric.workload ...` is one worker: it pulls, "computes" for a
set time (a sleep with seeded jitter: the network, not the arithmetic, is
under test), pushes an update of the model's size and records what happened
to it. `run_policy()` runs a server, a controller and N such workers on an
emulated cluster (`mlfabric.testbed`) and summarises delays and
push-to-applied times, so policies can be compared on the same hosts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

JOB = "workload"
CONTROLLER_PORT = 7071  # inside the server host's own namespace


def worker_main(argv: list[str] | None = None) -> int:
    import mlfabric

    p = argparse.ArgumentParser(prog="python -m mlfabric.workload")
    p.add_argument("--server", required=True)
    p.add_argument("--controller", default=None)
    p.add_argument("--token-file", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--compute-ms", type=float, default=100.0)
    p.add_argument("--jitter", type=float, default=0.2, help="relative compute-time jitter")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-in-flight", type=int, default=2,
                   help="pushes handed over and not yet answered before the worker waits "
                        "(workers hand updates to mlfabric and keep computing)")
    p.add_argument("--fallback", default="fifo", choices=["fifo", "wait"],
                   help="what to do while the controller is unreachable")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    records = []
    with mlfabric.connect(args.server, job=JOB, token_file=args.token_file,
                          controller=args.controller, host=args.host, timeout=30,
                          controller_fallback=args.fallback, controller_timeout=60) as ps:
        version, params = ps.pull(timeout=60)
        update = {n: np.full_like(a, 1e-6) for n, a in params.items()}
        in_flight: list[tuple[float, Any]] = []

        def settle(t0: float, fut: Any) -> None:
            outcome = fut.result(300)
            done = getattr(fut, "done_at", time.monotonic())  # callback may still run
            records.append({"start": t0, "seconds": done - t0,
                            "applied": outcome.applied, "delay": outcome.delay,
                            "reason": outcome.reason})

        def stamp(fut: Any) -> None:
            fut.done_at = time.monotonic()
        for _ in range(args.steps):
            version, _ = ps.pull(timeout=120)
            time.sleep(args.compute_ms / 1e3 * (1 + args.jitter * (2 * rng.random() - 1)))
            t0 = time.monotonic()
            fut = ps.push(update, base_version=version)
            fut.add_done_callback(stamp)
            in_flight.append((t0, fut))
            while len(in_flight) >= args.max_in_flight:
                settle(*in_flight.pop(0))
        for t0, fut in in_flight:
            settle(t0, fut)
    Path(args.out).write_text(json.dumps(records))
    return 0


@dataclass(frozen=True)
class Summary:
    policy: str
    pushes: int
    applied: int
    dropped: int
    delay_mean: float
    delay_std: float
    delay_max: int
    seconds_mean: float
    seconds_std: float
    wall: float

    @property
    def applied_per_s(self) -> float:
        """Throughput: a run is a fixed number of pushes, and a drop at the
        controller ends its push sooner than a transfer would, so applied
        updates per second compare policies where the applied count does not."""
        return self.applied / self.wall if self.wall > 0 else 0.0

    def row(self) -> str:
        return (f"{self.policy:9s} pushes {self.pushes:4d}  applied {self.applied:4d}  "
                f"dropped {self.dropped:3d}  delay mean {self.delay_mean:5.2f} std "
                f"{self.delay_std:5.2f} max {self.delay_max:3d}  push-to-applied mean "
                f"{self.seconds_mean:6.3f}s std {self.seconds_std:6.3f}s  wall {self.wall:5.1f}s")


def summarise(policy: str, records: list[dict[str, Any]], wall: float) -> Summary:
    applied = [r for r in records if r["applied"]]
    delays = [r["delay"] for r in applied]
    secs = [r["seconds"] for r in applied]
    return Summary(
        policy=policy, pushes=len(records), applied=len(applied),
        dropped=len(records) - len(applied),
        delay_mean=statistics.fmean(delays) if delays else 0.0,
        delay_std=statistics.pstdev(delays) if delays else 0.0,
        delay_max=max(delays, default=0),
        seconds_mean=statistics.fmean(secs) if secs else 0.0,
        seconds_std=statistics.pstdev(secs) if secs else 0.0,
        wall=wall)


def wait_for_line(proc: subprocess.Popen[str], word: str, what: str,
                  timeout: float = 60.0) -> str:
    """The first stdout line of `proc` containing `word`, within `timeout` seconds."""
    import selectors

    sel = selectors.DefaultSelector()
    assert proc.stdout is not None
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sel.select(timeout=max(0.0, deadline - time.monotonic())):
            line = proc.stdout.readline()
            if not line:
                break
            if word in line:
                return line.strip()
    err = proc.stderr.read() if proc.stderr else ""
    raise RuntimeError(f"{what} did not report {word!r} within {timeout:.0f} s: {err[-1500:]}")


def serving_address(proc: subprocess.Popen[str], what: str, timeout: float = 60.0) -> str:
    """The HOST:PORT of a server or controller, from its 'serving ... on HOST:PORT' line."""
    return wait_for_line(proc, "serving", what, timeout).split(" on ")[1].split()[0]


def run_policy(tb: Any, policy: str, *, model_bytes: int, steps: int, tau_max: int,
               compute_ms: float = 100.0, server_host: str = "h0", seed: int = 0,
               max_in_flight: int = 2, fallback: str = "fifo",
               restart_controller_after: float | None = None,
               link_mbit: dict[str, tuple[float, float]] | None = None,
               during: Any = None) -> tuple[Summary, list[dict[str, Any]]]:
    """Run one policy: server and controller on `server_host`, a worker on
    every other host of testbed `tb`. `during(tb)` runs once the workers are
    started (e.g. a schedule of rate changes). Returns the summary and the
    workers' records. With `restart_controller_after`, the controller is
    killed (SIGKILL) that many seconds into the run and started again on the
    same address a second later."""
    from . import auth

    server = tb.host(server_host)
    workers = [h for h in tb.hosts if h.name != server_host]
    with tempfile.TemporaryDirectory(prefix="mlfabric-workload-") as tmp:
        token = Path(tmp) / "job.token"
        token.write_text(auth.generate_token())
        token.chmod(0o600)
        init = Path(tmp) / "init.npz"
        np.savez(init, w=np.zeros(model_bytes // 4, np.float32))
        py = [sys.executable, "-m", "mlfabric", "--log-level", "WARNING"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        kw = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp, env=env)
        srv = tb.popen(server, [*py, "server", "--listen", f"{server.ip}:0", "--job", JOB,
                                "--token-file", str(token), "--init", str(init),
                                "--tau-max", str(tau_max)], **kw)
        links = []
        for name, (up, down) in (link_mbit or {}).items():
            links += ["--link", f"{tb.host(name).ip}={up}/{down}"]
        ctl_argv = [*py, "controller", "--listen", f"{server.ip}:{CONTROLLER_PORT}", "--job",
                    JOB, "--token-file", str(token), "--tau-max", str(tau_max), "--policy",
                    policy, *links]
        ctl = tb.popen(server, ctl_argv, **kw)
        try:
            srv_addr = serving_address(srv, "server")
            ctl_addr = serving_address(ctl, "controller")
            started = time.monotonic()
            procs = []
            for i, h in enumerate(workers):
                procs.append(tb.popen(h, [
                    sys.executable, "-m", "mlfabric.workload", "--server", srv_addr,
                    "--controller", ctl_addr, "--token-file", str(token), "--host", h.ip,
                    "--steps", str(steps), "--compute-ms", str(compute_ms),
                    "--seed", str(seed * 100 + i), "--max-in-flight", str(max_in_flight),
                    "--fallback", fallback,
                    "--out", f"{tmp}/w{i}.json"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp,
                    env=env))
            if during is not None:
                during(tb)
            if restart_controller_after is not None:
                time.sleep(restart_controller_after)  # the point in the run to kill it at
                ctl.kill()
                ctl.wait(10)
                time.sleep(1.0)  # a second without a controller
                ctl = tb.popen(server, ctl_argv, **kw)
                serving_address(ctl, "restarted controller")
            records: list[dict[str, Any]] = []
            for i, p in enumerate(procs):
                try:
                    code = p.wait(timeout=60 + steps * 30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    raise RuntimeError(f"worker {i} did not finish") from None
                if code != 0:
                    err = p.stderr.read() if p.stderr else ""
                    raise RuntimeError(f"worker {i} failed ({code}): {err[-2000:]}")
                records += json.loads(Path(f"{tmp}/w{i}.json").read_text())
            wall = time.monotonic() - started
        finally:
            for proc in (ctl, srv):
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return summarise(policy, records, wall), records


if __name__ == "__main__":
    sys.exit(worker_main())
