"""The long form of tests/test_chaos.py: a job of real processes on
loopback, SIGKILLed at random for minutes (src/mlfabric/tools/chaos.py), alternated
with the same job run as long without faults, so the cost of the faults
shows as a ratio.

Per round it prints the kills survived by kind and the targeted windows
hit, the pushes and acknowledgements, the longest stall of a worker that
lived to the end, and whether the final model equals the replay; at the
end the medians, and pushes per second with faults / without.

    python benchmarks/chaos.py [--minutes 3] [--rounds 3] [--seed 1]
        [--workers 4] [--config replicated|aggregated] [--div-max 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mlfabric.tools import chaos


def one(settings: chaos.Settings, seconds: float, seed: int, faults: bool) -> tuple[
        chaos.Report, float]:
    with tempfile.TemporaryDirectory(prefix="mlfabric-chaos-") as d:
        started = time.monotonic()
        if faults:
            report = chaos.run(settings, seconds, seed, Path(d), say=lambda *a: None)
        else:
            job = chaos.Job(Path(d), settings, say=lambda *a: None)
            try:
                job.start()
                job.wait_progress()
                time.sleep(seconds)
                job.stop()
                report = chaos.check(job)
            finally:
                job.shutdown()
        return report, time.monotonic() - started


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--config", choices=("replicated", "aggregated"), default="replicated")
    p.add_argument("--div-max", type=float, default=10.0, help="0: no divergence bound")
    args = p.parse_args()
    settings = chaos.Settings(workers=args.workers, config=args.config,
                              div_max=args.div_max if args.div_max > 0 else None)
    seconds = args.minutes * 60
    rows = []
    for r in range(args.rounds):
        seed = args.seed + r
        calm, calm_s = one(settings, seconds, seed, faults=False)
        print(f"round {r + 1} without faults: {calm.line()}", flush=True)
        hit, hit_s = one(settings, seconds, seed, faults=True)
        print(f"round {r + 1} with faults (seed {seed}): {hit.line()}", flush=True)
        rows.append((calm, calm_s, hit, hit_s))
    kills = sum(sum(h.kills.values()) for _, _, h, _ in rows)
    windows = sum(sum(h.windows.values()) for _, _, h, _ in rows)
    rate = [(h.pushes / hs) / (c.pushes / cs) for c, cs, h, hs in rows]
    print(f"\n{args.config}, {args.workers} workers, {args.rounds} rounds of "
          f"{args.minutes:g} min with and without faults, alternated")
    print(f"  kills survived: {kills} in all ({windows} in targeted windows)")
    print(f"  longest stall, median of rounds: with faults "
          f"{statistics.median(h.longest_stall for _, _, h, _ in rows):.2f} s, without "
          f"{statistics.median(c.longest_stall for c, _, _, _ in rows):.2f} s; worst "
          f"{max(h.longest_stall for _, _, h, _ in rows):.2f} s")
    print(f"  pushes per round, median: with faults "
          f"{statistics.median(h.pushes for _, _, h, _ in rows):.0f}, without "
          f"{statistics.median(c.pushes for c, _, _, _ in rows):.0f}")
    print(f"  pushes/s with faults / without: {statistics.median(rate):.2f}x (median)")
    print(f"  replay: {rows[-1][2].replay}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
