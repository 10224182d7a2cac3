"""The sans-I/O wire protocol: one table of round-trip cases, fed whole, byte
by byte and with trailing data; and every way a frame can be malformed."""

from __future__ import annotations

import dataclasses
import json
import math
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlfabric.errors import FrameTooLarge, ProtocolError
from mlfabric.wire.protocol import (
    ALIGN,
    DTYPES,
    HEADER,
    MAGIC,
    NEED_DATA,
    PROTOCOL_VERSION,
    Auth,
    Challenge,
    Connection,
    Directive,
    Error,
    Failover,
    FellBack,
    Hello,
    Landed,
    Model,
    ModelEnd,
    Moved,
    MsgType,
    Ping,
    Pong,
    Promote,
    Pull,
    PullCancel,
    Push,
    PushResult,
    ReplicaAt,
    ReplicaDone,
    ReplicaJoin,
    Resync,
    ShardAt,
    ShardInfo,
    StateRequest,
    Status,
    StatusRequest,
    TensorSpec,
    TransferDone,
    TransferProgress,
    TransferRequest,
    Welcome,
    layout,
    spec_of,
)

F4, F8 = DTYPES["f4"], DTYPES["f8"]

CASES = [
    Hello(job="mnist", client="host-1:42", nonce=bytes(range(32))),
    Hello(job="ünïcode-job", client="", nonce=b""),
    Challenge(nonce=b"\x01" * 32, proof=b"\xff" * 32, role="controller"),
    Auth(proof=b"\x00\x01\x02"),
    Welcome(session="abc", version=0, tensors=()),
    Welcome(
        session="s",
        version=2**40,
        tensors=(TensorSpec("w", F4, (3, 4)), TensorSpec("b", F8, ()),
                 TensorSpec("e", F4, (0, 5))),
        tau_max=8,
        momentum=0.9,
    ),
    Welcome(session="c", version=3, tensors=(), tau_max=8,
            aggregators=("10.0.0.2:7401", "10.0.0.3:7401")),
    Welcome(session="d", version=4, tensors=(TensorSpec("w@0", F4, (6,)),),
            shard=ShardInfo(index=1, count=3, chunk=65536, digest="0123456789abcdef",
                            model=(TensorSpec("b", F4, (2,)), TensorSpec("w", F4, (3, 4))))),
    Pull(req=1),
    Pull(req=2**64 - 1),
    Pull(req=3, uid="c0ffee-7", wait=2.5),
    PullCancel(req=3),
    Model(req=5, version=7, tensors={}),
    Model(req=5, version=7, tensors={"w": np.arange(12, dtype=np.float32).reshape(3, 4)}),
    Model(req=6, version=9, tensors={"w": np.float32([0.5, 2])}, streamed=True),
    ModelEnd(req=6, ok=True),
    ModelEnd(req=6, ok=False),
    Push(req=9, base_version=3, tensors={"a": np.float32([1.5, -2.0, np.nan, np.inf])}),
    Push(
        req=10,
        base_version=0,
        tensors={
            "odd": np.arange(7, dtype=np.float32),  # 28 bytes: next tensor is padded
            "dbl": np.linspace(0, 1, 5),
            "scalar": np.float32(3.25).reshape(()),
            "empty": np.zeros((2, 0), np.float32),
            "big": np.random.default_rng(0).standard_normal(70_000).astype(np.float32),
        },
    ),
    Push(req=11, base_version=4, tensors={"a": np.float32([0.5])}, seq=2**40),
    Push(req=12, base_version=0, tensors={"a": np.float32([0.5])}, seq=0),
    Push(req=13, base_version=4, tensors={"a": np.float32([0.5])}, uid="c0ffee-7"),
    Push(req=14, base_version=4, tensors={"a": np.float32([0.5, 1])}, uid="c0ffee-8", group=21,
         fan_in=3, index=2, dst="10.0.0.1:7070"),
    Push(req=15, base_version=2, tensors={"a": np.float32([1.5])},
         members=(("c0ffee-8", 4, "h1:4242"), ("beef-1", 2, "h2:77"))),
    PushResult(req=3, applied=True, version=11, delay=2),
    PushResult(req=6, applied=True, version=14, delay=1, delays=(1, 3, 2)),
    PushResult(req=4, applied=False, version=11, delay=None, reason="stale: delay 9 > 8"),
    PushResult(req=7, applied=True, version=20, delay=3, fan_in=4, index=3),
    Push(req=16, base_version=4, tensors={"a": np.float32([0.5])}, seq=18, fan_in=4, index=1),
    # under a controller: its ticket, and the transfers it must not pass (issue 34)
    Push(req=18, base_version=4, tensors={"a": np.float32([0.5])}, ticket=2**40),
    Push(req=19, base_version=4, tensors={"a": np.float32([0.5])}, ticket=9, after=(3, 7),
         after_seconds=0.25),
    Push(req=20, base_version=4, tensors={"a": np.float32([0.5])}, ticket=9, seq=3),
    # compressed (issue 35): each tensor's parts, named TENSOR#PART
    Push(req=17, base_version=4, tensors={
        "w#i": np.int32([1, 7]), "w#v": np.float32([0.5, -1]),
        "b#h": np.uint16([0x3C00, 0x7BFF, 0]), "big#i": np.int64([3])},
        codecs=(("w", "topk"), ("b", "fp16"), ("big", "randk"))),
    Error(code="protocol", message="bad frame"),
    TransferRequest(req=4, host="h1", dst="10.0.0.1:7070", nbytes=2**40, base_version=3,
                    norm=0.125),
    TransferRequest(req=5, host="h1", dst="10.0.0.1:7070", nbytes=2**26, base_version=3,
                    norm=0.5, shard=3, chunk=4 << 20),
    TransferRequest(req=6, host="h1", dst="10.0.0.1:7070", nbytes=4000, base_version=3,
                    norm=0.5, options=(("fp16", 2000, 0.0005), ("topk:0.01", 80, 0.02))),
    Directive(req=4, action="go", position=2, planned_seconds=0.5),
    Directive(req=6, action="go", position=1, planned_seconds=0.01, codec="topk:0.01"),
    Directive(req=7, action="go", position=0, planned_seconds=0.04, upto=8 << 20),
    Directive(req=8, action="go", position=1, planned_seconds=0.3, pace=7_340_032.5),
    Directive(req=9, action="go", position=1, planned_seconds=0.3, pace=1e6,
              pace_seconds=0.125),
    Directive(req=10, action="go", position=1, planned_seconds=0.3, ticket=44),
    Directive(req=11, action="go", position=1, planned_seconds=0.3, ticket=45,
              after=tuple(range(64)), after_seconds=600.0),
    TransferProgress(req=7, sent=8 << 20),
    Directive(req=5, action="drop", reason="deadline_missed"),
    Directive(req=6, action="go", position=3, planned_seconds=0.25, via="10.0.0.7:7401",
              group=40, fan_in=4, index=0),
    TransferDone(req=4, applied=True, version=9, delay=2, seconds=1.5),
    TransferDone(req=5, applied=False, version=9, delay=None, seconds=0.0),
    TransferDone(req=6, applied=True, version=12, delay=0, seconds=0.5, via_failed="10.0.0.7"),
    TransferDone(req=7, applied=True, version=12, delay=0, seconds=0.5, fan_in=3),
    StatusRequest(req=3),
    ReplicaDone(dst="10.0.0.2", version=2**33),
    ShardAt(shard=3, dst="10.0.0.5", version=17),
    Landed(ticket=44, shard=0, base_version=7, version=9, applied=True, delay=2),
    Landed(ticket=2**40, shard=63, base_version=0, version=10, applied=False, delay=None),
    Moved(shard=3, owner="10.0.0.6:7071"),
    Moved(shard=0, owner=""),
    FellBack(updates=12, seconds=3.25),
    FellBack(updates=0, seconds=0.0),
    Ping(req=1),
    Ping(req=2, since=40, velocity=True),
    Pong(req=1, role="replica", version=12),
    Pong(req=2, role="server", version=44, norms_from=41, norms=(0.5, 0.0, 1e30, 2.0)),
    Pong(req=4, role="server", version=44, norms_from=41, norms=(0.5, 0.0, 0.0, 2.0),
         spans=((44, 3),)),
    Pong(req=3, role="replica", version=40, velocity=0.125, gap=1.5),
    Promote(req=2),
    Promote(req=3, server="10.0.0.3:7070"),
    Promote(req=4, force=True),
    Resync(req=5, server="10.0.0.3:7070"),
    Failover(server="10.0.0.3:7070", version=40),
    StateRequest(req=3),
    ReplicaJoin(address="10.0.0.4:7070", version=41, velocity=0.25),
    ReplicaJoin(address="10.0.0.4:7070", version=41, velocity=0.25, shard=3),
    ReplicaJoin(address="10.0.0.4:7070", version=41, shard=3, server="10.0.0.3:7070"),
    ReplicaAt(address="10.0.0.4:7070", version=41),
    Status(req=3, status={"job": "j", "workers": [{"host": "h1", "requests": 4}]}),
    Error(code="bad_shape", message="tensor 'w' has shape (2,)", req=77),
]


