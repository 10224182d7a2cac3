"""A synthetic training workload for measuring transfer scheduling.

`python -m mlfabric.workload ...` is one worker: it pulls, "computes" for a
set time (a sleep with seeded jitter: the network, not the arithmetic, is
under test), pushes an update of the model's size and records what happened
to it. `run_policy()` runs a server, a controller and N such workers on an
emulated cluster (`mlfabric.tools.testbed`) and summarises delays and
push-to-applied times, so policies can be compared on the same hosts.

For in-network aggregation a run can also put an aggregator (`mlfabric agent
--aggregate`) on a host of its own, give the server momentum, have workers
push seeded random updates (`seeded_update`, reproducible per worker and
step) and record the version each was applied at, so that `replay` can redo
the run's applied sequence in numpy; `RunInfo` hands the processes, addresses
and metrics ports to callbacks during and at the end of the run
(`benchmarks/bench_aggregation.py`, `tests/test_aggregation_testbed.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .token_cli import agent_secrets

JOB = "workload"
CONTROLLER_PORT = 7071  # inside the server host's own namespace
ETCD_PORTS = (2379, 2380)  # several controllers: etcd on the server host (client, peer)
AGENT_PORT = 7400  # the aggregator's agent (its own host)
AGGREGATE_PORT = 7401
METRICS_PORTS = {"server": 9100, "controller": 9101, "agent": 9102}


def seeded_update(like: dict[str, np.ndarray], seed: int, step: int,
                  scale: float) -> dict[str, np.ndarray]:
    """Worker `seed`'s update at `step`: scale x N(0, 1) float32, the same
    every time (tensors in name order from one generator)."""
    rng = np.random.default_rng([seed, step])
    out = {}
    for name in sorted(like):
        a = like[name]
        out[name] = (rng.standard_normal(a.size, dtype=np.float32)
                     * np.float32(scale)).reshape(a.shape)
    return out


def worker_main(argv: list[str] | None = None) -> int:
    import mlfabric

    p = argparse.ArgumentParser(prog="python -m mlfabric.workload")
    p.add_argument("--server", required=True)
    p.add_argument("--controller", default=None)
    p.add_argument("--token-file", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--compute-ms", type=float, default=100.0)
    p.add_argument("--jitter", type=float, default=0.2, help="relative compute-time jitter")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-in-flight", type=int, default=2,
                   help="pushes handed over and not yet answered before the worker waits "
                        "(workers hand updates to mlfabric and keep computing)")
    p.add_argument("--fallback", default="fifo", choices=["fifo", "wait"],
                   help="what to do while the controller is unreachable")
    p.add_argument("--update-scale", type=float, default=None,
                   help="push seeded random updates of this scale (seeded_update: seed, step) "
                        "instead of a constant 1e-6")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    records = []
    with mlfabric.connect(args.server, job=JOB, token_file=args.token_file,
                          controller=args.controller, host=args.host, timeout=30,
                          controller_fallback=args.fallback, controller_timeout=60) as ps:
        version, params = ps.pull(timeout=60)
        print("ready", flush=True)  # connected: run_policy may start its clock
        update = {n: np.full_like(a, 1e-6) for n, a in params.items()}
        in_flight: list[tuple[float, int, Any]] = []

        def settle(t0: float, step: int, fut: Any) -> None:
            outcome = fut.result(300)
            done = getattr(fut, "done_at", time.monotonic())  # callback may still run
            records.append({"start": t0, "seconds": done - t0,
                            "applied": outcome.applied, "delay": outcome.delay,
                            "reason": outcome.reason, "version": outcome.version,
                            "seed": args.seed, "step": step, "host": args.host})

        def stamp(fut: Any) -> None:
            fut.done_at = time.monotonic()
        for step in range(args.steps):
            version, _ = ps.pull(timeout=120)
            time.sleep(args.compute_ms / 1e3 * (1 + args.jitter * (2 * rng.random() - 1)))
            if args.update_scale is not None:
                update = seeded_update(params, args.seed, step, args.update_scale)
            t0 = time.monotonic()
            fut = ps.push(update, base_version=version)
            fut.add_done_callback(stamp)
            in_flight.append((t0, step, fut))
            while len(in_flight) >= args.max_in_flight:
                settle(*in_flight.pop(0))
        for t0, step, fut in in_flight:
            settle(t0, step, fut)
    Path(args.out).write_text(json.dumps(records))
    return 0


@dataclass(frozen=True)
class Summary:
    policy: str
    pushes: int
    applied: int
    dropped: int
    delay_mean: float
    delay_std: float
    delay_max: int
    seconds_mean: float
    seconds_std: float
    wall: float

    @property
    def applied_per_s(self) -> float:
        """Throughput: a run is a fixed number of pushes, and a drop at the
        controller ends its push sooner than a transfer would, so applied
        updates per second compare policies where the applied count does not."""
        return self.applied / self.wall if self.wall > 0 else 0.0

    def row(self) -> str:
        return (f"{self.policy:9s} pushes {self.pushes:4d}  applied {self.applied:4d}  "
                f"dropped {self.dropped:3d}  delay mean {self.delay_mean:5.2f} std "
                f"{self.delay_std:5.2f} max {self.delay_max:3d}  push-to-applied mean "
                f"{self.seconds_mean:6.3f}s std {self.seconds_std:6.3f}s  wall {self.wall:5.1f}s")


def summarise(policy: str, records: list[dict[str, Any]], wall: float) -> Summary:
    applied = [r for r in records if r["applied"]]
    delays = [r["delay"] for r in applied]
    secs = [r["seconds"] for r in applied]
    return Summary(
        policy=policy, pushes=len(records), applied=len(applied),
        dropped=len(records) - len(applied),
        delay_mean=statistics.fmean(delays) if delays else 0.0,
        delay_std=statistics.pstdev(delays) if delays else 0.0,
        delay_max=max(delays, default=0),
        seconds_mean=statistics.fmean(secs) if secs else 0.0,
        seconds_std=statistics.pstdev(secs) if secs else 0.0,
        wall=wall)


def wait_for_line(proc: subprocess.Popen[str], word: str, what: str,
                  timeout: float = 60.0) -> str:
    """The first stdout line of `proc` containing `word`, within `timeout` seconds."""
    import selectors

    sel = selectors.DefaultSelector()
    assert proc.stdout is not None
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sel.select(timeout=max(0.0, deadline - time.monotonic())):
            line = proc.stdout.readline()
            if not line:
                break
            if word in line:
                return line.strip()
    err = proc.stderr.read() if proc.stderr else ""
    raise RuntimeError(f"{what} did not report {word!r} within {timeout:.0f} s: {err[-1500:]}")


def serving_address(proc: subprocess.Popen[str], what: str, timeout: float = 60.0) -> str:
    """The HOST:PORT of a server or controller, from its 'serving ... on HOST:PORT' line."""
    return wait_for_line(proc, "serving", what, timeout).split(" on ")[1].split()[0]


@dataclass
class RunInfo:
    """A run of `run_policy` while it lasts, for its callbacks: the testbed,
    the job's token file, the server's and controller's addresses, the
    processes by role ("server", "controller", "agent") and, with
    `metrics=True`, each role's (host, metrics port)."""

    tb: Any
    server_host: Any
    tmp: Path
    token: Path
    server_addr: str
    controller_addr: str
    procs: dict[str, subprocess.Popen[str]] = field(default_factory=dict)
    metrics: dict[str, tuple[Any, int]] = field(default_factory=dict)

    def scrape(self, role: str) -> dict[str, float]:
        """The metrics of `role` now (sample name with labels -> value)."""
        host, port = self.metrics[role]
        return scrape_metrics(host, port)

    def pull(self, host: str | None = None) -> tuple[int, dict[str, np.ndarray]]:
        """The server's model now, pulled from inside `host` (default: the server's)."""
        import mlfabric

        h = self.tb.host(host) if host is not None else self.server_host
        with h.enter():  # the connection's socket lives in that namespace
            ps = mlfabric.connect(self.server_addr, job=JOB, token_file=self.token,
                                  timeout=30)
        with ps:
            return ps.pull(timeout=60)


