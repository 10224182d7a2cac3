"""Compressed updates (issue 35): the codecs, without I/O.

A codec turns one float32 tensor of an update into the arrays that go on the
wire (`Encoded`), and back (`decode`). Each keeps error feedback: encoding
`x` with a residual `r` sends a compressed form of `x + r` and leaves in `r`
exactly what was not sent, so that

    decode(encode(x, r)) + r_after == x + r_before

element by element (bit for bit for the casts and the sparsifiers; to
float32 rounding for low rank, whose subtraction of P Q^T is not exact).
Decoding is the same bits on every machine (low rank's product too: a
fixed-order kernel, not BLAS), so a server and its replica apply the same
update. Over many
pushes nothing is lost: what was not sent goes with a later push.

The codecs:

- `none`: the tensor as it is (4 bytes per element);
- `fp16`, `bf16`: 16-bit floats (2 bytes per element), rounded to nearest
  even as numpy rounds; a value past the format's largest is clamped, and
  the rest stays in the residual;
- `topk:F`: the fraction F of the elements largest in magnitude, as sorted
  indices and their values (8 bytes per element sent);
- `randk:F`: F of the elements chosen at random (the same wire form: the
  indices are sent, not a seed, so sender and receiver need not share a
  random generator's algorithm across numpy versions);
- `lowrank:R`: PowerSGD's rank-R approximation of a tensor seen as a matrix
  (its first axis by the rest), one power iteration per push warm-started
  from the last (Vogels et al., NeurIPS'19). A tensor too small to gain
  (1-D, or R (m + n) >= m n) goes as it is.

`check` is the receiver's bound check: every array's dtype, shape and range,
indices strictly increasing and in range, values finite. A malformed
compressed tensor raises `InvalidUpdate` naming what was wrong, before
anything is decoded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..errors import ConfigError, InvalidUpdate
from ..kernels import all_finite
from ._kernels import bf16_to_float, ef_bf16, ef_half, half_to_float, lowrank_product

NAMES = ("none", "fp16", "bf16", "topk", "randk", "lowrank")
# Indices fit int32 below 2^31 elements; a larger tensor sends int64.
_INT32_MAX = (1 << 31) - 1


@dataclass(frozen=True)
class Encoded:
    """One tensor, compressed: `codec` (a name of NAMES), the tensor's `shape`,
    and the arrays that go on the wire (by codec: none {v}; fp16, bf16 {h}
    uint16 codes; topk, randk {i} indices, {v} float32 values; lowrank {p}
    m x R, {q} n x R, float32)."""

    codec: str
    shape: tuple[int, ...]
    arrays: Mapping[str, np.ndarray] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


class Codec(Protocol):
    """What the worker's client and the controller's cost model call."""

    name: str  # one of NAMES

    @property
    def spec(self) -> str:
        """The codec with its parameter, as `parse` reads it ("topk:0.01")."""

    def encode(self, x: np.ndarray, residual: np.ndarray, key: str = "") -> Encoded:
        """Send a compressed `x + residual`; leave the rest in `residual`.
        `x` and `residual`: float32, C-contiguous, of one shape; `key` names
        the tensor (low rank keeps its warm start by key)."""

    def encoded_bytes(self, shape: tuple[int, ...]) -> int:
        """The bytes `encode` puts on the wire for a tensor of `shape`."""


# What a worker with compression="adaptive" offers the controller, from the
# least compressed: half the bytes, a tenth of the elements, a hundredth.
ADAPTIVE_DEFAULT = ("fp16", "topk:0.1", "topk:0.01")


def parse_offer(spec: str) -> tuple[Codec, ...] | None:
    """The codecs `compression="adaptive[:A,B,...]"` offers the controller,
    from the least compressed (None: `spec` is one fixed codec)."""
    name, _, arg = spec.strip().partition(":")
    if name != "adaptive":
        return None
    codecs = tuple(parse(s) for s in (arg.split(",") if arg else ADAPTIVE_DEFAULT))
    if any(c.name == "none" for c in codecs) or len({c.spec for c in codecs}) != len(codecs):
        raise ConfigError(f"compression {spec!r}: list each compressed form once, without "
                          f"none (the update whole is always an option)")
    return codecs


def parse(spec: str) -> Codec:
    """A codec from its name: none, fp16, bf16, topk:F, randk:F, lowrank:R."""
    name, _, arg = spec.strip().partition(":")
    if name in ("none", "fp16", "bf16"):
        if arg:
            raise ConfigError(f"compression {spec!r}: {name} takes no parameter")
        return Dense() if name == "none" else Cast16(name)
    if name in ("topk", "randk"):
        try:
            fraction = float(arg)
        except ValueError:
            fraction = math.nan
        if not 0.0 < fraction <= 1.0:
            raise ConfigError(f"compression {spec!r}: {name} needs the fraction of elements "
                              f"to send, in (0, 1], e.g. {name}:0.01")
        return TopK(fraction) if name == "topk" else RandK(fraction)
    if name == "lowrank":
        if not arg.isdigit() or not 1 <= int(arg) <= 1024:
            raise ConfigError(f"compression {spec!r}: lowrank needs a rank 1..1024, "
                              f"e.g. lowrank:4")
        return LowRank(int(arg))
    raise ConfigError(f"unknown compression {spec!r}: use one of none, fp16, bf16, topk:F, "
                      f"randk:F, lowrank:R, or adaptive (the controller chooses)")


def _flat(a: np.ndarray, what: str) -> np.ndarray:
    if a.dtype != np.float32 or not a.flags.c_contiguous:
        raise ValueError(f"{what} must be a C-contiguous float32 array, got {a.dtype} "
                         f"(contiguous: {a.flags.c_contiguous})")
    return a.reshape(-1)


def _pair(x: np.ndarray, residual: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if x.shape != residual.shape:
        raise ValueError(f"update {x.shape} and residual {residual.shape} differ in shape")
    return _flat(x, "an update"), _flat(residual, "a residual")


class Dense:
    name = "none"
    spec = "none"

    def encode(self, x: np.ndarray, residual: np.ndarray, key: str = "") -> Encoded:
        fx, fr = _pair(x, residual)
        v = fx + fr  # all of it goes
        fr[:] = 0.0
        return Encoded("none", x.shape, {"v": v})

    def encoded_bytes(self, shape: tuple[int, ...]) -> int:
        return 4 * math.prod(shape)


class Cast16:
    """fp16 or bf16, error feedback fused with the cast (`_kernels`)."""

    def __init__(self, name: str) -> None:
        if name not in ("fp16", "bf16"):
            raise ConfigError(f"no 16-bit format {name!r}: fp16 or bf16")
        self.name = name
        self._kernel = ef_half if name == "fp16" else ef_bf16

    @property
    def spec(self) -> str:
        return self.name

    def encode(self, x: np.ndarray, residual: np.ndarray, key: str = "") -> Encoded:
        fx, fr = _pair(x, residual)
        h = np.empty(len(fx), np.uint16)
        self._kernel(fx, fr, h)
        return Encoded(self.name, x.shape, {"h": h})

    def encoded_bytes(self, shape: tuple[int, ...]) -> int:
        return 2 * math.prod(shape)


def sent_count(fraction: float, n: int) -> int:
    """How many of n elements a sparsifier of `fraction` sends (at least one)."""
    return min(n, max(1, math.ceil(fraction * n))) if n else 0


def _index_dtype(n: int) -> type[np.integer]:
    return np.int32 if n <= _INT32_MAX else np.int64


class _Sparse:
    name = ""

    def __init__(self, fraction: float) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ConfigError(f"{self.name} needs a fraction in (0, 1], got {fraction}")
        self.fraction = fraction

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.fraction:g}"

    def _choose(self, acc: np.ndarray, k: int) -> np.ndarray:
        raise NotImplementedError

    def encode(self, x: np.ndarray, residual: np.ndarray, key: str = "") -> Encoded:
        fx, fr = _pair(x, residual)
        fr += fx  # the residual now holds x + r: what there is to send
        n = len(fr)
        k = sent_count(self.fraction, n)
        idx = np.sort(self._choose(fr, k)).astype(_index_dtype(n), copy=False)
        v = fr[idx]  # a copy (fancy indexing)
        fr[idx] = 0.0  # sent whole: exactly x + r - v there
        return Encoded(self.name, x.shape, {"i": idx, "v": v})

    def encoded_bytes(self, shape: tuple[int, ...]) -> int:
        n = math.prod(shape)
        return sent_count(self.fraction, n) * (4 + np.dtype(_index_dtype(n)).itemsize)


class TopK(_Sparse):
    name = "topk"

    def _choose(self, acc: np.ndarray, k: int) -> np.ndarray:
        if k == len(acc):
            return np.arange(k)
        return np.argpartition(np.abs(acc), len(acc) - k)[len(acc) - k:]


class RandK(_Sparse):
    name = "randk"

    def __init__(self, fraction: float, seed: int | None = None) -> None:
        super().__init__(fraction)
        self.rng = np.random.default_rng(seed)

    def _choose(self, acc: np.ndarray, k: int) -> np.ndarray:
        return self.rng.choice(len(acc), k, replace=False)


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The matrix low rank sees a tensor as: its first axis by the rest."""
    m = shape[0] if shape else 1
    return m, math.prod(shape) // m if m else 0