def assert_same(got, want):
    assert type(got) is type(want)
    if isinstance(want, Status):
        assert (got.req, dict(got.status)) == (want.req, dict(want.status))
        return
    if isinstance(want, (Model, Push)):
        fields = {k: v for k, v in vars(want).items() if k != "tensors"}
        assert {k: v for k, v in vars(got).items() if k != "tensors"} == fields
        assert list(got.tensors) == list(want.tensors)
        for name, arr in want.tensors.items():
            g = got.tensors[name]
            assert g.dtype == arr.dtype and g.shape == arr.shape
            np.testing.assert_array_equal(g, arr)
    else:
        assert got == want


def drain(conn):
    events = []
    while (ev := conn.next_event()) is not NEED_DATA:
        events.append(ev)
    return events


@pytest.mark.parametrize("event", CASES, ids=lambda e: type(e).__name__)
def test_round_trip_whole(event):
    r = Connection()
    r.receive_data(Connection().send_bytes(event))
    (got,) = drain(r)
    assert_same(got, event)


@pytest.mark.parametrize("event", CASES, ids=lambda e: type(e).__name__)
def test_round_trip_byte_by_byte(event):
    data = Connection().send_bytes(event)
    if len(data) > 20_000:
        data = data[:4000] + data[4000:]  # still fed one byte at a time below
    r = Connection()
    events = []
    for i in range(len(data)):
        r.receive_data(data[i : i + 1])
        events += drain(r)
        if i < len(data) - 1:
            assert events == [], f"event completed early at byte {i} of {len(data)}"
    assert len(events) == 1
    assert_same(events[0], event)


@pytest.mark.parametrize("event", CASES, ids=lambda e: type(e).__name__)
def test_round_trip_with_trailing_data(event):
    data = Connection().send_bytes(event)
    follow = Connection().send_bytes(Pull(req=123))
    r = Connection()
    r.receive_data(data + follow[:7])
    (got,) = drain(r)
    assert_same(got, event)
    assert r.next_event() is NEED_DATA
    r.receive_data(follow[7:])
    assert drain(r) == [Pull(req=123)]


def test_a_chunk_spanning_a_data_block_and_the_next_frame_is_split_between_them():
    """Bytes past the end of an arriving data block are the next frame's,
    even when fed in one call before the first frame is taken."""
    model = Model(req=1, version=2, tensors={"w": np.arange(4096, dtype=np.float32)})
    data = Connection().send_bytes(model)
    follow = Connection().send_bytes(Pull(req=5))
    r = Connection()
    r.receive_data(data[:1000])
    assert r.next_event() is NEED_DATA  # the data block is arriving
    r.receive_data(data[1000:] + follow)
    got, pull = drain(r)
    assert_same(got, model)
    assert pull == Pull(req=5)


def test_all_cases_in_one_stream_through_the_zero_copy_path():
    stream = b"".join(Connection().send_bytes(e) for e in CASES)
    r = Connection()
    events = feed_zero_copy(r, stream, 1000)
    assert len(events) == len(CASES)
    for got, want in zip(events, CASES, strict=True):
        assert_same(got, want)
    assert r.bytes_received == len(stream)


def test_tensor_bytes_land_in_the_allocated_buffer():
    target = np.zeros(1 << 20, np.uint8)
    calls = []

    def allocate(msg_type, nbytes):
        calls.append((msg_type, nbytes))
        return target

    w = np.arange(100_000, dtype=np.float32)
    data = Connection().send_bytes(Push(req=1, base_version=0, tensors={"w": w}))
    (ev,) = feed_zero_copy(Connection(allocate=allocate), data, len(data))
    assert calls == [(MsgType.PUSH, w.nbytes)]
    assert np.shares_memory(ev.tensors["w"], target)
    np.testing.assert_array_equal(ev.tensors["w"], w)


