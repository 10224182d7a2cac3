"""Benchmark what the emulated network costs in CPU per byte, at each link MTU.

On one machine the whole cluster's network (both veths, the bridge, the tbf
qdiscs, TCP on both ends) runs on the same cores as the job. With GSO capped
at one frame, so that tbf meters wire-size packets, that work is per packet:
a 1500-byte MTU costs about five times the CPU of a 9000-byte one per byte
moved. This measures it: one bulk TCP flow between two testbed hosts over a
link shaped to --rate, the machine's busy CPU (all cores, from /proc/stat)
over the transfer, per MB delivered, and the goodput against what the wire
allows at that MTU. The MTUs alternate run by run; medians and the ratio.

    sudo python benchmarks/bench_testbed_mtu.py                 # 5 runs per MTU, ~1 minute
    sudo python benchmarks/bench_testbed_mtu.py --rate 100 --mb 60
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlfabric.errors import ConfigError  # noqa: E402
from mlfabric.tools.testbed import MTU_RANGE, Testbed, check_mtu, require_root  # noqa: E402

CHUNK = 1 << 20


def busy_jiffies() -> int:
    """Busy clock ticks of all cores together (idle and iowait are not busy)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4]


def one_run(mtu: int, rate: float, mb: int) -> dict[str, float]:
    with Testbed(hosts=2, rate_mbit=rate, mtu=mtu) as tb:
        h0, h1 = tb.host("h0"), tb.host("h1")
        with h0.enter():
            server = socket.create_server((h0.ip, 0))
        with h1.enter():
            sender = socket.create_connection(server.getsockname(), timeout=30)
        conn, _ = server.accept()
        received = 0

        def receive() -> None:
            nonlocal received
            buf = bytearray(CHUNK)
            while n := conn.recv_into(buf):
                received += n

        rx = threading.Thread(target=receive, daemon=True)
        rx.start()
        data = bytes(CHUNK)
        busy0 = busy_jiffies()
        t0 = time.monotonic()
        for _ in range(mb):
            sender.sendall(data)
        sender.close()
        rx.join(timeout=120)
        if rx.is_alive():
            raise RuntimeError(f"MTU {mtu}: the receiver did not finish within 120 s")
        t1 = time.monotonic()
        busy1 = busy_jiffies()
        conn.close()
        server.close()
    if received != mb * CHUNK:
        raise RuntimeError(f"MTU {mtu}: received {received} of {mb * CHUNK} bytes")
    cpu_s = (busy1 - busy0) / os.sysconf("SC_CLK_TCK")
    return {"cpu_ms_per_mb": cpu_s * 1000 / (received / 1e6),
            "goodput_mbit": received * 8 / (t1 - t0) / 1e6,
            "cores": cpu_s / (t1 - t0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mtus", default="1500,9000",
                    help=f"comma-separated MTUs to compare, {MTU_RANGE[0]}-{MTU_RANGE[1]} "
                         "(default %(default)s)")
    ap.add_argument("--rate", type=float, default=400.0,
                    help="the link's shaped rate, Mbit/s (default %(default)s)")
    ap.add_argument("--mb", type=int, default=200, help="MiB per run (default %(default)s)")
    ap.add_argument("--runs", type=int, default=5, help="runs per MTU (default %(default)s)")
    args = ap.parse_args()
    try:
        mtus = [int(m) for m in args.mtus.split(",") if m]
    except ValueError:
        ap.error(f"--mtus takes comma-separated integers, got {args.mtus!r}")
    for m in mtus:
        try:
            check_mtu(m)
        except ConfigError as exc:
            ap.error(str(exc))
    if not (args.rate > 0 and args.mb > 0 and args.runs > 0):
        ap.error("--rate, --mb and --runs must be positive")
    require_root()
    runs: dict[int, list[dict[str, float]]] = {m: [] for m in mtus}
    for r in range(args.runs):
        order = mtus[r % len(mtus):] + mtus[:r % len(mtus)]
        for m in order:
            res = one_run(m, args.rate, args.mb)
            runs[m].append(res)
            print(f"run {r + 1} MTU {m:5d}: {res['cpu_ms_per_mb']:6.2f} ms CPU per MB, "
                  f"{res['cores']:.2f} cores busy, goodput {res['goodput_mbit']:.1f} Mbit/s",
                  flush=True)
    print()
    print(f"One TCP flow over a link shaped to {args.rate:g} Mbit/s, {args.mb} MiB per run, "
          f"median of {args.runs} runs (MTUs alternated)")
    med = {m: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for m, rs in runs.items()}
    for m in mtus:
        wire = args.rate * (m - 52) / (m + 14)  # TCP payload (MSS with timestamps) per frame
        print(f"  MTU {m:5d}: {med[m]['cpu_ms_per_mb']:6.2f} ms CPU per MB   goodput "
              f"{med[m]['goodput_mbit']:6.1f} Mbit/s of {wire:.1f} the wire allows")
    base = mtus[0]
    for m in mtus[1:]:
        print(f"  CPU per MB, MTU {base} / MTU {m}: "
              f"{med[base]['cpu_ms_per_mb'] / med[m]['cpu_ms_per_mb']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
