"""A pull of a model from S shards against a pull of it from one server.

Every shard's part should be received straight into the whole model (no join
copy), so on one machine a sharded pull costs what the unsharded one does:
the same bytes over the same loopback. One blocking client process pulls
from `mlfabric server` processes on this machine, alternating pull by pull
between the one server and the S shards; the time is pull() to its return,
median over the pulls, and the ratio is paired per round.

    python benchmarks/bench_sharded_pull.py [--mib 64] [--pulls 40] [--shards 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_many_tensors import start_server


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="model size in MiB (default 64)")
    ap.add_argument("--pulls", type=int, default=40, help="pulls from each (default 40)")
    ap.add_argument("--shards", type=int, default=4, help="shards (default 4)")
    args = ap.parse_args()
    if args.shards < 2 or args.mib < 1 or args.pulls < 1:
        ap.error("--shards must be at least 2, --mib and --pulls at least 1")
    import mlfabric

    # Half the model one embedding (cut into chunks across the shards), the
    # rest 100 tensors of equal size and a few small ones.
    n = args.mib * 2**20 // 4
    model = {"embedding": np.zeros(n // 2, np.float32)}
    model |= {f"layer{i:03d}": np.zeros(n // 200, np.float32) for i in range(100)}
    model |= {f"bias{i}": np.zeros(100 + i, np.float32) for i in range(5)}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        token = tmp / "job.token"
        token.write_bytes(b"bench-token-0123456789abcdef0123")
        token.chmod(0o600)
        procs = []
        try:
            proc, one = start_server(tmp, "one", model)
            procs.append(proc)
            shards = []
            for i in range(args.shards):
                proc, address = start_server(tmp, "sharded", model, (i, args.shards))
                procs.append(proc)
                shards.append(address)
            clients = {"one": mlfabric.connect(one, job="bench", token_file=str(token)),
                       "sharded": mlfabric.connect(",".join(shards), job="bench",
                                                   token_file=str(token))}
            times: dict[str, list[float]] = {"one": [], "sharded": []}
            for r in range(args.pulls + 3):
                for name in (("one", "sharded") if r % 2 == 0 else ("sharded", "one")):
                    t0 = time.perf_counter()
                    _, params = clients[name].pull(timeout=60)
                    dt = time.perf_counter() - t0
                    assert len(params) == len(model)
                    del params
                    if r >= 3:  # warm-up
                        times[name].append(dt)
            for c in clients.values():
                c.close()
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(10)
    med = {k: statistics.median(v) for k, v in times.items()}
    paired = statistics.median(a / b for a, b in zip(times["sharded"], times["one"],
                                                     strict=True))
    print(f"pull() of a {args.mib} MiB model ({len(model)} tensors) on loopback, median of "
          f"{args.pulls}, alternated pull by pull")
    print(f"  one server        {med['one'] * 1e3:8.2f} ms")
    print(f"  {args.shards} shards          {med['sharded'] * 1e3:8.2f} ms")
    print(f"  sharded / one   {med['sharded'] / med['one']:5.2f}x   (paired {paired:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
