"""What a client checks of a sharded job's servers before it uses them, without I/O.

Every shard's welcome says which shard it is (index and count), the chunk
size and the whole model it was cut from, and the digest of that partition
(`wire.protocol.ShardInfo`). The client recomputes the partition from that
and accepts the servers only if they all describe the same one, each sits at
its own position in the address list, and each keeps exactly the pieces the
partition gives it. Any mismatch (another --init, another S or chunk size,
addresses out of order) is one ConfigError naming the difference and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ConfigError
from ..sharding.partition import Partition, partition
from ..wire.protocol import ShardInfo, TensorSpec


def shard_info(part: Partition, index: int) -> ShardInfo:
    """What shard `index` of `part` says of itself in its welcome."""
    return ShardInfo(index=index, count=part.shards, chunk=part.chunk_bytes, digest=part.digest,
                     model=tuple(TensorSpec(n, d, s) for n, d, s in part.specs))


def piece_specs(part: Partition, index: int) -> tuple[TensorSpec, ...]:
    """The tensors shard `index` serves: its pieces, flat, in partition order."""
    specs = {n: d for n, d, _ in part.specs}
    return tuple(TensorSpec(p.key, specs[p.tensor], (p.stop - p.start,))
                 for p in part.pieces[index])


def split_addresses(address: str) -> list[str]:
    """"h0:7070,h1:7070" -> ["h0:7070", "h1:7070"], refusing empty entries."""
    parts = [a.strip() for a in address.split(",")]
    if any(not a for a in parts):
        raise ConfigError(f"server address list {address!r} has an empty entry: give "
                          f"HOST:PORT of every shard, in shard order, separated by commas")
    if len(set(parts)) != len(parts):
        twice = next(a for a in parts if parts.count(a) > 1)
        raise ConfigError(f"server address list {address!r} names {twice} twice: every "
                          f"shard has an address of its own")
    return parts


def _describe(spec: TensorSpec) -> str:
    return f"{spec.dtype.name}{list(spec.shape)}"


def _model_difference(a: ShardInfo, b: ShardInfo) -> str:
    mine = {s.name: s for s in a.model}
    theirs = {s.name: s for s in b.model}
    for name in sorted(mine.keys() | theirs.keys()):
        if name not in theirs:
            return f"tensor {name!r} is missing there"
        if name not in mine:
            return f"it has a tensor {name!r} this one lacks"
        if mine[name] != theirs[name]:
            return f"tensor {name!r} is {_describe(theirs[name])} there, " \
                   f"{_describe(mine[name])} here"
    return "the models differ"


def check_shards(addresses: Sequence[str], infos: Sequence[ShardInfo | None],
                 tensors: Sequence[tuple[TensorSpec, ...]]) -> Partition | None:
    """The partition the servers at `addresses` (in the order given) serve,
    from their welcomes (`infos`: each one's ShardInfo, `tensors`: the pieces
    it serves); None for one unsharded server. Raises ConfigError on any
    mismatch."""
    n = len(addresses)
    if n == 1 and (infos[0] is None or infos[0].count == 1):
        return None
    for address, info in zip(addresses, infos, strict=True):
        if info is None:
            raise ConfigError(
                f"{address} serves the whole model (started without --shard), but {n} "
                f"server addresses were given: start every shard with --shard I/{n}, or "
                f"give this one address alone")
        if info.count != n:
            if n == 1:
                raise ConfigError(
                    f"{address} is shard {info.index} of {info.count} (--shard "
                    f"{info.index}/{info.count}): give all {info.count} shard addresses, in "
                    f"shard order, separated by commas")
            raise ConfigError(
                f"{address} was started with --shard {info.index}/{info.count}, but {n} "
                f"shard addresses were given: start every shard with the same S and list "
                f"them all")
    known = [info for info in infos if info is not None]
    by_index = {info.index: a for a, info in zip(addresses, known, strict=True)}
    for position, (address, info) in enumerate(zip(addresses, known, strict=True)):
        if info.index != position:
            if len(by_index) == n:
                order = ",".join(by_index[i] for i in range(n))
                fix = f"list them in shard order: {order}"
            else:
                fix = "two servers were started with the same --shard index: give each its own"
            raise ConfigError(
                f"the server listed at position {position} ({address}) is shard "
                f"{info.index} of {n}: {fix}")
    first, first_address = known[0], addresses[0]
    for address, info in zip(addresses[1:], known[1:], strict=True):
        if info.model != first.model:
            raise ConfigError(
                f"{address} was started from another model than {first_address} "
                f"({_model_difference(first, info)}): start every shard with the same --init")
        if info.chunk != first.chunk or info.digest != first.digest:
            raise ConfigError(
                f"{address} cuts the model with {info.chunk}-byte pieces, {first_address} "
                f"with {first.chunk}: start every shard with the same --chunk-bytes")
    part = partition([(s.name, s.dtype, s.shape) for s in first.model], n, first.chunk)
    for index, (address, served) in enumerate(zip(addresses, tensors, strict=True)):
        if part.digest != first.digest or tuple(served) != piece_specs(part, index):
            raise ConfigError(
                f"{address} serves another cut of the model than this client computes "
                f"(partition {first.digest}, here {part.digest}): are the servers and this "
                f"client the same mlfabric version?")
    return part
