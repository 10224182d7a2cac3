"""The staleness law: what an order can and cannot do to the delay.

With one push in flight per worker (the README's loop), an update of worker w
is computed on the model it pulled and applied one cycle later (compute, push,
transfer, apply), and w starts a cycle p_w times a second. Meanwhile the
server applies the other workers' updates at their rate, so w's updates wait
for about (A - a_w) / p_w of them on average: A is the updates the server
applies per second, a_w those of w (about: a cycle also holds the moment
between an apply and the next pull, whose updates the pull already has).
When nothing is discarded a_w = p_w, and averaged over the updates
(weighted by a_w) that is N - 1 for N workers, whatever the order the
updates land in. So an order moves the mean delay only
through the updates it discards (a server refusing stale ones, a controller
dropping them), and the spread only through how unequal the workers' rates
are (between workers) and how their cycles interleave (within a worker).

This measures it on a window where every worker is running (after `--warmup`
seconds, up to the first worker's last update: a run's start and end have
fewer workers and fewer updates between):

    .venv/bin/python benchmarks/staleness_law.py sim [--steps 200] [--seed 0] [--tau-max 8]
    .venv/bin/python benchmarks/staleness_law.py logs PREFIX
        # PREFIX of bench_controller.py --decision-log PREFIX: PREFIX-{policy}-r{round}.jsonl

`sim`: the mixed-speed setting of bench_order_sim.py (6 workers, uplinks
20/30/50 Mbit/s and 1 Gbit/s, an 80 Mbit/s downlink, 2 MiB, 1 s compute), no
bound on staleness unless --tau-max, so nothing is discarded.

Prints per run and policy: the window, its mean delay against N - 1 and
against the law from the measured rates, the spread within and between
workers, and each worker's mean delay against (A - a_w) / a_w.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from mlfabric.sim.engine import MIB, PushRecord, RateChange, Scenario, simulate


@dataclass(frozen=True)
class Outcome:
    """What became of one push: applied with `delay`, or discarded (refused
    by the server or dropped by the controller; `delay` None)."""

    worker: str
    at: float  # seconds
    delay: int | None


@dataclass(frozen=True)
class Window:
    seconds: float
    workers: int
    updates: int
    discarded: int
    mean: float
    law: float  # sum_w a_w (A - a_w) / p_w / A: N - 1 when nothing is discarded
    within: float  # spread of delays about each worker's mean
    between: float  # spread of the workers' means about the mean (weighted by updates)
    per_worker: dict[str, tuple[float, float]]  # worker -> (mean delay, (A - a_w) / p_w)

    @property
    def spread(self) -> float:
        return math.hypot(self.within, self.between)


def window(outcomes: Iterable[Outcome], warmup: float) -> Window:
    """The law on the part of a run where every worker is running."""
    pushes = list(outcomes)
    if not any(o.delay is not None for o in pushes):
        raise ValueError("no applied update to measure")
    by_worker: dict[str, list[Outcome]] = defaultdict(list)
    for o in pushes:
        by_worker[o.worker].append(o)
    start = min(o.at for o in pushes) + warmup
    end = min(max(o.at for o in os) for os in by_worker.values())
    if end <= start:
        raise ValueError(f"no window where every worker runs: the first worker's last outcome "
                         f"is {end - start + warmup:.2f} s after the first one; lower --warmup "
                         f"({warmup:g} s) or run more steps")
    seconds = end - start
    inside = {w: [o for o in os if start < o.at <= end] for w, os in by_worker.items()}
    applied = {w: [o.delay for o in os if o.delay is not None] for w, os in inside.items()}
    idle = sorted(w for w, ds in applied.items() if not ds)
    if idle:
        raise ValueError(f"workers {idle} had nothing applied in the window of {seconds:.2f} "
                         f"s: run more steps")
    cycles = {w: len(os) / seconds for w, os in inside.items()}  # p_w
    rate = {w: len(ds) / seconds for w, ds in applied.items()}  # a_w
    total = sum(rate.values())
    delays = [d for ds in applied.values() for d in ds]
    mean = sum(delays) / len(delays)
    means = {w: sum(ds) / len(ds) for w, ds in applied.items()}
    within = math.sqrt(sum((d - means[w]) ** 2 for w, ds in applied.items() for d in ds)
                       / len(delays))
    between = math.sqrt(sum(len(ds) * (means[w] - mean) ** 2 for w, ds in applied.items())
                        / len(delays))
    expect = {w: (total - rate[w]) / cycles[w] for w in applied}
    law = sum(rate[w] * expect[w] for w in applied) / total
    per_worker = {w: (means[w], expect[w]) for w in sorted(applied)}
    discarded = sum(len(os) for os in inside.values()) - len(delays)
    return Window(seconds, len(inside), len(delays), discarded, mean, law, within, between,
                  per_worker)


def from_records(records: Iterable[PushRecord]) -> list[Outcome]:
    """The outcomes of a `mlfabric.sim.engine` run, at the time each reached its worker."""
    return [Outcome(f"w{r.worker}", r.done, r.delay if r.applied else None)
            for r in records if r.done is not None]


def from_log(path: str) -> list[Outcome]:
    """The outcomes in one decision log of `mlfabric controller --decision-log`:
    its reports ("done", applied or refused) and its drops."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                e = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{n}: not JSON ({err.msg})") from None
            if e.get("event") == "done":
                out.append(Outcome(str(e["host"]), float(e["at"]),
                                   int(e["delay"]) if e.get("applied") else None))
            elif e.get("event") == "drop":
                out.append(Outcome(str(e["host"]), float(e["at"]), None))
    return out


