"""Durable checkpoints of a parameter server's model.

A checkpoint holds the tensors, the previous weights (the momentum history)
and the version, with a SHA-256 of the data, in one file:

    b"MLFBCKPT" | format u32 | header_len u32 | header (UTF-8 JSON) | data

The header names the job, version, momentum, the tensor list, the data length
and its checksum; the data is the weights then the previous weights, laid out
as in a wire frame (each tensor at a multiple of 64 bytes). Writing is atomic:
a temporary file in the same directory, fsync, rename, fsync of the directory;
a crash leaves the previous checkpoint intact. Reading refuses a truncated or
corrupted file with an error that says which and what to do.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import ConfigError
from .protocol import DTYPES, TensorSpec, layout

MAGIC = b"MLFBCKPT"
FORMAT = 1
_PREFIX = struct.Struct("<8sII")
_NAME = re.compile(r"^ckpt-(\d{12})\.mlfckpt$")


@dataclass(frozen=True)
class Checkpoint:
    job: str
    version: int
    momentum: float
    weights: dict[str, np.ndarray]
    previous: dict[str, np.ndarray]


def file_name(version: int) -> str:
    return f"ckpt-{version:012d}.mlfckpt"


def write(directory: str | os.PathLike[str], ckpt: Checkpoint) -> Path:
    """Write `ckpt` atomically into `directory`; return its path."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    names = list(ckpt.weights)
    specs = [TensorSpec(n, np.dtype("<f4"), ckpt.weights[n].shape) for n in names]
    offsets, block = layout(specs)
    digest = hashlib.sha256()
    header = {
        "job": ckpt.job,
        "version": ckpt.version,
        "momentum": ckpt.momentum,
        "tensors": [[s.name, "f4", list(s.shape)] for s in specs],
        "data_len": 2 * block,
    }
    path = d / file_name(ckpt.version)
    tmp = d / f".{path.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            # Checksum first (it goes in the header), then write the same bytes.
            for arrays in (ckpt.weights, ckpt.previous):
                for chunk in _chunks(arrays, names, offsets, block):
                    digest.update(chunk)
            header["sha256"] = digest.hexdigest()
            head = json.dumps(header, separators=(",", ":")).encode()
            f.write(_PREFIX.pack(MAGIC, FORMAT, len(head)) + head)
            for arrays in (ckpt.weights, ckpt.previous):
                for chunk in _chunks(arrays, names, offsets, block):
                    f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def _chunks(arrays: Mapping[str, np.ndarray], names: list[str], offsets: list[int],
            block: int) -> list[bytes | memoryview]:
    out: list[bytes | memoryview] = []
    pos = 0
    for name, off in zip(names, offsets, strict=True):
        if off > pos:
            out.append(bytes(off - pos))
        arr = np.asarray(arrays[name], dtype=np.float32, order="C")
        out.append(arr.reshape(-1).data.cast("B"))
        pos = off + arr.nbytes
    if block > pos:
        out.append(bytes(block - pos))
    return out


def read(path: str | os.PathLike[str]) -> Checkpoint:
    """Load a checkpoint, refusing a truncated or corrupted one."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"checkpoint {str(p)!r} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read checkpoint {str(p)!r}: {exc.strerror}") from None
    if len(raw) < _PREFIX.size or raw[:8] != MAGIC:
        raise ConfigError(f"{str(p)!r} is not an mlfabric checkpoint (bad magic)")
    _, fmt, head_len = _PREFIX.unpack_from(raw)
    if fmt != FORMAT:
        raise ConfigError(
            f"checkpoint {str(p)!r} has format {fmt}; this mlfabric reads format {FORMAT}"
        )
    start = _PREFIX.size + head_len
    try:
        header = json.loads(raw[_PREFIX.size:start].decode())
        job, version, momentum = header["job"], header["version"], float(header["momentum"])
        specs = [TensorSpec(n, DTYPES[c], tuple(s)) for n, c, s in header["tensors"]]
        data_len, checksum = header["data_len"], header["sha256"]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise ConfigError(
            f"checkpoint {str(p)!r} has a damaged header: use an older checkpoint"
        ) from None
    data = memoryview(raw)[start:]
    if len(data) != data_len:
        raise ConfigError(
            f"checkpoint {str(p)!r} is truncated: {len(data)} of {data_len} data bytes; "
            f"use an older checkpoint"
        )
    if hashlib.sha256(data).hexdigest() != checksum:
        raise ConfigError(
            f"checkpoint {str(p)!r} is corrupted (checksum mismatch): use an older checkpoint"
        )
    offsets, block = layout(specs)
    weights: dict[str, np.ndarray] = {}
    previous: dict[str, np.ndarray] = {}
    for base, target in ((0, weights), (block, previous)):
        for spec, off in zip(specs, offsets, strict=True):
            count = spec.nbytes // 4
            target[spec.name] = np.frombuffer(
                data, np.float32, count=count, offset=base + off).reshape(spec.shape).copy()
    return Checkpoint(job, version, momentum, weights, previous)


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """The newest checkpoint file in `directory` by version, or None."""
    d = Path(directory)
    if not d.is_dir():
        return None
    found = sorted(p for p in d.iterdir() if _NAME.match(p.name))
    return found[-1] if found else None


def prune(directory: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete all but the `keep` newest checkpoints; return what was deleted."""
    d = Path(directory)
    found = sorted(p for p in d.iterdir() if _NAME.match(p.name))
    doomed = found[:-keep] if keep > 0 else found
    for p in doomed:
        p.unlink(missing_ok=True)
    return doomed
