"""The guide's generated reference pages match the code they are generated from."""

from __future__ import annotations

import difflib
import subprocess
import sys
from pathlib import Path

import pytest

from mlfabric import cli, config
from mlfabric.runtime import metrics
from mlfabric.tools import docgen

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("page", sorted(docgen.PAGES))
def test_generated_page_is_up_to_date(page):
    committed = (ROOT / docgen.PAGES[page]).read_text()
    generated = docgen.GENERATORS[page]()
    if committed != generated:
        diff = "".join(difflib.unified_diff(
            committed.splitlines(keepends=True), generated.splitlines(keepends=True),
            "committed", "generated", n=1))
        pytest.fail(f"{docgen.PAGES[page]} is out of date; regenerate it with "
                    f"`{docgen._regenerate(page)}`:\n{diff[:3000]}")


def test_configuration_reference_covers_every_flag_and_setting():
    text = docgen.config_reference()
    parser = cli.build_parser()
    for name in cli.COMMANDS:
        assert f"### `mlfabric {name}`" in text
    for name, sub in docgen._subparsers(parser).items():
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in text, f"mlfabric {name} {flag} is missing"
    for s in config.SETTINGS:
        assert f"| `{s.name}` | `{s.flag}` | `{s.env}` |" in text


def test_metrics_reference_lists_every_metric_as_scraped():
    from prometheus_client import CollectorRegistry, generate_latest

    text = docgen.metrics_reference()
    for cls in (metrics.ServerMetrics, metrics.ClientMetrics, metrics.ControllerMetrics,
                metrics.AgentMetrics):
        exposition = generate_latest(cls(CollectorRegistry()).registry).decode()
        # Every family a scrape announces, by the name Prometheus stores it under
        # (the client's own *_created timestamps aside).
        for line in exposition.splitlines():
            if line.startswith("# TYPE ") and not line.split()[2].endswith("_created"):
                _, _, name, kind = line.split()
                assert f"| `{name}` | {kind} |" in text, f"{name} ({kind}) is missing"


def test_the_generator_prints_a_page_from_the_command_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mlfabric.docgen", "metrics"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == docgen.metrics_reference()
    bad = subprocess.run([sys.executable, "-m", "mlfabric.docgen", "flags"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'flags'" in bad.stderr