def test_send_does_not_copy_tensors_and_aligns_them():
    a = np.arange(7, dtype=np.float32)
    b = np.arange(3, dtype=np.float64)
    parts = Connection().send(Push(req=1, base_version=0, tensors={"a": a, "b": b}))
    assert any(np.shares_memory(np.frombuffer(p, np.uint8), a) for p in parts[1:])
    offsets, total = layout([TensorSpec("a", F4, (7,)), TensorSpec("b", F8, (3,))])
    assert offsets == [0, ALIGN] and total == ALIGN + 24


def test_non_float_tensors_are_refused_at_send():
    with pytest.raises(TypeError, match=r"int64.*astype"):
        Connection().send(Push(req=1, base_version=0, tensors={"a": np.arange(3)}))


# --- malformed input ---------------------------------------------------------


def frame(msg_type, meta, data=b"", *, magic=MAGIC, version=PROTOCOL_VERSION, flags=0,
          data_len=None, raw_meta=None):
    if raw_meta is not None:
        meta_bytes = raw_meta
    elif msg_type in (MsgType.MODEL, MsgType.PUSH) and isinstance(meta, dict):
        fields = {k: v for k, v in meta.items() if k != "tensors"}
        meta_bytes = json.dumps(fields).encode() + b"\n" + json.dumps(meta["tensors"]).encode()
    else:
        meta_bytes = json.dumps(meta).encode()
    n = len(data) if data_len is None else data_len
    return HEADER.pack(magic, version, msg_type, flags, len(meta_bytes), n) + meta_bytes + data


