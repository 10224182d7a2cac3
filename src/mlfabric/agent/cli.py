"""`mlfabric agent`: run the per-host bandwidth agent until SIGINT/SIGTERM.

Peers come from `--peer NAME=HOST:PORT` flags and/or a JSON `--config` file::

    {"name": "h0", "listen": "10.0.0.1:7400", "metrics_port": 9470,
     "probe_budget": 0.02, "stale_after": 3.0, "interface": "eth0",
     "peers": {"h1": "10.0.0.2:7400", "h2": "10.0.0.3:7400"}}

Flags override the file. The controller can replace the peer list later
(`SetPeers` on the agent's port). With `--tls-cert/--tls-key/--tls-ca` (or
the keys `tls_cert`, `tls_key`, `tls_ca`) the agent's port, and its
aggregator's, take mutual TLS only, and its probe sessions to peers are TLS.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import math
import signal
import socket
import ssl
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..transport import tls
from ..transport.listener import (
    add_handshake_timeout,
    add_metrics_arguments,
    check_metrics_host,
    handshake_timeout,
)
from ..transport.tls import add_tls_arguments
from ..wire import auth
from .daemon import (
    Agent,
    AgentConfig,
    parse_hostport,
    parse_peer,
    read_net_dev,
    read_nic_speed,
)
from .destinations import Destinations, split_servers
from .estimator import ProbeConfig
from .job_traffic import JobTrafficReader

log = logging.getLogger("mlfabric.agent")

#: Keys of the JSON --config file -> the flag each stands for (flags win).
CONFIG_KEYS = {
    "name": "--name",
    "cluster_token_file": "--cluster-token-file",
    "listen": "--listen",
    "peers": "--peer",  # an object {"NAME": "HOST:PORT", ...}
    "metrics_port": "--metrics-port",
    "probe_budget": "--probe-budget",
    "stale_after": "--stale-after",
    "interface": "--interface",
    "nic_mbit": "--nic-mbit",
    "job_ports": "--job-port",  # a list of port numbers
    "job_rediscover": "--job-rediscover",
    "aggregate": "--aggregate",
    "servers": "--servers",  # "HOST:PORT,HOST:PORT" or a list of "HOST:PORT"
    "job": "--job",
    "token_file": "--token-file",
    "group_timeout": "--group-timeout",
    "tls_cert": "--tls-cert",
    "tls_key": "--tls-key",
    "tls_ca": "--tls-ca",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", help="this host's name among its peers (default: hostname)")
    p.add_argument("--listen", metavar="HOST:PORT",
                   help="TCP control + UDP probe address (default 0.0.0.0:7400)")
    p.add_argument("--cluster-token-file", metavar="PATH",
                   help="the cluster's token (required): every agent of the cluster holds "
                        "it; peers and the operator log in with it, and each job's agent key "
                        "is derived from it (`mlfabric token agent-key`)")
    p.add_argument("--peer", action="append", default=[], metavar="NAME=HOST:PORT",
                   help="a peer agent to probe (repeatable)")
    p.add_argument("--config", type=Path, metavar="FILE",
                   help="JSON config file (keys as in deploy/README.md)")
    add_metrics_arguments(p)
    p.add_argument("--probe-budget", type=float, metavar="FRACTION",
                   help="max fraction of each link spent on probes (default 0.02)")
    p.add_argument("--stale-after", type=float, metavar="SECONDS",
                   help="an estimate older than this is reported stale (default 3)")
    p.add_argument("--interface", metavar="NAME",
                   help="NIC whose byte counters give the load on this host's links "
                        "(default: all but loopback)")
    p.add_argument("--nic-mbit", type=float, metavar="MBIT",
                   help="the physical limit of this host's link, Mbit/s: no estimate is "
                        "reported above it and a transfer report above it is refused "
                        "(default: the NIC's speed as the kernel reports it, else none)")
    p.add_argument("--job-port", type=int, action="append", default=[], metavar="PORT",
                   help="a port of the job's servers (parameter server, replica); TCP "
                        "traffic to or from it is the job's own and not counted as load on "
                        "this host's links (repeatable; --aggregate adds its own port)")
    p.add_argument("--job-rediscover", type=float, metavar="SECONDS",
                   help="how often every TCP socket is listed to find the job's new "
                        "connections (default 1); in between the known ones are looked up "
                        "one by one, which costs far less CPU; 0: list them at every load "
                        "reading")
    p.add_argument("--aggregate", metavar="HOST:PORT",
                   help="also act as the job's aggregator on this address: sum the updates "
                        "the controller routes here and forward one aggregate to the server "
                        "(needs --job, --token-file and --servers)")
    p.add_argument("--servers", action="append", metavar="HOST:PORT[,HOST:PORT...]",
                   help="with --aggregate (required): every server the aggregator may "
                        "forward to: the job's parameter server or shards, and their "
                        "replicas, as the workers and the controller name them; a member "
                        "bound for any other address is refused and nothing is dialled "
                        "(repeatable)")
    p.add_argument("--job", help="the job whose updates are aggregated (with --aggregate)")
    p.add_argument("--token-file", metavar="PATH",
                   help="the job's token file (with --aggregate)")
    add_handshake_timeout(p, "the aggregator's peers (with --aggregate)")
    add_tls_arguments(p, "the agent's peers and clients (and the aggregator's, with "
                         "--aggregate)")
    # None: not given (the agent's own port has no handshake; the flag needs --aggregate)
    p.set_defaults(handshake_timeout=None)
    p.add_argument("--group-timeout", type=float, metavar="SECONDS",
                   help="with --aggregate: seconds from a group's first member after which "
                        "the members in are forwarded and the rest go straight to the server; "
                        "if all had begun (their sum is already streaming to the server), all "
                        "go straight to it (default 2)")
    p.add_argument("--loop", choices=["uvloop", "asyncio"], default=None,
                   help="event loop (default: uvloop when installed)")


def _pick(flag: Any, file: dict[str, Any], key: str, default: Any = None) -> Any:
    """A setting: the flag if given, else the config file's key, else the default."""
    return flag if flag is not None else file.get(key, default)


