"""Benchmark the Cython kernels against numpy and against memory bandwidth.

For each kernel, in one run, this measures

* the speed-up over the numpy code a user would write instead (the momentum
  update as one expression with temporaries; target >= 4x for
  momentum_apply), and
* the kernel's effective bandwidth over np.copyto's (the physical limit: one
  streaming read and one streaming write; target >= 0.8x). Bytes are counted
  as the kernel's reads plus writes of whole arrays: momentum_apply reads w,
  prev, u and writes w, prev (5 x nbytes); momentum_into (which also tells
  whether its result is finite) reads w, prev, u and writes out (4 x nbytes),
  or without prev reads w, u (3 x nbytes); copyto reads one array and writes
  one (2 x nbytes). Write-allocate traffic is not counted, which favours
  kernels that write into arrays they also read (copyto's destination is
  fetched into cache before being overwritten).

Every repeat runs, for each kernel, np.copyto, the kernel and its numpy peer
back to back, alternating which of kernel and peer goes first, so slow drifts
of the machine hit both sides. Besides the ratios of the medians, the table
gives the median of the per-repeat ratios ("paired"), which is steadier on a
machine whose memory bandwidth wanders (a shared VM).
All arrays are filled (every page touched) and every function runs once
before timing.

    python benchmarks/bench_kernels.py                 # 64 MiB float32, 9 repeats
    python benchmarks/bench_kernels.py --dtype float64 --mib 256 --repeats 15
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

try:
    from mlfabric.kernels import _core
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from mlfabric.kernels import _core

GAMMA = 0.9
ALPHA = -0.01


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t0) / 1e9


class Case:
    """A kernel, the numpy code it replaces, and the bytes the kernel moves."""

    def __init__(
        self,
        name: str,
        kernel: Callable[[], object],
        peer_name: str,
        peer: Callable[[], object],
        arrays_moved: int,
    ) -> None:
        self.name = name
        self.kernel = kernel
        self.peer_name = peer_name
        self.peer = peer
        self.arrays_moved = arrays_moved
        self.kernel_s: list[float] = []
        self.peer_s: list[float] = []
        self.copy_s: list[float] = []


def make_cases(n: int, dtype: np.dtype, k: int) -> tuple[list[Case], Callable[[], object]]:
    rng = np.random.default_rng(0)

    def filled(scale: float = 1.0) -> np.ndarray:
        # Writing every element touches every page before any timing.
        return (rng.standard_normal(n, dtype=np.float64) * scale).astype(dtype)

    w, prev, u = filled(), filled(), filled(1e-3)
    out = np.zeros(n, dtype)
    src, dst = filled(), np.zeros(n, dtype)
    sum_inputs = [filled() for _ in range(k)]
    y = filled()
    g = dtype.type(GAMMA)

    def numpy_apply() -> None:
        new = w + u + g * (w - prev)
        prev[...] = w
        w[...] = new

    def numpy_into() -> None:
        out[...] = w + u + g * (w - prev)

    def numpy_add_into() -> None:
        np.add(w, u, out=out)

    def numpy_sum() -> None:
        np.add(sum_inputs[0], sum_inputs[1], out=out)
        for a in sum_inputs[2:]:
            np.add(out, a, out=out)

    def numpy_scaled_add() -> None:
        y[...] = y + dtype.type(ALPHA) * src

    cases = [
        Case(
            "momentum_apply",
            lambda: _core.momentum_apply(w, prev, u, GAMMA),
            "new = w + u + g*(w - prev); prev[...] = w; w[...] = new",
            numpy_apply,
            5,
        ),
        Case(
            "momentum_into",
            lambda: _core.momentum_into(out, w, prev, u, GAMMA),
            "out[...] = w + u + g*(w - prev)",
            numpy_into,
            4,
        ),
        Case(
            "momentum_into w+u",
            lambda: _core.momentum_into(out, w, None, u, GAMMA),
            "out[...] = w + u",
            numpy_add_into,
            3,
        ),
        Case(
            f"sum_into k={k}",
            lambda: _core.sum_into(out, sum_inputs),
            "np.add(a0, a1, out=out); np.add(out, a_j, out=out) ...",
            numpy_sum,
            k + 1,
        ),
        Case(
            "scaled_add",
            lambda: _core.scaled_add(y, src, ALPHA),
            "y[...] = y + a*x",
            numpy_scaled_add,
            3,
        ),
        Case(
            "l2_norm",
            lambda: _core.l2_norm(src),
            "np.linalg.norm(x)",
            lambda: np.linalg.norm(src),
            1,
        ),
        Case(
            "l2_norm_diff",
            lambda: _core.l2_norm_diff(src, y),
            "np.linalg.norm(a - b)",
            lambda: np.linalg.norm(src - y),
            2,
        ),
        Case(
            "all_finite",
            lambda: _core.all_finite(src),
            "np.isfinite(x).all()",
            lambda: np.isfinite(src).all(),
            1,
        ),
    ]
    copy = functools.partial(np.copyto, dst, src)
    return cases, copy


def fmt_ms(samples: list[float]) -> str:
    return (
        f"{statistics.median(samples) * 1e3:8.2f} "
        f"({min(samples) * 1e3:.2f}-{max(samples) * 1e3:.2f})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=64, help="size of each array (default 64)")
    parser.add_argument("--repeats", type=int, default=9, help="timed repeats (default 9)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--k", type=int, default=4, help="arrays summed by sum_into (default 4)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.mib <= 0 or args.k < 2:
        parser.error("--repeats must be >= 1, --mib > 0 and --k >= 2")

    dtype = np.dtype(args.dtype)
    n = int(args.mib * 2**20) // dtype.itemsize
    nbytes = n * dtype.itemsize
    cases, copy = make_cases(n, dtype, args.k)

    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(
        f"machine: {os.cpu_count()} CPUs, {cpu_model()}; Python {platform.python_version()}, "
        f"numpy {np.__version__}"
    )
    print(
        f"arrays: {n} x {dtype} = {nbytes / 2**20:.0f} MiB each; {args.repeats} repeats, "
        f"sides alternating; times in ms, median (min-max)"
    )

    for c in cases:  # warm-up: code paths, numpy's allocator, caches
        c.kernel()
        c.peer()
    copy()

    # Per repeat and kernel: copyto, kernel, numpy peer, with the kernel in the
    # middle and the order of the other two alternating, so the kernel always
    # runs next to the copyto it is compared with and goes first against its
    # numpy peer every other repeat.
    for r in range(args.repeats):
        for c in cases:
            if r % 2 == 0:
                c.copy_s.append(timed(copy))
                c.kernel_s.append(timed(c.kernel))
                c.peer_s.append(timed(c.peer))
            else:
                c.peer_s.append(timed(c.peer))
                c.kernel_s.append(timed(c.kernel))
                c.copy_s.append(timed(copy))

    copy_all = [t for c in cases for t in c.copy_s]
    copy_bw = 2 * nbytes / statistics.median(copy_all) / 1e9
    print(f"\nnp.copyto(dst, src): {fmt_ms(copy_all)} ms = {copy_bw:.1f} GB/s (2 x nbytes)\n")
    header = (
        f"{'kernel':<17} {'bytes':>5} {'kernel ms':>22} {'GB/s':>6} {'BW/copyto':>9} "
        f"{'(paired)':>8} {'numpy ms':>22} {'speed-up':>8} {'(paired)':>8}  numpy peer"
    )
    print(header)
    print("-" * len(header))
    for c in cases:
        moved = c.arrays_moved * nbytes
        bw = moved / statistics.median(c.kernel_s) / 1e9
        bw_ratio = bw / copy_bw
        bw_paired = statistics.median(
            (moved / k) / (2 * nbytes / cp) for k, cp in zip(c.kernel_s, c.copy_s, strict=True)
        )
        speedup = statistics.median(c.peer_s) / statistics.median(c.kernel_s)
        speedup_paired = statistics.median(p / k for p, k in zip(c.peer_s, c.kernel_s, strict=True))
        print(
            f"{c.name:<17} {c.arrays_moved:>3}xN {fmt_ms(c.kernel_s):>22} {bw:6.1f} "
            f"{bw_ratio:8.2f}x {bw_paired:7.2f}x {fmt_ms(c.peer_s):>22} {speedup:7.2f}x "
            f"{speedup_paired:7.2f}x  {c.peer_name}"
        )
    print(
        "\nratios: BW/copyto and speed-up are ratios of the medians; (paired) is the median"
        "\nover repeats of the ratio between runs made back to back, which cancels slow drifts."
    )
    print(
        "\ntargets: momentum_apply speed-up >= 4x over the numpy expression; "
        "every kernel's BW/copyto >= 0.8x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