BAD_FRAMES = {
    "bad magic": (frame(MsgType.PULL, {"req": 1}, magic=b"HTTP"), "magic"),
    "other version": (frame(MsgType.PULL, {"req": 1}, version=9), "protocol version 9"),
    "unknown type": (frame(200, {"req": 1}), "unknown message type 200"),
    "flags set": (frame(MsgType.PULL, {"req": 1}, flags=4), "flags"),
    "meta too long": (HEADER.pack(MAGIC, PROTOCOL_VERSION, MsgType.PULL, 0, (1 << 20) + 1, 0),
                      "metadata"),
    "not json": (frame(MsgType.PULL, None, raw_meta=b"{req: 1"), "not valid JSON"),
    "not utf8": (frame(MsgType.PULL, None, raw_meta=b"\xff\xfe"), "not valid JSON"),
    "not an object": (frame(MsgType.PULL, [1, 2]), "not a JSON object"),
    "missing field": (frame(MsgType.PULL, {}), "'req'"),
    "negative int": (frame(MsgType.PULL, {"req": -1}), "'req'"),
    "bool as int": (frame(MsgType.PULL, {"req": True}), "'req'"),
    "float as int": (frame(MsgType.PULL, {"req": 1.0}), "'req'"),
    "huge int": (frame(MsgType.PULL, {"req": 2**64}), "'req'"),
    "bad hex": (frame(MsgType.AUTH, {"proof": "zz"}), "hex"),
    "negative seconds": (frame(MsgType.FELL_BACK, {"updates": 1, "seconds": -1.0}),
                         "'seconds' must be >= 0"),
    "negative updates": (frame(MsgType.FELL_BACK, {"updates": -1, "seconds": 1.0}),
                         "'updates'"),
    "status not object": (frame(MsgType.STATUS, {"req": 1, "status": [1]}), "'status'"),
    "unknown action": (frame(MsgType.DIRECTIVE, {"req": 1, "action": "jump"}), "unknown directive"),
    "norm not number": (
        frame(MsgType.TRANSFER_REQUEST, {"req": 1, "host": "h", "dst": "d", "nbytes": 1,
                                         "base_version": 0, "norm": "x"}), "'norm'"),
    "norm is bool": (
        frame(MsgType.TRANSFER_REQUEST, {"req": 1, "host": "h", "dst": "d", "nbytes": 1,
                                         "base_version": 0, "norm": True}), "'norm'"),
    "applied not bool": (
        frame(MsgType.PUSH_RESULT, {"req": 1, "applied": 1, "version": 1}), "'applied'"),
    "shard not object": (
        frame(MsgType.WELCOME, {"session": "s", "version": 0, "tensors": [], "shard": [1]}),
        "'shard' must be an object"),
    "shard index past count": (
        frame(MsgType.WELCOME, {"session": "s", "version": 0, "tensors": [],
                                "shard": {"index": 3, "count": 3, "chunk": 1, "digest": "d",
                                          "model": []}}),
        "index < count"),
    "shard count huge": (
        frame(MsgType.WELCOME, {"session": "s", "version": 0, "tensors": [],
                                "shard": {"index": 0, "count": 10**6, "chunk": 1,
                                          "digest": "d", "model": []}}),
        "count <= 4096"),
    "shard model malformed": (
        frame(MsgType.WELCOME, {"session": "s", "version": 0, "tensors": [],
                                "shard": {"index": 0, "count": 2, "chunk": 1, "digest": "d",
                                          "model": [["w", "f4"]]}}),
        "must be \\[name, dtype, shape\\]"),
    "data on pull": (frame(MsgType.PULL, {"req": 1}, b"xxxx"), "carries 4 data bytes"),
    "tensors not list": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0, "tensors": {}}), "'tensors'"),
    "no tensor list": (
        frame(MsgType.PUSH, None, raw_meta=b'{"req": 1, "base_version": 0}'), "lacks its tensor"),
    "tensor list not json": (
        frame(MsgType.PUSH, None, raw_meta=b'{"req": 1}\n[["a"'), "tensor list is not valid"),
    "push fields not json": (
        frame(MsgType.PUSH, None, raw_meta=b'{req\n[]'), "PUSH metadata is not valid JSON"),
    "tensor entry short": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0, "tensors": [["a", "f4"]]}),
        "must be \\[name, dtype, shape\\]"),
    "unknown dtype": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0, "tensors": [["a", "c8", [1]]]},
              b"\0" * 8),
        "unknown dtype code"),
    "integers in a plain push": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0, "tensors": [["a", "i8", [1]]]},
              b"\0" * 8),
        "tensor 'a' is int64: only the parts of a compressed push"),
    "integers in a model": (
        frame(MsgType.MODEL, {"req": 1, "version": 0, "tensors": [["a", "u2", [4]]]},
              b"\0" * 8),
        "unknown dtype code 'u2'"),
    "a part of no compressed tensor": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0, "codecs": [["w", "topk"]],
                             "tensors": [["w#i", "i4", [1]], ["b#i", "i4", [1]]]},
              b"\0" * 68),
        "tensor 'b#i' of a compressed push is no part"),
    "a whole tensor in a compressed push": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0, "codecs": [["w", "none"]],
                             "tensors": [["w", "f4", [1]]]}, b"\0" * 4),
        "tensor 'w' of a compressed push is no part"),
    "a compressed tensor without parts": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0,
                             "codecs": [["w", "topk"], ["b", "fp16"]],
                             "tensors": [["w#i", "i4", [1]]]}, b"\0" * 4),
        "compressed tensor 'b' has 0 parts"),
    "codecs naming a tensor twice": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0,
                             "codecs": [["w", "topk"], ["w", "fp16"]],
                             "tensors": [["w#i", "i4", [1]]]}, b"\0" * 4),
        "names a tensor twice"),
    "options malformed": (
        frame(MsgType.TRANSFER_REQUEST, {"req": 1, "host": "h", "dst": "s", "nbytes": 8,
                                         "base_version": 0, "norm": 0.0,
                                         "options": [["fp16", -4]]}),
        "field 'options' must be 1 to 8"),
    "an option's encoding seconds negative": (
        frame(MsgType.TRANSFER_REQUEST, {"req": 1, "host": "h", "dst": "s", "nbytes": 8,
                                         "base_version": 0, "norm": 0.0,
                                         "options": [["fp16", 4, -0.5]]}),
        r"encode seconds in 0..600\] lists"),
    "an option's encoding seconds not finite": (
        frame(MsgType.TRANSFER_REQUEST, {"req": 1, "host": "h", "dst": "s", "nbytes": 8,
                                         "base_version": 0, "norm": 0.0,
                                         "options": [["fp16", 4, float("nan")]]}),
        "field 'options' must be 1 to 8"),
    "an option's encoding seconds past the bound": (
        frame(MsgType.TRANSFER_REQUEST, {"req": 1, "host": "h", "dst": "s", "nbytes": 8,
                                         "base_version": 0, "norm": 0.0,
                                         "options": [["fp16", 4, 601]]}),
        "field 'options' must be 1 to 8"),
    "codecs malformed": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0, "codecs": {"w": "topk"},
                             "tensors": [["w#i", "i4", [1]]]}, b"\0" * 4),
        "field 'codecs' must be"),
    "bad shape": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0, "tensors": [["a", "f4", [-1]]]}),
        "malformed shape"),
    "empty name": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0, "tensors": [["", "f4", [1]]]},
              b"\0" * 4),
        "tensor name"),
    "duplicate name": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0,
                             "tensors": [["a", "f4", [1]], ["a", "f4", [1]]]}, b"\0" * 68),
        "listed twice"),
    "negative seq": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0, "seq": -3, "tensors": []}),
        "'seq'"),
    "member without uid": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0, "group": 1, "fan_in": 2, "index": 0,
                             "dst": "s:1", "tensors": []}), "needs a 'uid'"),
    "member index past fan-in": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0, "uid": "u", "group": 1, "fan_in": 2,
                             "index": 2, "dst": "s:1", "tensors": []}), "0 <= index < fan_in"),
    "member without dst": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0, "uid": "u", "group": 1, "fan_in": 2,
                             "index": 0, "tensors": []}), "'dst'"),
    "fan-in too large": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0, "uid": "u", "group": 1, "fan_in": 65,
                             "index": 0, "dst": "s:1", "tensors": []}), "fan_in <= 64"),
    "members not triples": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0, "members": [["u", 1]],
                             "tensors": []}), "'members'"),
    "member base negative": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0, "members": [["u", -1, "h"]],
                             "tensors": []}), "'members'"),
    "members empty": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0, "members": [], "tensors": []}),
        "'members'"),
    "delays not ints": (
        frame(MsgType.PUSH_RESULT, {"req": 1, "applied": True, "version": 1, "delays": [1.5]}),
        "'delays'"),
    "via without group": (
        frame(MsgType.DIRECTIVE, {"req": 1, "action": "go", "via": "a:1", "fan_in": 2,
                                  "index": 0}), "needs 'group'"),
    "replica done no dst": (frame(MsgType.REPLICA_DONE, {"version": 2}), "'dst'"),
    "aggregators not a list": (
        frame(MsgType.WELCOME, {"session": "s", "version": 0, "tensors": [],
                                "aggregators": "a:1"}),
        r"'aggregators' must be a list of at most 4096 addresses"),
    "aggregator not a string": (
        frame(MsgType.WELCOME, {"session": "s", "version": 0, "tensors": [],
                                "aggregators": ["a:1", 7]}), "'aggregators'"),
    "pull for an update without wait": (
        frame(MsgType.PULL, {"req": 1, "uid": "u"}), "needs both 'uid' and 'wait'"),
    "pull wait without an update": (
        frame(MsgType.PULL, {"req": 1, "wait": 1.0}), "needs both 'uid' and 'wait'"),
    "pull wait too long": (
        frame(MsgType.PULL, {"req": 1, "uid": "u", "wait": 601.0}), r"wait <= 600.0 s"),
    "pull wait zero": (
        frame(MsgType.PULL, {"req": 1, "uid": "u", "wait": 0}), r"0 < wait"),
    "pull uid too long": (
        frame(MsgType.PULL, {"req": 1, "uid": "u" * 129, "wait": 1.0}), "longer than 128"),
    "streamed not a bool": (
        frame(MsgType.MODEL, {"req": 1, "version": 0, "streamed": 1, "tensors": []}),
        "'streamed' must be true or false"),
    "model end without ok": (frame(MsgType.MODEL_END, {"req": 1}), "'ok' must be true or false"),
    "pull cancel without req": (frame(MsgType.PULL_CANCEL, {}), "'req'"),
    "norms without norms_from": (
        frame(MsgType.PONG, {"req": 1, "role": "server", "version": 3, "norms": [1.0]}),
        "come together"),
    "norm negative": (
        frame(MsgType.PONG, {"req": 1, "role": "server", "version": 3, "norms_from": 3,
                             "norms": [-1.0]}), "'norms'"),
    "norms too many": (
        frame(MsgType.PONG, {"req": 1, "role": "server", "version": 3, "norms_from": 3,
                             "norms": [1.0] * 4097}), "at most 4096"),
    "norm not a number": (
        frame(MsgType.PONG, {"req": 1, "role": "server", "version": 3, "norms_from": 3,
                             "norms": ["x"]}), "'norms'"),
    "span outside the norms": (
        frame(MsgType.PONG, {"req": 1, "role": "server", "version": 3, "norms_from": 3,
                             "norms": [1.0], "spans": [[5, 2]]}), "'spans'"),
    "span of one": (
        frame(MsgType.PONG, {"req": 1, "role": "server", "version": 3, "norms_from": 3,
                             "norms": [1.0], "spans": [[3, 1]]}), "'spans'"),
    "spans without norms": (
        frame(MsgType.PONG, {"req": 1, "role": "server", "version": 3, "spans": [[3, 2]]}),
        "'spans'"),
    "member index without fan_in": (
        frame(MsgType.PUSH_RESULT, {"req": 1, "applied": True, "version": 3, "delay": 0,
                                    "index": 0}), "come together"),
    "member index past fan_in": (
        frame(MsgType.PUSH_RESULT, {"req": 1, "applied": True, "version": 3, "delay": 0,
                                    "fan_in": 2, "index": 2}), "0 <= index < fan_in"),
    "fan_in too large": (
        frame(MsgType.TRANSFER_DONE, {"req": 1, "applied": True, "version": 3, "delay": 0,
                                      "seconds": 0.1, "fan_in": 65}), "'fan_in'"),
    "replica member without index": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0, "seq": 4, "fan_in": 2,
                             "tensors": [["a", "f4", [1]]]}, b"\0" * 4), "0 <= index < fan_in"),
    "landed without its ticket": (
        frame(MsgType.LANDED, {"shard": 0, "base_version": 0, "version": 3,
                               "applied": True}), "'ticket'"),
    "landed without its base version": (
        frame(MsgType.LANDED, {"ticket": 1, "version": 3, "applied": True}),
        "'base_version'"),
    "landed applied not a bool": (
        frame(MsgType.LANDED, {"ticket": 1, "base_version": 0, "version": 3, "applied": 1}),
        "'applied'"),
    "landed shard too large": (
        frame(MsgType.LANDED, {"ticket": 1, "shard": 1 << 20, "base_version": 0,
                               "version": 3, "applied": True}), "'shard' must be below"),
    "landed delay negative": (
        frame(MsgType.LANDED, {"ticket": 1, "base_version": 0, "version": 3,
                               "applied": True, "delay": -1}), "'delay'"),
    "gap negative": (
        frame(MsgType.PONG, {"req": 1, "role": "replica", "version": 3, "gap": -1}), "gap"),
    "force not a bool": (frame(MsgType.PROMOTE, {"req": 1, "force": 1}), "'force'"),
    "resync without server": (frame(MsgType.RESYNC, {"req": 1}), "'server'"),
    "progress negative": (frame(MsgType.TRANSFER_PROGRESS, {"req": 1, "sent": -4}), "'sent'"),
    "joining shard past the bound": (
        frame(MsgType.REPLICA_JOIN, {"address": "h:1", "version": 0, "shard": 10**9}),
        "'shard' must be below"),
    "shard past the bound": (frame(MsgType.SHARD_AT, {"shard": 10**9, "dst": "h", "version": 0}),
                             "'shard' must be below"),
    "shard host too long": (frame(MsgType.SHARD_AT, {"shard": 1, "dst": "h" * 257, "version": 0}),
                            "'dst'"),
    "moved owner too long": (frame(MsgType.MOVED, {"shard": 1, "owner": "h" * 257}), "'owner'"),
    "moved shard past the bound": (frame(MsgType.MOVED, {"shard": 10**9, "owner": "h"}),
                                   "'shard'"),
    "shard version missing": (frame(MsgType.SHARD_AT, {"shard": 1, "dst": "h"}), "'version'"),
    "chunk not an int": (
        frame(MsgType.TRANSFER_REQUEST, {"req": 1, "host": "h", "dst": "s", "nbytes": 9,
                                         "base_version": 0, "norm": 0.0, "chunk": "4M"}),
        "'chunk'"),
    "upto negative": (frame(MsgType.DIRECTIVE, {"req": 1, "action": "go", "upto": -1}),
                      "'upto'"),
    "pace zero": (frame(MsgType.DIRECTIVE, {"req": 1, "action": "go", "pace": 0}),
                  r"field 'pace' must be 1 to 1e\+12 bytes/s, got 0"),
    "pace past the bound": (frame(MsgType.DIRECTIVE, {"req": 1, "action": "go", "pace": 2e12}),
                            "field 'pace' must be 1 to"),
    "pace not a number": (frame(MsgType.DIRECTIVE, {"req": 1, "action": "go", "pace": "fast"}),
                          "field 'pace' must be a finite number"),
    "pace seconds zero": (
        frame(MsgType.DIRECTIVE, {"req": 1, "action": "go", "pace": 1e6, "pace_seconds": 0}),
        "field 'pace_seconds' must be above 0 and at most 86400, got 0"),
    "pace seconds past a day": (
        frame(MsgType.DIRECTIVE, {"req": 1, "action": "go", "pace": 1e6,
                                  "pace_seconds": 1e6}), "'pace_seconds'"),
    "after without its seconds": (
        frame(MsgType.DIRECTIVE, {"req": 1, "action": "go", "ticket": 2, "after": [1]}),
        "fields 'after' and 'after_seconds' come together, with a 'ticket': got "
        r"\(1,\), None and 2"),
    "after without a ticket": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0, "tensors": [], "after": [1],
                             "after_seconds": 1.0}), "with a 'ticket'"),
    "after empty": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0, "tensors": [], "ticket": 2,
                             "after": [], "after_seconds": 1.0}),
        r"field 'after' must be 1 to 64 transfer ids \(non-negative integers\), got \[\]"),
    "after too many": (
        frame(MsgType.DIRECTIVE, {"req": 1, "action": "go", "ticket": 2,
                                  "after": list(range(65)), "after_seconds": 1.0}),
        "field 'after' must be 1 to 64"),
    "after negative": (
        frame(MsgType.DIRECTIVE, {"req": 1, "action": "go", "ticket": 2, "after": [-1],
                                  "after_seconds": 1.0}), "field 'after' must be"),
    "after not a list": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0, "tensors": [], "ticket": 2,
                             "after": 3, "after_seconds": 1.0}), "field 'after' must be"),
    "after seconds zero": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0, "tensors": [], "ticket": 2,
                             "after": [1], "after_seconds": 0}),
        "field 'after_seconds' must be above 0 and at most 600, got 0"),
    "after seconds past the bound": (
        frame(MsgType.DIRECTIVE, {"req": 1, "action": "go", "ticket": 2, "after": [1],
                                  "after_seconds": 601}), "'after_seconds'"),
    "ticket negative": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0, "tensors": [], "ticket": -2}),
        "field 'ticket' must be a non-negative integer"),
    "length mismatch": (
        frame(MsgType.PUSH, {"req": 1, "base_version": 0, "tensors": [["a", "f4", [4]]]},
              b"\0" * 12),
        "tensors of 16 bytes but carries 12"),
}


