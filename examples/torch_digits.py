"""Train a small PyTorch MLP on scikit-learn's digits through an mlfabric parameter server.

On one machine, one command (rank 0 starts a parameter server on loopback
and stops it at the end):

    torchrun --nproc-per-node 4 examples/torch_digits.py

With a server you run yourself (any number of machines):

    python examples/torch_digits.py --write-init init.npz
    mlfabric server --listen 0.0.0.0:7070 --job digits --token-file job.token \\
        --init init.npz --momentum 0.3 --tau-max 8
    torchrun --nproc-per-node 4 examples/torch_digits.py \\
        --server HOST:7070 --job digits --token-file job.token

mlfabric's settings come from flags, MLFABRIC_* environment variables or a
TOML file (--config / MLFABRIC_CONFIG), in that order of precedence; see
docs/torch.md. Each rank trains on its shard of the training set (rank and
world size from torchrun's environment); at the end rank 0 prints the
held-out accuracy of the server's model (about 0.96; at least 0.90).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import mlfabric.torch
from mlfabric import config
from mlfabric.errors import ConfigError, MlfabricError
from mlfabric.tools.demo_model import load_digits_split
from mlfabric.wire import auth

PROG = "torch_digits.py"
JOB = "digits"
# Set once every rank is past the final barrier: leave without the
# interpreter's teardown (`Group.close`).
_LEAVE_AT_ONCE = False
TARGET_ACCURACY = 0.90


def build_model(hidden: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 10)
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--write-init", metavar="PATH", default=None,
                   help="only write the initial model for `mlfabric server --init` and exit")
    p.add_argument("--steps", type=int, default=350, help="pushes per rank (default: 350)")
    p.add_argument("--batch-size", type=int, default=32, help="minibatch size (default: 32)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                   help="the local step: plain SGD (-lr * grad) or torch.optim.Adam "
                        "(default: sgd)")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default: 0.1 for sgd, 0.003 for adam)")
    p.add_argument("--hidden", type=int, default=64, help="hidden units (default: 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--momentum", type=float, default=0.3,
                   help="server momentum when rank 0 starts the server (default: 0.3)")
    p.add_argument("--tau-max", type=int, default=8,
                   help="staleness bound when rank 0 starts the server (default: 8)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="rank 0 also writes the summary as JSON to PATH")
    config.add_arguments(p)
    args = p.parse_args(argv)
    for flag, value, low in (("--steps", args.steps, 1), ("--batch-size", args.batch_size, 1),
                             ("--hidden", args.hidden, 1)):
        if value < low:
            raise ConfigError(f"{flag} must be at least {low}, got {value}")
    if args.lr is not None and not args.lr > 0:
        raise ConfigError(f"--lr must be positive, got {args.lr}")
    return args


# --- the process group: only to share the local server's address and to meet at the end ---


class Group:
    """torch.distributed (gloo) when launched by torchrun with several ranks."""

    def __init__(self, launch: config.Launch) -> None:
        self.launch = launch
        self.active = launch.world_size > 1
        if self.active:
            import torch.distributed as dist

            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))

    def broadcast(self, obj: Any) -> Any:
        if not self.active:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        if not self.active:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.launch.world_size
        dist.all_gather_object(out, obj)
        return out

    def close(self, graceful: bool = True) -> None:
        global _LEAVE_AT_ONCE
        if self.active:
            import torch.distributed as dist

            if not graceful:
                # After an error the other ranks may never come to a barrier.
                dist.destroy_process_group()
                return
            # Every rank is out of its last collective before any leaves (in
            # a CI run a rank whose peer had destroyed the group during the
            # final gather aborted in gloo). Then the ranks leave without
            # tearing the group down: gloo's threads, joined while the peers
            # close their links, still aborted a rank now and then after a
            # run that had finished ("terminate called without an active
            # exception", SIGABRT, so torchrun failed the job; pytorch#28126:
            # a gloo receive cannot be interrupted). Nothing is left to do
            # over the group, and the kernel closes its sockets.
            dist.barrier()
            _LEAVE_AT_ONCE = True


class LocalServer:
    """`mlfabric server` on loopback, started by rank 0 when no server is configured."""

    def __init__(self, workdir: Path, init: Path, args: argparse.Namespace) -> None:
        self.token_file = workdir / "job.token"
        self.token_file.write_text(auth.generate_token())
        self.token_file.chmod(0o600)
        argv = [sys.executable, "-m", "mlfabric", "--log-level", "WARNING", "server",
                "--listen", "127.0.0.1:0", "--job", JOB, "--token-file", str(self.token_file),
                "--init", str(init), "--momentum", str(args.momentum),
                "--tau-max", str(args.tau_max)]
        # cwd: `python -m mlfabric` must import the installed package.
        self.proc = subprocess.Popen(argv, cwd=workdir, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._collect, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _collect(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line.rstrip())

    def wait_serving(self, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise MlfabricError(f"the local server did not start within {timeout:.0f} s"
                                    ) from None
            if line is None:
                self.proc.wait(10)
                detail = self._stderr[-1] if self._stderr else f"exit {self.proc.returncode}"
                raise MlfabricError(f"the local server exited at start: {detail}")
            if "serving job" in line:
                return line.split(" on ", 1)[1].split()[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


# --- training ---------------------------------------------------------------------


def train(args: argparse.Namespace, ps: Any, launch: config.Launch, model: torch.nn.Module,
          settings: config.Settings) -> tuple[mlfabric.torch.DistributedOptimizer, float]:
    """Train this rank's shard; returns the optimizer and the seconds it took."""
    x_train, y_train, _, _ = load_digits_split(seed=args.seed)
    x = torch.from_numpy(x_train[launch.rank::launch.world_size])  # this rank's shard
    y = torch.from_numpy(y_train[launch.rank::launch.world_size])
    rng = np.random.default_rng(args.seed * 1000 + launch.rank)
    loss_fn = torch.nn.CrossEntropyLoss()
    started = time.monotonic()
    if args.optimizer == "adam":
        local = torch.optim.Adam(model.parameters(), lr=args.lr or 0.003)
        opt = mlfabric.torch.DistributedOptimizer(
            model, ps, local_optimizer=local, pull_every=settings.pull_every,
            max_in_flight=settings.max_in_flight)
    else:
        opt = mlfabric.torch.DistributedOptimizer(
            model, ps, lr=args.lr or 0.1, pull_every=settings.pull_every,
            max_in_flight=settings.max_in_flight)
    order = rng.permutation(len(x))
    at = 0
    batch = min(args.batch_size, len(x))
    for _ in range(args.steps):
        if at + batch > len(order):
            order, at = rng.permutation(len(x)), 0
        idx = torch.from_numpy(order[at:at + batch])
        at += batch
        opt.zero_grad()
        loss_fn(model(x[idx]), y[idx]).backward()
        opt.step()
    opt.flush()
    return opt, time.monotonic() - started


