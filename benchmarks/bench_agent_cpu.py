"""Benchmark what the bandwidth agents cost in CPU, on the contention scenario's cluster.

The emulated cluster (mlfabric.tools.testbed) of benchmarks/contention.py: a server
host and 8 worker hosts with the scenario's links. One agent per host, as
contention.py starts them (each worker's agent probes the server's host, the
server host's agent probes all eight). Each worker host holds one job
connection to the server's host: a paced TCP flow to a port every agent is
given as --job-port, so the agents count it as the job's own.

Two ways to read the job's traffic, alternated run by run:

* ``dump``: list every TCP socket at each load reading (`--job-rediscover 0`,
  what the agent did before 2026-11-23's change);
* ``lookup``: list them once a second and look up the job's known sockets
  in between (the default).

Per run it reports each agent's CPU (utime + stime from /proc over a
steady-state window) and how many of the job's bytes the server host's agent
counted against what the flows' sinks received (wire bytes: payload plus 66
header bytes per 1448-byte segment): what the cheaper reading may lose.
Medians over --runs per mode, and their ratio.

    sudo python benchmarks/bench_agent_cpu.py                 # 3 runs per mode, ~2 minutes
    sudo python benchmarks/bench_agent_cpu.py --runs 5 --window 20
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlfabric.tools.contention import Scenario, cluster_rates  # noqa: E402
from mlfabric.tools.testbed import Testbed, require_root  # noqa: E402
from mlfabric.tools.token_cli import agent_secrets  # noqa: E402
from mlfabric.tools.workload import scrape_metrics, wait_for_line  # noqa: E402

PORT = 7400
METRICS_PORT = 9471
TCP_WIRE = 1514 / 1448  # wire bytes per TCP payload byte (MSS 1448 with timestamps)
MODES = {"dump": "0", "lookup": "1"}


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(tb: Testbed, workers: int, mode: str, flow_mbit: float, settle: float,
            window: float) -> dict[str, float]:
    h0 = tb.host("h0")
    hosts = [tb.host(f"h{i + 1}") for i in range(workers)]
    flows = [tb.cross_traffic(h, h0, rate_mbit=flow_mbit, proto="tcp") for h in hosts]
    ports = [a for f in flows for a in ("--job-port", str(f.port))]
    secrets = tempfile.TemporaryDirectory(prefix="bench-agent-cpu-")
    cluster_token, _ = agent_secrets(Path(secrets.name), "bench")
    py = [sys.executable, "-m", "mlfabric", "--log-level", "WARNING", "agent",
          "--job-rediscover", MODES[mode], "--cluster-token-file", str(cluster_token), *ports]
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        for h in hosts:
            procs[h.name] = tb.popen(h, [*py, "--name", h.name, "--listen", f"{h.ip}:{PORT}",
                                         "--peer", f"h0={h0.ip}:{PORT}"],
                                     stdout=subprocess.PIPE, text=True)
        peers = [a for h in hosts for a in ("--peer", f"{h.name}={h.ip}:{PORT}")]
        procs["h0"] = tb.popen(h0, [*py, "--name", "h0", "--listen", f"{h0.ip}:{PORT}",
                                    "--metrics-port", str(METRICS_PORT), "--metrics-host",
                                    h0.ip, *peers], stdout=subprocess.PIPE, text=True)
        for name, p in procs.items():
            wait_for_line(p, "ready", f"agent {name}", timeout=30.0)
        time.sleep(settle)  # past the agents' start-up: imports, first trains
        c0 = {n: cpu_seconds(p.pid) for n, p in procs.items()}
        rx0 = sum(f.bytes_received for f in flows)
        m0 = scrape_metrics(h0, METRICS_PORT)
        t0 = time.monotonic()
        time.sleep(window)  # the measuring window
        dt = time.monotonic() - t0
        c1 = {n: cpu_seconds(p.pid) for n, p in procs.items()}
        rx1 = sum(f.bytes_received for f in flows)
        m1 = scrape_metrics(h0, METRICS_PORT)
        key = 'mlfabric_agent_job_traffic_bytes_total{direction="rx"}'
        counted = m1[key] - m0[key]
        wire = (rx1 - rx0) * TCP_WIRE
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(10)
        for f in flows:
            f.stop()
        secrets.cleanup()
    worker_cpu = [100 * (c1[h.name] - c0[h.name]) / dt for h in hosts]
    return {
        "worker agent %": statistics.median(worker_cpu),
        "server-host agent %": 100 * (c1["h0"] - c0["h0"]) / dt,
        "all agents, cores": sum(c1[n] - c0[n] for n in procs) / dt,
        "job bytes counted / received": counted / wire if wire else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs per mode (alternated)")
    ap.add_argument("--window", type=float, default=10.0, help="seconds measured per run")
    ap.add_argument("--settle", type=float, default=3.0,
                    help="seconds after the agents are ready before measuring")
    ap.add_argument("--flow-mbit", type=float, default=5.0,
                    help="rate of each worker host's job flow to the server's host")
    args = ap.parse_args()
    if args.runs < 1 or args.window <= 0 or args.settle < 0 or args.flow_mbit <= 0:
        ap.error("--runs must be >= 1, --window and --flow-mbit > 0, --settle >= 0")
    require_root()
    sc = Scenario()
    print(f"# {platform.node()}: {os.cpu_count()} cores; {sc.workers} worker hosts + the "
          f"server's, links as in benchmarks/contention.py; {args.runs} runs per mode, "
          f"{args.window:g} s windows, job flows at {args.flow_mbit:g} Mbit/s", flush=True)
    results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    with Testbed(hosts=sc.workers + 1, rate_mbit=1000.0,
                 rates=cluster_rates(sc)) as tb:
        for r in range(args.runs):
            order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
            for mode in order:
                got = one_run(tb, sc.workers, mode, args.flow_mbit, args.settle, args.window)
                results[mode].append(got)
                print(f"run {r + 1} {mode:6s} " + "  ".join(
                    f"{k} {v:.3f}" for k, v in got.items()), flush=True)
    print(f"\nmedian of {args.runs} runs       " + "".join(f"{m:>10s}" for m in MODES)
          + "   lookup/dump")
    for key in results["dump"][0]:
        med = {m: statistics.median(x[key] for x in results[m]) for m in MODES}
        ratio = med["lookup"] / med["dump"] if med["dump"] else float("nan")
        print(f"  {key:30s}" + "".join(f"{med[m]:10.3f}" for m in MODES) + f"   {ratio:.2f}")


if __name__ == "__main__":
    main()