@pytest.mark.parametrize("name", list(BAD_FRAMES))
def test_malformed_frames_are_protocol_errors(name):
    data, message = BAD_FRAMES[name]
    r = Connection()
    r.receive_data(data)
    with pytest.raises(ProtocolError, match=message):
        r.next_event()
    # The stream cannot be trusted after that: the connection stays broken.
    with pytest.raises(ProtocolError, match="broken"):
        r.next_event()
    with pytest.raises(ProtocolError, match="broken"):
        r.get_buffer(-1)


def test_frame_too_large_is_refused_before_any_allocation():
    allocations = []
    r = Connection(max_frame_size=1000, allocate=lambda t, n: allocations.append(n))
    r.receive_data(HEADER.pack(MAGIC, PROTOCOL_VERSION, MsgType.PUSH, 0, 10, 2000))
    with pytest.raises(FrameTooLarge, match="exceeds the maximum frame size of 1000"):
        r.next_event()
    assert allocations == []


def test_huge_declared_length_is_refused_with_default_limit():
    r = Connection()
    r.receive_data(HEADER.pack(MAGIC, PROTOCOL_VERSION, MsgType.PUSH, 0, 2, 2**63))
    with pytest.raises(FrameTooLarge):
        r.next_event()


def feed_zero_copy(conn, data, chunk):
    """Feed `data` the way a BufferedProtocol transport does; return the events."""
    events = []
    pos = 0
    while pos < len(data):
        buf = conn.get_buffer(-1)
        n = min(len(buf), chunk, len(data) - pos)
        buf[:n] = data[pos : pos + n]
        del buf
        conn.buffer_updated(n)
        pos += n
        events += drain(conn)
    return events


