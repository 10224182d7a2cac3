"""The controller's re-plan time at 1,000 and 10,000 pending transfers
(issue 34: p99 <= 1 ms at 1,000, <= 5 ms at 10,000).

Times `ControlState.decide` itself, the whole of a re-plan as the
controller makes it (the plan, then letting go what is due), on the event
stream of a job whose server link is the bottleneck: each step one
transfer ends, its worker pushes its next update, and the controller
re-plans. Two planners side by side, alternated round by round:

- `scratch`: the mlfabric policy on a snapshot, built from the pending
  transfers on every event (`policies.mlfabric_policy`, the controller
  before issue 34's columns);
- `columns`: the same policy on columns kept between events
  (`policies.Mlfabric`, what the controller runs now). Their plans are
  equal (tests/test_columns.py); only the time differs.

Two loads: `fresh`, where every update can still meet its deadline, and
`overloaded`, where base versions lag by up to half the queue, so that
deadlines pass in the plan and the overload rule plans a second time.

    python benchmarks/bench_replan.py                        # 1,000 and 10,000, 5 rounds
    python benchmarks/bench_replan.py --pending 10000 --rounds 3 --steps 100
    python benchmarks/bench_replan.py --planners columns --malloc default
    python benchmarks/bench_replan.py --planners columns --against ../base/src/mlfabric

--against times the same rounds on another checkout's package (built:
its compiled extensions in place) in this process, alternated with this
tree's: on a machine whose speed drifts from one minute to the next,
before and after share the same minutes. It prints each side and the
ratio of their medians.

The process sets up its memory as `mlfabric controller` does
(`runtime.memory.reuse_freed_blocks`) unless --malloc default; each row also
gives the page faults per re-plan (the process's minor faults over the
round's re-plans and events, divided by the re-plans).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

from mlfabric.controller.state import ControlState
from mlfabric.scheduling.plan import Network, Policy
from mlfabric.scheduling.policies import mlfabric_policy

GBIT = 1e9 / 8
MiB = 1 << 20
TARGET_MS = {1000: 1.0, 10000: 5.0}  # p99, issue 34


def one_round(policy: Policy, pending: int, load: str, steps: int, seed: int,
              tree: types.ModuleType | None = None) -> tuple[list[float], float]:
    """Decision times (seconds) of `steps` re-plans at about `pending`
    pending, and the page faults per re-plan. `tree`: another mlfabric
    package (`load_tree`) whose controller state and network to use."""
    rng = random.Random(seed)
    state_cls, network_cls = ControlState, Network
    if tree is not None:
        state_cls = importlib.import_module(tree.__name__ + ".controller.state").ControlState
        network_cls = importlib.import_module(tree.__name__ + ".scheduling.plan").Network
    # Workers at 1 Gbit/s into a server that takes 4 at once: a queue.
    state = state_cls(policy, tau_max=pending, guard_order=True, learn_rates=True,
                      network=network_cls(default=GBIT, down={"server": 4 * GBIT}))
    lag = pending // 2 if load == "overloaded" else 0
    for i in range(pending):
        state.request(i, 0, host=f"w{i}", dst="server", nbytes=2 * MiB,
                      base_version=rng.randrange(0, lag + 1), norm=1.0, now=0.0)
    now, version = 0.0, lag
    state.decide(now)
    times = []
    gc.collect()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for step in range(1, steps + 1):
        now += 0.004
        if state.active:
            t = min(state.active.values(), key=lambda t: t.id)
            version += 1
            state.done(t.owner, t.req, version=version, applied=True, delay=1, now=now,
                       seconds=now - (t.started or 0.0))
            owner = t.owner
        else:
            owner = pending + step
        state.request(owner, step, host=f"w{owner}", dst="server", nbytes=2 * MiB,
                      base_version=version, norm=1.0, now=now)
        t0 = time.perf_counter()
        state.decide(now)
        times.append(time.perf_counter() - t0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return times, faults / steps


def load_tree(package_dir: str) -> types.ModuleType:
    """Another checkout's mlfabric package (its directory), importable beside
    this one as `mlfabric_other`: copied into a temporary directory under
    that name (its imports are relative, its compiled extensions keep their
    names)."""
    src = Path(package_dir).resolve()
    if not (src / "__init__.py").is_file() or not list((src / "scheduling").glob("_stf*.so")):
        raise SystemExit(f"--against {package_dir}: not a built mlfabric package (need "
                         f"__init__.py and scheduling/_stf*.so: run "
                         f"'python setup.py build_ext --inplace' in that checkout)")
    where = Path(tempfile.mkdtemp(prefix="bench_replan_"))
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    shutil.copytree(src, where / "mlfabric_other",
                    ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, str(where))
    return importlib.import_module("mlfabric_other")


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pending", default="1000,10000",
                    help="pending transfers, comma-separated (default 1000,10000)")
    ap.add_argument("--loads", default="fresh,overloaded")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200, help="re-plans timed per round")
    ap.add_argument("--planners", default="scratch,columns",
                    help="which of scratch,columns to time (scratch alone runs on a tree "
                         "before the columns, to compare)")
    ap.add_argument("--malloc", choices=("reuse", "default"), default="reuse",
                    help="reuse: the controller's setting (runtime.memory."
                         "reuse_freed_blocks); default: glibc's own")
    ap.add_argument("--against", metavar="PACKAGE_DIR",
                    help="another checkout's built src/mlfabric: its columns planner is "
                         "timed too, alternated round by round with this tree's")
    args = ap.parse_args()
    if args.malloc == "reuse":
        from mlfabric.runtime import memory

        if not memory.reuse_freed_blocks():
            print("(no glibc: --malloc reuse changes nothing here)")
    wanted = args.planners.split(",")
    planners: dict[str, Policy] = {}
    if "scratch" in wanted:
        planners["scratch"] = mlfabric_policy
    if "columns" in wanted:
        from mlfabric.scheduling.policies import Mlfabric

        planners["columns"] = Mlfabric()
    trees: dict[str, types.ModuleType | None] = {name: None for name in planners}
    if args.against:
        other = load_tree(args.against)
        policies = importlib.import_module(other.__name__ + ".scheduling.policies")
        planners["against"] = policies.Mlfabric()
        trees["against"] = other
    for n in (int(x) for x in args.pending.split(",")):
        for load in args.loads.split(","):
            p50: dict[str, list[float]] = {k: [] for k in planners}
            p99: dict[str, list[float]] = {k: [] for k in planners}
            faults: dict[str, list[float]] = {k: [] for k in planners}
            for r in range(args.rounds):
                names = list(planners) if r % 2 == 0 else list(reversed(planners))
                for name in names:
                    times, per_replan = one_round(planners[name], n, load, args.steps, seed=r,
                                                  tree=trees[name])
                    faults[name].append(per_replan)
                    p50[name].append(percentile(times, 0.50) * 1e3)
                    p99[name].append(percentile(times, 0.99) * 1e3)
                print(f"  ... {n} pending, {load}: round {r + 1}/{args.rounds}", flush=True)
            target = TARGET_MS.get(n)
            print(f"{n} pending, {load}: median of {args.rounds} rounds, "
                  f"{args.steps} re-plans each")
            for name in planners:
                m50, m99 = statistics.median(p50[name]), statistics.median(p99[name])
                goal = f"  p99 / {target:g} ms goal {m99 / target:.2f}" if target else ""
                print(f"  {name:8s} p50 {m50:7.3f} ms  p99 {m99:7.3f} ms{goal}  page faults "
                      f"per re-plan {statistics.median(faults[name]):.0f}")
            for a, b in (("columns", "scratch"), ("columns", "against")):
                if a in planners and b in planners:
                    ratio50 = statistics.median(p50[a]) / statistics.median(p50[b])
                    ratio99 = statistics.median(p99[a]) / statistics.median(p99[b])
                    print(f"  {a} / {b}: p50 {ratio50:.2f}  p99 {ratio99:.2f}")


if __name__ == "__main__":
    main()
