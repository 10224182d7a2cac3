"""`mlfabric status`'s text: every section of the controller's status dict."""

from __future__ import annotations

from mlfabric.controller.status_cli import format_status

STATUS = {
    "job": "mnist", "policy": "mlfabric", "tau_max": 16, "connections": 3,
    "server_version": 42, "pending": 1, "active": 2,
    "servers": [{"host": "10.0.0.9", "version": 42, "transfers": 50, "applied": 40,
                 "refused": 2, "last_heard_age_s": 0.25}],
    "replicas": [],
    "agents": [
        {"host": "h1", "address": "10.0.0.1:7400", "reachable": True,
         "last_report_age_s": 0.5, "peers": 2, "fresh": 2, "error": ""},
        {"host": "h2", "address": "10.0.0.2:7400", "reachable": False,
         "last_report_age_s": None, "peers": 0, "fresh": 0, "error": "Connection refused"}],
    "delay": {"count": 40, "mean": 1.5, "std": 0.5, "max": 3},
    "workers": [{"name": "w1", "host": "h1", "requests": 50, "sent": 45, "dropped": 5,
                 "applied": 40, "refused": 2, "last_delay": 1}],
    "bandwidth": {"h1": {"up_bytes_per_s": 12.5e6, "down_bytes_per_s": 125e6}},
    "default_bytes_per_s": 125e6,
    "measured_paths": {"h1->10.0.0.9": 6.25e6},
}


def test_status_text_lists_servers_replicas_agents_workers_and_bandwidth():
    assert format_status(STATUS, "ctl:7071").splitlines() == [
        "job 'mnist' on controller ctl:7071   policy mlfabric   tau_max 16",
        "server version 42   transfers pending 1, active 2   connections 3",
        "servers (versions as their workers reported them):",
        "  host      version  transfers  applied  refused  last heard",
        "  10.0.0.9  42       50         40       2        0.2 s ago",
        "replicas: none reported (workers replicate with replica=HOST:PORT; the controller "
        "tracks replicas with --div-max)",
        "agents:",
        "  host  address        reachable  last report  peers  fresh  error",
        "  h1    10.0.0.1:7400  yes        0.5 s ago    2      2      -",
        "  h2    10.0.0.2:7400  no         never        0      0      Connection refused",
        "delay of applied updates: count 40  mean 1.50  std 0.50  max 3",
        "workers:",
        "  name  host  requests  sent  dropped  applied  refused  last delay",
        "  w1    h1    50        45    5        40       2        1",
        "bandwidth picture (Mbit/s, up / down):",
        "  h1  100 / 1000",
        "  any other host  1000 / 1000",
        "measured by agents (Mbit/s available):",
        "  h1->10.0.0.9  50",
    ]


def test_status_text_says_what_is_missing_and_shows_any_replica_fields():
    empty = {**STATUS, "servers": [], "agents": [], "workers": [], "measured_paths": {},
             "delay": {"count": 0},
             "replicas": [{"host": "r1", "version": 40, "lag": 2},
                          {"host": "r2", "version": None, "divergence": 0.125}]}
    lines = format_status(empty, "ctl:7071").splitlines()
    assert "servers: none seen yet (no transfer requested)" in lines
    assert ("agents: none (start the controller with --agent HOST=ADDR:PORT or --agents-dns "
            "NAME:PORT)") in lines
    assert "delay of applied updates: none reported yet" in lines
    assert ("measured by agents: none (no --agent or --agents-dns, or no fresh estimate "
            "yet)") in lines
    # Replicas print whatever fields they report, one column per key.
    i = lines.index("replicas:")
    assert lines[i + 1:i + 4] == [
        "  host  version  lag  divergence",
        "  r1    40       2    -",
        "  r2    -        -    0.125",
    ]


def test_status_text_lists_the_shards_of_a_sharded_job():
    sharded = {**STATUS, "shards": [{"shard": 0, "host": "10.0.0.1", "version": 42},
                                    {"shard": 1, "host": "10.0.0.2", "version": 41}]}
    lines = format_status(sharded, "ctl:7071").splitlines()
    i = lines.index("shards: 2, each with its own version:")
    assert lines[i + 1:i + 4] == ["  shard  host      version", "  0      10.0.0.1  42",
                                  "  1      10.0.0.2  41"]
    assert not any(line.startswith("shards") for line in format_status(STATUS, "c").splitlines())