class LowRank:
    """PowerSGD: M ~ P Q^T with P (m x R) orthonormal, one power iteration
    per push from the last push's Q (kept per tensor `key`)."""

    name = "lowrank"

    def __init__(self, rank: int, seed: int = 0) -> None:
        if not 1 <= rank <= 1024:
            raise ConfigError(f"lowrank needs a rank 1..1024, got {rank}")
        self.rank = rank
        self.rng = np.random.default_rng(seed)
        self.q: dict[str, np.ndarray] = {}  # the warm start of each tensor

    @property
    def spec(self) -> str:
        return f"lowrank:{self.rank}"

    def worth(self, shape: tuple[int, ...]) -> bool:
        m, n = matrix_shape(shape)
        return len(shape) >= 2 and self.rank * (m + n) < m * n

    def encode(self, x: np.ndarray, residual: np.ndarray, key: str = "") -> Encoded:
        if not self.worth(x.shape):
            return Dense().encode(x, residual)
        fx, fr = _pair(x, residual)
        fr += fx
        m, n = matrix_shape(x.shape)
        acc = fr.reshape(m, n)
        q = self.q.get(key)
        if q is None or q.shape != (n, self.rank):
            q = self.rng.standard_normal((n, self.rank)).astype(np.float32)
        p = acc @ q
        p, _ = np.linalg.qr(p)  # orthonormal columns: P P^T projects
        p = np.ascontiguousarray(p, np.float32)
        q = np.ascontiguousarray(acc.T @ p, np.float32)
        # What the approximation missed stays: the product as every receiver
        # computes it (`decode`), bit for bit.
        approx = np.empty((m, n), np.float32)
        lowrank_product(p, q, approx)
        acc -= approx
        self.q[key] = q
        return Encoded("lowrank", x.shape, {"p": p, "q": q})

    def encoded_bytes(self, shape: tuple[int, ...]) -> int:
        if not self.worth(shape):
            return 4 * math.prod(shape)
        m, n = matrix_shape(shape)
        return 4 * self.rank * (m + n)


