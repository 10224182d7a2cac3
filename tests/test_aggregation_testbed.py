"""Aggregation at agents on an emulated cluster (root): the aggregator is
killed (SIGKILL) during a run, and no update is lost or applied twice."""

from __future__ import annotations

import time

import numpy as np
import pytest

from mlfabric.tools.testbed import Testbed
from mlfabric.tools.workload import RunInfo, member_order, replay, run_policy

from testbed_helpers import needs_root

TAU_MAX = 16
MOMENTUM = 0.9
SCALE = 1e-3
WORKERS = 3
STEPS = 12
MODEL_BYTES = 1 << 20


def _wait_for(what: str, probe, timeout: float = 20.0, every: float = 0.05):
    """Poll `probe()` until it returns a true value (returned), at most `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(every)  # polling interval, not a synchronisation
    raise AssertionError(f"{what} did not happen within {timeout:.0f} s")


@pytest.mark.root
@needs_root
def test_killing_the_aggregator_mid_run_loses_nothing_and_applies_nothing_twice(tmp_path):
    # h0: server and controller, its downlink the bottleneck; h1-h3 workers;
    # h4 the aggregator (spare capacity).
    seen: dict = {}

    def kill_after_an_aggregate(info: RunInfo) -> None:
        def aggregated():
            srv = info.scrape("server")
            return srv if srv["mlfabric_server_aggregates_applied_total"] >= 1 else None

        before = _wait_for("an aggregate applied at the server", aggregated)
        agent = info.procs["agent"]
        agent.kill()  # SIGKILL: no goodbye to workers or the server
        agent.wait(10)
        seen["version_at_kill"] = info.scrape("server")["mlfabric_server_model_version"]
        seen["aggregates_before_kill"] = before["mlfabric_server_aggregates_applied_total"]

    def at_end(info: RunInfo) -> None:
        seen["server"] = info.scrape("server")
        seen["controller"] = info.scrape("controller")
        seen["model"] = info.pull()

    started = time.monotonic()
    with Testbed(hosts=WORKERS + 2, rate_mbit=1000.0, rates={"h0": (1000.0, 100.0)}) as tb:
        summary, records = run_policy(
            tb, "mlfabric", model_bytes=MODEL_BYTES, steps=STEPS, tau_max=TAU_MAX,
            compute_ms=100, max_in_flight=2, link_mbit={"h0": (1000, 100)},
            momentum=MOMENTUM, update_scale=SCALE, aggregator=f"h{WORKERS + 1}",
            controller_args=[], metrics=True, decision_log=tmp_path / "log",
            during_run=kill_after_an_aggregate, at_end=at_end)
    elapsed = time.monotonic() - started
    srv, ctl = seen["server"], seen["controller"]
    dup = srv.get('mlfabric_server_updates_rejected_total{reason="duplicate"}', 0)
    print(f"{elapsed:.1f} s; killed at version {seen['version_at_kill']:.0f} after "
          f"{seen['aggregates_before_kill']:.0f} aggregate(s); final version "
          f"{srv['mlfabric_server_model_version']:.0f}, aggregates "
          f"{srv['mlfabric_server_aggregates_applied_total']:.0f}, duplicates answered "
          f"{dup:.0f}, aggregator failures "
          f"{ctl['mlfabric_controller_aggregator_failures_total']:.0f}; {summary.row()}")

    # Every push resolved: applied, or not applied with a reason (run_policy
    # raised had a worker failed or hung).
    assert summary.pushes == len(records) == WORKERS * STEPS
    assert all(r["applied"] or r["reason"] for r in records), records
    assert summary.applied > 0
    # The aggregator was used before the kill, and training went on after it.
    assert seen["aggregates_before_kill"] >= 1
    assert any(r["applied"] and r["version"] > seen["version_at_kill"] for r in records)
    # The controller was told that the aggregator failed updates (and benched it).
    assert seen["controller"]["mlfabric_controller_aggregator_failures_total"] >= 1
    # Nothing applied twice: the server counted what the workers were told,
    # the applied updates occupy versions 1..V once each, and the model is
    # the numpy replay of that sequence to float32 rounding.
    srv = seen["server"]
    assert srv["mlfabric_server_updates_applied_total"] == summary.applied
    version, params = seen["model"]
    init = {"w": np.zeros(MODEL_BYTES // 4, np.float32)}
    # Members summed in their order at the aggregator (from the decision log).
    order = member_order(records, tmp_path / "log")
    w, replay_version, steps = replay(records, init, MOMENTUM, SCALE, order)
    assert version == replay_version == srv["mlfabric_server_model_version"]
    diff = float(np.max(np.abs(params["w"] - w["w"])))
    assert diff <= 1e-6 * float(np.max(np.abs(w["w"]))) * steps, diff
    print(f"replay: {steps} steps, max |diff| {diff:.2e}")
    assert elapsed < 60, elapsed
