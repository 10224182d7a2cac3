"""The `mlfabric` command as a user runs it: real processes, real signals."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import urllib.request

import numpy as np
import pytest

import mlfabric

from support import JOB, TOKEN, free_port, make_model


def mlfabric_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "mlfabric", *args]


class Server:
    """`mlfabric server` in a subprocess, waited for by its 'serving' line."""

    def __init__(self, tmp_path, *extra: str, model=None) -> None:
        self.token_file = tmp_path / "job.token"
        self.token_file.write_bytes(TOKEN)
        self.token_file.chmod(0o600)
        init = tmp_path / "init.npz"
        np.savez(init, **(model if model is not None else make_model()))
        self.proc = subprocess.Popen(
            mlfabric_cmd("server", "--listen", "127.0.0.1:0", "--job", JOB,
                         "--token-file", str(self.token_file), "--init", str(init), *extra),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        line = self.lines.get(timeout=30)
        assert line and "serving job" in line, line
        self.line = line
        self.address = line.split(" on ")[1].split()[0]

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def stop(self, sig=signal.SIGTERM) -> tuple[int, str, str]:
        self.proc.send_signal(sig)
        code = self.proc.wait(15)
        rest = []
        while (line := self.lines.get(timeout=5)) is not None:
            rest.append(line)
        return code, "".join(rest), self.proc.stderr.read()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_server_serves_and_shuts_down_cleanly_on_signals(tmp_path, sig):
    model = make_model()
    server = Server(tmp_path, "--momentum", "0.5", "--tau-max", "3", model=model)
    assert server.line.rstrip().endswith("version 0, tau_max 3)"), server.line
    with mlfabric.connect(server.address, job=JOB, token_file=server.token_file) as ps:
        version, params = ps.pull(timeout=10)
        assert version == 0
        np.testing.assert_array_equal(params["w"], model["w"])
        assert ps.tau_max == 3 and ps.momentum == 0.5
        assert ps.push(params, base_version=0).result(10).applied
    code, out, err = server.stop(sig)
    assert code == 0, err
    assert "stopped at version 1" in out
    assert "Traceback" not in err


def test_server_exports_prometheus_metrics(tmp_path):
    port = free_port()
    server = Server(tmp_path, "--metrics-port", str(port), "--metrics-host", "127.0.0.1")
    try:
        with mlfabric.connect(server.address, job=JOB, token_file=server.token_file) as ps:
            version, params = ps.pull(timeout=10)
            zero = {n: np.zeros_like(a) for n, a in params.items()}
            ps.push(zero, base_version=version).result(10)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        text = body.decode()
        assert "mlfabric_server_updates_applied_total 1.0" in text
        assert "mlfabric_server_pulls_total 1.0" in text
        assert 'mlfabric_server_updates_rejected_total{reason="stale"} 0.0' in text
        assert 'mlfabric_server_update_delay_versions_bucket{le="0.0"} 1.0' in text
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: ["--init", str(d / "missing.npz")], "no such file"),
        (lambda d: ["--init", str(_npz(d, a=np.zeros(3)))], "is float64; mlfabric serves float32"),
        (lambda d: ["--init", str(_write(d / "bad.npz", b"not a zip"))],
         "is not a valid .npz model (not a zip archive); --init takes a .npz file"),
        (lambda d: ["--token-file", str(d / "nope")], "does not exist: create it"),
        (lambda d: ["--listen", "nohost"], "address must be HOST:PORT"),
        (lambda d: ["--momentum", "1.5"], "momentum must be in"),
        # issue 33: -2 and -16 used to start a server with no bound at all
        (lambda d: ["--tau-max", "-2"],
         "--tau-max must be a number of versions in 0..1000000, or -1 for no bound; got -2"),
        (lambda d: ["--job", " "], "--job must name the job, got ' '"),
    ],
    ids=["missing-init", "float64-init", "corrupt-init", "missing-token", "bad-listen",
         "bad-momentum", "bad-tau-max", "empty-job"],
)
def test_server_configuration_errors_are_one_line(tmp_path, setup, message):
    token = _write(tmp_path / "job.token", TOKEN)
    token.chmod(0o600)
    init = _npz(tmp_path, w=np.zeros(3, np.float32))
    args = {"--listen": "127.0.0.1:0", "--job": JOB, "--token-file": str(token),
            "--init": str(init)}
    override = setup(tmp_path)
    args.update(dict(zip(override[::2], override[1::2], strict=True)))
    argv = [x for kv in args.items() for x in kv]
    proc = subprocess.run(mlfabric_cmd("server", *argv), capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def _npz(d, **arrays):
    path = d / "model.npz"
    np.savez(path, **arrays)
    return path


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def test_server_warns_about_a_token_file_others_can_read(tmp_path):
    token = _write(tmp_path / "job.token", TOKEN)
    token.chmod(0o644)
    proc = subprocess.run(
        mlfabric_cmd("server", "--listen", "127.0.0.1:0", "--job", JOB, "--token-file",
                     str(token), "--init", str(tmp_path / "missing.npz")),
        capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert "readable by other users: chmod 600 it" in proc.stderr


def test_version_and_help(tmp_path):
    out = subprocess.run(mlfabric_cmd("--version"), capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert out.stdout.strip() == f"mlfabric {mlfabric.__version__}"
    out = subprocess.run(mlfabric_cmd("--help"), capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert "server" in out.stdout and "demo" in out.stdout


def test_demo_trains_to_the_target_accuracy(tmp_path):
    summary_file = tmp_path / "summary.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        mlfabric_cmd("demo", "--json", str(summary_file)),
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(summary_file.read_text())
    assert summary["accuracy"] >= 0.90
    assert summary["applied"] + summary["dropped"] == 4 * 350
    assert summary["version"] == summary["applied"]
    assert summary["delay"]["count"] == summary["applied"]
    assert summary["delay"]["max"] <= 8
    assert sum(summary["delay"]["histogram"].values()) == summary["applied"]
    for text in ("held-out accuracy", "updates applied", "updates dropped", "staleness"):
        assert text in proc.stdout
    assert "Traceback" not in proc.stderr


def test_demo_trains_with_sharded_servers(tmp_path):
    summary_file = tmp_path / "summary.json"
    proc = subprocess.run(
        mlfabric_cmd("demo", "--shards", "3", "--workers", "2", "--steps", "300", "--json",
                     str(summary_file)),
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "3 parameter server shards" in proc.stdout
    summary = json.loads(summary_file.read_text())
    assert summary["accuracy"] >= 0.90
    assert summary["applied"] + summary["dropped"] == 2 * 300
    # A push counts as applied when every shard applied its part; a shard may
    # have applied the part of a push another shard refused.
    assert len(summary["version"]) == 3
    assert all(summary["applied"] <= v <= 2 * 300 for v in summary["version"])
    assert "shard versions" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_demo_rejects_bad_arguments(tmp_path):
    proc = subprocess.run(mlfabric_cmd("demo", "--workers", "0"), capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2
    assert "--workers must be at least 1, got 0" in proc.stderr


def test_demo_stops_cleanly_on_ctrl_c(tmp_path):
    """Ctrl-C reaches the demo's whole process group, as from a terminal."""
    proc = subprocess.Popen(
        mlfabric_cmd("demo", "--steps", "1000000"), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd=tmp_path, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)],
                     daemon=True).start()
    address = None
    while address is None:
        line = lines.get(timeout=60)
        assert line is not None, proc.stderr.read()
        if line.startswith("server listening on "):
            address = line.split()[3].rstrip(";")
    # Wait until training is under way (the first progress line), then Ctrl-C.
    while not (line := lines.get(timeout=60)).startswith("["):
        pass
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(30) == 130
    err = proc.stderr.read()
    assert "interrupted" in err
    assert "Traceback" not in err
    with pytest.raises(mlfabric.ConnectError):
        mlfabric.connect(address, job="demo", token=TOKEN, timeout=2)


