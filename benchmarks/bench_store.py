"""The parameter server's apply step as ParameterStore runs it, compared
between source trees in one run (before/after a change), and against memory
bandwidth.

Per model size (64 MiB and 2.5 MB float32, one tensor, momentum 0.9) and per
tree, one child process holds a store and times

* plain: store.apply() of a whole update (validate, step, bookkeeping);
* staged: begin_staged(), feed() in the server's 512 KiB chunks, finish();

and, in the first tree, np.copyto of one model-sized array (the memory
bandwidth limit: one read and one write) and the bare in-place kernel
momentum_apply (the floor the store's step sits on). Every round runs every
(tree, mode) once, in an order that rotates from round to round, so the
trees share the machine's drifts, with fresh processes every epoch (memory
placement); the table gives medians and, per tree, the
median of the per-round ratios to the first tree ("paired"), which is what
to read on a noisy machine.

Trees are source checkouts with the extension built in place, e.g.

    git archive 7f264a4 | (mkdir -p /tmp/t/before && tar -x -C /tmp/t/before)
    (cd /tmp/t/before && python setup.py build_ext --inplace -q)
    python benchmarks/bench_store.py --tree before=/tmp/t/before --tree after=. --epochs 5

Without --tree it times the checkout it is run from.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SIZES = {"64 MiB": 16 << 20, "2.5 MB": 640_000}
# The small model's rounds are this many times as many (each is short).
SMALL_FACTOR = 10
CHUNK = 1 << 19  # mlfabric.server.server.STAGE_CHUNK: the server feeds at least this much
GAMMA = 0.9


class Child:
    """The store of one tree in a child process, driven over a pipe."""

    def __init__(self, name: str, tree: Path, cache: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(tree))
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", "--cache", cache], cwd=tree, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.ask("ping", "")

    def ask(self, op: str, size: str) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{op}\t{size}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"tree {self.name!r}: the child process died (see stderr)")
        return float(line)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def child(cache: str) -> None:
    # Imported here: the tree under test is on PYTHONPATH (and the cwd).
    import mlfabric
    from mlfabric.kernels import _core
    from mlfabric.server.store import ParameterStore
    from mlfabric.wire.protocol import layout

    if not Path(mlfabric.__file__).resolve().is_relative_to(Path.cwd()):
        raise SystemExit(f"imported {mlfabric.__file__}, not the tree {Path.cwd()}")
    rng = np.random.default_rng(0)
    state = {}
    for size, n in SIZES.items():
        model = {"w": rng.standard_normal(n, dtype=np.float32)}
        store = ParameterStore(model, momentum=GAMMA)
        u = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)
        offsets, nbytes = layout(store.specs)
        w, prev = model["w"].copy(), model["w"].copy()
        dst = np.zeros(n, np.float32)
        state[size] = (store, {"w": u}, offsets, nbytes, w, prev, dst)

    def plain(size: str) -> None:
        store, update = state[size][:2]
        assert store.apply(store.version, update).applied

    def staged(size: str) -> None:
        store, update, offsets, nbytes = state[size][:4]
        data = memoryview(update["w"]).cast("B")
        s = store.begin_staged(store.version, store.specs, offsets)
        assert s is not None
        for received in range(CHUNK, nbytes, CHUNK):
            s.feed(data, received)
        assert s.finish(data) is not None

    def kernel(size: str) -> None:
        _, update, _, _, w, prev, _ = state[size]
        _core.momentum_apply(w, prev, update["w"], GAMMA)

    def copy(size: str) -> None:
        _, update, _, _, _, _, dst = state[size]
        np.copyto(dst, update["w"])

    ops = {"plain": plain, "staged": staged, "kernel": kernel, "copy": copy}
    # Written before each timed call with --cache cold: evicts the model
    # (and leaves dirty lines, as a server's receive buffers would).
    junk = np.zeros(64 << 18, np.float32) if cache == "cold" else None
    for size in SIZES:  # warm-up
        for f in ops.values():
            f(size)
    for line in sys.stdin:
        op, size = line.rstrip("\n").split("\t")
        if op == "ping":
            t = 0.0
        else:
            if junk is not None:
                junk += 1.0
            t0 = time.perf_counter()
            ops[op](size)
            t = time.perf_counter() - t0
        print(t, flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                   help="a source tree with mlfabric built in place (repeat; the first is "
                        "the baseline of the ratios)")
    p.add_argument("--repeats", type=int, default=9, help="rounds per epoch (default 9)")
    p.add_argument("--epochs", type=int, default=3,
                   help="fresh child processes this many times (default 3)")
    p.add_argument("--cache", choices=["shared", "cold"], default="shared",
                   help="shared: each call finds the caches as the previous call (of "
                        "another tree) left them; cold: a 64 MiB array is written before "
                        "each call")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.cache)
        return 0
    trees = [t.split("=", 1) for t in args.tree] or [["this", str(Path(__file__).parents[1])]]
    if any(len(t) != 2 for t in trees):
        p.error("--tree takes NAME=PATH")
    names = [name for name, _ in trees]
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; "
          f"trees: {', '.join(f'{n}={p}' for n, p in trees)}")
    print(f"momentum {GAMMA}, one float32 tensor; staged feeds {CHUNK >> 10} KiB chunks; "
          f"caches {args.cache}; {args.epochs} epochs of fresh processes x {args.repeats} "
          f"rounds (x{SMALL_FACTOR} for the 2.5 MB model), order rotating; "
          f"ms: median (min-max)")
    jobs = [(name, op) for name in names for op in ("plain", "staged")]
    jobs += [(names[0], "kernel"), (names[0], "copy")]
    times = {size: {job: [] for job in jobs} for size in SIZES}
    for _ in range(args.epochs):
        # Fresh processes per epoch: where a process's arrays land in memory
        # moves a kernel's speed by up to 1.5x (see the kernels' notes in
        # RESULTS.md), so each tree's figures span several placements.
        children = {name: Child(name, Path(path).resolve(), args.cache)
                    for name, path in trees}
        try:
            for size in SIZES:
                rounds = args.repeats * (SMALL_FACTOR if SIZES[size] < 1 << 20 else 1)
                for r in range(rounds):
                    k = r % len(jobs)
                    order = jobs[k:] + jobs[:k]
                    if r % 2:
                        order.reverse()
                    for name, op in order:
                        times[size][name, op].append(children[name].ask(op, size))
        finally:
            for c in children.values():
                c.close()
    for size in SIZES:
        report(size, SIZES[size] * 4, names, times[size])
    return 0


def report(size: str, nbytes: int, names: list[str],
           times: dict[tuple[str, str], list[float]]) -> None:
    def ms(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 1e3:7.3f} ({min(xs) * 1e3:.2f}-{max(xs) * 1e3:.2f})"

    base = names[0]
    copy = times[base, "copy"]
    copy_bw = 2 * nbytes / statistics.median(copy) / 1e9
    print(f"\n{size} model ({nbytes / 2**20:.2f} MiB): np.copyto {ms(copy)} ms = "
          f"{copy_bw:.1f} GB/s; bare momentum_apply {ms(times[base, 'kernel'])} ms")
    print(f"  {'tree':<10} {'mode':<7} {'ms':>22} {'/copyto':>8} {'/kernel':>8} "
          f"{'/' + base:>10} {'(paired)':>9}")
    kernel = statistics.median(times[base, "kernel"])
    for name in names:
        for op in ("plain", "staged"):
            xs, ref = times[name, op], times[base, op]
            m = statistics.median(xs)
            paired = statistics.median(a / b for a, b in zip(xs, ref, strict=True))
            print(f"  {name:<10} {op:<7} {ms(xs):>22} {m / statistics.median(copy):7.2f}x "
                  f"{m / kernel:7.2f}x {m / statistics.median(ref):9.3f}x {paired:8.3f}x")


if __name__ == "__main__":
    raise SystemExit(main())
