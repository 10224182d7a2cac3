"""Every Prometheus metric mlfabric exports, declared in one place.

Conventions (prometheus client_python): namespace `mlfabric`, base units in
the name (`_seconds`, `_bytes`), `_total` on counters, buckets chosen for this
domain, and an injectable registry so each test gets a fresh one. No label
takes unbounded values: reasons and kinds come from fixed sets, never ids.
"""

from __future__ import annotations

import errno
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ..errors import ConfigError

NAMESPACE = "mlfabric"

# Staleness is counted in server versions; small values matter most.
DELAY_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
# Applying an update: from microseconds (small models) to a second (GB models).
APPLY_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)
# A transfer: a 4 KiB round trip on loopback to a GB model on a slow link.
TRANSFER_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
# A push held for the transfers it must not pass: as long as they are late.
HOLD_BUCKETS = TRANSFER_BUCKETS
# A controller's decision, or carrying out its actions: 10 us to 0.3 s.
DECISION_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3)

# Members of one aggregate (2..64).
FAN_IN_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)

# Why a push was not applied: the fixed set of `reason` label values.
# mlfabric.compression.NAMES (the metrics sit below it; tests/test_compression.py
# checks the two agree).
COMPRESSION_CODECS = ("none", "fp16", "bf16", "topk", "randk", "lowrank")
REJECT_REASONS = (
    "stale",
    "nonfinite",
    "overflow",  # a finite update that would make the model non-finite
    "unknown_tensor",
    "bad_dtype",
    "bad_shape",
    "future_version",
    "malformed",
    "duplicate",  # a sequence number or update uid that was applied already
    "seq_gap",  # a replica's out-of-order buffer is full
    "misrouted",  # a sequenced push to a server, or an unsequenced one to a replica
)


def _listener_metrics(m: Any, prefix: str, peers: str, r: CollectorRegistry) -> None:
    """What every listener counts (endpoint.py), as attributes of `m`."""
    ns = NAMESPACE
    m.received_bytes = Counter(f"{prefix}_received_bytes",
                               f"Bytes received on {peers} connections", namespace=ns,
                               registry=r)
    m.sent_bytes = Counter(f"{prefix}_sent_bytes", f"Bytes sent on {peers} connections",
                           namespace=ns, registry=r)
    m.connected_clients = Gauge(f"{prefix}_connected_clients",
                                f"Authenticated {peers} connections open now", namespace=ns,
                                registry=r)
    m.auth_failures = Counter(f"{prefix}_auth_failures",
                              "Connections refused at the handshake (wrong token or job)",
                              namespace=ns, registry=r)
    m.protocol_errors = Counter(f"{prefix}_protocol_errors",
                                "Connections closed for a malformed or oversized frame",
                                namespace=ns, registry=r)
    m.unauthenticated_evicted = Counter(
        f"{prefix}_unauthenticated_evicted",
        "Connections that had not finished the handshake, closed to make room for a new "
        "one (the per-listener cap on them)", namespace=ns, registry=r)
    m.tls_refused = Counter(
        f"{prefix}_tls_refused",
        "Connections refused at the TLS handshake (no certificate, one the cluster's CA did "
        "not sign, or no TLS at all)", namespace=ns, registry=r)
    m.backpressure = Counter(
        f"{prefix}_backpressure",
        f"Times a connection's requests were held because the answers queued for a "
        f"{peers} that does not read them reached the per-connection bound",
        namespace=ns, registry=r)


