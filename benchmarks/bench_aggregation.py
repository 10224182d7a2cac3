"""Aggregation at agents vs none, on an emulated cluster (issue 5's acceptance).

The server (and the controller) on h0, whose downlink is the bottleneck
(shaped to --down-mbit, uplink 1 Gbit/s); 8 workers on hosts of their own at
1 Gbit/s; one more host with spare capacity runs `mlfabric agent --aggregate`
(the aggregator). The mlfabric policy runs with `--aggregator` and without
it, alternated round by round on the same namespaces, with the same link
picture (`--link h0=1000/DOWN`) and the same seeds. Workers push seeded
random float32 updates (`workload.seeded_update`, scale --scale) into a
server with momentum --momentum. Needs root.

    sudo .venv/bin/python benchmarks/bench_aggregation.py [--rounds 3] [--steps 12]
        [--compute-ms 150] [--in-flight 2] [--model-mib 2] [--down-mbit 100]
        [--tau-max 16] [--momentum 0.9] [--scale 1e-3] [--max-fan-in 8] [--no-hold-groups]

The controller holds the last group of its order for more members while it
can (its default); `--no-hold-groups` passes the same flag to it, and then
every aggregate has 2 members here and the server gets just over half the
bytes (benchmarks/RESULTS.md).

Per run and as medians per setting: bytes into the server (the server's
`mlfabric_server_received_bytes_total`, read from its metrics port at the
end of the run: every byte it read from client connections, pulls' requests
included), applied and dropped updates, aggregates the server applied and
their mean fan-in (the aggregator's members / aggregates), delay
mean/std/max, push-to-applied mean; and the ratios with/without. Every run
also checks that the final model, pulled from the server, equals a numpy
replay of the applied sequence (`workload.replay`: applied updates in
version order, those sharing an outcome version as one aggregate, its
members summed in their order at the aggregator, taken from the controller's
decision log) within float32 rounding: max |diff| <= 1e-6 x max|w| x steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlfabric.tools.testbed import Testbed, require_root
from mlfabric.tools.workload import RunInfo, Summary, member_order, replay, run_policy

MIB = 1 << 20
SETTINGS = ("with", "without")


@dataclass
class Run:
    setting: str
    summary: Summary
    server_bytes: float
    aggregates: float
    members: float  # updates applied inside aggregates (the aggregator's count)
    groups: float  # groups the controller formed
    failures: float
    agent: dict[str, float]  # the aggregator's metrics at the end (with only)
    steps: int  # momentum steps the server took (aggregates count once)
    max_diff: float
    tolerance: float

    @property
    def fan_in(self) -> float:
        return self.members / self.aggregates if self.aggregates else 0.0

    @property
    def mib_in(self) -> float:
        return self.server_bytes / MIB

    @property
    def mib_per_applied(self) -> float:
        return self.mib_in / self.summary.applied if self.summary.applied else 0.0

    def row(self) -> str:
        s = self.summary
        return (f"{self.setting:7s} into server {self.mib_in:7.1f} MiB "
                f"({self.mib_per_applied:4.2f}/applied)  pushes {s.pushes:3d} applied "
                f"{s.applied:3d} dropped {s.dropped:3d}  aggregates {self.aggregates:3.0f} "
                f"fan-in {self.fan_in:4.2f}  delay mean {s.delay_mean:5.2f} std "
                f"{s.delay_std:5.2f} max {s.delay_max:3d}  push-to-applied mean "
                f"{s.seconds_mean:6.3f}s  wall {s.wall:5.1f}s  replay max|diff| "
                f"{self.max_diff:.2e} (tol {self.tolerance:.1e})" + self.trouble())

    def trouble(self) -> str:
        """What went wrong at the aggregator, if anything."""
        a = self.agent
        counts = {
            "aggregator failures told the controller": self.failures,
            "group timeouts": a.get("mlfabric_aggregator_group_timeouts_total", 0.0),
            "late members": a.get("mlfabric_aggregator_late_members_total", 0.0),
            "aggregates not delivered": a.get(
                'mlfabric_aggregator_aggregates_total{outcome="failed"}', 0.0),
            "aggregates refused": a.get(
                'mlfabric_aggregator_aggregates_total{outcome="refused"}', 0.0)}
        bad = [f"{k} {v:.0f}" for k, v in counts.items() if v]
        return f"\n          ({', '.join(bad)})" if bad else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12, help="pushes per worker per run")
    ap.add_argument("--compute-ms", type=float, default=150.0)
    ap.add_argument("--in-flight", type=int, default=2, help="pushes outstanding per worker")
    ap.add_argument("--model-mib", type=float, default=2.0)
    ap.add_argument("--down-mbit", type=float, default=100.0, help="server downlink")
    ap.add_argument("--tau-max", type=int, default=16)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--scale", type=float, default=1e-3, help="updates: scale x N(0, 1)")
    ap.add_argument("--max-fan-in", type=int, default=8)
    ap.add_argument("--hold-groups", action=argparse.BooleanOptionalAction, default=True,
                    help="the controller holds the last group for more members "
                         "(mlfabric controller --hold-groups, its default)")
    ap.add_argument("--decision-logs", type=Path, default=None,
                    help="keep each run's controller decision log in this directory")
    args = ap.parse_args()
    require_root()

    model_bytes = int(args.model_mib * MIB) // 4 * 4
    init = {"w": np.zeros(model_bytes // 4, np.float32)}
    runs: dict[str, list[Run]] = {s: [] for s in SETTINGS}
    aggregator = f"h{args.workers + 1}"
    logs = args.decision_logs or Path(tempfile.mkdtemp(prefix="mlfabric-bench-agg-"))
    logs.mkdir(parents=True, exist_ok=True)
    failed = False

    with Testbed(hosts=args.workers + 2, rate_mbit=1000.0,
                 rates={"h0": (1000.0, args.down_mbit)}) as tb:
        for r in range(args.rounds):
            order = SETTINGS if r % 2 == 0 else SETTINGS[::-1]
            for setting in order:
                seen: dict[str, Any] = {}
                log = logs / f"round{r + 1}-{setting}.jsonl"
                log.unlink(missing_ok=True)  # the controller appends

                def at_end(info: RunInfo, seen: dict[str, Any] = seen) -> None:
                    seen["server"] = info.scrape("server")
                    seen["controller"] = info.scrape("controller")
                    seen["agent"] = info.scrape("agent") if "agent" in info.metrics else {}
                    seen["model"] = info.pull()

                summary, records = run_policy(
                    tb, "mlfabric", model_bytes=model_bytes, steps=args.steps,
                    tau_max=args.tau_max, compute_ms=args.compute_ms, seed=r,
                    max_in_flight=args.in_flight, link_mbit={"h0": (1000, args.down_mbit)},
                    momentum=args.momentum, update_scale=args.scale,
                    aggregator=aggregator if setting == "with" else None,
                    idle_hosts=(aggregator,), max_fan_in=args.max_fan_in, metrics=True,
                    controller_args=[] if args.hold_groups else ["--no-hold-groups"],
                    decision_log=log, at_end=at_end,
                    agent_log=logs / f"round{r + 1}-{setting}.agent.log")
                srv, ctl, agent = seen["server"], seen["controller"], seen["agent"]
                version, params = seen["model"]
                w, replay_version, steps = replay(records, init, args.momentum, args.scale,
                                                  member_order(records, log))
                diff = float(np.max(np.abs(params["w"] - w["w"])))
                tol = 1e-6 * float(np.max(np.abs(w["w"]))) * steps
                run = Run(setting, summary, srv["mlfabric_server_received_bytes_total"],
                          srv["mlfabric_server_aggregates_applied_total"],
                          agent.get("mlfabric_aggregator_members_total", 0.0),
                          ctl.get("mlfabric_controller_aggregation_groups_total", 0.0),
                          ctl.get("mlfabric_controller_aggregator_failures_total", 0.0),
                          agent,
                          steps, diff, tol)
                runs[setting].append(run)
                print(f"round {r + 1}  {run.row()}", flush=True)
                problems = []
                if version != replay_version:
                    problems.append(f"server version {version}, replay {replay_version}")
                if srv["mlfabric_server_updates_applied_total"] != summary.applied:
                    problems.append(f"server applied "
                                    f"{srv['mlfabric_server_updates_applied_total']:.0f}, "
                                    f"workers saw {summary.applied}")
                if not diff <= tol:
                    problems.append(f"final model differs from the replay by {diff:.3e} "
                                    f"> {tol:.3e}")
                for p in problems:
                    failed = True
                    print(f"  CHECK FAILED: {p}", flush=True)

    def med(setting: str, attr: str) -> float:
        vals = []
        for run in runs[setting]:
            obj: Any = run if hasattr(run, attr) else run.summary
            vals.append(float(getattr(obj, attr)))
        return statistics.median(vals)

    print()
    print(f"medians of {args.rounds} runs per setting ({args.workers} workers, "
          f"{args.model_mib} MiB updates, server downlink {args.down_mbit} Mbit/s, "
          f"compute {args.compute_ms:.0f} ms, {args.in_flight} in flight, tau_max "
          f"{args.tau_max}, momentum {args.momentum}"
          f"{'' if args.hold_groups else ', controller --no-hold-groups'})")
    fields = ["mib_in", "mib_per_applied", "applied", "dropped", "aggregates", "fan_in",
              "delay_mean", "delay_std", "delay_max", "seconds_mean", "seconds_std", "wall",
              "max_diff"]
    print(f"  {'':22s}" + "".join(f"{p:>12s}" for p in ("with", "without", "with/w-o")))
    for f in fields:
        a, b = med("with", f), med("without", f)
        ratio = f"{a / b:12.2f}" if b else f"{'-':>12s}"
        val = (lambda x: f"{x:12.2e}") if f == "max_diff" else (lambda x: f"{x:12.3f}")
        print(f"  {f:22s}{val(a)}{val(b)}{ratio}")
    worst = max((r.max_diff / r.tolerance for rs in runs.values() for r in rs
                 if r.tolerance > 0), default=0.0)
    print(f"  replay: every run's final model within tolerance: "
          f"{'yes' if not failed else 'NO'} (worst max|diff| / tol {worst:.2e}); "
          f"decision logs in {logs}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
