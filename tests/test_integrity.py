"""Frames cannot be altered, injected, replayed or reordered (issue 33).

Measured before: a man in the middle on loopback, relaying an authenticated
session, negated a worker's update in flight (the server applied it, and the
worker was told it was applied), and injected a push of its own (applied).
Now every frame after the handshake carries a MAC keyed per session and
direction, over its sequence number: a relay that flips one bit of a push,
injects a forged or a replayed push, or alters the server's answer is
detected, the session closes, and the model is untouched. A real server and
a real client, through a real relay on loopback.
"""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

import mlfabric
from mlfabric.errors import MlfabricError, ProtocolError
from mlfabric.server.store import ParameterStore
from mlfabric.wire import auth
from mlfabric.wire.protocol import FLAG_MAC, HEADER, MAC_SIZE, Connection, Ping, Pong, Push

from support import JOB, TOKEN, ServerThread, assert_model_equal, make_model, random_update


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


@pytest.fixture
def served():
    model = make_model(sizes={"w": (256, 512), "b": (512,)})  # 512 KiB of float32
    st = ServerThread(ParameterStore({n: a.copy() for n, a in model.items()}))
    st.__enter__()
    relay = Relay(("127.0.0.1", st.port))
    yield model, st, relay
    relay.close()
    st.__exit__(None, None, None)


def _untouched(st: ServerThread, model, version: int = 0) -> None:
    assert st.call(lambda: st.store.version) == version
    if version == 0:
        assert_model_equal(st.call(lambda: {n: a.copy() for n, a in st.store.weights.items()}),
                           model)


def test_a_bit_flipped_in_a_push_is_detected_and_the_model_untouched(served) -> None:
    model, st, relay = served
    with mlfabric.connect(relay.address, job=JOB, token=TOKEN, timeout=10) as ps:
        relay.flip_at = len(relay.c2s) + 300_000  # inside the push's data block
        with pytest.raises(MlfabricError) as err:
            ps.push(random_update(model, 1), base_version=0).result(10)
    assert "a PUSH frame failed its integrity check" in str(err.value)
    assert st.metrics.protocol_errors._value.get() == 1
    _untouched(st, model)


@pytest.mark.parametrize("forgery", ["forged MAC", "no MAC", "replayed"])
def test_an_injected_push_is_detected_and_the_session_closes(served, forgery) -> None:
    """The relay puts a push of its own into an authenticated session: with a
    MAC under a key of its own, without any, or a copy of the worker's own
    last push (a replay). None is applied; the session closes."""
    model, st, relay = served
    evil = {n: np.full_like(a, 1000.0) for n, a in model.items()}
    with mlfabric.connect(relay.address, job=JOB, token=TOKEN, timeout=10) as ps:
        if forgery == "replayed":
            start = len(relay.c2s)
            ps.push(random_update(model, 2), base_version=0).result(10)
            frame = bytes(relay.c2s[start:])
            expected_version = 1  # the worker's own push, once
        else:
            conn = Connection()
            if forgery == "forged MAC":
                guess = auth.new_nonce()
                conn.protect(guess, guess)
            frame = conn.send_bytes(Push(req=99, base_version=0, tensors=evil))
            expected_version = 0
        relay.inject(frame)
        with pytest.raises(MlfabricError) as err:  # the session is closed under the worker
            ps.push(random_update(model, 3), base_version=expected_version).result(10)
    message = str(err.value)
    assert ("failed its integrity check" in message if forgery != "no MAC" else
            "without its integrity check on a protected connection" in message), message
    assert st.metrics.protocol_errors._value.get() == 1
    _untouched(st, model, expected_version)
    if expected_version == 1:
        w = st.call(lambda: {n: a.copy() for n, a in st.store.weights.items()})
        assert not np.any(w["w"] > 100)  # the replay was not applied a second time


def test_a_bit_flipped_in_the_servers_answer_is_detected_by_the_client(served) -> None:
    _, st, relay = served
    with mlfabric.connect(relay.address, job=JOB, token=TOKEN, timeout=10) as ps:
        relay.flip_s2c_at = relay.s2c_count + 200_000  # inside the model's data block
        with pytest.raises(ProtocolError) as err:
            ps.pull()
    assert str(err.value).startswith("a MODEL frame failed its integrity check (frame ")
    assert st.call(lambda: st.store.version) == 0


# --- the codec, without I/O ---------------------------------------------------------


def _pair() -> tuple[Connection, Connection]:
    a, b = Connection(), Connection()
    k1, k2 = auth.new_nonce(), auth.new_nonce()
    a.protect(k1, k2)
    b.protect(k2, k1)
    return a, b


def test_protected_frames_round_trip_and_carry_their_mac() -> None:
    a, b = _pair()
    u = {"w": np.arange(1000, dtype=np.float32)}
    for ev in (Ping(req=1), Push(req=2, base_version=0, tensors=u),
               Pong(req=3, role="server", version=4)):
        frame = a.send_bytes(ev)
        assert HEADER.unpack_from(frame)[3] == FLAG_MAC
        b.receive_data(frame)
        got = b.next_event()
        assert type(got) is type(ev) and got.req == ev.req
        if isinstance(ev, Push):
            assert np.array_equal(got.tensors["w"], u["w"])


@pytest.mark.parametrize("what", ["reordered", "dropped", "truncated MAC", "reflected"])
def test_reordered_dropped_or_reflected_frames_fail_their_check(what: str) -> None:
    a, b = _pair()
    first, second = a.send_bytes(Ping(req=1)), a.send_bytes(Ping(req=2))
    if what == "reordered":
        stream = second + first
    elif what == "dropped":
        stream = second
    elif what == "truncated MAC":
        stream = first[:-1] + bytes([first[-1] ^ 1])
    else:  # the receiver's own frame sent back to it
        stream = b.send_bytes(Ping(req=1))
    b.receive_data(stream)
    with pytest.raises(ProtocolError, match="failed its integrity check"):
        b.next_event()
    with pytest.raises(ProtocolError):  # and the connection stays broken
        b.next_event()


def test_a_streamed_frame_carries_one_mac_over_its_pieces() -> None:
    from mlfabric.wire.protocol import Model, spec_of
    from mlfabric.wire.streamed import StreamedBlock

    a, b = _pair()
    tensors = {"w": np.arange(3000, dtype=np.float32), "b": np.ones(7, np.float32)}
    head = a.send_head(Model(req=1, version=3, tensors=tensors))
    block = StreamedBlock([spec_of(n, t) for n, t in tensors.items()])
    data = bytearray(head)
    for upto in (1000, 5000, block.total):
        piece = block.from_arrays(tensors, upto)
        a.stream_data(piece)
        data += piece
    data += a.stream_trailer()
    assert len(data) == len(head) + block.total + MAC_SIZE
    b.receive_data(bytes(data))
    got = b.next_event()
    assert np.array_equal(got.tensors["w"], tensors["w"])
