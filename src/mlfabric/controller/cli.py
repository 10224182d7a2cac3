"""`mlfabric controller`: order one job's transfers until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import logging
import math
import os

from ..client.core import parse_address
from ..coordination.etcd import EtcdClient, EtcdError, parse_endpoints
from ..coordination.leases import ShardLeases
from ..errors import ConfigError
from ..replication.divergence import DEFAULT_LAG_TIMEOUT, DivergenceGate
from ..replication.failover import DEFAULT_GAP_TIMEOUT
from ..runtime import loop, memory
from ..runtime.metrics import ControllerMetrics, serve_metrics
from ..scheduling.aggregation import AggregationConfig
from ..scheduling.plan import POLICIES, Network, Policy, fifo_policy
from ..transport import tls
from ..transport.listener import (
    MAX_TAU_MAX,
    add_listener_arguments,
    add_metrics_arguments,
    check_count,
    check_metrics_host,
    check_momentum,
    check_port,
    check_positive,
    handshake_timeout,
    job_name,
    listen,
    parse_tau_max,
    stop_on_signals,
)
from ..wire import auth
from ..wire.agent_auth import load_job_key
from ..wire.protocol import MAX_FAN_IN
from .controller import Controller
from .directives import DecisionFile

log = logging.getLogger("mlfabric.controller")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_listener_arguments(p, "workers")
    p.add_argument("--tau-max", type=int, default=16, metavar="N",
                   help=f"staleness bound in versions for deadlines, 0..{MAX_TAU_MAX}; -1 "
                        f"for none (default: 16; use the server's value)")
    p.add_argument("--policy", choices=POLICIES, default="mlfabric",
                   help="mlfabric: shortest-transfer-first with deadlines and drops; fifo: "
                        "every update goes at once (the plain asynchronous PS baseline)")
    p.add_argument("--overload", choices=("stalest", "deadline"), default="stalest",
                   help="mlfabric policy, when not every pending update can meet its deadline: "
                        "drop the stalest ones (default) or the ones whose deadline passes, "
                        "forcing the rest in at delay tau_max (docs/scheduling.md)")
    p.add_argument("--idle-factor", default="1", metavar="X|off",
                   help="mlfabric policy: drop an update forced in at tau_max when the "
                        "server would wait for it longer than X times the transfers it "
                        "displaces (default: 1, the design brief's rule; larger drops "
                        "less; off: never for that reason; docs/scheduling.md)")
    p.add_argument("--compression", default="adaptive", metavar="off|adaptive|fixed:CODEC",
                   help="mlfabric policy, for workers that offer compressed forms of their "
                        "updates (compression=\"adaptive\"): adaptive sends each whole "
                        "unless the plan would drop it, then with the least compression "
                        "that lets it go; fixed:CODEC (e.g. fixed:fp16) always that one; off "
                        "always whole (default: adaptive; docs/scheduling.md)")
    p.add_argument("--link", action="append", default=[], metavar="HOST=UP[/DOWN]",
                   help="a host's uplink and downlink capacity in Mbit/s (repeat per host)")
    p.add_argument("--default-link-mbit", type=float, default=1000.0, metavar="M",
                   help="capacity assumed for hosts without --link (default: 1000)")
    p.add_argument("--agent", action="append", default=[], metavar="HOST=ADDR:PORT",
                   help="poll the agent on HOST (a name used in --link and by workers) at "
                        "ADDR:PORT for measured bandwidth (repeat per host)")
    p.add_argument("--agents-dns", metavar="NAME:PORT", default=None,
                   help="poll an agent at every address NAME resolves to, on PORT, each "
                        "named by its IP as a node's agent names itself (on Kubernetes: the "
                        "agents' headless Service, mlfabric-agent.mlfabric.svc:7400); NAME is "
                        "resolved again every --agent-rediscover seconds, so agents of nodes "
                        "that join are polled (default: none, only --agent)")
    p.add_argument("--agent-rediscover", type=float, default=30.0, metavar="SECONDS",
                   help="with --agents-dns: seconds between lookups of NAME (default: 30)")
    p.add_argument("--agent-key-file", metavar="PATH",
                   help="the job's key for the agents' API (needed with --agent and "
                        "--agents-dns; the operator makes it: `mlfabric token agent-key`)")
    p.add_argument("--agent-interval", type=float, default=0.5, metavar="SECONDS",
                   help="seconds between polls of each agent (default: 0.5)")
    p.add_argument("--aggregator", action="append", default=[], metavar="HOST=ADDR:PORT",
                   help="mlfabric policy: route groups of consecutive updates through the "
                        "aggregator of the agent on HOST (mlfabric agent --aggregate ADDR:PORT), "
                        "which sums them and forwards one update (repeat per host)")
    p.add_argument("--max-fan-in", type=int, default=8, metavar="K",
                   help="most updates summed into one aggregate (default: 8)")
    p.add_argument("--hold-groups", action=argparse.BooleanOptionalAction, default=True,
                   help="with --aggregator: keep the last group of the order waiting for more "
                        "members while its aggregate would still reach the server in time "
                        "(larger groups; with --no-hold-groups a group goes as soon as two "
                        "updates wait) (default: on)")
    p.add_argument("--group-wait", type=float, default=0.0, metavar="SECONDS",
                   help="with --aggregator: how long the server's downlink may wait for an "
                        "aggregate, to get larger groups; with --hold-groups a group (or a lone "
                        "update) is also held this long after its first member asked, unless "
                        "it fills up (set --max-fan-in to the number of workers). 0 keeps the "
                        "design's rule that aggregation never stalls the server (default: 0)")
    p.add_argument("--rescue-drops", action=argparse.BooleanOptionalAction, default=True,
                   help="with --aggregator: an update the policy would drop because the "
                        "server's downlink is overloaded joins an aggregate that goes anyway, "
                        "when it meets its deadline there and delays no other past its own "
                        "(default: on)")
    p.add_argument("--chunks", action=argparse.BooleanOptionalAction, default=True,
                   help="let a sharded job's parts go a chunk at a time (the partition's "
                        "--chunk-bytes, at least 256 KiB), so that a shorter transfer can "
                        "pass a long one between two of its chunks; --no-chunks plans each "
                        "part whole (default: on)")
    p.add_argument("--div-max", type=float, default=None, metavar="X",
                   help="worker-driven replication: keep a bound on ||w_server - w_replica||_2 "
                        "at most X by holding server transfers until the replica catches up "
                        "(workers connect with replica=...; needs --momentum). With shards "
                        "(several --server), each shard's part is kept within X/sqrt(S), so "
                        "the whole model stays within X")
    p.add_argument("--momentum", type=float, default=None, metavar="G",
                   help="the server's momentum gamma, for the divergence bound (--div-max)")
    p.add_argument("--server", metavar="HOST:PORT[,...]", default=None,
                   help="failover: send heartbeats to the server here, and when it stops "
                        "answering promote --replica and tell the workers (needs --replica); "
                        "for a sharded job every shard's server, in shard order: losing one "
                        "moves only that shard to its replica")
    p.add_argument("--replica", metavar="HOST:PORT[,...]", default=None,
                   help="failover: the replica to promote (mlfabric server --role replica); "
                        "for a sharded job one per shard, in shard order")
    p.add_argument("--heartbeat-interval", type=float, default=0.2, metavar="SECONDS",
                   help="seconds between heartbeats to the server (default: 0.2)")
    p.add_argument("--heartbeat-timeout", type=float, default=1.0, metavar="SECONDS",
                   help="silence after which the server is declared lost (default: 1.0)")
    p.add_argument("--replica-gap-timeout", type=float, default=DEFAULT_GAP_TIMEOUT,
                   metavar="SECONDS",
                   help="with --server/--replica: a replica that has waited this long for an "
                        "update that will not come (its worker died after the server applied "
                        f"it) is resynced from the server's state (default: "
                        f"{DEFAULT_GAP_TIMEOUT})")
    p.add_argument("--replica-lag-timeout", type=float, default=DEFAULT_LAG_TIMEOUT,
                   metavar="SECONDS",
                   help="with --div-max: after holding server transfers this long with no "
                        "progress of the replica, let them go without the bound until it "
                        f"catches up, rather than stall the job (default: {DEFAULT_LAG_TIMEOUT})")
    g = p.add_argument_group(
        "several controllers", "each plans some of the job's server shards; who plans which "
        "is held in etcd under leases, and a controller's shards move to another when it is "
        "gone (docs/guide/deploying.md)")
    g.add_argument("--etcd", metavar="URL[,URL...]", default=None,
                   help="the etcd cluster holding the job's shard leases, e.g. "
                        "http://10.0.0.2:2379 (default: none: this is the job's only "
                        "controller and plans every shard)")
    g.add_argument("--etcd-cert", default=None, metavar="FILE",
                   help="with an https:// --etcd: this controller's client certificate for "
                        "etcd (PEM; with --etcd-key and --etcd-ca; default: --tls-cert, "
                        "--tls-key and --tls-ca)")
    g.add_argument("--etcd-key", default=None, metavar="FILE",
                   help="the private key of --etcd-cert (PEM)")
    g.add_argument("--etcd-ca", default=None, metavar="FILE",
                   help="the CA that signed etcd's server certificate (PEM)")
    g.add_argument("--controllers", metavar="HOST:PORT,...", default=None,
                   help="with --etcd: every controller of the job, as the workers reach them "
                        "and in the order the workers are given them (their `controller` "
                        "setting); shard s is first offered to the (s mod N)-th")
    g.add_argument("--advertise", metavar="HOST:PORT", default=None,
                   help="with --etcd: this controller's entry in --controllers (default: the "
                        "--listen address)")
    g.add_argument("--shards", type=int, default=None, metavar="S",
                   help="with --etcd: the job's number of server shards (default: the number "
                        "of --server addresses, else 1: one server, with the other "
                        "controllers standing by)")
    g.add_argument("--lease-ttl", type=int, default=2, metavar="SECONDS",
                   help="with --etcd: the lease under which this controller holds its shards; "
                        "a controller that dies keeps them about this long (plus up to 0.75 s "
                        "for etcd's sweep and the next read) before another takes them over. "
                        "etcd grants at least 1.5 election timeouts (default: 2)")
    p.add_argument("--decision-log", metavar="PATH", default=None,
                   help="append one JSON line per decision to this file (without it, "
                        "decisions are not logged)")
    add_metrics_arguments(p)


def parse_links(specs: list[str], default_mbit: float) -> Network:
    """--link HOST=UP[/DOWN] (Mbit/s) -> a Network in bytes per second."""
    check_positive("--default-link-mbit", default_mbit, "Mbit/s")
    up: dict[str, float] = {}
    down: dict[str, float] = {}
    for spec in specs:
        host, sep, rates = spec.partition("=")
        try:
            parts = [float(x) for x in rates.split("/")] if sep else []
        except ValueError:
            parts = []
        # not (0 < x < inf): NaN and inf are no capacity either
        if not host or len(parts) not in (1, 2) or not all(0 < x < math.inf for x in parts):
            raise ConfigError(
                f"--link {spec!r}: expected HOST=UP or HOST=UP/DOWN in Mbit/s, e.g. "
                f"10.0.0.5=1000/400")
        up[host] = parts[0] * 1e6 / 8
        down[host] = parts[-1] * 1e6 / 8
    return Network(default=default_mbit * 1e6 / 8, up=up, down=down)


def parse_agents(specs: list[str], flag: str = "--agent") -> dict[str, tuple[str, int]]:
    agents = {}
    for spec in specs:
        host, sep, addr = spec.partition("=")
        if not host or not sep:
            raise ConfigError(f"{flag} {spec!r}: expected HOST=ADDR:PORT, e.g. "
                              f"10.0.0.5=10.0.0.5:7400")
        agents[host] = parse_address(addr)
    return agents


def decision_log(path: str) -> DecisionFile:
    """The handler appending to --decision-log, or a one-line error naming
    the path (issue 33: a folder that did not exist was a traceback)."""
    try:
        return DecisionFile(path)
    except OSError as exc:
        folder = os.path.dirname(path) or "."
        if not os.path.isdir(folder):
            raise ConfigError(f"--decision-log {path!r}: the folder {folder!r} does not "
                              f"exist; create it or give a path in one that does") from None
        raise ConfigError(f"--decision-log {path!r} cannot be opened for appending: "
                          f"{exc.strerror}") from None


def parse_idle_factor(text: str) -> float | None:
    """--idle-factor: a number >= 0, or "off" (None: the rule is off)."""
    if text.strip().lower() == "off":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise ConfigError(f"--idle-factor must be a number >= 0 or 'off', got {text!r}")
    return value


def make_policy(name: str, overload: str = "stalest",
                idle_factor: float | None = 1.0, compression: str = "adaptive") -> Policy:
    if name == "fifo":
        return fifo_policy
    try:
        from ..scheduling.policies import Mlfabric
    except ImportError as exc:  # pragma: no cover - the module ships with the package
        raise ConfigError(f"policy 'mlfabric' is unavailable: {exc}") from None
    return Mlfabric(overload=overload, idle_factor=idle_factor, compression=compression)


def parse_compression_mode(text: str) -> str:
    """--compression: off, adaptive or fixed:CODEC, with a codec that exists."""
    from ..compression import parse
    from ..scheduling.policies import check_compression

    try:
        mode = check_compression(text.strip())
    except ValueError as exc:
        raise ConfigError(f"--compression: {exc}") from None
    if mode.startswith("fixed:"):
        try:
            parse(mode.partition(":")[2])
        except ConfigError as exc:
            raise ConfigError(f"--compression {text}: {exc}") from None
    return mode


def check_numbers(args: argparse.Namespace) -> None:
    """Every numeric flag within its range, whether or not the feature it
    tunes is on (issue 33): a wrong value is an error, never silently unused."""
    check_positive("--agent-interval", args.agent_interval)
    check_positive("--agent-rediscover", args.agent_rediscover)
    parse_idle_factor(args.idle_factor)
    parse_compression_mode(args.compression)
    check_count("--max-fan-in", args.max_fan_in, 2, MAX_FAN_IN)
    if not 0 <= args.group_wait < math.inf:
        raise ConfigError(f"--group-wait must be a finite number of seconds >= 0 (0: "
                          f"aggregation never stalls the server), got {args.group_wait}")
    if args.div_max is not None:
        check_positive("--div-max", args.div_max, "")
    check_momentum("--momentum", args.momentum)
    check_positive("--heartbeat-interval", args.heartbeat_interval)
    check_positive("--heartbeat-timeout", args.heartbeat_timeout)
    if not args.heartbeat_interval < args.heartbeat_timeout:
        raise ConfigError(f"--heartbeat-interval must be below --heartbeat-timeout "
                          f"({args.heartbeat_timeout}), got {args.heartbeat_interval}")
    check_positive("--replica-gap-timeout", args.replica_gap_timeout)
    check_positive("--replica-lag-timeout", args.replica_lag_timeout)
    check_port("--metrics-port", args.metrics_port)
    check_metrics_host(args.metrics_port, args.metrics_host)


def coordination(args: argparse.Namespace, servers: list[str]) -> ShardLeases | None:
    """The shard leases --etcd asks for, checked; None without --etcd."""
    given = [f for f, v in (("--controllers", args.controllers), ("--advertise", args.advertise),
                            ("--shards", args.shards), ("--etcd-cert", args.etcd_cert),
                            ("--etcd-key", args.etcd_key), ("--etcd-ca", args.etcd_ca))
             if v is not None]
    if args.etcd is None:
        if given:
            raise ConfigError(f"{' and '.join(given)} only appl{'y' if len(given) > 1 else 'ies'} "
                              f"with --etcd URL (several "
                              f"controllers); without it this is the job's only controller")
        return None
    if args.controllers is None:
        raise ConfigError("--etcd needs --controllers HOST:PORT,...: every controller of the "
                          "job, as the workers are given them")
    controllers = [a.strip() for a in args.controllers.split(",") if a.strip()]
    for address in controllers:
        parse_address(address)
    me = args.advertise or args.listen
    host, _ = parse_address(me)
    if host in ("", "0.0.0.0", "::"):
        raise ConfigError(f"--listen {args.listen} is no address workers can dial: give "
                          f"--advertise HOST:PORT, this controller's entry in --controllers")
    shards = args.shards if args.shards is not None else max(len(servers), 1)
    endpoints, secure = parse_endpoints(args.etcd)
    names = ("--etcd-cert", "--etcd-key", "--etcd-ca")
    files = tls.files(args.etcd_cert, args.etcd_key, args.etcd_ca, names)
    if files is None and secure:
        names = tls.FLAGS
        files = tls.files(args.tls_cert, args.tls_key, args.tls_ca)
    if secure and files is None:
        raise ConfigError(f"--etcd {args.etcd} is https: give this controller's client "
                          f"certificate for it, --etcd-cert, --etcd-key and --etcd-ca (or "
                          f"--tls-cert, --tls-key and --tls-ca)")
    if files is not None and not secure:
        raise ConfigError(f"--etcd {args.etcd} is plain http, but {names[0]} was given: "
                          f"give etcd's https:// client URLs")
    context = tls.client_context(files, names) if files is not None else None
    return ShardLeases(EtcdClient(endpoints, tls=context), job=args.job, me=me,
                       controllers=controllers, shards=shards, ttl=args.lease_ttl)


def planning(leases: ShardLeases) -> str:
    return f", planning shards {sorted(leases.owned)} of {leases.shards} (etcd)"


def run(args: argparse.Namespace) -> int:
    host, port = parse_address(args.listen)
    check_numbers(args)
    token = auth.load_token(args.token_file)
    tau_max = parse_tau_max(args.tau_max)
    job_name(args.job)
    network = parse_links(args.link, args.default_link_mbit)
    shake = handshake_timeout(args)
    # The client context is also this process's: the failover monitor's
    # heartbeats to the servers and replicas go over TLS too.
    secured = tls.from_args(args)
    agents = parse_agents(args.agent)
    agents_dns = None
    if args.agents_dns is not None:
        try:
            agents_dns = parse_address(args.agents_dns)
        except ConfigError as exc:
            raise ConfigError(f"--agents-dns: {exc}: the agents' name and port, e.g. "
                              f"mlfabric-agent.mlfabric.svc:7400") from None
    if agents_dns is not None and agents_dns[1] == 0:
        raise ConfigError(f"--agents-dns {args.agents_dns}: give the agents' port (7400 "
                          f"unless their --listen says otherwise)")
    agent_key = None
    if agents or agents_dns:
        flag = "--agent" if agents else "--agents-dns"
        if not args.agent_key_file:
            raise ConfigError(f"{flag} needs --agent-key-file PATH: the agents serve only "
                              "clients that log in; the operator makes the job's key with "
                              "`mlfabric token agent-key --cluster-token-file FILE --job "
                              f"{args.job} KEYFILE`")
        agent_key = load_job_key(args.agent_key_file)
        if agent_key.job != args.job:
            raise ConfigError(f"--agent-key-file {args.agent_key_file!r} is job "
                              f"{agent_key.job!r}'s key, not job {args.job!r}'s: make this "
                              f"job's with `mlfabric token agent-key --job {args.job}`")
    policy = make_policy(args.policy, args.overload, parse_idle_factor(args.idle_factor),
                         parse_compression_mode(args.compression))
    aggregators = {h: f"{a}:{p}" for h, (a, p) in
                   parse_agents(args.aggregator, "--aggregator").items()}
    if aggregators and args.policy != "mlfabric":
        raise ConfigError(f"--aggregator needs --policy mlfabric (got {args.policy}): "
                          f"aggregation groups the mlfabric policy's order")
    aggregation = AggregationConfig(max_fan_in=args.max_fan_in, hold=args.hold_groups,
                                    wait=args.group_wait, rescue=args.rescue_drops)
    if (args.server is None) != (args.replica is None):
        raise ConfigError("failover needs both --server HOST:PORT and --replica HOST:PORT")
    servers: list[str] = []
    replicas: list[str] = []
    if args.server is not None:
        servers = [a.strip() for a in args.server.split(",")]
        replicas = [a.strip() for a in args.replica.split(",")]
        for address in (*servers, *replicas):
            parse_address(address)
        if len(servers) != len(replicas):
            raise ConfigError(f"--server names {len(servers)} server(s) and --replica "
                              f"{len(replicas)} replica(s): give one replica per shard's "
                              f"server, in shard order")
    if args.etcd is not None and args.div_max is not None and not servers:
        raise ConfigError("--etcd with --div-max needs --server and --replica (one of each "
                          "per shard, in shard order): with several controllers, each bounds "
                          "the shards it plans from their servers' and replicas' heartbeats")
    gate = None
    if args.div_max is not None:
        if args.momentum is None:
            raise ConfigError("--div-max needs --momentum G, the server's momentum (the bound "
                              "depends on it)")
        gate = DivergenceGate(args.momentum, args.div_max, lag_timeout=args.replica_lag_timeout)
        if args.server is None:
            log.warning("--div-max without --server/--replica: the divergence gate learns "
                        "applied updates only from the workers that pushed them, and a replica "
                        "waiting for a lost update is not resynced (it is given up after "
                        "--replica-lag-timeout)")
    leases = coordination(args, servers)
    # One JSON line per decision goes to --decision-log, and without it
    # nowhere: at the default --log-level INFO, every go was also written
    # to stderr (15.6 us each, up to 125 in a decision at 10,000 workers).
    decisions = logging.getLogger("mlfabric.decisions")
    decisions.propagate = False
    if args.decision_log:
        decisions.addHandler(decision_log(args.decision_log))
        decisions.setLevel(logging.INFO)
    # Re-plans allocate and free the same link-sized arrays on every event:
    # keep their pages (runtime.memory says what it saves).
    memory.reuse_freed_blocks()
    metrics = ControllerMetrics()
    metrics_url = None
    if args.metrics_port is not None:
        # by default where the workers are served: --listen 127.0.0.1 keeps them local
        metrics_url = serve_metrics(metrics.registry, args.metrics_port,
                                    args.metrics_host or host)

    async def main() -> None:
        controller = Controller(policy, job=args.job, token=token, tau_max=tau_max,
                                handshake_timeout=shake,
                                network=network, metrics=metrics, policy_name=args.policy,
                                gate=gate, aggregators=aggregators,
                                aggregation=aggregation)
        controller.state.chunks = args.chunks
        controller.tls = None if secured is None else secured[0]
        stopped = stop_on_signals()  # before the "serving" line: see stop_on_signals
        if leases is not None:
            try:
                await controller.coordinate(leases)
            except EtcdError as exc:
                raise ConfigError(f"--etcd {args.etcd}: {exc}; start etcd or give its client "
                                  f"URL") from None
        bound = await listen(controller, host, port, args.listen)
        if agents:
            assert agent_key is not None
            controller.watch_agents(agents, agent_key, args.agent_interval)
        if agents_dns is not None:
            assert agent_key is not None
            controller.discover_agents(*agents_dns, agent_key, args.agent_interval,
                                       args.agent_rediscover)
        if servers:
            controller.watch_servers(servers, replicas, interval=args.heartbeat_interval,
                                     timeout=args.heartbeat_timeout,
                                     gap_timeout=args.replica_gap_timeout)
        print(f"mlfabric controller: serving job {args.job!r} on {bound[0]}:{bound[1]} "
              f"(policy {args.policy}, tau_max {tau_max}"
              f"{'' if gate is None else f', div_max {gate.div_max}'}"
              f"{f', {len(aggregators)} aggregators' if aggregators else ''}"
              f"{'' if leases is None else planning(leases)}"
              f"{tls.describe(controller.tls)}"
              f"{'' if metrics_url is None else f', metrics {metrics_url}'})", flush=True)
        await stopped.wait()
        await controller.close()
        print("mlfabric controller: stopped", flush=True)

    loop.run(main())
    return 0