def accuracy(model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    with torch.no_grad():
        pred = model(torch.from_numpy(x)).argmax(dim=1).numpy()
    return float((pred == y).mean())


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)  # several ranks share this machine's cores
    launch = config.launch_info()
    settings = config.from_args(args)
    model = build_model(args.hidden, args.seed)
    group = Group(launch)
    server: LocalServer | None = None
    workdir: tempfile.TemporaryDirectory[str] | None = None
    try:
        if settings.server is None:  # no server configured: rank 0 starts one on loopback
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", launch.world_size))
            if local_world != launch.world_size:
                raise ConfigError(
                    "setting server is not set and the ranks span several machines: start "
                    "`mlfabric server` yourself and give --server HOST:PORT (or MLFABRIC_SERVER)"
                )
            shared: list[str]
            if launch.rank == 0:
                try:
                    workdir = tempfile.TemporaryDirectory(prefix="mlfabric-torch-digits-")
                    init = Path(workdir.name) / "init.npz"
                    mlfabric.torch.save_init(model, init)
                    server = LocalServer(Path(workdir.name), init, args)
                    shared = ["ok", server.wait_serving(), str(server.token_file)]
                except MlfabricError as exc:
                    shared = ["error", str(exc), ""]
                group.broadcast(shared)
                if shared[0] == "error":
                    raise MlfabricError(shared[1])
                print(f"{PROG}: rank 0 started a parameter server on {shared[1]} for "
                      f"{launch.world_size} ranks", flush=True)
            else:
                shared = group.broadcast(None)
                if shared[0] == "error":
                    raise MlfabricError(f"rank 0 could not start the server: {shared[1]}")
            here = "started by rank 0"
            settings = dataclasses.replace(
                settings, server=shared[1], job=JOB, token_file=shared[2],
                sources={**settings.sources, "server": here, "job": here, "token_file": here})
        with config.connect(settings, launch=launch) as ps:
            opt, seconds = train(args, ps, launch, model, settings)
            group.gather(None)  # every rank's pushes are done
            version = opt.pull()  # the final model, into this rank's module
        _, _, x_test, y_test = load_digits_split(seed=args.seed)
        result: dict[str, Any] = {
            "rank": launch.rank, "stats": dataclasses.asdict(opt.stats()), "seconds": seconds,
            "accuracy": accuracy(model, x_test, y_test),
        }
        everyone = group.gather(result)
        if launch.rank == 0:
            summary = summarize(everyone, result["accuracy"], version, launch, args)
            print(format_summary(summary), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(summary, indent=2))
    finally:
        if server is not None:
            server.stop()
        if workdir is not None:
            workdir.cleanup()
        group.close(graceful=sys.exc_info()[0] is None)
    return 0


