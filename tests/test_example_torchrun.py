"""examples/torch_digits.py as a user runs it: `torchrun --nproc-per-node 4`, real
processes, a real parameter server; and its bad-configuration errors."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

import mlfabric
from mlfabric.errors import ConnectError
from mlfabric.wire import auth

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "torch_digits.py"
#: The accuracy examples/README.md states (measured 0.951-0.960 with the
#: defaults); the example itself prints whether it reached 0.90.
STATED_ACCURACY = 0.93
RUN_LIMIT = 120  # seconds for one torchrun; it takes 12-18 s on 2 cores


def torchrun(*args: str) -> list[str]:
    # --standalone: a rendezvous on a free port, so runs never collide on 29500.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "4", str(EXAMPLE), *args]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MLFABRIC_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(extra)
    return env


def run(argv: list[str], cwd: Path, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env or clean_env(), capture_output=True,
                          text=True, timeout=RUN_LIMIT)


#: Pushes per rank where a test's point is the configuration, not the
#: stated accuracy: 150 reached 0.944 (350: 0.958) and saves 4 s a run. Such
#: a run is held to the example's target (0.90), not to the accuracy the
#: README states for 350 steps: one reached 0.927 in a CI run.
SHORT = 150
TARGET = 0.90


def check_summary(path: Path, proc: subprocess.CompletedProcess[str], steps: int = 350) -> dict:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(path.read_text())
    assert summary["ranks"] == 4
    assert summary["applied"] + summary["dropped"] == 4 * steps
    assert summary["version"] == summary["applied"]
    assert sum(summary["delays"].values()) == summary["applied"]
    assert summary["accuracy"] >= (STATED_ACCURACY if steps == 350 else TARGET), summary
    assert f"held-out accuracy {summary['accuracy']:.4f} (reached the 0.90 target)" in \
        proc.stdout
    assert "Traceback" not in proc.stderr
    return summary


@pytest.mark.slow
def test_torchrun_example_with_its_own_server_reaches_the_stated_accuracy(tmp_path):
    out = tmp_path / "summary.json"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = run(torchrun("--json", str(out)), tmp_path, clean_env(TMPDIR=str(scratch)))
    check_summary(out, proc)
    assert not [p for p in scratch.iterdir() if p.name.startswith("mlfabric-torch-digits-")]
    # Rank 0 started a server on loopback and stopped it at the end.
    line = next(ln for ln in proc.stdout.splitlines() if "started a parameter server" in ln)
    address = line.split(" on ")[1].split()[0]
    token = tmp_path / "any.token"
    token.write_text("SYrNR50quh4m7kuaQ-f_3C76s_2r4C4r4JLMEv8sJS4")
    with pytest.raises(ConnectError):
        mlfabric.connect(address, job="digits", token_file=token, timeout=5)


class Server:
    """`mlfabric server` in a subprocess, waited for by its 'serving' line."""

    def __init__(self, cwd: Path, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlfabric", "server", "--listen", "127.0.0.1:0", *args],
            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        line = self.lines.get(timeout=30)
        assert line and "serving job" in line, (line, self.proc.stderr.read())
        self.address = line.split(" on ")[1].split()[0]

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def stop(self) -> str:
        """Stop it; its stderr (the log)."""
        self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=15)
        return err


@pytest.mark.slow
def test_torchrun_example_through_two_shards_from_a_config_file_and_the_environment(tmp_path):
    """Settings in layers: the config file names the wrong job and server,
    the environment the two shards and the token, a flag the job. (One run
    checks both what a file-configured job and a sharded job need: each
    torchrun costs about 20 s of the suite.)"""
    init = tmp_path / "init.npz"
    proc = run([sys.executable, str(EXAMPLE), "--write-init", str(init)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    with np.load(init) as npz:
        assert sorted(npz.files) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    token = tmp_path / "job.token"
    token.write_text(auth.generate_token())
    token.chmod(0o600)
    shards = [Server(tmp_path, "--job", "digits-shards", "--token-file", str(token), "--init",
                     str(init), "--momentum", "0.3", "--tau-max", "8", "--shard", f"{i}/2")
              for i in range(2)]
    logs = []
    try:
        cfg = tmp_path / "mlfabric.toml"
        cfg.write_text('server = "127.0.0.1:1"\njob = "wrong"\ntimeout = 20\n')
        out = tmp_path / "summary.json"
        addresses = ",".join(s.address for s in shards)
        proc = run(torchrun("--job", "digits-shards", "--steps", str(SHORT), "--json", str(out)),
                   tmp_path, clean_env(MLFABRIC_CONFIG=str(cfg), MLFABRIC_SERVER=addresses,
                                       MLFABRIC_TOKEN_FILE=str(token)))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        summary = json.loads(out.read_text())
        assert summary["ranks"] == 4 and summary["accuracy"] >= TARGET, summary
        assert summary["applied"] + summary["dropped"] == 4 * SHORT
        assert sum(summary["delays"].values()) == summary["applied"]
        # An update counts as applied when both shards applied their parts.
        versions = summary["version"]
        assert len(versions) == 2 and all(summary["applied"] <= v <= 4 * SHORT for v in versions)
        assert "started a parameter server" not in proc.stdout
        assert "Traceback" not in proc.stderr
        with mlfabric.connect(addresses, job="digits-shards", token_file=token) as ps:
            assert list(ps.pull(timeout=10)[0]) == versions
    finally:
        for s in shards:
            logs.append(s.stop())
    # Each rank connected to each shard under its torchrun rank.
    for log in logs:
        for rank in range(4):
            assert f":rank{rank} (" in log, log


@pytest.mark.parametrize(
    ("args", "files", "message"),
    [
        (["--server", "127.0.0.1:1", "--job", "j", "--token-file", "missing.token"], {},
         "setting token_file (from --token-file): token file 'missing.token' does not exist"),
        (["--server", "{refused}", "--job", "j", "--token-file", "job.token"], {},
         "cannot reach the server at {refused} (setting server (from --server)): Connection "
         "refused; start `mlfabric server` there or fix --server"),
        (["--config", "m.toml"], {"m.toml": "sever = '127.0.0.1:7070'\n"},
         "config file 'm.toml': unknown setting 'sever'; did you mean 'server'?"),
        (["--config", "m.toml", "--token-file", "job.token"],
         {"m.toml": "server = '127.0.0.1:7070'\njob = 'j'\npull_every = 'often'\n"},
         "setting pull_every (from config file 'm.toml') must be an integer, got 'often' (str)"),
    ],
    ids=["missing-token-file", "unreachable-server", "unknown-key", "wrong-type"],
)
def test_bad_configuration_ends_with_one_line(tmp_path, args, files, message):
    import socket

    (tmp_path / "job.token").write_text("SYrNR50quh4m7kuaQ-f_3C76s_2r4C4r4JLMEv8sJS4")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with socket.socket() as refused:  # bound, not listening: connections are refused
        refused.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{refused.getsockname()[1]}"
        argv = [a.format(refused=address) for a in args]
        proc = run([sys.executable, str(EXAMPLE), *argv], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("torch_digits.py: error: "), proc.stderr
    assert message.format(refused=address) in proc.stderr
