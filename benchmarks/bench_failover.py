"""Failover on an emulated cluster: the server process is SIGKILLed at
random points of each run (needs root).

h0 runs the server, h1 the replica, h2 the controller (heartbeats to the
server, promotes the replica), h3.. one worker each; every link is shaped to
--mbit. Workers pull, push and wait for the acknowledgement (on server and
replica), with worker-driven replication and failover on. The current server
is killed --kills times per run, each time once it has applied a random
number of updates (uniform over 10-80 % of the run's updates, distinct,
increasing); after each loss but the last, a new replica joins (`mlfabric
server --role replica --join-from PROMOTED --controller ...`) on the host the
lost server ran on, and the next kill waits until the workers feed it.

--model digits (the default): the workers train the demo's MLP
(mlfabric.tools.demo_model) on scikit-learn's bundled digits, one shard each, and
every run with kills is followed by a run without (same seeds, steps and
processes), so the held-out accuracy of the two can be compared. Each step
spends --compute-ms more (100) as if computing a larger model's gradient:
this MLP's takes under a millisecond, and a run must last long enough for
five losses and four joins with training in between.
--model synthetic: the workers push random updates of --model-mib MiB.

Per run it reports, for every kill, the time to the acknowledgement of a
step begun after it (its pull and push went to the promoted replica:
training resumed); whether the versions acknowledged are exactly 1..N (none
lost, none twice); whether the final model (the last promoted replica's)
equals a numpy replay of every acknowledged update in version order, bit
for bit; and with digits, the final model's held-out accuracy.

    sudo python benchmarks/bench_failover.py [--runs 3] [--model digits]
        [--workers 3] [--steps 120] [--compute-ms 100] [--kills 5] [--mbit 200]
        [--heartbeat-timeout 0.5] [--model-mib 1 (synthetic)]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
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

from mlfabric.tools.workload import serving_address

JOB = "bench-failover"
SYNTHETIC_GAMMA = 0.9


def make_update(shape: tuple[int, ...], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": (1e-3 * rng.standard_normal(shape)).astype(np.float32)}


class Recorder:
    """Stands between a training loop and the client: keeps every update
    pushed, with when its step began (the pull) and when it was acknowledged.
    Each step computes for `compute_s` more (a real model's gradient takes
    longer than this MLP's), so a run is long enough for five losses."""

    def __init__(self, ps: Any, compute_s: float) -> None:
        self.ps = ps
        self.compute_s = compute_s
        self.records: list[dict[str, Any]] = []
        self.updates: dict[str, np.ndarray] = {}
        self._t_pull = 0.0

    def pull(self) -> tuple[int, dict[str, np.ndarray]]:
        self._t_pull = time.perf_counter()
        return self.ps.pull(timeout=60)

    def push(self, update: dict[str, np.ndarray], *, base_version: int) -> Any:
        time.sleep(self.compute_s)
        i = len(self.records)
        record: dict[str, Any] = {"i": i, "t_pull": self._t_pull}
        self.records.append(record)
        for name, a in update.items():
            self.updates[f"u{i}/{name}"] = a
        fut = self.ps.push(update, base_version=base_version)

        def done(f: Any) -> None:
            record["t"] = time.perf_counter()
            if f.exception() is None:
                outcome = f.result()
                record["version"], record["applied"] = outcome.version, outcome.applied
                # Each shard's place in its server's order, and the size of
                # the step it was part of (an aggregate's members share one).
                parts = getattr(outcome, "shards", ()) or (outcome,)
                record["place"] = [[o.seq, o.fan_in or 1] for o in parts]

        fut.add_done_callback(done)
        return fut


def worker(argv: list[str]) -> int:
    import mlfabric

    p = argparse.ArgumentParser()
    for flag in ("--server", "--replica", "--controller", "--token-file", "--out", "--model"):
        p.add_argument(flag, required=True)
    for flag in ("--steps", "--index", "--workers"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--eta", type=float, required=True)
    p.add_argument("--compute-ms", type=float, required=True)
    args = p.parse_args(argv)
    with mlfabric.connect(args.server, job=JOB, token_file=args.token_file, timeout=30,
                          controller=args.controller, controller_fallback="wait",
                          replica=args.replica, failover_timeout=30) as ps:
        rec = Recorder(ps, args.compute_ms / 1000)
        if args.model == "digits":
            from mlfabric.tools import demo_model as dm

            X, y, _, _ = dm.load_digits_split()
            Xs, ys = dm.shard(X, y, args.workers, args.index)
            dm.train_worker(rec, Xs, ys, steps=args.steps, batch_size=dm.DEFAULTS["batch_size"],
                            eta=args.eta, seed=args.index, timeout=120)
        else:
            for i in range(args.steps):
                version, params = rec.pull()
                update = make_update(params["w"].shape, 1000 * args.index + i)
                rec.push(update, base_version=version).result(120)
    np.savez(f"{args.out}.npz", **rec.updates)
    Path(f"{args.out}.json").write_text(json.dumps(rec.records))
    return 0


async def _pong(address: str, token: bytes) -> Any:
    """The Pong of the server or replica at `address` (its role and version)."""
    from mlfabric.client.aio import open_link
    from mlfabric.wire.handshake import ClientHandshake
    from mlfabric.wire.protocol import Ping, Pong

    answer = asyncio.get_running_loop().create_future()

    def on_event(event: Any) -> None:
        if isinstance(event, Pong) and not answer.done():
            answer.set_result(event)

    link = await open_link(address, ClientHandshake(JOB, token, "bench"), 5.0, "replica server",
                           on_event=on_event)
    try:
        link.send(Ping(1))
        return await asyncio.wait_for(answer, 5.0)
    finally:
        link.close()


def pong(host: Any, address: str, token: bytes) -> Any:
    with host.enter():
        return asyncio.run(_pong(address, token))


def wait_for(what: str, host: Any, address: str, token: bytes, check: Any,
             workers: list[subprocess.Popen[str]], timeout: float = 120.0) -> Any:
    """Ask the server or replica at `address` for its Pong every 20 ms until
    `check(pong)` holds, and return that Pong; fail if the workers all ended
    first (nothing will change any more) or after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not check(answer := pong(host, address, token)):
        if all(w.poll() is not None for w in workers):
            failed = [f"worker {i} exited {w.returncode}: {w.stderr.read()[-2000:]}"
                      for i, w in enumerate(workers) if w.returncode]
            raise RuntimeError("; ".join(failed) or f"the workers finished before {what}: "
                               f"lower --kills or raise --steps")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout} s")
        time.sleep(0.02)
    return answer


def steps(placed: list[tuple[int, int, dict[str, np.ndarray]]]
          ) -> tuple[list[dict[str, np.ndarray]], bool]:
    """One server's steps from its acknowledged updates as (place, fan_in,
    update): an update alone is a step, and an aggregate's members (places
    p .. p + k - 1) are one step with their sum, formed left to right in
    member order as the aggregator forms it. Also whether the places are
    exactly 1..N, each aggregate whole (none lost, none twice)."""
    placed = sorted(placed, key=lambda x: x[0])
    exact = [p for p, _, _ in placed] == list(range(1, len(placed) + 1))
    out, i = [], 0
    while i < len(placed):
        k = placed[i][1]
        members = [u for _, _, u in placed[i:i + k]]
        exact &= len(members) == k and all(f == k for _, f, _ in placed[i:i + k])
        out.append({n: functools.reduce(np.add, (u[n] for u in members)) for n in members[0]})
        i += k
    return out, exact


def replay(init: dict[str, np.ndarray], updates: list[dict[str, np.ndarray]],
           gamma: float) -> dict[str, np.ndarray]:
    """The server's rule in float32 numpy, in the order given."""
    g = np.float32(gamma)
    w = {n: a.copy() for n, a in init.items()}
    prev = {n: a.copy() for n, a in init.items()}
    for u in updates:
        for n in w:
            w[n], prev[n] = w[n] + u[n] + g * (w[n] - prev[n]), w[n]
    return w


