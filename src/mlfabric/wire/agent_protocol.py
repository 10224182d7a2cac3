"""The agent wire protocol, without I/O.

Two channels share one port number:

* **TCP control channel** (`Connection`): length-prefixed frames carrying the
  events below, after a login (`Login` -> `Challenge` -> `Prove` -> `Ack`,
  see `wire.agent_auth`: who may send what). Agents use it to introduce
  themselves (`Hello`), to return the arrival times of a probe train
  (`TrainReport`), to measure RTT
  (`Ping`/`Pong`); local clients and the controller use it to report finished
  transfers (`TransferReport`), read the estimates (`GetEstimates` ->
  `Estimates`) and set the peer list (`SetPeers` -> `Ack`).
* **UDP probe datagrams** (`ProbePacket`, `encode_datagram`/`decode_datagram`):
  one datagram per packet of a probe train, tagged with the session the
  sender opened with `Hello`, the train id and the sequence number.

Frame layout: ``b"MA" | version u8 | type u8 | flags u8 | payload length u32 |
payload``, big-endian, then on a protected connection a 16-byte MAC. Strings
are u16-length-prefixed UTF-8. A malformed, truncated or oversized frame
raises `ProtocolError` and the connection is unusable after.

Integrity (issue 33): once the login has succeeded, every frame either side
sends carries FLAG_MAC and is followed by its AES-GMAC tag (`wire.frame_mac`,
as job connections' frames are) over its header and payload, under the
direction's key (from the login's nonces and the credential's key,
`wire.agent_auth`), with the frame's number on the connection as the nonce.
A frame altered, injected, replayed, dropped or reordered in transit fails
its check: `IntegrityError` before its event is returned, and the
connection is closed. `Connection.protect` turns it on. Probe datagrams are
not protected: a forged one can only spoil one train's measurement, which
the estimator's checks bound.

This module does no I/O: feed bytes to `Connection.receive_data`, pull events
with `next_event()` until it returns `NEED_DATA`, and turn events into bytes
with `send(event)`.
"""

from __future__ import annotations

import enum
import math
import struct
from dataclasses import dataclass
from typing import Any, Final

from ..errors import FrameTooLarge, IntegrityError, NotMlfabric, ProtocolError
from .frame_mac import FLAG_MAC, MAC_SIZE, FrameKey, carries_mac, matches

# 2: Estimates carry the host's own link loads; 3: TrainReport.senders;
# 4: TrainReport.rx_carried_bps; 5: every connection opens with a login
# (wire.agent_auth); 6: frames after the login carry MACs (a flags byte)
VERSION: Final = 6
MAGIC: Final = b"MA"
HEADER = struct.Struct(">2sBBBI")
MAX_FRAME: Final = 1 << 20  # a report of 64 Ki arrivals fits; anything larger is an error
MAX_STRING: Final = 1024
MAX_TRAIN_PACKETS: Final = 65535
MAX_BLOB: Final = 64  # nonces and proofs

DATAGRAM_MAGIC: Final = b"MFPB"
DATAGRAM_HEADER = struct.Struct(">4sBQIHHQ")  # magic, version, session, train, seq, count, sent_ns
# Bytes a datagram adds on an Ethernet link: IPv4 (20) + UDP (8) + Ethernet header (14).
WIRE_OVERHEAD: Final = 42


class NeedData:
    """The type of NEED_DATA (for isinstance checks that type checkers understand)."""

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = NeedData()


class MsgType(enum.IntEnum):
    HELLO = 1
    HELLO_ACK = 2
    TRAIN_REPORT = 3
    PING = 4
    PONG = 5
    TRANSFER_REPORT = 6
    GET_ESTIMATES = 7
    ESTIMATES = 8
    SET_PEERS = 9
    ACK = 10
    ERROR = 11
    LOGIN = 12
    CHALLENGE = 13
    PROVE = 14


