"""Workers, a controller and a server on an emulated cluster (root): the
invariants that hold under every policy, with the server's downlink shaped
as the bottleneck."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlfabric.tools.testbed import Testbed
from mlfabric.tools.workload import run_policy

from testbed_helpers import needs_root

TAU_MAX = 4


@pytest.mark.root
@needs_root
@pytest.mark.parametrize("policy", ["fifo", "mlfabric"])
def test_every_push_ends_with_an_outcome_within_the_staleness_bound(policy):
    with Testbed(hosts=5, rate_mbit=1000.0, rates={"h0": (1000.0, 100.0)}) as tb:
        summary, records = run_policy(
            tb, policy, model_bytes=1 << 20, steps=6, tau_max=TAU_MAX, compute_ms=50,
            max_in_flight=2, link_mbit={"h0": (1000, 100)})
    assert summary.pushes == len(records) == 4 * 6
    for r in records:
        if r["applied"]:
            assert 0 <= r["delay"] <= TAU_MAX
        else:  # refused stale by the server, or dropped by the controller: said why
            assert r["reason"] and ("stale" in r["reason"] or "dropped by the controller"
                                    in r["reason"]), r
    assert summary.applied > 0
    if policy == "mlfabric":
        # The controller drops before sending; the server never sees a stale update.
        # (The server's refusal starts "stale:"; a drop reason may say "stalest".)
        assert not any((r["reason"] or "").startswith("stale:") for r in records), records


@pytest.mark.root
@needs_root
def test_a_run_over_sharded_servers_applies_every_push_on_every_shard():
    """run_policy's shards (the simulator's validation at 8 workers and 4
    shards uses them): shard 0 beside the controller, shard 1 on its own
    host, the workers on the others, each push one transfer per shard."""
    with Testbed(hosts=5, rate_mbit=1000.0,
                 rates={"h0": (1000.0, 50.0), "h1": (1000.0, 50.0)}) as tb:
        summary, records = run_policy(
            tb, "mlfabric", model_bytes=1 << 20, steps=4, tau_max=TAU_MAX, compute_ms=50,
            max_in_flight=1, link_mbit={"h0": (1000, 50), "h1": (1000, 50)},
            shard_hosts=["h1"])
        servers = {tb.host("h0").ip, tb.host("h1").ip}
    assert summary.pushes == len(records) == 3 * 4
    assert not {r["host"] for r in records} & servers
    versions = sorted(tuple(r["version"]) for r in records if r["applied"])
    assert all(len(v) == 2 for v in versions), versions  # one version per shard
    # Every applied push is applied on both shards: each shard's version
    # counts every applied push once.
    assert versions[-1] == (summary.applied, summary.applied), versions
    for r in records:
        assert r["applied"] or "dropped by the controller" in (r["reason"] or ""), r


@pytest.mark.root
@needs_root
def test_two_controllers_split_the_shards_and_one_killed_mid_run_loses_nothing(tmp_path):
    """Two shards (h0, h1), a controller beside each, sharing an etcd on h0.
    Half a second after the workers connected, the first controller (shard
    0's) is killed with SIGKILL and not started again. The workers wait
    for a controller (fallback "wait": nothing goes unscheduled): the
    second takes shard 0 over, and every push ends applied or with the
    controller's reason."""
    log = tmp_path / "decisions.jsonl"
    with Testbed(hosts=5, rate_mbit=1000.0,
                 rates={"h0": (1000.0, 50.0), "h1": (1000.0, 50.0)}) as tb:
        summary, records = run_policy(
            tb, "mlfabric", model_bytes=1 << 20, steps=6, tau_max=TAU_MAX, compute_ms=100,
            max_in_flight=1, link_mbit={"h0": (1000, 50), "h1": (1000, 50)},
            shard_hosts=["h1"], controllers=2, kill_controller_after=0.5, fallback="wait",
            decision_log=log)
    assert summary.pushes == len(records) == 3 * 6
    for r in records:
        assert r["applied"] or "dropped by the controller" in (r["reason"] or ""), r
    first = [json.loads(x) for x in log.read_text().splitlines()]
    second = [json.loads(x) for x in Path(f"{log}.1").read_text().splitlines()]
    def decisions(log: list[dict]) -> int:
        return sum(r["event"] in ("go", "drop") for r in log)

    # Every part decided once (a directive lost with the killed controller
    # is asked for again: at most a few twice).
    assert 2 * summary.pushes <= decisions(first) + decisions(second) <= 2 * summary.pushes + 3
    # The first decided shard 0's parts until it was killed; the second its
    # own shard's all along, and shard 0's from then on.
    assert 0 < decisions(first) < summary.pushes < decisions(second)


@pytest.mark.root
@needs_root
@pytest.mark.parametrize("fallback", ["fifo", "wait"])
def test_killing_the_controller_mid_run_loses_no_update_silently(fallback):
    with Testbed(hosts=4, rate_mbit=1000.0, rates={"h0": (1000.0, 100.0)}) as tb:
        summary, records = run_policy(
            tb, "mlfabric", model_bytes=1 << 20, steps=8, tau_max=TAU_MAX, compute_ms=150,
            max_in_flight=2, link_mbit={"h0": (1000, 100)}, fallback=fallback,
            restart_controller_after=1.0)
    # Every worker finished, and every push it made ended applied or with a reason.
    assert summary.pushes == len(records) == 3 * 8
    assert all(r["applied"] or r["reason"] for r in records)
    assert summary.applied > 0
    # The run spans the kill (1 s after the workers connected) and the second
    # without a controller, and workers kept pushing after the kill.
    assert summary.wall > 2.0
    assert max(r["start"] for r in records) - min(r["start"] for r in records) > 1.0


@pytest.mark.root
@needs_root
def test_controller_learns_available_bandwidth_from_agents(tmp_path):
    import subprocess
    import sys

    from mlfabric.controller.status_cli import fetch_status
    from mlfabric.errors import MlfabricError

    from support import JOB, TOKEN, agent_key_file, cluster_token_file, wait_until

    token = tmp_path / "job.token"
    token.write_bytes(TOKEN)
    token.chmod(0o600)
    py = [sys.executable, "-m", "mlfabric", "--log-level", "WARNING"]
    kw = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    with Testbed(hosts=2, rate_mbit=100.0) as tb:
        h0, h1 = tb.hosts
        for me, peer in ((h0, h1), (h1, h0)):
            tb.popen(me, [*py, "agent", "--name", me.ip, "--listen", f"{me.ip}:7400",
                          "--cluster-token-file", str(cluster_token_file()),
                          "--peer", f"{peer.ip}={peer.ip}:7400"], **kw)
        tb.popen(h0, [*py, "controller", "--listen", f"{h0.ip}:7071", "--job", JOB,
                      "--token-file", str(token), "--agent", f"{h1.ip}={h1.ip}:7400",
                      "--agent-key-file", str(agent_key_file()),
                      "--agent-interval", "0.2"], **kw)
        path = f"{h1.ip}->{h0.ip}"

        def measured() -> float:
            with h0.enter():
                try:
                    status = fetch_status(f"{h0.ip}:7071", JOB, TOKEN, timeout=2)
                except (OSError, MlfabricError):
                    return 0.0  # not up yet
            return status["measured_paths"].get(path, 0.0)

        # 100 Mbit/s of wire bytes; payload is a little less (headers).
        wait_until(lambda: 0.85 * 12.5e6 <= measured() <= 1.05 * 12.5e6, timeout=15,
                   what=f"the controller's picture of {path} near 100 Mbit/s")
        tb.set_rate(h0, down=50.0)
        wait_until(lambda: 0.85 * 6.25e6 <= measured() <= 1.05 * 6.25e6, timeout=10,
                   what=f"the controller's picture of {path} following 50 Mbit/s")