def collect(workers: list[subprocess.Popen[str]], tmp: str, tag: str, *, timeout: float
            ) -> tuple[list[dict[str, Any]], list[dict[str, np.ndarray]]]:
    """Wait for the workers and read what each recorded: every step's record
    (its update's index in the second list as "u") and every update."""
    records: list[dict[str, Any]] = []
    updates: list[dict[str, np.ndarray]] = []
    for i, p in enumerate(workers):
        if p.wait(timeout=timeout) != 0:
            raise RuntimeError(f"worker {i} failed: {p.stderr.read()[-3000:]}")
        arrays = np.load(f"{tmp}/{tag}-w{i}.npz")
        for r in json.loads(Path(f"{tmp}/{tag}-w{i}.json").read_text()):
            names = [k.split("/", 1)[1] for k in arrays.files if k.startswith(f"u{r['i']}/")]
            r["u"] = len(updates)
            updates.append({n: arrays[f"u{r['i']}/{n}"] for n in names})
            records.append(r)
    return records, updates


def one_run(tb: Any, tmp: str, args: argparse.Namespace, rng: random.Random,
            kills: int, tag: str) -> dict[str, Any]:
    import mlfabric

    h0, h1, ctl_host, *workers = tb.hosts
    token = f"{tmp}/job.token"
    secret = Path(token).read_bytes().strip()
    py = [sys.executable, "-m", "mlfabric", "--log-level", "WARNING"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    kw: dict[str, Any] = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=tmp, env=env)
    common = ["--job", JOB, "--token-file", token, "--momentum", str(args.gamma),
              "--tau-max", "-1"]
    init = ["--init", f"{tmp}/init.npz"]
    total = args.workers * args.steps
    targets = sorted(rng.sample(range(total // 10, total * 8 // 10), kills))
    procs = []
    kill_times: list[float] = []
    kill_versions: list[int] = []  # the server's version just before each kill
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
                "--model", args.model, "--eta", str(args.eta), "--compute-ms",
                str(args.compute_ms), "--workers",
                str(args.workers), "--steps", str(args.steps), "--index", str(i),
                "--out", f"{tmp}/{tag}-w{i}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp,
                env=env))
        server_proc, server_addr, server_host = srv, srv_addr, h0
        replica_proc, replica_addr, replica_host = rep, rep_addr, h1
        fed_from: int | None = None  # a joined replica's version when it served
        for k, target in enumerate(targets):
            # A random point of the run, and (after a loss) not before the
            # workers feed the joined replica: what the server alone
            # acknowledges while none is attached is lost with it, by design.
            last = wait_for(f"kill {k + 1} at version {target}", server_host, server_addr,
                            secret, lambda p, target=target: p.version >= target, workers_p)
            if fed_from is not None:
                wait_for("the workers feeding the joined replica", replica_host, replica_addr,
                         secret, lambda p, v=fed_from + 2 * args.workers: p.version >= v,
                         workers_p)
                last = pong(server_host, server_addr, secret)
            server_proc.send_signal(signal.SIGKILL)
            kill_times.append(time.perf_counter())
            kill_versions.append(last.version)
            wait_for("the promotion", replica_host, replica_addr, secret,
                     lambda p: p.role == "server", workers_p, timeout=30)
            if k == kills - 1:
                server_addr, server_host = replica_addr, replica_host
                break
            # A new replica joins from the promoted one's state, on the host
            # the lost server ran on.
            server_host_lost = server_host
            new = tb.popen(server_host_lost, [
                *py, "server", "--role", "replica", "--listen", f"{server_host_lost.ip}:0",
                *common, "--join-from", replica_addr, "--controller", ctl_addr], **kw)
            procs.append(new)
            new_addr = serving_address(new, "joining replica")
            server_proc, server_addr, server_host = replica_proc, replica_addr, replica_host
            replica_proc, replica_addr, replica_host = new, new_addr, server_host_lost
            fed_from = pong(replica_host, replica_addr, secret).version
        records, updates = collect(workers_p, tmp, tag, timeout=600)
        # Without kills the server serves to the end; with them, the replica
        # promoted at the last kill.
        with ctl_host.enter(), mlfabric.connect(server_addr, job=JOB, token_file=token,
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
    acked = sorted((r for r in records if r.get("applied")), key=lambda r: r["version"])
    versions = [r["version"] for r in acked]
    start = dict(np.load(f"{tmp}/init.npz"))
    ref = replay(start, [updates[r["u"]] for r in acked], args.gamma)
    # Training resumed: a step begun after the kill (so its pull, and its
    # push, went to the promoted replica) acknowledged.
    resumed = []
    for killed_at in kill_times:
        after = [r["t"] - killed_at for r in records if r["t_pull"] > killed_at and "t" in r]
        resumed.append(min(after) if after else float("nan"))
    result: dict[str, Any] = {
        "kills": len(kill_times), "pushed": len(records), "acked": len(acked),
        "versions_exact": versions == list(range(1, len(acked) + 1)),
        "final_version": final_version,
        "replay_equal": all(np.array_equal(ref[n].view(np.uint32), final[n].view(np.uint32))
                            for n in ref),
        "killed_near_version": kill_versions, "resumed_s": resumed}
    if args.model == "digits":
        from mlfabric.tools import demo_model as dm

        _, _, X_test, y_test = dm.load_digits_split()
        result["accuracy"] = dm.accuracy(final, X_test, y_test)
        result["loss"] = dm.loss_and_grads(final, X_test, y_test)[0]
    result["final"] = final
    return result


def _fmt(res: dict[str, Any]) -> str:
    return "  ".join(f"{k} {[round(x, 3) for x in v]}" if isinstance(v, list)
                     else f"{k} {round(v, 4) if isinstance(v, float) else v}"
                     for k, v in res.items() if k != "final")


def _distance(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(np.sum((a[n].astype(np.float64) - b[n]) ** 2) for n in a)))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--model", choices=("digits", "synthetic"), default="digits",
                    help="train the demo's MLP on digits (with a run without kills after "
                    "each run with them), or push random updates")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=120, help="pushes per worker per run")
    ap.add_argument("--model-mib", type=float, default=1.0, help="synthetic model size")
    ap.add_argument("--eta", type=float, default=None,
                    help="digits learning rate (default: the demo's)")
    ap.add_argument("--gamma", type=float, default=None,
                    help=f"server momentum (default: the demo's for digits, "
                    f"{SYNTHETIC_GAMMA} synthetic)")
    ap.add_argument("--compute-ms", type=float, default=None,
                    help="extra computation per step (default: 100 digits, 0 synthetic)")
    ap.add_argument("--mbit", type=float, default=200.0)
    ap.add_argument("--heartbeat-timeout", type=float, default=0.5)
    ap.add_argument("--kills", type=int, default=5, help="server losses per run; after each "
                    "but the last a new replica joins from the promoted one's state")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from mlfabric.tools import demo_model as dm
    from mlfabric.tools.testbed import Testbed, require_root
    from mlfabric.wire import auth

    require_root()
    if args.gamma is None:
        args.gamma = dm.DEFAULTS["gamma"] if args.model == "digits" else SYNTHETIC_GAMMA
    if args.compute_ms is None:
        args.compute_ms = 100.0 if args.model == "digits" else 0.0
    if args.eta is None:
        args.eta = dm.DEFAULTS["eta"]
    total = args.workers * args.steps
    if not 0 <= args.kills <= total * 7 // 10:
        ap.error(f"--kills {args.kills} needs at least {args.kills / 0.7:.0f} updates per run "
                 f"(--workers x --steps is {total})")
    rng = random.Random(args.seed)
    killed: list[dict[str, Any]] = []
    clean: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mlfabric-bench-failover-") as tmp, \
            Testbed(hosts=args.workers + 3, rate_mbit=args.mbit) as tb:
        token = Path(tmp) / "job.token"
        token.write_text(auth.generate_token())
        token.chmod(0o600)
        if args.model == "digits":
            np.savez(f"{tmp}/init.npz", **dm.init_params(seed=args.seed))
        else:
            n = int(args.model_mib * (1 << 20)) // 4
            np.savez(f"{tmp}/init.npz",
                     w=np.random.default_rng(args.seed).standard_normal(n).astype(np.float32))
        for r in range(args.runs):
            t0 = time.monotonic()
            res = one_run(tb, tmp, args, rng, args.kills, f"k{r}")
            res["seconds"] = time.monotonic() - t0
            killed.append(res)
            print(f"run {r + 1}, {args.kills} kills: {_fmt(res)}", flush=True)
            if args.model == "digits":
                t0 = time.monotonic()
                res = one_run(tb, tmp, args, rng, 0, f"c{r}")
                res["seconds"] = time.monotonic() - t0
                # Asynchronous training applies in a different order each
                # run: how far apart the two final models are, for scale.
                res["distance_to_killed_run"] = _distance(res["final"], killed[-1]["final"])
                clean.append(res)
                print(f"run {r + 1}, no kill: {_fmt(res)}", flush=True)
    resumed = [x for r in killed for x in r["resumed_s"]]
    print()
    model = (f"digits MLP, eta {args.eta:g}" if args.model == "digits"
             else f"{args.model_mib} MiB synthetic model")
    model += f", {args.compute_ms:g} ms of computation per step"
    print(f"{args.runs} runs, {args.workers} workers x {args.steps} steps, {model}, momentum "
          f"{args.gamma:g}, links {args.mbit:g} Mbit/s, heartbeat timeout "
          f"{args.heartbeat_timeout} s")
    if resumed:
        print(f"  resumed after each of {len(resumed)} kills: median "
              f"{statistics.median(resumed):.3f} s, max {max(resumed):.3f} s")
    for label, rs in (("with kills", killed), ("without", clean)):
        if not rs:
            continue
        print(f"  {label}: all acknowledged versions exact "
              f"{all(r['versions_exact'] for r in rs)}, final model == numpy replay "
              f"{all(r['replay_equal'] for r in rs)}, median run "
              f"{statistics.median(r['seconds'] for r in rs):.1f} s", end="")
        if args.model == "digits":
            accs = [r["accuracy"] for r in rs]
            print(f", held-out accuracy median {statistics.median(accs):.4f} "
                  f"(min {min(accs):.4f}, max {max(accs):.4f}), loss median "
                  f"{statistics.median(r['loss'] for r in rs):.4f}", end="")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