def _is_number(value: Any) -> bool:
    """An int or a float; not a bool, which JSON's true would otherwise pass as 1."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_port(value: Any) -> bool:
    """A TCP port number, 1..65535 (an int; not a bool)."""
    return _is_number(value) and isinstance(value, int) and 0 < value <= 65535


def _load_file(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read agent config {str(path)!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"agent config {str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"agent config {str(path)!r} must be a JSON object")
    unknown = set(data) - set(CONFIG_KEYS)
    if unknown:
        raise ConfigError(
            f"agent config {str(path)!r} has unknown keys {sorted(unknown)}; "
            f"known keys: {sorted(CONFIG_KEYS)}"
        )
    return data


@dataclass(frozen=True)
class AggregateConfig:
    """The agent's aggregator (--aggregate)."""

    host: str
    port: int
    job: str
    token: bytes
    group_timeout: float
    servers: tuple[str, ...]  # where aggregates may go (--servers)
    handshake_timeout: float = 10.0
    tls: ssl.SSLContext | None = None  # the aggregator listener's (--tls-*)


def build_aggregate(args: argparse.Namespace, file: dict[str, Any]) -> AggregateConfig | None:
    address = args.aggregate or file.get("aggregate")
    job = args.job or file.get("job")
    token_file = args.token_file or file.get("token_file")
    timeout = _pick(args.group_timeout, file, "group_timeout", 2.0)
    servers = _pick(args.servers, file, "servers")
    if address is None:
        if (job is not None or token_file is not None or args.group_timeout is not None
                or args.handshake_timeout is not None or servers is not None):
            raise ConfigError("--job, --token-file, --servers, --group-timeout and "
                              "--handshake-timeout belong to --aggregate HOST:PORT (the "
                              "agent's aggregator); give it too")
        return None
    if not isinstance(address, str):
        raise ConfigError(f"aggregate must be a \"HOST:PORT\" string, got {address!r}")
    host, port = parse_hostport(address, "--aggregate")
    if not job or not token_file:
        raise ConfigError(f"--aggregate {address} needs the job's --job NAME and "
                          f"--token-file PATH (the aggregator speaks to workers and the "
                          f"server with the job's token)")
    if not _is_number(timeout) or not 0 < timeout < math.inf:
        raise ConfigError(f"group timeout must be a positive number of seconds, got {timeout!r}")
    if servers is None:
        # Secure by default (issue 33): without a list, any member could
        # make the aggregator dial any address with the job's token.
        raise ConfigError(f"--aggregate {address} needs --servers HOST:PORT[,HOST:PORT...]: "
                          f"the job's servers (shards and replicas too) as the workers name "
                          f"them; the aggregator forwards to no other address")
    allowed = Destinations(split_servers(servers, "servers"), "--servers")
    # (its TLS context is the agent's: `run` sets it from build_config's)
    return AggregateConfig(host, port, str(job), auth.load_token(token_file), float(timeout),
                           allowed.addresses, handshake_timeout(args))


