"""A push of many small tensors against one tensor of the same total size.

Issue 30's goal: a model of 1,000 tensors of 4 KB each costs at most 1.2x the
time of one tensor of the same size. Two `mlfabric server` processes, one per
model (momentum 0.9), one blocking client process alternating between them
push by push; the time is push() to its outcome (received, checked, applied,
answered), median over the pushes, and the ratio is paired per round.

    python benchmarks/bench_many_tensors.py [--tensors 1000] [--kib 4] [--pushes 200]
        [--shards 4]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

JOB = "bench"


def start_server(tmp: Path, name: str, model: dict[str, np.ndarray],
                 shard: tuple[int, int] | None = None) -> tuple[subprocess.Popen, str]:
    init = tmp / f"{name}.npz"
    np.savez(init, **model)
    part = ["--shard", f"{shard[0]}/{shard[1]}"] if shard is not None else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlfabric", "--log-level", "WARNING", "server", "--listen",
         "127.0.0.1:0", "--job", JOB, "--token-file", str(tmp / "job.token"), "--init",
         str(init), "--momentum", "0.9", *part],
        stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "serving job" not in line:
        proc.kill()
        raise RuntimeError(f"the {name} server did not start: {line!r}")
    return proc, line.split(" on ")[1].split()[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--kib", type=int, default=4, help="KiB per small tensor (default 4)")
    ap.add_argument("--pushes", type=int, default=200, help="pushes to each (default 200)")
    ap.add_argument("--shards", type=int, default=1,
                    help="server shards per model, all on this machine (default 1)")
    args = ap.parse_args()
    import mlfabric

    n = args.kib * 1024 // 4
    many = {f"t{i:04d}": np.zeros(n, np.float32) for i in range(args.tensors)}
    one = {"t": np.zeros(n * args.tensors, np.float32)}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        token = tmp / "job.token"
        token.write_bytes(b"bench-token-0123456789abcdef0123")
        token.chmod(0o600)
        procs = []
        try:
            clients = {}
            for name, model in (("many", many), ("one", one)):
                addresses = []
                for i in range(args.shards):
                    proc, address = start_server(
                        tmp, name, model, (i, args.shards) if args.shards > 1 else None)
                    procs.append(proc)
                    addresses.append(address)
                clients[name] = mlfabric.connect(",".join(addresses), job=JOB,
                                                 token_file=str(token))
            times: dict[str, list[float]] = {"many": [], "one": []}
            updates = {"many": {k: np.full_like(a, 1e-3) for k, a in many.items()},
                       "one": {k: np.full_like(a, 1e-3) for k, a in one.items()}}
            versions = {name: c.pull()[0] for name, c in clients.items()}
            for r in range(args.pushes + 10):
                order = ("many", "one") if r % 2 == 0 else ("one", "many")
                for name in order:
                    t0 = time.perf_counter()
                    outcome = clients[name].push(updates[name],
                                                 base_version=versions[name]).result(30)
                    dt = time.perf_counter() - t0
                    versions[name] = outcome.version
                    if r >= 10:  # warm-up
                        times[name].append(dt)
            for c in clients.values():
                c.close()
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(10)
    med = {k: statistics.median(v) for k, v in times.items()}
    paired = statistics.median(a / b for a, b in zip(times["many"], times["one"], strict=True))
    total = n * 4 * args.tensors
    print(f"push to outcome, {args.tensors} tensors of {args.kib} KiB against one tensor of "
          f"{total / 2**20:.1f} MiB, {args.shards} server shard(s) each; median of "
          f"{args.pushes}, alternated push by push")
    print(f"  one tensor      {med['one'] * 1e3:8.2f} ms")
    print(f"  many tensors    {med['many'] * 1e3:8.2f} ms")
    print(f"  many / one      {med['many'] / med['one']:5.2f}x   (paired {paired:.2f}x)   "
          f"target <= 1.2")
    return 0


if __name__ == "__main__":
    sys.exit(main())