def test_metadata_larger_than_scratch_buffer():
    names = {f"t{i:05d}": np.float32([i]) for i in range(4000)}  # ~80 KiB of metadata
    ev = Push(req=1, base_version=0, tensors=names)
    data = Connection().send_bytes(ev)
    assert struct.unpack_from("<I", data, 8)[0] > 1 << 16
    for chunk in (len(data), 5000):
        (got,) = feed_zero_copy(Connection(), data, chunk)
        assert_same(got, ev)


def test_error_event_round_trip_keeps_optional_request():
    for ev in (Error("auth", "no"), Error("stale", "late", req=0)):
        r = Connection()
        r.receive_data(Connection().send_bytes(ev))
        assert drain(r) == [ev]


def test_unknown_event_type_cannot_be_sent():
    with pytest.raises(TypeError, match="not an mlfabric event"):
        Connection().send(object())  # type: ignore[arg-type]


# --- the codec table and the head of a frame still arriving -----------------------


def test_the_codec_table_has_one_row_per_message_type_and_event():
    from mlfabric.wire.protocol import CODECS

    assert sorted(c.msg_type for c in CODECS) == sorted(MsgType)
    assert len({c.event for c in CODECS}) == len(CODECS)
    # The direct formatting, where a codec has one, says the same as JSON.
    for event in (Push(req=3, base_version=7, tensors={}),
                  Push(req=3, base_version=7, tensors={}, seq=9),
                  PushResult(req=3, applied=True, version=8, delay=1),
                  PushResult(req=3, applied=False, version=8, delay=None),
                  Pull(req=4), Model(req=5, version=6, tensors={})):
        codec = next(c for c in CODECS if c.event is type(event))
        assert codec.fast is not None
        assert json.loads(codec.fast(event)) == codec.encode(event)


@given(req=st.integers(0, 2**53), position=st.integers(0, 2**31),
       planned=st.floats(0, 1e6, allow_nan=False), ticket=st.integers(0, 2**53),
       after=st.none() | st.lists(st.integers(0, 2**53), min_size=1, max_size=8).map(tuple),
       after_seconds=st.floats(0, 1e3, allow_nan=False))
def test_a_plain_go_is_formatted_directly_byte_for_byte_as_json(req, position, planned, ticket,
                                                                after, after_seconds):
    """The controller's commonest directive, a go straight to the server
    (with or without the transfers it must follow), is written without the
    generic JSON encoder, and its bytes are the generic encoder's exactly."""
    from mlfabric.wire.protocol import CODECS

    codec = next(c for c in CODECS if c.event is Directive)
    go = Directive(req=req, action="go", position=position, planned_seconds=planned,
                   ticket=ticket, after=after,
                   after_seconds=None if after is None else after_seconds)
    generic = json.dumps(codec.encode(go), separators=(",", ":")).encode()
    assert codec.fast(go) == generic
    # anything else takes the generic way
    for other in (dataclasses.replace(go, action="drop", reason="late: x"),
                  dataclasses.replace(go, via="10.0.0.2:7072", group=1, fan_in=2, index=0),
                  dataclasses.replace(go, upto=4096), dataclasses.replace(go, codec="fp16"),
                  dataclasses.replace(go, pace=1e6),
                  dataclasses.replace(go, planned_seconds=math.inf),
                  dataclasses.replace(go, after=after or (1,), after_seconds=None)):
        assert codec.fast(other) is None