def test_status_text_shows_workers_without_this_controller_as_far_as_it_knows():
    """Issue 33: a worker the controller did not answer trains unscheduled.
    Those that came back reported what went without it; of those that
    disconnected, the controller knows only when (finished, died or lost)."""
    s = {**STATUS,
         "workers": [{**STATUS["workers"][0], "fell_back_updates": 17,
                      "fell_back_seconds": 3.25},
                     {"name": "w3", "host": "h3", "requests": 1, "sent": 1, "dropped": 0,
                      "applied": 1, "refused": 0, "last_delay": 0,
                      "fell_back_updates": 0, "fell_back_seconds": 0.0}],
         "gone_workers": [{"name": "w2", "host": "h2", "requests": 40,
                           "gone_age_s": 12.5}]}
    lines = format_status(s, "ctl:7071").splitlines()
    i = lines.index("workers that went on without this controller (it did not answer them) "
                    "and came back:")
    assert lines[i + 1:i + 6] == [
        "  name  host  updates sent straight to the server  time without it",
        "  w1    h1    17                                   3.2 s",
        "disconnected workers (finished, died, or lost this controller: with "
        "controller_fallback 'fifo' those send straight to the server until they "
        "reconnect):",
        "  name  host  requests  disconnected",
        "  w2    h2    40        12.5 s ago",
    ]
    assert lines[i + 6].startswith("bandwidth picture")


def test_status_of_several_controllers_says_who_answered_and_who_plans_which_shard():
    from mlfabric.controller.status_cli import format_statuses
    from mlfabric.errors import ConnectError

    def planning(plans: list[int], owners: list[str], pending: int, **more) -> dict:
        return {**STATUS, "pending": pending,
                "controllers": {"etcd": "http://e:2379", "lease_ttl_s": 2, "this": "",
                                "plans": plans, "owners": owners}, **more}

    owners = ["a:7071", "b:7071", "a:7071"]
    # b plans shard 1, on a server of its own; w1 sent it the parts for
    # shard 1, and w2 talks to b alone so far.
    b_servers = [{**STATUS["servers"][0], "version": 41, "last_heard_age_s": 0.125},
                 {"host": "10.0.0.8", "version": 7, "transfers": 9, "applied": 8,
                  "refused": 1, "last_heard_age_s": 3.0}]
    # (each controller names a worker with its connection's address; the
    # name in its hello is the same)
    b_workers = [{"name": "w1 (10.0.0.1:6000)", "client": "w1", "host": "h1", "requests": 25,
                  "sent": 24, "dropped": 1, "applied": 20, "refused": 4, "last_delay": 2},
                 {"name": "w2", "host": "h2", "requests": 3, "sent": 3, "dropped": 0,
                  "applied": 3, "refused": 0, "last_delay": 0}]
    text = format_statuses({
        "a:7071": planning([0, 2], owners, 5, gone_workers=[
            {"name": "w3", "host": "h3", "requests": 5, "gone_age_s": 1.0}]),
        "b:7071": planning([1], owners, 7, servers=b_servers, workers=b_workers),
        "c:7071": ConnectError("nothing listens at c:7071"),
    })
    lines = text.splitlines()
    assert lines[:11] == [
        "job 'mnist': 3 controllers, 2 answered",
        "  controller      answered                       plans shards  pending  active  "
        "connections",
        "  a:7071          yes                            [0, 2]        5        2       3",
        "  b:7071          yes                            [1]           7        2       3",
        "  c:7071          no: nothing listens at c:7071  -             -        -       -",
        # the job's transfers, added up over the controllers that answered
        "  job (answered)  -                              [0, 1, 2]     12       4       -",
        "shards planned by:",
        "  shard  controller",
        "  0      a:7071",
        "  1      b:7071",
        "  2      a:7071",
    ]
    # the job's servers and workers, added up over those that answered
    i = lines.index("the job's servers (added up over the controllers that answered):")
    assert lines[i + 1:i + 9] == [
        "  host      version  transfers  applied  refused  last heard",
        "  10.0.0.8  7        9          8        1        3.0 s ago",
        "  10.0.0.9  42       100        80       4        0.1 s ago",
        "the job's connected workers (parts of their updates, added up over the "
        "controllers that answered):",
        "  name  host  controllers  requests  sent  dropped  applied  refused",
        "  w1    h1    2            75        69    6        60       6",
        "  w2    h2    1            3         3     0        3        0",
        "  and 1 disconnected (each controller's list is below)",
    ]
    # then each answering controller's own status, in the order given
    assert [line for line in lines if line.startswith("job 'mnist' on controller")] == [
        "job 'mnist' on controller a:7071   policy mlfabric   tau_max 16",
        "job 'mnist' on controller b:7071   policy mlfabric   tau_max 16"]
    # While a shard moves, their views of etcd differ: both are shown.
    moving = format_statuses({"a:7071": planning([0], ["a:7071", ""], 0),
                              "b:7071": planning([1], ["a:7071", "b:7071"], 0)})
    i = moving.splitlines().index(
        "shards planned by (the controllers' views differ while a shard moves):")
    assert moving.splitlines()[i + 1:i + 4] == [
        "  shard  as a:7071 reads it  as b:7071 reads it",
        "  0      a:7071              a:7071",
        "  1      nobody              b:7071"]


