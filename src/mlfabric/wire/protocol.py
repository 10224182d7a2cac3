"""The mlfabric wire protocol, without I/O.

A `Connection` turns bytes into events and events into bytes; it never
touches a socket, a loop or a clock (the h11 pattern). The asyncio transport
and the blocking client both drive the same state machine.

Frame layout (all integers little-endian)::

    magic     4 bytes   b"MLFB"
    version   u8        PROTOCOL_VERSION
    type      u8        MsgType
    flags     u16       FLAG_MAC once the connection is protected, else 0
    meta_len  u32       length of the metadata block
    data_len  u64       length of the tensor data block
    meta      meta_len bytes: the message fields as a UTF-8 JSON object; for
              messages that carry tensors (MODEL, PUSH) followed by a newline
              and the tensor list as JSON, [[name, dtype, shape], ...]. The
              list is kept apart because a job sends the same one with every
              push: both sides cache its encoding and parsing.
    data      the tensors' bytes in the order listed, each starting at a
              multiple of ALIGN bytes from the start of the block (zero padding)

Integrity (issue 33): once both sides have authenticated, every frame
carries FLAG_MAC and is followed by a 16-byte trailer, the AES-GMAC tag of
its header, metadata and data block under the direction's key (from the
handshake, `auth.frame_keys`), with the frame's sequence number on the
connection as the nonce (`wire.frame_mac`, which the agents' control
protocol shares). A frame that
was altered, injected, replayed, dropped or reordered fails its check: the
receiver raises IntegrityError (a ProtocolError) before it returns the
event, and the connection is closed. `Connection.protect` turns it on.

Large data blocks are received straight into a buffer the receiver chooses
(`allocate`), so a 64 MiB push is written by the kernel into its final place:
the transport calls `get_buffer()` / `buffer_updated(n)` (the shape of
asyncio's BufferedProtocol). Small frames go through a scratch buffer so that
one recv() can carry many of them.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import struct
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from ..errors import FrameTooLarge, IntegrityError, NotMlfabric, ProtocolError
from .frame_mac import FLAG_MAC, MAC_SIZE, FrameKey, FrameTag, carries_mac, matches

# 2: CHALLENGE names the listener's role; 3: FELL_BACK; 4: frames after the
# handshake carry MACs
PROTOCOL_VERSION: Final = 4
MAGIC: Final = b"MLFB"
HEADER = struct.Struct("<4sBBHIQ")
ALIGN: Final = 64
MAX_META_LEN: Final = 1 << 20
DEFAULT_MAX_FRAME_SIZE: Final = 1 << 34  # 16 GiB; servers set the model's size
MAX_NAME_LEN: Final = 256
MAX_TENSORS: Final = 4096
MAX_FAN_IN: Final = 64  # members of one aggregate
MAX_UID_LEN: Final = 128
MAX_PULL_WAIT: Final = 600.0  # seconds a pull for an update may be held
MAX_ADDRESSES: Final = 4096  # aggregators a controller's welcome may list
_SCRATCH_SIZE = 1 << 16
_MAX_U64 = (1 << 64) - 1

# Wire dtype codes: only the float types the kernels implement.
DTYPES: Final[Mapping[str, np.dtype]] = {
    "f4": np.dtype("<f4"),
    "f8": np.dtype("<f8"),
}
# Only the parts of a compressed push's tensors (Push.codecs) may also be
# 16-bit codes and indices; every other tensor on the wire is float.
PART_DTYPES: Final[Mapping[str, np.dtype]] = {
    **DTYPES,
    "u2": np.dtype("<u2"),
    "i4": np.dtype("<i4"),
    "i8": np.dtype("<i8"),
}
_DTYPE_CODES = {dt: code for code, dt in PART_DTYPES.items()}
# A compressed tensor's parts are named NAME + PART_SEP + part ("w#i").
PART_SEP: Final = "#"
MAX_PARTS: Final = 4  # parts of one compressed tensor (the codecs use at most 2)


class MsgType(enum.IntEnum):
    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    WELCOME = 4
    PULL = 5
    MODEL = 6
    PUSH = 7
    PUSH_RESULT = 8
    ERROR = 9
    TRANSFER_REQUEST = 10
    DIRECTIVE = 11
    TRANSFER_DONE = 12
    STATUS_REQUEST = 13
    STATUS = 14
    REPLICA_DONE = 15
    PING = 16
    PONG = 17
    PROMOTE = 18
    FAILOVER = 19
    STATE_REQUEST = 20
    REPLICA_JOIN = 21
    REPLICA_AT = 22
    MODEL_END = 23
    PULL_CANCEL = 24
    RESYNC = 25
    TRANSFER_PROGRESS = 26
    SHARD_AT = 27
    FELL_BACK = 28
    MOVED = 29
    LANDED = 30


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = _NeedData()


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def layout(specs: Sequence[TensorSpec]) -> tuple[list[int], int]:
    """Offsets of each tensor in the data block, and the block's total length."""
    offsets = []
    pos = 0
    for i, spec in enumerate(specs):
        if i:
            pos = -(-pos // ALIGN) * ALIGN
        offsets.append(pos)
        pos += spec.nbytes
    return offsets, pos


_LITTLE = sys.byteorder == "little"


def spec_of(name: str, array: np.ndarray, part: bool = False) -> TensorSpec:
    """`part`: the array is a part of a compressed tensor (PART_DTYPES)."""
    dt = array.dtype
    # Fast path (every push): native little-endian float32/float64.
    if _LITTLE and dt.kind == "f" and dt.byteorder in "=<" and dt.itemsize in (4, 8):
        return TensorSpec(name, DTYPES["f4"] if dt.itemsize == 4 else DTYPES["f8"],
                          array.shape)
    if part and dt.byteorder != ">" and dt.newbyteorder("<") in _DTYPE_CODES:
        return TensorSpec(name, np.dtype(dt.newbyteorder("<")), tuple(array.shape))
    if array.dtype.newbyteorder("<") not in DTYPES.values() or array.dtype.byteorder == ">":
        raise TypeError(
            f"tensor {name!r} has dtype {array.dtype}; mlfabric sends float32 or float64 "
            f"(little-endian): convert with arr.astype(np.float32)"
        )
    return TensorSpec(name, np.dtype(array.dtype.newbyteorder("<")), tuple(array.shape))


# --- Events ----------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """Client -> server: which job, who, and the client's nonce."""

    job: str
    client: str
    nonce: bytes


@dataclass(frozen=True)
class Challenge:
    """Server -> client: the server's nonce and its proof of the token, and
    what the listener is (`role`: "server", "replica", "controller",
    "aggregator"), so that a client that dialled the wrong kind of process
    can say so. The role is no secret; the job is not named."""

    nonce: bytes
    proof: bytes
    role: str


@dataclass(frozen=True)
class Auth:
    """Client -> server: the client's proof of the token."""

    proof: bytes


@dataclass(frozen=True)
class ShardInfo:
    """Which part of the model a sharded server keeps: shard `index` of
    `count`, cut with pieces of `chunk` bytes from the whole `model`, which
    `mlfabric.sharding.partition` turns into the same partition on every
    side; `digest` names that partition (a client checks it)."""

    index: int
    count: int
    chunk: int
    digest: str
    model: tuple[TensorSpec, ...]


@dataclass(frozen=True)
class Welcome:
    """Server -> client: authenticated; the model's layout and current version.
    From a controller, `aggregators`: the addresses it may route pushes through
    (a client dials them ahead, not when its first member is due). From a
    sharded server, `shard`: its part of the model (`tensors` are its pieces)."""

    session: str
    version: int
    tensors: tuple[TensorSpec, ...]
    tau_max: int | None = None
    momentum: float = 0.0
    aggregators: tuple[str, ...] = ()
    shard: ShardInfo | None = None


@dataclass(frozen=True)
class Pull:
    """Ask for the model. With `uid`: the first model that includes update
    `uid`, held for up to `wait` seconds until it exists (then the model as
    it is); the server may stream it while that update is still arriving."""

    req: int
    uid: str | None = None
    wait: float | None = None


@dataclass(frozen=True)
class PullCancel:
    """The pull `req` (one for an update, held by the server) is no longer
    wanted: the server forgets it and sends nothing more for it. A model
    already streaming for it still ends with its ModelEnd."""

    req: int


@dataclass(frozen=True, eq=False)
class Model:
    """The model at one version: the answer to a Pull.

    `streamed`: its bytes were sent as the server computed them, and it
    holds only if the ModelEnd for `req` that follows says ok."""

    req: int
    version: int
    tensors: Mapping[str, np.ndarray]
    streamed: bool = False


@dataclass(frozen=True)
class ModelEnd:
    """The end of a streamed Model: `ok` it holds; not ok, the update it was
    computed from did not apply as staged, and the pull is still open."""

    req: int
    ok: bool


@dataclass(frozen=True, eq=False)
class Push:
    """An update computed on model version `base_version`.

    `seq` is set only on pushes to a replica: the server version this update
    produced when the server applied it (the replica applies seq v+1 next).
    An update the server applied as member `index` of an aggregate of
    `fan_in` (one momentum step with their sum, versions v+1 .. v+fan_in)
    goes to a replica with seq = v + 1 + index and those two fields, without
    a `group`: the replica applies the aggregate once all its members are in.

    Aggregation (docs/design.md, "Aggregation"): `uid` names the update
    uniquely (a server applies a uid at most once, so re-sending after a
    failed aggregate is safe). A member pushed to an aggregator carries its
    `group` id, the group's `fan_in`, its `index` in the group (the order of
    the sum) and the server address `dst` the aggregate goes to. An
    aggregate pushed to the server carries `members`: (uid, base_version,
    source) of each member, in index order, the source being the worker's
    client name; its tensors are their sum."""

    req: int
    base_version: int
    tensors: Mapping[str, np.ndarray]
    seq: int | None = None
    uid: str | None = None
    group: int | None = None
    fan_in: int | None = None
    index: int | None = None
    dst: str | None = None
    members: tuple[tuple[str, int, str], ...] | None = None
    # A compressed update (issue 35): (tensor name, codec) for each of the
    # model's tensors, and `tensors` holds their parts, named
    # NAME + PART_SEP + part ("w#i", "w#v"): see mlfabric.compression.
    codecs: tuple[tuple[str, str], ...] | None = None
    # Under a controller: the transfer's id there (`Directive.ticket`), and
    # the ids of the transfers it must not be applied before (they would be
    # refused as stale if it passed them), waited for at most
    # `after_seconds` from its arrival (`Directive.after`).
    ticket: int | None = None
    after: tuple[int, ...] | None = None
    after_seconds: float | None = None


@dataclass(frozen=True)
class PushResult:
    """The answer to a push. For an aggregate, `delays` holds each member's
    delay, in member order (`delay` is the smallest). To a member of an
    aggregate the server applied (answered by the aggregator, or by the
    server to a member re-sent after its aggregate was applied), `fan_in`
    and `index`: it was member `index` of `fan_in`, which took the server
    from version - fan_in to `version` in one step."""

    req: int
    applied: bool
    version: int
    delay: int | None
    reason: str | None = None
    delays: tuple[int, ...] | None = None
    fan_in: int | None = None
    index: int | None = None


@dataclass(frozen=True)
class Error:
    """An error answer. `req` names the request it answers, or None when it
    concerns the whole connection (which the sender then closes)."""

    code: str
    message: str
    req: int | None = None


@dataclass(frozen=True)
class TransferRequest:
    """Client -> controller: an update is ready to go from `host` to the server
    at `dst`; may it?"""

    req: int
    host: str
    dst: str
    nbytes: int
    base_version: int
    norm: float
    shard: int = 0  # which shard of a sharded job's servers (its own versions)
    # Above 0: the controller may let the update go `chunk` bytes of its data
    # block at a time (each grant a `Directive.upto`), so that a shorter
    # transfer can pass it between chunks. 0: all at once.
    chunk: int = 0
    # Compressed forms the worker can send instead (issue 35): (codec, the
    # bytes it would take, the seconds the worker measured encoding it
    # takes), from the least compressed; the controller names one in its go
    # (`Directive.codec`), or none for the update whole.
    options: tuple[tuple[str, int, float], ...] | None = None


@dataclass(frozen=True)
class Directive:
    """Controller -> client: what to do with a requested transfer now.

    action "go": send it now; "drop": do not send it (`reason` says why).
    `position` is its place in the planned order, `planned_seconds` the
    transfer time the plan expects (both for metrics and the decision log).
    A "go" with `via` sends the update to the aggregator at that address as
    member `index` of group `group` (`fan_in` members), not to the server.
    A "go" with `upto` lets the first `upto` bytes of the update's data block
    go (a chunked request): the client reports `TransferProgress` once they
    have left, and waits for the next "go" for the rest."""

    req: int
    action: str
    reason: str | None = None
    position: int | None = None
    planned_seconds: float | None = None
    via: str | None = None
    group: int | None = None
    fan_in: int | None = None
    index: int | None = None
    upto: int | None = None
    # A go's compression: one of the request's options (None: whole).
    codec: str | None = None
    # The most bytes/s the worker's socket may send at while it goes (None:
    # as fast as TCP allows), given beside a transfer that must land first,
    # so it cannot crowd that one out (`MAX_PACE`), for `pace_seconds` from
    # the go (None: until the server's answer).
    pace: float | None = None
    pace_seconds: float | None = None
    # The transfer's id at the controller, which its push carries (a go
    # only), so that the server can tell when it has landed; and, when
    # transfers running into the server would be refused as stale if this
    # one landed before them, their ids: the server applies it only once
    # they have landed, waiting at most `after_seconds` after it lands
    # (the push carries all three: `Push.after`).
    ticket: int | None = None
    after: tuple[int, ...] | None = None
    after_seconds: float | None = None


@dataclass(frozen=True)
class TransferProgress:
    """Client -> controller: the first `sent` bytes of a chunked transfer's
    data have left (its grant so far is used up); the rest waits for a go."""

    req: int
    sent: int


@dataclass(frozen=True)
class TransferDone:
    """Client -> controller: a transfer it let go has ended at the server.
    `via_failed`: it was to go through an aggregator, which failed it (the
    update was then sent straight to the server)."""

    req: int
    applied: bool
    version: int
    delay: int | None
    seconds: float  # from "go" to the server's answer
    via_failed: str | None = None
    # Applied as one of an aggregate of `fan_in` (versions version - fan_in
    # + 1 .. version, one step): None for an update applied alone.
    fan_in: int | None = None


# The name (`Hello.client`) a server's link that sends LANDED gives.
LANDINGS_CLIENT: Final = "mlfabric-server-landings"


@dataclass(frozen=True)
class Landed:
    """Server -> controller (`mlfabric server --controller`): the push that
    carried `ticket` (its transfer's id at the controller: `Push.ticket`)
    was applied at `version`, or refused (`applied` false), with `delay` as
    its answer to the worker gives. It reaches the controller a message
    before the worker's `TransferDone` could, which follows all the same.
    `shard`: the server's shard (0 for a job of one server); `base_version`:
    the push's, so that a ticket of another controller (one the shard had
    before a hand-over) that repeats an id is not taken for the transfer."""

    ticket: int
    shard: int
    base_version: int
    version: int
    applied: bool
    delay: int | None = None


@dataclass(frozen=True)
class ShardAt:
    """Client -> controller, once per link: shard `shard` of a sharded job is
    served at host `dst`, at `version` when this client last heard (so the
    controller lists every shard before any transfer to it)."""

    shard: int
    dst: str
    version: int


@dataclass(frozen=True)
class Moved:
    """Controller -> client, and the controller then closes the link: another
    of the job's controllers plans shard `shard` (several controllers, issue
    34): the one at `owner`, or none yet ("") while its lease is taken over.
    The client dials it and asks again for what this one left undecided."""

    shard: int
    owner: str


@dataclass(frozen=True)
class FellBack:
    """Client -> controller, first on a link dialled after the client had no
    controller (unreachable at connect, or lost later): since it connected,
    it sent `updates` straight to the server, unscheduled (fallback "fifo";
    none with "wait"), over `seconds` without the controller. So that
    `mlfabric status` shows the workers that trained without it."""

    updates: int
    seconds: float


@dataclass(frozen=True)
class ReplicaDone:
    """Client -> controller: the replica at `dst` has applied the update the
    server applied as `version` (worker-driven replication)."""

    dst: str
    version: int


@dataclass(frozen=True)
class Ping:
    """Controller -> server or replica: are you alive? (a heartbeat)

    `since`: also send the norms of the updates applied above this version
    (the divergence gate learns every applied update from the server, not
    only from the worker that pushed it). `velocity`: also send
    ||w - w_prev|| (one pass over the model: asked once per connection)."""

    req: int
    since: int | None = None
    velocity: bool | None = None


# At most this many update norms in one Pong (a controller that is further
# behind asks again from where the answer ended).
MAX_NORMS: Final = 4096


@dataclass(frozen=True)
class Pong:
    """Server or replica -> controller: alive, in `role` at `version`.

    `norms_from`, `norms`: the norms of the updates that produced versions
    norms_from, norms_from + 1, ... (answering a Ping's `since`; norms_from
    is above since + 1 when older ones are no longer kept). `velocity`:
    ||w - w_prev|| at `version`, when asked. `gap`: a replica waiting for a
    missing sequence number says for how many seconds it has waited.
    `spans`: (version, k) for each aggregate of k > 1 among `norms`: one
    step, whose norm is at `version`, took the server there from version - k
    (the norms at the k - 1 versions it skipped are 0.0, and no step)."""

    req: int
    role: str
    version: int
    norms_from: int | None = None
    norms: tuple[float, ...] | None = None
    spans: tuple[tuple[int, int], ...] | None = None
    velocity: float | None = None
    gap: float | None = None


@dataclass(frozen=True)
class Promote:
    """Controller (or an operator) -> replica: the server is gone, become the
    server. Answered with a Pong in role "server", or an Error with code
    "server_alive" when the replica itself still reaches `server` (the one
    it would replace) and `force` is not set: promotion is for a server that
    is really gone, never a second server beside a live one."""

    req: int
    server: str | None = None
    force: bool | None = None


@dataclass(frozen=True)
class Resync:
    """Controller -> replica: a sequence number you wait for will not come
    (its worker died after the server applied it): start over from the state
    of the server at `server`. Answered with a Pong (role "replica") at the
    version taken over, with its velocity, or an Error."""

    req: int
    server: str


@dataclass(frozen=True)
class Failover:
    """Controller -> clients: the server is now at `server` ("HOST:PORT"),
    the replica promoted at `version`."""

    server: str
    version: int


@dataclass(frozen=True)
class StateRequest:
    """New replica -> server: the whole state, to start from. Answered with a
    Model whose tensors are the weights and, under PREVIOUS_PREFIX + name, the
    previous weights (momentum history)."""

    req: int


PREVIOUS_PREFIX: Final = "\x00previous/"


@dataclass(frozen=True)
class ReplicaJoin:
    """New replica -> controller: serving at `address` from `version`, with
    ||w - w_prev|| = `velocity` (for the divergence bound); `shard`: the
    shard it keeps, for a sharded job's replica; `server`: the server it
    took its state from (the one serving the shard now)."""

    address: str
    version: int
    velocity: float = 0.0
    shard: int | None = None
    server: str | None = None


@dataclass(frozen=True)
class ReplicaAt:
    """Controller -> clients: send updates above `version` to the replica at
    `address` (those kept since the last failover included)."""

    address: str
    version: int


@dataclass(frozen=True)
class StatusRequest:
    """Any authenticated peer -> controller: describe the job."""

    req: int


@dataclass(frozen=True, eq=False)
class Status:
    """Controller -> peer: the job's state as a JSON object (see controller.py)."""

    req: int
    status: Mapping[str, Any]


Event = (Hello | Challenge | Auth | Welcome | Pull | PullCancel | Model | ModelEnd | Push
         | PushResult | Error | TransferRequest | Directive | TransferDone | TransferProgress
         | Landed | StatusRequest | Status | ShardAt | Moved | FellBack | ReplicaDone | Ping | Pong
         | Promote | Resync | Failover | StateRequest | ReplicaJoin | ReplicaAt)

DIRECTIVE_ACTIONS = ("go", "drop")


# Allocator: (message type, data length) -> a writable buffer of at least that
# many bytes. The receiver decides where tensor bytes land (a pooled buffer on
# the server, a fresh array in the client).
Allocate = Callable[[MsgType, int], Any]


def default_allocate(msg_type: MsgType, nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


def _tensor_views(specs: Sequence[TensorSpec], offsets: Sequence[int], data: Any
                  ) -> dict[str, np.ndarray]:
    """The tensors of a frame's data block: views into it, by name."""
    tensors: dict[str, np.ndarray] = {}
    for spec, off in zip(specs, offsets, strict=True):
        count = spec.nbytes // spec.dtype.itemsize
        if count:
            assert data is not None
            arr = np.frombuffer(data, dtype=spec.dtype, count=count, offset=off)
        else:
            arr = np.empty(0, dtype=spec.dtype)
        tensors[spec.name] = arr.reshape(spec.shape)
    return tensors


class FrameTensors(Mapping[str, np.ndarray]):
    """A received push's tensors, by name: views into the frame's data block,
    made on first use. `specs` is the frame's tensor list (one tuple object
    per distinct list: the codec caches them) and `flat()` the whole block as
    float32, which a store laid out the same way applies without a Python
    object per tensor (a model of 1,000 small tensors otherwise spends its
    time making and walking views)."""

    __slots__ = ("_views", "data", "offsets", "specs")

    def __init__(self, specs: tuple[TensorSpec, ...], offsets: Sequence[int], data: Any) -> None:
        self.specs = specs
        self.offsets = offsets
        self.data = data
        self._views: dict[str, np.ndarray] | None = None

    def _made(self) -> dict[str, np.ndarray]:
        if self._views is None:
            self._views = _tensor_views(self.specs, self.offsets, self.data)
        return self._views

    def __getitem__(self, name: str) -> np.ndarray:
        return self._made()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._made())

    def __len__(self) -> int:
        return len(self.specs)

    def __repr__(self) -> str:
        return f"FrameTensors({len(self.specs)} tensors)"

    def flat(self) -> np.ndarray:
        """The data block as one float32 array (meaningful when every tensor
        is float32)."""
        if self.data is None:
            return np.empty(0, np.float32)
        return np.frombuffer(self.data, np.float32, count=len(self.data) // 4)


@dataclass(frozen=True, eq=False)
class BlockPlan:
    """Where a frame's data block comes from, piece by piece, when it is sent
    straight from the arrays of an update (not copied): piece k is
    `lengths[k]` bytes from byte `starts[k]` of array `index[k]`, at
    `offsets[k]` in the block of `total` bytes. The bytes between pieces and
    after the last are zero. One plan serves every push of a client (it
    depends on the tensor list only); `runtime._sendv` checks it against the
    arrays before it reads a byte."""

    index: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    offsets: np.ndarray
    total: int

    @classmethod
    def whole(cls, specs: Sequence[TensorSpec]) -> BlockPlan:
        """Every tensor of `specs` whole, in their frame layout."""
        offsets, total = layout(specs)
        n = len(specs)
        return cls(np.arange(n, dtype=np.intp), np.zeros(n, np.intp),
                   np.array([sp.nbytes for sp in specs], np.intp),
                   np.array(offsets, np.intp), total)


class ScatteredBlock:
    """A frame's data block as pieces of arrays (`BlockPlan`): one part of
    the buffers `Connection.send` returns. A link writes it with one
    scatter-gather system call (runtime.loop.write_parts); `len()` is its
    size in bytes."""

    __slots__ = ("arrays", "plan", "trailer")

    def __init__(self, arrays: list[np.ndarray], plan: BlockPlan) -> None:
        self.arrays = arrays
        self.plan = plan
        self.trailer = b""  # the frame's MAC, written after the block (protected links)

    def __len__(self) -> int:
        return self.plan.total + len(self.trailer)

    def pieces(self) -> list[bytes | memoryview]:
        """The block as buffers in order, zero padding included (for a
        writer that cannot take the arrays as they are: a Python object
        per piece)."""
        plan, pos = self.plan, 0
        out: list[bytes | memoryview] = []
        for i, start, n, off in zip(plan.index.tolist(), plan.starts.tolist(),
                                    plan.lengths.tolist(), plan.offsets.tolist(), strict=True):
            if off > pos:
                out.append(bytes(off - pos))
            out.append(memoryview(self.arrays[i]).cast("B")[start:start + n])
            pos = off + n
        if plan.total > pos:
            out.append(bytes(plan.total - pos))
        if self.trailer:
            out.append(self.trailer)
        return out


def expand_parts(parts: list[Any]) -> list[Any]:
    """A frame's parts with a `ScatteredBlock` replaced by its pieces: for a
    writer that takes buffers only."""
    if not parts or not isinstance(parts[-1], ScatteredBlock):
        return parts
    return [*parts[:-1], *parts[-1].pieces()]


class Scatter:
    """Where a MODEL frame's data block is received when not into one new
    buffer: the block's bytes in order, as consecutive writable runs (the
    receiver's own arrays, and a spare buffer for the padding between them).
    A sharded client receives each shard's part straight into the whole
    model this way (no join copy). Used only for a frame that lists exactly
    `specs`; any other frame gets a buffer of its own. `tensors` is what the
    event then carries, this very object: the receiver's view of where the
    bytes went."""

    __slots__ = ("runs", "specs", "tensors")

    def __init__(self, specs: tuple[TensorSpec, ...], runs: Sequence[memoryview],
                 tensors: Mapping[str, np.ndarray]) -> None:
        self.specs = specs
        self.runs = [r for r in runs if len(r)]
        for r in self.runs:
            if r.readonly or r.format != "B" or not r.c_contiguous:
                raise ValueError("a Scatter's runs must be writable contiguous byte views")
        total = layout(specs)[1]
        if sum(len(r) for r in self.runs) != total or (total and not self.runs):
            raise ValueError(f"a Scatter's runs hold {sum(len(r) for r in self.runs)} bytes; "
                             f"the block of its tensors is {total}")
        self.tensors = tensors


class LaidOutTensors(Mapping[str, np.ndarray]):
    """An update checked against the tensor list `specs`, to be sent as one
    frame data block in their layout straight from `arrays`, not copied
    (`plan` says which bytes of which array go where). A model of 1,000
    small tensors then costs one system call and no copy, like one tensor of
    the same size. By name, the tensors are views (made on first use)."""

    __slots__ = ("_views", "arrays", "plan", "specs")

    def __init__(self, specs: tuple[TensorSpec, ...], arrays: list[np.ndarray],
                 plan: BlockPlan) -> None:
        self.specs = specs
        self.arrays = arrays
        self.plan = plan
        self._views: dict[str, np.ndarray] | None = None

    @property
    def nbytes(self) -> int:
        return self.plan.total

    def block(self) -> ScatteredBlock:
        return ScatteredBlock(self.arrays, self.plan)

    def _made(self) -> dict[str, np.ndarray]:
        if self._views is None:
            plan = self.plan
            self._views = {
                spec.name: self.arrays[i].reshape(-1).view(np.uint8)[start:start + spec.nbytes]
                .view(spec.dtype).reshape(spec.shape)
                for spec, i, start in zip(self.specs, plan.index.tolist(), plan.starts.tolist(),
                                          strict=True)}
        return self._views

    def __getitem__(self, name: str) -> np.ndarray:
        return self._made()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(sp.name for sp in self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def __repr__(self) -> str:
        return f"LaidOutTensors({len(self.specs)} tensors)"


# --- Field validation ------------------------------------------------------


def _int(meta: Mapping[str, Any], key: str) -> int:
    value = meta.get(key)
    if type(value) is not int or not 0 <= value <= _MAX_U64:
        raise ProtocolError(f"field {key!r} must be a non-negative integer, got {value!r}")
    return value


def _opt_int(meta: Mapping[str, Any], key: str) -> int | None:
    return None if meta.get(key) is None else _int(meta, key)


def _str(meta: Mapping[str, Any], key: str, max_len: int = 4096) -> str:
    value = meta.get(key)
    if not isinstance(value, str) or len(value) > max_len:
        raise ProtocolError(f"field {key!r} must be a string of at most {max_len} characters")
    return value


def _hex(meta: Mapping[str, Any], key: str) -> bytes:
    value = _str(meta, key, 1024)
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ProtocolError(f"field {key!r} must be hex, got {value[:40]!r}") from None


def _float(meta: Mapping[str, Any], key: str) -> float:
    value = meta.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        -1e300 < value < 1e300
    ):
        raise ProtocolError(f"field {key!r} must be a finite number, got {value!r:.40}")
    return float(value)


def _opt_float(meta: Mapping[str, Any], key: str) -> float | None:
    return None if meta.get(key) is None else _float(meta, key)


def _addresses(meta: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = meta.get(key, [])
    if not (isinstance(value, list) and len(value) <= MAX_ADDRESSES
            and all(isinstance(a, str) and len(a) <= 256 for a in value)):
        raise ProtocolError(f"field {key!r} must be a list of at most {MAX_ADDRESSES} "
                            f"addresses of at most 256 characters")
    return tuple(value)


def _opt_str(meta: Mapping[str, Any], key: str, max_len: int = 4096) -> str | None:
    return None if meta.get(key) is None else _str(meta, key, max_len)


def _opt_bool(meta: Mapping[str, Any], key: str) -> bool | None:
    value = meta.get(key)
    if value is not None and not isinstance(value, bool):
        raise ProtocolError(f"field {key!r} must be a boolean, got {value!r:.40}")
    return value


def _opt_norms(meta: Mapping[str, Any], key: str) -> tuple[float, ...] | None:
    """Update norms: at most MAX_NORMS finite numbers >= 0."""
    value = meta.get(key)
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) <= MAX_NORMS and all(
            not isinstance(x, bool) and isinstance(x, (int, float)) and 0 <= x < 1e300
            for x in value)):
        raise ProtocolError(f"field {key!r} must be a list of at most {MAX_NORMS} finite "
                            f"numbers >= 0")
    return tuple(float(x) for x in value)


def _opt_fan_in(meta: Mapping[str, Any]) -> int | None:
    fan_in = _opt_int(meta, "fan_in")
    if fan_in is not None and not 1 <= fan_in <= MAX_FAN_IN:
        raise ProtocolError(f"field 'fan_in' must be 1 to {MAX_FAN_IN}, got {fan_in}")
    return fan_in


def _check_membership(fan_in: int | None, index: int | None, what: str) -> None:
    if fan_in is None or index is None or not 1 <= fan_in <= MAX_FAN_IN \
            or not 0 <= index < fan_in:
        raise ProtocolError(f"a {what} for an aggregate needs 1 <= fan_in <= {MAX_FAN_IN} and "
                            f"0 <= index < fan_in, got fan_in={fan_in!r} index={index!r}")


def _aggregation_fields(meta: Mapping[str, Any]) -> dict[str, Any]:
    """A push's optional aggregation fields (see Push), checked."""
    fields: dict[str, Any] = {}
    if meta.get("uid") is not None:
        fields["uid"] = _str(meta, "uid", MAX_UID_LEN)
    if meta.get("group") is not None:
        fields["group"] = _int(meta, "group")
        fields["fan_in"], fields["index"] = _opt_int(meta, "fan_in"), _opt_int(meta, "index")
        _check_membership(fields["fan_in"], fields["index"], "push")
        fields["dst"] = _str(meta, "dst", 256)
        if "uid" not in fields:
            raise ProtocolError("a push to an aggregator needs a 'uid'")
    elif meta.get("seq") is not None and meta.get("fan_in") is not None:
        # A member of an aggregate, to a replica.
        fields["fan_in"], fields["index"] = _opt_int(meta, "fan_in"), _opt_int(meta, "index")
        _check_membership(fields["fan_in"], fields["index"], "push")
    members = meta.get("members")
    if members is not None:
        if (not isinstance(members, list) or not 1 <= len(members) <= MAX_FAN_IN
                or not all(isinstance(m, list) and len(m) == 3 and isinstance(m[0], str)
                           and len(m[0]) <= MAX_UID_LEN and type(m[1]) is int and m[1] >= 0
                           and isinstance(m[2], str) and len(m[2]) <= MAX_NAME_LEN
                           for m in members)):
            raise ProtocolError(f"field 'members' must be 1 to {MAX_FAN_IN} [uid, base_version, "
                                f"source] triples, got {members!r:.80}")
        fields["members"] = tuple((uid, base, source) for uid, base, source in members)
    return fields


def _specs(meta: Mapping[str, Any], dtypes: Mapping[str, np.dtype] = DTYPES
           ) -> tuple[TensorSpec, ...]:
    raw = meta.get("tensors")
    if not isinstance(raw, list) or len(raw) > MAX_TENSORS:
        raise ProtocolError(f"field 'tensors' must be a list of at most {MAX_TENSORS} entries")
    specs = []
    seen = set()
    for entry in raw:
        if not (isinstance(entry, list) and len(entry) == 3):
            raise ProtocolError(f"tensor entry must be [name, dtype, shape], got {entry!r:.80}")
        name, code, shape = entry
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LEN:
            raise ProtocolError(f"tensor name must be 1..{MAX_NAME_LEN} characters: {name!r:.80}")
        if name in seen:
            raise ProtocolError(f"tensor {name!r} is listed twice")
        seen.add(name)
        if code not in dtypes:
            raise ProtocolError(f"tensor {name!r} has unknown dtype code {code!r:.20}")
        if not (
            isinstance(shape, list)
            and len(shape) <= 32
            and all(type(d) is int and 0 <= d <= _MAX_U64 for d in shape)
        ):
            raise ProtocolError(f"tensor {name!r} has a malformed shape {shape!r:.80}")
        specs.append(TensorSpec(name, dtypes[code], tuple(shape)))
    return tuple(specs)


def _meta_specs(specs: Sequence[TensorSpec]) -> list[list[Any]]:
    return [[s.name, _DTYPE_CODES[s.dtype], list(s.shape)] for s in specs]


# Tensor lists seen recently, both ways. Bounded: a peer that sends a new
# list with every frame costs a parse each time, never unbounded memory.
_SPEC_CACHE_SIZE = 256
_encoded_specs: dict[tuple[TensorSpec, ...], tuple[bytes, list[int], int]] = {}
_decoded_specs: dict[tuple[bytes, bool], tuple[tuple[TensorSpec, ...], list[int], int]] = {}


# The same, by identity: a client sends one tensor list object with every push
# of a laid-out block, and hashing a list of 1,000 tensors costs a millisecond.
_encoded_by_id: dict[int, tuple[tuple[TensorSpec, ...], tuple[bytes, list[int], int]]] = {}


def _encode_specs(specs: tuple[TensorSpec, ...]) -> tuple[bytes, list[int], int]:
    known = _encoded_by_id.get(id(specs))
    if known is not None and known[0] is specs:
        return known[1]
    hit = _encode_specs_by_value(specs)
    if len(_encoded_by_id) >= _SPEC_CACHE_SIZE:
        _encoded_by_id.clear()
    _encoded_by_id[id(specs)] = (specs, hit)  # holds specs: its id is not reused meanwhile
    return hit


def _encode_specs_by_value(specs: tuple[TensorSpec, ...]) -> tuple[bytes, list[int], int]:
    hit = _encoded_specs.get(specs)
    if hit is None:
        text = json.dumps(_meta_specs(specs), separators=(",", ":")).encode()
        hit = (text, *layout(specs))
        if len(_encoded_specs) >= _SPEC_CACHE_SIZE:
            _encoded_specs.clear()
        _encoded_specs[specs] = hit
    return hit


def _decode_specs(raw: bytes, parts: bool = False
                  ) -> tuple[tuple[TensorSpec, ...], list[int], int]:
    """`parts`: a push's list, whose tensors may be compressed parts
    (PART_DTYPES; `check_parts` then says which may)."""
    key = (raw, parts)
    hit = _decoded_specs.get(key)
    if hit is None:
        try:
            entries = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise ProtocolError("tensor list is not valid JSON") from None
        specs = _specs({"tensors": entries}, PART_DTYPES if parts else DTYPES)
        hit = (specs, *layout(specs))
        if len(_decoded_specs) >= _SPEC_CACHE_SIZE:
            _decoded_specs.clear()
        _decoded_specs[key] = hit
    return hit


def _decode_hello(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    return Hello(job=_str(meta, "job", 256), client=_str(meta, "client", 256),
                 nonce=_hex(meta, "nonce"))


def _decode_challenge(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    return Challenge(nonce=_hex(meta, "nonce"), proof=_hex(meta, "proof"),
                     role=_str(meta, "role", 16))


def _decode_auth(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    return Auth(proof=_hex(meta, "proof"))


def _decode_welcome(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    momentum = meta.get("momentum", 0.0)
    if not isinstance(momentum, (int, float)) or isinstance(momentum, bool):
        raise ProtocolError(f"field 'momentum' must be a number, got {momentum!r:.40}")
    return Welcome(
        session=_str(meta, "session", 256),
        version=_int(meta, "version"),
        tensors=_specs(meta),
        tau_max=_opt_int(meta, "tau_max"),
        momentum=float(momentum),
        aggregators=_addresses(meta, "aggregators"),
        shard=_shard_info(meta),
    )


MAX_SHARDS: Final = 4096


def _shard_info(meta: Mapping[str, Any]) -> ShardInfo | None:
    raw = meta.get("shard")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ProtocolError(f"field 'shard' must be an object, got {raw!r:.40}")
    index, count, chunk = _int(raw, "index"), _int(raw, "count"), _int(raw, "chunk")
    if not (1 <= count <= MAX_SHARDS and index < count and chunk > 0):
        raise ProtocolError(f"field 'shard' must name shard index < count <= {MAX_SHARDS} "
                            f"and a positive chunk, got index {index}, count {count}, "
                            f"chunk {chunk}")
    return ShardInfo(index, count, chunk, _str(raw, "digest", 64),
                     _specs({"tensors": raw.get("model")}))


def _decode_pull(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    uid, wait = _opt_str(meta, "uid"), _opt_float(meta, "wait")
    if uid is not None and len(uid) > MAX_UID_LEN:
        raise ProtocolError(f"field 'uid' is longer than {MAX_UID_LEN} characters")
    if (uid is None) != (wait is None) or (wait is not None
                                           and not 0 < wait <= MAX_PULL_WAIT):
        raise ProtocolError(f"a pull for an update needs both 'uid' and 'wait' (0 < wait "
                            f"<= {MAX_PULL_WAIT} s), got uid={uid!r:.40} wait={wait!r}")
    return Pull(req=_int(meta, "req"), uid=uid, wait=wait)


def _decode_pull_cancel(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    return PullCancel(req=_int(meta, "req"))


def _decode_model(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    streamed = meta.get("streamed", False)
    if not isinstance(streamed, bool):
        raise ProtocolError(f"field 'streamed' must be true or false, got {streamed!r:.40}")
    return Model(req=_int(meta, "req"), version=_int(meta, "version"), tensors=tensors,
                 streamed=streamed)


def _decode_model_end(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    ok = meta.get("ok")
    if not isinstance(ok, bool):
        raise ProtocolError(f"field 'ok' must be true or false, got {ok!r:.40}")
    return ModelEnd(req=_int(meta, "req"), ok=ok)


def _decode_push(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    return Push(req=_int(meta, "req"), base_version=_int(meta, "base_version"),
                tensors=tensors, seq=_opt_int(meta, "seq"), codecs=_codecs(meta),
                **_after(meta), **_aggregation_fields(meta))


def _codecs(meta: Mapping[str, Any]) -> tuple[tuple[str, str], ...] | None:
    raw = meta.get("codecs")
    if raw is None:
        return None
    if (not isinstance(raw, list) or not 0 < len(raw) <= MAX_TENSORS
            or not all(isinstance(c, list) and len(c) == 2 and isinstance(c[0], str)
                       and 0 < len(c[0]) <= MAX_NAME_LEN and isinstance(c[1], str)
                       and 0 < len(c[1]) <= 16 for c in raw)):
        raise ProtocolError(f"field 'codecs' must be 1 to {MAX_TENSORS} [tensor, codec] "
                            f"pairs, got {raw!r:.80}")
    names = [c[0] for c in raw]
    if len(set(names)) != len(names):
        raise ProtocolError("field 'codecs' names a tensor twice")
    return tuple((name, codec) for name, codec in raw)


def check_parts(codecs: tuple[tuple[str, str], ...] | None, specs: Sequence[TensorSpec]
                ) -> None:
    """A push's tensor list against its codecs: without codecs every tensor is
    float; with them, every tensor is a part (NAME#PART) of a tensor they
    name, each has at least one, and none more than MAX_PARTS. What the parts
    must be for each codec is the receiver's check (compression.check)."""
    if codecs is None:
        for spec in specs:
            if spec.dtype not in DTYPES.values():
                raise ProtocolError(f"tensor {spec.name!r} is {spec.dtype}: only the parts of "
                                    f"a compressed push (field 'codecs') are not float")
        return
    count = dict.fromkeys((name for name, _ in codecs), 0)
    for spec in specs:
        name, sep, part = spec.name.rpartition(PART_SEP)
        if not sep or not part or name not in count:
            raise ProtocolError(f"tensor {spec.name!r} of a compressed push is no part "
                                f"(NAME{PART_SEP}PART) of a tensor its 'codecs' name")
        count[name] += 1
    for name, n in count.items():
        if not 1 <= n <= MAX_PARTS:
            raise ProtocolError(f"compressed tensor {name!r} has {n} parts (1 to {MAX_PARTS})")


def _decode_push_result(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    applied = meta.get("applied")
    if not isinstance(applied, bool):
        raise ProtocolError(f"field 'applied' must be a boolean, got {applied!r:.40}")
    reason = meta.get("reason")
    if reason is not None:
        reason = _str(meta, "reason")
    delays = meta.get("delays")
    if delays is not None and (not isinstance(delays, list) or len(delays) > MAX_FAN_IN
                               or not all(type(d) is int for d in delays)):
        raise ProtocolError(f"field 'delays' must be a list of at most {MAX_FAN_IN} "
                            f"integers, got {delays!r:.60}")
    fan_in, index = _opt_fan_in(meta), _opt_int(meta, "index")
    if (fan_in is None) != (index is None) or (
            index is not None and fan_in is not None and index >= fan_in):
        raise ProtocolError(f"a push result's 'fan_in' and 'index' come together, with "
                            f"0 <= index < fan_in; got {fan_in!r} and {index!r}")
    return PushResult(req=_int(meta, "req"), applied=applied, version=_int(meta, "version"),
                      delay=_opt_int(meta, "delay"), reason=reason,
                      delays=None if delays is None else tuple(delays),
                      fan_in=fan_in, index=index)


def _decode_error(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    return Error(code=_str(meta, "code", 64), message=_str(meta, "message"),
                 req=_opt_int(meta, "req"))


def _decode_transfer_request(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    return TransferRequest(req=_int(meta, "req"), host=_str(meta, "host", 256),
                           dst=_str(meta, "dst", 256), nbytes=_int(meta, "nbytes"),
                           base_version=_int(meta, "base_version"),
                           norm=_float(meta, "norm"), shard=_shard_index(meta),
                           chunk=_opt_int(meta, "chunk") or 0, options=_options(meta))


MAX_OPTIONS: Final = 8  # compressed forms one transfer request may offer
MAX_ENCODE_SECONDS: Final = 600.0  # an option's encoding time, at most
# A go's pacing rate, at most (bytes/s): 8 Tbit/s, above any NIC's, and within
# the 64 bits the socket option takes.
MAX_PACE: Final = 1e12
MAX_PACE_SECONDS: Final = 86400.0  # how long a go may pace, at most (a day)
# How long a server may hold a push for the transfers it must not pass, at
# most (a transfer later than that is not coming), and how many it may name.
MAX_AFTER_SECONDS: Final = 600.0
MAX_AFTER: Final = 64


def _option(o: Any) -> tuple[str, int, float] | None:
    """[codec, bytes, encode seconds] (or, from a worker of before the
    seconds, [codec, bytes]: 0 s), or None if malformed."""
    if not (isinstance(o, list) and len(o) in (2, 3) and isinstance(o[0], str)
            and 0 < len(o[0]) <= 32 and type(o[1]) is int and 0 <= o[1] <= _MAX_U64):
        return None
    seconds = o[2] if len(o) == 3 else 0.0
    if type(seconds) not in (int, float) or not 0.0 <= seconds <= MAX_ENCODE_SECONDS:
        return None  # NaN fails the comparison too
    return o[0], o[1], float(seconds)


def _options(meta: Mapping[str, Any]) -> tuple[tuple[str, int, float], ...] | None:
    raw = meta.get("options")
    if raw is None:
        return None
    options = [_option(o) for o in raw] if isinstance(raw, list) else []
    if not 0 < len(options) <= MAX_OPTIONS or None in options:
        raise ProtocolError(f"field 'options' must be 1 to {MAX_OPTIONS} [codec, bytes, "
                            f"encode seconds in 0..{MAX_ENCODE_SECONDS:g}] lists, got "
                            f"{raw!r:.80}")
    return tuple(o for o in options if o is not None)


def _shard_index(meta: Mapping[str, Any]) -> int:
    shard = _opt_int(meta, "shard") or 0
    if shard >= MAX_SHARDS:
        raise ProtocolError(f"field 'shard' must be below {MAX_SHARDS}, got {shard}")
    return shard


def _decode_directive(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    action = _str(meta, "action", 16)
    if action not in DIRECTIVE_ACTIONS:
        raise ProtocolError(f"unknown directive action {action!r}")
    via = meta.get("via")
    group = {k: _opt_int(meta, k) for k in ("group", "fan_in", "index")}
    if via is not None:
        _check_membership(group["fan_in"], group["index"], "directive")
        if group["group"] is None:
            raise ProtocolError("a directive with 'via' needs 'group'")
    return Directive(req=_int(meta, "req"), action=action, reason=_opt_str(meta, "reason"),
                     position=_opt_int(meta, "position"),
                     planned_seconds=_opt_float(meta, "planned_seconds"),
                     via=None if via is None else _str(meta, "via", 256),
                     upto=_opt_int(meta, "upto"), codec=_opt_str(meta, "codec", 32),
                     pace=_pace(meta), pace_seconds=_pace_seconds(meta),
                     group=group["group"], fan_in=group["fan_in"], index=group["index"],
                     **_after(meta))


def _after(meta: Mapping[str, Any]) -> dict[str, Any]:
    """A go's or a push's `ticket`, `after` and `after_seconds` (the last
    two both or neither, and only with a ticket)."""
    ticket, raw, seconds = _opt_int(meta, "ticket"), meta.get("after"), \
        _opt_float(meta, "after_seconds")
    after: tuple[int, ...] | None = None
    if raw is not None:
        if not (isinstance(raw, list) and 0 < len(raw) <= MAX_AFTER
                and all(type(i) is int and 0 <= i <= _MAX_U64 for i in raw)):
            raise ProtocolError(f"field 'after' must be 1 to {MAX_AFTER} transfer ids "
                                f"(non-negative integers), got {raw!r:.80}")
        after = tuple(raw)
    if (after is None) != (seconds is None) or (after is not None and ticket is None):
        raise ProtocolError(f"fields 'after' and 'after_seconds' come together, with a "
                            f"'ticket': got {after!r:.80}, {seconds!r} and {ticket!r}")
    if seconds is not None and not 0.0 < seconds <= MAX_AFTER_SECONDS:
        raise ProtocolError(f"field 'after_seconds' must be above 0 and at most "
                            f"{MAX_AFTER_SECONDS:g}, got {seconds!r}")
    return {"ticket": ticket, "after": after, "after_seconds": seconds}


def _pace(meta: Mapping[str, Any]) -> float | None:
    pace = _opt_float(meta, "pace")
    if pace is not None and not 1.0 <= pace <= MAX_PACE:
        raise ProtocolError(f"field 'pace' must be 1 to {MAX_PACE:g} bytes/s, got {pace!r}")
    return pace


def _pace_seconds(meta: Mapping[str, Any]) -> float | None:
    seconds = _opt_float(meta, "pace_seconds")
    if seconds is not None and not 0.0 < seconds <= MAX_PACE_SECONDS:
        raise ProtocolError(f"field 'pace_seconds' must be above 0 and at most "
                            f"{MAX_PACE_SECONDS:g}, got {seconds!r}")
    return seconds


def _decode_transfer_progress(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]
                              ) -> Event:
    return TransferProgress(req=_int(meta, "req"), sent=_int(meta, "sent"))


def _decode_shard_at(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    return ShardAt(shard=_shard_index(meta), dst=_str(meta, "dst", 256),
                   version=_int(meta, "version"))


def _decode_status_request(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    return StatusRequest(req=_int(meta, "req"))


def _decode_moved(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    return Moved(shard=_shard_index(meta), owner=_str(meta, "owner", 256))


def _decode_fell_back(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    seconds = _float(meta, "seconds")
    if seconds < 0:
        raise ProtocolError(f"field 'seconds' must be >= 0, got {seconds!r}")
    return FellBack(updates=_int(meta, "updates"), seconds=seconds)


def _decode_ping(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    return Ping(req=_int(meta, "req"), since=_opt_int(meta, "since"),
                velocity=_opt_bool(meta, "velocity"))


def _decode_pong(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    norms = _opt_norms(meta, "norms")
    norms_from = _opt_int(meta, "norms_from")
    if (norms is None) != (norms_from is None):
        raise ProtocolError("a pong's 'norms' and 'norms_from' come together")
    velocity, gap = _opt_float(meta, "velocity"), _opt_float(meta, "gap")
    if (velocity is not None and velocity < 0) or (gap is not None and gap < 0):
        raise ProtocolError(f"a pong's velocity and gap must be >= 0, got {velocity!r} "
                            f"and {gap!r}")
    spans = meta.get("spans")
    if spans is not None:
        if norms is None or norms_from is None or not (
                isinstance(spans, list) and len(spans) <= len(norms) and all(
                    isinstance(x, list) and len(x) == 2 and type(x[0]) is int
                    and type(x[1]) is int and 2 <= x[1] <= MAX_FAN_IN
                    and norms_from <= x[0] < norms_from + len(norms) for x in spans)):
            raise ProtocolError(f"a pong's 'spans' must be [version, k] pairs with 2 <= k <= "
                                f"{MAX_FAN_IN} and a version among its norms, got "
                                f"{spans!r:.80}")
        spans = tuple((v, k) for v, k in spans)
    return Pong(req=_int(meta, "req"), role=_str(meta, "role", 16),
                version=_int(meta, "version"), norms_from=norms_from, norms=norms,
                spans=spans, velocity=velocity, gap=gap)


def _decode_promote(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    return Promote(req=_int(meta, "req"), server=_opt_str(meta, "server", 256),
                   force=_opt_bool(meta, "force"))


def _decode_resync(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    return Resync(req=_int(meta, "req"), server=_str(meta, "server", 256))


def _decode_failover(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    return Failover(server=_str(meta, "server", 256), version=_int(meta, "version"))


def _decode_state_request(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    return StateRequest(req=_int(meta, "req"))


def _decode_replica_join(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    return ReplicaJoin(address=_str(meta, "address", 256), version=_int(meta, "version"),
                       velocity=_opt_float(meta, "velocity") or 0.0,
                       shard=None if meta.get("shard") is None else _shard_index(meta),
                       server=_opt_str(meta, "server", 256))


def _decode_replica_at(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    return ReplicaAt(address=_str(meta, "address", 256), version=_int(meta, "version"))


def _decode_replica_done(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    return ReplicaDone(dst=_str(meta, "dst", 256), version=_int(meta, "version"))


def _decode_status(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    status = meta.get("status")
    if not isinstance(status, dict):
        raise ProtocolError("field 'status' must be a JSON object")
    return Status(req=_int(meta, "req"), status=status)


def _decode_landed(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    applied = meta.get("applied")
    if not isinstance(applied, bool):
        raise ProtocolError(f"field 'applied' must be a boolean, got {applied!r:.40}")
    return Landed(ticket=_int(meta, "ticket"), shard=_shard_index(meta),
                  base_version=_int(meta, "base_version"),
                  version=_int(meta, "version"), applied=applied,
                  delay=_opt_int(meta, "delay"))


def _decode_transfer_done(meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    applied = meta.get("applied")
    if not isinstance(applied, bool):
        raise ProtocolError(f"field 'applied' must be a boolean, got {applied!r:.40}")
    via_failed = meta.get("via_failed")
    return TransferDone(req=_int(meta, "req"), applied=applied,
                        version=_int(meta, "version"), delay=_opt_int(meta, "delay"),
                        seconds=_float(meta, "seconds"),
                        via_failed=None if via_failed is None else _str(meta, "via_failed",
                                                                        256),
                        fan_in=_opt_fan_in(meta))


def _fields(event: Event) -> dict[str, Any]:
    """An event's fields as JSON, those that are None left out."""
    return {k: list(v) if isinstance(v, tuple) else v
            for k, v in vars(event).items() if v is not None}


def _encode_hello(event: Hello) -> dict[str, Any]:
    return {"job": event.job, "client": event.client, "nonce": event.nonce.hex()}


def _encode_challenge(event: Challenge) -> dict[str, Any]:
    return {"nonce": event.nonce.hex(), "proof": event.proof.hex(), "role": event.role}


def _encode_auth(event: Auth) -> dict[str, Any]:
    return {"proof": event.proof.hex()}


def _encode_welcome(event: Welcome) -> dict[str, Any]:
    meta = {"session": event.session, "version": event.version,
            "tensors": _meta_specs(event.tensors), "momentum": event.momentum}
    if event.tau_max is not None:
        meta["tau_max"] = event.tau_max
    if event.aggregators:
        meta["aggregators"] = list(event.aggregators)
    if event.shard is not None:
        sh = event.shard
        meta["shard"] = {"index": sh.index, "count": sh.count, "chunk": sh.chunk,
                         "digest": sh.digest, "model": _meta_specs(sh.model)}
    return meta


def _encode_model(event: Model) -> dict[str, Any]:
    meta: dict[str, Any] = {"req": event.req, "version": event.version}
    if event.streamed:
        meta["streamed"] = True
    return meta


def _encode_push(event: Push) -> dict[str, Any]:
    meta: dict[str, Any] = {"req": event.req, "base_version": event.base_version}
    for key in ("seq", "uid", "group", "fan_in", "index", "dst", "ticket", "after_seconds"):
        value = getattr(event, key)
        if value is not None:
            meta[key] = value
    if event.after is not None:
        meta["after"] = list(event.after)
    if event.members is not None:
        meta["members"] = [list(m) for m in event.members]
    if event.codecs is not None:
        meta["codecs"] = [list(c) for c in event.codecs]
    return meta


def _encode_push_result(event: PushResult) -> dict[str, Any]:
    meta: dict[str, Any] = {"req": event.req, "applied": event.applied, "version": event.version,
            "delay": event.delay}
    if event.reason is not None:
        meta["reason"] = event.reason
    if event.delays is not None:
        meta["delays"] = list(event.delays)
    if event.fan_in is not None:
        meta["fan_in"], meta["index"] = event.fan_in, event.index
    return meta


def _encode_error(event: Error) -> dict[str, Any]:
    meta: dict[str, Any] = {"code": event.code, "message": event.message}
    if event.req is not None:
        meta["req"] = event.req
    return meta


# The fields of the messages sent with every step, formatted directly:
# json.dumps costs more than the rest of a small push. None: the general path.


def _fast_hello(event: Hello) -> bytes:
    # The hello's fields end with a newline (JSON allows it), so that an HTTP
    # server dialled by mistake (a metrics port) takes the frame for a request
    # line and answers it (400), and the client can say what answered: without
    # one it waits for the line's end, and the client only times out.
    return json.dumps(_encode_hello(event), separators=(",", ":")).encode() + b"\n"


def _fast_push(event: Push) -> bytes | None:
    if event.uid is not None or event.members is not None or event.group is not None \
            or event.dst is not None or event.fan_in is not None or event.codecs is not None \
            or event.after is not None:
        return None
    if event.ticket is not None:  # a controlled push's
        if event.seq is not None:
            return None
        return b'{"req":%d,"base_version":%d,"ticket":%d}' % (
            event.req, event.base_version, event.ticket)
    if event.seq is not None:
        return b'{"req":%d,"base_version":%d,"seq":%d}' % (
            event.req, event.base_version, event.seq)
    return b'{"req":%d,"base_version":%d}' % (event.req, event.base_version)


def _fast_push_result(event: PushResult) -> bytes | None:
    if event.reason is not None or event.delays is not None or event.fan_in is not None:
        return None
    delay = b"null" if event.delay is None else b"%d" % event.delay
    applied = b"true" if event.applied else b"false"
    return b'{"req":%d,"applied":%s,"version":%d,"delay":%s}' % (
        event.req, applied, event.version, delay)


def _fast_directive(event: Directive) -> bytes | None:
    """A plain go straight to the server: what a controller sends most
    (up to 125 in one decision at 10,000 workers), and the generic JSON
    took about a fifth of carrying one out."""
    if (event.action != "go" or event.reason is not None or event.via is not None
            or event.group is not None or event.fan_in is not None or event.index is not None
            or event.upto is not None or event.codec is not None or event.pace is not None
            or event.pace_seconds is not None or event.position is None
            or event.planned_seconds is None or event.ticket is None
            or not math.isfinite(event.planned_seconds)):
        return None
    head = b'{"req":%d,"action":"go","position":%d,"planned_seconds":%s,"ticket":%d' % (
        event.req, event.position, float.__repr__(event.planned_seconds).encode(),
        event.ticket)
    if event.after is None:
        return head + b"}" if event.after_seconds is None else None
    if event.after_seconds is None or not math.isfinite(event.after_seconds):
        return None
    return head + b',"after":[%s],"after_seconds":%s}' % (
        b",".join(b"%d" % a for a in event.after),
        float.__repr__(event.after_seconds).encode())


def _fast_pull(event: Pull) -> bytes | None:
    return b'{"req":%d}' % event.req if event.uid is None else None


def _fast_model(event: Model) -> bytes | None:
    return None if event.streamed else b'{"req":%d,"version":%d}' % (event.req, event.version)


@dataclass(frozen=True)
class Codec:
    """One message type: its event class, how its JSON fields are checked and
    made into the event (`decode(meta, tensors)`), how an event's fields are
    written (`encode`), and, for the messages of every step, a direct
    formatting (`fast`, None when it does not apply to that event)."""

    msg_type: MsgType
    event: type
    decode: Callable[[Mapping[str, Any], dict[str, np.ndarray]], Any]
    encode: Callable[[Any], dict[str, Any]] = _fields
    fast: Callable[[Any], bytes | None] | None = None


CODECS: tuple[Codec, ...] = (
    Codec(MsgType.HELLO, Hello, _decode_hello, _encode_hello, _fast_hello),
    Codec(MsgType.CHALLENGE, Challenge, _decode_challenge, _encode_challenge),
    Codec(MsgType.AUTH, Auth, _decode_auth, _encode_auth),
    Codec(MsgType.WELCOME, Welcome, _decode_welcome, _encode_welcome),
    Codec(MsgType.PULL, Pull, _decode_pull, fast=_fast_pull),
    Codec(MsgType.PULL_CANCEL, PullCancel, _decode_pull_cancel),
    Codec(MsgType.MODEL, Model, _decode_model, _encode_model, _fast_model),
    Codec(MsgType.MODEL_END, ModelEnd, _decode_model_end),
    Codec(MsgType.PUSH, Push, _decode_push, _encode_push, _fast_push),
    Codec(MsgType.PUSH_RESULT, PushResult, _decode_push_result, _encode_push_result,
          _fast_push_result),
    Codec(MsgType.ERROR, Error, _decode_error, _encode_error),
    Codec(MsgType.TRANSFER_REQUEST, TransferRequest, _decode_transfer_request),
    Codec(MsgType.DIRECTIVE, Directive, _decode_directive, fast=_fast_directive),
    Codec(MsgType.TRANSFER_DONE, TransferDone, _decode_transfer_done),
    Codec(MsgType.TRANSFER_PROGRESS, TransferProgress, _decode_transfer_progress),
    Codec(MsgType.LANDED, Landed, _decode_landed),
    Codec(MsgType.STATUS_REQUEST, StatusRequest, _decode_status_request),
    Codec(MsgType.STATUS, Status, _decode_status),
    Codec(MsgType.SHARD_AT, ShardAt, _decode_shard_at),
    Codec(MsgType.FELL_BACK, FellBack, _decode_fell_back),
    Codec(MsgType.MOVED, Moved, _decode_moved),
    Codec(MsgType.REPLICA_DONE, ReplicaDone, _decode_replica_done),
    Codec(MsgType.PING, Ping, _decode_ping),
    Codec(MsgType.PONG, Pong, _decode_pong),
    Codec(MsgType.PROMOTE, Promote, _decode_promote),
    Codec(MsgType.RESYNC, Resync, _decode_resync),
    Codec(MsgType.FAILOVER, Failover, _decode_failover),
    Codec(MsgType.STATE_REQUEST, StateRequest, _decode_state_request),
    Codec(MsgType.REPLICA_JOIN, ReplicaJoin, _decode_replica_join),
    Codec(MsgType.REPLICA_AT, ReplicaAt, _decode_replica_at),
)
_BY_TYPE = {c.msg_type: c for c in CODECS}
_BY_EVENT = {c.event: c for c in CODECS}


def _decode(msg_type: MsgType, meta: Mapping[str, Any], tensors: dict[str, np.ndarray]) -> Event:
    decoded: Event = _BY_TYPE[msg_type].decode(meta, tensors)
    return decoded


@dataclass(frozen=True)
class InProgress:
    """A frame whose tensor data is still arriving (see Connection.receiving).
    `head` is its event, every field checked, with no tensors yet."""

    msg_type: MsgType
    head: Any  # Model | Push, tensors empty
    specs: tuple[TensorSpec, ...]
    data: memoryview  # the whole data block; bytes [0, received) have arrived
    received: int


class _State(enum.Enum):
    HEADER = 1
    META = 2
    DATA = 3
    BROKEN = 4
    TRAILER = 5
    RELEASED = 6


@dataclass
class _Frame:
    msg_type: MsgType
    meta_len: int
    data_len: int
    head: Any = None  # the frame's event, fields checked, tensors not yet attached
    specs: tuple[TensorSpec, ...] = ()
    offsets: list[int] = field(default_factory=list)
    data: memoryview | None = None  # the whole block (None when scattered)
    received: int = 0
    # Where the next received bytes go: `sink` holds block bytes
    # [sink_start, sink_end); the whole block, or one run of a `scatter`.
    scatter: Scatter | None = None
    run: int = 0
    sink: memoryview | None = None
    sink_start: int = 0
    sink_end: int = 0
    mac: FrameTag | None = None  # the frame's running tag, on a protected connection

    def hash_received(self, start: int, n: int) -> None:
        """Block bytes [start, start + n) arrived in the sink: into the MAC."""
        if self.mac is not None and n:
            assert self.sink is not None
            at = start - self.sink_start
            self.mac.update(self.sink[at:at + n])

    def next_run(self) -> None:
        """The sink is full: on to the scatter's next run, if any."""
        if self.scatter is not None and self.run + 1 < len(self.scatter.runs):
            self.run += 1
            self.sink = self.scatter.runs[self.run]
            self.sink_start, self.sink_end = self.sink_end, self.sink_end + len(self.sink)


class Connection:
    """One side of an mlfabric connection, as a pure state machine.

    Receiving: call `receive_data(bytes)` (copying path), or
    `get_buffer()` then `buffer_updated(n)` (zero-copy path), then call
    `next_event()` until it returns NEED_DATA. Tensors in an event are views
    into the buffer `allocate` returned; the receiver may reuse that buffer
    once it has finished with the event.

    Sending: `send(event)` returns the frame as a list of buffers (header and
    metadata in one bytes object, then each tensor's memory without a copy).
    """

    def __init__(
        self,
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        allocate: Allocate = default_allocate,
    ) -> None:
        self.max_frame_size = max_frame_size
        self._allocate = allocate
        # For a MODEL frame: where its data block goes, by its fields (a
        # `Scatter`, or None for a buffer of its own). Set by a receiver that
        # knows, from the request it answers, where the model belongs.
        self.scatter_for: Callable[[Any], Scatter | None] | None = None
        self._scratch = bytearray(_SCRATCH_SIZE)
        self._start = 0  # first unparsed byte in scratch
        self._end = 0  # end of received bytes in scratch
        self._state = _State.HEADER
        self._frame: _Frame | None = None
        self.bytes_received = 0
        self.bytes_sent = 0
        # Integrity (`protect`): per-direction keys and frame sequence numbers.
        self._send_key: FrameKey | None = None
        self._recv_key: FrameKey | None = None
        self._send_seq = 0
        self._recv_seq = 0
        self._plain_error_ok = False
        self._stream_mac: Any = None  # a streamed frame's MAC, while its block is sent

    def protect(self, send_key: bytes, recv_key: bytes, *, plain_error: bool = False) -> None:
        """From now on every frame sent carries a MAC under `send_key` and
        every frame received must carry one under `recv_key`, each numbered
        from 0. `plain_error`: the first frame received may still be a plain
        ERROR (a listener refusing the proof that was just sent, before it
        could turn protection on)."""
        self._send_key, self._recv_key = FrameKey(send_key), FrameKey(recv_key)
        self._send_seq = self._recv_seq = 0
        self._plain_error_ok = plain_error

    @property
    def trailer_size(self) -> int:
        """Bytes each frame sent carries after its data block."""
        return MAC_SIZE if self._send_key is not None else 0

    def _mac(self, sending: bool, seq: int) -> FrameTag:
        key = self._send_key if sending else self._recv_key
        assert key is not None
        return key.tag(seq)

    # -- receiving ----------------------------------------------------------

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next received bytes should be written."""
        frame = self._frame
        if self._into_frame():
            assert frame is not None and frame.sink is not None
            return frame.sink[frame.received - frame.sink_start:]
        self._check_open()
        if self._end == len(self._scratch):
            self._compact()
        return memoryview(self._scratch)[self._end:]

    def _check_open(self) -> None:
        if self._state is _State.BROKEN:
            raise ProtocolError("connection is broken by an earlier protocol error")
        if self._state is _State.RELEASED:
            raise ProtocolError("connection is over: its receiving side was released")

    def release(self) -> None:
        """The connection is over: drop the receive buffer, the frame being
        received (with the buffer `allocate` gave it) and the callbacks.
        The owner of a connection often passes its own methods as `allocate`
        or `scatter_for`: a reference cycle, which only Python's cyclic GC
        frees, and in a process with many long-lived objects its full
        collections are rare. Until one ran, a listener kept what each
        closed connection held: 16 clients that left mid-push of a 16 MiB
        model left 150 MiB in the server (issue 33). Sending still works
        (a caller may finish a frame it began); receiving is a ProtocolError."""
        self._allocate = default_allocate
        self.scatter_for = None
        self._scratch = bytearray()
        self._start = self._end = 0
        self._frame = None
        self._state = _State.RELEASED

    def buffer_updated(self, nbytes: int) -> None:
        self.bytes_received += nbytes
        frame = self._frame
        if self._into_frame():
            assert frame is not None
            frame.hash_received(frame.received, nbytes)
            frame.received += nbytes
            if frame.received == frame.sink_end:
                frame.next_run()
        else:
            self._end += nbytes

    def _into_frame(self) -> bool:
        """Received bytes go straight into the arriving frame's data block:
        nothing is buffered before them and the block is not full yet (bytes
        after a full block belong to the next frame)."""
        frame = self._frame
        return (self._state is _State.DATA and self._end == self._start
                and frame is not None and frame.received < frame.data_len)

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Copying path: feed received bytes. Events come from next_event()."""
        view = memoryview(data).cast("B")
        while view:
            # Keep every byte: if the parser has not consumed the scratch
            # buffer yet, grow it instead of overrunning.
            buf = self.get_buffer(len(view))
            if len(buf) == 0:
                del buf
                self._grow(self._end - self._start + len(view))
                continue
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            del buf
            self.buffer_updated(n)
            view = view[n:]

    def receiving(self) -> InProgress | None:
        """The frame whose data is arriving now, if any: lets a receiver start
        working on the first bytes of a large frame before the last arrive.
        Its fields are checked (`head`): a frame whose fields are wrong is
        refused when they arrive, before its data."""
        frame = self._frame
        if self._state is not _State.DATA or frame is None or frame.data is None:
            return None
        return InProgress(frame.msg_type, frame.head, frame.specs, frame.data, frame.received)

    def next_event(self) -> Event | _NeedData:
        """The next complete event, or NEED_DATA. Raises ProtocolError
        (or FrameTooLarge) on a malformed frame; the connection is then broken."""
        try:
            return self._next_event()
        except ProtocolError:
            self._state = _State.BROKEN
            raise

    def _next_event(self) -> Event | _NeedData:
        while True:
            self._check_open()
            if self._state is _State.HEADER:
                if self._end - self._start < HEADER.size:
                    return NEED_DATA
                self._frame = self._parse_header()
                self._state = _State.META
            frame = self._frame
            assert frame is not None
            if self._state is _State.META:
                if self._end - self._start < frame.meta_len:
                    if frame.meta_len > len(self._scratch) - self._start:
                        self._grow(frame.meta_len)
                    return NEED_DATA
                self._parse_meta(frame)
                self._state = _State.DATA
                if frame.data_len:
                    self._sink(frame)
            if self._state is _State.DATA:
                while frame.received < frame.data_len and self._end > self._start:
                    n = min(frame.sink_end - frame.received, self._end - self._start)
                    assert frame.sink is not None
                    at = frame.received - frame.sink_start
                    frame.sink[at:at + n] = self._scratch[self._start:self._start + n]
                    frame.hash_received(frame.received, n)
                    frame.received += n
                    self._start += n
                    if frame.received == frame.sink_end:
                        frame.next_run()
                if self._start == self._end:
                    self._start = self._end = 0
                if frame.received < frame.data_len:
                    return NEED_DATA
                self._state = _State.TRAILER
            if self._state is _State.TRAILER:
                if frame.mac is not None:
                    if self._end - self._start < MAC_SIZE:
                        return NEED_DATA
                    self._check_mac(frame)
                self._state = _State.HEADER
                self._frame = None
                return self._finish(frame)

    def _sink(self, frame: _Frame) -> None:
        """Where the frame's data block goes: the receiver's scatter for it
        if it lists the tensors the scatter expects, else a new buffer."""
        scatter = (self.scatter_for(frame.head)
                   if self.scatter_for is not None and frame.msg_type is MsgType.MODEL
                   else None)
        if scatter is not None and scatter.specs == frame.specs:
            frame.scatter = scatter
            frame.sink = scatter.runs[0]
            frame.sink_end = len(frame.sink)
            return
        buf = self._allocate(frame.msg_type, frame.data_len)
        frame.data = memoryview(buf).cast("B")[: frame.data_len]
        if len(frame.data) < frame.data_len:
            raise ProtocolError("allocator returned a buffer that is too small")
        frame.sink, frame.sink_end = frame.data, frame.data_len

    def _grow(self, size: int) -> None:
        """Compact the scratch buffer into a new one of at least `size` bytes.

        A new bytearray rather than an in-place resize: a transport may still
        hold a memoryview of the old one."""
        remaining = self._end - self._start
        new = bytearray(max(size, 2 * len(self._scratch)))
        new[:remaining] = self._scratch[self._start:self._end]
        self._scratch, self._start, self._end = new, 0, remaining

    def _compact(self) -> None:
        if self._start:
            remaining = self._end - self._start
            self._scratch[:remaining] = self._scratch[self._start:self._end]
            self._start, self._end = 0, remaining

    def _parse_header(self) -> _Frame:
        magic, version, type_code, flags, meta_len, data_len = HEADER.unpack_from(
            self._scratch, self._start
        )
        if magic != MAGIC:
            raise NotMlfabric(
                f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r}): the peer is not "
                f"an mlfabric process, or the stream is out of sync",
                bytes(self._scratch[self._start:min(self._end, self._start + 64)]))
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"peer speaks protocol version {version}, this side speaks "
                f"{PROTOCOL_VERSION}: install the same mlfabric version on both sides"
            )
        try:
            msg_type = MsgType(type_code)
        except ValueError:
            raise ProtocolError(f"unknown message type {type_code}") from None
        mac = None
        protected = self._recv_key is not None
        if carries_mac(flags, protected=protected, what=msg_type.name,
                       plain_error=(msg_type is MsgType.ERROR and self._plain_error_ok
                                    and self._recv_seq == 0)):
            mac = self._mac(False, self._recv_seq)
            mac.update(memoryview(self._scratch)[self._start:self._start + HEADER.size])
            self._recv_seq += 1
        if protected:
            self._plain_error_ok = False
        if meta_len > MAX_META_LEN:
            raise ProtocolError(f"metadata block of {meta_len} bytes exceeds {MAX_META_LEN}")
        size = HEADER.size + meta_len + data_len
        if size > self.max_frame_size:
            raise FrameTooLarge(
                f"frame of {size} bytes exceeds the maximum frame size of "
                f"{self.max_frame_size} bytes"
            )
        if msg_type not in (MsgType.MODEL, MsgType.PUSH) and data_len:
            raise ProtocolError(f"{msg_type.name} frame carries {data_len} data bytes")
        self._start += HEADER.size
        return _Frame(msg_type, meta_len, data_len, mac=mac)

    def _check_mac(self, frame: _Frame) -> None:
        got = bytes(self._scratch[self._start:self._start + MAC_SIZE])
        self._start += MAC_SIZE
        if self._start == self._end:
            self._start = self._end = 0
        assert frame.mac is not None
        if not matches(frame.mac.finalize(), got):
            raise IntegrityError(
                f"a {frame.msg_type.name} frame failed its integrity check (frame "
                f"{self._recv_seq - 1} of the connection): altered, injected, replayed or "
                f"reordered in transit; the connection is closed")

    def _parse_meta(self, frame: _Frame) -> None:
        raw = bytes(self._scratch[self._start:self._start + frame.meta_len])
        if frame.mac is not None:
            frame.mac.update(raw)
        self._start += frame.meta_len
        if self._start == self._end:
            self._start = self._end = 0
        name = frame.msg_type.name
        if frame.msg_type in (MsgType.MODEL, MsgType.PUSH):
            fields, sep, specs_raw = raw.partition(b"\n")
            if not sep:
                raise ProtocolError(f"{name} metadata lacks its tensor list")
            frame.specs, frame.offsets, total = _decode_specs(
                specs_raw, parts=frame.msg_type is MsgType.PUSH)
            if total != frame.data_len:
                raise ProtocolError(
                    f"{name} lists tensors of {total} bytes but carries {frame.data_len}"
                )
            raw = fields
        try:
            meta = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise ProtocolError(f"{name} metadata is not valid JSON") from None
        if not isinstance(meta, dict):
            raise ProtocolError(f"{name} metadata is not a JSON object")
        # Every field checked now, so nothing outside the codec reads raw JSON,
        # not even for a frame whose data is still arriving.
        frame.head = _decode(frame.msg_type, meta, {})
        if isinstance(frame.head, Push):
            check_parts(frame.head.codecs, frame.specs)

    def _finish(self, frame: _Frame) -> Event:
        if frame.msg_type not in (MsgType.MODEL, MsgType.PUSH):
            return frame.head
        if frame.msg_type is MsgType.PUSH:
            # Views are made only if someone asks for them: a server whose
            # store has this layout applies the data block as it is.
            return dataclasses.replace(
                frame.head, tensors=FrameTensors(frame.specs, frame.offsets, frame.data))
        if frame.scatter is not None:
            return dataclasses.replace(frame.head, tensors=frame.scatter.tensors)
        return dataclasses.replace(frame.head,
                                   tensors=_tensor_views(frame.specs, frame.offsets, frame.data))

    # -- sending ------------------------------------------------------------

    def send(self, event: Event) -> list[Any]:
        """The frame for `event` as buffers to write in order (tensors not
        copied); the data block of `LaidOutTensors` is one `ScatteredBlock`,
        the last part."""
        codec = _BY_EVENT.get(type(event))
        if codec is None:
            raise TypeError(f"not an mlfabric event: {event!r:.80}")
        msg_type = codec.msg_type
        meta_bytes = codec.fast(event) if codec.fast is not None else None
        if meta_bytes is None:
            meta_bytes = json.dumps(codec.encode(event), separators=(",", ":")).encode()
        specs: Sequence[TensorSpec] = ()
        arrays: list[np.ndarray] = []
        if isinstance(event, (Model, Push)) and isinstance(event.tensors, FrameTensors):
            return self._send_block(msg_type, meta_bytes, event.tensors)
        if isinstance(event, (Model, Push)) and isinstance(event.tensors, LaidOutTensors):
            return self._send_scattered(msg_type, meta_bytes, event.tensors)
        if isinstance(event, (Model, Push)):
            names = list(event.tensors)
            arrays = [np.asarray(event.tensors[n]) for n in names]
            part = isinstance(event, Push) and event.codecs is not None
            specs = [spec_of(n, a, part) for n, a in zip(names, arrays, strict=True)]
        if msg_type in (MsgType.MODEL, MsgType.PUSH):
            specs_bytes, offsets, data_len = _encode_specs_by_value(tuple(specs))
            meta_bytes += b"\n" + specs_bytes
        else:
            offsets, data_len = [], 0
        parts: list[bytes | memoryview] = [self._head(msg_type, meta_bytes, data_len)]
        pos = 0
        for off, spec, arr in zip(offsets, specs, arrays, strict=True):
            if off > pos:
                parts.append(bytes(off - pos))
            if spec.nbytes:
                parts.append(np.ascontiguousarray(arr).data.cast("B"))
            pos = off + spec.nbytes
        if pos < data_len:  # (the last tensor is aligned too: zero padding)
            parts.append(bytes(data_len - pos))
        self.bytes_sent += len(parts[0]) + data_len + self.trailer_size
        return self._sealed(parts)

    def _head(self, msg_type: MsgType, meta_bytes: bytes, data_len: int) -> bytes:
        flags = FLAG_MAC if self._send_key is not None else 0
        return (HEADER.pack(MAGIC, PROTOCOL_VERSION, msg_type, flags, len(meta_bytes), data_len)
                + meta_bytes)

    def _sealed(self, parts: list[Any]) -> list[Any]:
        """`parts` with the frame's MAC after them, on a protected connection."""
        if self._send_key is None:
            return parts
        mac = self._mac(True, self._send_seq)
        self._send_seq += 1
        for part in parts:
            if isinstance(part, ScatteredBlock):
                for piece in part.pieces():
                    mac.update(piece)
                part.trailer = mac.finalize()
                return parts
            mac.update(part)
        return [*parts, mac.finalize()]

    def _send_block(self, msg_type: MsgType, meta_bytes: bytes, tensors: FrameTensors
                    ) -> list[bytes | memoryview]:
        """A frame whose data block is already laid out (a received push
        forwarded, or tensors gathered into one buffer): two parts."""
        specs_bytes, _, data_len = _encode_specs(tensors.specs)
        meta_bytes += b"\n" + specs_bytes
        block = memoryview(tensors.data if tensors.data is not None else b"").cast("B")
        if len(block) != data_len:
            raise ValueError(f"a laid-out data block of {len(block)} bytes for tensors of "
                             f"{data_len}")
        self.bytes_sent += HEADER.size + len(meta_bytes) + data_len + self.trailer_size
        head = self._head(msg_type, meta_bytes, data_len)
        return self._sealed([head, block] if data_len else [head])

    def _send_scattered(self, msg_type: MsgType, meta_bytes: bytes, tensors: LaidOutTensors
                        ) -> list[Any]:
        """A frame whose data block goes straight from the update's arrays:
        its head, and the block as one `ScatteredBlock` part."""
        specs_bytes, _, data_len = _encode_specs(tensors.specs)
        meta_bytes += b"\n" + specs_bytes
        if tensors.plan.total != data_len:
            raise ValueError(f"a block plan of {tensors.plan.total} bytes for tensors of "
                             f"{data_len}")
        self.bytes_sent += HEADER.size + len(meta_bytes) + data_len + self.trailer_size
        head = self._head(msg_type, meta_bytes, data_len)
        return self._sealed([head, tensors.block()] if data_len else [head])

    def send_head(self, event: Model | Push) -> bytes:
        """The head of `event`'s frame (header and fields) alone: its data
        block follows as a `streamed.StreamedBlock` over the same tensors,
        each piece passed through `stream_data` as it is written, then
        `stream_trailer()`."""
        key, self._send_key = self._send_key, None
        try:
            head = self.send(event)[0]  # plain: its MAC runs on over the block
        finally:
            self._send_key = key
        assert isinstance(head, bytes)
        if key is not None:
            self.bytes_sent += MAC_SIZE
            head = head[:6] + FLAG_MAC.to_bytes(2, "little") + head[8:]
            self._stream_mac = self._mac(True, self._send_seq)
            self._send_seq += 1
            self._stream_mac.update(head)
        return head

    def stream_data(self, data: Any) -> None:
        """Bytes of the streamed frame's data block, as they are written."""
        if self._stream_mac is not None:
            self._stream_mac.update(data)

    def stream_trailer(self) -> bytes:
        """What follows the streamed frame's data block: its MAC on a
        protected connection, else nothing."""
        mac, self._stream_mac = self._stream_mac, None
        return b"" if mac is None else mac.finalize()

    def send_bytes(self, event: Event) -> bytes:
        """The frame for `event` as one bytes object (copies tensors)."""
        return b"".join(expand_parts(self.send(event)))
