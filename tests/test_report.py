"""`mlfabric report`: the controller's decision log, read and drawn.

The log is recorded here from a real controller, server and client (the
controller's `mlfabric.decisions` logger written to a file, as
`--decision-log` does), so the reader is tested on what the controller
writes, not on a hand-made imitation."""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys

import pytest

import mlfabric
from mlfabric.errors import ConfigError
from mlfabric.tools import report

from support import JOB, TOKEN, ServerThread, make_model, random_update


def record(path, pushes: int = 8):
    """A decision log of `pushes` updates from one worker, all on base
    version 0 through a controller that drops every third (req 3, 6) and
    lets the rest go at once; the server's tau_max of 2 then applies three
    (delays 0, 1, 2) and refuses the rest as stale."""
    from mlfabric.controller.controller import Controller
    from mlfabric.scheduling.plan import PlanItem, Snapshot
    from mlfabric.server.store import ParameterStore

    def drop_thirds(snap: Snapshot) -> list[PlanItem]:
        return [PlanItem(t.id, drop="deadline_missed", detail="test") if t.req % 3 == 0
                else PlanItem(t.id, start=snap.now) for t in snap.pending]

    log = logging.getLogger("mlfabric.decisions")
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)
    model = make_model()
    try:
        with ServerThread(ParameterStore(model, tau_max=2)) as st, \
                ServerThread(None, endpoint=Controller(drop_thirds, job=JOB, token=TOKEN,
                                                       tau_max=2)) as ctl, \
                mlfabric.connect(st.address, job=JOB, token=TOKEN,
                                 controller=ctl.address) as ps:
            outcomes = [ps.push(random_update(model, seed=i), base_version=0).result(10)
                        for i in range(pushes)]
            server = st.address
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        handler.close()
    return outcomes, server


def test_the_schedule_read_from_a_recorded_log_is_what_happened(tmp_path):
    path = tmp_path / "decisions.jsonl"
    outcomes, server = record(path)
    s = report.read_schedule(path.read_text().splitlines())
    assert s.skipped == 0 and len(s.transfers) == 8
    # each transfer's outcome as its worker saw it: dropped, refused, applied
    seen = ["dropped" if o.reason and o.reason.startswith("dropped") else
            "applied" if o.applied else "refused" for o in outcomes]
    assert [t.outcome for t in sorted(s.transfers.values(), key=lambda t: t.id)] == seen
    assert seen == ["applied", "applied", "dropped", "applied", "refused", "dropped",
                    "refused", "refused"]
    assert s.counts() == {"applied": 3, "aggregated": 0, "refused": 3, "dropped": 2,
                          "unfinished": 0}
    assert s.links() == [server.rsplit(":", 1)[0]]  # the link each went into: the server's host
    for t in s.transfers.values():
        assert t.deadline_version == 2  # base version 0 + tau_max 2
        if t.outcome != "dropped":
            assert t.go is not None and t.done is not None and t.go <= t.done
    # the server reached version 2 with the second applied update: from then
    # on every transfer's deadline had passed
    applied = sorted(t.done for t in s.transfers.values() if t.outcome == "applied")
    assert {t.deadline for t in s.transfers.values()} == {applied[1]}


def test_lanes_keep_overlapping_transfers_apart():
    assert report.lanes([(0, 2), (1, 3), (2, 4), (5, 6), (1.5, 1.7)]) == [0, 1, 0, 0, 2]
    assert report.lanes([]) == []


def test_a_torn_log_is_read_up_to_its_last_whole_line():
    lines = [json.dumps({"event": "go", "at": 10.0, "id": 1, "host": "h", "dst": "s:1",
                         "nbytes": 4, "base_version": 0, "planned_seconds": 0.5}),
             json.dumps({"event": "done", "at": 10.4, "id": 1, "applied": True,
                         "version": 1}),
             '{"event": "go", "at": 1']
    s = report.read_schedule(lines)
    assert s.skipped == 1 and s.counts()["applied"] == 1 and s.start == 10.0
    # a window past the transfer keeps nothing, one across it keeps it
    assert not report.window(s, 1.0, 2.0).transfers
    assert list(report.window(s, 0.2, 0.3).transfers) == [1]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib is not installed (the report extra)")
def test_mlfabric_report_draws_the_recorded_log(tmp_path):
    path = tmp_path / "decisions.jsonl"
    record(path)
    out = tmp_path / "schedule.png"
    proc = subprocess.run([sys.executable, "-m", "mlfabric", "report", str(path), "-o", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (f"{out}: 8 transfers on 1 link(s) (3 applied, 3 refused, "
                                   f"2 dropped)")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("content", "args", "message"), [
    (None, [], "cannot read the decision log"),
    ("not json\n", [], "has no transfer decisions (1 lines that are not)"),
    ("GO", ["-o", "x.txt"], "give a .png, .svg or .pdf file"),
    ("GO", ["--since", "5", "--until", "1"], "--since 5 is not before --until 1"),
    ("GO", ["--since", "100"], "no transfer between --since 100.0"),
])
def test_bad_input_is_one_line_saying_what_to_give(tmp_path, content, args, message):
    path = tmp_path / "decisions.jsonl"
    if content == "GO":
        content = json.dumps({"event": "go", "at": 1.0, "id": 1, "host": "h", "dst": "s",
                              "nbytes": 4, "base_version": 0, "planned_seconds": 0.5}) + "\n"
    if content is not None:
        path.write_text(content)
    import argparse

    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        report.run(parser.parse_args([str(path), *args]))
