"""Random and mutated frames thrown at a live server; afterwards a good client
still pulls exactly the expected weights, and the server loop saw no error.

The expected weights are a replay: each authenticated stream is decoded with
the same parser the server uses, up to where the server closes the
connection, and its pushes are applied to a reference store. (A mutated
length can make a valid push swallow the next frame's bytes as tensor data:
a legitimate update, which the server must apply exactly.)"""

from __future__ import annotations

import socket

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlfabric
from mlfabric.errors import InvalidUpdate, ProtocolError
from mlfabric.server.store import ParameterStore
from mlfabric.wire.protocol import (
    HEADER,
    Auth,
    Connection,
    Error,
    Hello,
    Model,
    Pull,
    Push,
    PushResult,
    TensorSpec,
    Welcome,
)

from support import JOB, TOKEN, RawClient, ServerThread, assert_model_equal, make_model

MODEL = make_model(sizes={"w": (16, 4), "b": (4,)})
ZEROS = {n: np.zeros_like(a) for n, a in MODEL.items()}


def _encode(event) -> bytes:
    return Connection().send_bytes(event)


BASE_FRAMES = [
    _encode(Hello(job=JOB, client="fuzz", nonce=b"n" * 32)),
    _encode(Auth(proof=b"p" * 32)),
    _encode(Pull(req=1)),
    _encode(Push(req=2, base_version=0, tensors=ZEROS)),
    _encode(Push(req=3, base_version=0, tensors={"w": ZEROS["w"]})),
    _encode(Push(req=4, base_version=0, tensors={"b": np.zeros(3, np.float32)})),
    _encode(Model(req=5, version=0, tensors=ZEROS)),
    _encode(PushResult(req=6, applied=True, version=1, delay=0)),
    _encode(Error(code="x", message="y")),
    _encode(Welcome(session="s", version=0, tensors=(TensorSpec("w", np.dtype("<f4"), (2,)),))),
]


def _prefix_len(frame: bytes) -> int:
    """Header and metadata: where mutations may go (tensor data stays zero)."""
    return HEADER.size + int.from_bytes(frame[8:12], "little")


@st.composite
def mutated_frame(draw) -> bytes:
    frame = bytearray(draw(st.sampled_from(BASE_FRAMES)))
    prefix = _prefix_len(bytes(frame))
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["flip", "set", "insert", "delete"]))
        i = draw(st.integers(0, prefix - 1))
        if kind == "flip":
            frame[i] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set":
            frame[i] = draw(st.integers(0, 255))
        elif kind == "insert":
            junk = draw(st.binary(min_size=1, max_size=8))
            frame[i:i] = junk
            prefix += len(junk)
        elif len(frame) > 1:
            del frame[i]
            prefix -= 1
        prefix = max(1, min(prefix, len(frame)))
    if draw(st.booleans()):
        frame = frame[: draw(st.integers(0, len(frame)))]
    return bytes(frame)


streams = st.lists(
    st.one_of(mutated_frame(), st.binary(max_size=300), st.sampled_from(BASE_FRAMES)),
    min_size=1,
    max_size=4,
).map(b"".join)


def replay(reference: ParameterStore, data: bytes, max_frame_size: int) -> None:
    """Apply to `reference` what the server applies from this authenticated stream."""
    conn = Connection(max_frame_size=max_frame_size)
    conn.receive_data(data)
    while True:
        try:
            event = conn.next_event()
        except ProtocolError:
            return  # the server closes the connection here
        if isinstance(event, Push):
            try:
                reference.apply(event.base_version, event.tensors)
            except InvalidUpdate:
                pass  # refused with an error; the connection stays open
        elif not isinstance(event, Pull):
            return  # NEED_DATA (the stream ends), or a message the server refuses


def _exchange(port: int, data: bytes, authenticate: bool) -> None:
    raw = RawClient(port, authenticate=authenticate)
    try:
        raw.send_raw(data)
        raw.sock.shutdown(socket.SHUT_WR)
        # The server answers what it can and closes; EOF must come (5 s timeout).
        while raw.sock.recv(1 << 16):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass  # the server closed first: fine
    finally:
        raw.close()


def test_fuzzed_frames_never_corrupt_the_model_or_stop_the_server(loop_kind):
    store = ParameterStore(MODEL, momentum=0.5, tau_max=None)
    reference = ParameterStore(MODEL, momentum=0.5, tau_max=None)
    with ServerThread(store, loop_kind=loop_kind) as server, mlfabric.connect(
        server.address, job=JOB, token=TOKEN
    ) as good:

        @settings(max_examples=150, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(data=streams, authenticate=st.booleans())
        def check(data: bytes, authenticate: bool) -> None:
            _exchange(server.port, data, authenticate)
            if authenticate:
                replay(reference, data, server.server.max_frame_size)
            version, params = good.pull(timeout=10)
            assert version == reference.version
            assert_model_equal(params, reference.weights)

        check()
        assert server.metrics.protocol_errors._value.get() > 0
        version, params = good.pull(timeout=10)
        assert version == reference.version == server.metrics.updates_applied._value.get()
        assert_model_equal(params, reference.weights)
