"""benchmarks/bench_replan.py --against: another checkout's controller timed
in the same process, alternated with this tree's (how before and after are
compared on a machine whose speed drifts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import mlfabric
from mlfabric.scheduling import schedule

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_replan.py"
PACKAGE = Path(mlfabric.__file__).resolve().parent  # the one imported: built or installed

pytestmark = pytest.mark.skipif(not schedule.has_kernel(),
                                reason="the column planner needs the compiled core")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_against_times_the_other_tree_and_gives_the_ratio():
    """This tree against a copy of itself: both sides timed, a ratio printed,
    and the copy really is a second package (its own planner)."""
    r = run("--pending", "300", "--loads", "fresh", "--rounds", "2", "--steps", "5",
            "--planners", "columns", "--against", str(PACKAGE))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(line.split()[:1] == ["columns"] for line in lines), r.stdout
    assert any(line.split()[:1] == ["against"] for line in lines), r.stdout
    ratio = [line for line in lines if "columns / against: p50" in line]
    assert len(ratio) == 1 and float(ratio[0].split()[4]) > 0, r.stdout


def test_against_a_directory_that_is_no_built_package_says_what_to_do(tmp_path):
    r = run("--pending", "300", "--planners", "columns", "--against", str(tmp_path))
    assert r.returncode != 0
    assert f"--against {tmp_path}: not a built mlfabric package" in r.stderr
    assert "python setup.py build_ext --inplace" in r.stderr