class ServerMetrics:
    """Metrics of one parameter server (or replica) process."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        ns = NAMESPACE
        self.updates_applied = Counter(
            "server_updates_applied", "Updates applied to the model", namespace=ns, registry=r
        )
        self.aggregates_applied = Counter(
            "server_aggregates_applied",
            "Aggregates applied (each also counts its members in updates_applied)",
            namespace=ns, registry=r)
        self.updates_rejected = Counter(
            "server_updates_rejected",
            "Pushes not applied, by reason",
            ["reason"],
            namespace=ns,
            registry=r,
        )
        for reason in REJECT_REASONS:
            self.updates_rejected.labels(reason)
        self.compressed_tensors = Counter(
            "server_compressed_tensors",
            "Tensors of compressed pushes decoded, by codec (issue 35)", ["codec"],
            namespace=ns, registry=r)
        for codec in COMPRESSION_CODECS:
            self.compressed_tensors.labels(codec)
        self.shard = Gauge(
            "server_shard", "1 on a server that keeps one shard of a partitioned model "
            "(--shard INDEX/COUNT), with its partition's digest", ["index", "count", "partition"],
            namespace=ns, registry=r)
        self.delay = Histogram(
            "server_update_delay_versions",
            "Staleness of applied updates: server version at apply minus base version",
            namespace=ns,
            registry=r,
            buckets=DELAY_BUCKETS,
        )
        self.apply_seconds = Histogram(
            "server_apply_seconds",
            "Time to validate and apply one update with the kernels",
            namespace=ns,
            registry=r,
            buckets=APPLY_BUCKETS,
        )
        self.pushes_held = Counter(
            "server_pushes_held",
            "Pushes that landed before transfers their go named (ones that would be "
            "refused as stale if passed), by how their hold ended: in_order (those "
            "landed), expired (after_seconds passed first) or lost (the connection "
            "closed, or the server did, before either)",
            ["ended"], namespace=ns, registry=r)
        for ended in ("in_order", "expired", "lost"):
            self.pushes_held.labels(ended)
        self.push_hold_seconds = Histogram(
            "server_push_hold_seconds",
            "How long a push that landed before the transfers its go named was held",
            namespace=ns, registry=r, buckets=HOLD_BUCKETS)
        self.landings_reported = Counter(
            "server_landings_reported",
            "Pushes with a controller's ticket applied or refused, by whether the server "
            "told a controller itself (--controller): sent, or unsent (no controller "
            "reached: its worker's report stands in)",
            ["result"], namespace=ns, registry=r)
        for result in ("sent", "unsent"):
            self.landings_reported.labels(result)
        _listener_metrics(self, "server", "client", r)
        self.pulls = Counter("server_pulls", "Pulls answered with the model as it is",
                             namespace=ns, registry=r)
        self.pulls_held = Gauge(
            "server_pulls_held", "Pulls for an update held until the model includes it",
            namespace=ns, registry=r)
        self.pulls_streamed = Counter(
            "server_pulls_streamed",
            "Pulls for an update answered with a model streamed while the update arrived",
            namespace=ns, registry=r)
        self.pulls_expired = Counter(
            "server_pulls_expired",
            "Pulls for an update answered with the model as it is after their wait "
            "(the update did not reach the server in time, or was dropped)",
            namespace=ns, registry=r)
        self.pulls_cancelled = Counter(
            "server_pulls_cancelled",
            "Pulls for an update the client gave up while they were held "
            "(its update was dropped, or the client timed out)",
            namespace=ns, registry=r)
        self.streams_voided = Counter(
            "server_streams_voided",
            "Streamed models ended as not holding (the update did not apply as staged)",
            namespace=ns, registry=r)
        self.version = Gauge(
            "server_model_version", "Current model version", namespace=ns, registry=r
        )
        self.checkpoints = Counter(
            "server_checkpoints", "Checkpoints written", namespace=ns, registry=r
        )
        self.checkpoint_failures = Counter(
            "server_checkpoint_failures", "Checkpoints that could not be written",
            namespace=ns, registry=r,
        )
        self.checkpoint_seconds = Histogram(
            "server_checkpoint_seconds",
            "Time to write one checkpoint (copy, checksum, write, fsync, rename)",
            namespace=ns,
            registry=r,
            buckets=(0.001, 0.01, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0),
        )
        self.last_checkpoint = Gauge(
            "server_last_checkpoint_timestamp_seconds",
            "Unix time of the newest checkpoint (0: none yet); age = time() - this",
            namespace=ns,
            registry=r,
        )
        self.last_checkpoint_version = Gauge(
            "server_last_checkpoint_version", "Model version of the newest checkpoint",
            namespace=ns, registry=r,
        )
        # Replication (a server in chain mode, or a replica).
        self.replica_lag = Gauge(
            "server_replica_lag_updates",
            "Chain replication: updates applied here that the replica has not acknowledged",
            namespace=ns, registry=r,
        )
        self.replica_connected = Gauge(
            "server_replica_connected",
            "Chain replication: 1 while the link to the replica is up",
            namespace=ns, registry=r,
        )
        self.replication_sent_bytes = Counter(
            "server_replication_sent_bytes",
            "Chain replication: bytes forwarded to the replica",
            namespace=ns, registry=r,
        )
        self.replica_divergence = Gauge(
            "server_replica_divergence",
            "Measured ||w_server - w_replica||_2 at the last sample (--sample-replica)",
            namespace=ns, registry=r)
        self.replica_divergence_lag = Gauge(
            "server_replica_divergence_lag_updates",
            "Server version minus replica version in the last divergence sample",
            namespace=ns, registry=r)
        self.replica_divergence_samples = Counter(
            "server_replica_divergence_samples", "Divergence samples taken",
            namespace=ns, registry=r)
        self.replica_pending = Gauge(
            "server_replica_pending_updates",
            "Replica: updates received ahead of their turn, waiting for earlier ones",
            namespace=ns, registry=r,
        )
        self.replica_gap = Gauge(
            "server_replica_gap_seconds",
            "Replica: how long it has waited for a missing sequence number (0: none missing)",
            namespace=ns, registry=r,
        )
        self.replica_resyncs = Counter(
            "server_replica_resyncs",
            "Replica: times it started over from the server's state because an update it "
            "waited for would not come",
            namespace=ns, registry=r,
        )
        self.promotions_refused = Counter(
            "server_promotions_refused",
            "Replica: promotions refused because the server it would replace still answered",
            namespace=ns, registry=r,
        )


class ClientMetrics:
    """Metrics of one training process (a worker using the client API)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        ns = NAMESPACE
        self.push_seconds = Histogram(
            "client_push_seconds",
            "Time from push() to the server's outcome",
            namespace=ns,
            registry=r,
            buckets=TRANSFER_BUCKETS,
        )
        self.pull_seconds = Histogram(
            "client_pull_seconds",
            "Time from pull() to the model in hand",
            namespace=ns,
            registry=r,
            buckets=TRANSFER_BUCKETS,
        )
        self.pushes = Counter(
            "client_pushes", "Push outcomes, by result", ["result"], namespace=ns, registry=r
        )
        # held: below the significance threshold, kept in the residual.
        for result in ("applied", "rejected", "error", "held"):
            self.pushes.labels(result)
        self.sent_bytes = Counter(
            "client_sent_bytes", "Bytes sent to servers", namespace=ns, registry=r
        )
        self.received_bytes = Counter(
            "client_received_bytes", "Bytes received from servers", namespace=ns, registry=r
        )
        # A sharded job's client: per shard (one label value per server shard).
        # The metrics above count every shard's part as a push of its own.
        self.shard_update_bytes = Counter(
            "client_shard_update_bytes", "Update bytes pushed to each server shard",
            ["shard"], namespace=ns, registry=r)
        self.shard_model_bytes = Counter(
            "client_shard_model_bytes", "Model bytes pulled from each server shard",
            ["shard"], namespace=ns, registry=r)
        self.shard_parts = Counter(
            "client_shard_parts", "Outcomes of the update parts each server shard answered, "
            "by result", ["shard", "result"], namespace=ns, registry=r)
        self.shard_delay = Histogram(
            "client_shard_delay_versions", "Delay of the parts each server shard applied",
            ["shard"], namespace=ns, registry=r, buckets=DELAY_BUCKETS)
        # With a controller: training without it is never silent (issue 33).
        self.controller_unreachable = Gauge(
            "client_controller_unreachable", "1 while the controller given to connect() does "
            "not answer (a sharded job: its shards' links to it that are down): pushes then "
            "go straight to the server, unscheduled, or wait for it (controller_fallback)",
            namespace=ns, registry=r)
        self.controller_fallback_updates = Counter(
            "client_controller_fallback_updates", "Updates sent straight to the server, "
            "unscheduled, because the controller did not answer (controller_fallback 'fifo')",
            namespace=ns, registry=r)
        self.paced_pushes = Counter(
            "client_paced_pushes", "Pushes the controller let go paced (beside one that "
            "must land first), with the socket to the server held to the go's pace for its "
            "pace_seconds or until the server's answer", namespace=ns, registry=r)