def build_tls(args: argparse.Namespace, file: dict[str, Any]
              ) -> tuple[ssl.SSLContext, ssl.SSLContext] | None:
    """(server context, client context) from --tls-* or the config file's
    tls_* keys (flags win), or None for plain TCP. The client context is
    also made the process's (`tls.use_for_process`): the probe sessions to
    peers and the aggregator's pushes to the server go over TLS too."""
    given = []
    for key in ("tls_cert", "tls_key", "tls_ca"):
        value = _pick(getattr(args, key, None), file, key)
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{key} in the agent config must be a file path (a string), got "
                              f"{value!r}")
        given.append(value)
    files = tls.files(given[0], given[1], given[2])
    if files is None:
        tls.use_for_process(None)
        return None
    contexts = tls.server_context(files), tls.client_context(files)
    tls.use_for_process(contexts[1])
    return contexts


def build_config(args: argparse.Namespace, aggregate: AggregateConfig | None = None
                 ) -> tuple[AgentConfig, int | None]:
    """Merge the config file and the flags into an AgentConfig (+ metrics port).
    With `aggregate`, its port is one of the job's: its traffic is not load."""
    file: dict[str, Any] = _load_file(args.config) if args.config else {}
    name = args.name or file.get("name") or socket.gethostname()
    host, port = parse_hostport(args.listen or file.get("listen") or "0.0.0.0:7400",
                                "--listen")
    peers: dict[str, tuple[str, int]] = {}
    file_peers = file.get("peers", {})
    if not isinstance(file_peers, dict):
        raise ConfigError('"peers" in the agent config must map NAME to "HOST:PORT"')
    for pname, addr in file_peers.items():
        if not isinstance(addr, str):
            raise ConfigError(f"peer {pname!r} address must be a \"HOST:PORT\" string")
        peers[pname] = parse_hostport(addr, f"peer {pname!r} address")
    for text in args.peer:
        pname, addr = parse_peer(text)
        peers[pname] = addr
    budget = _pick(args.probe_budget, file, "probe_budget", 0.02)
    if not _is_number(budget) or not 0 < budget <= 0.5:
        raise ConfigError(f"probe budget must be a fraction in (0, 0.5], got {budget!r}")
    stale = _pick(args.stale_after, file, "stale_after", 3.0)
    if not _is_number(stale) or not 0 < stale < math.inf:  # also NaN, which compares false
        raise ConfigError(f"stale-after must be a positive number of seconds, got {stale!r}")
    metrics_port = _pick(args.metrics_port, file, "metrics_port")
    if metrics_port is not None and not (_is_port(metrics_port) or metrics_port == 0):
        raise ConfigError(f"metrics port must be in 0..65535 (0 picks a free port), got "
                          f"{metrics_port!r}")
    interface = args.interface or file.get("interface")
    if interface is not None:
        check_interface(interface)
    rediscover = _pick(args.job_rediscover, file, "job_rediscover", 1.0)
    if not _is_number(rediscover) or not 0 <= rediscover <= 3600:
        raise ConfigError(f"job-rediscover must be a number of seconds in [0, 3600], "
                          f"got {rediscover!r}")
    ports = parse_job_ports(file.get("job_ports", []), args.job_port)
    if aggregate is not None and aggregate.port != 0:
        ports = sorted({*ports, aggregate.port})
    nic_mbit = _pick(args.nic_mbit, file, "nic_mbit")
    if nic_mbit is not None and (not _is_number(nic_mbit) or not 0 < nic_mbit < 1e7):
        raise ConfigError(f"nic-mbit must be the link's speed in Mbit/s, above 0, got "
                          f"{nic_mbit!r}")
    nic_bps = nic_mbit * 1e6 if nic_mbit is not None else read_nic_speed(interface)
    probe_cfg = replace(ProbeConfig(), budget=float(budget), stale_after=float(stale))
    if nic_bps is not None:
        probe_cfg = replace(probe_cfg, max_bps=min(probe_cfg.max_bps, nic_bps))
    cluster_token_file = args.cluster_token_file or file.get("cluster_token_file")
    if not cluster_token_file:
        raise ConfigError("an agent needs --cluster-token-file PATH: the cluster's secret, "
                          "which every agent holds (make it once with `mlfabric token new "
                          "cluster.token` and copy it to every host)")
    secured = build_tls(args, file)
    config = AgentConfig(name=name, cluster_token=auth.load_token(cluster_token_file),
                         host=host, port=port, peers=peers, probe=probe_cfg,
                         counters=functools.partial(read_net_dev, interface),
                         job_traffic=JobTrafficReader(ports, rediscover=float(rediscover))
                         if ports else None,
                         tls=None if secured is None else secured[0],
                         tls_client=None if secured is None else secured[1])
    return config, metrics_port


