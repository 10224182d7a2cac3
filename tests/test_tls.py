"""Mutual TLS (issue 33): certificates from `mlfabric tls init`, a TLS server
and client that push and pull exactly, and every peer that must be refused
at the TLS handshake (no certificate, another CA's, none at all, a server
certificate that does not name the host) refused with a clear error on the
client's side and counted and logged on the listener's. The job token is
still checked inside TLS. On asyncio's loop and on uvloop."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import stat
import subprocess

import numpy as np
import pytest
from test_handshake_timeout import Process, command

import mlfabric
from mlfabric import config
from mlfabric.client import aio
from mlfabric.errors import AuthenticationError, ConfigError, ConnectionLost, TLSError
from mlfabric.server.store import ParameterStore
from mlfabric.tools import tls_cli
from mlfabric.transport import tls
from mlfabric.wire.agent_auth import AgentCredential, derive_job_key

from support import (
    CLUSTER,
    CLUSTER_TOKEN,
    JOB,
    JOB_AGENT_KEY,
    TOKEN,
    WRONG_TOKEN,
    Reference,
    ServerThread,
    assert_model_equal,
    cluster_token_file,
    free_port,
    make_model,
    random_update,
    sample,
    wait_until,
)
from test_cli import Server, mlfabric_cmd


def tls_init(directory, *hosts: str, force: bool = False) -> subprocess.CompletedProcess:
    argv = ["tls", "init", str(directory)]
    for h in hosts:
        argv += ["--host", h]
    return subprocess.run(mlfabric_cmd(*argv, *(["--force"] if force else [])),
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """The cluster's CA and certificates, made by the command itself; and
    another cluster's, whose CA ours does not trust."""
    ours = tmp_path_factory.mktemp("certs")
    done = tls_init(ours, "server,127.0.0.1,localhost", "worker", "elsewhere")
    assert done.returncode == 0, done.stderr
    theirs = tmp_path_factory.mktemp("other-certs")
    done = tls_init(theirs, "server,127.0.0.1", "worker")
    assert done.returncode == 0, done.stderr
    return ours, theirs


def files(directory, name: str, ca_dir=None) -> tls.TLSFiles:
    found = tls.files(directory / f"{name}.pem", directory / f"{name}.key",
                      (ca_dir or directory) / "ca.pem")
    assert found is not None
    return found


def client_args(directory, name: str = "worker", ca_dir=None) -> dict[str, str]:
    f = files(directory, name, ca_dir)
    return {"tls_cert": f.cert, "tls_key": f.key, "tls_ca": f.ca}


@pytest.fixture
def tls_server(certs, loop_kind):
    """A ParameterServer over TLS (certificate `server`, naming 127.0.0.1)."""
    ours, _ = certs
    st = ServerThread(ParameterStore(make_model()), loop_kind=loop_kind)
    st.server.tls = tls.server_context(files(ours, "server"))
    with st:
        yield st


# -- mlfabric tls init ------------------------------------------------------------------


