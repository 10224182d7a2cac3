"""`mlfabric demo`: train a small model through a local parameter server.

Starts `mlfabric server` as a real process on loopback and several worker
processes that pull, compute a gradient on their shard of scikit-learn's
digits data set and push, all over TCP. The demo's own process watches:
it pulls the model now and then, shows progress, and ends with the held-out
accuracy, how many updates were applied and dropped, and their staleness.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from ..client.blocking import connect
from ..errors import ConfigError, MlfabricError
from ..wire import auth

JOB = "demo"
TARGET_ACCURACY = 0.90


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .demo_model import DEFAULTS

    p.add_argument("--workers", type=int, default=DEFAULTS["workers"],
                   help=f"worker processes (default: {DEFAULTS['workers']})")
    p.add_argument("--steps", type=int, default=DEFAULTS["steps_per_worker"],
                   help=f"pushes per worker (default: {DEFAULTS['steps_per_worker']})")
    p.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"])
    p.add_argument("--eta", type=float, default=DEFAULTS["eta"], help="learning rate")
    p.add_argument("--momentum", type=float, default=DEFAULTS["gamma"],
                   help=f"server momentum (default: {DEFAULTS['gamma']})")
    p.add_argument("--tau-max", type=int, default=DEFAULTS["tau_max"],
                   help=f"staleness bound in versions (default: {DEFAULTS['tau_max']})")
    p.add_argument("--hidden", type=int, default=DEFAULTS["hidden"], help="hidden units")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards", type=int, default=1, metavar="S",
                   help="partition the model over S server processes (`mlfabric server "
                        "--shard I/S`), each applying its part (default: 1)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="let the server export Prometheus metrics on this port (shard I "
                        "on this port + I)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write the summary as JSON to PATH")
    p.add_argument("--contention", action="store_true",
                   help="instead: FIFO vs mlfabric (without aggregation, with aggregation at "
                        "agents, and with aggregation that waits for every worker: "
                        "--group-wait) on an emulated cluster with other tenants' traffic and "
                        "a straggler, ending with a comparison table (root)")


def _check(args: argparse.Namespace) -> None:
    if args.workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {args.workers}")
    if args.steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {args.steps}")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    if not args.eta > 0:
        raise ConfigError(f"--eta must be positive, got {args.eta}")
    if not 1 <= args.shards <= 64:
        raise ConfigError(f"--shards must be from 1 to 64, got {args.shards}")


# --- worker processes -----------------------------------------------------------


def _worker_main(address: str, token_file: str, index: int, args: dict[str, Any],
                 events: Any) -> None:
    """One worker process: train on shard `index` and report every outcome."""
    from .demo_model import load_digits_split, shard, train_worker

    try:
        x_train, y_train, _, _ = load_digits_split(seed=args["seed"])
        x, y = shard(x_train, y_train, args["workers"], index)
        with connect(address, job=JOB, token_file=token_file, name=f"demo-worker-{index}") as ps:
            train_worker(
                ps, x, y,
                steps=args["steps"],
                batch_size=args["batch_size"],
                eta=args["eta"],
                seed=args["seed"] * 1000 + index,
                on_outcome=lambda o: events.put(("outcome", index, o.applied, o.delay)),
            )
        events.put(("done", index, None, None))
    except BaseException as exc:  # reported to the demo's process, which prints it
        events.put(("failed", index, f"{type(exc).__name__}: {exc}", None))


# --- the server process ------------------------------------------------------------


class _ServerProcess:
    def __init__(self, argv: list[str], cwd: str) -> None:
        # cwd: `python -m` puts the working directory first on sys.path; run
        # from a directory that holds no source tree of mlfabric.
        self.proc = subprocess.Popen(
            argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,  # Ctrl-C reaches the demo, which stops the server
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(
            target=self._pump, args=(self.proc.stdout, self._lines), daemon=True
        ).start()
        threading.Thread(target=self._collect, daemon=True).start()

    @staticmethod
    def _pump(stream: Any, lines: queue.Queue[str | None]) -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    def _collect(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line.rstrip())

    def wait_serving(self, timeout: float) -> str:
        """The HOST:PORT from the server's 'serving' line."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise MlfabricError(f"the server did not start within {timeout:.0f} s") from None
            if line is None:
                self.proc.wait(5)
                detail = self.stderr[-1] if self.stderr else f"exit code {self.proc.returncode}"
                raise MlfabricError(f"the server exited at start: {detail}")
            if " on " in line and "serving" in line:
                return line.split(" on ", 1)[1].split()[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


# --- progress and summary -----------------------------------------------------------


class _Progress:
    """One status line: redrawn in place on a terminal, every 10% otherwise."""

    def __init__(self, total: int, stream: Any = sys.stdout) -> None:
        self.total = total
        self.stream = stream
        self.tty = stream.isatty()
        self.started = time.monotonic()
        self._last_decile = -1

    def show(self, done: int, applied: int, dropped: int, accuracy: float | None) -> None:
        frac = done / self.total if self.total else 1.0
        width = 24
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        acc = f"{accuracy:.3f}" if accuracy is not None else "  -  "
        line = (f"[{bar}] {done:>5}/{self.total} updates  applied {applied:>5}  dropped "
                f"{dropped:>4}  held-out acc {acc}  {time.monotonic() - self.started:5.1f}s")
        if self.tty:
            self.stream.write("\r" + line)
            self.stream.flush()
        elif int(frac * 10) > self._last_decile:
            self._last_decile = int(frac * 10)
            print(line, file=self.stream, flush=True)

    def end(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def delay_summary(delays: list[int]) -> dict[str, Any]:
    if not delays:
        return {"count": 0}
    arr = np.asarray(delays)
    return {
        "count": int(arr.size),
        "mean": float(arr.mean()),
        "std": float(arr.std()),
        "p50": float(np.percentile(arr, 50)),
        "p95": float(np.percentile(arr, 95)),
        "max": int(arr.max()),
        "histogram": {int(k): int(v) for k, v in sorted(Counter(delays).items())},
    }


def _versions(version: Any) -> str:
    if isinstance(version, (tuple, list)):  # sharded: one per shard
        return "shard versions " + ", ".join(str(v) for v in version)
    return f"server version {version}"


def format_summary(s: dict[str, Any]) -> str:
    d = s["delay"]
    lines = [
        "",
        f"held-out accuracy   {s['accuracy']:.4f}  "
        f"({'reached' if s['accuracy'] >= TARGET_ACCURACY else 'BELOW'} the "
        f"{TARGET_ACCURACY:.2f} target)",
        f"updates applied     {s['applied']}  ({_versions(s['version'])})",
        f"updates dropped     {s['dropped']}  (delay above tau_max = {s['tau_max']})",
        f"wall time           {s['seconds']:.1f} s with {s['workers']} workers",
    ]
    if d["count"]:
        lines.append(
            f"staleness (delay)   mean {d['mean']:.2f}  p50 {d['p50']:.0f}  p95 {d['p95']:.0f}"
            f"  max {d['max']} versions"
        )
        peak = max(d["histogram"].values())
        for delay, count in d["histogram"].items():
            bar = "#" * max(1, round(30 * count / peak))
            lines.append(f"  delay {delay:>3}  {count:>6}  {bar}")
    return "\n".join(lines)


# --- the demo ------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    if args.contention:
        from .contention import run_demo

        run_demo()
        return 0
    _check(args)
    from .demo_model import accuracy, init_params, load_digits_split

    _, _, x_test, y_test = load_digits_split(seed=args.seed)  # fails early without sklearn
    total = args.workers * args.steps
    servers = ("a parameter server" if args.shards == 1 else
               f"{args.shards} parameter server shards")
    print(
        f"mlfabric demo: {args.workers} workers train a {args.hidden}-unit MLP on the digits "
        f"data set through {servers} ({total} updates, momentum {args.momentum}, "
        f"tau_max {args.tau_max})",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="mlfabric-demo-") as tmp:
        token_file = Path(tmp) / "job.token"
        token_file.write_text(auth.generate_token())
        token_file.chmod(0o600)
        init = Path(tmp) / "init.npz"
        np.savez(init, **init_params(hidden=args.hidden, seed=args.seed))  # type: ignore[arg-type]
        shards: list[_ServerProcess] = []
        workers: list[Any] = []
        try:
            for i in range(args.shards):
                argv = [
                    sys.executable, "-m", "mlfabric", "--log-level", "WARNING", "server",
                    "--listen", "127.0.0.1:0", "--job", JOB, "--token-file", str(token_file),
                    "--init", str(init), "--momentum", str(args.momentum),
                    "--tau-max", str(args.tau_max),
                ]
                if args.shards > 1:
                    argv += ["--shard", f"{i}/{args.shards}"]
                if args.metrics_port is not None:
                    argv += ["--metrics-port", str(args.metrics_port + i)]
                shards.append(_ServerProcess(argv, cwd=tmp))
            address = ",".join(server.wait_serving(timeout=60) for server in shards)
            where = "server listening on" if args.shards == 1 else "shards listening on"
            print(f"{where} {address}; starting {args.workers} workers", flush=True)
            ctx = mp.get_context("spawn")
            events = ctx.Queue()
            worker_args = {k: getattr(args, k) for k in ("seed", "workers", "steps",
                                                         "batch_size", "eta")}
            workers = [
                ctx.Process(target=_worker_main, name=f"demo-worker-{i}",
                            args=(address, str(token_file), i, worker_args, events))
                for i in range(args.workers)
            ]
            # Workers leave Ctrl-C to this process: an ignored signal stays
            # ignored across exec, and Python then installs no handler for it.
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                for w in workers:
                    w.start()
            finally:
                signal.signal(signal.SIGINT, previous)
            summary = _watch(address, str(token_file), events, workers, total,
                             x_test, y_test, accuracy)
        except KeyboardInterrupt:
            print("\nmlfabric demo: interrupted; stopping workers and server", flush=True)
            raise
        finally:
            for w in workers:
                if w.is_alive():
                    w.terminate()
            for w in workers:
                w.join(5)
            for server in shards:
                server.stop()
    summary.update(workers=args.workers, tau_max=args.tau_max)
    print(format_summary(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


def _watch(address: str, token_file: str, events: Any, workers: list[Any], total: int,
           x_test: np.ndarray, y_test: np.ndarray, accuracy: Any) -> dict[str, Any]:
    """Collect outcomes until every worker is done, showing progress."""
    progress = _Progress(total)
    applied = dropped = 0
    delays: list[int] = []
    finished: set[int] = set()
    started = time.monotonic()
    with connect(address, job=JOB, token_file=token_file, name="demo-monitor") as ps:
        acc = None
        next_eval = 0.0
        while len(finished) < len(workers):
            try:
                kind, index, a, b = events.get(timeout=0.2)
            except queue.Empty:
                dead = [w.name for i, w in enumerate(workers)
                        if i not in finished and not w.is_alive() and w.exitcode]
                if dead:
                    raise MlfabricError(f"worker process {dead[0]} died") from None
                continue
            if kind == "outcome":
                if a:
                    applied += 1
                    delays.append(b)
                else:
                    dropped += 1
            elif kind == "done":
                finished.add(index)
            else:
                raise MlfabricError(f"worker {index} failed: {a}")
            now = time.monotonic()
            if now >= next_eval:
                _, params = ps.pull(timeout=30)
                acc = accuracy(params, x_test, y_test)
                next_eval = now + 0.5
            progress.show(applied + dropped, applied, dropped, acc)
        version, params = ps.pull(timeout=30)
        acc = accuracy(params, x_test, y_test)
        progress.show(applied + dropped, applied, dropped, acc)
        progress.end()
    return {
        "accuracy": float(acc),
        "applied": applied,
        "dropped": dropped,
        "version": version,
        "seconds": time.monotonic() - started,
        "delay": delay_summary(delays),
    }

