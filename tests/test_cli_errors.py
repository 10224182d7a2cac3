"""Misconfiguration is a one-line error, never a traceback or a silent
downgrade (issue 33): each case as a new user met it, by running the command."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from support import JOB, TOKEN


def mlfabric_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "mlfabric", "--log-level", "WARNING", *args]


@pytest.fixture
def files(tmp_path):
    """The job's token file and a valid model, as every command below needs."""
    token = tmp_path / "job.token"
    token.write_bytes(TOKEN)
    token.chmod(0o600)
    np.savez(tmp_path / "model.npz", w=np.zeros(3, np.float32))
    return tmp_path


def command(name: str, d) -> list[str]:
    """`name`'s command line, complete but for the flags under test."""
    listener = ["--listen", "127.0.0.1:0", "--job", JOB, "--token-file", str(d / "job.token")]
    return {
        "server": ["server", *listener, "--init", str(d / "model.npz")],
        "replica": ["server", "--role", "replica", *listener, "--init", str(d / "model.npz")],
        "controller": ["controller", *listener],
        "agent": ["agent", "--listen", "127.0.0.1:0"],
        "promote": ["promote", "--replica", "127.0.0.1:1", "--force", "--job", JOB,
                    "--token-file", str(d / "job.token")],
        "status": ["status", "--controller", "127.0.0.1:1", "--job", JOB, "--token-file",
                   str(d / "job.token")],
    }[name]


def assert_one_line_error(d, argv: list[str], message: str) -> None:
    proc = subprocess.run(mlfabric_cmd(*argv), capture_output=True, text=True, timeout=60,
                          cwd=d)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.splitlines() == [f"mlfabric {argv[0]}: error: {message}"], proc.stderr


# -- 2. and 5. --init that is not a .npz model ------------------------------------------

ACCEPTED = ("--init takes a .npz file of named float32 arrays, as np.savez('model.npz', "
            "w=w, b=b) writes")


@pytest.mark.parametrize(("name", "write", "what"), [
    ("model.npy", lambda p: np.save(p, np.zeros(3, np.float32)),
     "is a single array (.npy), not a model"),
    ("x.npz", lambda p: p.write_text("a text file\n"),
     "is not a valid .npz model (not a zip archive)"),
    ("random.npz", lambda p: p.write_bytes(np.random.default_rng(0).bytes(256)),
     "is not a valid .npz model (not a zip archive)"),
], ids=["npy", "text", "random-bytes"])
def test_an_init_that_is_not_a_npz_model_is_a_one_line_error(files, name, write, what):
    write(files / name)
    assert (files / name).exists()
    assert_one_line_error(files, [*command("server", files), "--init", name],
                          f"--init {name!r} {what}; {ACCEPTED}")


# -- 3. --decision-log in a folder that does not exist ------------------------------------


def test_a_decision_log_in_a_missing_folder_is_a_one_line_error(files):
    path = str(files / "no-such-folder" / "decisions.jsonl")
    assert_one_line_error(
        files, [*command("controller", files), "--decision-log", path],
        f"--decision-log {path!r}: the folder {str(files / 'no-such-folder')!r} does not "
        f"exist; create it or give a path in one that does")


def test_a_decision_log_that_is_a_folder_is_a_one_line_error(files):
    assert_one_line_error(
        files, [*command("controller", files), "--decision-log", str(files)],
        f"--decision-log {str(files)!r} cannot be opened for appending: Is a directory")


# -- 4. an --interface that does not exist ------------------------------------------------


def interfaces_in_proc_net_dev() -> list[str]:
    with open("/proc/net/dev") as f:
        names = [line.partition(":")[0].strip() for line in f.readlines()[2:]]
    return sorted(n for n in names if n != "lo")


@pytest.mark.parametrize(("interface", "why"), [
    ("eht0", "does not exist on this host"),
    ("lo", "is loopback, which carries none of the links' traffic"),
])
def test_the_agent_refuses_an_interface_it_cannot_measure(files, interface, why):
    have = ", ".join(interfaces_in_proc_net_dev()) or "none but loopback"
    assert_one_line_error(
        files, [*command("agent", files), "--interface", interface],
        f"interface {interface!r} {why}; this host's interfaces: {have} (or leave "
        f"--interface out to count them all)")