# --- events -----------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """An agent opens a probe session: datagrams tagged `session` come from `name`."""

    name: str
    session: int


@dataclass(frozen=True)
class HelloAck:
    name: str


@dataclass(frozen=True)
class TrainReport:
    """Receiver -> sender: the arrivals of one train, as (seq, receive time in ns)
    on the receiver's clock (only differences are meaningful), the load on the
    receiver's downlink in wire bit/s excluding probes (NaN if unknown),
    whether another agent's train overlapped it (then it shared the downlink),
    how many agents probe the receiver (they share its downlink's budget), and
    the most its downlink carried lately in wire bit/s, probes excluded and
    the job's own traffic included (NaN if unknown): the job's traffic is not
    load (the job plans it) but it slows a train all the same."""

    session: int
    train: int
    count: int
    rx_load_bps: float
    overlapped: bool  # another train arrived at the receiver at the same time
    arrivals: tuple[tuple[int, int], ...]
    senders: int = 1  # agents with a probe session open to the receiver
    rx_carried_bps: float = 0.0  # LoadMeter.carried at the receiver


@dataclass(frozen=True)
class Ping:
    nonce: int
    sent_ns: int


@dataclass(frozen=True)
class Pong:
    nonce: int
    sent_ns: int


@dataclass(frozen=True)
class TransferReport:
    """A local client finished a real transfer to/from `peer`."""

    peer: str
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class GetEstimates:
    request_id: int


@dataclass(frozen=True)
class PeerEstimate:
    """What the agent believes about the path to one peer. NaN when unknown."""

    peer: str
    bandwidth_bps: float  # available bandwidth, bit/s of UDP/TCP payload
    capacity_bps: float  # bottleneck capacity, bit/s
    load_bps: float  # load on the path's edge links (other traffic), bit/s
    rtt_s: float
    age_s: float  # since the last accepted bandwidth sample
    stale: bool
    connected: bool
    samples: int


@dataclass(frozen=True)
class Estimates:
    request_id: int
    agent: str
    estimates: tuple[PeerEstimate, ...]
    # other traffic on this host's own downlink and uplink, payload bit/s (probes
    # and the job's own connections excluded); -1 when the agent cannot tell
    down_load_bps: float = -1.0
    up_load_bps: float = -1.0


@dataclass(frozen=True)
class PeerAddress:
    name: str
    host: str
    port: int


@dataclass(frozen=True)
class SetPeers:
    request_id: int
    peers: tuple[PeerAddress, ...]


@dataclass(frozen=True)
class Ack:
    request_id: int


@dataclass(frozen=True)
class Error:
    request_id: int
    message: str


@dataclass(frozen=True)
class Login:
    """A client opens its connection: it holds the cluster token (`role`
    "cluster") or job `job`'s agent key (`role` "job"); see wire.agent_auth."""

    role: str
    job: str
    name: str
    nonce: bytes


@dataclass(frozen=True)
class Challenge:
    """The agent's nonce, and its proof that it holds the same key."""

    nonce: bytes
    proof: bytes


@dataclass(frozen=True)
class Prove:
    """The client's proof that it holds the key; ACK(0) or ERROR(0) follows."""

    proof: bytes


@dataclass(frozen=True)
class ConnectionClosed:
    """The peer closed the connection cleanly, at a frame boundary."""


Event = (
    Hello | HelloAck | TrainReport | Ping | Pong | TransferReport | GetEstimates
    | Estimates | SetPeers | Ack | Error | Login | Challenge | Prove
)


# --- payload codec ----------------------------------------------------------


