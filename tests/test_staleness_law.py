"""benchmarks/staleness_law.py: with one push in flight per worker, worker w's
updates wait for (A - a_w) / p_w others on average, and the mean over updates
is N - 1 when nothing is discarded, whatever the order (issue 34's delay goal
measured against it)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "staleness_law.py"
_spec = importlib.util.spec_from_file_location("staleness_law", SCRIPT)
assert _spec is not None and _spec.loader is not None
law = importlib.util.module_from_spec(_spec)
sys.modules["staleness_law"] = law  # dataclasses look their module up
_spec.loader.exec_module(law)


def two_workers(b_discards_odd: bool = False) -> list:
    """a every second (each cycle sees b's update half the time: delays 0, 1,
    0, ...); b every two seconds, seeing a's two; or, with `b_discards_odd`, b
    every second with the odd ones discarded."""
    out = [law.Outcome("a", float(t), t % 2) for t in range(21)]
    if b_discards_odd:
        out += [law.Outcome("b", float(t), None if t % 2 else 2) for t in range(21)]
    else:
        out += [law.Outcome("b", float(t), 2) for t in range(0, 21, 2)]
    return out


def test_nothing_discarded_the_mean_is_the_workers_less_one():
    w = law.window(two_workers(), warmup=0.0)
    assert (w.seconds, w.workers, w.updates, w.discarded) == (20.0, 2, 30, 0)
    assert w.mean == pytest.approx(1.0) and w.law == pytest.approx(1.0)
    assert w.per_worker == {"a": pytest.approx((0.5, 0.5)), "b": pytest.approx((2.0, 2.0))}
    assert w.within == pytest.approx((5 / 30) ** 0.5)  # a's 0s and 1s about 0.5
    assert w.between == pytest.approx((15 / 30) ** 0.5)  # 20 x 0.5^2 + 10 x 1^2
    assert w.spread == pytest.approx(((5 + 15) / 30) ** 0.5)


def test_a_discarded_update_counts_as_a_cycle_not_as_an_update():
    w = law.window(two_workers(b_discards_odd=True), warmup=0.0)
    assert (w.updates, w.discarded) == (30, 10)
    # A = 1.5/s; a waits for b's 0.5/s over its 1 s cycles, b for a's 1/s over 1 s.
    assert w.per_worker["a"][1] == pytest.approx(0.5)
    assert w.per_worker["b"][1] == pytest.approx(1.0)
    assert w.law == pytest.approx((1.0 * 0.5 + 0.5 * 1.0) / 1.5)


def test_bad_windows_are_refused_with_what_to_do():
    with pytest.raises(ValueError, match="no applied update"):
        law.window([law.Outcome("a", 1.0, None)], warmup=0.0)
    with pytest.raises(ValueError, match="lower --warmup"):
        law.window(two_workers(), warmup=30.0)
    idle = [*two_workers(), law.Outcome("c", 0.0, None), law.Outcome("c", 25.0, None)]
    with pytest.raises(ValueError, match=r"workers \['c'\] had nothing applied"):
        law.window(idle, warmup=0.0)


def test_the_simulator_follows_the_law_for_either_order():
    """Both policies, nothing discarded: N - 1 on the steady window, and each
    worker's mean within a few hundredths of (A - a_w) / p_w, although the
    orders differ (mlfabric's slowest worker waits longer than fifo's)."""
    from mlfabric.sim.engine import MIB, RateChange, Scenario, simulate

    slow = (RateChange(0, "h1", up_mbit=20), RateChange(0, "h2", up_mbit=30),
            RateChange(0, "h3", up_mbit=50))
    sc = Scenario(workers=6, server_down_mbit=80, update_bytes=2 * MIB, compute=1.0, steps=60,
                  tau_max=None, changes=slow, seed=0)
    slowest = {}
    for policy in ("fifo", "mlfabric"):
        w = law.window(law.from_records(simulate(sc, policy).records), warmup=5.0)
        assert w.discarded == 0 and w.workers == 6
        assert w.mean == pytest.approx(5.0, abs=0.05), (policy, w)
        for mean, expect in w.per_worker.values():
            assert mean == pytest.approx(expect, abs=0.1), (policy, w.per_worker)
        slowest[policy] = w.per_worker["w0"][0]
    assert slowest["mlfabric"] > slowest["fifo"] + 0.3, slowest


def test_logs_of_bench_controller_are_read_and_bad_ones_refused(tmp_path):
    events = []
    for o in two_workers(b_discards_odd=True):
        if o.worker == "b" and o.delay is None:
            events.append({"event": "drop", "at": o.at, "host": o.worker, "reason": "stale"})
        else:
            events.append({"event": "done", "at": o.at, "host": o.worker,
                           "applied": o.delay is not None, "delay": o.delay})
    events.append({"event": "go", "at": 3.0, "host": "a"})  # not an outcome
    (tmp_path / "x-mlfabric-r1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    r = subprocess.run([sys.executable, str(SCRIPT), "logs", str(tmp_path / "x"), "--warmup",
                        "0"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("mlfabric round 1: window 20.0 s, 30 updates of 2 workers: "
                               "10 discarded: delay mean 1.000"), r.stdout
    assert "the law from the rates 0.667" in r.stdout
    (tmp_path / "y-fifo-r1.jsonl").write_text('{"event": "done"\nnot json\n')
    r = subprocess.run([sys.executable, str(SCRIPT), "logs", str(tmp_path / "y")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "y-fifo-r1.jsonl:1: not JSON" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, str(SCRIPT), "logs", str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "--decision-log PREFIX" in r.stderr, r.stderr
