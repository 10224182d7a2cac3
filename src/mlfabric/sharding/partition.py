"""Which bytes of the model each of S server shards keeps, without I/O.

The partition is a pure function of the model's tensor names, dtypes and
shapes, S and the chunk size, so every client and every shard computes the
same one, and `Partition.digest` names it: two processes that disagree
(another init file, another S or chunk size) see different digests, and the
handshake can refuse the pair instead of mixing them.

How (as BytePS does, in whole elements rather than bytes):

1. Tensors are taken in name order: the order a dict holds them in does not
   matter.
2. Each tensor is cut into pieces of at most the chunk size, of nearly equal
   length (a 9 MB tensor with 4 MB chunks is three pieces of 3 MB, not
   4 + 4 + 1). Small tensors stay whole; several go to one shard, packed
   into its frames.
3. Pieces go, largest first, each to the shard holding the fewest bytes so
   far (ties: the lower shard). Every shard then holds within one piece of
   every other. So the chunk used is at most a twentieth of a shard's mean
   share: shards hold within 5% of the mean, even when one 64 MB embedding
   dwarfs a hundred small tensors. It is never below `MIN_CHUNK_BYTES` (a
   piece costs a little on every transfer): a model too small for that is
   balanced within one such piece instead.

With S = 1 nothing is cut: the one shard keeps every tensor whole, as a
single server does.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError

DEFAULT_CHUNK_BYTES = 4 << 20  # BytePS's partition size
MIN_CHUNK_BYTES = 64 << 10
BALANCE_SHARE = 20  # pieces per shard's mean share, at least: within 5%

Spec = tuple[str, np.dtype, tuple[int, ...]]


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of tensor `tensor`'s flat (C-order) view."""

    tensor: str
    start: int
    stop: int
    nbytes: int

    @property
    def key(self) -> str:
        """The piece's name on the wire and in a shard's store."""
        return f"{self.tensor}@{self.start}"


@dataclass(frozen=True)
class Partition:
    """The model over `shards` shards: `pieces[i]` is what shard i keeps."""

    shards: int
    chunk_bytes: int  # the chunk size actually used (see the module docstring)
    specs: tuple[Spec, ...]  # the model, in name order
    pieces: tuple[tuple[Piece, ...], ...]
    digest: str

    def bytes_per_shard(self) -> list[int]:
        return [sum(p.nbytes for p in shard) for shard in self.pieces]

    def split(self, tensors: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        """Each shard's part of a model or an update: flat views, not copies
        (of C-contiguous arrays). Raises ConfigError if a tensor is missing or
        has another shape or dtype."""
        flat = {}
        for name, dtype, shape in self.specs:
            if name not in tensors:
                raise ConfigError(f"tensor {name!r} of the partitioned model is missing")
            a = np.asarray(tensors[name])
            if a.shape != shape or a.dtype != dtype:
                raise ConfigError(f"tensor {name!r} is {a.dtype}{list(a.shape)}, the "
                                  f"partition was made for {dtype}{list(shape)}")
            flat[name] = a.reshape(-1)
        return [{p.key: flat[p.tensor][p.start:p.stop] for p in shard} for shard in self.pieces]

    def join(self, parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The whole model from every shard's part (new arrays)."""
        if len(parts) != self.shards:
            raise ConfigError(f"{len(parts)} parts for a partition over {self.shards} shards")
        out = {name: np.empty(shape, dtype) for name, dtype, shape in self.specs}
        for shard, part in enumerate(parts):
            self.put(out, shard, part)
        return out

    def put(self, model: Mapping[str, np.ndarray], shard: int,
            part: Mapping[str, np.ndarray]) -> None:
        """Copy shard `shard`'s part into the whole `model`'s (C-contiguous) arrays."""
        for p in self.pieces[shard]:
            model[p.tensor].reshape(-1)[p.start:p.stop] = np.asarray(part[p.key]).reshape(-1)


def partition(specs: Sequence[Spec], shards: int,
              chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Partition:
    """The partition of the model `specs` ((name, dtype, shape) each) over
    `shards` shards, with pieces of at most `chunk_bytes`."""
    if not isinstance(shards, int) or shards < 1:
        raise ConfigError(f"the number of shards must be a positive integer, got {shards!r}")
    if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ConfigError(f"the chunk size must be a positive number of bytes, got "
                          f"{chunk_bytes!r}")
    model = tuple(sorted((str(n), np.dtype(d), tuple(int(x) for x in s)) for n, d, s in specs))
    if not model:
        raise ConfigError("cannot partition a model without tensors")
    names = [n for n, _, _ in model]
    if len(set(names)) != len(names):
        raise ConfigError("tensor names must be unique to partition a model")
    odd = [n for n in names if "@" in n]
    if odd:  # a piece is named "tensor@start": such a name could collide
        raise ConfigError(f"tensor names may not contain '@' in a sharded model, got "
                          f"{odd[0]!r}: rename it")
    total = sum(math.prod(s) * d.itemsize for _, d, s in model)
    if shards == 1:
        chunk = max(chunk_bytes, total)  # one shard: nothing is cut
    else:
        chunk = max(min(chunk_bytes, total // (shards * BALANCE_SHARE)), MIN_CHUNK_BYTES)
    pieces = []
    for name, dtype, shape in model:
        count = math.prod(shape)
        per_chunk = max(1, chunk // dtype.itemsize)
        n = max(1, math.ceil(count / per_chunk))
        for k in range(n):  # n nearly equal runs of whole elements
            start, stop = count * k // n, count * (k + 1) // n
            pieces.append(Piece(name, start, stop, (stop - start) * dtype.itemsize))
    held = [0] * shards
    assigned: list[list[Piece]] = [[] for _ in range(shards)]
    for p in sorted(pieces, key=lambda p: (-p.nbytes, p.tensor, p.start)):
        i = min(range(shards), key=lambda j: (held[j], j))
        assigned[i].append(p)
        held[i] += p.nbytes
    described = {"shards": shards, "chunk": chunk,
                 "model": [[n, d.str, list(s)] for n, d, s in model]}
    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]
    return Partition(shards, chunk, model,
                     tuple(tuple(sorted(a, key=lambda p: (p.tensor, p.start))) for a in assigned),
                     digest)
