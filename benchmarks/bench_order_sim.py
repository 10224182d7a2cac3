"""Mixed-speed workers in the simulator: the stale refusals issue 34 is about.

6 workers, uplinks 20/30/50 Mbit/s for h1-h3 and 1 Gbit/s for h4-h6, the
server's downlink 80 Mbit/s, 2 MiB updates, compute 1.0 s +-20 %, 20 steps,
one push in flight; per tau_max (4, 8), with the controller knowing the
rates ("live") and with an unannounced drop to 40 Mbit/s from 8 to 16 s
("static"). Prints, per setting, the updates the server refused as stale per
seed (mlfabric's: the controller let them go; fifo's), the controller's drops
per seed, and medians over the seeds of mlfabric / fifo: applied per second,
delay mean and spread, push-to-applied mean.

    .venv/bin/python benchmarks/bench_order_sim.py [--seeds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from mlfabric.sim.engine import MIB, RateChange, Scenario, simulate


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    if args.seeds < 1:
        ap.error(f"--seeds must be >= 1, got {args.seeds}")
    slow = (RateChange(0, "h1", up_mbit=20), RateChange(0, "h2", up_mbit=30),
            RateChange(0, "h3", up_mbit=50))
    drop = (RateChange(8, "h0", down_mbit=40), RateChange(16, "h0", down_mbit=80))
    for tau in (4, 8):
        for unannounced in (False, True):
            rows: dict[str, list[tuple[float, ...]]] = {"mlfabric": [], "fifo": []}
            for seed in range(args.seeds):
                sc = Scenario(workers=6, server_down_mbit=80, update_bytes=2 * MIB,
                              compute=1.0, steps=20, tau_max=tau, seed=seed,
                              changes=slow + (drop if unannounced else ()),
                              controller_view="static" if unannounced else "live")
                for policy, out in rows.items():
                    s = simulate(sc, policy).summary()
                    stale = s["reasons"].get("stale", 0)
                    out.append((stale, s["dropped"] - stale, s["applied"] / s["end"],
                                s["delay"]["mean"], s["delay"]["std"],
                                s["push_to_applied"]["mean"]))
            med = {p: [statistics.median(r[i] for r in rows[p]) for i in range(6)]
                   for p in rows}
            m, f = med["mlfabric"], med["fifo"]
            name = "unannounced drop 80->40" if unannounced else "live rates"
            print(f"tau_max {tau}, {name}: stale per seed mlfabric "
                  f"{[int(r[0]) for r in rows['mlfabric']]} fifo "
                  f"{[int(r[0]) for r in rows['fifo']]}; controller drops "
                  f"{[int(r[1]) for r in rows['mlfabric']]}; mlfabric/fifo applied/s "
                  f"{m[2] / f[2]:.2f}x delay mean {m[3] / f[3]:.2f}x spread {m[4] / f[4]:.2f}x "
                  f"push-to-applied {m[5] / f[5]:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