def test_status_watch_redraws_as_the_job_moves_and_stops_on_ctrl_c(tmp_path):
    """`mlfabric status --watch 0.2` against a real controller, in a terminal
    (rich told so by TTY_COMPATIBLE): it shows server version 0, then, after
    a worker's three updates, version 3, redrawn in place; Ctrl-C ends it
    with status 0 and the terminal's cursor back."""
    import os
    import queue
    import signal
    import subprocess
    import threading

    import mlfabric
    from mlfabric.controller.controller import Controller
    from mlfabric.scheduling.policies import Mlfabric
    from mlfabric.server.store import ParameterStore

    from support import JOB, TOKEN, ServerThread, make_model, random_update
    from test_cli import mlfabric_cmd

    token = tmp_path / "job.token"
    token.write_bytes(TOKEN)
    token.chmod(0o600)
    model = make_model()
    with ServerThread(ParameterStore(model)) as st, \
            ServerThread(None, endpoint=Controller(Mlfabric(), job=JOB, token=TOKEN,
                                                   tau_max=None)) as ctl:
        proc = subprocess.Popen(
            mlfabric_cmd("status", "--controller", ctl.address, "--job", JOB, "--token-file",
                         str(token), "--watch", "0.2"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
            env={**os.environ, "TTY_COMPATIBLE": "1", "COLUMNS": "160"})
        chunks: queue.Queue[str] = queue.Queue()

        def pump() -> None:
            assert proc.stdout is not None
            while chunk := proc.stdout.read(256):
                chunks.put(chunk)

        threading.Thread(target=pump, daemon=True).start()
        seen = ""

        def until(text: str) -> None:
            nonlocal seen
            while text not in seen:
                try:
                    seen += chunks.get(timeout=30)
                except queue.Empty:
                    proc.kill()
                    raise AssertionError(f"no {text!r} within 30 s; it printed: {seen!r}"
                                         ) from None

        try:
            until("server version 0")
            with mlfabric.connect(st.address, job=JOB, token=TOKEN,
                                  controller=ctl.address) as ps:
                for v in range(3):
                    assert ps.push(random_update(model, seed=v), base_version=v).result(10)
            until("server version 3")
        finally:
            proc.send_signal(signal.SIGINT)
            code = proc.wait(15)
        assert code == 0, proc.stderr.read() if proc.stderr else ""
    assert "every 0.2 s, press Ctrl-C to stop; updated " in seen
    assert "\x1b[1A" in seen  # redrawn in place: the cursor goes back up
    assert seen.count(f"job '{JOB}' on controller") >= 2
    assert "Traceback" not in (proc.stderr.read() if proc.stderr else "")


def test_status_watch_refuses_json_and_a_bad_interval():
    import argparse

    import pytest

    from mlfabric.controller import status_cli
    from mlfabric.errors import ConfigError

    parser = argparse.ArgumentParser()
    status_cli.add_arguments(parser)
    base = ["--controller", "127.0.0.1:1", "--job", "j", "--token-file", "/dev/null"]
    for extra, message in ((["--watch", "--json"], "--watch shows the status as a table"),
                           (["--watch", "0"], "--watch must be")):
        with pytest.raises(ConfigError, match=message):
            status_cli.run(parser.parse_args([*base, *extra]))