def test_a_frame_arriving_shows_its_checked_head_and_wrong_fields_are_refused_early():
    w = np.arange(50_000, dtype=np.float32)
    data = Connection().send_bytes(Push(req=2, base_version=4, tensors={"w": w}, seq=11))
    conn = Connection()
    conn.receive_data(data[: len(data) - w.nbytes + 1000])  # fields and 1000 data bytes
    assert conn.next_event() is NEED_DATA
    partial = conn.receiving()
    assert partial is not None and partial.received == 1000
    head = partial.head
    assert (type(head), head.req, head.base_version, head.seq, head.tensors) == (
        Push, 2, 4, 11, {})
    # A push whose fields are wrong is refused when they arrive, before its
    # data: nothing outside the codec reads them unchecked.
    bad = bytearray(Connection().send_bytes(Push(req=2, base_version=4, tensors={"w": w})))
    meta_len = struct.unpack_from("<I", bad, 8)[0]
    meta = bytes(bad[HEADER.size:HEADER.size + meta_len])
    swapped = meta.replace(b'"base_version":4', b'"base_version":-1')
    assert len(swapped) == len(meta) + 1
    forged = (HEADER.pack(MAGIC, PROTOCOL_VERSION, MsgType.PUSH, 0, len(swapped), w.nbytes)
              + swapped)
    conn = Connection()
    conn.receive_data(forged)  # no data at all yet
    with pytest.raises(ProtocolError, match="base_version"):
        conn.next_event()


# --- streamed data blocks (wire.streamed) ------------------------------------------


def feed_whole(conn, data):
    conn.receive_data(data)
    return drain(conn)


def _streamed_model():
    rng = np.random.default_rng(3)
    # Odd sizes: padding between the tensors (they start at multiples of ALIGN).
    return {"a": rng.standard_normal(37).astype(np.float32),
            "b": rng.standard_normal((5, 7)).astype(np.float32),
            "c": rng.standard_normal(3).astype(np.float32)}


@pytest.mark.parametrize("chunks", [[1], [7, 64, 100], [10_000]])
def test_a_streamed_frame_is_byte_for_byte_the_whole_frame(chunks):
    from mlfabric.wire.streamed import StreamedBlock

    tensors = _streamed_model()
    event = Model(req=9, version=4, tensors=tensors, streamed=True)
    whole = Connection().send_bytes(event)
    head = Connection().send_head(event)
    block = StreamedBlock([spec_of(n, a) for n, a in tensors.items()])
    out = [head]
    k = 0
    while not block.done:
        upto = min(block.total, block.sent + chunks[k % len(chunks)])
        out.append(bytes(block.from_arrays(tensors, upto)))
        k += 1
    assert b"".join(out) == whole
    assert block.replay(tensors) == bytearray(whole[len(head):])
    # And as a contiguous block, without copies.
    block = StreamedBlock(block.specs)
    data = memoryview(whole[len(head):])
    pieces = [block.from_block(data, 50), block.from_block(data, block.total)]
    assert head + b"".join(bytes(p) for p in pieces) == whole
    got = feed_whole(Connection(), whole)
    np.testing.assert_array_equal(got[0].tensors["b"], tensors["b"])


def test_a_void_stream_ends_whole_with_zeros_and_never_goes_back():
    from mlfabric.wire.streamed import StreamedBlock

    tensors = _streamed_model()
    event = Model(req=9, version=4, tensors=tensors, streamed=True)
    head = Connection().send_head(event)
    block = StreamedBlock([spec_of(n, a) for n, a in tensors.items()])
    first = bytes(block.from_arrays(tensors, 100))
    rest = block.void()
    assert block.done and len(first) + len(rest) == block.total and set(rest) <= {0}
    (ev,) = feed_whole(Connection(), head + first + rest)
    np.testing.assert_array_equal(ev.tensors["a"][:25], tensors["a"][:25])  # 100 bytes
    assert not ev.tensors["b"].any() and not ev.tensors["c"].any()
    with pytest.raises(ValueError, match="goes forward within its"):
        block.from_arrays(tensors, block.total + 1)
    again = StreamedBlock(block.specs)
    again.from_arrays(tensors, 64)
    with pytest.raises(ValueError, match="64 sent, asked up to 10"):
        again.from_arrays(tensors, 10)


def test_an_update_of_many_small_tensors_goes_out_laid_out_in_one_buffer():
    """The client gathers many small tensors into one data block; the frame
    is byte for byte the one of the tensors sent one by one."""
    from mlfabric.client.core import check_update, laid_out
    from mlfabric.wire.protocol import FrameTensors

    specs = tuple(TensorSpec(f"t{i:02d}", F4, (3 + i % 4,)) for i in range(40))
    block = layout(specs)
    rng = np.random.default_rng(0)
    update = check_update({s.name: rng.standard_normal(s.shape).astype(np.float32)
                           for s in specs}, specs)
    gathered = laid_out(update, specs, block)
    assert isinstance(gathered, FrameTensors)
    parts = Connection().send(Push(req=3, base_version=2, tensors=gathered))
    assert len(parts) == 2
    assert b"".join(parts) == Connection().send_bytes(Push(req=3, base_version=2,
                                                           tensors=update))
    # Few tensors, large ones, or another order: sent as they are.
    assert not isinstance(laid_out(dict(list(update.items())[:10]), specs[:10],
                                   layout(specs[:10])), FrameTensors)
    reordered = dict(reversed(list(update.items())))
    assert laid_out(reordered, specs, block) is reordered
    big = tuple(TensorSpec(f"b{i:02d}", F4, (1 << 15,)) for i in range(20))
    big_update = {s.name: np.zeros(s.shape, np.float32) for s in big}
    assert laid_out(big_update, big, layout(big)) is big_update