def describe(label: str, w: Window) -> list[str]:
    workers = "  ".join(f"{m:.2f}/{p:.2f}" for m, p in w.per_worker.values())
    return [f"{label}: window {w.seconds:.1f} s, {w.updates} updates of {w.workers} workers: "
            f"{w.discarded} discarded: delay mean {w.mean:.3f} (N - 1 = {w.workers - 1}; the "
            f"law from the rates {w.law:.3f}), spread {w.spread:.3f} = within "
            f"{w.within:.3f} (+) between {w.between:.3f}",
            f"    per worker, mean delay / (A - a_w) / p_w: {workers}"]


def run_sim(args: argparse.Namespace) -> int:
    slow = (RateChange(0, "h1", up_mbit=20), RateChange(0, "h2", up_mbit=30),
            RateChange(0, "h3", up_mbit=50))
    sc = Scenario(workers=6, server_down_mbit=80, update_bytes=2 * MIB, compute=1.0,
                  steps=args.steps, tau_max=args.tau_max, changes=slow, seed=args.seed)
    for policy in args.policies.split(","):
        result = simulate(sc, policy)
        discarded = sum(1 for r in result.records if not r.applied)
        label = (f"{policy} (seed {args.seed}; the whole run: {discarded} of "
                 f"{len(result.records)} discarded)")
        for line in describe(label, window(from_records(result.records), args.warmup)):
            print(line, flush=True)
    return 0


def run_logs(args: argparse.Namespace) -> int:
    paths = sorted(glob.glob(glob.escape(args.prefix) + "-*-r*.jsonl"))
    if not paths:
        print(f"no decision log matches {args.prefix}-POLICY-rROUND.jsonl "
              "(bench_controller.py --decision-log PREFIX writes them)", file=sys.stderr)
        return 2
    by_policy: dict[str, list[Window]] = defaultdict(list)
    for path in paths:
        m = re.search(r"-([a-z]+)-r(\d+)\.jsonl$", path)
        label = f"{m.group(1)} round {m.group(2)}" if m else path
        w = window(from_log(path), args.warmup)
        by_policy[m.group(1) if m else path].append(w)
        for line in describe(label, w):
            print(line, flush=True)
    for line in medians(by_policy):
        print(line)
    return 0


def medians(by_policy: dict[str, list[Window]]) -> list[str]:
    """Per policy, the medians over its rounds; mlfabric / fifo when both ran."""
    rows = {p: {k: statistics.median(getattr(w, k) for w in ws)
                for k in ("mean", "spread", "within", "between", "discarded")}
            for p, ws in by_policy.items() if len(ws) > 1}
    out = []
    for p, r in rows.items():
        out.append(f"medians of {len(by_policy[p])} rounds, {p}: delay mean {r['mean']:.3f}, "
                   f"spread {r['spread']:.3f} (within {r['within']:.3f}, between "
                   f"{r['between']:.3f}), discarded {r['discarded']:g}")
    if "mlfabric" in rows and "fifo" in rows:
        m, f = rows["mlfabric"], rows["fifo"]
        out.append("mlfabric / fifo: " + ", ".join(
            f"{k} {m[k] / f[k]:.2f}x" for k in ("mean", "spread", "within", "between") if f[k]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    sim = sub.add_parser("sim", help="the simulator's mixed-speed setting")
    sim.add_argument("--steps", type=int, default=200)
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--tau-max", type=int, default=None,
                     help="the server's staleness bound (default: none, nothing discarded)")
    sim.add_argument("--policies", default="fifo,mlfabric")
    sim.add_argument("--warmup", type=float, default=5.0)
    logs = sub.add_parser("logs", help="decision logs of bench_controller.py")
    logs.add_argument("prefix")
    logs.add_argument("--warmup", type=float, default=2.0)
    args = ap.parse_args(argv)
    try:
        return run_sim(args) if args.what == "sim" else run_logs(args)
    except ValueError as e:
        print(f"staleness_law: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
