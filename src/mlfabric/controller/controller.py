"""The controller: the asyncio side of `ControlState`.

Workers ask it before sending each update (TRANSFER_REQUEST); it answers
each with a DIRECTIVE (go now, or drop with a reason) when the plan says so,
and re-plans on every event: a request, a completion (TRANSFER_DONE), a
worker gone, a planned start time reached. This module only carries the
decisions out, logs them (one JSON line per decision) and counts them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

from ..coordination.leases import ShardLeases
from ..errors import ConfigError, MlfabricError
from ..replication.divergence import DivergenceGate
from ..replication.failover import DEFAULT_GAP_TIMEOUT, FailoverMonitor
from ..replication.gate import gated, in_flight_norms
from ..runtime.metrics import ControllerMetrics
from ..scheduling import observed
from ..scheduling.aggregation import AggregationConfig, Group, aggregating
from ..scheduling.estimates import EstimateGuard, Held
from ..scheduling.plan import (
    Network,
    Policy,
    Transfer,
    fifo_policy,
    with_estimates,
    with_host_load,
)
from ..transport.listener import Endpoint, EndpointProtocol
from ..wire import roles
from ..wire.agent_auth import AgentCredential
from ..wire.protocol import (
    LANDINGS_CLIENT,
    Failover,
    FellBack,
    Landed,
    Moved,
    Pong,
    ReplicaAt,
    ReplicaDone,
    ReplicaJoin,
    ShardAt,
    Status,
    StatusRequest,
    TransferDone,
    TransferProgress,
    TransferRequest,
    Welcome,
)
from .directives import carry_out, log_decision
from .state import MAX_FIRST_ID, ControlState, Drop, Go

log = logging.getLogger("mlfabric.controller")
class Controller(Endpoint):
    role = "controller"
    log = log

    def __init__(self, policy: Policy, *, job: str, token: bytes, tau_max: int | None,
                 network: Network | None = None, metrics: ControllerMetrics | None = None,
                 handshake_timeout: float = 10.0, clock: Any = time.monotonic,
                 policy_name: str | None = None, gate: DivergenceGate | None = None,
                 aggregators: dict[str, str] | None = None,
                 aggregation: AggregationConfig | None = None) -> None:
        """`gate`: worker-driven replication with a divergence bound; server
        transfers are held back so that it stays within gate.div_max. With
        sharded servers (`watch_servers`) each shard gets a gate of its own
        with a bound of gate.div_max / sqrt(S), so that the whole model's
        divergence stays within gate.div_max (docs/design.md).
        `aggregators` (host -> "ADDR:PORT" of its agent's aggregator): the
        policy's order is grouped and routed through them (aggregation.py).
        With both, the gate wraps the grouping (it holds whole groups, each
        one step of the server: gate.py), not the other way round: grouping
        starts every member of a group at once, also ones the gate held."""
        super().__init__(job=job, token=token,
                         metrics=metrics if metrics is not None else ControllerMetrics(),
                         handshake_timeout=handshake_timeout)
        # The divergence gates, by shard (shard 0 only, for one server).
        self.gates: dict[int, DivergenceGate] = {} if gate is None else {0: gate}
        # Servers' links that report landings (`server.landings`, on_landed).
        self.landing_feeds: set[_ControllerProtocol] = set()
        # Groups formed by the plan being decided; counted once they go (the
        # gate may hold a group, and the next plan forms it afresh).
        self._formed: list[Group] = []
        # The closed loop (issue 34: order guard, rates learnt from the job's
        # own transfers) serves a plan; FIFO lets everything go at once.
        closed = policy is not fifo_policy and policy_name != "fifo"
        if aggregators:
            # A new epoch per controller: group ids stay unique across restarts.
            policy = aggregating(policy, aggregation, on_groups=self._formed.extend,
                                 epoch=secrets.randbits(24))
        if gate is not None:
            policy = gated(policy, self.gates)
        # Transfer ids (the tickets pushes carry, which servers report back
        # and name in a go's `after`) from a random start: a server may still
        # hold pushes and report landings under another controller's tickets
        # (the one that planned its shard before a hand-over in etcd, or this
        # one before a restart), and counting from 1, each would count where
        # the other did: a report that matches a transfer's ticket, shard
        # and base version would end it. From random starts below 2^39, two
        # counters meet only if they start within the ids issued between
        # them: about one in 5 million for 50,000 ids.
        self.state = ControlState(policy, tau_max=tau_max, network=network,
                                  guard_order=closed, learn_rates=closed,
                                  first_id=1 + secrets.randbelow(MAX_FIRST_ID - 1))
        self.state.aggregators = dict(aggregators or {})
        self.clock = clock
        self.policy_name = policy_name or getattr(policy, "__name__", "custom")
        self._agent_tasks: list[asyncio.Task[None]] = []
        self._named_agents: set[str] = set()  # watch_agents': discovery leaves them be
        # Which agent estimates the plans use (issue 32: one made-up spike or
        # a stale path must not steer them).
        self.estimate_guard = EstimateGuard()
        self._held_warned: dict[tuple[str, str, str], float] = {}
        self._wake: asyncio.TimerHandle | None = None
        self._soon: asyncio.Handle | None = None  # the re-plan this turn's events asked for
        self._events = 0  # events since the last re-plan
        # By shard: the server's update norms are known up to this version.
        self._norms_known: dict[int, int] = {}
        self._seen: dict[int, tuple[int, int, int]] = {}  # gate counters already counted
        # One per server watched for failover, by shard index (shard 0 for a
        # job of one server). With several controllers, only the shards this
        # one plans: a failover is one controller's decision.
        self.monitors: dict[int, FailoverMonitor] = {}
        self._watch: _Watch | None = None
        # Each shard's (server, replica) as this controller last knew them:
        # where a monitor starts when this controller takes the shard over.
        self._servers: dict[int, tuple[str, str | None]] = {}
        # Several controllers (issue 34): the shards this one holds in etcd.
        # None: the only controller, planning every shard.
        self.leases: ShardLeases | None = None
        self._closing: set[asyncio.Task[None]] = set()  # monitors of shards given up

    # -- several controllers ------------------------------------------------------

    async def coordinate(self, leases: ShardLeases) -> None:
        """Plan only the shards `leases` holds in etcd, from its first round
        (which raises EtcdError when etcd cannot be reached: at start that is
        a setting to fix, not an outage to ride out)."""
        self.leases = leases
        leases.metrics = self.metrics
        leases.on_change = self._owned_changed
        await leases.tick()
        leases.start()

    def owns(self, shard: int) -> bool:
        return self.leases is None or shard in self.leases.owned

    def _owned_changed(self, owned: frozenset[int], owners: dict[int, str]) -> None:
        """This controller's shards changed: its part of the workers' uplinks
        follows (`Network.up_share`), and links to shards it no longer plans
        are sent to their new controller."""
        assert self.leases is not None
        share = max(len(owned), 1) / self.leases.shards
        if share != self.state.network.up_share:
            self.state.set_network(replace(self.state.network, up_share=share))
            self.state.touch(None)
        for conn in list(self.connections):
            if isinstance(conn, _ControllerProtocol) and conn.shard is not None \
                    and conn.shard not in owned:
                self.move(conn, conn.shard)
        if self._watch is not None:
            self._follow_owned(owned)
        self.replan()

    def _follow_owned(self, owned: frozenset[int]) -> None:
        """Watch the servers of the shards this controller now plans, and only
        those: a shard taken over gets a monitor (and a divergence gate that
        starts over from its replica's next heartbeat); a shard lost, none."""
        assert self._watch is not None and self.leases is not None
        for shard in sorted(set(self.monitors) - owned):
            monitor = self.monitors.pop(shard)
            self._servers[shard] = (monitor.server, monitor.replica)
            self._closing.add(asyncio.get_running_loop().create_task(monitor.close()))
            self._closing = {t for t in self._closing if not t.done()}
        for shard in sorted(owned - set(self.monitors)):
            if shard >= len(self._servers):
                continue  # refused at its requests (on_request)
            gate = self.gates.get(shard)
            if gate is not None:
                self.gates[shard] = DivergenceGate(gate.gamma, gate.div_max,
                                                   lag_timeout=gate.lag_timeout)
                self._norms_known.pop(shard, None)
            # Served before: another controller planned it, so its server has
            # answered someone; its silence from now on is a loss.
            self._start_monitor(shard, serving=shard in self.leases.ever_held)

    def move(self, conn: _ControllerProtocol, shard: int) -> None:
        """Tell a worker's link that another controller plans `shard`, and
        close it (its transfers here are forgotten; the worker asks again)."""
        assert self.leases is not None
        owner = self.leases.owner(shard)
        self.metrics.links_moved.inc()
        conn.send(Moved(shard=shard, owner="" if owner == self.leases.me else owner))
        conn.close()

    # -- agents -------------------------------------------------------------------

    def watch_agents(self, agents: dict[str, tuple[str, int]], credential: AgentCredential,
                     interval: float = 0.5) -> None:
        """Poll each agent (host name -> agent address) for its estimates, logged
        in with the job's agent key (`credential`), and re-plan when the
        bandwidth picture changes."""
        for host, addr in agents.items():
            self._named_agents.add(host)
            self._watch_agent(host, addr, credential, interval)

    def _watch_agent(self, host: str, addr: tuple[str, int], credential: AgentCredential,
                     interval: float) -> asyncio.Task[None]:
        self.state.add_agent(host, f"{addr[0]}:{addr[1]}")
        task = asyncio.get_running_loop().create_task(
            self._poll_agent(host, addr, credential, interval))
        # (polls of agents no longer discovered are done: not kept forever)
        self._agent_tasks = [t for t in self._agent_tasks if not t.done()] + [task]
        return task

    def discover_agents(self, name: str, port: int, credential: AgentCredential,
                        interval: float = 0.5, every: float = 30.0,
                        resolve: Callable[[], Awaitable[set[str]]] | None = None) -> None:
        """Poll every agent at an address `name` resolves to, on `port`, each
        under its IP as its name (as the DaemonSet's agents name themselves;
        on Kubernetes `name` is a headless Service over them: the nodes'
        IPs). `name` is resolved again every `every` seconds: an agent that
        appears is polled, one that is gone is no longer (and shows
        unreachable). `resolve`: the lookup (default DNS, `getaddrinfo`)."""
        lookup = resolve or functools.partial(resolve_addresses, name, port)
        self._agent_tasks.append(asyncio.get_running_loop().create_task(
            self._discover(name, port, credential, interval, every, lookup)))

    async def _discover(self, name: str, port: int, credential: AgentCredential,
                        interval: float, every: float,
                        resolve: Callable[[], Awaitable[set[str]]]) -> None:
        polls: dict[str, asyncio.Task[None]] = {}
        failing = ""
        try:
            while True:
                try:
                    found = await resolve()
                except OSError as exc:
                    # DNS can fail for a while (a restarting resolver): poll
                    # the agents found before, and say so once per reason.
                    if str(exc) != failing:
                        log.warning("cannot resolve the agents' name %s (%s): polling the %d "
                                    "found before", name, exc, len(polls))
                    failing = str(exc)
                    found = set(polls)
                else:
                    failing = ""
                for ip in sorted(found - set(polls) - self._named_agents):
                    log.info("agent %s found at %s:%d (%s)", ip, ip, port, name)
                    polls[ip] = self._watch_agent(ip, (ip, port), credential, interval)
                for ip in sorted(set(polls) - found):  # (never a named one)
                    task = polls.pop(ip)
                    task.cancel()
                    await asyncio.wait([task], timeout=5.0)
                    self.state.agent_unreachable(ip, f"no longer an address of {name}")
                    log.info("agent %s is no longer an address of %s: not polled", ip, name)
                await asyncio.sleep(every)
        finally:
            for task in polls.values():
                task.cancel()

    async def _poll_agent(self, host: str, addr: tuple[str, int], credential: AgentCredential,
                          interval: float) -> None:
        from ..agent.daemon import AgentClient

        client = None
        while True:
            try:
                if client is None:
                    client = await AgentClient.connect(*addr, credential, timeout=2.0,
                                                       name="controller")
                est = await client.estimates()
            except (OSError, TimeoutError, MlfabricError) as exc:
                log.debug("agent %s at %s:%d: %s", host, *addr, exc)
                # errno's text: the loops word the same refusal differently.
                reason = os.strerror(exc.errno) if isinstance(exc, OSError) and exc.errno else ""
                self.state.agent_unreachable(host, reason or str(exc) or type(exc).__name__)
                if client is not None:
                    await client.close()
                client = None
                await asyncio.sleep(interval)
                continue
            reported = {e.peer: (e.bandwidth_bps / 8, e.stale or not e.connected)
                        for e in est.estimates}
            self.state.agent_reported(host, now=self.clock(), peers=len(reported),
                                      fresh=sum(not stale and rate > 0
                                                for rate, stale in reported.values()))
            measured, held = self.estimate_guard.update(host, reported, self.clock())
            self._held_estimates(held)
            network = with_host_load(with_estimates(self.state.network, host, measured),
                                     host, est.down_load_bps / 8, est.up_load_bps / 8)
            if network != self.state.network:
                self.state.set_network(network)
                for (src, dst), rate in network.pair.items():
                    if src == host:
                        self.metrics.bandwidth.labels(src, dst).set(rate)
                # Which estimates the plans use from now on, and which reports not.
                log_decision({
                    "event": "estimates", "at": round(self.clock(), 6), "host": host,
                    "used": {dst: round(rate) for (src, dst), rate in network.pair.items()
                             if src == host},
                    "held": [{"peer": h.peer, "reason": h.reason,
                              "reported": None if math.isnan(h.reported) else round(h.reported)}
                             for h in held]})
                self.state.touch(None)
                self.replan()
            await asyncio.sleep(interval)

    def _held_estimates(self, held: list[Held]) -> None:
        """Count the reports the plan did not take, and say so once a minute
        per path."""
        now = self.clock()
        for h in held:
            self.metrics.estimates_held.labels(h.reason).inc()
            key = (h.host, h.peer, h.reason)
            if now - self._held_warned.get(key, -math.inf) < 60.0:
                continue
            self._held_warned[key] = now
            if h.reason == "jump":
                log.warning("agent %s reports %.1f Mbit/s to %s, more than %gx the %.1f Mbit/s "
                            "the plans use: held until its next reports agree", h.host,
                            h.reported * 8e-6, h.peer, self.estimate_guard.jump,
                            h.used * 8e-6)
            else:
                log.warning("agent %s has no fresh estimate to %s: planning with its last "
                            "good one (%.1f Mbit/s) for up to %g s", h.host, h.peer,
                            h.used * 8e-6, self.estimate_guard.keep_stale)

    # -- failover -----------------------------------------------------------------

    def watch_server(self, server: str, replica: str, *, interval: float = 0.2,
                     timeout: float = 1.0, gap_timeout: float = DEFAULT_GAP_TIMEOUT) -> None:
        """Heartbeat the server; when it is lost, promote the replica and tell
        every worker where the server now is. The heartbeats also feed the
        divergence gate (the norms of the server's applied updates, the
        replica's version) and resync a replica that waits `gap_timeout`
        seconds for an update that will not come."""
        self.watch_servers([server], [replica], interval=interval, timeout=timeout,
                           gap_timeout=gap_timeout)

    def watch_servers(self, servers: Sequence[str], replicas: Sequence[str], *,
                      interval: float = 0.2, timeout: float = 1.0,
                      gap_timeout: float = DEFAULT_GAP_TIMEOUT) -> None:
        """`watch_server` for each shard of a sharded job (`servers[i]` is
        shard i's, `replicas[i]` its replica): losing one shard promotes only
        its replica and tells only the workers' links to that shard. With
        several controllers (`coordinate`), each watches the shards it plans,
        and takes up the watch of a shard it takes over."""
        if len(servers) != len(replicas) or not servers:
            raise ConfigError(f"failover needs one replica per server: {len(servers)} "
                              f"server(s), {len(replicas)} replica(s)")
        template = self.gates.get(0)
        if template is not None and len(servers) > 1:
            # sqrt(sum over shards of (div_max / sqrt(S))^2) = div_max: the
            # whole model keeps the bound the user gave (docs/design.md).
            per_shard = template.div_max / math.sqrt(len(servers))
            for shard in range(len(servers)):
                self.gates[shard] = DivergenceGate(template.gamma, per_shard,
                                                   lag_timeout=template.lag_timeout)
        self._watch = _Watch(len(servers), interval, timeout, gap_timeout)
        self._servers = {k: (server, replica)
                         for k, (server, replica) in enumerate(zip(servers, replicas,
                                                                   strict=True))}
        for shard in range(len(servers)):
            if self.owns(shard):
                self._start_monitor(shard, serving=False)

    def _start_monitor(self, shard: int, *, serving: bool) -> None:
        assert self._watch is not None
        w = self._watch
        server, replica = self._servers[shard]

        def server_up(is_up: bool) -> None:
            w.up[shard] = is_up  # the gauge says whether every server watched answers
            self.metrics.server_up.set(int(all(w.up[k] for k in self.monitors)))

        monitor = FailoverMonitor(
            server=server, replica=replica, job=self.job, token=self.token,
            interval=w.interval, timeout=w.timeout,
            on_failover=functools.partial(self.on_failover, shard=shard),
            on_server_up=server_up,
            on_replica_lost=functools.partial(self.on_replica_lost, shard=shard),
            since=functools.partial(self._norms_since, shard),
            on_server_pong=functools.partial(self.on_server_pong, shard=shard),
            on_replica_pong=functools.partial(self.on_replica_pong, shard=shard),
            on_resynced=functools.partial(self.on_resynced, shard=shard),
            gap_timeout=w.gap_timeout,
            on_adopted=functools.partial(self.on_adopted, shard=shard), serving=serving)
        self.monitors[shard] = monitor
        monitor.start()

    def _peers(self, shard: int) -> list[_ControllerProtocol]:
        """The connections to tell of a change at `shard`'s server: every one
        for a job of one server; with shards, the links that said they talk
        to that shard (SHARD_AT)."""
        ready = [c for c in list(self.connections)
                 if isinstance(c, _ControllerProtocol) and c.stage == "ready"]
        if not self.sharded:
            return ready
        return [c for c in ready if c.shard == shard]

    @property
    def sharded(self) -> bool:
        """Failover watches the servers of several shards."""
        return self._watch is not None and self._watch.shards > 1

    @property
    def gate(self) -> DivergenceGate | None:
        """The divergence gate of a job of one server (shard 0's with shards)."""
        return self.gates.get(0)

    def _norms_since(self, shard: int = 0) -> int | None:
        """The version above which `shard`'s gate wants its server's update norms."""
        gate = self.gates.get(shard)
        if gate is None:
            return None
        return max(self._norms_known.get(shard, 0), gate.replica)

    def on_server_pong(self, pong: Pong, shard: int = 0) -> None:
        """The server's heartbeat answer: every update it applied, with its
        norm, reaches the gate even if the worker that pushed it died."""
        gate = self.gates.get(shard)
        if gate is None or pong.norms is None or pong.norms_from is None:
            return
        # (version, k): an aggregate of k, one step ending at `version`; the
        # k - 1 versions before it are no steps (their norms are 0.0).
        spans = dict(pong.spans or ())
        skipped = {v for end, k in spans.items() for v in range(end - k + 1, end)}
        # A span may start before norms_from: the versions it skipped are
        # not missing.
        first = min([pong.norms_from, *(end - k + 1 for end, k in spans.items())])
        wanted = self._norms_since(shard)
        if wanted is not None and first > wanted + 1:
            log.warning("the server no longer knows the norms of versions %d..%d: the "
                        "divergence gate cannot fold them (it will hold, then give up "
                        "holding, until the replica reports past them)", wanted + 1,
                        first - 1)
        for i, norm in enumerate(pong.norms):
            version = pong.norms_from + i
            if version not in skipped:
                gate.server_applied(version, norm, spans.get(version, 1))
        self._norms_known[shard] = max(self._norms_known.get(shard, 0),
                                       pong.norms_from + len(pong.norms) - 1)
        self.state.touch(shard)
        self.replan()

    def on_replica_pong(self, address: str, pong: Pong, shard: int = 0) -> None:
        """The replica's heartbeat answer: its version (and, first on each
        connection, its velocity, which gives the gate an exact start)."""
        gate = self.gates.get(shard)
        if gate is None or not gate.active:
            return
        before = (gate.replica, gate.replica_reported)
        if pong.velocity is not None and (not gate.synced or pong.version > gate.replica):
            gate.start(pong.version, pong.velocity)
        else:
            gate.replica_applied(pong.version)
        if (gate.replica, gate.replica_reported) != before:
            self._replica_row(shard, address, gate.replica_reported, div_max=gate.div_max)
            self.state.touch(shard)
            self.replan()

    def _replica_row(self, shard: int, address: str, version: int, **more: Any) -> None:
        """What `mlfabric status` lists of shard `shard`'s replica (`address`
        its HOST:PORT, or only its host as a worker names it)."""
        host = address.rsplit(":", 1)[0] if ":" in address else address
        row = {"host": host, "version": version, **more}
        if ":" in address:
            row["address"] = address
        if self.sharded:  # one row per shard
            self.state.replicas[shard] = {**self.state.replicas.get(shard, {}), **row,
                                          "shard": shard}
        else:
            self.state.replicas[host] = row

    def on_resynced(self, address: str, version: int, velocity: float, shard: int = 0
                    ) -> None:
        """The replica started over from the server's state at `version`:
        as a join there (workers that gave it up send it what they kept)."""
        self.metrics.replica_resyncs.inc()
        self.on_replica_join(ReplicaJoin(address=address, version=version, velocity=velocity),
                             shard=shard)

    def on_adopted(self, address: str, version: int, shard: int = 0) -> None:
        """`shard`'s replica was promoted before this controller watched it
        (by the controller it took the shard over from, or by this one before
        a restart): the workers are told, as at a failover, in case the one
        that promoted it could not tell them; no failover is counted."""
        self.on_failover(address, version, asyncio.get_running_loop().time(), shard=shard,
                         adopted=True)

    def on_failover(self, address: str, version: int, silent_since: float, shard: int = 0,
                    *, adopted: bool = False) -> None:
        m = self.metrics
        if not adopted:
            m.failovers.inc()
        gate = self.gates.get(shard)
        if gate is not None:
            gate.active = False  # no replica left to diverge from
            # The promoted replica's versions above `version` are other
            # updates than the lost server's: forget the old norms there.
            gate.forget_above(version)
        self._norms_known[shard] = min(self._norms_known.get(shard, 0), version)
        sharded = self.sharded
        self._servers[shard] = (address, None)
        host = address.rsplit(":", 1)[0]
        if sharded:  # the other shards' replicas and transfers are untouched
            self.state.replicas.pop(shard, None)
            self.state.shard_hosts[shard] = host
        else:
            self.state.replicas.clear()
        # Transfers let go to the lost server are never reported: their
        # workers re-send them to the new server directly.
        for k in [k for k, t in self.state.active.items() if not sharded or t.shard == shard]:
            del self.state.active[k]
        event = Failover(server=address, version=version)
        peers = self._peers(shard)
        for conn in peers:
            conn.send(event)
        seconds = asyncio.get_running_loop().time() - silent_since
        what = f"shard {shard}'s server" if sharded else "the server"
        if adopted:
            log.warning("the replica at %s is %s since an earlier failover (version %d); %d "
                        "peers told", address, what, version, len(peers))
        else:
            m.failover_seconds.observe(seconds)
            log.warning("failover: the replica at %s is %s (version %d); %d peers told, "
                        "%.2f s after the last heartbeat", address, what, version, len(peers),
                        seconds)
        log_decision({"event": "adopted" if adopted else "failover",
                      "server": address,
                      "version": version, "seconds": round(seconds, 6),
                      **({"shard": shard} if sharded else {})})
        self.state.touch(None if not sharded else shard)
        self.replan()

    def on_replica_lost(self, address: str, shard: int = 0) -> None:
        """No replica any more: nothing to bound the divergence from, so server
        transfers are no longer held (training goes on, unreplicated)."""
        self.metrics.replicas_lost.inc()
        gate = self.gates.get(shard)
        if gate is not None:
            gate.active = False
        if self.sharded:
            self.state.replicas.pop(shard, None)
        else:
            self.state.replicas.clear()
        if shard in self._servers:
            self._servers[shard] = (self._servers[shard][0], None)
        log_decision({"event": "replica_lost", "replica": address})
        self.state.touch(shard)
        self.replan()

    def on_replica_join(self, ev: ReplicaJoin, shard: int = 0) -> None:
        """A new replica serves from ev.version: workers send it the updates
        above that version, and it is the one to promote at the next failover.
        With shards, only for `shard`: its monitor, its gate, its workers' links.
        A controller that does not plan `shard` only notes where its server
        and replica are, for when it takes the shard over (a replica
        announces itself to every controller of the job)."""
        if self._watch is not None and shard < self._watch.shards:
            server = self._servers[shard][0]
            if ev.server is not None:  # the server it joined from serves the shard now
                server = ev.server
                if shard in self.monitors:
                    self.monitors[shard].server = server
            self._servers[shard] = (server, ev.address)
        if not self.owns(shard):
            log.info("replica of shard %d joined at %s; the controller planning that shard "
                     "watches it", shard, ev.address)
            return
        if shard in self.monitors:
            self.monitors[shard].replica = ev.address
        gate = self.gates.get(shard)
        if gate is not None:
            gate.start(ev.version, ev.velocity)
            gate.active = True
            self._norms_known[shard] = max(self._norms_known.get(shard, 0), ev.version)
        if not self.sharded:
            self.state.replicas.clear()
        self._replica_row(shard, ev.address, ev.version)
        peers = self._peers(shard)
        for conn in peers:
            conn.send(ReplicaAt(address=ev.address, version=ev.version))
        told = len(peers)
        log.warning("replica joined at %s from version %d; %d peers told", ev.address,
                    ev.version, told)
        log_decision({"event": "replica_join", "replica": ev.address,
                      "version": ev.version})
        self.state.touch(shard)
        self.replan()

    def _groups_formed(self, groups: list[Group]) -> None:
        """Count and log the groups that go (their members were let go)."""
        m = self.metrics
        for g in groups:
            m.aggregation_groups.inc()
            m.aggregation_fan_in.observe(len(g.ids))
            m.aggregation_rescued.inc(g.rescued)
            log_decision({"event": "group", "aggregator": g.aggregator,
                          "ids": list(g.ids), "rescued": g.rescued,
                          "first_position": g.first,
                          "ready": round(g.ready, 6),
                          "delivered": round(g.delivered, 6)})

    def make_protocol(self) -> _ControllerProtocol:
        return _ControllerProtocol(self)

    def welcome(self, conn: EndpointProtocol) -> Welcome:
        return Welcome(session=secrets.token_hex(8), version=self.state.version, tensors=(),
                       tau_max=self.state.tau_max,
                       aggregators=tuple(sorted(set(self.state.aggregators.values()))))

    # -- events -------------------------------------------------------------------

    def on_request(self, conn: _ControllerProtocol, ev: TransferRequest) -> None:
        # Aggregation works per shard: each shard's transfers are planned (and
        # grouped) on their own, so a group's members are parts of one shard.
        if ev.shard and self.gates and ev.shard not in self.gates:
            conn.refuse("config", f"this controller bounds the divergence (--div-max) of "
                                  f"{len(self.gates)} server(s), not of shard {ev.shard}: give "
                                  f"--server and --replica one address per shard, in shard "
                                  f"order")
            return
        if ev.shard and self._watch is not None and ev.shard >= self._watch.shards:
            conn.refuse("config", f"this controller watches {self._watch.shards} server(s) "
                                  f"for failover, not shard {ev.shard}: give --server and "
                                  f"--replica one address per shard, in shard order")
            return
        if conn.shard is None:
            conn.shard = ev.shard  # a client of one server says it only here
        if not self.owns(ev.shard):
            self.move(conn, ev.shard)
            return
        self.metrics.requests.inc()
        self.state.request(conn, ev.req, host=ev.host, dst=ev.dst, nbytes=ev.nbytes,
                           base_version=ev.base_version, norm=ev.norm, now=self.clock(),
                           shard=ev.shard, chunk=ev.chunk, options=ev.options or ())
        self.replan()

    def on_progress(self, conn: _ControllerProtocol, ev: TransferProgress) -> None:
        """A chunk of a chunked transfer has left: plan what is left of it
        with the pending transfers."""
        if self.state.progress(conn, ev.req, sent=ev.sent, now=self.clock()) is not None:
            self.replan()

    def on_done(self, conn: _ControllerProtocol, ev: TransferDone) -> None:
        before = self.state.network
        t = self.state.done(conn, ev.req, version=ev.version, applied=ev.applied,
                            delay=ev.delay, now=self.clock(), via_failed=ev.via_failed,
                            seconds=ev.seconds)
        self._corrected(before)
        if t is not None and ev.via_failed is not None and t.route is not None:
            self.metrics.aggregator_failures.inc()
            log.warning("aggregator on %s failed update %d (%s); routing nothing through it "
                        "for %.0f s", t.route.host, t.id, ev.via_failed,
                        self.state.bench_seconds)
        # One its server reported first (on_landed) was counted then: the
        # worker's report only times it.
        first = t is not None and t.landed_at is None
        if first:
            assert t is not None
            self._ended_at_server(t, ev.applied, ev.version, ev.delay, ev.fan_in)
        if t is not None:
            self.metrics.actual_seconds.observe(ev.seconds)
            log_decision({
                "event": "done", "at": round(self.clock(), 6), "id": t.id, "host": t.host,
                "applied": ev.applied,
                "version": ev.version, "delay": ev.delay, "seconds": round(ev.seconds, 6),
                "planned_seconds": t.planned_seconds})
        if first or t is None or self.state.network is not before:
            self.replan()  # (one its server reported changed nothing else to plan by)

    def _ended_at_server(self, t: Transfer, applied: bool, version: int, delay: int | None,
                         fan_in: int | None = None) -> None:
        """`t` was applied or refused at `version`, told once (by its
        server's report or its worker's, whichever came first): the
        divergence gate and the delay histogram learn it."""
        gate = self.gates.get(t.shard)
        if applied and gate is not None:
            if fan_in is None:
                gate.server_applied(version, t.norm)
            else:
                # One member of an aggregate of fan_in (each reports the
                # aggregate's end version): the gate sums their norms.
                gate.server_applied(version, t.norm, fan_in, member=True)
        if applied and delay is not None:
            self.metrics.delay.observe(delay)

    def on_landed(self, ev: Landed) -> None:
        """A server's own report of a landing (`server.landings`): the
        transfer ends here, a message before its worker's report, which
        then only times it. Several controllers each hear every landing of
        a server; the one planning its shard acts."""
        t = None
        if self.owns(ev.shard):
            t = self.state.landed(ev.ticket, shard=ev.shard, version=ev.version,
                                  applied=ev.applied, delay=ev.delay, now=self.clock(),
                                  base_version=ev.base_version)
        if t is None:
            self.metrics.landings.labels("ignored").inc()
            return
        self.metrics.landings.labels("first").inc()
        self._ended_at_server(t, ev.applied, ev.version, ev.delay)
        log_decision({
            "event": "landed", "at": round(self.clock(), 6), "id": t.id, "host": t.host,
            "applied": ev.applied, "version": ev.version, "delay": ev.delay})
        self.replan()

    def on_replica_done(self, ev: ReplicaDone, shard: int = 0) -> None:
        """A worker's replica (of `shard`, the one its link talks to) applied
        an update."""
        gate = self.gates.get(shard)
        if gate is None:
            return  # replication without a bound: nothing to decide
        gate.replica_applied(ev.version)
        self._replica_row(shard, ev.dst, gate.replica_reported, div_max=gate.div_max)
        self.state.touch(shard)
        self.replan()

    def on_fell_back(self, conn: _ControllerProtocol, ev: FellBack) -> None:
        """A worker this controller did not answer (at its connect, or
        later) is back: what it sent without it goes into the status."""
        self.state.fell_back(conn, ev.updates, ev.seconds)
        log.warning("worker %s (%s) went on without this controller for %.1f s since it "
                    "connected: %d updates straight to the server, unscheduled", conn.client,
                    conn.peer, ev.seconds, ev.updates)

    def on_lost(self, conn: _ControllerProtocol) -> None:
        gone = self.state.forget(conn, now=self.clock())
        if gone:
            log.info("worker %s gone with %d transfers", conn.client, len(gone))
            self.replan()

    # -- decide, then act -------------------------------------------------------------

    def replan(self) -> None:
        """Re-plan once the loop has read what else has arrived: the events of
        one turn of the loop share one re-plan. A re-plan over thousands of
        pending transfers takes milliseconds, and the events that arrive
        meanwhile are read together in the next turn, so the batches grow
        with the load instead of a queue of re-plans, one per event, falling
        further behind (benchmarks/RESULTS.md, "The simulator")."""
        self._events += 1
        if self._soon is None:
            self._soon = asyncio.get_running_loop().call_soon(self._replan_now)

    def _corrected(self, before: Network) -> None:
        """Count and log what the closed loop changed in the network picture
        since `before` (a transfer's report, or one running past its time)."""
        if self.state.network is before:
            return
        for link, host, old, new in observed.corrections(before, self.state.network):
            way = "lower" if new is not None and (old is None or new < old) else "higher"
            self.metrics.link_corrections.labels(link, way).inc()
            log_decision({
                "event": "link", "at": round(self.clock(), 6), "link": link, "host": host,
                "from": None if old is None else round(old),
                "to": None if new is None else round(new)})

    def _replan_now(self) -> None:
        self._soon = None
        started = time.perf_counter()
        now = self.clock()
        before = self.state.network
        m = self.metrics
        # Each action is carried out as the decision takes it (`decide`'s
        # on_action): the first transfers of a round of a link are on their
        # way while the rest is committed. The decision's time is observed
        # without that of carrying them out, which is observed apart: at
        # 10,000 workers it is the larger (about 66 us a go, up to 125 goes).
        carrying = 0.0
        carried = 0

        def carried_out(action: Go | Drop) -> None:
            nonlocal carrying, carried, before
            # What the closed loop changed first (a transfer overdue), logged
            # before the goes it led to.
            self._corrected(before)
            before = self.state.network
            t0 = time.perf_counter()
            if self._formed and isinstance(action, Go) and action.route is not None:
                # A group goes with its first member, and is logged before its
                # go (`contention.read_decisions` reads a group, then its
                # first member's go).
                tid = action.transfer.id
                went = [g for g in self._formed if g.ids[0] == tid]
                if went:
                    self._groups_formed(went)
                    self._formed[:] = [g for g in self._formed if g.ids[0] != tid]
            self._carry_out(action, now)
            carrying += time.perf_counter() - t0
            carried += 1

        decisions = self.state.decide(now, carried_out)
        self._corrected(before)
        m.decision_seconds.observe(time.perf_counter() - started - carrying)
        if carried:
            m.carry_out_seconds.observe(carrying)
        self._formed.clear()  # groups whose first member did not go
        m.replan_events.observe(self._events)
        self._events = 0
        m.pending.set(len(self.state.pending))
        m.active.set(len(self.state.active))
        m.handover.set(self.state.handover)
        m.version.set(self.state.version)
        if self.gates:
            self._replication_metrics()
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        if decisions.wake_at is not None:
            delay = max(0.0, decisions.wake_at - now)
            self._wake = asyncio.get_running_loop().call_later(delay, self.replan)

    def _carry_out(self, action: Go | Drop, now: float) -> None:
        """Count, log and send one action of the decision made at `now`."""
        conn = action.transfer.owner
        assert isinstance(conn, _ControllerProtocol)
        carry_out(action, now, metrics=self.metrics, tau_max=self.state.tau_max,
                  version=self.state.version, send=conn.send)

    def _replication_metrics(self) -> None:
        """The gauges show the shard nearest its bound (the one gate of a job
        of one server); the counters count every shard's."""
        m = self.metrics
        worst: tuple[float, int, float, int] | None = None  # (bound/div_max, lag, bound, v)
        for shard, gate in sorted(self.gates.items()):
            bound = gate.bound(in_flight_norms(self.state.active.values(), shard))
            lag = gate.lag(sum(t.shard == shard for t in self.state.active.values()))
            if worst is None or bound / gate.div_max > worst[0]:
                worst = (bound / gate.div_max, lag, bound, gate.replica_reported)
            held, overrides, stalls = self._seen.get(shard, (0, 0, 0))
            m.divergence_holds.inc(gate.held - held)
            m.divergence_overrides.inc(gate.overrides - overrides)
            if gate.stalls > stalls:
                m.divergence_stalls.inc(gate.stalls - stalls)
                log.error("the replica made no progress for %.1f s while server transfers "
                          "were held (replica at version %d, lag %d): letting transfers go "
                          "without the divergence bound until it catches up or is resynced%s",
                          gate.lag_timeout or 0.0, gate.replica_reported, lag,
                          f" (shard {shard})" if len(self.gates) > 1 else "")
                log_decision({
                    "event": "replica_stalled", "replica_version": gate.replica_reported,
                    "lag": lag, **({"shard": shard} if len(self.gates) > 1 else {})})
            self._seen[shard] = (gate.held, gate.overrides, gate.stalls)
            for key, row in self.state.replicas.items():
                if len(self.gates) == 1 or key == shard:
                    row.update(lag_updates=lag, divergence_bound=bound)
        assert worst is not None
        _, lag, bound, version = worst
        m.replica_lag.set(lag)
        m.divergence_bound.set(bound)
        m.replica_version.set(version)
        m.replica_stalled.set(int(any(g.stalled for g in self.gates.values())))

    def status(self, asker: Any = None) -> dict[str, Any]:
        """The job at a glance; `asker` (the connection asking) is not a worker."""
        status: dict[str, Any] = self.state.status(now=self.clock())
        if asker in self.state.workers:
            me = self.state.workers[asker].name
            status["workers"] = [w for w in status["workers"] if w["name"] != me]
        feeds = len(self.landing_feeds)
        status.update(job=self.job, policy=self.policy_name,
                      connections=len(self.connections) - feeds, landing_feeds=feeds)
        if self.leases is not None:  # several controllers: who plans which shard
            leases = self.leases
            status["controllers"] = {
                "etcd": leases.etcd.where(), "lease_ttl_s": leases.ttl, "this": leases.me,
                "plans": sorted(leases.owned),
                "owners": [leases.owner(k) for k in range(leases.shards)]}
        return status

    async def close(self) -> None:
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None
        if self._wake is not None:
            self._wake.cancel()
        for task in self._agent_tasks:
            task.cancel()
        if self._agent_tasks:  # no re-plan from an agent's report after close
            await asyncio.wait(self._agent_tasks, timeout=5.0)
        for monitor in self.monitors.values():
            await monitor.close()
        if self._closing:
            await asyncio.wait(self._closing, timeout=5.0)
        if self.leases is not None:
            await self.leases.close()
        await super().close()


class _Watch:
    """What `watch_servers` was given, to start a monitor for a shard later."""

    def __init__(self, shards: int, interval: float, timeout: float, gap_timeout: float
                 ) -> None:
        self.shards, self.interval, self.timeout = shards, interval, timeout
        self.gap_timeout = gap_timeout
        self.up = [False] * shards  # each watched server answers (the server_up gauge)


class _ControllerProtocol(EndpointProtocol):
    endpoint: Controller
    accepts = roles.CONTROLLER
    shard: int | None = None  # the shard a sharded client's link talks to (SHARD_AT)

    def on_ready(self) -> None:
        if self.client == LANDINGS_CLIENT:  # a server's landing reports: no worker
            self.endpoint.landing_feeds.add(self)
            return
        self.endpoint.state.join(self, f"{self.client} ({self.peer})", client=self.client)

    def handle(self, event: Any) -> None:
        if isinstance(event, TransferRequest):
            self.endpoint.on_request(self, event)
        elif isinstance(event, TransferDone):
            self.endpoint.on_done(self, event)
        elif isinstance(event, TransferProgress):
            self.endpoint.on_progress(self, event)
        elif isinstance(event, ReplicaJoin):
            self.endpoint.on_replica_join(event, event.shard or 0)
        elif isinstance(event, ReplicaDone):
            self.endpoint.on_replica_done(event, self.shard or 0)
        elif isinstance(event, ShardAt):
            self.shard = event.shard  # failover news for that shard come here
            if not self.endpoint.owns(event.shard):
                self.endpoint.move(self, event.shard)
                return
            self.endpoint.state.shard_at(event.shard, event.dst, event.version)
        elif isinstance(event, StatusRequest):
            self.send(Status(req=event.req, status=self.endpoint.status(asker=self)))
        elif isinstance(event, FellBack):
            self.endpoint.on_fell_back(self, event)
        elif isinstance(event, Landed):
            if self in self.endpoint.landing_feeds:
                self.endpoint.on_landed(event)
            else:  # a worker's link: not the server's word
                self.protocol_error(f"LANDED comes from a server's landing reports "
                                    f"(`mlfabric server --controller`), not from "
                                    f"{self.client!r}")

    def on_lost(self) -> None:
        self.endpoint.landing_feeds.discard(self)
        self.endpoint.on_lost(self)


async def resolve_addresses(name: str, port: int) -> set[str]:
    """Every address `name` resolves to (DNS, /etc/hosts): raises OSError
    (socket.gaierror) when it resolves to none."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return {str(info[4][0]) for info in infos}