def test_init_writes_a_ca_and_certificates_for_both_ends(certs) -> None:
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ours, _ = certs
    for name in ("ca", "server", "worker", "elsewhere"):
        assert stat.S_IMODE((ours / f"{name}.key").stat().st_mode) == 0o600, name
    cert = x509.load_pem_x509_certificate((ours / "server.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["server", "localhost"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    ca = x509.load_pem_x509_certificate((ours / "ca.pem").read_bytes())
    cert.verify_directly_issued_by(ca)


def test_init_keeps_existing_files_unless_forced(tmp_path) -> None:
    assert tls_init(tmp_path, "a").returncode == 0
    before = (tmp_path / "ca.pem").read_bytes()
    kept = tls_init(tmp_path, "a")
    assert kept.returncode == 2
    assert kept.stderr.strip() == (
        f"mlfabric tls: error: {tmp_path}/ca.pem, {tmp_path}/ca.key, {tmp_path}/a.pem, "
        f"{tmp_path}/a.key already exist: give --force to replace them (certificates made "
        f"with the old CA then stop working)")
    assert (tmp_path / "ca.pem").read_bytes() == before
    assert tls_init(tmp_path, "a", force=True).returncode == 0
    assert (tmp_path / "ca.pem").read_bytes() != before


@pytest.mark.parametrize("host, message", [
    ("a,,b", "--host 'a,,b' has an empty name: give NAME or NAME,ALT,... (host names or IP "
             "addresses)"),
    ("../x", "--host '../x': '../x' cannot name a file; start with a name of letters, digits, "
             "'.', '-' or '_'"),
    ("ca", "--host 'ca': 'ca' is the CA's file name; name the host otherwise"),
])
def test_init_refuses_bad_host_names(tmp_path, host: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        tls_cli.init(tmp_path, [host])
    assert str(info.value) == message


# -- the contexts: all three files or none, each checked -------------------------------


def test_some_but_not_all_files_is_an_error(certs) -> None:
    ours, _ = certs
    with pytest.raises(ConfigError) as info:
        tls.files(ours / "server.pem", None, ours / "ca.pem")
    assert str(info.value) == ("TLS needs all three of --tls-cert, --tls-key, --tls-ca: "
                               "--tls-cert, --tls-ca given without --tls-key; give all three, "
                               "or none for plain TCP")
    assert tls.files(None, None, None) is None


def test_missing_and_non_pem_files_are_named(certs, tmp_path) -> None:
    ours, _ = certs
    with pytest.raises(ConfigError) as info:
        tls.files(tmp_path / "nope.pem", ours / "server.key", ours / "ca.pem", tls.SETTINGS)
    assert str(info.value) == (f"tls_cert file '{tmp_path}/nope.pem' does not exist: give the "
                               f"path of a PEM file (`mlfabric tls init DIR` makes them)")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigError) as info:
        tls.files(ours / "server.pem", ours / "server.key", junk)
    assert str(info.value) == (f"--tls-ca file '{junk}' is not a PEM file (no '-----BEGIN' "
                               f"line): give the PEM certificate or key")


def test_a_key_of_another_certificate_is_refused(certs) -> None:
    ours, _ = certs
    mixed = tls.files(ours / "server.pem", ours / "worker.key", ours / "ca.pem")
    assert mixed is not None
    with pytest.raises(ConfigError) as info:
        tls.server_context(mixed)
    assert str(info.value) == (f"cannot use --tls-cert '{ours}/server.pem' with --tls-key "
                               f"'{ours}/worker.key': the key does not belong to the "
                               f"certificate; give the certificate and the key made with it")


def test_contexts_are_mutual_and_tls12_or_later(certs) -> None:
    ours, _ = certs
    for ctx in (tls.server_context(files(ours, "server")),
                tls.client_context(files(ours, "worker"))):
        assert ctx.verify_mode == ssl.CERT_REQUIRED
        assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    assert tls.client_context(files(ours, "worker")).check_hostname


# -- a TLS server and its clients --------------------------------------------------------


def test_push_and_pull_exactly_over_tls(certs, tls_server, run_async) -> None:
    ours, _ = certs
    model = make_model()
    ref = Reference(model, gamma=0.0)

    async def main():
        async with await aio.connect(tls_server.address, job=JOB, token=TOKEN, timeout=5,
                                     **client_args(ours)) as c:
            assert c._proto.transport.get_extra_info("ssl_object").version() == "TLSv1.3"
            version, got = await c.pull()
            assert_model_equal(got, model)
            for step in range(3):
                u = random_update(model, seed=step)
                ref.apply(u)
                outcome = await c.push(u, base_version=version + step)
                assert outcome.applied
            _, got = await c.pull()
            assert_model_equal(got, ref.w)

    run_async(main())
    assert tls_server.metrics.tls_refused._value.get() == 0


def test_pushes_over_tls_are_flushed_while_the_server_says_nothing(certs, tls_server,
                                                                     run_async) -> None:
    """flushed() returns once a push's bytes have left, with no answer from
    the server to wake the link. With a write-buffer high mark of 0, the TLS
    layer paused the link on every other write with nothing buffered (it
    pauses at size >= high) and a blocking push over TLS waited forever: a
    fresh-clone CI run hung 85 minutes in test_a_sharded_job_over_tls."""
    import threading

    ours, _ = certs
    model = make_model()
    gate = threading.Event()

    async def main():
        async with await aio.connect(tls_server.address, job=JOB, token=TOKEN, timeout=5,
                                     **client_args(ours)) as c:
            version, _ = await c.pull()
            # The server's loop waits on the gate: it reads nothing, answers nothing.
            tls_server._loop.call_soon_threadsafe(gate.wait, 20)
            try:
                pushed = []
                for step in range(4):
                    pushed.append(c.push(random_update(model, seed=step), base_version=version))
                    await asyncio.wait_for(c.flushed(), 5)
            finally:
                gate.set()
            outcomes = [await asyncio.wait_for(p, 10) for p in pushed]
            assert [o.applied for o in outcomes] == [True] * 4

    run_async(main())


def test_large_model_over_tls(certs, loop_kind, run_async) -> None:
    """16 MiB each way: many TLS records per frame, on both loops."""
    ours, _ = certs
    model = make_model(2, {"w": (4096, 1024)})
    st = ServerThread(ParameterStore(model), loop_kind=loop_kind)
    st.server.tls = tls.server_context(files(ours, "server"))
    u = {"w": np.full((4096, 1024), 0.5, dtype=np.float32)}

    async def main():
        async with await aio.connect(st.address, job=JOB, token=TOKEN, timeout=10,
                                     **client_args(ours)) as c:
            version, _ = await c.pull()
            assert (await c.push(u, base_version=version)).applied
            _, got = await c.pull()
            assert np.array_equal(got["w"], model["w"] + u["w"])

    with st:
        run_async(main(), timeout=60)


def refused_on_server(st, caplog, reason: str) -> None:
    # The server's thread counts the refusal, then logs it: wait for both.
    wait_until(lambda: st.metrics.tls_refused._value.get() == 1, 5,
               "the refusal counted by the server")
    wait_until(lambda: reason in caplog.text, 5, f"the server's log line: {reason}")


def test_a_client_without_a_certificate_is_refused(certs, tls_server, run_async,
                                                   caplog) -> None:
    from mlfabric.client.link import open_link
    from mlfabric.wire.handshake import ClientHandshake

    ours, _ = certs
    # It trusts the server's CA, but has no certificate of its own to show.
    bare = ssl.create_default_context(cafile=str(ours / "ca.pem"))

    async def main():
        with pytest.raises(ConnectionLost) as info:
            await open_link(tls_server.address, ClientHandshake(JOB, TOKEN, "bare"), 5,
                            "parameter server", tls=bare)
        assert str(info.value) == (
            f"the parameter server at {tls_server.address} closed the connection right after "
            f"the TLS handshake: it did not accept this client's certificate (not signed by "
            f"its --tls-ca; its log says why), or it is shutting down; give tls_cert and "
            f"tls_key signed by the cluster's CA")

    with caplog.at_level(logging.WARNING, logger="mlfabric.server"):
        run_async(main())
        refused_on_server(tls_server, caplog, "TLS handshake failed: the peer presented no "
                                              "certificate (PEER_DID_NOT_RETURN_A_CERTIFICATE)")


def test_a_certificate_of_another_ca_is_refused(certs, tls_server, run_async,
                                                caplog) -> None:
    ours, theirs = certs

    async def main():
        # Their worker's certificate, though it trusts our CA.
        with pytest.raises(ConnectionLost, match="did not accept this client's certificate"):
            await aio.connect(tls_server.address, job=JOB, token=TOKEN, timeout=5,
                              **client_args(theirs, ca_dir=ours))

    with caplog.at_level(logging.WARNING, logger="mlfabric.server"):
        run_async(main())
        refused_on_server(tls_server, caplog, "TLS handshake failed: certificate not accepted: "
                                              "unable to get local issuer certificate")


def test_a_plain_client_is_refused(tls_server, run_async, caplog) -> None:
    async def main():
        with pytest.raises(ConnectionLost) as info:
            await aio.connect(tls_server.address, job=JOB, token=TOKEN, timeout=5)
        assert str(info.value) == (
            f"{tls_server.address} closed the connection during the handshake: it is not a "
            f"parameter server (`mlfabric server`), it requires TLS (give tls_cert, tls_key "
            f"and tls_ca, or --tls-cert, --tls-key and --tls-ca), or it is shutting down")

    with caplog.at_level(logging.WARNING, logger="mlfabric.server"):
        run_async(main())
        refused_on_server(tls_server, caplog, "TLS handshake failed: the peer does not speak "
                                              "TLS (WRONG_VERSION_NUMBER)")


def test_the_client_refuses_a_server_of_another_ca(certs, tls_server, run_async) -> None:
    ours, theirs = certs

    async def main():
        with pytest.raises(TLSError) as info:
            await aio.connect(tls_server.address, job=JOB, token=TOKEN, timeout=5,
                              **client_args(ours, ca_dir=theirs))
        assert str(info.value) == (
            f"the parameter server at {tls_server.address} presented a certificate this "
            f"client does not accept: self-signed certificate in certificate chain; it must be "
            f"signed by the CA in tls_ca and name the host dialled (`mlfabric tls init --host`)")

    run_async(main())


def test_the_client_checks_the_server_certificate_names_the_host(certs, loop_kind,
                                                                 run_async) -> None:
    ours, _ = certs
    st = ServerThread(ParameterStore(make_model()), loop_kind=loop_kind)
    # Signed by our CA, but names only "elsewhere": not 127.0.0.1, the host dialled.
    st.server.tls = tls.server_context(files(ours, "elsewhere"))

    async def main():
        with pytest.raises(TLSError, match="presented a certificate this client does not "
                                           "accept: IP address mismatch"):
            await aio.connect(st.address, job=JOB, token=TOKEN, timeout=5,
                              **client_args(ours))

    with st:
        run_async(main())


def test_a_tls_client_of_a_plain_server_is_told(certs, loop_kind, run_async) -> None:
    ours, _ = certs

    async def main():
        with pytest.raises(TLSError) as info:
            await aio.connect(st.address, job=JOB, token=TOKEN, timeout=5, **client_args(ours))
        assert str(info.value) == (
            f"the parameter server at {st.address} does not use TLS (WRONG_VERSION_NUMBER): "
            f"start `mlfabric server` with --tls-cert, --tls-key and --tls-ca, or connect "
            f"without TLS settings")

    with ServerThread(ParameterStore(make_model()), loop_kind=loop_kind) as st:
        run_async(main())


def test_the_job_token_is_still_checked_inside_tls(certs, tls_server, run_async) -> None:
    ours, _ = certs

    async def main():
        with pytest.raises(AuthenticationError):
            await aio.connect(tls_server.address, job=JOB, token=WRONG_TOKEN, timeout=5,
                              **client_args(ours))

    run_async(main())
    # The client refuses the server's proof (sending none of its own); the
    # server counts that refusal.
    wait_until(lambda: tls_server.metrics.auth_failures._value.get() == 1, 5,
               "the wrong token counted by the server")
    assert tls_server.metrics.tls_refused._value.get() == 0


# -- settings and commands -----------------------------------------------------------------


def test_tls_settings_come_from_the_environment(certs, tmp_path) -> None:
    ours, _ = certs
    env = {"MLFABRIC_TLS_CERT": str(ours / "worker.pem"),
           "MLFABRIC_TLS_KEY": str(ours / "worker.key"),
           "MLFABRIC_TLS_CA": str(ours / "ca.pem")}
    s = config.resolve(environ=env)
    assert (s.tls_cert, s.tls_key, s.tls_ca) == tuple(env.values())
    assert s.source("tls_ca") == "MLFABRIC_TLS_CA"
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'tls_cert = "{ours}/worker.pem"\n')
    token = tmp_path / "t"
    token.write_bytes(TOKEN)
    token.chmod(0o600)
    half = config.resolve({"server": "127.0.0.1:1", "job": JOB, "token_file": str(token)},
                          config_file=cfg, environ={})
    with pytest.raises(ConfigError) as info:
        config.connect(half)
    assert str(info.value) == (
        f"TLS needs all three of tls_cert, tls_key, tls_ca: tls_cert given without tls_key, "
        f"tls_ca; give all three, or none for plain TCP (setting tls_cert from config file "
        f"'{cfg}', setting tls_key from default, setting tls_ca from default)")


def test_server_command_over_tls(certs, tmp_path) -> None:
    """`mlfabric server --tls-*` says TLS is on, and mlfabric.connect with the
    same settings from the environment's config pushes to it."""
    ours, _ = certs
    server = Server(tmp_path, "--tls-cert", str(ours / "server.pem"), "--tls-key",
                    str(ours / "server.key"), "--tls-ca", str(ours / "ca.pem"))
    try:
        assert ", mutual TLS" in server.line
        with mlfabric.connect(server.address, job=JOB, token=TOKEN, timeout=5,
                              **client_args(ours)) as c:
            version, model = c.pull()
            assert c.push({n: np.ones_like(a) for n, a in model.items()},
                          base_version=version).result(10).applied
    finally:
        code, _, err = server.stop()
    assert code == 0, err


def test_server_command_refuses_half_the_tls_flags(certs, tmp_path) -> None:
    ours, _ = certs
    token = tmp_path / "t"
    token.write_bytes(TOKEN)
    token.chmod(0o600)
    done = subprocess.run(mlfabric_cmd("server", "--listen", "127.0.0.1:0", "--job", JOB,
                                       "--token-file", str(token), "--tls-cert",
                                       str(ours / "server.pem")),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "mlfabric server: error: TLS needs all three of --tls-cert, --tls-key, --tls-ca: "
        "--tls-cert given without --tls-key, --tls-ca; give all three, or none for plain TCP")


# -- a whole job over TLS --------------------------------------------------------------------


def test_a_job_over_tls_fails_over_to_its_replica(certs, tmp_path) -> None:
    """Server, replica and controller as deployed, all with --tls-*; a worker
    through the controller, feeding the replica. The controller's heartbeats,
    the worker's links and its failover all go over TLS: the server is
    SIGKILLed mid-run, the replica promoted, and every acknowledged update
    is in the replica's model. `mlfabric status` reaches the controller
    with the same flags."""
    import signal

    from test_failover import step
    from test_replication import Serving, write_inputs

    ours, _ = certs
    flags = ["--tls-cert", str(ours / "server.pem"), "--tls-key", str(ours / "server.key"),
             "--tls-ca", str(ours / "ca.pem")]
    model = make_model()
    gamma = 0.5
    init = write_inputs(tmp_path, model)
    replica = Serving(tmp_path, "--role", "replica", "--init", init, "--momentum", str(gamma),
                      *flags)
    server = Serving(tmp_path, "--init", init, "--momentum", str(gamma), "--tau-max", "-1",
                     *flags)
    controller = Serving(tmp_path, "--server", server.address, "--replica", replica.address,
                         "--heartbeat-interval", "0.1", "--heartbeat-timeout", "0.5",
                         "--policy", "fifo", "--tau-max", "-1", *flags, command="controller")
    acked: dict[int, dict[str, np.ndarray]] = {}
    try:
        status = subprocess.run(mlfabric_cmd("status", "--controller", controller.address,
                                             "--job", JOB, "--token-file",
                                             str(tmp_path / "job.token"), "--json", *flags),
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        with mlfabric.connect(server.address, job=JOB, token=TOKEN,
                              controller=controller.address, controller_fallback="wait",
                              replica=replica.address, failover_timeout=10,
                              **client_args(ours)) as ps:
            for i in range(12):
                if i == 6:
                    server.proc.send_signal(signal.SIGKILL)
                u, outcome = step(ps, model, i)
                acked[outcome.version] = u
        with mlfabric.connect(replica.address, job=JOB, token=TOKEN, timeout=5,
                              **client_args(ours)) as rs:
            final_version, final = rs.pull(timeout=10)
    finally:
        codes = [controller.stop(), replica.stop(), server.stop()]
    assert sorted(acked) == list(range(1, 13))
    assert final_version == 12
    ref = Reference(model, gamma)
    for v in sorted(acked):
        ref.apply(acked[v])
    assert_model_equal(final, ref.w)
    for code, err in codes[:2]:
        assert code == 0 and "Traceback" not in err, err
    for _, err in codes:  # every link any of them opened was TLS, and accepted
        assert "TLS handshake failed" not in err, err
    assert "promoting the replica" in codes[0][1]


# -- the TLS handshake is held to the listener's limits ----------------------------------


def tls_handshake(sock, ctx: ssl.SSLContext, hostname: str) -> ssl.SSLObject:
    """A client's TLS handshake on a blocking socket, its ClientHello sent at
    once after connecting (so it is in the listener's socket when the
    connection is accepted: uvloop reads it before start_tls takes over)."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=hostname)
    while True:
        try:
            obj.do_handshake()
            break
        except ssl.SSLWantReadError:
            sock.sendall(outgoing.read())
            data = sock.recv(1 << 16)
            if not data:
                raise ConnectionError("closed during the TLS handshake") from None
            incoming.write(data)
    sock.sendall(outgoing.read())
    return obj


def test_a_clienthello_read_before_start_tls_is_not_lost(certs, tls_server) -> None:
    ours, _ = certs
    ctx = tls.client_context(files(ours, "worker"))
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", tls_server.port), timeout=5) as sock:
            # The server's Finished came: it had the whole ClientHello.
            assert tls_handshake(sock, ctx, "127.0.0.1").version() == "TLSv1.3"


def test_a_silent_peer_is_dropped_within_the_handshake_timeout(certs, loop_kind,
                                                               caplog) -> None:
    ours, _ = certs
    st = ServerThread(ParameterStore(make_model()), loop_kind=loop_kind, handshake_timeout=0.3)
    st.server.tls = tls.server_context(files(ours, "server"))
    with caplog.at_level(logging.WARNING, logger="mlfabric.server"), st, \
            socket.create_connection(("127.0.0.1", st.port), timeout=5) as silent:
        silent.settimeout(5.0)  # bounded: the listener closes it long before
        try:
            assert silent.recv(1 << 16) == b""  # nothing sent before TLS: just closed
        except ConnectionResetError:
            pass
        wait_until(lambda: "no TLS handshake within 0.3 s" in caplog.text, 5, "the log line")
        wait_until(lambda: not st.server.unauthenticated, 5, "the connection forgotten")


def test_tls_handshakes_count_among_unauthenticated_connections(certs, loop_kind) -> None:
    ours, _ = certs
    st = ServerThread(ParameterStore(make_model()), loop_kind=loop_kind)
    st.server.tls = tls.server_context(files(ours, "server"))
    st.server.max_unauthenticated = 2
    with st:
        socks = [socket.create_connection(("127.0.0.1", st.port), timeout=5) for _ in range(2)]
        try:
            wait_until(lambda: len(st.server.unauthenticated) == 2, 5, "two held")
            socks.append(socket.create_connection(("127.0.0.1", st.port), timeout=5))
            socks[0].settimeout(5.0)
            try:
                assert socks[0].recv(1) == b""  # the oldest, closed to make room
            except ConnectionResetError:
                pass
            wait_until(lambda: st.metrics.unauthenticated_evicted._value.get() == 1, 5)
            # A good client still gets in (evicting the oldest of those left).
            ctx = tls.client_context(files(ours, "worker"))
            with socket.create_connection(("127.0.0.1", st.port), timeout=5) as good:
                assert tls_handshake(good, ctx, "127.0.0.1").version() == "TLSv1.3"
                # The evicted ones are not TLS refusals: the listener closed
                # them. (Closing the others from here would be: peers gone
                # mid-handshake.)
                assert st.metrics.unauthenticated_evicted._value.get() == 2
                assert st.metrics.tls_refused._value.get() == 0
        finally:
            for s in socks:
                s.close()


def test_push_returns_only_once_the_arrays_are_no_longer_read(certs, loop_kind,
                                                              monkeypatch) -> None:
    """The blocking client's push() of a large update returns once its bytes
    have left the caller's arrays (`Link.flushed`). Over TLS the transport
    keeps a reference to them until they are encrypted: flushed() must still
    mean that, or overwriting an array right after push() corrupts the update."""
    ours, _ = certs
    monkeypatch.setenv("MLFABRIC_LOOP", loop_kind)
    shape = (2048, 2048)  # 16 MiB: many TLS records, buffered in the transport
    model = {"w": np.zeros(shape, np.float32)}
    st = ServerThread(ParameterStore(model), loop_kind=loop_kind)
    st.server.tls = tls.server_context(files(ours, "server"))
    with st, mlfabric.connect(st.address, job=JOB, token=TOKEN, timeout=5,
                              **client_args(ours)) as c:
        version, _ = c.pull()
        u = {"w": np.full(shape, 0.25, np.float32)}
        pushed = c.push(u, base_version=version)
        u["w"][:] = 999.0  # the caller's array is the caller's again
        assert pushed.result(30).applied
        _, got = c.pull()
    assert np.array_equal(got["w"], np.full(shape, 0.25, np.float32))


def test_a_sharded_job_over_tls(certs) -> None:
    """mlfabric.connect to every shard: each link is TLS, and pushes apply
    bit for bit on every shard."""
    import contextlib

    from test_sharded import SIZES, addresses, sharded_store

    ours, _ = certs
    model = make_model(sizes=SIZES)
    ref = Reference(model, 0.5)
    with contextlib.ExitStack() as stack:
        servers = []
        for i in range(2):
            st = ServerThread(sharded_store(model, i, 2))
            st.server.tls = tls.server_context(files(ours, "server"))
            servers.append(stack.enter_context(st))
        ps = stack.enter_context(mlfabric.connect(addresses(servers), job=JOB, token=TOKEN,
                                                  timeout=5, **client_args(ours)))
        assert all(c._proto.transport.get_extra_info("ssl_object") is not None
                   for c in ps._engine.shards)
        version, _ = ps.pull(timeout=10)
        for k in range(3):
            u = random_update(model, seed=k)
            ref.apply(u)
            outcome = ps.push(u, base_version=version).result(10)
            assert outcome.applied and outcome.version == (k + 1, k + 1)
            version, params = ps.pull(timeout=10)
        assert_model_equal(params, ref.w)


# -- the agent's control port ----------------------------------------------------------------
#
# With --tls-* (AgentConfig.tls) the agent's control port takes mutual TLS
# only, started per connection as a job listener does: a failed TLS
# handshake is counted (agent_tls_refused_total) and logged, and held to the
# login timeout and the cap on connections not logged in. Its clients dial
# it over TLS: peer agents' probe sessions, the controller, workers' transfer
# reports, query_estimates. The login and the frame MACs run inside TLS.


def tls_agent(certs, name: str = "a", cert: str = "server", **kw):
    from mlfabric.agent.daemon import Agent, AgentConfig
    from mlfabric.agent.estimator import ProbeConfig
    from mlfabric.runtime.metrics import AgentMetrics

    ours, _ = certs
    config = AgentConfig(name=name, cluster_token=CLUSTER_TOKEN, host="127.0.0.1", port=0,
                         counters=None, backoff_max=0.2,
                         probe=ProbeConfig(max_packets=64, initial_bps=50e6, stale_after=0.5),
                         tls=tls.server_context(files(ours, cert)),
                         tls_client=tls.client_context(files(ours, cert)), **kw)
    return Agent(config, metrics=AgentMetrics())


def worker_context(certs) -> ssl.SSLContext:
    ours, _ = certs
    return tls.client_context(files(ours, "worker"))


class AgentEndpoint:
    """An agent, as an endpoint to run in a ServerThread."""

    role = "agent"

    def __init__(self, agent) -> None:
        self.agent, self.metrics = agent, agent.metrics

    async def start(self, host, port):
        await self.agent.start()
        return "127.0.0.1", self.agent.port

    async def close(self):
        await self.agent.stop()


def test_tls_agents_probe_each_other_and_serve_estimates_and_reports(certs, run_async) -> None:
    from mlfabric.agent.daemon import AgentClient, query_estimates
    from mlfabric.client.agent_report import TransferReporter

    ctx = worker_context(certs)

    async def main():
        a, b = tls_agent(certs, "a"), tls_agent(certs, "b")
        await a.start()
        await b.start()
        try:
            a.set_peers({"b": ("127.0.0.1", b.port)})
            b.set_peers({"a": ("127.0.0.1", a.port)})
            await a.wait_trains("b", 2, timeout=10)  # probe sessions, over TLS
            # the controller's reader: the job's key, over TLS
            async with await AgentClient.connect("127.0.0.1", a.port, JOB_AGENT_KEY,
                                                 tls=ctx) as client:
                assert client._writer.get_extra_info("ssl_object").version() == "TLSv1.3"
                assert client._conn.protected  # the login's MACs inside TLS
                est = await client.estimates()
            assert est.agent == "a" and [e.peer for e in est.estimates] == ["b"]
            # b answered a's trains and pings on the probe session
            assert est.estimates[0].connected and est.estimates[0].rtt_s > 0
            # a worker's transfer reports, and a tool's one-shot read
            reporter = TransferReporter(f"127.0.0.1:{a.port}", JOB_AGENT_KEY, timeout=5,
                                        tls=ctx)
            reporter.report("b", 1 << 20, 0.1)
            wait = asyncio.get_running_loop().run_in_executor
            await wait(None, reporter.close)
            assert reporter.sent == 1 and reporter.dropped == 0
            deadline = asyncio.get_running_loop().time() + 5
            while sample(a.metrics.transfer_reports, result="accepted") < 1:
                assert asyncio.get_running_loop().time() < deadline, "no report accepted"
                await asyncio.sleep(0.01)
            got = await wait(None, lambda: query_estimates("127.0.0.1", a.port, CLUSTER, 5,
                                                           tls=ctx))
            assert [e.peer for e in got.estimates] == ["b"]
            # the login still decides inside TLS: a wrong key is refused
            with pytest.raises(AuthenticationError, match="did not prove it holds"):
                await AgentClient.connect("127.0.0.1", a.port, AgentCredential(
                    "job", JOB, derive_job_key(WRONG_TOKEN, JOB)), tls=ctx)
            for agent in (a, b):
                assert sample(agent.metrics.tls_refused) == 0
                assert sample(agent.metrics.bad_messages, kind="frame") == 0
        finally:
            await b.stop()
            await a.stop()

    run_async(main())


@pytest.fixture
def agent_thread(certs, loop_kind):
    """A TLS agent (certificate `server`, naming 127.0.0.1) in a thread."""
    agent = tls_agent(certs)
    with ServerThread(None, loop_kind=loop_kind, endpoint=AgentEndpoint(agent)) as thread:
        thread.agent = agent
        yield thread


def refused_by_agent(thread, caplog, reason: str) -> None:
    wait_until(lambda: sample(thread.agent.metrics.tls_refused) == 1, 5,
               "the refusal counted by the agent")
    assert f"TLS handshake failed: {reason}" in caplog.text, caplog.text


def _connect(port: int, **kw):
    from mlfabric.agent.daemon import AgentClient

    async def main():
        client = await AgentClient.connect("127.0.0.1", port, JOB_AGENT_KEY, timeout=5, **kw)
        await client.close()

    return main()


def test_a_plain_client_of_a_tls_agent_is_refused_and_told(agent_thread, run_async,
                                                           caplog) -> None:
    port = agent_thread.agent.port
    with caplog.at_level(logging.WARNING, logger="mlfabric.agent"):
        with pytest.raises(ConnectionLost) as info:
            run_async(_connect(port))
        assert str(info.value) == (
            f"the agent at 127.0.0.1:{port} closed the connection during the login: perhaps "
            f"it requires TLS (give --tls-cert, --tls-key and --tls-ca, or tls_cert, tls_key "
            f"and tls_ca), or it is shutting down")
        refused_by_agent(agent_thread, caplog, "the peer does not speak TLS "
                                               "(WRONG_VERSION_NUMBER)")


def test_a_client_certificate_of_another_ca_is_refused_by_the_agent(certs, agent_thread,
                                                                    run_async,
                                                                    caplog) -> None:
    ours, theirs = certs
    # Their worker's certificate, though it trusts our CA.
    ctx = tls.client_context(files(theirs, "worker", ca_dir=ours))
    port = agent_thread.agent.port
    with caplog.at_level(logging.WARNING, logger="mlfabric.agent"):
        with pytest.raises(ConnectionLost) as info:
            run_async(_connect(port, tls=ctx))
        assert str(info.value) == (
            f"the agent at 127.0.0.1:{port} closed the connection right after the TLS "
            f"handshake: it did not accept this client's certificate (not signed by its "
            f"--tls-ca; its log says why), or it is shutting down; give tls_cert and tls_key "
            f"(or --tls-cert and --tls-key) signed by the cluster's CA")
        refused_by_agent(agent_thread, caplog, "certificate not accepted: unable to get local "
                                               "issuer certificate")
    assert agent_thread.call(lambda: agent_thread.agent.pending_logins) == 0


def test_the_client_refuses_an_agent_of_another_ca(certs, agent_thread, run_async) -> None:
    ours, theirs = certs
    port = agent_thread.agent.port
    with pytest.raises(TLSError) as info:
        run_async(_connect(port, tls=tls.client_context(files(ours, "worker", ca_dir=theirs))))
    assert str(info.value) == (
        f"the agent at 127.0.0.1:{port} presented a certificate this client does not accept: "
        f"self-signed certificate in certificate chain; it must be signed by the CA in tls_ca "
        f"and name the host dialled (`mlfabric tls init --host`)")


def test_a_tls_client_of_a_plain_agent_is_told_on_both_sides(certs, loop_kind, run_async,
                                                             caplog) -> None:
    from mlfabric.agent.daemon import Agent, AgentConfig, query_estimates
    from mlfabric.runtime.metrics import AgentMetrics

    plain = Agent(AgentConfig(name="p", cluster_token=CLUSTER_TOKEN, host="127.0.0.1", port=0,
                              counters=None), metrics=AgentMetrics())
    ctx = worker_context(certs)
    with caplog.at_level(logging.WARNING, logger="mlfabric.agent"), \
            ServerThread(None, loop_kind=loop_kind, endpoint=AgentEndpoint(plain)):
        for attempt in (lambda: run_async(_connect(plain.port, tls=ctx)),
                        lambda: query_estimates("127.0.0.1", plain.port, JOB_AGENT_KEY, 5,
                                                tls=ctx)):
            with pytest.raises(TLSError) as info:
                attempt()
            assert str(info.value) == (
                f"the agent at 127.0.0.1:{plain.port} does not use TLS (WRONG_VERSION_NUMBER): "
                f"start `mlfabric agent` with --tls-cert, --tls-key and --tls-ca, or connect "
                f"without TLS settings")
        wait_until(lambda: "this agent's control port is plain TCP" in caplog.text, 5,
                   "the agent's log line")
    assert "refused a TLS client at 127.0.0.1:" in caplog.text


def test_a_clienthello_read_before_start_tls_reaches_the_agent(certs, agent_thread) -> None:
    """uvloop reads the ClientHello that came with the connection before the
    agent hands the socket to its TLS layer: those bytes must not be lost."""
    ctx = worker_context(certs)
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", agent_thread.agent.port),
                                      timeout=5) as sock:
            assert tls_handshake(sock, ctx, "127.0.0.1").version() == "TLSv1.3"


def test_tls_handshakes_at_the_agent_are_held_to_its_login_limits(certs, loop_kind) -> None:
    """A peer silent in its TLS handshake is closed at the login timeout;
    such connections count among those not logged in (the cap), and a good
    client still gets in."""
    agent = tls_agent(certs, login_timeout=0.5, max_unauthenticated=2)
    ctx = worker_context(certs)
    with ServerThread(None, loop_kind=loop_kind, endpoint=AgentEndpoint(agent)) as thread:
        socks = [socket.create_connection(("127.0.0.1", agent.port), timeout=5)
                 for _ in range(3)]
        try:
            socks[0].settimeout(5.0)
            try:
                assert socks[0].recv(1) == b""  # the oldest, closed to make room
            except ConnectionResetError:
                pass
            wait_until(lambda: sample(agent.metrics.refused, reason="evicted") == 1, 5)
            assert thread.call(lambda: agent.pending_logins) == 2
            for s in socks[1:]:  # closed at the login timeout, no TLS handshake done
                s.settimeout(5.0)
                try:
                    assert s.recv(1) == b""
                except ConnectionResetError:
                    pass
            wait_until(lambda: sample(agent.metrics.refused, reason="login-timeout") == 2, 5)
            assert thread.call(lambda: agent.pending_logins) == 0
            assert sample(agent.metrics.tls_refused) == 0  # (closed by the agent: no refusal)
            with socket.create_connection(("127.0.0.1", agent.port), timeout=5) as good:
                assert tls_handshake(good, ctx, "127.0.0.1").version() == "TLSv1.3"
            # the evicted one is not counted again at its login timeout
            assert sample(agent.metrics.refused, reason="login-timeout") == 2
        finally:
            for s in socks:
                s.close()


def test_the_agent_port_and_its_aggregator_listen_over_tls(certs, tmp_path) -> None:
    """`mlfabric agent --tls-*` secures its control port (before, the flags
    were refused without --aggregate) and its aggregator's listener alike."""
    from mlfabric.agent.daemon import query_estimates

    ours, _ = certs
    flags = ["--tls-cert", str(ours / "server.pem"), "--tls-key", str(ours / "server.key"),
             "--tls-ca", str(ours / "ca.pem")]
    proc = Process(command("aggregator", tmp_path, *flags), tmp_path,
                   r"ready on (\S+), mutual TLS; aggregating job '[^']+' on \S+, mutual TLS "
                   r"\(forwards to \S+ only\)$")
    try:
        host, port = proc.address.rsplit(":", 1)
        got = query_estimates(host, int(port), CLUSTER, 5, tls=worker_context(certs))
        assert got.agent == "a1" and got.estimates == ()
        with pytest.raises(ConnectionLost, match="perhaps it requires TLS"):
            query_estimates(host, int(port), CLUSTER, 5)
    finally:
        assert proc.stop() == 0


def test_a_tls_controller_reads_a_tls_agent_set_from_its_config_file(certs,
                                                                     tmp_path) -> None:
    """The agent's TLS settings from its --config file; the controller, with
    --tls-*, dials its --agent over TLS (`mlfabric status` says reachable);
    a controller without TLS cannot, and its status says why."""
    import json

    from support import agent_key_file

    ours, _ = certs
    conf = tmp_path / "agent.json"
    conf.write_text(json.dumps({"tls_cert": str(ours / "server.pem"),
                                "tls_key": str(ours / "server.key"),
                                "tls_ca": str(ours / "ca.pem")}))
    flags = ["--tls-cert", str(ours / "server.pem"), "--tls-key", str(ours / "server.key"),
             "--tls-ca", str(ours / "ca.pem")]
    agent = Process(mlfabric_cmd("agent", "--name", "h1", "--listen",
                                 f"127.0.0.1:{free_port()}", "--cluster-token-file",
                                 str(cluster_token_file()), "--config", str(conf)),
                    tmp_path, r"ready on (\S+), mutual TLS$")
    procs = [agent]
    try:
        for tls_flags in (flags, []):
            ctl = Process(command("controller", tmp_path, "--agent", f"h1={agent.address}",
                                  "--agent-key-file", str(agent_key_file()),
                                  "--agent-interval", "0.1", *tls_flags), tmp_path,
                          r"serving job '[^']+' on (\S+)")
            procs.append(ctl)

            def agents(ctl=ctl, tls_flags=tls_flags) -> dict:
                done = subprocess.run(mlfabric_cmd("status", "--controller", ctl.address,
                                                   "--job", JOB, "--token-file",
                                                   str(tmp_path / "job.token"), "--json",
                                                   *tls_flags),
                                      capture_output=True, text=True, timeout=60)
                assert done.returncode == 0, done.stderr
                (found,) = json.loads(done.stdout)["agents"]
                return found

            if tls_flags:
                wait_until(lambda: agents()["reachable"], 10, "the agent read over TLS")
            else:
                wait_until(lambda: "requires TLS" in agents()["error"], 10, "the reason")
                assert agents()["error"] == (
                    f"the agent at {agent.address} closed the connection during the login: "
                    f"perhaps it requires TLS (give --tls-cert, --tls-key and --tls-ca, or "
                    f"tls_cert, tls_key and tls_ca), or it is shutting down")
    finally:
        assert [p.stop() for p in reversed(procs)] == [0] * len(procs)
