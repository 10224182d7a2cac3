"""Failover on an emulated cluster: the server process is SIGKILLed at
random points of each run (needs root).

h0 runs the server, h1 the replica, h2 the controller (heartbeats to the
server, promotes the replica), h3.. one worker each; every link is shaped to
--mbit. Workers pull, push and wait for the acknowledgement (on server and
replica), with worker-driven replication and failover on. The current server
is killed --kills times per run, at uniformly random times; after each loss
but the last, a new replica joins (`mlfabric server --role replica
--join-from PROMOTED --controller ...`) on the host the lost server ran on.
Per run it reports, for every kill, the time to the acknowledgement of a
step begun after it (its pull and push went to the promoted replica:
training resumed); whether the versions acknowledged are exactly 1..N (none
lost, none twice); and whether the final model of the last promoted replica
equals a numpy replay of every acknowledged update in version order, bit
for bit.

    sudo python benchmarks/bench_failover.py [--runs 5] [--workers 3]
        [--steps 20] [--model-mib 1] [--mbit 200] [--heartbeat-timeout 0.5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from mlfabric.workload import serving_address

JOB = "bench-failover"
GAMMA = 0.9


def make_update(shape: tuple[int, ...], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": (1e-3 * rng.standard_normal(shape)).astype(np.float32)}


def worker(argv: list[str]) -> int:
    import mlfabric

    p = argparse.ArgumentParser()
    for flag in ("--server", "--replica", "--controller", "--token-file", "--out"):
        p.add_argument(flag, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--index", type=int, required=True)
    args = p.parse_args(argv)
    records = []
    with mlfabric.connect(args.server, job=JOB, token_file=args.token_file, timeout=30,
                          controller=args.controller, controller_fallback="wait",
                          replica=args.replica, failover_timeout=30) as ps:
        for i in range(args.steps):
            t_pull = time.perf_counter()
            version, params = ps.pull(timeout=60)
            seed = 1000 * args.index + i
            outcome = ps.push(make_update(params["w"].shape, seed),
                              base_version=version).result(120)
            records.append({"version": outcome.version, "applied": outcome.applied,
                            "seed": seed, "t_pull": t_pull, "t": time.perf_counter()})
    Path(args.out).write_text(json.dumps(records))
    return 0


async def _role(address: str, token: bytes) -> str:
    from mlfabric.aio import open_link
    from mlfabric.client_core import Handshake
    from mlfabric.protocol import Ping, Pong

    answer: Any = None

    def on_event(event: Any) -> None:
        nonlocal answer
        if isinstance(event, Pong):
            answer = event

    import asyncio

    link = await open_link(address, Handshake(JOB, token, "bench"), 5.0, "replica server",
                           on_event=on_event)
    link.send(Ping(1))
    for _ in range(500):
        if answer is not None:
            break
        await asyncio.sleep(0.01)
    link.close()
    return answer.role if answer is not None else "?"


def wait_promoted(host: Any, address: str, token: bytes, timeout: float = 30.0) -> None:
    """Until the replica at `address` answers heartbeats as the server."""
    import asyncio

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with host.enter():
            if asyncio.run(_role(address, token)) == "server":
                return
        time.sleep(0.05)
    raise RuntimeError(f"{address} was not promoted within {timeout} s")


def one_run(tb: Any, tmp: str, args: argparse.Namespace, rng: random.Random,
            expected: float) -> dict[str, Any]:
    import mlfabric

    h0, h1, ctl_host, *workers = tb.hosts
    token = f"{tmp}/job.token"
    secret = Path(token).read_bytes().strip()
    py = [sys.executable, "-m", "mlfabric", "--log-level", "WARNING"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    kw: dict[str, Any] = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=tmp, env=env)
    common = ["--job", JOB, "--token-file", token, "--momentum", str(GAMMA), "--tau-max", "-1"]
    init = ["--init", f"{tmp}/init.npz"]
    procs = []
    kill_times: list[float] = []
    try:
        rep = tb.popen(h1, [*py, "server", "--role", "replica", "--listen", f"{h1.ip}:0",
                            *common, *init], **kw)
        procs.append(rep)
        srv = tb.popen(h0, [*py, "server", "--listen", f"{h0.ip}:0", *common, *init], **kw)
        procs.append(srv)
        rep_addr, srv_addr = serving_address(rep, "replica"), serving_address(srv, "server")
        ctl = tb.popen(ctl_host, [*py, "controller", "--listen", f"{ctl_host.ip}:0", "--job",
                                  JOB, "--token-file", token, "--policy", "fifo",
                                  "--tau-max", "-1", "--server", srv_addr, "--replica",
                                  rep_addr, "--heartbeat-interval",
                                  str(args.heartbeat_timeout / 5), "--heartbeat-timeout",
                                  str(args.heartbeat_timeout)], **kw)
        procs.append(ctl)
        ctl_addr = serving_address(ctl, "controller")
        workers_p = []
        for i, h in enumerate(workers):
            workers_p.append(tb.popen(h, [
                sys.executable, os.path.abspath(__file__), "--worker", "--server", srv_addr,
                "--replica", rep_addr, "--controller", ctl_addr, "--token-file", token,
                "--steps", str(args.steps), "--index", str(i), "--out", f"{tmp}/w{i}.json"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp,
                env=env))
        # Start-up of the workers (imports, connect) is not training: wait for
        # the first acknowledged update on the server before timing the kills.
        with ctl_host.enter(), mlfabric.connect(srv_addr, job=JOB, token_file=token,
                                                timeout=30) as probe:
            while probe.pull(timeout=30)[0] == 0:
                time.sleep(0.05)
        server_proc, server_host = srv, h0
        replica_proc, replica_addr, replica_host = rep, rep_addr, h1
        for k in range(args.kills):
            time.sleep(rng.uniform(0.2, 0.8) * expected / args.kills)
            server_proc.send_signal(signal.SIGKILL)
            kill_times.append(time.perf_counter())
            if k == args.kills - 1:
                break
            wait_promoted(ctl_host, replica_addr, secret)
            # A new replica joins from the promoted one's state, on the host
            # the lost server ran on.
            new = tb.popen(server_host, [
                *py, "server", "--role", "replica", "--listen", f"{server_host.ip}:0",
                *common, "--join-from", replica_addr, "--controller", ctl_addr], **kw)
            procs.append(new)
            new_addr = serving_address(new, "joining replica")
            server_proc, server_host, replica_proc, replica_addr, replica_host = (
                replica_proc, replica_host, new, new_addr, server_host)
        records = []
        for i, p in enumerate(workers_p):
            if p.wait(timeout=300) != 0:
                raise RuntimeError(f"worker {i} failed: {p.stderr.read()[-3000:]}")
            records += json.loads(Path(f"{tmp}/w{i}.json").read_text())
        final_addr = replica_addr  # the replica promoted at the last kill serves
        with ctl_host.enter(), mlfabric.connect(final_addr, job=JOB, token_file=token,
                                                timeout=30) as ps:
            final_version, final = ps.pull(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    acked = sorted((r for r in records if r["applied"]), key=lambda r: r["version"])
    versions = [r["version"] for r in acked]
    init = np.load(f"{tmp}/init.npz")["w"]
    w, prev = init.copy(), init.copy()
    for r in acked:
        u = make_update(init.shape, r["seed"])["w"]
        w, prev = w + u + np.float32(GAMMA) * (w - prev), w
    # Training resumed: a step begun after the kill (so its pull, and its
    # push, went to the promoted replica) acknowledged.
    resumed = []
    for killed_at in kill_times:
        after = [r["t"] - killed_at for r in records if r["t_pull"] > killed_at]
        resumed.append(min(after) if after else float("nan"))
    return {"kills": len(kill_times), "acked": len(acked),
            "versions_exact": versions == list(range(1, len(acked) + 1)),
            "final_version": final_version,
            "replay_equal": bool(np.array_equal(w.view(np.uint32),
                                                final["w"].view(np.uint32))),
            "resumed_s": resumed}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="pushes per worker per run")
    ap.add_argument("--model-mib", type=float, default=1.0)
    ap.add_argument("--mbit", type=float, default=200.0)
    ap.add_argument("--heartbeat-timeout", type=float, default=0.5)
    ap.add_argument("--kills", type=int, default=5, help="server losses per run; after each "
                    "but the last a new replica joins from the promoted one's state")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from mlfabric import auth
    from mlfabric.testbed import Testbed, require_root

    require_root()
    rng = random.Random(args.seed)
    # A step moves the model twice (pull, push) over a shared link.
    expected = args.steps * 2 * args.model_mib * 8.4 / args.mbit * args.workers
    results = []
    with tempfile.TemporaryDirectory(prefix="mlfabric-bench-failover-") as tmp, \
            Testbed(hosts=args.workers + 3, rate_mbit=args.mbit) as tb:
        token = Path(tmp) / "job.token"
        token.write_text(auth.generate_token())
        token.chmod(0o600)
        n = int(args.model_mib * (1 << 20)) // 4
        np.savez(f"{tmp}/init.npz",
                 w=np.random.default_rng(args.seed).standard_normal(n).astype(np.float32))
        for r in range(args.runs):
            res = one_run(tb, tmp, args, rng, expected)
            results.append(res)
            print(f"run {r + 1}: " + "  ".join(
                f"{k} {[round(x, 3) for x in v]}" if isinstance(v, list) else f"{k} {v}"
                for k, v in res.items()), flush=True)
    resumed = [x for r in results for x in r["resumed_s"]]
    print()
    print(f"{args.runs} runs, {args.workers} workers x {args.steps} steps, {args.model_mib} MiB "
          f"model, links {args.mbit:g} Mbit/s, heartbeat timeout {args.heartbeat_timeout} s")
    print(f"  resumed after each of {len(resumed)} kills: median "
          f"{statistics.median(resumed):.3f} s, max {max(resumed):.3f} s")
    print(f"  every run: all acknowledged versions exact "
          f"{all(r['versions_exact'] for r in results)}, final model == numpy replay "
          f"{all(r['replay_equal'] for r in results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
