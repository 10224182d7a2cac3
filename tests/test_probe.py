"""The agent wire protocol (mlfabric.wire.agent_protocol): one table of round trips, fed whole,
byte by byte and with trailing data, plain and protected (MACs); malformed, truncated,
altered, reordered and replayed input; datagrams."""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.errors import FrameTooLarge, IntegrityError, ProtocolError
from mlfabric.wire import agent_protocol as probe
from mlfabric.wire import auth
from mlfabric.wire.frame_mac import MAC_SIZE

EVENTS = [
    probe.Hello("h0", 2**64 - 1),
    probe.Hello("hôte-ünïcode", 0),
    probe.HelloAck("h1"),
    probe.TrainReport(7, 1, 3, 1.5e6, False, ((0, 10), (2, 2**63))),
    probe.TrainReport(7, 2**32 - 1, 65535, math.inf, True, (), senders=65535),
    probe.TrainReport(7, 3, 8, 2e6, False, ((0, 1),), senders=2, rx_carried_bps=95e6),
    probe.Ping(1, 123456789),
    probe.Pong(2**64 - 1, 0),
    probe.TransferReport("h2", 10**12, 0.25),
    probe.GetEstimates(42),
    probe.Estimates(
        3,
        "h0",
        (
            probe.PeerEstimate("h1", 97e6, 98e6, 1e6, 2e-4, 0.3, False, True, 12),
            probe.PeerEstimate("h2", 0.0, 0.0, 0.0, 0.0, -1.0, True, False, 0),
        ),
    ),
    probe.Estimates(4, "h0", ()),
    probe.SetPeers(5, (probe.PeerAddress("h1", "198.18.0.2", 7400),)),
    probe.SetPeers(6, ()),
    probe.Ack(5),
    probe.Error(6, "peer 'x' needs a port"),
]


def _drain(conn: probe.Connection) -> list:
    out = []
    while True:
        ev = conn.next_event()
        if ev is probe.NEED_DATA:
            return out
        out.append(ev)


def _eq(a, b) -> bool:
    """Dataclass equality that treats NaN == NaN."""
    return repr(a) == repr(b)


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_round_trip_whole(event) -> None:
    data = probe.Connection().send(event)
    rx = probe.Connection()
    rx.receive_data(data)
    assert _drain(rx) == [event]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_round_trip_byte_by_byte(event) -> None:
    data = probe.Connection().send(event)
    rx = probe.Connection()
    got = []
    for i in range(len(data)):
        rx.receive_data(data[i : i + 1])
        got += _drain(rx)
        if i < len(data) - 1:
            assert got == []
    assert got == [event]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_round_trip_with_trailing_data(event) -> None:
    tx = probe.Connection()
    nxt = tx.send(probe.Ping(9, 9))
    rx = probe.Connection()
    rx.receive_data(tx.send(event) + nxt[:5])
    assert _drain(rx) == [event]
    rx.receive_data(nxt[5:])
    assert _drain(rx) == [probe.Ping(9, 9)]


def test_all_events_in_one_chunk_then_clean_close() -> None:
    tx = probe.Connection()
    rx = probe.Connection()
    rx.receive_data(b"".join(tx.send(e) for e in EVENTS))
    assert _drain(rx) == EVENTS
    rx.receive_data(b"")
    assert isinstance(rx.next_event(), probe.ConnectionClosed)


def test_nan_survives_round_trip() -> None:
    e = probe.PeerEstimate("h1", math.nan, math.nan, 0.0, math.nan, -1.0, True, False, 0)
    ev = probe.Estimates(1, "h0", (e,))
    rx = probe.Connection()
    rx.receive_data(probe.Connection().send(ev))
    assert _eq(rx.next_event(), ev)


def _frame(msg_type: int, payload: bytes, magic: bytes = b"MA",
           version: int = probe.VERSION, flags: int = 0) -> bytes:
    return probe.HEADER.pack(magic, version, msg_type, flags, len(payload)) + payload


BAD_FRAMES = {
    "bad magic": _frame(probe.MsgType.PING, b"\0" * 16, magic=b"XX"),
    "bad version": _frame(probe.MsgType.PING, b"\0" * 16, version=99),
    "unknown type": _frame(200, b""),
    "flags on a plain connection": _frame(probe.MsgType.PING, b"\0" * 16,
                                          flags=probe.FLAG_MAC),
    "short payload": _frame(probe.MsgType.PING, b"\0" * 15),
    "long payload": _frame(probe.MsgType.PING, b"\0" * 17),
    "string past end": _frame(probe.MsgType.HELLO_ACK, struct.pack(">H", 50) + b"ab"),
    "not utf-8": _frame(probe.MsgType.HELLO_ACK, struct.pack(">H", 2) + b"\xff\xfe"),
    "more arrivals than packets": _frame(
        probe.MsgType.TRAIN_REPORT, struct.pack(">QIHdBI", 1, 1, 1, 0.0, 0, 2) + b"\0" * 20
    ),
    "negative duration": _frame(
        probe.MsgType.TRANSFER_REPORT, struct.pack(">H", 1) + b"x" + struct.pack(">Qd", 1, -1.0)
    ),
    "infinite duration": _frame(
        probe.MsgType.TRANSFER_REPORT,
        struct.pack(">H", 1) + b"x" + struct.pack(">Qd", 1, math.inf),
    ),
}


