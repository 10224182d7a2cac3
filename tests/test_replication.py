"""Chain replication end to end: `mlfabric server --replicate-to` feeding an
`mlfabric server --role replica`, both real processes."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading

import numpy as np

import mlfabric
from mlfabric.errors import ConfigError

from support import JOB, TOKEN, Reference, assert_model_equal, make_model, random_update


class Serving:
    """`mlfabric server ...` (or another listening command) in a subprocess,
    waited for by its 'serving' line."""

    def __init__(self, tmp_path, *args: str, command: str = "server") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlfabric", command, "--listen", "127.0.0.1:0", "--job", JOB,
             "--token-file", str(tmp_path / "job.token"), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        line = self.lines.get(timeout=30)
        if not line or "serving job" not in line:
            self.proc.kill()
            raise AssertionError(f"no serving line: {line!r} {self.proc.stderr.read()}")
        self.address = line.split(" on ")[1].split()[0]

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def stop(self) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(15)
        assert self.proc.stderr is not None
        return code, self.proc.stderr.read()


def write_inputs(tmp_path, model):
    token = tmp_path / "job.token"
    token.write_bytes(TOKEN)
    token.chmod(0o600)
    np.savez(tmp_path / "init.npz", **model)
    return str(tmp_path / "init.npz")


def test_chain_replication_leaves_the_replica_equal_to_the_server(tmp_path):
    model = make_model()
    init = write_inputs(tmp_path, model)
    replica = Serving(tmp_path, "--role", "replica", "--init", init, "--momentum", "0.9")
    server = None
    try:
        server = Serving(tmp_path, "--init", init, "--momentum", "0.9", "--tau-max", "-1",
                         "--replicate-to", replica.address)
        applied: dict[int, dict[str, np.ndarray]] = {}
        lock = threading.Lock()

        def worker(w: int) -> None:
            with mlfabric.connect(server.address, job=JOB, token=TOKEN) as ps:
                for i in range(8):
                    version, _ = ps.pull(timeout=10)
                    u = random_update(model, seed=100 * w + i)
                    outcome = ps.push(u, base_version=version).result(10)
                    assert outcome.applied
                    with lock:
                        applied[outcome.version] = u

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(applied) == list(range(1, 25))
        # Acknowledged means on both: no wait needed before reading the replica.
        with mlfabric.connect(server.address, job=JOB, token=TOKEN) as ps:
            sv, sw = ps.pull(timeout=10)
        with mlfabric.connect(replica.address, job=JOB, token=TOKEN) as rs:
            rv, rw = rs.pull(timeout=10)
    finally:
        codes = [server.stop() if server else (0, ""), replica.stop()]
    assert sv == rv == 24
    ref = Reference(model, 0.9)
    for version in sorted(applied):
        ref.apply(applied[version])
    assert_model_equal(sw, ref.w)
    assert_model_equal(rw, ref.w)
    for code, err in codes:
        assert code == 0 and "Traceback" not in err, err


def test_the_server_serves_on_alone_when_its_replica_dies(tmp_path):
    model = make_model()
    init = write_inputs(tmp_path, model)
    replica = Serving(tmp_path, "--role", "replica", "--init", init)
    server = Serving(tmp_path, "--init", init, "--replicate-to", replica.address)
    try:
        with mlfabric.connect(server.address, job=JOB, token=TOKEN) as ps:
            assert ps.push(random_update(model, 1), base_version=0).result(10).version == 1
            replica.proc.kill()
            replica.proc.wait(10)
            for i in range(2, 5):
                outcome = ps.push(random_update(model, i), base_version=0).result(10)
                assert (outcome.applied, outcome.version) == (True, i)
    finally:
        code, err = server.stop()
    assert code == 0
    assert f"lost the connection to the replica at {replica.address}" in err
    assert "serving without a replica from version 1 on" in err


def test_the_server_refuses_a_replica_holding_another_model(tmp_path, run_async):
    from mlfabric.replication.chain import ChainLink
    from mlfabric.runtime.metrics import ServerMetrics
    from mlfabric.server.store import ParameterStore

    model = make_model()
    init = write_inputs(tmp_path, model)
    replica = Serving(tmp_path, "--role", "replica", "--init", init, "--momentum", "0.5")
    try:
        async def connect(store):
            return await ChainLink.connect(replica.address, job=JOB, token=TOKEN, store=store,
                                           metrics=ServerMetrics())

        for store, message in [
            (ParameterStore(model, momentum=0.5, version=3), "is at version 0, this server at 3"),
            (ParameterStore(model, momentum=0.9), "has momentum 0.5, this server 0.9"),
            (ParameterStore({"w": model["w"]}, momentum=0.5), "holds other tensors"),
        ]:
            try:
                run_async(connect(store))
            except ConfigError as exc:
                assert message in str(exc) and "same --init" in str(exc)
            else:
                raise AssertionError(f"connected despite: {message}")
    finally:
        replica.stop()


def test_a_hung_replica_is_given_up_and_the_server_answers_alone(loop_kind):
    """Chain replication answers a worker once the replica acknowledged; a
    replica that stops answering (its loop is stuck here for 3 s) must not
    hold every push: after the ack timeout the server serves alone."""
    import asyncio
    import time

    from mlfabric.replication.chain import ChainLink
    from mlfabric.replication.replica import ReplicaServer
    from mlfabric.runtime.metrics import ServerMetrics
    from mlfabric.server.store import ParameterStore

    from support import ServerThread, random_update

    model = make_model()
    replica_ep = ReplicaServer(ParameterStore(model, momentum=0.9), job=JOB, token=TOKEN,
                               metrics=ServerMetrics())
    with ServerThread(None, endpoint=replica_ep, loop_kind=loop_kind) as replica, \
            ServerThread(ParameterStore(model, momentum=0.9), loop_kind=loop_kind) as server:
        async def link():
            return await ChainLink.connect(replica.address, job=JOB, token=TOKEN,
                                           store=server.store, metrics=server.metrics)

        chain = asyncio.run_coroutine_threadsafe(link(), server._loop).result(10)
        chain.ack_timeout = 0.5
        server.server.chain = chain
        with mlfabric.connect(server.address, job=JOB, token=TOKEN) as ps:
            assert ps.push(random_update(model, seed=1), base_version=0).result(10).applied
            replica._loop.call_soon_threadsafe(time.sleep, 3)  # the replica hangs
            started = time.monotonic()
            outcome = ps.push(random_update(model, seed=2), base_version=1).result(10)
            waited = time.monotonic() - started
        assert (outcome.applied, outcome.version) == (True, 2)
        assert 0.4 <= waited < 2.5, waited
        assert server.metrics.replica_connected._value.get() == 0
