"""Build deploy/grafana/mlfabric.json, the Grafana dashboard of an mlfabric job.

    pip install 'grafana-foundation-sdk==1769699998!10.1.0'
    python deploy/grafana/dashboard.py > deploy/grafana/mlfabric.json

Built with Grafana's own SDK (grafana-foundation-sdk), not by hand: its
builders produce the JSON model Grafana imports. Every query names metrics
that mlfabric declares (docs/guide/metrics.md), with labels they carry:
tests/test_deploy.py checks that, and that this script gives the committed
file. Import it in Grafana (Dashboards > New > Import) and pick the
Prometheus data source that scrapes deploy/prometheus/prometheus.yml's jobs.
"""

from __future__ import annotations

import json
import sys

from grafana_foundation_sdk.builders import dashboard, heatmap, prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

# The data source is chosen at import: ${datasource} is the dashboard variable.
SOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"


def query(expr: str, legend: str, ref: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref)


def series(title: str, description: str, unit: str, *queries: tuple[str, str]
           ) -> timeseries.Panel:
    panel = (timeseries.Panel().title(title).description(description).unit(unit)
             .datasource(SOURCE).height(8).span(12))
    for i, (expr, legend) in enumerate(queries):
        panel = panel.with_target(query(expr, legend, chr(ord("A") + i)))
    return panel


def build() -> dashboard.Dashboard:
    delay_heatmap = (
        heatmap.Panel().title("Update delay (staleness) distribution")
        .description("How many versions old each applied update was "
                     "(mlfabric_server_update_delay_versions), per interval.")
        .datasource(SOURCE).height(8).span(12).calculate(False)
        .with_target(query(
            f"sum by (le) (increase(mlfabric_server_update_delay_versions_bucket[{RATE}]))",
            "{{le}}", "A").format(PromQueryFormat.HEATMAP)))
    return (
        dashboard.Dashboard("mlfabric job")
        .uid("mlfabric-job")
        .tags(["mlfabric"])
        .refresh("10s")
        .time("now-1h", "now")
        .with_variable(dashboard.DatasourceVariable("datasource")
                       .label("Prometheus").type("prometheus"))
        .with_row(dashboard.Row("Training"))
        .with_panel(series(
            "Updates applied and dropped per second",
            "Applied by the servers; refused by a server (stale, invalid) and dropped by "
            "the controller, by reason.", "ops",
            (f"sum(rate(mlfabric_server_updates_applied_total[{RATE}]))", "applied"),
            (f"sum by (reason) (rate(mlfabric_server_updates_rejected_total[{RATE}]))",
             "refused: {{reason}}"),
            (f"sum by (reason) (rate(mlfabric_controller_drops_total[{RATE}]))",
             "dropped: {{reason}}")))
        .with_panel(delay_heatmap)
        .with_panel(series(
            "Push to applied",
            "From a worker's push() to the server's outcome (workers' metrics), and each "
            "transfer's time as the controller measured it.", "s",
            ("histogram_quantile(0.5, sum by (le) "
             f"(rate(mlfabric_client_push_seconds_bucket[{RATE}])))", "push p50"),
            ("histogram_quantile(0.99, sum by (le) "
             f"(rate(mlfabric_client_push_seconds_bucket[{RATE}])))", "push p99"),
            ("histogram_quantile(0.5, sum by (le) "
             f"(rate(mlfabric_controller_transfer_actual_seconds_bucket[{RATE}])))",
             "transfer p50")))
        .with_row(dashboard.Row("Network"))
        .with_panel(series(
            "Available bandwidth per host pair",
            "What each host's agent measures to each peer, and what the controller plans "
            "each path with.", "Bps",
            ("mlfabric_agent_available_bandwidth_bytes_per_second",
             "{{instance}} to {{peer}}"),
            ("mlfabric_controller_path_bandwidth_bytes_per_second",
             "planned {{src}} to {{dst}}")))
        .with_panel(series(
            "Controller: re-plan time and events per re-plan",
            "The controller's time per decision (p99), the time a decision spends carrying "
            "out its actions (counting, logging and sending each; p99), and how many events "
            "each re-plan takes in at once.", "s",
            ("histogram_quantile(0.99, sum by (le) "
             f"(rate(mlfabric_controller_decision_seconds_bucket[{RATE}])))", "decision p99"),
            ("histogram_quantile(0.99, sum by (le) "
             f"(rate(mlfabric_controller_carry_out_seconds_bucket[{RATE}])))",
             "carrying out p99"),
            (f"sum(rate(mlfabric_controller_replan_events_sum[{RATE}])) / "
             f"sum(rate(mlfabric_controller_replan_events_count[{RATE}]))",
             "events per re-plan")))
        .with_row(dashboard.Row("Servers"))
        .with_panel(series(
            "Server apply time per shard",
            "Time to apply one update (p99), per server or shard.", "s",
            ("histogram_quantile(0.99, sum by (le, instance) "
             f"(rate(mlfabric_server_apply_seconds_bucket[{RATE}])))", "{{instance}}")))
        .with_panel(series(
            "Server bytes in and out per shard",
            "Updates in and models out, per server or shard.", "Bps",
            (f"sum by (instance) (rate(mlfabric_server_received_bytes_total[{RATE}]))",
             "in {{instance}}"),
            (f"sum by (instance) (rate(mlfabric_server_sent_bytes_total[{RATE}]))",
             "out {{instance}}")))
        .with_panel(series(
            "Replica: lag and divergence against its bound",
            "Updates the replica has not applied yet; ||w_server - w_replica|| as measured "
            "and the controller's bound on it (--div-max gates it).", "short",
            ("mlfabric_server_replica_lag_updates", "lag (updates) {{instance}}"),
            ("mlfabric_server_replica_divergence", "divergence measured {{instance}}"),
            ("mlfabric_controller_divergence_bound", "divergence bound {{instance}}")))
    )


def main() -> int:
    json.dump(build().build(), sys.stdout, cls=JSONEncoder, indent=2, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