@pytest.mark.parametrize("data", BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
def test_malformed_frame_raises_and_stays_broken(data: bytes) -> None:
    rx = probe.Connection()
    rx.receive_data(data)
    with pytest.raises(ProtocolError):
        rx.next_event()
    with pytest.raises(ProtocolError):  # the connection cannot continue
        rx.next_event()


def test_oversized_frame_is_refused_from_its_header() -> None:
    rx = probe.Connection(max_frame=100)
    rx.receive_data(probe.HEADER.pack(b"MA", probe.VERSION, probe.MsgType.PING, 0, 101))
    with pytest.raises(FrameTooLarge, match="101 bytes exceeds the maximum 100"):
        rx.next_event()


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_truncated_frame_at_eof(event) -> None:
    data = probe.Connection().send(event)
    for cut in (1, probe.HEADER.size - 1, probe.HEADER.size, len(data) - 1):
        if cut >= len(data):
            continue
        rx = probe.Connection()
        rx.receive_data(data[:cut])
        assert rx.next_event() is probe.NEED_DATA
        rx.receive_data(b"")
        with pytest.raises(ProtocolError, match="closed inside a frame"):
            rx.next_event()


def test_data_after_eof_is_an_error() -> None:
    rx = probe.Connection()
    rx.receive_data(b"")
    with pytest.raises(ProtocolError):
        rx.receive_data(b"x")


def test_send_refuses_what_cannot_be_encoded() -> None:
    tx = probe.Connection()
    with pytest.raises(ProtocolError, match="longer than"):
        tx.send(probe.HelloAck("x" * 2000))
    with pytest.raises(ProtocolError):
        tx.send(probe.TransferReport("h1", 1, math.nan))
    with pytest.raises(ProtocolError):
        tx.send(probe.Ping(-1, 0))
    with pytest.raises(TypeError):
        tx.send("not an event")  # type: ignore[arg-type]


@given(st.binary(max_size=300), st.integers(min_value=1, max_value=64))
@settings(max_examples=300, deadline=None)
def test_random_bytes_raise_only_protocol_errors(data: bytes, chunk: int) -> None:
    rx = probe.Connection()
    try:
        for i in range(0, len(data), chunk):
            rx.receive_data(data[i : i + chunk])
            _drain(rx)
        rx.receive_data(b"")
        rx.next_event()
    except ProtocolError:
        pass


@given(st.sampled_from(EVENTS), st.integers(min_value=0, max_value=200), st.binary(max_size=8))
@settings(max_examples=300, deadline=None)
def test_corrupted_frames_raise_only_protocol_errors(event, pos: int, junk: bytes) -> None:
    data = bytearray(probe.Connection().send(event))
    data[pos % len(data) : pos % len(data) + len(junk)] = junk
    rx = probe.Connection()
    try:
        rx.receive_data(bytes(data))
        _drain(rx)
    except ProtocolError:
        pass


# --- protected connections (frames carry MACs after the login) -------------------


def _pair() -> tuple[probe.Connection, probe.Connection]:
    a, b = probe.Connection(), probe.Connection()
    k1, k2 = auth.new_nonce(), auth.new_nonce()
    a.protect(k1, k2)
    b.protect(k2, k1)
    return a, b


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_protected_round_trip_byte_by_byte(event) -> None:
    a, b = _pair()
    plain = probe.Connection().send(event)
    data = a.send(event) + a.send(probe.Ping(9, 9))
    assert probe.HEADER.unpack_from(data)[3] == probe.FLAG_MAC
    assert data[len(plain) + MAC_SIZE:][:2] == probe.MAGIC  # the MAC, then the next frame
    got = []
    for i in range(len(data)):
        b.receive_data(data[i : i + 1])
        got += _drain(b)
    assert got == [event, probe.Ping(9, 9)]


SET_PEERS = probe.SetPeers(1, (probe.PeerAddress("h1", "10.0.0.2", 7400),))


def _tampered(what: str) -> tuple[bytes, probe.Connection, list]:
    """A stream from a to b spoiled by a man in the middle; b; and the
    events b must take from it before it fails (none of the spoiled one)."""
    a, b = _pair()
    first, second = a.send(SET_PEERS), a.send(probe.Ping(2, 2))
    if what == "bit flipped":
        spoiled = bytearray(first)
        spoiled[probe.HEADER.size + 8] ^= 1  # in the peer's name
        return bytes(spoiled), b, []
    if what == "MAC flipped":
        return first[:-1] + bytes([first[-1] ^ 0x80]), b, []
    if what == "reordered":
        return second + first, b, []
    if what == "dropped":
        return second, b, []
    if what == "replayed":
        return first + first, b, [SET_PEERS]
    if what == "reflected":  # b's own frame sent back to it
        return b.send(probe.Ping(1, 1)), b, []
    if what == "forged MAC":  # under a key of the forger's
        return _pair()[0].send(probe.Ping(1, 1)), b, []
    if what == "injected plain":  # no MAC at all
        return first + probe.Connection().send(SET_PEERS), b, [SET_PEERS]
    raise AssertionError(what)


@pytest.mark.parametrize("what", ["bit flipped", "MAC flipped", "reordered", "dropped",
                                  "replayed", "reflected", "forged MAC", "injected plain"])
def test_altered_reordered_or_replayed_frames_fail_their_check(what: str) -> None:
    stream, rx, before = _tampered(what)
    rx.receive_data(stream)
    got = []
    with pytest.raises(IntegrityError) as err:
        while (ev := rx.next_event()) is not probe.NEED_DATA:
            got.append(ev)
    assert got == before
    if what == "injected plain":
        assert str(err.value) == ("a SET_PEERS frame without its integrity check on a protected "
                                  "connection (flags 0x0): altered in transit or injected; the "
                                  "connection is closed")
    else:
        assert "frame failed its integrity check (frame " in str(err.value)
        assert str(err.value).endswith("altered, injected, replayed or reordered in transit; "
                                       "the connection is closed")
    with pytest.raises(ProtocolError):  # and the connection stays broken
        rx.next_event()


def test_a_plain_error_may_come_first_where_the_login_allows_it() -> None:
    """The agent refuses a wrong proof before it could protect the
    connection: the client takes that one plain ERROR, and no other."""
    refusal = probe.Connection().send(probe.Error(0, "authentication failed"))
    rx = probe.Connection()
    rx.protect(auth.new_nonce(), auth.new_nonce(), plain_error=True)
    rx.receive_data(refusal)
    assert rx.next_event() == probe.Error(0, "authentication failed")
    for frame, allowed in ((refusal, False), (probe.Connection().send(probe.Ack(0)), True)):
        rx = probe.Connection()
        rx.protect(auth.new_nonce(), auth.new_nonce(), plain_error=allowed)
        rx.receive_data(frame + refusal if allowed else frame)
        with pytest.raises(IntegrityError, match="without its integrity check"):
            _drain(rx)


# --- datagrams -----------------------------------------------------------------


def test_datagram_round_trip_and_fast_path() -> None:
    raw = probe.encode_datagram(5, 6, 2, 10, 123, 1472)
    assert len(raw) == 1472
    assert probe.decode_datagram(raw) == probe.ProbePacket(5, 6, 2, 10, 123, 1472)
    buf = probe.datagram_template(5, 6, 10, 100)
    probe.stamp_datagram(buf, 9, 2**63)
    assert probe.decode_datagram(bytes(buf)) == probe.ProbePacket(5, 6, 9, 10, 2**63, 100)


BAD_DATAGRAMS = {
    "empty": b"",
    "short": probe.encode_datagram(1, 1, 0, 1, 0, 64)[: probe.DATAGRAM_HEADER.size - 1],
    "bad magic": b"XXXX" + probe.encode_datagram(1, 1, 0, 1, 0, 64)[4:],
    "bad version": probe.DATAGRAM_HEADER.pack(b"MFPB", 9, 1, 1, 0, 1, 0),
    "seq beyond count": probe.DATAGRAM_HEADER.pack(b"MFPB", probe.VERSION, 1, 1, 5, 5, 0),
    "zero count": probe.DATAGRAM_HEADER.pack(b"MFPB", probe.VERSION, 1, 1, 0, 0, 0),
}


@pytest.mark.parametrize("data", BAD_DATAGRAMS.values(), ids=BAD_DATAGRAMS.keys())
def test_bad_datagrams_raise_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        probe.decode_datagram(data)


def test_encode_datagram_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="below the header size"):
        probe.encode_datagram(1, 1, 0, 1, 0, 10)
    with pytest.raises(ValueError, match="out of range"):
        probe.encode_datagram(1, 1, 3, 3, 0, 100)


@given(st.binary(max_size=200))
def test_random_datagrams_raise_only_protocol_errors(data: bytes) -> None:
    try:
        probe.decode_datagram(data)
    except ProtocolError:
        pass
