"""Random and mutated frames thrown at a live server; afterwards a good client
still pulls exactly the expected weights, and the server loop saw no error.

Streams are drawn as recipes (tests/fuzz_recipes.py) and made at exchange
time: an authenticated stream's frames by the raw client's own protected
connection (each with its MAC and its number), then mutated, cut, swapped,
replayed or dropped; an unauthenticated one of plain frames. The server reads
a frame's header and fields before its MAC trailer arrives, so mutated ones
still reach its parser; each fails at the latest at its trailer.

The expected weights are a replay: each authenticated stream, the exact bytes
sent, is decoded by a Connection protected with the server's receive key (the
client's send key), up to where the server closes the connection, and its
pushes are applied to a reference store: an intact push is applied, nothing
after a refused frame is.
"""

from __future__ import annotations

import socket

import numpy as np
from fuzz_recipes import Dropped, Frame, Swapped, Twice, render, streams
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import mlfabric
from mlfabric.errors import InvalidUpdate, ProtocolError
from mlfabric.server.store import ParameterStore
from mlfabric.wire.protocol import (
    HEADER,
    MAC_SIZE,
    Auth,
    Connection,
    Error,
    Hello,
    Model,
    Ping,
    Pull,
    PullCancel,
    Push,
    PushResult,
    StateRequest,
    TensorSpec,
    Welcome,
)

from support import (
    JOB,
    TOKEN,
    RawClient,
    ServerThread,
    assert_model_equal,
    make_model,
    random_update,
)

MODEL = make_model(sizes={"w": (16, 4), "b": (4,)})
UPDATE = random_update(MODEL, seed=1)

# Those the server takes first (an intact stream of them keeps the connection
# open), then those it refuses, closing it.
BASE_EVENTS = [
    Push(req=1, base_version=0, tensors=UPDATE),  # applied
    Pull(req=2),
    Push(req=3, base_version=0, tensors=UPDATE, uid="fuzz-once"),  # applied the first time
    PullCancel(req=4),
    Ping(req=5, since=0, velocity=True),
    StateRequest(req=6),
    Push(req=7, base_version=0, tensors={"w": UPDATE["w"]}),  # refused: a tensor missing
    Push(req=8, base_version=0, tensors={"b": np.zeros(3, np.float32)}),  # refused: shape
    Push(req=9, base_version=0, tensors=UPDATE, seq=1),  # refused: only replicas take seq
    Hello(job=JOB, client="fuzz", nonce=b"n" * 32),
    Auth(proof=b"p" * 32),
    Model(req=10, version=0, tensors=UPDATE),
    PushResult(req=11, applied=True, version=1, delay=0),
    Error(code="x", message="y"),
    Welcome(session="s", version=0, tensors=(TensorSpec("w", np.dtype("<f4"), (2,)),)),
]
PUSH = 0  # BASE_EVENTS[PUSH]: the push that is applied
# What the server answers and reads on after (roles.SERVER, but pushes).
ANSWERED = (Pull, PullCancel, StateRequest, Ping)


def prefix_len(frame: bytes) -> int:
    """A frame's header and fields: where mutations go."""
    return HEADER.size + int.from_bytes(frame[8:12], "little")


def _sizes() -> list[tuple[int, int]]:
    out = []
    for ev in BASE_EVENTS:
        frame = Connection().send_bytes(ev)
        out.append((prefix_len(frame), len(frame) + MAC_SIZE))
    return out


RECIPES = streams(_sizes(), favoured=6)


def replay(reference: ParameterStore, data: bytes, keys: tuple[bytes, bytes],
           max_frame_size: int) -> None:
    """Apply to `reference` what the server applies from this authenticated
    stream, sent by a client whose frame keys are `keys` (send, receive)."""
    conn = Connection(max_frame_size=max_frame_size)
    conn.protect(keys[1], keys[0])  # the server receives under the client's send key
    conn.receive_data(data)
    while True:
        try:
            event = conn.next_event()
        except ProtocolError:
            return  # the server closes the connection here
        if isinstance(event, Push):
            if event.seq is not None:
                continue  # refused with an error; the connection stays open
            try:
                reference.apply(event.base_version, event.tensors, event.uid)
            except InvalidUpdate:
                pass  # refused with an error (a duplicate: answered, not applied)
        elif not isinstance(event, ANSWERED):
            return  # NEED_DATA (the stream ends), or a message the server refuses