def test_client_metrics_count_requests(tmp_path):
    from mlfabric.runtime.metrics import ClientMetrics

    server = Server(tmp_path)
    try:
        metrics = ClientMetrics()
        with mlfabric.connect(server.address, job=JOB, token_file=server.token_file,
                              metrics=metrics) as ps:
            version, params = ps.pull(timeout=10)
            for _ in range(3):
                ps.push(params, base_version=version).result(10)
        assert metrics.pushes.labels("applied")._value.get() == 3
        assert metrics.push_seconds._sum.get() > 0
        assert metrics.pull_seconds._sum.get() > 0
        assert metrics.sent_bytes._value.get() > 3 * sum(a.nbytes for a in params.values())
        assert metrics.received_bytes._value.get() > sum(a.nbytes for a in params.values())
    finally:
        server.stop()


def test_tau_max_is_a_number_of_versions_or_minus_one():
    from mlfabric.errors import ConfigError
    from mlfabric.transport.listener import parse_tau_max

    assert parse_tau_max(None) is None and parse_tau_max(-1) is None
    assert (parse_tau_max(0), parse_tau_max(16)) == (0, 16)
    for bad in (-2, -5, -16):
        with pytest.raises(ConfigError, match=f"or -1 for no bound; got {bad}$"):
            parse_tau_max(bad)


def test_the_controller_refuses_a_negative_tau_max_in_one_line(tmp_path):
    token = _write(tmp_path / "job.token", TOKEN)
    token.chmod(0o600)
    proc = subprocess.run(
        mlfabric_cmd("controller", "--log-level", "WARNING", "--listen", "127.0.0.1:0",
                     "--job", JOB, "--token-file", str(token), "--tau-max", "-16"),
        capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "mlfabric controller: error: --tau-max must be a number of versions in 0..1000000, or "
        "-1 for no bound; got -16"], proc.stderr


def test_log_level_is_taken_before_and_after_the_subcommand():
    """Issue 33: `mlfabric server --log-level DEBUG ...` was an error; only
    `mlfabric --log-level DEBUG server ...` worked."""
    from mlfabric.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["demo"]).log_level == "INFO"
    assert parser.parse_args(["--log-level", "WARNING", "demo"]).log_level == "WARNING"
    assert parser.parse_args(["demo", "--log-level", "DEBUG"]).log_level == "DEBUG"
    assert parser.parse_args(["--log-level", "ERROR", "demo", "--log-level",
                              "DEBUG"]).log_level == "DEBUG"
    # Only the named command's module is loaded: found however the options
    # before it are spelt (argparse takes `--log` for --log-level).
    from mlfabric.cli import _command_in

    for argv in (["demo"], ["--log-level", "DEBUG", "demo"], ["--log-level=DEBUG", "demo"],
                 ["--log", "DEBUG", "demo", "--steps", "3"]):
        assert _command_in(argv) == "demo", argv
    assert _command_in(["--version"]) is None and _command_in(["bogus"]) is None
