"""Time to accuracy under multi-tenant contention: mlfabric vs the FIFO PS vs DDP/gloo.

On the emulated cluster (root): a server host, 8 workers on heterogeneous
links, two other tenants whose traffic starts, stops and moves, and one
compute straggler (`mlfabric.tools.contention.Scenario`); the same with the
tenants loading worker links as much as the server hosts'
(contended-everywhere); and the same cluster uncontended. The sharded
systems put one server shard on every worker host (mlfabric-colocated) or
two on dedicated hosts (mlfabric-2shards). Every system runs on the same
namespaces, alternated round by round; the medians of the rounds are compared.

    sudo .venv/bin/python benchmarks/contention.py [--rounds 3] [--systems fifo,mlfabric,ddp]
        [--scenarios contended,uncontended] [--time-limit 150] [--json out.json]
        [--plot benchmarks/contention.png]

Prints, per scenario and system: time to the target accuracy (median; runs
that never reach it count as the time limit and are marked), delay mean, std
and max, updates applied (in all and per second of the run), drops, bytes
into the server; then the ratios against mlfabric. Time to target swings
with how many updates a run needs (asynchronous SGD on a noisy curve);
applied/s is the network-bound part, steadier from run to run. For the
systems with one server and no aggregation, the Mbit/s into the server's
host while another tenant's flow loads its downlink and while none does
(each transfer's bytes spread over its go to its report, from the decision
log), and what the tenant's flows into it got meanwhile: how much of a
shared link each way of sending takes, and from whom.
`--from-json out.json` prints the tables (and --plot) of a saved run again;
given several times, it pools their runs. Each ratio of median times to
target comes with a bootstrap 95% interval over the runs behind it.
Needs `pip install '.[torch]'` for ddp and matplotlib for --plot.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from mlfabric.errors import ConfigError
from mlfabric.tools.contention import (
    DDP_SYSTEMS,
    SHARDED,
    SYSTEMS,
    RunResult,
    Scenario,
    cluster_hosts,
    cluster_rates,
    contended_everywhere,
    first_reach,
    run_system,
    uncontended,
)
from mlfabric.tools.testbed import Testbed, require_root

NAME_W = max(len(s) for s in SYSTEMS)  # the system column


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def ttt(r: RunResult, limit: float) -> float:
    return r.time_to_target if r.time_to_target is not None else limit


# Accuracies below the target, reported too: the curve flattens before 0.90,
# where a run's crossing time depends on a few lucky or unlucky updates.
MILESTONES = (0.80, 0.85)


def milestones(sc: Scenario, runs: dict[str, list[RunResult]]) -> list[str]:
    """Median time to each milestone and to the target, per system."""
    marks = [m for m in MILESTONES if m < sc.target] + [sc.target]
    lines = ["  time to each accuracy (median; a run that never reached it counts as the "
             "time limit, marked >=)",
             "  " + f"{'system':{NAME_W}s}" + "".join(f"{'to ' + format(m, '.2f'):>11s}"
                                                for m in marks)]
    for system, rs in runs.items():
        if not rs:
            continue
        cells = []
        for m in marks:
            times = [first_reach(r.curve, m) for r in rs]
            t = med([x if x is not None else sc.time_limit for x in times])
            cells.append(f"{'>=' if None in times else ''}{t:.1f} s".rjust(11))
        lines.append(f"  {system:{NAME_W}s}" + "".join(cells))
    return lines


def forwards_floor(sc: Scenario, runs: dict[str, list[RunResult]]) -> list[str]:
    """A floor under the time to target of a system whose every applied update
    went through an aggregation group (mlfabric-agg-wait: groups of every
    worker, one at a time). Each group's aggregate crosses the server's
    downlink whole, so a run spent at least (groups - 1) x the forward time its
    aggregators measured receiving aggregates (the last group may still have
    been on its way when the target was reached). Against ddp's time in the
    same round, that is the most 'ddp / system' could be if nothing but the
    forwards took time."""
    ddp = runs.get("ddp") or []
    lines = []
    for system, rs in runs.items():
        if system in SHARDED:  # groups per shard, on links of their own: no one floor
            continue
        if not rs or not all(r.groups and r.forward_mean is not None and r.grouped == r.applied
                             for r in rs):
            continue
        floors = [(r.groups - 1) * (r.forward_mean or 0.0) for r in rs]
        line = (f"  {system}: forwards alone, (groups - 1) x measured forward, per run: "
                + ", ".join(f"{f:.2f} s" for f in floors))
        if len(ddp) == len(rs) and all(f > 0 for f in floors):
            ratios = [ttt(d, sc.time_limit) / f for d, f in zip(ddp, floors, strict=True)]
            line += ("; ddp's time to target / that: "
                     + ", ".join(f"{x:.2f}x" for x in ratios)
                     + f" (the most ddp / {system} could be)")
        lines.append(line)
    return lines


def ratio_interval(num: list[float], den: list[float], *, resamples: int = 2000,
                   seed: int = 0) -> tuple[float, float]:
    """A 95% bootstrap interval of median(num) / median(den): both sets of
    runs resampled with replacement, `resamples` times, from a seeded
    generator (the same runs print the same interval). Time to target
    spreads two- to three-fold between runs of one system, so a ratio of
    medians from a few rounds says little without it."""
    rng = random.Random(seed)
    ratios = sorted(statistics.median(rng.choices(num, k=len(num)))
                    / statistics.median(rng.choices(den, k=len(den)))
                    for _ in range(resamples))
    return ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]


def _rate(xs: list[float]) -> str:
    return f"{med(xs):.1f}" if xs else "-"


def table(sc: Scenario, runs: dict[str, list[RunResult]]) -> str:
    lines = [f"scenario {sc.name}: medians of {max(len(v) for v in runs.values())} runs, "
             f"target accuracy {sc.target}, time limit {sc.time_limit:.0f} s"]
    head = (f"  {'system':{NAME_W}s} {'time to target':>15s} {'reached':>8s} {'delay mean':>11s} "
            f"{'std':>6s} {'max':>4s} {'applied':>8s} {'applied/s':>10s} {'dropped':>8s} "
            f"{'server MB in':>13s}")
    lines.append(head)
    for system, rs in runs.items():
        if not rs:
            continue
        reached = sum(r.reached for r in rs)
        t = med([ttt(r, sc.time_limit) for r in rs])
        mark = "" if reached == len(rs) else " (>=)"
        if system in DDP_SYSTEMS:
            rest = f"{'-':>11s} {'-':>6s} {'-':>4s} {'-':>8s} {'-':>10s} {'-':>8s} {'-':>13s}"
        else:
            b = [r.server_bytes_in for r in rs if r.server_bytes_in is not None]
            rest = (f"{med([r.delay_mean for r in rs]):11.2f} "
                    f"{med([r.delay_std for r in rs]):6.2f} "
                    f"{med([r.delay_max for r in rs]):4.0f} {med([r.applied for r in rs]):8.0f} "
                    f"{med([r.applied / r.wall for r in rs]):10.2f} "
                    f"{med([r.dropped for r in rs]):8.0f} {med(b) / 1e6:13.1f}")
        lines.append(f"  {system:{NAME_W}s} {t:13.1f} s{mark:5s}{reached:>3d}/{len(rs):<3d} {rest}")
    lines += milestones(sc, runs)
    finals = [f"{system} {med([r.curve[-1][1] for r in rs if r.curve]):.3f}"
              for system, rs in runs.items() if any(r.curve for r in rs)]
    if finals:  # with a target none reaches, every run's accuracy at the time limit
        lines.append(f"  final held-out accuracy (median of each run's last): "
                     f"{', '.join(finals)}")
    for system, rs in runs.items():
        if any(r.codecs for r in rs):
            merged = RunResult(system, sc.name, False, None, 0.0,
                               codecs=[c for r in rs for c in r.codecs])
            lines.append(f"  {system} forms chosen per transfer (all runs): "
                         f"{codec_counts(merged)}")
    for system, rs in runs.items():
        parts = {k: [getattr(r, k) for r in rs if getattr(r, k) is not None]
                 for k in ("gather_mean", "forward_mean", "planned_gather_mean",
                           "planned_forward_mean")}
        if parts["gather_mean"] and parts["planned_gather_mean"]:
            lines.append(
                f"  {system} groups, mean seconds per group (median of runs), measured by the "
                f"aggregators vs planned: gather {med(parts['gather_mean']):.3f} vs "
                f"{med(parts['planned_gather_mean']):.3f}, forward "
                f"{med(parts['forward_mean']):.3f} vs {med(parts['planned_forward_mean']):.3f}")
    for system, rs in runs.items():
        loaded = [r.server_mbit_loaded for r in rs if r.server_mbit_loaded is not None]
        free = [r.server_mbit_free for r in rs if r.server_mbit_free is not None]
        tenant = [r.tenant_mbit_server for r in rs if r.tenant_mbit_server is not None]
        if loaded or free:
            lines.append(f"  {system} into the server's host, Mbit/s of its "
                         f"{sc.server_link[1]:g} (median of runs): while another tenant's "
                         f"flow loads it {_rate(loaded)} (the tenant's flow {_rate(tenant)}), "
                         f"while none does {_rate(free)}")
    lines += forwards_floor(sc, runs)
    # Each mlfabric system against what a user would pick instead (the goals),
    # and plain mlfabric against its variants.
    pairs = [(m, other) for m in SYSTEMS if m.startswith("mlfabric") and runs.get(m)
             for other in ("fifo", "ddp", "ddp-powersgd") if runs.get(other)]
    pairs += [("mlfabric", other) for other in ("mlfabric-agg", "mlfabric-static",
                                                "mlfabric-idle-off", "mlfabric-adaptive")
              if runs.get("mlfabric") and runs.get(other)]
    for m, other in pairs:
        mts = [ttt(r, sc.time_limit) for r in runs[m]]
        os_ = [ttt(r, sc.time_limit) for r in runs[other]]
        mt, o = med(mts), med(os_)
        spread = ""
        if len(mts) > 1 and len(os_) > 1:
            lo, hi = ratio_interval(os_, mts)
            spread = (f"; bootstrap 95% {lo:.2f}-{hi:.2f} over {len(os_)} and {len(mts)} runs"
                      + (", which holds 1: neither is shown sooner" if lo <= 1 <= hi else ""))
        lines.append(f"  time to target, {other} / {m}: {o / mt:.2f}x "
                     f"({m} {'sooner' if o > mt else 'later'}{spread})")
    return "\n".join(lines)


def plot(path: str, results: dict[str, dict[str, list[RunResult]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Beneath the accuracy, where workers offered compressed forms (issue
    # 35): each transfer's form as the controller chose it, over the same time.
    chose = any(r.codecs for runs in results.values() for rs in runs.values() for r in rs)
    rows = 2 if chose else 1
    fig, axes = plt.subplots(rows, len(results), figsize=(6 * len(results), 4.2 * rows),
                             squeeze=False, sharex="col")
    colours = {"fifo": "tab:red", "mlfabric": "tab:blue", "ddp": "tab:green",
               "ddp-powersgd": "lime",
               "mlfabric-agg": "tab:purple", "mlfabric-agg-wait": "tab:orange",
               "mlfabric-static": "tab:gray",
               "mlfabric-agg-static": "tab:brown", "mlfabric-colocated": "tab:cyan",
               "mlfabric-2shards": "tab:olive", "mlfabric-colocated-agg": "tab:pink",
               "mlfabric-colocated-agg-wait": "black", "mlfabric-idle-off": "navy",
               "mlfabric-adaptive": "gold", "mlfabric-colocated-adaptive": "darkgoldenrod",
               "mlfabric-colocated-agg-adaptive": "magenta"}
    for ax, (name, runs) in zip(axes[0], results.items(), strict=True):
        for system, rs in runs.items():
            for k, r in enumerate(rs):
                ts, accs = zip(*r.curve, strict=True) if r.curve else ((), ())
                ax.plot(ts, accs, color=colours.get(system), alpha=0.8,
                        label=system if k == 0 else None)
        ax.set_title(f"{name}")
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("held-out accuracy")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend()
    if chose:
        for ax, runs in zip(axes[1], results.values(), strict=True):
            forms = sorted({c for rs in runs.values() for r in rs for _, c in r.codecs},
                           key=form_order)
            offset = 0.0
            for system, rs in runs.items():
                points = [(t, forms.index(c)) for r in rs for t, c in r.codecs]
                if not points:
                    continue
                ts, ys = zip(*points, strict=True)
                ax.scatter(ts, [y + offset for y in ys], s=6, alpha=0.5,
                           color=colours.get(system), label=system)
                offset += 0.15  # systems side by side within a form's band
            ax.set_yticks(range(len(forms)), forms)
            ax.set_title("compression chosen per transfer")
            ax.set_xlabel("wall time (s)")
            ax.grid(alpha=0.3)
            if forms:
                ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def form_order(codec: str) -> tuple[int, float, str]:
    """Whole first, then by the bytes a form keeps: 16-bit, then sparse and
    low rank by their fraction or rank, descending."""
    name, _, arg = codec.partition(":")
    if codec == "whole":
        return (0, 0.0, codec)
    if name in ("fp16", "bf16"):
        return (1, 0.0, codec)
    try:
        return (2, -float(arg), codec)
    except ValueError:
        return (3, 0.0, codec)


def codec_counts(r: RunResult) -> str:
    """'whole 120, fp16 5, topk:0.1 17' for a run whose workers offered forms."""
    counts: dict[str, int] = {}
    for _, c in r.codecs:
        counts[c] = counts.get(c, 0) + 1
    return ", ".join(f"{c} {counts[c]}" for c in sorted(counts, key=form_order))


def report(paths: list[str], plot_path: str | None, time_limit: float) -> int:
    """Print the tables of the runs saved in `paths` (by --json), the runs of
    each scenario and system pooled over the files in their order."""
    results: dict[str, dict[str, list[RunResult]]] = {}
    for path in paths:
        try:
            with open(path) as f:
                saved = json.load(f)
            for name, runs in saved.items():
                pooled = results.setdefault(name, {})
                for system, rs in runs.items():
                    pooled.setdefault(system, []).extend(
                        RunResult(**{**r, "curve": [tuple(p) for p in r["curve"]],
                                     "codecs": [tuple(c) for c in r.get("codecs", [])]})
                        for r in rs)
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            print(f"cannot read the runs saved in {path}: {exc}; give a file written by "
                  f"--json", file=sys.stderr)
            return 2
    base = Scenario(time_limit=time_limit)
    for name, runs in results.items():
        print(table(replace(base, name=name), runs))
        print()
    if plot_path:
        plot(plot_path, results)
        print(f"plot: {plot_path}")
    return 0


def tenant_rate(text: str) -> float | None:
    if text.lower() == "none":
        return None
    try:
        rate = float(text)
    except ValueError:
        rate = float("nan")
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"give a positive rate in Mbit/s or 'none', got {text!r}")
    return rate


SCENARIOS = ("contended", "contended-everywhere", "uncontended")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3,
                    help="runs of each system per scenario; the systems alternate within a "
                         "round (default %(default)s)")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help="comma-separated, from: %(default)s (default: all)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS),
                    help="comma-separated, from: %(default)s (default: all)")
    ap.add_argument("--time-limit", type=float, default=150.0,
                    help="seconds a run may take to reach the target accuracy "
                         "(default %(default)s)")
    ap.add_argument("--workers", type=int, default=8,
                    help="worker hosts (2-8; default %(default)s)")
    ap.add_argument("--tenant-max-mbit", type=tenant_rate, default=Scenario.tenant_max_mbit,
                    metavar="MBIT|none",
                    help="bound on each tenant flow's rate (default %(default)s Mbit/s; none: "
                         "60%% of the link it loads, whatever that costs the machine's CPU)")
    ap.add_argument("--target", type=float, default=Scenario.target,
                    help="the held-out accuracy to reach (default %(default)s); one no "
                         "system reaches (0.99) runs each for the whole --time-limit, to "
                         "compare final accuracies")
    ap.add_argument("--tau-max", type=int, default=Scenario.tau_max,
                    help="the staleness bound of the PS systems, in versions (default "
                         "%(default)s)")
    ap.add_argument("--group-wait", type=float, default=Scenario.group_wait,
                    metavar="SECONDS",
                    help="mlfabric-agg-wait: how long the server's downlink may wait for a "
                         "group (the controller's --group-wait; default %(default)s)")
    ap.add_argument("--mtu", type=int, default=Scenario.mtu,
                    help="every link's MTU in bytes, 1280-9000 (default %(default)s, jumbo "
                         "frames; 1500 costs the emulation 5x the CPU per byte)")
    ap.add_argument("--json", default=None, help="write every run's result here")
    ap.add_argument("--plot", default=None, help="write the accuracy-over-time plot (PNG)")
    ap.add_argument("--keep-logs", default=None, metavar="DIR",
                    help="copy each run's controller decision log into DIR")
    ap.add_argument("--from-json", action="append", default=[], metavar="FILE",
                    help="print the tables of the runs saved in FILE (by --json); run "
                         "nothing. Repeat it to pool the runs of several files")
    args = ap.parse_args()
    if args.from_json:
        return report(args.from_json, args.plot, args.time_limit)
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            ap.error(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    names = [n for n in args.scenarios.split(",") if n]
    for n in names:
        if n not in SCENARIOS:
            ap.error(f"unknown scenario {n!r}; choose from {', '.join(SCENARIOS)}")
    try:
        base = Scenario(time_limit=args.time_limit, workers=args.workers, target=args.target,
                        tenant_max_mbit=args.tenant_max_mbit, mtu=args.mtu,
                        tau_max=args.tau_max, group_wait=args.group_wait)
    except ConfigError as exc:
        ap.error(str(exc))
    require_root()
    scenarios = {"contended": base, "contended-everywhere": contended_everywhere(base),
                 "uncontended": uncontended(base)}
    chosen = [scenarios[n] for n in names]
    results: dict[str, dict[str, list[RunResult]]] = {}
    hosts = cluster_hosts(base)
    with Testbed(hosts=hosts, rate_mbit=1000.0, rates=cluster_rates(base), mtu=base.mtu) as tb:
        for sc in chosen:
            runs: dict[str, list[RunResult]] = {s: [] for s in systems}
            for r in range(args.rounds):
                order = systems[r % len(systems):] + systems[:r % len(systems)]
                for system in order:
                    try:
                        res = run_system(tb, replace(sc, seed=r), system,
                                         progress=lambda m: print(f"\r  {m}", end="",
                                                                  file=sys.stderr, flush=True),
                                         keep=Path(args.keep_logs) if args.keep_logs else None)
                    except RuntimeError as exc:  # reported, counted, and the next run goes on
                        print(f"{sc.name} round {r + 1} {system:8s} FAILED: {exc}", flush=True)
                        continue
                    finally:
                        print(file=sys.stderr)
                    runs[system].append(res)
                    t = f"{res.time_to_target:.1f} s" if res.reached else "not reached"
                    extra = ("" if system in DDP_SYSTEMS else
                             f"  delay mean {res.delay_mean:.2f} std {res.delay_std:.2f} max "
                             f"{res.delay_max}  applied {res.applied} dropped {res.dropped}  "
                             + (f"held {res.held}  " if res.held else "") +
                             f"server MB in {(res.server_bytes_in or 0) / 1e6:.1f}"
                             + (f"  groups {res.groups} of {res.grouped} updates "
                                f"({res.rescued} rescued)" if res.groups else "")
                             + "".join(f"  {n} {reason}" for reason, n in
                                       sorted(res.drop_reasons.items()))
                             + (f"  forms: {codec_counts(res)}" if res.codecs else "")
                             + (f"  into the server {res.server_mbit_loaded:.1f} Mbit/s with "
                                f"a tenant" if res.server_mbit_loaded is not None else "")
                             + (f" (its flow {res.tenant_mbit_server:.1f})"
                                if res.tenant_mbit_server is not None else "")
                             + (f"  {res.server_mbit_free:.1f} without"
                                if res.server_mbit_free is not None else ""))
                    print(f"{sc.name} round {r + 1} {system:8s} time to target {t}  wall "
                          f"{res.wall:.1f} s{extra}", flush=True)
            results[sc.name] = runs
            print()
            print(table(sc, runs), flush=True)
            print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({n: {s: [r.as_dict() for r in rs] for s, rs in runs.items()}
                       for n, runs in results.items()}, f)
    if args.plot:
        plot(args.plot, results)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