class ControllerMetrics:
    """Metrics of a controller process."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        from ..scheduling.plan import DROP_REASONS

        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        ns = NAMESPACE
        self.requests = Counter("controller_requests", "Transfer requests received",
                                namespace=ns, registry=r)
        self.directives = Counter("controller_directives", "Directives sent, by action",
                                  ["action"], namespace=ns, registry=r)
        for action in ("go", "drop"):
            self.directives.labels(action)
        self.compressed_transfers = Counter(
            "controller_compressed_transfers",
            "Transfers let go whose workers offered compressed forms, by the codec chosen "
            "(none: whole; issue 35)", ["codec"], namespace=ns, registry=r)
        for codec in COMPRESSION_CODECS:
            self.compressed_transfers.labels(codec)
        self.drops = Counter("controller_drops", "Updates dropped, by reason", ["reason"],
                             namespace=ns, registry=r)
        for reason in DROP_REASONS:
            self.drops.labels(reason)
        self.landings = Counter(
            "controller_server_landings",
            "Servers' own reports of a landing (mlfabric server --controller), by whether "
            "one ended its transfer here (first: before its worker's report) or came too "
            "late or for a transfer this controller does not have (ignored)",
            ["result"], namespace=ns, registry=r)
        for result in ("first", "ignored"):
            self.landings.labels(result)
        self.ordered_transfers = Counter(
            "controller_ordered_transfers",
            "Transfers let go with transfers named that their server applies first: ones "
            "planned to land before them that would be refused as stale if passed "
            "(scheduling.observed.RunningOrder.must_follow)",
            namespace=ns, registry=r)
        self.paced_transfers = Counter(
            "controller_paced_transfers",
            "Transfers let go beside a critical transfer that could crowd it out of the "
            "server's link, paced at the room it leaves (or their reserved rate, if more) "
            "until it is planned to have landed (scheduling.observed.room_beside)",
            namespace=ns, registry=r)
        self.link_corrections = Counter(
            "controller_link_corrections",
            "Changes of the picture of a link by the job's own transfers (the closed "
            "loop, scheduling.observed), by link (up: a worker's, down: a server's) and "
            "way (lower: capped at what it delivered; higher: a cap raised or lifted)",
            ["link", "way"], namespace=ns, registry=r)
        for link in ("up", "down"):
            for way in ("lower", "higher"):
                self.link_corrections.labels(link, way)
        self.aggregation_groups = Counter(
            "controller_aggregation_groups", "Groups routed through an aggregator",
            namespace=ns, registry=r)
        self.aggregation_fan_in = Histogram(
            "controller_aggregation_fan_in", "Members per group routed through an aggregator",
            namespace=ns, registry=r, buckets=FAN_IN_BUCKETS)
        self.aggregation_rescued = Counter(
            "controller_aggregation_rescued",
            "Updates the policy dropped in overload that joined an aggregate instead",
            namespace=ns, registry=r)
        self.aggregation_members = Counter(
            "controller_aggregation_members", "Updates told to go through an aggregator",
            namespace=ns, registry=r)
        self.chunks = Counter(
            "controller_chunk_grants",
            "Grants of a chunked transfer's next chunk (after its first): each is a point "
            "where a shorter transfer could have passed it", namespace=ns, registry=r)
        self.aggregator_failures = Counter(
            "controller_aggregator_failures",
            "Updates whose aggregator failed them (sent directly instead); each benches "
            "that aggregator for a while", namespace=ns, registry=r)
        self.queue_wait = Histogram(
            "controller_queue_wait_seconds", "Time from a request to its directive",
            namespace=ns, registry=r, buckets=TRANSFER_BUCKETS)
        self.decision_seconds = Histogram(
            "controller_decision_seconds",
            "Time of one re-plan (policy and bookkeeping; not sending its directives, which go "
            "out as it takes them)",
            namespace=ns, registry=r,
            buckets=DECISION_BUCKETS)
        self.carry_out_seconds = Histogram(
            "controller_carry_out_seconds",
            "Time one re-plan spent carrying out the actions it took (counting, logging and "
            "sending each directive as it is taken); re-plans that took none are not observed",
            namespace=ns, registry=r,
            buckets=DECISION_BUCKETS)
        self.replan_events = Histogram(
            "controller_replan_events",
            "Events (requests, completions, timers, bandwidth changes) one re-plan "
            "answered: above 1, events arrived faster than the controller re-planned",
            namespace=ns, registry=r, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1024))
        self.delay = Histogram(
            "controller_update_delay_versions",
            "Staleness of applied updates as their workers reported it",
            namespace=ns, registry=r, buckets=DELAY_BUCKETS)
        self.planned_seconds = Histogram(
            "controller_transfer_planned_seconds", "Transfer time the plan expected",
            namespace=ns, registry=r, buckets=TRANSFER_BUCKETS)
        self.actual_seconds = Histogram(
            "controller_transfer_actual_seconds",
            "Time from go to the server's outcome, as the worker reported it",
            namespace=ns, registry=r, buckets=TRANSFER_BUCKETS)
        self.handover = Gauge(
            "controller_handover_seconds",
            "Measured wait a transfer's successor would have past its end for its report and "
            "go (three messages); transfers alone into a server and planned within 10 of "
            "these hand over at their planned end instead (0: none reported yet)",
            namespace=ns, registry=r)
        self.pending = Gauge("controller_pending_transfers", "Transfers waiting for a directive",
                             namespace=ns, registry=r)
        self.active = Gauge("controller_active_transfers", "Transfers let go, not yet done",
                            namespace=ns, registry=r)
        self.version = Gauge("controller_server_version", "Newest server version heard of",
                             namespace=ns, registry=r)
        # Hosts are the job's configured set, so the labels are bounded.
        self.bandwidth = Gauge("controller_path_bandwidth_bytes_per_second",
                               "Available bandwidth per path the plans use, as agents "
                               "measured it", ["src", "dst"], namespace=ns, registry=r)
        self.estimates_held = Counter(
            "controller_estimates_held",
            "Agent reports the plan did not take, by reason: jump (more than 3x from the "
            "last one used, until confirmed) or stale (planned with the last good one)",
            ["reason"], namespace=ns, registry=r)
        for reason in ("jump", "stale"):
            self.estimates_held.labels(reason)
        _listener_metrics(self, "controller", "peer", r)
        # Worker-driven replication (--div-max).
        self.replica_lag = Gauge(
            "controller_replica_lag_updates",
            "Updates the server may have applied that the replica has not (in flight "
            "included); with shards, of the shard nearest its bound",
            namespace=ns, registry=r)
        self.divergence_bound = Gauge(
            "controller_divergence_bound",
            "Bound on ||w_server - w_replica||_2 from the reported update norms; with "
            "shards, of the shard nearest its bound (each within div_max / sqrt(S))",
            namespace=ns, registry=r)
        self.replica_version = Gauge(
            "controller_replica_version",
            "Newest version the replica was reported at (with shards: of the shard nearest "
            "its bound)",
            namespace=ns, registry=r)
        self.divergence_holds = Counter(
            "controller_divergence_holds",
            "Times a server transfer was held back because the bound would pass div_max",
            namespace=ns, registry=r)
        self.divergence_overrides = Counter(
            "controller_divergence_overrides",
            "Updates let go with nothing lagging although alone they pass div_max",
            namespace=ns, registry=r)
        self.divergence_stalls = Counter(
            "controller_divergence_stalls",
            "Times the gate stopped holding server transfers because the replica made no "
            "progress for --replica-lag-timeout seconds",
            namespace=ns, registry=r)
        self.replica_stalled = Gauge(
            "controller_replica_stalled",
            "1 while the divergence gate lets transfers go because the replica is stalled",
            namespace=ns, registry=r)
        self.replica_resyncs = Counter(
            "controller_replica_resyncs",
            "Times the replica was told to start over from the server's state (a sequence "
            "number it waited for would not come)",
            namespace=ns, registry=r)
        # Failover (--server/--replica).
        self.failovers = Counter("controller_failovers",
                                 "Times the replica was promoted after the server was lost",
                                 namespace=ns, registry=r)
        self.replicas_lost = Counter("controller_replicas_lost",
                                     "Times the replica stopped answering heartbeats",
                                     namespace=ns, registry=r)
        self.server_up = Gauge("controller_server_up",
                               "1 while the server answers heartbeats", namespace=ns, registry=r)
        self.failover_seconds = Histogram(
            "controller_failover_seconds",
            "From the last heartbeat answered by the lost server to the clients told",
            namespace=ns, registry=r, buckets=(0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0))
        # Several controllers (--coordination): the shards this one plans.
        self.shards_owned = Gauge(
            "controller_shards_owned",
            "Server shards this controller plans (holds in etcd); with one controller, all",
            namespace=ns, registry=r)
        self.shards_claimed = Counter(
            "controller_shards_claimed",
            "Shards this controller claimed in etcd, its own at start and any taken over "
            "from a controller that was gone", namespace=ns, registry=r)
        self.leases_lost = Counter(
            "controller_leases_lost",
            "Times this controller could not renew its etcd lease in time and stopped "
            "planning its shards", namespace=ns, registry=r)
        self.links_moved = Counter(
            "controller_links_moved",
            "Worker links sent to the controller that plans their shard", namespace=ns,
            registry=r)


def serve_metrics(registry: CollectorRegistry, port: int, addr: str) -> str:
    """Serve `registry` from a daemon thread; its URL, with the port bound
    (--metrics-port 0 picks a free one). An address that cannot be served on
    is a ConfigError naming it (issue 33: a port in use was a traceback)."""
    try:
        httpd, _ = start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:  # socket.gaierror too: an unknown host name
        fix = ("give another --metrics-port, or 0 to pick a free one"
               if exc.errno == errno.EADDRINUSE else
               "give --metrics-host an address of this host")
        raise ConfigError(f"cannot serve metrics on {addr}:{port}: "
                          f"{exc.strerror or exc}; {fix}") from None
    host, bound = httpd.server_address[:2]
    return metrics_url(str(host), int(bound))


def metrics_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"


# --- Agent metrics (the per-host bandwidth agent) are declared below this line. ---


class AggregatorMetrics:
    """Metrics of an aggregator (it runs in the agent process: pass the
    agent's registry to export both on one port)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        ns = NAMESPACE
        self.aggregates = Counter(
            "aggregator_aggregates", "Aggregates forwarded to a server, by outcome (applied; "
            "refused by the server; failed: not delivered)", ["outcome"], namespace=ns,
            registry=r)
        for outcome in ("applied", "refused", "failed"):
            self.aggregates.labels(outcome)
        self.fan_in = Histogram(
            "aggregator_fan_in", "Members per applied aggregate", namespace=ns, registry=r,
            buckets=FAN_IN_BUCKETS)
        self.members = Counter(
            "aggregator_members", "Updates applied as members of an aggregate", namespace=ns,
            registry=r)
        self.saved_bytes = Counter(
            "aggregator_saved_bytes", "Bytes the server did not receive thanks to aggregation: "
            "(members - 1) x update size per applied aggregate", namespace=ns, registry=r)
        self.aggregation_seconds = Histogram(
            "aggregator_aggregation_seconds", "From a group's first member arriving to the "
            "server's answer to its aggregate", namespace=ns, registry=r,
            buckets=TRANSFER_BUCKETS)
        # The two parts of aggregation_seconds, to tell a slow member from a
        # slow path to the server. A streamed aggregate's forward starts while
        # its members arrive, so the two overlap.
        self.gather_seconds = Histogram(
            "aggregator_gather_seconds", "From a group's first member arriving to its last "
            "member received (or to the group timing out)", namespace=ns, registry=r,
            buckets=TRANSFER_BUCKETS)
        self.forward_seconds = Histogram(
            "aggregator_forward_seconds", "From forwarding an aggregate to the server's answer "
            "(the link, the transfer into the server and its apply); it starts once every "
            "member has begun to arrive", namespace=ns, registry=r, buckets=TRANSFER_BUCKETS)
        self.streamed_bytes = Counter(
            "aggregator_streamed_bytes", "Aggregate bytes sent to the server before the "
            "group's last member was in (the forward overlapping the gather)", namespace=ns,
            registry=r)
        self.group_timeouts = Counter(
            "aggregator_group_timeouts", "Groups forwarded without all members (a member did "
            "not arrive within the group timeout)", namespace=ns, registry=r)
        self.late_members = Counter(
            "aggregator_late_members", "Members that arrived after their group closed (sent "
            "back to go straight to the server)", namespace=ns, registry=r)
        self.dst_refused = Counter(
            "aggregator_dst_refused", "Member pushes refused because the server they name is "
            "not one of the aggregator's --servers (nothing dialled; the worker sends the "
            "update straight to its server)", namespace=ns, registry=r)
        _listener_metrics(self, "aggregator", "worker", r)


class AgentMetrics:
    """Metrics of one per-host bandwidth agent. `peer` takes values from the
    agent's configured peer set (bounded); rates are in bytes per second."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        ns = NAMESPACE
        self.probe_sent_bytes = Counter(
            "agent_probe_sent_bytes",
            "Probe datagram bytes sent, including IP/UDP/Ethernet headers",
            ["peer"], namespace=ns, registry=r,
        )
        self.probe_sent_packets = Counter(
            "agent_probe_sent_packets", "Probe datagrams sent", ["peer"], namespace=ns, registry=r
        )
        self.probe_received_bytes = Counter(
            "agent_probe_received_bytes",
            "Probe datagram bytes received from a peer's trains, including headers",
            ["peer"], namespace=ns, registry=r,
        )
        self.probe_lost_packets = Counter(
            "agent_probe_lost_packets",
            "Probe datagrams the peer did not report as received",
            ["peer"], namespace=ns, registry=r,
        )
        self.trains = Counter(
            "agent_probe_trains",
            "Probe trains by outcome (sample, rise, burst, weak, short, unqueued, "
            "escalate, sender-limited, sender-slow, unexplained, collision, lost)",
            ["peer", "outcome"], namespace=ns, registry=r,
        )
        self.available_bandwidth = Gauge(
            "agent_available_bandwidth_bytes_per_second",
            "Estimated available bandwidth to the peer (payload bytes per second)",
            ["peer"], namespace=ns, registry=r,
        )
        self.capacity = Gauge(
            "agent_capacity_bytes_per_second",
            "Estimated bottleneck capacity of the path to the peer",
            ["peer"], namespace=ns, registry=r,
        )
        self.path_load = Gauge(
            "agent_path_load_bytes_per_second",
            "Other traffic on the path's edge links (this uplink, the peer's downlink)",
            ["peer"], namespace=ns, registry=r,
        )
        self.rtt = Gauge(
            "agent_rtt_seconds", "Round-trip time to the peer's agent (median of recent)",
            ["peer"], namespace=ns, registry=r,
        )
        self.estimate_age = Gauge(
            "agent_estimate_age_seconds", "Time since the last bandwidth sample for the peer",
            ["peer"], namespace=ns, registry=r,
        )
        self.estimate_stale = Gauge(
            "agent_estimate_stale", "1 when the estimate for the peer is stale or unknown",
            ["peer"], namespace=ns, registry=r,
        )
        self.probe_interval = Gauge(
            "agent_probe_interval_seconds",
            "Seconds between steady-state trains to the peer that the probe budget allows "
            "(a change of the path shows within about this plus its confirming trains)",
            ["peer"], namespace=ns, registry=r,
        )
        self.peer_connected = Gauge(
            "agent_peer_connected", "1 while the probe connection to the peer is up",
            ["peer"], namespace=ns, registry=r,
        )
        self.probe_share = Gauge(
            "agent_probe_share",
            "Paths that share the probe budget of the path to the peer: the larger of this "
            "agent's peers (its uplink) and the agents probing the peer (the peer's downlink)",
            ["peer"], namespace=ns, registry=r,
        )
        self.peer_connects = Counter(
            "agent_peer_connects", "Probe connections established to the peer",
            ["peer"], namespace=ns, registry=r,
        )
        self.peers = Gauge("agent_peers", "Configured peers", namespace=ns, registry=r)
        self.bad_messages = Counter(
            "agent_bad_messages",
            "Malformed input dropped: datagram (ignored) or frame (connection closed)",
            ["kind"], namespace=ns, registry=r,
        )
        for kind in ("datagram", "frame"):
            self.bad_messages.labels(kind)
        self.transfer_reports = Counter(
            "agent_transfer_reports",
            "Transfer reports from local clients, by result (accepted, unknown_peer, "
            "refused: a rate above the NIC's speed or a duration that is no number)",
            ["result"], namespace=ns, registry=r,
        )
        self.refused = Counter(
            "agent_refused",
            "Control connections refused, by reason (unauthenticated: a request before "
            "a login; auth: a wrong key; login-timeout: no login in time; forbidden: a "
            "request the credential does not allow, such as SetPeers with a job's key; "
            "evicted: not logged in, closed to make room for a new connection; integrity: "
            "a frame after the login altered, injected or replayed on the way, its MAC "
            "wrong or missing)",
            ["reason"], namespace=ns, registry=r,
        )
        for result in ("accepted", "unknown_peer", "refused"):
            self.transfer_reports.labels(result)
        self.tls_refused = Counter(
            "agent_tls_refused",
            "Control connections refused at the TLS handshake (--tls-*: no certificate, one "
            "the cluster's CA did not sign, or no TLS at all)", namespace=ns, registry=r)
        self.delivery_samples = Counter(
            "agent_delivery_samples",
            "Delivery-rate samples of the job's own TCP flows to the peer (as BBR takes "
            "them; --job-port), by result: used, or refused (above the NIC's speed)",
            ["peer", "result"], namespace=ns, registry=r,
        )
        self.job_traffic_bytes = Counter(
            "agent_job_traffic_bytes",
            "Wire bytes of the job's own TCP connections through this host's NICs, by "
            "direction (rx, tx); not counted as load (--job-port)",
            ["direction"], namespace=ns, registry=r,
        )
        for direction in ("rx", "tx"):
            self.job_traffic_bytes.labels(direction)