def scrape_metrics(host: Any, port: int, timeout: float = 5.0) -> dict[str, float]:
    """Prometheus samples of the endpoint on `port` inside testbed `host`:
    'name{label="v",...}' (or 'name') -> value."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    # The request's socket is made (and used) in this thread, inside the host.
    with host.enter(), urllib.request.urlopen(f"http://{host.ip}:{port}/metrics",
                                              timeout=timeout) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def run_policy(tb: Any, policy: str, *, model_bytes: int, steps: int, tau_max: int,
               compute_ms: float = 100.0, server_host: str = "h0", seed: int = 0,
               max_in_flight: int = 2, fallback: str = "fifo",
               restart_controller_after: float | None = None,
               link_mbit: dict[str, tuple[float, float]] | None = None,
               during: Any = None, momentum: float | None = None,
               update_scale: float | None = None, aggregator: str | None = None,
               idle_hosts: Sequence[str] = (), max_fan_in: int | None = None,
               group_timeout: float | None = None, metrics: bool = False,
               decision_log: Path | None = None, controller_args: Sequence[str] = (),
               agent_log: Path | None = None,
               during_run: Callable[[RunInfo], None] | None = None,
               at_end: Callable[[RunInfo], None] | None = None,
               shard_hosts: Sequence[str] = (), controllers: int = 1,
               kill_controller_after: float | None = None, lease_ttl: int = 1,
               landing_reports: bool = False
               ) -> tuple[Summary, list[dict[str, Any]]]:
    """Run one policy: server and controller on `server_host`, a worker on
    every other host of testbed `tb`. `during(tb)` runs once the workers are
    started (e.g. a schedule of rate changes). Returns the summary and the
    workers' records. With `restart_controller_after`, the controller is
    killed (SIGKILL) that many seconds after every worker has connected, and
    started again on the same address a second later.

    Aggregation: `aggregator` names a host that runs `mlfabric agent
    --aggregate` (and no worker) and that the controller routes groups
    through (`max_fan_in`, `group_timeout` passed on); `idle_hosts` run no
    worker either (e.g. the same host in the runs without aggregation).
    `momentum` is the server's; `update_scale` makes workers push seeded
    random updates (`seeded_update`). `metrics` serves every process's
    metrics (RunInfo.metrics); `decision_log` is the controller's, and
    `controller_args` more of its flags (with an aggregator only, e.g.
    --hold-groups); `agent_log` gets the aggregator agent's stderr.
    `during_run(info)` runs once the workers are started (after `during`),
    `at_end(info)` once they are all done, before anything is stopped.

    `shard_hosts`: the model is served by len(shard_hosts) + 1 shards, shard
    0 on `server_host` (with the controller) and shard i on shard_hosts[i-1];
    no worker runs there. RunInfo.server_addr then lists them all.

    `controllers` > 1 (several controllers, issue 34): an etcd on
    `server_host`, and controller k on the k-th of [server_host,
    *shard_hosts] (`--etcd`, `--lease-ttl lease_ttl`); the workers are
    given them all. `kill_controller_after`: the first controller is killed
    (SIGKILL) that many seconds after every worker has connected, and not
    started again: the others take its shards over. `landing_reports`:
    each server is started with `--controller` (every controller), and
    tells them of each landing itself (`server.landings`)."""
    from ..wire import auth

    server = tb.host(server_host)
    if shard_hosts and aggregator:
        raise ValueError("run_policy: sharded servers with an aggregator are not supported "
                         "(an aggregator forwards to one server)")
    if controllers > 1 and (aggregator or restart_controller_after is not None):
        raise ValueError("run_policy: several controllers with an aggregator or a restarted "
                         "controller are not supported")
    if not 1 <= controllers <= 1 + len(shard_hosts):
        raise ValueError(f"run_policy: controllers must be 1..shards ({1 + len(shard_hosts)}), "
                         f"got {controllers}")
    skip = {server_host, *shard_hosts, *idle_hosts, *([aggregator] if aggregator else [])}
    workers = [h for h in tb.hosts if h.name not in skip]
    with tempfile.TemporaryDirectory(prefix="mlfabric-workload-") as tmp:
        token = Path(tmp) / "job.token"
        token.write_text(auth.generate_token())
        token.chmod(0o600)
        init = Path(tmp) / "init.npz"
        np.savez(init, w=np.zeros(model_bytes // 4, np.float32))
        py = [sys.executable, "-m", "mlfabric", "--log-level", "WARNING"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        kw = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp, env=env)
        ports: dict[str, tuple[Any, int]] = {}
        if metrics:
            ports = {"server": (server, METRICS_PORTS["server"]),
                     "controller": (server, METRICS_PORTS["controller"])}
            if aggregator:
                ports["agent"] = (tb.host(aggregator), METRICS_PORTS["agent"])

        def metrics_argv(role: str) -> list[str]:
            return ["--metrics-port", str(ports[role][1])] if role in ports else []
        srv_argv = [*py, "server", "--listen", f"{server.ip}:0", "--job", JOB, "--token-file",
                    str(token), "--init", str(init), "--tau-max", str(tau_max),
                    *metrics_argv("server")]
        ctl_hosts = [server, *(tb.host(h) for h in shard_hosts)][:controllers]
        if landing_reports:  # each server tells the controllers of its landings itself
            srv_argv += ["--controller",
                         ",".join(f"{h.ip}:{CONTROLLER_PORT}" for h in ctl_hosts)]
        if momentum is not None:
            srv_argv += ["--momentum", str(momentum)]
        shards = 1 + len(shard_hosts)
        if shards > 1:
            srv_argv += ["--shard", f"0/{shards}"]
        srv = tb.popen(server, srv_argv, **kw)
        procs = {"server": srv}
        for i, name in enumerate(shard_hosts, start=1):
            argv = [a.replace(f"{server.ip}:0", f"{tb.host(name).ip}:0") for a in srv_argv]
            procs[f"server{i}"] = tb.popen(tb.host(name), [*argv[:-2], "--shard",
                                                           f"{i}/{shards}"], **kw)
        srv_addr = ""  # from its start line, once it is up
        links = []
        for name, (up, down) in (link_mbit or {}).items():
            links += ["--link", f"{tb.host(name).ip}={up}/{down}"]
        ctl_argv = [*py, "controller", "--listen", f"{server.ip}:{CONTROLLER_PORT}", "--job",
                    JOB, "--token-file", str(token), "--tau-max", str(tau_max), "--policy",
                    policy, *links, *metrics_argv("controller")]
        if aggregator:
            agg = tb.host(aggregator)
            ctl_argv += ["--aggregator", f"{agg.ip}={agg.ip}:{AGGREGATE_PORT}"]
            if max_fan_in is not None:
                ctl_argv += ["--max-fan-in", str(max_fan_in)]
            ctl_argv += list(controller_args)
            cluster_token, _ = agent_secrets(Path(tmp), JOB)
            try:  # the aggregator forwards to the server only, named as the workers do
                srv_addr = serving_address(srv, "server")
            except BaseException:
                srv.kill()
                srv.wait(10)
                raise
            agent_argv = [*py, "agent", "--name", agg.ip, "--listen", f"{agg.ip}:{AGENT_PORT}",
                          "--cluster-token-file", str(cluster_token),
                          "--aggregate", f"{agg.ip}:{AGGREGATE_PORT}", "--job", JOB,
                          "--token-file", str(token), "--servers", srv_addr,
                          *metrics_argv("agent")]
            if group_timeout is not None:
                agent_argv += ["--group-timeout", str(group_timeout)]
            if agent_log is not None:
                with open(agent_log, "w") as log_file:
                    procs["agent"] = tb.popen(agg, agent_argv, **{**kw, "stderr": log_file})
            else:
                procs["agent"] = tb.popen(agg, agent_argv, **kw)
        if decision_log is not None:
            ctl_argv += ["--decision-log", str(decision_log)]
        if controllers > 1:
            from .etcd import etcd_argv

            # Its log goes to a file (read for its ready line): a pipe left
            # unread would fill and stall it.
            etcd_log = Path(tmp) / "etcd.log"
            with open(etcd_log, "w") as out:
                procs["etcd"] = tb.popen(server, etcd_argv(server.ip, *ETCD_PORTS,
                                                           Path(tmp) / "etcd", log_level="info"),
                                         stdout=out, stderr=subprocess.STDOUT, cwd=tmp, env=env)
            deadline = time.monotonic() + 30.0
            while "ready to serve client requests" not in etcd_log.read_text():
                if procs["etcd"].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"etcd did not start: {etcd_log.read_text()[-2000:]}")
                time.sleep(0.05)
            listed = ",".join(f"{h.ip}:{CONTROLLER_PORT}" for h in ctl_hosts)
            ctl_argv += ["--etcd", f"http://{server.ip}:{ETCD_PORTS[0]}", "--controllers",
                         listed, "--shards", str(shards), "--lease-ttl", str(lease_ttl)]
        ctl = tb.popen(server, ctl_argv, **kw)
        procs["controller"] = ctl
        for k, host in enumerate(ctl_hosts[1:], start=1):
            argv = list(ctl_argv)
            argv[argv.index("--listen") + 1] = f"{host.ip}:{CONTROLLER_PORT}"
            if decision_log is not None:
                argv = [f"{decision_log}.{k}" if a == str(decision_log) else a for a in argv]
            procs[f"controller{k}"] = tb.popen(host, argv, **kw)
        try:
            if not aggregator:
                srv_addr = ",".join(serving_address(procs[role], role) for role in
                                    ["server", *(f"server{i}" for i in range(1, shards))])
            ctl_addr = ",".join(serving_address(procs[role], role) for role in
                                ["controller", *(f"controller{k}"
                                                 for k in range(1, controllers))])
            if "agent" in procs:
                wait_for_line(procs["agent"], "aggregating", "aggregator agent")
            info = RunInfo(tb, server, Path(tmp), token, srv_addr, ctl_addr, procs, ports)
            started = time.monotonic()
            workers_procs = []
            for i, h in enumerate(workers):
                extra = [] if update_scale is None else ["--update-scale", str(update_scale)]
                workers_procs.append(tb.popen(h, [
                    sys.executable, "-m", "mlfabric.tools.workload", "--server", srv_addr,
                    "--controller", ctl_addr, "--token-file", str(token), "--host", h.ip,
                    "--steps", str(steps), "--compute-ms", str(compute_ms),
                    "--seed", str(seed * 100 + i), "--max-in-flight", str(max_in_flight),
                    "--fallback", fallback, *extra,
                    "--out", f"{tmp}/w{i}.json"],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp,
                    env=env))
            if during is not None:
                during(tb)
            if during_run is not None:
                during_run(info)
            if restart_controller_after is not None:
                # From when every worker is connected: a worker still starting
                # up when the controller dies is refused at connect() with
                # fallback "wait", which is not what this run is about.
                for i, p in enumerate(workers_procs):
                    wait_for_line(p, "ready", f"worker {i}", timeout=60.0)
                time.sleep(restart_controller_after)  # the point in the run to kill it at
                ctl.kill()
                ctl.wait(10)
                time.sleep(1.0)  # a second without a controller
                ctl = procs["controller"] = tb.popen(server, ctl_argv, **kw)
                serving_address(ctl, "restarted controller")
            if kill_controller_after is not None:
                for i, p in enumerate(workers_procs):
                    wait_for_line(p, "ready", f"worker {i}", timeout=60.0)
                time.sleep(kill_controller_after)  # the point in the run to kill it at
                ctl.kill()
                ctl.wait(10)
            records: list[dict[str, Any]] = []
            for i, p in enumerate(workers_procs):
                try:
                    code = p.wait(timeout=60 + steps * 30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    raise RuntimeError(f"worker {i} did not finish") from None
                if code != 0:
                    err = p.stderr.read() if p.stderr else ""
                    raise RuntimeError(f"worker {i} failed ({code}): {err[-2000:]}")
                records += json.loads(Path(f"{tmp}/w{i}.json").read_text())
            wall = time.monotonic() - started
            if at_end is not None:
                at_end(info)
        finally:
            for proc in (*[p for r, p in procs.items()
                           if r not in ("controller", "server", "etcd")],
                         ctl, srv, *([procs["etcd"]] if "etcd" in procs else [])):
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
    return summarise(policy, records, wall), records


def member_order(records: list[dict[str, Any]], decision_log: Path) -> dict[tuple[int, int], int]:
    """(seed, step) -> index of that update in its group at the aggregator,
    from the controller's decision log: the controller numbers requests as
    they come, and a worker asks for its steps in order, so its k-th request
    id is its step k."""
    ids: dict[str, list[int]] = {}
    index: dict[int, int] = {}
    for line in decision_log.read_text().splitlines():
        ev = json.loads(line)
        if ev.get("event") in ("go", "drop"):
            ids.setdefault(ev["host"], []).append(ev["id"])
            if ev.get("via") is not None:
                index[ev["id"]] = ev["index"]
    out = {}
    for r in records:
        tid = sorted(ids.get(r["host"], []))[r["step"]] if r["step"] < len(
            ids.get(r["host"], [])) else None
        if tid is not None and tid in index:
            out[(r["seed"], r["step"])] = index[tid]
    return out


def replay(records: list[dict[str, Any]], init: dict[str, np.ndarray], momentum: float,
           scale: float, order: dict[tuple[int, int], int] | None = None
           ) -> tuple[dict[str, np.ndarray], int, int]:
    """Redo a run's applied sequence in numpy (`aggregation.apply_aggregate`,
    the reference of the server's rule) from the records of workers that
    pushed seeded updates: applied updates in version order, those that
    share an outcome version forming one aggregate (one momentum step with
    their sum, version + k), the others single steps. Members of an
    aggregate are summed in the aggregator's order (their index in the
    group) when `order` ((seed, step) -> index, `member_order`) has them,
    else in (seed, step) order, which float32 rounding covers. Raises AssertionError unless the
    applied updates occupy versions 1..V exactly once (nothing applied twice,
    nothing missing). Returns (weights, final version V, steps)."""
    from ..scheduling.aggregation import apply_aggregate

    by_version: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        if r["applied"]:
            by_version.setdefault(r["version"], []).append(r)
    w = {n: a.copy() for n, a in init.items()}
    w_prev = {n: a.copy() for n, a in init.items()}
    version = 0
    steps = 0
    for v in sorted(by_version):
        members = sorted(by_version[v], key=lambda r: (
            (order or {}).get((r["seed"], r["step"]), 0), r["seed"], r["step"]))
        if v - len(members) != version:
            raise AssertionError(f"the applied updates do not occupy versions 1..V once each: "
                                 f"{len(members)} at version {v} after version {version}")
        ups = [(seeded_update(init, r["seed"], r["step"], scale), 0) for r in members]
        w, w_prev, version, _ = apply_aggregate(w, w_prev, version, ups, momentum)
        steps += 1
    return w, version, steps


if __name__ == "__main__":
    sys.exit(worker_main())