def summarize(results: list[dict[str, Any]], acc: float, version: int, launch: config.Launch,
              args: argparse.Namespace) -> dict[str, Any]:
    delays: dict[int, int] = {}
    reasons: dict[str, int] = {}
    for r in results:
        for d, n in r["stats"]["delays"].items():
            delays[int(d)] = delays.get(int(d), 0) + n
        for reason, n in r["stats"]["dropped_reasons"].items():
            reasons[reason] = reasons.get(reason, 0) + n
    return {
        "accuracy": acc,
        "target": TARGET_ACCURACY,
        "version": version,
        "ranks": launch.world_size,
        "optimizer": args.optimizer,
        "applied": sum(r["stats"]["applied"] for r in results),
        "dropped": sum(r["stats"]["dropped"] for r in results),
        "dropped_reasons": reasons,
        "delays": dict(sorted(delays.items())),
        "seconds": max(r["seconds"] for r in results),
    }


def format_summary(s: dict[str, Any]) -> str:
    reached = "reached" if s["accuracy"] >= s["target"] else "BELOW"
    ranks = f"{s['ranks']} rank{'s' if s['ranks'] != 1 else ''}"
    why = ", ".join(f"{n} {reason}" for reason, n in s["dropped_reasons"].items())
    return (
        f"{PROG}: held-out accuracy {s['accuracy']:.4f} ({reached} the {s['target']:.2f} "
        f"target)\n"
        f"{PROG}: {ranks}, updates applied {s['applied']}, dropped {s['dropped']}"
        f"{f' ({why})' if why else ''}, server version {s['version']}, training "
        f"{s['seconds']:.1f} s\n"
        f"{PROG}: staleness histogram (delay: updates) {s['delays']}"
    )


def main(argv: list[str] | None = None) -> int:
    # torchrun stops the ranks with SIGTERM when one fails: exit through the
    # finally blocks, so rank 0's server is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        args = parse_args(argv)
        if args.write_init:
            mlfabric.torch.save_init(build_model(args.hidden, args.seed), args.write_init)
            print(f"{PROG}: wrote the initial model to {args.write_init}", flush=True)
            return 0
        return run(args)
    except MlfabricError as exc:
        rank = os.environ.get("RANK")
        where = f" (rank {rank})" if rank is not None else ""
        print(f"{PROG}: error{where}: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    code = main()
    if _LEAVE_AT_ONCE:
        # Without the interpreter's teardown, which would destroy the gloo
        # group (see Group.close). The server and scratch files are already
        # cleaned up by run's finally blocks.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
