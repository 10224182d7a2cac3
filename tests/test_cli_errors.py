"""Misconfiguration is a one-line error, never a traceback or a silent
downgrade (issue 33): each case as a new user met it, by running the command."""

from __future__ import annotations

import json
import queue
import re
import socket
import subprocess
import sys
import threading
import urllib.request

import numpy as np
import pytest

from support import JOB, TOKEN, cluster_token_file


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
        "agent": ["agent", "--listen", "127.0.0.1:0", "--cluster-token-file",
                  str(cluster_token_file())],
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


# -- 1. a metrics port in use ---------------------------------------------------------


@pytest.mark.parametrize("name", ["server", "replica", "controller", "agent"])
def test_a_metrics_port_in_use_is_a_one_line_error(files, name):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert_one_line_error(
            files, [*command(name, files), "--metrics-port", str(port)],
            f"cannot serve metrics on 127.0.0.1:{port}: Address already in use; give another "
            f"--metrics-port, or 0 to pick a free one")


def test_a_metrics_host_that_is_not_this_hosts_is_a_one_line_error(files):
    # 192.0.2.0/24 is TEST-NET-1: no host has it
    assert_one_line_error(
        files, [*command("server", files), "--metrics-port", "0", "--metrics-host",
                "192.0.2.1"],
        "cannot serve metrics on 192.0.2.1:0: Cannot assign requested address; give "
        "--metrics-host an address of this host")


METRICS_HOST_ALONE = ("--metrics-host without --metrics-port: metrics are off without a "
                      "port; give --metrics-port P (0 picks a free one), or drop --metrics-host")


@pytest.mark.parametrize("name", [
    "server", "replica", "controller", "agent",
])
def test_a_metrics_host_without_a_metrics_port_is_a_one_line_error(files, name):
    # it was ignored: the process ran without metrics, as if it had none to serve
    assert_one_line_error(files, [*command(name, files), "--metrics-host", "127.0.0.1"],
                          METRICS_HOST_ALONE)


def test_an_empty_metrics_host_is_a_one_line_error(files):
    # it fell back to the --listen host without a word
    assert_one_line_error(files, [*command("controller", files), "--metrics-port", "0",
                                  "--metrics-host", ""],
                          "--metrics-host must name an address of this host, got ''")


# -- 6. metrics on the listen host by default, and the start line says where ------------


class Started:
    """A long-running command, up to its start line (stopped with SIGTERM)."""

    def __init__(self, d, argv: list[str]) -> None:
        self.proc = subprocess.Popen(mlfabric_cmd(*argv), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=d)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: lines.put(self.proc.stdout.readline()),
                         daemon=True).start()
        self.line = lines.get(timeout=60)
        assert self.line, self.proc.stderr.read() if self.proc.poll() is not None else ""

    def stop(self) -> None:
        self.proc.terminate()
        assert self.proc.wait(15) == 0, self.proc.stderr.read()


def test_a_servers_controller_must_be_an_address(files):
    """`mlfabric server --controller` (the server tells it of each landing)
    takes HOST:PORT, one or several: anything else is a one-line error."""
    assert_one_line_error(files, [*command("server", files), "--controller", "10.0.0.9"],
                          "--controller: address must be HOST:PORT, got '10.0.0.9'")
    assert_one_line_error(files, [*command("server", files), "--controller",
                                  "10.0.0.9:7071,10.0.0.10:99999"],
                          "--controller: address must be HOST:PORT with a port in 0..65535, "
                          "got '10.0.0.10:99999'")


def test_an_aggregator_needs_the_servers_it_may_forward_to(files):
    """Issue 33: an aggregator dialled whatever server a member named; it
    now starts only with the list of the job's servers, and says so."""
    aggregate = ["--aggregate", "127.0.0.1:0", "--job", JOB, "--token-file",
                 str(files / "job.token")]
    assert_one_line_error(files, [*command("agent", files), *aggregate],
                          "--aggregate 127.0.0.1:0 needs --servers HOST:PORT[,HOST:PORT...]: "
                          "the job's servers (shards and replicas too) as the workers name "
                          "them; the aggregator forwards to no other address")
    # from the config file, as every agent setting
    (files / "agent.json").write_text(json.dumps({
        "aggregate": "127.0.0.1:0", "job": JOB, "token_file": str(files / "job.token"),
        "servers": ["127.0.0.1:7070", "127.0.0.1:7071"]}))
    started = Started(files, [*command("agent", files), "--config", str(files / "agent.json")])
    try:
        assert re.search(r"; aggregating job '[^']+' on 127\.0\.0\.1:\d+ \(forwards to "
                         r"127\.0\.0\.1:7070,127\.0\.0\.1:7071 only\)$", started.line.strip()), \
            started.line
    finally:
        started.stop()


