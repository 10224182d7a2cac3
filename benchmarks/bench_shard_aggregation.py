"""Aggregation per shard: bytes into each shard with and without aggregators.

Issue 31's goal: on the emulated cluster with S = 4 shards on 4 hosts and 8
workers, with aggregation the bytes into each shard are at most 0.5x of what
they are without it. The job of `bench_shards.py` (each worker pushes an
update of the whole model, then pulls, `--rounds` times, all starting
together) through a controller (`--policy mlfabric`) with `--aggregator`
for the agents on two aggregator hosts, and without it, alternated within
every repeat. Each shard's server link is shaped (the bottleneck), the
workers' and aggregators' links are fast. Bytes into a shard are its
server's `mlfabric_server_received_bytes_total` over the run (every byte
read from its connections, pulls' requests included). Per repeat and shard
the ratio with / without; the table gives each shard's median over the
repeats and the largest. Every run also checks that the shards applied
every update (the workers' outcomes) and ends with every shard's version
equal to the updates applied there.

    sudo python benchmarks/bench_shard_aggregation.py [--workers 8] [--shards 4]
        [--model-mib 16] [--server-mbit 100] [--rounds 3] [--repeats 3] [--group-wait S]

Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from bench_shards import (
    JOB,
    METRICS_PORT,
    job_files,
    make_model,
    popen,
    race,
    start_workers,
    stop,
)

from mlfabric.tools.token_cli import agent_secrets

CONFIGS = ("with", "without")
AGGREGATE_PORT = 7401
AGENT_PORT = 7400
AGGREGATORS = 2


def run_one(tb, config: str, args: argparse.Namespace, tmp: Path, init: Path, token: Path
            ) -> dict[str, object]:
    from mlfabric.tools.workload import scrape_metrics, serving_address, wait_for_line

    py = [sys.executable, "-m", "mlfabric", "--log-level", "WARNING"]
    procs, workers = [], []
    first_agg = args.shards + args.workers + 1
    aggs = [tb.host(f"h{first_agg + i}") for i in range(AGGREGATORS)]
    try:
        ctl_host = tb.host(f"h{args.shards + args.workers}")
        links = [f"--link={tb.host(f'h{i}').ip}={args.server_mbit:g}/{args.server_mbit:g}"
                 for i in range(args.shards)]
        routes = [f"--aggregator={a.ip}={a.ip}:{AGGREGATE_PORT}" for a in aggs] \
            if config == "with" else []
        if config == "with" and args.group_wait:
            routes += ["--group-wait", str(args.group_wait)]
        procs.append(popen(tb, ctl_host, [
            *py, "controller", "--listen", f"{ctl_host.ip}:0", "--job", JOB, "--token-file",
            str(token), "--tau-max", "-1", "--policy", "mlfabric",
            "--default-link-mbit", str(args.worker_mbit), *links, *routes], tmp))
        controller = serving_address(procs[0], "controller", timeout=120)
        servers = []
        for i in range(args.shards):
            host = tb.host(f"h{i}")
            servers.append(popen(tb, host, [
                *py, "server", "--listen", f"{host.ip}:0", "--job", JOB, "--token-file",
                str(token), "--init", str(init), "--tau-max", "-1", "--momentum", "0.9",
                "--metrics-port", str(METRICS_PORT), "--metrics-host", host.ip,
                "--shard", f"{i}/{args.shards}"], tmp))
        procs += servers
        addresses = ",".join(serving_address(p, f"shard {i}", timeout=120)
                             for i, p in enumerate(servers))
        if config == "with":
            for a in aggs:  # forwarding to the shards only
                agent = popen(tb, a, [
                    *py, "agent", "--name", a.ip, "--listen", f"{a.ip}:{AGENT_PORT}",
                    "--aggregate", f"{a.ip}:{AGGREGATE_PORT}", "--job", JOB, "--token-file",
                    str(token), "--servers", addresses,
                    "--cluster-token-file", str(agent_secrets(tmp, JOB)[0])], tmp)
                procs.append(agent)
                wait_for_line(agent, "aggregating", f"aggregator on {a.name}", timeout=120)
        start_workers(tb, [tb.host(f"h{args.shards + w}") for w in range(args.workers)],
                      addresses, token, tmp, args.rounds, workers, controller)

        def scrape(name: str) -> list[float]:
            return [scrape_metrics(tb.host(f"h{i}"), METRICS_PORT)[name]
                    for i in range(args.shards)]

        before = scrape("mlfabric_server_received_bytes_total")
        seconds = race(workers)
        received = [b - a for a, b in zip(before, scrape("mlfabric_server_received_bytes_total"),
                                          strict=True)]
        applied = scrape("mlfabric_server_updates_applied_total")
        aggregates = scrape("mlfabric_server_aggregates_applied_total")
    finally:
        stop(workers + procs)
    expected = args.workers * args.rounds
    if applied != [expected] * args.shards:
        raise SystemExit(f"{config}: shards applied {applied} updates, expected {expected} "
                         f"each (every worker's outcome was 'applied')")
    return {"seconds": seconds, "received": received, "aggregates": aggregates}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--model-mib", type=int, default=16)
    ap.add_argument("--server-mbit", type=float, default=100.0)
    ap.add_argument("--worker-mbit", type=float, default=1000.0)
    ap.add_argument("--queue-ms", type=float, default=50.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--group-wait", type=float, default=0.0,
                    help="the controller's --group-wait with aggregation (default 0: its "
                         "default, groups held only while they have time to spare)")
    args = ap.parse_args()
    if args.shards < 2 or args.workers < 2:
        ap.error("--shards and --workers must be at least 2")

    from mlfabric.tools.testbed import Testbed, require_root

    require_root()
    model = make_model(args.model_mib << 20)
    rates = {f"h{i}": (args.server_mbit, args.server_mbit) for i in range(args.shards)}
    print(f"{args.workers} workers, model {sum(a.nbytes for a in model.values()) / 2**20:.1f} "
          f"MiB over {args.shards} shards, server links {args.server_mbit:g} Mbit/s, "
          f"{AGGREGATORS} aggregators, group wait {args.group_wait:g} s, {args.rounds} rounds, "
          f"{args.repeats} repeats",
          flush=True)
    results: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="bench-shard-agg-") as d:
        tmp = Path(d)
        token, init = job_files(tmp, model)
        with Testbed(hosts=args.shards + args.workers + 1 + AGGREGATORS,
                     rate_mbit=args.worker_mbit, rates=rates, mtu=9000,
                     queue_ms=args.queue_ms) as tb:
            for r in range(args.repeats):
                for config in CONFIGS[r % 2:] + CONFIGS[:r % 2]:
                    res = run_one(tb, config, args, tmp, init, token)
                    results[config].append(res)
                    print(f"  repeat {r + 1}/{args.repeats}  {config:7s} {res['seconds']:6.1f} s"
                          f"  MB into each shard "
                          f"{' '.join(f'{b / 1e6:6.1f}' for b in res['received'])}"
                          f"  aggregates {' '.join(f'{a:.0f}' for a in res['aggregates'])}",
                          flush=True)
    ratios = [[w / o for w, o in zip(x["received"], y["received"], strict=True)]
              for x, y in zip(results["with"], results["without"], strict=True)]
    print()
    print("bytes into each shard, with aggregation / without (per repeat, then the median):")
    for i in range(args.shards):
        runs = [r[i] for r in ratios]
        print(f"  shard {i}: {statistics.median(runs):.3f}  ({' '.join(f'{x:.3f}' for x in runs)})")
    worst = max(statistics.median(r[i] for r in ratios) for i in range(args.shards))
    seconds = statistics.median(x["seconds"] / y["seconds"]
                                for x, y in zip(results["with"], results["without"], strict=True))
    print(f"largest shard median {worst:.3f} (goal <= 0.5); job time with / without "
          f"{seconds:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
