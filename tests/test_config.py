"""mlfabric.config: the precedence of the four layers, torchrun's environment,
and one-line errors that name the setting and the fix."""

from __future__ import annotations

import argparse
import socket
import threading

import numpy as np
import pytest

import mlfabric
from mlfabric import config
from mlfabric.errors import ConfigError
from mlfabric.server.store import ParameterStore

from support import JOB, TOKEN, WRONG_TOKEN, ServerThread, make_model


def write(path, text: str):
    path.write_text(text)
    return path


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


@pytest.fixture
def refused_address():
    """HOST:PORT where nothing listens: a bound socket that does not listen
    holds the port and refuses connections."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "job.token"
    path.write_bytes(TOKEN)
    path.chmod(0o600)
    return path


# --- precedence -------------------------------------------------------------------------

# setting, default, config-file value (TOML text), environment value, argument value,
# and the resolved value for each.
PRECEDENCE = [
    ("server", None, '"file:1"', "env:2", "arg:3", ("file:1", "env:2", "arg:3")),
    ("timeout", 10.0, "5", "3.5", 2, (5.0, 3.5, 2.0)),
    ("pull_every", 1, "4", "0", 7, (4, 0, 7)),
    ("controller_fallback", "fifo", '"wait"', "fifo", "wait", ("wait", "fifo", "wait")),
    ("token_file", None, '"f.token"', "e.token", "a.token", ("f.token", "e.token", "a.token")),
]


@pytest.mark.parametrize(("name", "default", "in_file", "in_env", "in_arg", "want"), PRECEDENCE,
                         ids=[row[0] for row in PRECEDENCE])
def test_each_layer_overrides_the_next(tmp_path, name, default, in_file, in_env, in_arg, want):
    env_var = "MLFABRIC_" + name.upper()
    path = write(tmp_path / "m.toml", f"{name} = {in_file}\n")

    s = config.resolve(environ={})
    assert (getattr(s, name), s.source(name)) == (default, "default")

    s = config.resolve(environ={"MLFABRIC_CONFIG": str(path)})
    assert (getattr(s, name), s.source(name)) == (want[0], f"config file {str(path)!r}")

    s = config.resolve(environ={"MLFABRIC_CONFIG": str(path), env_var: in_env})
    assert (getattr(s, name), s.source(name)) == (want[1], env_var)

    s = config.resolve({name: in_arg}, environ={"MLFABRIC_CONFIG": str(path), env_var: in_env})
    assert (getattr(s, name), s.source(name)) == (want[2], f"argument {name}=")

    # None is "not given": the next layer shows through.
    s = config.resolve({name: None}, environ={env_var: in_env})
    assert getattr(s, name) == want[1]


def test_flags_override_the_environment_and_the_file(tmp_path):
    path = write(tmp_path / "m.toml", 'server = "file:1"\njob = "j-file"\ntimeout = 4\n')
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    args = parser.parse_args(["--config", str(path), "--server", "flag:9", "--pull-every", "3"])
    s = config.from_args(args, environ={"MLFABRIC_SERVER": "env:2", "MLFABRIC_TIMEOUT": "6"})
    assert (s.server, s.source("server")) == ("flag:9", "--server")
    assert (s.pull_every, s.source("pull_every")) == (3, "--pull-every")
    assert (s.timeout, s.source("timeout")) == (6.0, "MLFABRIC_TIMEOUT")
    assert (s.job, s.source("job")) == ("j-file", f"config file {str(path)!r}")
    assert (s.max_in_flight, s.source("max_in_flight")) == (1, "default")


def test_a_config_file_argument_wins_over_MLFABRIC_CONFIG(tmp_path):
    named = write(tmp_path / "a.toml", 'job = "from-argument"\n')
    env = write(tmp_path / "b.toml", 'job = "from-env"\n')
    s = config.resolve(config_file=named, environ={"MLFABRIC_CONFIG": str(env)})
    assert s.job == "from-argument"


def test_other_MLFABRIC_variables_are_left_alone():
    s = config.resolve(environ={"MLFABRIC_LOOP": "asyncio", "MLFABRIC_AGENT_ARGS": "-x"})
    assert s.server is None


# --- torchrun's environment -----------------------------------------------------------------


def test_launch_info_reads_torchruns_variables():
    assert config.launch_info({}) == config.Launch(0, 1, 0, under_launcher=False)
    got = config.launch_info({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert got == config.Launch(3, 4, 1, under_launcher=True)
    got = config.launch_info({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.7"})
    assert got.master_addr == "10.0.0.7"


def test_under_torchrun_the_server_defaults_to_master_addr():
    under = config.Launch(1, 2, 1, under_launcher=True, master_addr="10.0.0.7")
    s = config.server_from_launcher(config.resolve(environ={}), under)
    assert (s.server, s.source("server")) == ("10.0.0.7:7070", "MASTER_ADDR (torchrun)")
    six = config.Launch(0, 2, 0, under_launcher=True, master_addr="fd00::7")
    assert config.server_from_launcher(config.resolve(environ={}), six).server == "[fd00::7]:7070"
    named = config.resolve(environ={"MLFABRIC_SERVER": "h1:7071"})
    assert config.server_from_launcher(named, under).server == "h1:7071"  # a setting wins
    alone = config.resolve(environ={})
    assert config.server_from_launcher(alone, config.Launch()).server is None


def test_a_torchrun_worker_without_a_server_setting_connects_to_master_addr(
        token_file, monkeypatch):
    with ServerThread(ParameterStore(make_model())) as st:
        monkeypatch.setattr(config, "SERVER_PORT", int(st.address.rsplit(":", 1)[1]))
        s = config.resolve(environ={"MLFABRIC_JOB": JOB, "MLFABRIC_TOKEN_FILE": str(token_file)})
        launch = config.Launch(0, 2, 0, under_launcher=True, master_addr="127.0.0.1")
        with config.connect(s, launch=launch) as ps:
            assert ps.address == st.address
            assert ps.pull(timeout=5)[0] == 0


def test_an_unreachable_master_addr_server_says_how_to_name_another(
        token_file, refused_address, monkeypatch):
    monkeypatch.setattr(config, "SERVER_PORT", int(refused_address.rsplit(":", 1)[1]))
    s = config.resolve(environ={"MLFABRIC_JOB": JOB, "MLFABRIC_TOKEN_FILE": str(token_file)})
    launch = config.Launch(0, 2, 0, under_launcher=True, master_addr="127.0.0.1")
    with pytest.raises(ConfigError) as exc:
        config.connect(s, launch=launch)
    assert one_line(exc) == (
        f"cannot reach the server at {refused_address} (setting server (from MASTER_ADDR "
        f"(torchrun))): Connection refused; start `mlfabric server` there or fix --server or "
        f"MLFABRIC_SERVER (without them, torchrun's MASTER_ADDR names the server, on port "
        f"{refused_address.rsplit(':', 1)[1]})")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "x", "WORLD_SIZE": "4"}, "environment variable RANK='x' is not an integer"),
        ({"RANK": "1"}, "WORLD_SIZE is not: start workers with torchrun"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, "need 0 <= RANK < WORLD_SIZE"),
    ],
)
def test_bad_launch_variables_are_one_line_errors(env, message):
    with pytest.raises(ConfigError) as exc:
        config.launch_info(env)
    assert message in one_line(exc)


# --- bad configuration: one line naming the setting and the fix ------------------------------


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("tiemout = 5", "unknown setting 'tiemout'; did you mean 'timeout'?"),
        ('token-file = "x"', "unknown setting 'token-file'; did you mean 'token_file'?"),
        ("[mlfabric]\njob = 'x'", "unknown setting 'mlfabric' (settings are top-level keys)"),
        ('timeout = "fast"', "setting timeout (from config file '{path}') must be a number, "
                             "got 'fast' (str): write it without quotes in config file '{path}'"),
        ("pull_every = 1.5", "setting pull_every (from config file '{path}') must be an "
                             "integer, got 1.5 (float)"),
        ("server = 7070", 'setting server (from config file \'{path}\') must be a string '
                          '"HOST:PORT" or, for shards, "HOST:PORT,HOST:PORT,...", got 7070 (int)'),
        ("max_in_flight = true", "setting max_in_flight (from config file '{path}') must be an "
                                 "integer, got True (bool)"),
        ("timeout = -1", "setting timeout (from config file '{path}') must be a number, "
                         "got -1 (must be > 0)"),
        ("job = ", "config file '{path}' is not valid TOML: "),
    ],
    ids=["typo", "hyphen", "table", "str-for-number", "float-for-int", "int-for-address",
         "bool-for-int", "negative", "syntax"],
)
def test_config_file_errors(tmp_path, toml, message):
    path = write(tmp_path / "m.toml", toml + "\n")
    with pytest.raises(ConfigError) as exc:
        config.resolve(config_file=path, environ={})
    assert message.format(path=path) in one_line(exc)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MLFABRIC_TIMEOUT": "abc"},
         "setting timeout (from MLFABRIC_TIMEOUT) must be a number, got 'abc': fix "
         "MLFABRIC_TIMEOUT"),
        ({"MLFABRIC_PULL_EVERY": "-1"},
         "setting pull_every (from MLFABRIC_PULL_EVERY) must be an integer, got '-1' "
         "(must be >= 0)"),
        ({"MLFABRIC_CONTROLLER_FALLBACK": "drop"},
         "setting controller_fallback (from MLFABRIC_CONTROLLER_FALLBACK) must be one of "
         "'fifo', 'wait', got 'drop'"),
        ({"MLFABRIC_SERVER": "nohost"},
         'setting server (from MLFABRIC_SERVER) must be a string "HOST:PORT" or, for shards, '
         '"HOST:PORT,HOST:PORT,...", got \'nohost\' (address must be HOST:PORT'),
        ({"MLFABRIC_SEVER": "h:1"},
         "unknown environment variable MLFABRIC_SEVER; did you mean MLFABRIC_SERVER?"),
        ({"MLFABRIC_CONFIG": "/nonexistent/m.toml"},
         "config file '/nonexistent/m.toml' (from MLFABRIC_CONFIG) does not exist: create it "
         "or fix MLFABRIC_CONFIG"),
    ],
    ids=["timeout", "pull-every", "fallback", "address", "typo", "missing-file"],
)
def test_environment_errors(env, message):
    with pytest.raises(ConfigError) as exc:
        config.resolve(environ=env)
    assert message in one_line(exc)


def test_flag_errors_name_the_flag():
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    args = parser.parse_args(["--timeout", "soon"])
    with pytest.raises(ConfigError) as exc:
        config.from_args(args, environ={"MLFABRIC_TIMEOUT": "3"})
    assert "setting timeout (from --timeout) must be a number, got 'soon': fix --timeout" in \
        one_line(exc)


def test_unknown_argument_suggests_the_closest():
    with pytest.raises(ConfigError) as exc:
        config.resolve({"pull_evry": 2}, environ={})
    assert "unknown mlfabric setting 'pull_evry'; did you mean 'pull_every'?" in one_line(exc)


def test_a_missing_required_setting_says_how_to_set_it(token_file):
    s = config.resolve({"job": JOB, "token_file": str(token_file)}, environ={})
    with pytest.raises(ConfigError) as exc:
        config.connect(s)
    assert one_line(exc) == (
        'setting server is not set: give --server HOST:PORT, set MLFABRIC_SERVER, or write '
        'server = "HOST:PORT" in the config file (MLFABRIC_CONFIG)'
    )


def test_a_missing_token_file_names_the_setting_and_where_it_came_from(tmp_path):
    s = config.resolve(environ={"MLFABRIC_SERVER": "127.0.0.1:1", "MLFABRIC_JOB": JOB,
                                "MLFABRIC_TOKEN_FILE": str(tmp_path / "nope.token")})
    with pytest.raises(ConfigError) as exc:
        config.connect(s)
    message = one_line(exc)
    assert message.startswith("setting token_file (from MLFABRIC_TOKEN_FILE): token file ")
    assert "nope.token' does not exist: create it" in message
    assert message.endswith("or fix MLFABRIC_TOKEN_FILE")


def test_an_unreachable_server_names_the_address_and_the_setting(token_file, refused_address):
    s = config.resolve({"token_file": str(token_file)},
                       environ={"MLFABRIC_SERVER": refused_address, "MLFABRIC_JOB": JOB})
    with pytest.raises(ConfigError) as exc:
        config.connect(s)
    assert one_line(exc) == (
        f"cannot reach the server at {refused_address} (setting server (from "
        f"MLFABRIC_SERVER)): Connection refused; start `mlfabric server` there or fix "
        f"MLFABRIC_SERVER"
    )


def test_an_unreachable_controller_names_the_address_and_the_setting(tmp_path, token_file,
                                                                      refused_address):
    path = write(tmp_path / "m.toml", f'controller = "{refused_address}"\n')
    with ServerThread(ParameterStore(make_model())) as st:
        s = config.resolve({"server": st.address, "job": JOB, "token_file": str(token_file)},
                           config_file=path, environ={})
        with pytest.raises(ConfigError) as exc:
            config.connect(s)
    assert one_line(exc) == (
        f"cannot reach the controller at {refused_address} (setting controller (from config "
        f"file {str(path)!r})): Connection refused; start `mlfabric controller` there or fix "
        f"config file {str(path)!r}"
    )


def test_an_unreachable_replica_names_the_address_and_the_setting(token_file,
                                                                   refused_address):
    with ServerThread(ParameterStore(make_model())) as st:
        s = config.resolve({"server": st.address, "job": JOB, "token_file": str(token_file)},
                           environ={"MLFABRIC_REPLICA": refused_address})
        assert (s.replica, s.source("replica")) == (refused_address, "MLFABRIC_REPLICA")
        with pytest.raises(ConfigError) as exc:
            config.connect(s)
    assert one_line(exc) == (
        f"cannot reach the replica at {refused_address} (setting replica (from "
        f"MLFABRIC_REPLICA)): Connection refused; start `mlfabric server --role replica` there "
        f"or fix MLFABRIC_REPLICA"
    )


def test_a_replica_per_shard_is_probed_one_by_one(token_file, refused_address):
    with ServerThread(ParameterStore(make_model())) as st:
        replicas = f"{st.address},{refused_address}"
        s = config.resolve({"server": st.address, "job": JOB, "token_file": str(token_file),
                            "replica": replicas}, environ={})
        assert s.replica == replicas
        with pytest.raises(ConfigError) as exc:
            config.connect(s)
    assert one_line(exc).startswith(
        f"cannot reach the replica at {replicas} (setting replica (from ")
    assert f"): {refused_address}: Connection refused; start `mlfabric server --role " \
           f"replica` there" in one_line(exc)


def test_a_wrong_token_or_job_names_both_settings(tmp_path):
    other = write(tmp_path / "other.token", WRONG_TOKEN.decode())
    with ServerThread(ParameterStore(make_model())) as st:
        address = st.address
        s = config.resolve({"server": address, "job": JOB, "token_file": str(other)},
                           environ={})
        with pytest.raises(ConfigError) as exc:
            config.connect(s)
    message = one_line(exc)
    assert (f"the parameter server at {address} did not prove it holds job 'testjob''s "
            f"token; check the token file") in message
    assert message.endswith(
        "(setting job from argument job=, setting token_file from argument token_file=)")


def test_an_address_that_is_not_an_mlfabric_server_names_the_setting(token_file):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"

        def answer_http() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n" + b" " * 64)

        thread = threading.Thread(target=answer_http, daemon=True)
        thread.start()
        s = config.resolve({"server": address, "job": JOB, "token_file": str(token_file)},
                           environ={})
        with pytest.raises(ConfigError) as exc:
            config.connect(s)
        thread.join(10)
    assert one_line(exc) == (
        f"{address} is an HTTP server (a metrics port?), not a parameter server: give the "
        f"address of the job's `mlfabric server` (setting server (from argument server=))")


def test_connect_with_good_settings_names_the_rank(token_file):
    with ServerThread(ParameterStore(make_model())) as st:
        s = config.resolve(environ={"MLFABRIC_SERVER": st.address, "MLFABRIC_JOB": JOB,
                                    "MLFABRIC_TOKEN_FILE": str(token_file),
                                    "MLFABRIC_TIMEOUT": "5"})
        with config.connect(s, launch=config.Launch(2, 4, 2, under_launcher=True)) as ps:
            assert isinstance(ps, mlfabric.Client)
            version, params = ps.pull(timeout=5)
            assert version == 0
            np.testing.assert_array_equal(params["w"], make_model()["w"])
            names = st.call(lambda: [c.client for c in st.server.connections])
            assert names == [f"{socket.gethostname()}:rank2"]


def test_the_server_setting_names_a_sharded_jobs_shards(tmp_path, token_file, refused_address):
    from mlfabric.server.cli import shard_store

    model = make_model(sizes={"w": (300, 1000), "b": (10,)})
    stores = []
    for i in range(2):
        tensors, info = shard_store(model, (i, 2), 1 << 16)
        stores.append(ParameterStore(tensors))
        stores[-1].shard = info
    with ServerThread(stores[0]) as a, ServerThread(stores[1]) as b:
        path = write(tmp_path / "m.toml", f'server = "{a.address},{b.address}"\n')
        s = config.resolve(config_file=path,
                           environ={"MLFABRIC_JOB": JOB, "MLFABRIC_TOKEN_FILE": str(token_file)})
        with config.connect(s) as ps:
            version, params = ps.pull(timeout=5)
            assert version == (0, 0)
            np.testing.assert_array_equal(params["w"], model["w"])
        s = config.resolve(environ={"MLFABRIC_SERVER": f"{a.address},{refused_address}",
                                    "MLFABRIC_JOB": JOB, "MLFABRIC_TOKEN_FILE": str(token_file),
                                    "MLFABRIC_TIMEOUT": "2"})
        with pytest.raises(ConfigError) as exc:
            config.connect(s)
        assert one_line(exc).startswith(f"cannot reach the server at {a.address},"
                                        f"{refused_address} (setting server (from "
                                        f"MLFABRIC_SERVER)): ")
        assert refused_address in one_line(exc).split("): ", 1)[1]
    with pytest.raises(ConfigError) as exc:
        config.resolve(environ={"MLFABRIC_SERVER": "a:1,,b:2"})
    assert "has an empty entry" in one_line(exc)
