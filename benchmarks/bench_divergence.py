"""The divergence bound on an emulated cluster: measured ||w_s - w_r||_2
against --div-max, and what a tight bound costs in throughput (needs root).

h0 runs the server, h1 the replica, h2 the controller (with the divergence
gate), all three in this process, each on an event loop in a thread that
lives in its host's network namespace; h3.. run one worker process each
(worker-driven replication, pull / push / wait for the acknowledgement);
every link is shaped to --mbit. A sampler freezes the server's event loop,
snapshots the replica from inside it (so both states are of one instant)
and measures ||w_s - w_r||_2 with the l2_norm_diff kernel, continuously.
Div_max values are multiples of the largest single step the workers can
make (||a|| + gamma B <= ||a|| / (1 - gamma)): below it no bound can be kept.
Values alternate within every round.

    sudo python benchmarks/bench_divergence.py [--rounds 2] [--workers 4]
        [--steps 30] [--model-mib 1] [--mbit 200] [--factors 1,2,4,inf]
        [--correlation 0.9]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

JOB = "bench-divergence"
GAMMA = 0.9
SCALE = 1e-3


def make_update(n: int, seed: int, correlation: float) -> dict[str, np.ndarray]:
    """Noise plus a share `correlation` of one fixed direction: successive
    gradients of real training point roughly the same way, which is when the
    bound (a sum of norms) is close to the truth; independent noise in a
    million dimensions nearly cancels instead."""
    common = np.random.default_rng(424242).standard_normal(n)
    noise = np.random.default_rng(seed).standard_normal(n)
    u = correlation * common + math.sqrt(1 - correlation ** 2) * noise
    return {"w": (SCALE * u).astype(np.float32)}


def worker(argv: list[str]) -> int:
    import mlfabric

    p = argparse.ArgumentParser()
    for flag in ("--server", "--replica", "--controller", "--token-file", "--out"):
        p.add_argument(flag, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--correlation", type=float, required=True)
    args = p.parse_args(argv)
    records = []
    with mlfabric.connect(args.server, job=JOB, token_file=args.token_file, timeout=30,
                          controller=args.controller, controller_fallback="wait",
                          replica=args.replica) as ps:
        for i in range(args.steps):
            version, params = ps.pull(timeout=60)
            t0 = time.perf_counter()
            u = make_update(params["w"].size, 1000 * args.index + i, args.correlation)
            outcome = ps.push(u, base_version=version).result(120)
            records.append({"applied": outcome.applied, "push": time.perf_counter() - t0,
                            "t": time.perf_counter()})
    Path(args.out).write_text(json.dumps(records))
    return 0


class LoopThread:
    """An mlfabric endpoint on its own event loop, in a thread that lives in
    a testbed host's network namespace."""

    def __init__(self, endpoint: Any, host: Any) -> None:
        self.endpoint = endpoint
        self.host = host
        self.loop: asyncio.AbstractEventLoop | None = None
        self.address = ""
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        # Threads start in the namespace of the thread that creates them.
        with host.enter():
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()
        assert self._ready.wait(30), "endpoint did not start"

    def _run(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            ip, port = await self.endpoint.start(self.host.ip, 0)
            self.address = f"{ip}:{port}"
            self._ready.set()
            await self._stop.wait()
            await self.endpoint.close()

        asyncio.run(main())

    def call(self, fn: Any) -> Any:
        assert self.loop is not None

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def close(self) -> None:
        if self.loop is not None and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(30)


def one_run(tb: Any, tmp: str, args: argparse.Namespace, div_max: float, n: int
            ) -> dict[str, Any]:
    from mlfabric.controller.controller import Controller
    from mlfabric.kernels import _core
    from mlfabric.replication.divergence import DivergenceGate
    from mlfabric.replication.replica import ReplicaServer
    from mlfabric.runtime.metrics import ServerMetrics
    from mlfabric.scheduling.plan import fifo_policy
    from mlfabric.server.server import ParameterServer
    from mlfabric.server.store import ParameterStore

    h0, h1, h2, *workers = tb.hosts
    token = Path(f"{tmp}/job.token").read_bytes().strip()
    init = {"w": np.load(f"{tmp}/init.npz")["w"]}
    gate = DivergenceGate(GAMMA, div_max if math.isfinite(div_max) else 1e300)
    server = LoopThread(ParameterServer(ParameterStore(init, momentum=GAMMA), job=JOB,
                                        token=token, metrics=ServerMetrics()), h0)
    replica = LoopThread(ReplicaServer(ParameterStore(init, momentum=GAMMA), job=JOB,
                                       token=token, metrics=ServerMetrics()), h1)
    controller = LoopThread(Controller(fifo_policy, job=JOB, token=token, tau_max=None,
                                       gate=gate), h2)
    samples: list[float] = []
    stop = threading.Event()
    s_store, r_store = server.endpoint.store, replica.endpoint.store

    def sample_both() -> float:
        # In the server's loop: nothing is applied there until the replica's
        # snapshot (taken in the replica's loop) is back.
        ws = s_store.weights["w"].copy()
        wr = replica.call(lambda: r_store.weights["w"].copy())
        return _core.l2_norm_diff(ws, wr)

    def sampler() -> None:
        while not stop.is_set():
            samples.append(server.call(sample_both))

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = []
    try:
        sampling = threading.Thread(target=sampler, daemon=True)
        sampling.start()
        for i, h in enumerate(workers):
            procs.append(tb.popen(h, [
                sys.executable, os.path.abspath(__file__), "--worker", "--server",
                server.address, "--replica", replica.address, "--controller",
                controller.address, "--token-file", f"{tmp}/job.token", "--steps",
                str(args.steps), "--index", str(i), "--correlation", str(args.correlation),
                "--out", f"{tmp}/w{i}.json"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp,
                env=env))
        records = []
        for i, p in enumerate(procs):
            if p.wait(timeout=600) != 0:
                raise RuntimeError(f"worker {i} failed: {p.stderr.read()[-3000:]}")
            records += json.loads(Path(f"{tmp}/w{i}.json").read_text())
        stop.set()
        sampling.join(30)
        final = server.call(sample_both)
    finally:
        stop.set()
        for p in procs:
            if p.poll() is None:
                p.kill()
        for lt in (controller, server, replica):
            lt.close()
    span = max(r["t"] for r in records) - min(r["t"] - r["push"] for r in records)
    return {"samples": len(samples), "max_measured": max(samples),
            "median_measured": statistics.median(samples), "final": final,
            "held": gate.held, "overrides": gate.overrides,
            "push_s": statistics.median(r["push"] for r in records),
            "updates_per_s": len(records) / span}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30, help="pushes per worker per run")
    ap.add_argument("--model-mib", type=float, default=1.0)
    ap.add_argument("--mbit", type=float, default=200.0)
    ap.add_argument("--correlation", type=float, default=0.9,
                    help="share of a common direction in every update (0: independent)")
    ap.add_argument("--factors", default="1,2,4,inf",
                    help="Div_max as multiples of the largest single step")
    args = ap.parse_args()
    from mlfabric.kernels import _core
    from mlfabric.tools.testbed import Testbed, require_root
    from mlfabric.wire import auth

    require_root()
    n = int(args.model_mib * (1 << 20)) // 4
    a_max = max(_core.l2_norm(make_update(n, 1000 * w + i, args.correlation)["w"])
                for w in range(args.workers) for i in range(args.steps))
    step = a_max / (1 - GAMMA)  # ||a|| + gamma B with B <= ||a|| / (1 - gamma)
    factors = [float(f) for f in args.factors.split(",")]
    runs: dict[float, list[dict[str, Any]]] = {f: [] for f in factors}
    with tempfile.TemporaryDirectory(prefix="mlfabric-bench-div-") as tmp, \
            Testbed(hosts=args.workers + 3, rate_mbit=args.mbit) as tb:
        token = Path(tmp) / "job.token"
        token.write_text(auth.generate_token())
        token.chmod(0o600)
        np.savez(f"{tmp}/init.npz",
                 w=np.random.default_rng(0).standard_normal(n).astype(np.float32))
        for r in range(args.rounds):
            order = factors[r % len(factors):] + factors[:r % len(factors)]
            for f in order:
                res = one_run(tb, tmp, args, f * step * 1.001, n)
                runs[f].append(res)
                print(f"round {r + 1} div_max {f:g} x {step:.3f}: " + "  ".join(
                    f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in res.items()), flush=True)
    print()
    print(f"{args.workers} workers x {args.steps} steps, {args.model_mib} MiB model, links "
          f"{args.mbit:g} Mbit/s, momentum {GAMMA}, correlation {args.correlation}; largest "
          f"single step {step:.3f}")
    print(f"  {'div_max':>10s} {'samples':>8s} {'max meas.':>10s} {'held':>6s} "
          f"{'overrides':>9s} {'push s':>8s} {'upd/s':>8s}")
    for f in factors:
        rs = runs[f]
        dm = f * step * 1.001
        print(f"  {dm:10.3f} {sum(x['samples'] for x in rs):8d} "
              f"{max(x['max_measured'] for x in rs):10.4f} "
              f"{statistics.median(x['held'] for x in rs):6.0f} "
              f"{statistics.median(x['overrides'] for x in rs):9.0f} "
              f"{statistics.median(x['push_s'] for x in rs):8.4f} "
              f"{statistics.median(x['updates_per_s'] for x in rs):8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