def _drain(raw: RawClient) -> None:
    """Half-close and read until the server closes: it answers what it can
    and closes (EOF must come: the socket's 5 s timeout bounds each read)."""
    try:
        raw.sock.shutdown(socket.SHUT_WR)
        while raw.sock.recv(1 << 16):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass  # the server closed first: fine
    finally:
        raw.close()


def _plain(i: int) -> bytes:
    return Connection().send_bytes(BASE_EVENTS[i])


def exchange(port: int, parts, authenticate: bool
             ) -> tuple[bytes, list[int], tuple[bytes, bytes] | None]:
    """Send the stream `parts` makes; returns its bytes, the base events it
    carries intact and in order up to its first flaw, and the client's frame
    keys (None unauthenticated)."""
    raw = RawClient(port, authenticate=authenticate)
    if authenticate:
        assert raw.keys is not None
        data, intact = render(parts, lambda i: raw.frame(BASE_EVENTS[i]), prefix_len)
    else:
        data, intact = render(parts, _plain, prefix_len)
    try:
        raw.send_raw(data)
    except (ConnectionResetError, BrokenPipeError):
        pass  # refused and closed before all of it was sent: the replay stops there too
    _drain(raw)
    return data, intact, raw.keys


def replay_recipe(reference: ParameterStore, intact: list[int]) -> None:
    """The same as `replay`, from the recipe alone, without the parser: the
    frames sent intact and in order are taken, up to the first the server
    refuses (so a parser that let an altered frame through is caught too)."""
    for i in intact:
        event = BASE_EVENTS[i]
        if isinstance(event, Push):
            if event.seq is None:
                try:
                    reference.apply(event.base_version, event.tensors, event.uid)
                except InvalidUpdate:
                    pass
        elif not isinstance(event, ANSWERED):
            return


def test_fuzzed_frames_never_corrupt_the_model_or_stop_the_server(loop_kind):
    store = ParameterStore(MODEL, momentum=0.5, tau_max=None)
    reference = ParameterStore(MODEL, momentum=0.5, tau_max=None)
    by_recipe = ParameterStore(MODEL, momentum=0.5, tau_max=None)
    with ServerThread(store, loop_kind=loop_kind) as server, mlfabric.connect(
        server.address, job=JOB, token=TOKEN
    ) as good:

        @settings(max_examples=300, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(parts=RECIPES, authenticate=st.booleans())
        # Always tried: an intact push is applied, and one altered (its req
        # 1 made 0, which parses: only its MAC tells; a bit of its MAC),
        # sent twice, out of order or after a frame that never came is
        # not, nor anything after it.
        @example(parts=[Frame(PUSH)], authenticate=True)
        @example(parts=[Frame(PUSH)], authenticate=False)
        @example(parts=[Frame(PUSH), Frame(PUSH, (("flip", 27, 0),)), Frame(PUSH)],
                 authenticate=True)
        @example(parts=[Frame(PUSH, (("flip_any", 1 << 20, 3),))], authenticate=True)
        @example(parts=[Twice(PUSH), Frame(PUSH)], authenticate=True)
        @example(parts=[Swapped(PUSH, PUSH)], authenticate=True)
        @example(parts=[Dropped(PUSH), Frame(PUSH)], authenticate=True)
        def check(parts, authenticate: bool) -> None:
            data, intact, keys = exchange(server.port, parts, authenticate)
            if authenticate:
                assert keys is not None
                replay(reference, data, keys, server.server.max_frame_size)
                replay_recipe(by_recipe, intact)
                assert by_recipe.version == reference.version
                assert_model_equal(by_recipe.weights, reference.weights)
            version, params = good.pull(timeout=10)
            assert version == reference.version
            assert_model_equal(params, reference.weights)
            assert not server.loop_errors

        check()
        assert server.metrics.protocol_errors._value.get() > 0
        version, params = good.pull(timeout=10)
        assert version == reference.version == server.metrics.updates_applied._value.get()
        assert version > 0  # intact pushes were made and applied
        assert_model_equal(params, reference.weights)