# -- the receiver's side ---------------------------------------------------------------


def _want(e: Encoded, name: str, dtype: np.dtype | tuple[np.dtype, ...],
          shape: tuple[int, ...] | None, what: str) -> np.ndarray:
    a = e.arrays.get(name)
    if a is None:
        raise InvalidUpdate(f"{what}: a {e.codec} tensor needs its array {name!r}; it has "
                            f"{sorted(e.arrays)}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if a.dtype not in dtypes:
        raise InvalidUpdate(f"{what}: array {name!r} of a {e.codec} tensor must be "
                            f"{' or '.join(str(d) for d in dtypes)}, got {a.dtype}")
    if shape is not None and a.shape != shape:
        raise InvalidUpdate(f"{what}: array {name!r} of a {e.codec} tensor must have shape "
                            f"{shape}, got {a.shape}")
    return a


def _finite(a: np.ndarray, name: str, e: Encoded, what: str) -> None:
    if a.dtype == np.uint16:  # 16-bit codes: all exponent bits set is inf or NaN
        mask = 0x7C00 if e.codec == "fp16" else 0x7F80
        bad = int(np.count_nonzero((a & mask) == mask))
    else:
        bad = 0 if all_finite(a) else int(np.count_nonzero(~np.isfinite(a)))
    if bad:
        raise InvalidUpdate(f"{what}: array {name!r} of a {e.codec} tensor holds {bad} "
                            f"non-finite value(s)", "nonfinite")


def check(e: Encoded, shape: tuple[int, ...], what: str = "compressed tensor") -> None:
    """Raise InvalidUpdate unless `e` is a well-formed compressed tensor of
    `shape`: what a receiver runs before `decode` (nothing a peer sends is
    trusted unchecked)."""
    if e.codec not in NAMES:
        raise InvalidUpdate(f"{what}: unknown compression {e.codec!r} (known: "
                            f"{', '.join(NAMES)})")
    if tuple(e.shape) != tuple(shape):
        raise InvalidUpdate(f"{what}: compressed as shape {tuple(e.shape)}, the tensor is "
                            f"{tuple(shape)}", "bad_shape")
    extra = set(e.arrays) - {"none": {"v"}, "fp16": {"h"}, "bf16": {"h"}, "topk": {"i", "v"},
                             "randk": {"i", "v"}, "lowrank": {"p", "q"}}[e.codec]
    if extra:
        raise InvalidUpdate(f"{what}: a {e.codec} tensor has no array {sorted(extra)[0]!r}")
    n = math.prod(shape)
    f4 = np.dtype(np.float32)
    if e.codec == "none":
        _finite(_want(e, "v", f4, (n,), what), "v", e, what)
    elif e.codec in ("fp16", "bf16"):
        _finite(_want(e, "h", np.dtype(np.uint16), (n,), what), "h", e, what)
    elif e.codec in ("topk", "randk"):
        i = _want(e, "i", (np.dtype(np.int32), np.dtype(np.int64)), None, what)
        if i.ndim != 1 or len(i) > n:
            raise InvalidUpdate(f"{what}: {e.codec} sends at most the tensor's {n} elements "
                                f"as a 1-D index array, got shape {i.shape}")
        v = _want(e, "v", f4, i.shape, what)
        if len(i) and (int(i[0]) < 0 or int(i[-1]) >= n):
            raise InvalidUpdate(f"{what}: {e.codec} index out of range 0..{n - 1}: first "
                                f"{int(i[0])}, last {int(i[-1])}")
        if len(i) > 1 and not bool(np.all(i[1:] > i[:-1])):
            raise InvalidUpdate(f"{what}: {e.codec} indices must be strictly increasing "
                                f"(each element sent once)")
        _finite(v, "v", e, what)
    else:  # lowrank
        if len(shape) < 2:
            raise InvalidUpdate(f"{what}: lowrank is for tensors of 2 or more axes; this one "
                                f"has shape {tuple(shape)}", "bad_shape")
        m, cols = matrix_shape(tuple(shape))
        p = _want(e, "p", f4, None, what)
        if p.ndim != 2 or p.shape[0] != m or not 1 <= p.shape[1] <= min(m, cols, 1024):
            raise InvalidUpdate(f"{what}: lowrank's P must be {m} x R with 1 <= R <= "
                                f"{min(m, cols, 1024)}, got shape {p.shape}", "bad_shape")
        q = _want(e, "q", f4, (cols, p.shape[1]), what)
        _finite(p, "p", e, what)
        _finite(q, "q", e, what)


def decode(e: Encoded, out: np.ndarray | None = None) -> np.ndarray:
    """The float32 tensor `e` stands for (into `out`, float32 of e.shape, if
    given). Run `check` first on anything a peer sent."""
    if out is None:
        out = np.empty(e.shape, np.float32)
    flat = _flat(out, "the output")
    a = e.arrays
    if e.codec == "none":
        flat[:] = a["v"]
    elif e.codec == "fp16":
        half_to_float(a["h"], flat)
    elif e.codec == "bf16":
        bf16_to_float(a["h"], flat)
    elif e.codec in ("topk", "randk"):
        flat[:] = 0.0
        flat[a["i"]] = a["v"]
    elif e.codec == "lowrank":
        m, n = matrix_shape(e.shape)
        lowrank_product(np.ascontiguousarray(a["p"]), np.ascontiguousarray(a["q"]),
                        flat.reshape(m, n))
    else:
        raise InvalidUpdate(f"unknown compression {e.codec!r}")
    return out
