"""What compressing an update costs and what it saves (issue 35).

For each codec, on one float32 tensor of the size of a model's layer:

- encode: the worker's side, `ErrorFeedback.encode` (update + residual,
  compressed; the residual keeps the rest);
- decode: the receiver's side, `check` then `decode` into a dense tensor;
- the wire bytes against the dense tensor's;
- against the physical limit: a copy of the dense tensor (memory bandwidth;
  no codec can touch every element faster than that);
- for the casts, against the numpy expression of the same error feedback
  (five passes, three temporaries), which the Cython kernel fuses;
- break-even: the link rate below which the codec is worth its CPU time for
  one transfer, (dense - encoded bytes) / (encode + decode time). Above it,
  sending the tensor whole is sooner.

Rounds alternate the codecs; the figures are medians over rounds.

    python benchmarks/bench_compression.py                  # 2000 x 2000, 5 rounds
    python benchmarks/bench_compression.py --shape 4096,1024 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from mlfabric.compression import ErrorFeedback, check, decode, parse

CODECS = "none,fp16,bf16,topk:0.01,randk:0.01,lowrank:4"


def best_of(fn: Callable[[], object], repeat: int) -> float:
    """The fastest of `repeat` calls (seconds): the cost without the noise of
    other processes on the machine."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def numpy_ef_half(x: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Error feedback with an fp16 cast, as numpy expressions."""
    acc = x + r
    h = np.clip(acc, -65504, 65504).astype(np.float16)
    r[...] = acc - h.astype(np.float32)
    return h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="2000,2000", help="the tensor's shape (default 2000,2000)")
    ap.add_argument("--codecs", default=CODECS)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3, help="calls per measurement (the best)")
    args = ap.parse_args()
    shape = tuple(int(s) for s in args.shape.split(","))
    specs = args.codecs.split(",")
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    dense = x.nbytes
    copy_to = np.empty_like(x)
    results: dict[str, dict[str, list[float]]] = {
        s: {"encode": [], "decode": [], "bytes": []} for s in ["(copy)", "(numpy fp16)", *specs]}
    for k in range(args.rounds):
        print(f"  ... round {k + 1}/{args.rounds}", flush=True)
        results["(copy)"]["encode"].append(best_of(lambda: np.copyto(copy_to, x), args.repeat))
        r0 = np.zeros_like(x)
        results["(numpy fp16)"]["encode"].append(
            best_of(lambda r0=r0: numpy_ef_half(x, r0), args.repeat))
        for spec in specs:
            fb = ErrorFeedback(parse(spec))
            encoded = fb.encode({"w": x})  # warm: the residual and any warm start exist
            results[spec]["encode"].append(best_of(lambda fb=fb: fb.encode({"w": x}),
                                                   args.repeat))
            e = fb.encode({"w": x})["w"]
            out = np.empty_like(x)

            def receive(e=e, out=out) -> None:
                check(e, shape)
                decode(e, out)

            results[spec]["decode"].append(best_of(receive, args.repeat))
            results[spec]["bytes"].append(float(encoded["w"].nbytes))
    copy = statistics.median(results["(copy)"]["encode"])
    numpy_fp16 = statistics.median(results["(numpy fp16)"]["encode"])
    print(f"\none {shape} float32 tensor ({dense / 2**20:.1f} MiB), medians of {args.rounds} "
          f"rounds (each the best of {args.repeat} calls)")
    print(f"  memory copy of the tensor: {copy * 1e3:.2f} ms ({dense / copy / 1e9:.1f} GB/s)")
    print(f"  {'codec':<12} {'wire/dense':>10} {'encode ms':>10} {'/copy':>7} "
          f"{'decode ms':>10} {'/copy':>7} {'break-even Mbit/s':>18}")
    for spec in specs:
        enc = statistics.median(results[spec]["encode"])
        dec = statistics.median(results[spec]["decode"])
        nbytes = statistics.median(results[spec]["bytes"])
        saved = dense - nbytes
        even = f"{saved * 8 / (enc + dec) / 1e6:,.0f}" if saved > 0 else "-"
        print(f"  {spec:<12} {nbytes / dense:>10.4f} {enc * 1e3:>10.2f} {enc / copy:>7.1f} "
              f"{dec * 1e3:>10.2f} {dec / copy:>7.1f} {even:>18}")
    if "fp16" in specs:
        fused = statistics.median(results["fp16"]["encode"])
        print(f"  fp16 error feedback, numpy expression / fused kernel: "
              f"{numpy_fp16 / fused:.2f}x ({numpy_fp16 * 1e3:.2f} ms / {fused * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