def metrics_url(line: str) -> str:
    return line.split("metrics ")[1].split(")")[0]


@pytest.mark.parametrize("name", ["server", "replica", "controller", "agent"])
def test_metrics_are_served_on_the_listen_host_by_default(files, name):
    started = Started(files, [*command(name, files), "--metrics-port", "0"])
    try:
        url = metrics_url(started.line)
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics"), started.line
        port = int(url.split(":")[2].split("/")[0])
        assert port != 0
        with urllib.request.urlopen(url, timeout=10) as answer:
            assert b"mlfabric_" in answer.read()
        # Bound to 127.0.0.1, not 0.0.0.0: another loopback address is refused.
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", port), timeout=10).close()
    finally:
        started.stop()


def test_an_explicit_metrics_host_is_taken_and_printed(files):
    started = Started(files, [*command("server", files), "--metrics-port", "0",
                              "--metrics-host", "127.0.0.2"])
    try:
        url = metrics_url(started.line)
        assert url.startswith("http://127.0.0.2:"), started.line
        with urllib.request.urlopen(url, timeout=10) as answer:
            assert b"mlfabric_server_model_version" in answer.read()
    finally:
        started.stop()


def test_the_start_line_names_no_metrics_when_they_are_off(files):
    started = Started(files, command("server", files))
    try:
        assert started.line.rstrip().endswith("version 0, tau_max 16)"), started.line
    finally:
        started.stop()


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


# -- every numeric flag has its range ---------------------------------------------------

PORT = "must be a port number in 0..65535 (0 picks a free port), got"