def check_interface(interface: Any) -> None:
    """--interface names a NIC of this host (in this network namespace) that
    is not loopback: otherwise its counters are never found and the agent
    reports no load at all, as if it had measured none (issue 33)."""
    if not isinstance(interface, str):
        raise ConfigError(f"interface must be a NIC name, got {interface!r}")
    # if_nameindex lists this network namespace's, as read_net_dev reads them
    names = sorted(name for _, name in socket.if_nameindex() if name != "lo")
    if interface not in names:
        why = "is loopback, which carries none of the links' traffic" if interface == "lo" \
            else "does not exist on this host"
        have = ", ".join(names) if names else "none but loopback"
        raise ConfigError(f"interface {interface!r} {why}; this host's interfaces: {have} "
                          f"(or leave --interface out to count them all)")


def parse_job_ports(from_file: Any, from_flags: list[int]) -> list[int]:
    if not isinstance(from_file, list):
        raise ConfigError(f'"job_ports" in the agent config must be a list of port numbers, '
                          f"got {from_file!r}")
    values = [*from_file, *from_flags]
    for v in values:
        if not _is_port(v):
            raise ConfigError(f"job port must be a port number in 1..65535, got {v!r}")
    return sorted(set(values))


async def serve(config: AgentConfig, metrics_port: int | None = None,
                metrics_host: str | None = None,
                aggregate: AggregateConfig | None = None) -> None:
    """Run an agent (and its aggregator) until SIGINT/SIGTERM (or cancellation)."""
    from ..runtime.metrics import AgentMetrics, AggregatorMetrics, serve_metrics
    from .aggregator import Aggregator

    metrics = AgentMetrics()
    agent = Agent(config, metrics=metrics)
    aggregator = None if aggregate is None else Aggregator(
        job=aggregate.job, token=aggregate.token, servers=aggregate.servers,
        group_timeout=aggregate.group_timeout,
        metrics=AggregatorMetrics(metrics.registry), name=config.name,
        handshake_timeout=aggregate.handshake_timeout)
    if aggregator is not None and aggregate is not None:
        aggregator.tls = aggregate.tls
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        where = ""
        if metrics_port is not None:  # first: a port in use is refused before anything runs
            # by default on the --listen address: an agent on 127.0.0.1 keeps them local
            url = serve_metrics(metrics.registry, metrics_port, metrics_host or config.host)
            where = f" (metrics {url})"  # after the address, which scripts take as a word
        await agent.start()
        extra = ""
        if aggregator is not None and aggregate is not None:
            try:
                host, port = await aggregator.start(aggregate.host, aggregate.port)
            except OSError as exc:
                raise ConfigError(f"cannot listen on --aggregate {aggregate.host}:"
                                  f"{aggregate.port}: {exc.strerror or exc}") from None
            extra = (f"; aggregating job {aggregate.job!r} on {host}:{port}"
                     f"{tls.describe(aggregate.tls)} (forwards to "
                     f"{','.join(aggregate.servers)} only)")
        print(f"mlfabric agent {config.name} ready on {config.host}:{agent.port}{where}"
              f"{tls.describe(config.tls)}{extra}", flush=True)
        await stop.wait()
        log.info("agent %s: shutting down", config.name)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if aggregator is not None:
            await aggregator.close()
        await agent.stop()
        if isinstance(config.job_traffic, JobTrafficReader):
            config.job_traffic.close()  # its netlink socket


def run(args: argparse.Namespace) -> int:
    from ..runtime.loop import run as loop_run

    aggregate = build_aggregate(args, _load_file(args.config) if args.config else {})
    config, metrics_port = build_config(args, aggregate)
    check_metrics_host(metrics_port, args.metrics_host)
    if aggregate is not None:  # the aggregator's listener is as the agent's port
        aggregate = replace(aggregate, tls=config.tls)
    loop_run(serve(config, metrics_port, args.metrics_host, aggregate), kind=args.loop)
    return 0
