"""Several controllers for one job (issue 34): how long a killed controller's
shards take to move, and what the workers see meanwhile.

A real etcd (mlfabric.tools.etcd), S server shards (`mlfabric server --shard
i/S`) and C controllers (`mlfabric controller --etcd ... --lease-ttl T`), all
processes on loopback; W workers in this process, each pushing small updates
in a loop (pull, push, wait for the outcome), with controller_fallback
"wait" so that nothing goes unscheduled. Each round kills the controller
that holds shard 0 with SIGKILL, measures:

- takeover: from the kill to another controller holding shard 0 in etcd
  (read every 10 ms). The bound is the lease: up to T after the last renewal,
  plus etcd's expiry sweep (up to 0.5 s) and the next controller's read
  (a quarter lease, at most 0.25 s); the ratio takeover / T is printed;
- stall: the longest push of any worker that spans the kill (pull to outcome);
- lost: pushes that failed (must be 0) or went without a controller (0);

then starts the killed controller again (it comes back holding nothing: it
does not take shards back) and goes on. Printed per (C, T): medians and
maxima over the rounds.

    python benchmarks/bench_controllers.py [--controllers 2,3,4] [--ttls 1,2]
        [--shards 4] [--workers 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import mlfabric
from mlfabric.coordination import ownership
from mlfabric.coordination.etcd import EtcdClient, parse_endpoints
from mlfabric.runtime.metrics import ClientMetrics
from mlfabric.tools.chaos import free_port
from mlfabric.tools.etcd import etcd_argv
from mlfabric.tools.workload import serving_address
from mlfabric.wire import auth

JOB = "bench-controllers"
PY = [sys.executable, "-m", "mlfabric", "--log-level", "WARNING"]


def sample(metric: Any) -> float:
    return float(next(iter(metric.collect())).samples[0].value)


def owner(url: str, shard: int) -> str:
    async def read() -> str:
        client = EtcdClient(parse_endpoints(url)[0], timeout=1.0)
        try:
            _, owners = ownership.read(JOB, await client.range(ownership.prefix(JOB)),
                                       ownership.MAX_SHARDS)
        finally:
            await client.close()
        return owners.get(shard, ("", 0))[0]

    return asyncio.run(read())


class Pusher(threading.Thread):
    def __init__(self, servers: str, controllers: str, token: bytes, k: int) -> None:
        super().__init__(daemon=True)
        self.metrics = ClientMetrics()
        self.ps = mlfabric.connect(servers, job=JOB, token=token, controller=controllers,
                                   controller_fallback="wait", controller_timeout=60,
                                   host=f"w{k}", metrics=self.metrics)
        self.pushes: list[tuple[float, float, bool]] = []  # (start, end, applied)
        self.failed: list[str] = []
        self.stop = threading.Event()
        self.rng = np.random.default_rng(k)

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                version, params = self.ps.pull(timeout=30)
                update = {n: (self.rng.standard_normal(a.shape) * 1e-3).astype(a.dtype)
                          for n, a in params.items()}
                outcome = self.ps.push(update, base_version=version).result(60)
            except Exception as exc:  # counted: the benchmark says so
                self.failed.append(repr(exc))
                continue
            self.pushes.append((t0, time.monotonic(), outcome.applied))


def controller(me: str, names: list[str], url: str, shards: int, ttl: int, token: Path,
               tmp: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*PY, "controller", "--listen", me, "--job", JOB, "--token-file", str(token),
         "--etcd", url, "--controllers", ",".join(names), "--shards", str(shards),
         "--lease-ttl", str(ttl)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp)


def run(c: int, ttl: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-controllers-") as tmp, \
            contextlib.ExitStack() as stack:
        token_text = auth.generate_token()
        token = Path(tmp) / "job.token"
        token.write_text(token_text)
        token.chmod(0o600)
        init = Path(tmp) / "init.npz"
        np.savez(init, w=np.zeros(args.model_kib * 256, np.float32))
        procs: list[subprocess.Popen[str]] = []

        def stop_all() -> None:
            for p in procs:
                p.kill()
                p.wait(10)

        stack.callback(stop_all)
        client_port, peer_port = free_port(), free_port()
        url = f"http://127.0.0.1:{client_port}"
        log = stack.enter_context(open(Path(tmp) / "etcd.log", "w"))
        procs.append(subprocess.Popen(etcd_argv("127.0.0.1", client_port, peer_port,
                                                Path(tmp) / "etcd", log_level="info"),
                                      stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 30
        while "ready to serve client requests" not in (Path(tmp) / "etcd.log").read_text():
            if time.monotonic() > deadline:
                raise RuntimeError("etcd did not start")
            time.sleep(0.05)
        servers = []
        for i in range(args.shards):
            p = subprocess.Popen([*PY, "server", "--listen", "127.0.0.1:0", "--job", JOB,
                                  "--token-file", str(token), "--init", str(init),
                                  "--shard", f"{i}/{args.shards}"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 cwd=tmp)
            procs.append(p)
            servers.append(serving_address(p, f"shard {i}"))
        names = [f"127.0.0.1:{free_port()}" for _ in range(c)]
        ctl: dict[str, subprocess.Popen[str]] = {}
        for me in names:
            ctl[me] = controller(me, names, url, args.shards, ttl, token, tmp)
            procs.append(ctl[me])
            serving_address(ctl[me], f"controller {me}")
        pushers = [Pusher(",".join(servers), ",".join(names), token_text.encode(), k)
                   for k in range(args.workers)]
        for p in pushers:
            stack.callback(p.ps.close)
            p.start()
        takeovers, stalls = [], []
        time.sleep(1.0)  # pushes under way
        for r in range(args.rounds):
            victim = owner(url, 0)
            ctl[victim].kill()
            ctl[victim].wait(10)
            killed = time.monotonic()
            while (now_owner := owner(url, 0)) in ("", victim):
                if time.monotonic() - killed > 30:
                    raise RuntimeError("shard 0 did not move within 30 s")
                time.sleep(0.01)
            takeovers.append(time.monotonic() - killed)
            time.sleep(ttl + 1.0)  # the workers' pushes resume
            stalls.append(max((end - start for p in pushers for start, end, _ in p.pushes
                               if start <= killed <= end), default=0.0))
            print(f"    round {r + 1}: killed {victim}, shard 0 to {now_owner} after "
                  f"{takeovers[-1]:.2f} s; longest push across the kill {stalls[-1]:.2f} s",
                  flush=True)
            procs.remove(ctl[victim])
            ctl[victim] = controller(victim, names, url, args.shards, ttl, token, tmp)
            procs.append(ctl[victim])
            serving_address(ctl[victim], f"controller {victim} (again)")
        for p in pushers:
            p.stop.set()
        for p in pushers:
            p.join(70)
        pushes = sum(len(p.pushes) for p in pushers)
        failed = sum(len(p.failed) for p in pushers)
        unscheduled = sum(sample(p.metrics.controller_fallback_updates) for p in pushers)
        applied = sum(a for p in pushers for _, _, a in p.pushes)
        return {"takeover": takeovers, "stall": stalls, "pushes": pushes, "failed": failed,
                "applied": applied, "unscheduled": unscheduled,
                "errors": [e for p in pushers for e in p.failed][:3]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--controllers", default="2,3,4")
    ap.add_argument("--ttls", default="1,2", help="--lease-ttl values, seconds")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model-kib", type=int, default=256, help="model (and update) size")
    args = ap.parse_args()
    # The workers' warnings about each lost controller would drown the table.
    logging.getLogger("mlfabric").setLevel(logging.ERROR)
    try:
        for ttl in (int(x) for x in args.ttls.split(",")):
            for c in (int(x) for x in args.controllers.split(",")):
                print(f"{c} controllers, {args.shards} shards, {args.workers} workers, "
                      f"lease {ttl} s:", flush=True)
                r = run(c, ttl, args)
                t, s = r["takeover"], r["stall"]
                print(f"  takeover median {statistics.median(t):.2f} s max {max(t):.2f} s "
                      f"({statistics.median(t) / ttl:.2f}x the lease); longest push across "
                      f"a kill median {statistics.median(s):.2f} s max {max(s):.2f} s; "
                      f"pushes {r['pushes']} applied {r['applied']} failed {r['failed']} "
                      f"unscheduled {r['unscheduled']:.0f}"
                      + (f" errors {r['errors']}" if r["errors"] else ""), flush=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