class _Writer:
    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def pack(self, fmt: str, *values: object) -> None:
        try:
            self.parts.append(struct.pack(">" + fmt, *values))
        except struct.error as exc:
            raise ProtocolError(f"cannot encode {values!r} as {fmt!r}: {exc}") from None

    def string(self, s: str) -> None:
        raw = s.encode("utf-8")
        if len(raw) > MAX_STRING:
            raise ProtocolError(
                f"string of {len(raw)} bytes is longer than {MAX_STRING}; shorten it"
            )
        self.pack("H", len(raw))
        self.parts.append(raw)

    def blob(self, b: bytes) -> None:
        if len(b) > MAX_BLOB:
            raise ProtocolError(f"blob of {len(b)} bytes is longer than {MAX_BLOB}")
        self.pack("B", len(b))
        self.parts.append(bytes(b))

    def bytes(self) -> bytes:
        return b"".join(self.parts)


class _Reader:
    def __init__(self, data: bytes, what: str) -> None:
        self.data = data
        self.pos = 0
        self.what = what

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        s = struct.Struct(">" + fmt)
        if self.pos + s.size > len(self.data):
            raise ProtocolError(
                f"{self.what} frame truncated: needs {self.pos + s.size} bytes, "
                f"has {len(self.data)}"
            )
        values = s.unpack_from(self.data, self.pos)
        self.pos += s.size
        return values

    def string(self) -> str:
        (n,) = self.unpack("H")
        if n > MAX_STRING or self.pos + n > len(self.data):
            raise ProtocolError(f"{self.what} frame has a bad string length {n}")
        raw = self.data[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(f"{self.what} frame has a string that is not UTF-8") from None

    def blob(self) -> bytes:
        (n,) = self.unpack("B")
        if n > MAX_BLOB or self.pos + n > len(self.data):
            raise ProtocolError(f"{self.what} frame has a bad blob length {n}")
        raw = self.data[self.pos : self.pos + n]
        self.pos += n
        return raw

    def end(self) -> None:
        if self.pos != len(self.data):
            raise ProtocolError(
                f"{self.what} frame has {len(self.data) - self.pos} unexpected trailing bytes"
            )


def _finite(x: float, what: str) -> float:
    if not math.isfinite(x) or x < 0:
        raise ProtocolError(f"{what} must be a finite non-negative number, got {x!r}")
    return x


def _encode_payload(event: Event) -> tuple[MsgType, bytes]:
    w = _Writer()
    if isinstance(event, Hello):
        w.string(event.name)
        w.pack("Q", event.session)
        return MsgType.HELLO, w.bytes()
    if isinstance(event, HelloAck):
        w.string(event.name)
        return MsgType.HELLO_ACK, w.bytes()
    if isinstance(event, TrainReport):
        w.pack("QIHddBHI", event.session, event.train, event.count, event.rx_load_bps,
               event.rx_carried_bps, int(event.overlapped), event.senders, len(event.arrivals))
        for seq, t in event.arrivals:
            w.pack("HQ", seq, t)
        return MsgType.TRAIN_REPORT, w.bytes()
    if isinstance(event, Ping):
        w.pack("QQ", event.nonce, event.sent_ns)
        return MsgType.PING, w.bytes()
    if isinstance(event, Pong):
        w.pack("QQ", event.nonce, event.sent_ns)
        return MsgType.PONG, w.bytes()
    if isinstance(event, TransferReport):
        w.string(event.peer)
        w.pack("Qd", event.nbytes, _finite(event.seconds, "TransferReport.seconds"))
        return MsgType.TRANSFER_REPORT, w.bytes()
    if isinstance(event, GetEstimates):
        w.pack("I", event.request_id)
        return MsgType.GET_ESTIMATES, w.bytes()
    if isinstance(event, Estimates):
        w.pack("I", event.request_id)
        w.string(event.agent)
        w.pack("dd", event.down_load_bps, event.up_load_bps)
        w.pack("H", len(event.estimates))
        for e in event.estimates:
            w.string(e.peer)
            w.pack("ddddd", e.bandwidth_bps, e.capacity_bps, e.load_bps, e.rtt_s, e.age_s)
            w.pack("BBI", int(e.stale), int(e.connected), e.samples)
        return MsgType.ESTIMATES, w.bytes()
    if isinstance(event, SetPeers):
        w.pack("IH", event.request_id, len(event.peers))
        for p in event.peers:
            w.string(p.name)
            w.string(p.host)
            w.pack("H", p.port)
        return MsgType.SET_PEERS, w.bytes()
    if isinstance(event, Ack):
        w.pack("I", event.request_id)
        return MsgType.ACK, w.bytes()
    if isinstance(event, Error):
        w.pack("I", event.request_id)
        w.string(event.message)
        return MsgType.ERROR, w.bytes()
    if isinstance(event, Login):
        w.string(event.role)
        w.string(event.job)
        w.string(event.name)
        w.blob(event.nonce)
        return MsgType.LOGIN, w.bytes()
    if isinstance(event, Challenge):
        w.blob(event.nonce)
        w.blob(event.proof)
        return MsgType.CHALLENGE, w.bytes()
    if isinstance(event, Prove):
        w.blob(event.proof)
        return MsgType.PROVE, w.bytes()
    raise TypeError(f"not an agent protocol event: {event!r}")


def _decode_payload(msg_type: int, payload: bytes) -> Event:
    try:
        kind = MsgType(msg_type)
    except ValueError:
        raise ProtocolError(f"unknown message type {msg_type}") from None
    r = _Reader(payload, kind.name)
    event: Event
    if kind is MsgType.HELLO:
        name = r.string()
        (session,) = r.unpack("Q")
        event = Hello(name, session)
    elif kind is MsgType.HELLO_ACK:
        event = HelloAck(r.string())
    elif kind is MsgType.TRAIN_REPORT:
        session, train, count, load, job, overlapped, senders, n = r.unpack("QIHddBHI")
        if n > count:
            raise ProtocolError(f"TrainReport lists {n} arrivals for a train of {count}")
        arrivals = tuple(r.unpack("HQ") for _ in range(n))
        event = TrainReport(session, train, count, load, bool(overlapped), arrivals, senders,
                            job)
    elif kind is MsgType.PING:
        event = Ping(*r.unpack("QQ"))
    elif kind is MsgType.PONG:
        event = Pong(*r.unpack("QQ"))
    elif kind is MsgType.TRANSFER_REPORT:
        peer = r.string()
        nbytes, seconds = r.unpack("Qd")
        event = TransferReport(peer, nbytes, _finite(seconds, "TransferReport.seconds"))
    elif kind is MsgType.GET_ESTIMATES:
        event = GetEstimates(*r.unpack("I"))
    elif kind is MsgType.ESTIMATES:
        (request_id,) = r.unpack("I")
        agent = r.string()
        down_load, up_load = r.unpack("dd")
        (n,) = r.unpack("H")
        entries = []
        for _ in range(n):
            peer = r.string()
            bw, cap, load, rtt, age = r.unpack("ddddd")
            stale, connected, samples = r.unpack("BBI")
            entries.append(
                PeerEstimate(peer, bw, cap, load, rtt, age, bool(stale), bool(connected),
                             samples)
            )
        event = Estimates(request_id, agent, tuple(entries), down_load, up_load)
    elif kind is MsgType.SET_PEERS:
        request_id, n = r.unpack("IH")
        peers = []
        for _ in range(n):
            name = r.string()
            host = r.string()
            (port,) = r.unpack("H")
            peers.append(PeerAddress(name, host, port))
        event = SetPeers(request_id, tuple(peers))
    elif kind is MsgType.ACK:
        event = Ack(*r.unpack("I"))
    elif kind is MsgType.LOGIN:
        event = Login(r.string(), r.string(), r.string(), r.blob())
    elif kind is MsgType.CHALLENGE:
        event = Challenge(r.blob(), r.blob())
    elif kind is MsgType.PROVE:
        event = Prove(r.blob())
    else:  # MsgType.ERROR
        (request_id,) = r.unpack("I")
        event = Error(request_id, r.string())
    r.end()
    return event


# --- the control-channel state machine ----------------------------------------


class Connection:
    """One side of a control connection: bytes in, events out; events in, bytes out.

    Both directions use the same frames, so the same class serves the agent,
    its peers and its clients. After a `ProtocolError` every further call to
    `next_event` raises again: drop the connection.
    """

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self._eof = False
        # The error that broke the connection, as (class, args): not the
        # exception, whose traceback holds the caller's frames, which hold
        # this Connection. That cycle kept every control connection an agent
        # dropped for a bad frame, with its buffers and streams, until a full
        # collection of the cyclic GC: 20-50 MiB after 500 of them (issue 33).
        self._error: tuple[type[ProtocolError], tuple[Any, ...]] | None = None
        # Integrity (`protect`): per-direction keys and frame numbers.
        self._send_key: FrameKey | None = None
        self._recv_key: FrameKey | None = None
        self._send_seq = 0
        self._recv_seq = 0
        self._plain_error_ok = False

    def protect(self, send_key: bytes, recv_key: bytes, *, plain_error: bool = False) -> None:
        """From now on every frame sent carries a MAC under `send_key` and
        every frame received must carry one under `recv_key`, each numbered
        from 0 (frames already buffered included). `plain_error`: the first
        frame received may still be a plain ERROR (the agent refusing the
        proof just sent, before it could turn protection on)."""
        self._send_key, self._recv_key = FrameKey(send_key), FrameKey(recv_key)
        self._send_seq = self._recv_seq = 0
        self._plain_error_ok = plain_error

    @property
    def protected(self) -> bool:
        return self._recv_key is not None

    def receive_data(self, data: bytes) -> None:
        """Feed received bytes; `b""` means the peer closed its side."""
        if not data:
            self._eof = True
        else:
            if self._eof:
                raise ProtocolError("data received after end of stream")
            self._buf += data

    def next_event(self) -> Event | ConnectionClosed | NeedData:
        if self._error is not None:
            kind, args = self._error
            raise kind(*args)
        try:
            return self._next()
        except ProtocolError as exc:
            self._error = (type(exc), exc.args)
            raise

    def _next(self) -> Event | ConnectionClosed | NeedData:
        buf = self._buf
        if len(buf) < HEADER.size:
            if self._eof:
                if buf:
                    raise ProtocolError(
                        f"connection closed inside a frame header ({len(buf)} bytes)"
                    )
                return ConnectionClosed()
            return NEED_DATA
        magic, version, msg_type, flags, length = HEADER.unpack_from(buf)
        if magic != MAGIC:
            # (its first bytes kept: a TLS record there means the other side
            # speaks TLS and this one does not, which both can then say)
            raise NotMlfabric(f"bad frame magic {bytes(magic)!r}: not an mlfabric agent peer",
                              bytes(buf[:64]))
        if version != VERSION:
            raise ProtocolError(
                f"protocol version {version} is not supported (this agent speaks {VERSION}); "
                "run the same mlfabric version on every host"
            )
        protected = self._recv_key is not None
        mac = carries_mac(flags, protected=protected, what=_type_name(msg_type),
                          plain_error=(msg_type == MsgType.ERROR and self._plain_error_ok
                                       and self._recv_seq == 0))
        if protected:
            self._plain_error_ok = False
        if length > self.max_frame:
            raise FrameTooLarge(f"frame of {length} bytes exceeds the maximum {self.max_frame}")
        end = HEADER.size + length + (MAC_SIZE if mac else 0)
        if len(buf) < end:
            if self._eof:
                raise ProtocolError(
                    f"connection closed inside a frame ({len(buf)} of {end} bytes)"
                )
            return NEED_DATA
        payload = bytes(buf[HEADER.size : HEADER.size + length])
        if mac:
            assert self._recv_key is not None
            seq = self._recv_seq
            self._recv_seq += 1
            tag = self._recv_key.tag(seq)
            tag.update(memoryview(buf)[: HEADER.size + length])
            if not matches(tag.finalize(), bytes(buf[HEADER.size + length : end])):
                raise IntegrityError(
                    f"a {_type_name(msg_type)} frame failed its integrity check (frame {seq} "
                    f"of the connection): altered, injected, replayed or reordered in "
                    f"transit; the connection is closed")
        del buf[:end]
        return _decode_payload(msg_type, payload)

    def send(self, event: Event) -> bytes:
        msg_type, payload = _encode_payload(event)
        if len(payload) > self.max_frame:
            raise FrameTooLarge(
                f"{type(event).__name__} of {len(payload)} bytes exceeds the maximum "
                f"{self.max_frame}"
            )
        if self._send_key is None:
            return HEADER.pack(MAGIC, VERSION, msg_type, 0, len(payload)) + payload
        frame = HEADER.pack(MAGIC, VERSION, msg_type, FLAG_MAC, len(payload)) + payload
        tag = self._send_key.tag(self._send_seq)
        self._send_seq += 1
        tag.update(frame)
        return frame + tag.finalize()


def _type_name(msg_type: int) -> str:
    """A message type's name for errors (its number if unknown)."""
    try:
        return MsgType(msg_type).name
    except ValueError:
        return f"type-{msg_type}"


# --- probe datagrams ----------------------------------------------------------


@dataclass(frozen=True)
class ProbePacket:
    session: int
    train: int
    seq: int
    count: int
    sent_ns: int
    size: int  # datagram payload size in bytes (header + padding)


def encode_datagram(session: int, train: int, seq: int, count: int, sent_ns: int,
                    size: int) -> bytes:
    """One probe datagram of `size` bytes (at least the header)."""
    if size < DATAGRAM_HEADER.size:
        raise ValueError(f"probe datagram size {size} is below the header size "
                         f"{DATAGRAM_HEADER.size}")
    if not 0 <= seq < count <= MAX_TRAIN_PACKETS:
        raise ValueError(f"probe seq {seq} / count {count} out of range")
    head = DATAGRAM_HEADER.pack(DATAGRAM_MAGIC, VERSION, session, train, seq, count, sent_ns)
    return head + bytes(size - len(head))


def datagram_template(session: int, train: int, count: int, size: int) -> bytearray:
    """A mutable datagram whose seq and timestamp `stamp_datagram` fills in (fast path)."""
    return bytearray(encode_datagram(session, train, 0, count, 0, size))


_SEQ_OFFSET = 4 + 1 + 8 + 4
_STAMP = struct.Struct(">H")
_STAMP_NS = struct.Struct(">Q")


def stamp_datagram(buf: bytearray, seq: int, sent_ns: int) -> None:
    _STAMP.pack_into(buf, _SEQ_OFFSET, seq)
    _STAMP_NS.pack_into(buf, _SEQ_OFFSET + 4, sent_ns)


def decode_datagram(data: bytes) -> ProbePacket:
    """Parse a probe datagram; raises ProtocolError for anything else."""
    if len(data) < DATAGRAM_HEADER.size:
        raise ProtocolError(
            f"probe datagram of {len(data)} bytes is shorter than the {DATAGRAM_HEADER.size}"
            "-byte header"
        )
    magic, version, session, train, seq, count, sent_ns = DATAGRAM_HEADER.unpack_from(data)
    if magic != DATAGRAM_MAGIC:
        raise ProtocolError(f"bad probe datagram magic {magic!r}")
    if version != VERSION:
        raise ProtocolError(f"probe datagram version {version} is not {VERSION}")
    if count == 0 or seq >= count:
        raise ProtocolError(f"probe datagram seq {seq} outside a train of {count}")
    return ProbePacket(session, train, seq, count, sent_ns, len(data))
