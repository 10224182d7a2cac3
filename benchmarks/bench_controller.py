"""mlfabric ordering vs the plain asynchronous PS (fifo), on an emulated cluster.

8 workers (one per host) push updates of one model size into a server whose
downlink is the bottleneck (shaped with tc); the controller runs either
policy on the same namespaces, alternated round by round. Optionally the
server's downlink changes rate during each run. Needs root.

    sudo python benchmarks/bench_controller.py [--rounds 3] [--steps 8]
        [--compute-ms 1200] [--in-flight 1] [--model-mib 2] [--down-mbit 100]
        [--change-to 50] [--tau-max 8] [--uplinks 20,30,50,1000]
        [--landing-reports] [--decision-log PREFIX]

`--uplinks` gives the workers mixed uplink rates (Mbit/s, cycled over the
workers; the controller is configured with them, as it is with the
server's downlink, unless `--unannounced-uplinks`: then it is told only the
server's downlink, and the workers' uplinks are what it must learn).
Prints per run and the medians per policy: applied and dropped updates,
delay mean/std/max, push-to-applied mean/std, and the ratios mlfabric/fifo;
the delay on each run's steady window, where every worker is running
(`staleness_law.py`: with one push in flight per worker its mean is N - 1
whatever the order when nothing is discarded; a short run is mostly its
start and end, with fewer workers running); then every update not applied,
by reason, summed over the runs ("stale" is the server refusing an update
the controller let go: issue 34's goal is none).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from pathlib import Path

from staleness_law import Outcome, Window, window  # beside this script

from mlfabric.tools.testbed import SetRate, Testbed, require_root
from mlfabric.tools.workload import Summary, run_policy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="pushes per worker per run")
    ap.add_argument("--compute-ms", type=float, default=1200.0)
    ap.add_argument("--in-flight", type=int, default=1, help="pushes outstanding per worker")
    ap.add_argument("--model-mib", type=float, default=2.0)
    ap.add_argument("--down-mbit", type=float, default=100.0, help="server downlink")
    ap.add_argument("--change-to", type=float, default=None,
                    help="server downlink rate for the middle third of each run")
    ap.add_argument("--tau-max", type=int, default=8)
    ap.add_argument("--uplinks", default="",
                    help="workers' uplink rates in Mbit/s, comma-separated, cycled "
                         "(default: 1000 each)")
    ap.add_argument("--unannounced-uplinks", action="store_true",
                    help="configure the controller with the server's downlink only")
    ap.add_argument("--landing-reports", action="store_true",
                    help="start the server with --controller: it tells the controller of "
                         "each landing itself, a message before the worker's report")
    ap.add_argument("--decision-log", default=None, metavar="PREFIX",
                    help="keep each run's controller decision log as "
                         "PREFIX-POLICY-rN.jsonl (default: none kept)")
    args = ap.parse_args()
    try:
        uplinks = [float(x) for x in args.uplinks.split(",")] if args.uplinks else [1000.0]
    except ValueError:
        ap.error(f"--uplinks {args.uplinks!r}: give Mbit/s numbers separated by commas")
    if any(not 0 < u <= 100_000 for u in uplinks):
        ap.error(f"--uplinks {args.uplinks!r}: each rate must be in (0, 100000] Mbit/s")
    require_root()

    runs: dict[str, list[Summary]] = {"mlfabric": [], "fifo": []}
    steady: dict[str, list[Window]] = {"mlfabric": [], "fifo": []}
    not_applied: dict[str, collections.Counter[str]] = {
        "mlfabric": collections.Counter(), "fifo": collections.Counter()}
    rates = {"h0": (1000.0, args.down_mbit)}
    rates.update({f"h{i}": (uplinks[(i - 1) % len(uplinks)], 1000.0)
                  for i in range(1, args.workers + 1)})
    expected = args.steps * (args.compute_ms / 1e3 + 0.3)

    def change_rate(tb: Testbed) -> None:
        if args.change_to is not None:
            tb.schedule([(expected / 3, SetRate("h0", down=args.change_to)),
                         (2 * expected / 3, SetRate("h0", down=args.down_mbit))])

    with Testbed(hosts=args.workers + 1, rate_mbit=1000.0, rates=rates) as tb:
        for r in range(args.rounds):
            order = ["mlfabric", "fifo"] if r % 2 == 0 else ["fifo", "mlfabric"]
            for policy in order:
                summary, records = run_policy(
                    tb, policy, model_bytes=int(args.model_mib * (1 << 20)), steps=args.steps,
                    tau_max=args.tau_max, compute_ms=args.compute_ms, seed=r,
                    max_in_flight=args.in_flight, during=change_rate,
                    link_mbit={"h0": rates["h0"]} if args.unannounced_uplinks else rates,
                    landing_reports=args.landing_reports,
                    decision_log=None if args.decision_log is None else
                    Path(f"{args.decision_log}-{policy}-r{r + 1}.jsonl").resolve())
                runs[policy].append(summary)
                why = collections.Counter(_reason(rec["reason"]) for rec in records
                                          if not rec["applied"])
                not_applied[policy].update(why)
                print(f"round {r + 1}  {summary.row()}  {dict(why) or ''}", flush=True)
                try:
                    w = window((Outcome(rec["host"], rec["start"] + rec["seconds"],
                                        rec["delay"] if rec["applied"] else None)
                                for rec in records), warmup=STEADY_WARMUP)
                except ValueError as e:
                    print(f"           steady window: none ({e})", flush=True)
                else:
                    steady[policy].append(w)
                    print(f"           steady window {w.seconds:.1f} s, {w.updates} applied, "
                          f"{w.discarded} not: delay mean {w.mean:.2f} (N - 1 = "
                          f"{w.workers - 1}) std {w.spread:.2f} (within {w.within:.2f}, "
                          f"between {w.between:.2f})", flush=True)

    def med(items: list[Summary] | list[Window], field: str) -> float:
        return statistics.median(getattr(x, field) for x in items)

    def line(name: str, items: dict[str, list[Summary]] | dict[str, list[Window]],
             field: str) -> None:
        """One row: the medians of mlfabric and fifo, and their ratio."""
        a, b = med(items["mlfabric"], field), med(items["fifo"], field)
        ratio = f"{a / b:12.2f}" if b else f"{'-':>12s}"
        print(f"  {name:22s}{a:12.3f}{b:12.3f}{ratio}")

    print()
    print(f"medians of {args.rounds} runs per policy ({args.workers} workers, "
          f"{args.model_mib} MiB updates, server downlink {args.down_mbit} Mbit/s"
          + (f", {args.change_to} Mbit/s in the middle third" if args.change_to else "") + ")")
    fields = ["applied", "dropped", "applied_per_s", "delay_mean", "delay_std", "delay_max",
              "seconds_mean", "seconds_std", "wall"]
    print(f"  {'':22s}" + "".join(f"{p:>12s}" for p in ("mlfabric", "fifo", "mlf/fifo")))
    for f in fields:
        line(f, runs, f)
    if steady["mlfabric"] and steady["fifo"]:
        print(f"  steady window (every worker running, from {STEADY_WARMUP:g} s after the "
              f"first outcome; medians of {len(steady['mlfabric'])} and "
              f"{len(steady['fifo'])} runs)")
        for f in ("seconds", "mean", "spread", "within", "between"):
            line("window_seconds" if f == "seconds" else f"delay_{f}", steady, f)
    for policy, why in not_applied.items():
        print(f"  not applied over {args.rounds} runs, {policy}: "
              + (", ".join(f"{k} {v}" for k, v in why.most_common()) or "none"))
    return 0


# The run's first outcomes come before every worker has pushed once.
STEADY_WARMUP = 2.0


def _reason(reason: str | None) -> str:
    """The kind of an outcome's reason: "stale: delay 9 exceeds ..." -> "stale"."""
    return (reason or "unknown").split(":")[0].split()[0]


if __name__ == "__main__":
    sys.exit(main())
