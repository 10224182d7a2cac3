"""Lint and types as part of the tests: the repository passes ruff and mypy."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str) -> str:
    path = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(path).exists():
        pytest.skip(f"{name} is not installed: pip install '.[test]'")
    return path


def test_ruff_passes():
    proc = subprocess.run(
        [_tool("ruff"), "check", "src", "tests", "benchmarks", "examples"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_passes():
    proc = subprocess.run(
        [_tool("mypy"), "src/mlfabric"], cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