@pytest.mark.parametrize("columns", [3, 1200])  # 20 tensors of < 64 KiB in all, or more
def test_an_update_is_checked_and_laid_out_in_one_pass_or_checked_the_slow_way(columns):
    """laid_out_update: for a good update, the same frame as check_update +
    laid_out (gathered into a copy when small, else the arrays themselves);
    None for anything else, so that check_update names the mistake."""
    from mlfabric.client.core import GATHER_MAX_BYTES, check_update, laid_out, laid_out_update
    from mlfabric.errors import InvalidUpdate
    from mlfabric.wire.protocol import BlockPlan, FrameTensors, LaidOutTensors

    specs = tuple(TensorSpec(f"t{i:02d}", F4, (2, columns + i % 4)) for i in range(20))
    block = layout(specs)
    plan = BlockPlan.whole(specs)
    rng = np.random.default_rng(1)
    update = {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in specs}
    fast = laid_out_update(update, specs, block, plan)
    slow = laid_out(check_update(update, specs), specs, block)
    assert isinstance(slow, FrameTensors)
    if block[1] <= GATHER_MAX_BYTES:
        assert isinstance(fast, FrameTensors) and bytes(fast.data) == bytes(slow.data)
    else:
        # Not copied: the arrays themselves, and by name the same tensors.
        assert isinstance(fast, LaidOutTensors)
        assert all(a is update[s.name] for a, s in zip(fast.arrays, specs, strict=True))
        assert list(fast) == [s.name for s in specs] and len(fast) == 20
        for name, a in update.items():
            assert np.array_equal(fast[name], a) and fast[name].shape == a.shape
    assert Connection().send_bytes(Push(1, 2, fast)) == Connection().send_bytes(Push(1, 2, slow))
    bad_dtype = dict(update, t03=update["t03"].astype(np.float64))
    swapped = dict(update, t02=update["t02"].astype(">f4"))
    wrong_shape = dict(update, t04=np.zeros((3, 2), np.float32))
    strided = dict(update, t05=np.zeros((2, 20), np.float32)[:, ::4][:, :4].copy(order="F"))
    missing = {k: v for k, v in update.items() if k != "t06"}
    reordered = dict(reversed(list(update.items())))
    for bad in (bad_dtype, swapped, wrong_shape, missing, reordered, strided):
        assert laid_out_update(bad, specs, block, plan) is None
    with pytest.raises(InvalidUpdate, match="tensor 't03' is float64"):
        check_update(bad_dtype, specs)
    with pytest.raises(InvalidUpdate, match=r"tensor 't04' has shape \(3, 2\)"):
        check_update(wrong_shape, specs)
    with pytest.raises(InvalidUpdate, match="update lacks tensor 't06'"):
        check_update(missing, specs)
    # A torch tensor or any other mapping: the slow way too.
    assert laid_out_update(list(update.items()), specs, block, plan) is None


@pytest.mark.parametrize("chunk", [1, 7, 100, 1 << 20])
@pytest.mark.parametrize("zero_copy", [True, False])
def test_a_model_is_received_straight_into_a_scatters_runs_whatever_the_chunks(chunk, zero_copy):
    """A MODEL frame that lists the scatter's tensors lands in its runs (the
    padding in a spare buffer), bit for bit; the event carries the scatter's
    own tensors. Other frames around it are untouched by it."""
    from mlfabric.wire.protocol import Scatter, TensorSpec, layout

    rng = np.random.default_rng(2)
    tensors = {"a": rng.standard_normal(5).astype(np.float32),  # 20 B, then 44 B padding
               "b": rng.standard_normal((3, 7)).astype(np.float32),
               "c": np.arange(3, dtype=np.float64)}
    specs = tuple(TensorSpec(n, DTYPES["f4" if a.dtype == np.float32 else "f8"], a.shape)
                  for n, a in tensors.items())
    offsets, total = layout(specs)
    # The receiver's memory: the tensors in reverse order, each in its own array.
    dest = {n: np.full(a.shape, -1, a.dtype) for n, a in tensors.items()}
    spare = bytearray(ALIGN)
    runs = []
    for spec, off, nxt in zip(specs, offsets, [*offsets[1:], total], strict=True):
        runs.append(memoryview(dest[spec.name]).cast("B"))
        if nxt > off + spec.nbytes:
            runs.append(memoryview(spare)[:nxt - off - spec.nbytes])
    mine = {"dest": dest}
    scatter = Scatter(specs, runs, mine)
    asked = []

    def scatter_for(head):
        asked.append(head.req)
        return scatter if head.req == 5 else None

    other = {"a": np.float32([1, 2])}  # another tensor list: a buffer of its own
    stream = b"".join(Connection().send_bytes(e) for e in (
        Model(req=5, version=3, tensors=tensors), Model(req=5, version=4, tensors=other),
        Push(req=5, base_version=0, tensors=tensors), Model(req=6, version=1, tensors=tensors)))
    r = Connection()
    r.scatter_for = scatter_for
    if zero_copy:
        events = feed_zero_copy(r, stream, chunk)
    else:
        events = []
        for i in range(0, len(stream), chunk):
            r.receive_data(stream[i:i + chunk])
            events += drain(r)
    assert asked == [5, 5, 6]  # only MODEL frames ask
    assert events[0].tensors is mine and events[0].version == 3
    for n, a in tensors.items():
        assert dest[n].tobytes() == a.tobytes()
    np.testing.assert_array_equal(events[1].tensors["a"], other["a"])
    for ev in events[2:]:
        for n, a in tensors.items():
            np.testing.assert_array_equal(ev.tensors[n], a)
            assert not np.shares_memory(ev.tensors[n], dest[n])


def test_a_scatter_must_cover_its_block_with_writable_bytes():
    from mlfabric.wire.protocol import Scatter, TensorSpec

    specs = (TensorSpec("w", DTYPES["f4"], (4,)),)
    with pytest.raises(ValueError, match="runs hold 12 bytes; the block of its tensors is 16"):
        Scatter(specs, [memoryview(bytearray(12))], {})
    with pytest.raises(ValueError, match="writable contiguous byte views"):
        Scatter(specs, [memoryview(bytes(16))], {})
    with pytest.raises(ValueError, match="writable contiguous byte views"):
        Scatter(specs, [memoryview(np.zeros(4, np.float32))], {})
    assert Scatter(specs, [memoryview(bytearray(10)), memoryview(bytearray(0)),
                           memoryview(bytearray(6))], {}).runs[1].nbytes == 6


def test_an_option_without_encoding_seconds_is_read_as_costing_none():
    """A worker of before the seconds (issue 35) offers [codec, bytes]."""
    r = Connection()
    r.receive_data(frame(MsgType.TRANSFER_REQUEST,
                         {"req": 1, "host": "h", "dst": "s", "nbytes": 8, "base_version": 0,
                          "norm": 0.0, "options": [["fp16", 4], ["topk:0.1", 2, 3]]}))
    event = r.next_event()
    assert isinstance(event, TransferRequest)
    assert event.options == (("fp16", 4, 0.0), ("topk:0.1", 2, 3.0))