@pytest.mark.parametrize(("name", "flags", "message"), [
    ("server", ["--sample-interval", "0"],
     "--sample-interval must be a positive number of seconds, got 0.0"),
    ("server", ["--sample-interval", "inf"],
     "--sample-interval must be a positive number of seconds, got inf"),
    ("replica", ["--recovery-seconds", "-1"],
     "--recovery-seconds must be a finite number of seconds >= 0, got -1.0"),
    ("replica", ["--recovery-seconds", "inf"],
     "--recovery-seconds must be a finite number of seconds >= 0, got inf"),
    ("replica", ["--max-pending", "0"], "--max-pending must be in 1..1024, got 0"),
    ("replica", ["--max-pending", "1025"], "--max-pending must be in 1..1024, got 1025"),
    ("server", ["--max-pending", "1000000"], "--max-pending must be in 1..1024, got 1000000"),
    ("server", ["--chunk-bytes", "0"], "--chunk-bytes must be at least 1, got 0"),
    ("server", ["--momentum", "1"], "--momentum must be in [0, 1), got 1.0"),
    ("server", ["--momentum", "nan"], "--momentum must be in [0, 1), got nan"),
    ("server", ["--checkpoint-interval", "inf"],
     "--checkpoint-interval must be a positive number of seconds, got inf"),
    ("server", ["--keep-checkpoints", "0"], "--keep-checkpoints must be in 1..1000, got 0"),
    ("server", ["--keep-checkpoints", "1001"],
     "--keep-checkpoints must be in 1..1000, got 1001"),
    ("server", ["--metrics-port", "65536"], f"--metrics-port {PORT} 65536"),
    ("replica", ["--metrics-port", "-1"], f"--metrics-port {PORT} -1"),
    ("server", ["--handshake-timeout", "0"],
     "--handshake-timeout must be a positive number of seconds, got 0.0"),
    ("server", ["--tau-max", "-2"],
     "--tau-max must be a number of versions in 0..1000000, or -1 for no bound; got -2"),
    ("server", ["--tau-max", "1000001"],
     "--tau-max must be a number of versions in 0..1000000, or -1 for no bound; got 1000001"),
    # past 2**64 it started a server whose welcome no client could read
    ("replica", ["--tau-max", "18446744073709551616"],
     "--tau-max must be a number of versions in 0..1000000, or -1 for no bound; got "
     "18446744073709551616"),
    ("server", ["--shard", "2/2"], "--shard 2/2: the index I must be in 0..S-1 (S = 2), got 2"),
    ("controller", ["--default-link-mbit", "inf"],
     "--default-link-mbit must be a positive number of Mbit/s, got inf"),
    ("controller", ["--link", "h=nan"],
     "--link 'h=nan': expected HOST=UP or HOST=UP/DOWN in Mbit/s, e.g. 10.0.0.5=1000/400"),
    ("controller", ["--link", "h=10/inf"],
     "--link 'h=10/inf': expected HOST=UP or HOST=UP/DOWN in Mbit/s, e.g. 10.0.0.5=1000/400"),
    ("controller", ["--agent-interval", "0"],
     "--agent-interval must be a positive number of seconds, got 0.0"),
    ("controller", ["--agent-rediscover", "0"],
     "--agent-rediscover must be a positive number of seconds, got 0.0"),
    ("controller", ["--agents-dns", "agents.example"],
     "--agents-dns: address must be HOST:PORT, got 'agents.example': the agents' name and "
     "port, e.g. mlfabric-agent.mlfabric.svc:7400"),
    ("controller", ["--agents-dns", "agents.example:0"],
     "--agents-dns agents.example:0: give the agents' port (7400 unless their --listen says "
     "otherwise)"),
    ("controller", ["--agents-dns", "agents.example:7400"],
     "--agents-dns needs --agent-key-file PATH: the agents serve only clients that log in; "
     "the operator makes the job's key with `mlfabric token agent-key --cluster-token-file "
     f"FILE --job {JOB} KEYFILE`"),
    ("controller", ["--max-fan-in", "1"], "--max-fan-in must be in 2..64, got 1"),
    ("controller", ["--idle-factor", "-1"], "--idle-factor must be a number >= 0 or 'off', "
     "got '-1'"),
    ("controller", ["--idle-factor", "never"], "--idle-factor must be a number >= 0 or "
     "'off', got 'never'"),
    ("controller", ["--group-wait", "inf"],
     "--group-wait must be a finite number of seconds >= 0 (0: aggregation never stalls the "
     "server), got inf"),
    ("controller", ["--div-max", "inf", "--momentum", "0.5"],
     "--div-max must be a positive number, got inf"),
    ("controller", ["--momentum", "1.5"], "--momentum must be in [0, 1), got 1.5"),
    ("controller", ["--heartbeat-interval", "-1"],
     "--heartbeat-interval must be a positive number of seconds, got -1.0"),
    ("controller", ["--heartbeat-timeout", "inf"],
     "--heartbeat-timeout must be a positive number of seconds, got inf"),
    ("controller", ["--heartbeat-interval", "2"],
     "--heartbeat-interval must be below --heartbeat-timeout (1.0), got 2.0"),
    ("controller", ["--replica-gap-timeout", "0"],
     "--replica-gap-timeout must be a positive number of seconds, got 0.0"),
    ("controller", ["--replica-lag-timeout", "nan"],
     "--replica-lag-timeout must be a positive number of seconds, got nan"),
    ("controller", ["--metrics-port", "70000"], f"--metrics-port {PORT} 70000"),
    ("controller", ["--tau-max", "-5"],
     "--tau-max must be a number of versions in 0..1000000, or -1 for no bound; got -5"),
    ("controller", ["--tau-max", "1000001"],
     "--tau-max must be a number of versions in 0..1000000, or -1 for no bound; got 1000001"),
    ("controller", ["--handshake-timeout", "inf"],
     "--handshake-timeout must be a positive number of seconds, got inf"),
    ("agent", ["--metrics-port", "65536"],
     "metrics port must be in 0..65535 (0 picks a free port), got 65536"),
    ("agent", ["--probe-budget", "0.9"], "probe budget must be a fraction in (0, 0.5], got 0.9"),
    ("agent", ["--stale-after", "inf"],
     "stale-after must be a positive number of seconds, got inf"),
    ("agent", ["--nic-mbit", "0"],
     "nic-mbit must be the link's speed in Mbit/s, above 0, got 0.0"),
    ("agent", ["--job-port", "0"], "job port must be a port number in 1..65535, got 0"),
    ("agent", ["--job-rediscover", "3601"],
     "job-rediscover must be a number of seconds in [0, 3600], got 3601.0"),
    ("agent", ["--aggregate", "127.0.0.1:0", "--job", JOB, "--token-file", "job.token",
               "--servers", "127.0.0.1:7070", "--group-timeout", "inf"],
     "group timeout must be a positive number of seconds, got inf"),
    ("agent", ["--aggregate", "127.0.0.1:0", "--job", JOB, "--token-file", "job.token",
               "--servers", "127.0.0.1:7070", "--handshake-timeout", "0"],
     "--handshake-timeout must be a positive number of seconds, got 0.0"),
    ("promote", ["--timeout", "inf"], "--timeout must be a positive number of seconds, got inf"),
    ("status", ["--timeout", "0"], "--timeout must be a positive number of seconds, got 0.0"),
    ("status", ["--controller", "127.0.0.1:1,127.0.0.1:1"],
     "--controller '127.0.0.1:1,127.0.0.1:1': give HOST:PORT, or the job's controllers "
     "separated by commas, each once"),
])
def test_every_numeric_flag_has_its_range_checked(files, name, flags, message):
    assert_one_line_error(files, [*command(name, files), *flags], message)


def test_the_commands_above_start_without_the_bad_flags(files):
    """The cases above fail for their flag, not for their command line."""
    for name in ("server", "replica", "controller"):
        Started(files, command(name, files)).stop()
