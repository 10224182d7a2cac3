"""Durable checkpoints of a parameter server's model.

A checkpoint holds the tensors, the previous weights (the momentum history),
the version and the run it belongs to, in one file (format 2):

    b"MLFBCKPT" | format u32 | header_len u32 | header (UTF-8 JSON) | data | sha256

The header names the job, the run, the version, the momentum, the tensor list
and the data length, and for a sharded server which shard of which partition
it keeps (`--resume` refuses a checkpoint of another partition); the data is
the weights then the previous weights, laid out as in a wire frame (each
tensor at a multiple of 64 bytes). The trailing SHA-256 covers everything
before it, header included: an edited version, momentum, shape, job or run
is refused like flipped data bits. (Format 1 checksummed the data alone; it
is still read, with a warning, so old runs resume.)

A run id names one training run: made when a server starts from --init,
kept when it resumes. Files are named `ckpt-VERSION-RUN.mlfckpt`, so two runs
in one folder never overwrite each other, and retention deletes only the
current run's older checkpoints, never the one just written (`prune`).
Writing is atomic: a temporary file in the same directory, fsync, rename,
fsync of the directory; a crash leaves the previous checkpoint intact.
Reading refuses a truncated or corrupted file with an error that says which
and what to do.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..wire.protocol import DTYPES, ShardInfo, TensorSpec, layout

log = logging.getLogger("mlfabric.checkpoint")

MAGIC = b"MLFBCKPT"
FORMAT = 2
_PREFIX = struct.Struct("<8sII")
_DIGEST = 32  # bytes of the trailing SHA-256 (format 2)
# ckpt-VERSION.mlfckpt (format 1, no run) or ckpt-VERSION-RUN.mlfckpt
_NAME = re.compile(r"^ckpt-(\d{12})(?:-([0-9a-f]{1,32}))?\.mlfckpt$")


@dataclass(frozen=True)
class Checkpoint:
    job: str
    version: int
    momentum: float
    weights: dict[str, np.ndarray]
    previous: dict[str, np.ndarray]
    run: str = ""  # the run it belongs to ("" for files written before runs had ids)
    shard: ShardInfo | None = None  # a sharded server's: which part of which partition


def new_run_id() -> str:
    return secrets.token_hex(6)


def file_name(version: int, run: str = "") -> str:
    return f"ckpt-{version:012d}-{run}.mlfckpt" if run else f"ckpt-{version:012d}.mlfckpt"


def parse_name(name: str) -> tuple[int, str] | None:
    """(version, run) of a checkpoint's file name, or None if it is not one."""
    m = _NAME.match(name)
    return None if m is None else (int(m.group(1)), m.group(2) or "")


def write(directory: str | os.PathLike[str], ckpt: Checkpoint) -> Path:
    """Write `ckpt` atomically into `directory`; return its path."""
    if not re.fullmatch(r"[0-9a-f]{0,32}", ckpt.run):
        raise ConfigError(f"a checkpoint's run id is up to 32 lowercase hex digits, got "
                          f"{ckpt.run!r}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    names = list(ckpt.weights)
    specs = [TensorSpec(n, np.dtype("<f4"), ckpt.weights[n].shape) for n in names]
    offsets, block = layout(specs)
    header = {
        "job": ckpt.job,
        "run": ckpt.run,
        "version": ckpt.version,
        "momentum": ckpt.momentum,
        "tensors": [[s.name, "f4", list(s.shape)] for s in specs],
        "data_len": 2 * block,
    }
    if ckpt.shard is not None:
        sh = ckpt.shard
        header["shard"] = {"index": sh.index, "count": sh.count, "chunk": sh.chunk,
                           "digest": sh.digest,
                           "model": [[m.name, "f4", list(m.shape)] for m in sh.model]}
    head = json.dumps(header, separators=(",", ":")).encode()
    path = d / file_name(ckpt.version, ckpt.run)
    tmp = d / f".{path.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            digest = hashlib.sha256()
            for part in (_PREFIX.pack(MAGIC, FORMAT, len(head)) + head,
                         *_chunks(ckpt.weights, names, offsets, block),
                         *_chunks(ckpt.previous, names, offsets, block)):
                digest.update(part)
                f.write(part)
            f.write(digest.digest())  # covers the header too
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
    if fmt not in (1, FORMAT):
        raise ConfigError(
            f"checkpoint {str(p)!r} has format {fmt}; this mlfabric reads formats 1 and "
            f"{FORMAT}"
        )
    start = _PREFIX.size + head_len
    try:
        header = json.loads(raw[_PREFIX.size:start].decode())
        job, version, momentum = header["job"], header["version"], float(header["momentum"])
        run = header.get("run", "") if fmt == FORMAT else ""
        specs = [TensorSpec(n, DTYPES[c], tuple(s)) for n, c, s in header["tensors"]]
        data_len = header["data_len"]
        checksum = header["sha256"] if fmt == 1 else None
        if not (isinstance(job, str) and isinstance(run, str) and type(version) is int
                and type(data_len) is int):
            raise TypeError
        shard = None
        if header.get("shard") is not None:
            sh = header["shard"]
            shard = ShardInfo(int(sh["index"]), int(sh["count"]), int(sh["chunk"]),
                              str(sh["digest"]),
                              tuple(TensorSpec(n, DTYPES[c], tuple(x)) for n, c, x in sh["model"]))
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise ConfigError(
            f"checkpoint {str(p)!r} has a damaged header: use an older checkpoint"
        ) from None
    end = len(raw) - (_DIGEST if fmt == FORMAT else 0)
    data = memoryview(raw)[start:max(end, start)]
    if len(data) != data_len:
        raise ConfigError(
            f"checkpoint {str(p)!r} is truncated: {len(data)} of {data_len} data bytes; "
            f"use an older checkpoint"
        )
    if fmt == FORMAT:
        intact = hashlib.sha256(memoryview(raw)[:end]).digest() == raw[end:]
    else:
        intact = hashlib.sha256(data).hexdigest() == checksum
        log.warning("checkpoint %s has format 1: its checksum covers the data, not the "
                    "header (version, momentum, shapes); the next checkpoint is written in "
                    "format %d", p, FORMAT)
    if not intact:
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
    return Checkpoint(job, version, momentum, weights, previous, run, shard)


def found(directory: str | os.PathLike[str]) -> list[tuple[int, str, Path]]:
    """(version, run, path) of every checkpoint file in `directory`, oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        parsed = parse_name(p.name)
        if parsed is not None:
            out.append((*parsed, p))
    return sorted(out)


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """The newest checkpoint file in `directory` by version, or None."""
    files = found(directory)
    return files[-1][2] if files else None


def newest_valid(directory: str | os.PathLike[str]
                 ) -> tuple[Path, Checkpoint, list[tuple[Path, str]]]:
    """The newest checkpoint of `directory` that reads back whole, whatever its
    run (the operator asked for the latest state), and the newer ones skipped
    with why. ConfigError if none is valid."""
    skipped: list[tuple[Path, str]] = []
    for _, _, path in reversed(found(directory)):
        try:
            return path, read(path), skipped
        except ConfigError as exc:
            skipped.append((path, str(exc)))
    if not skipped:
        raise ConfigError(f"--resume latest: no checkpoint in {str(directory)!r}")
    raise ConfigError(f"--resume latest: no valid checkpoint in {str(directory)!r}: "
                      + "; ".join(reason for _, reason in skipped))


def runs(directory: str | os.PathLike[str]) -> dict[str, int]:
    """Each run with files in `directory` -> its newest version ("" for format-1
    files, which name no run)."""
    out: dict[str, int] = {}
    for version, run, _ in found(directory):
        out[run] = max(version, out.get(run, version))
    return out


def prune(directory: str | os.PathLike[str], keep: int, run: str = "", *,
          current: int | None = None) -> list[Path]:
    """Delete the older checkpoints of run `run`, keeping its `keep` newest (at
    least one); return what was deleted. Other runs' files are the operator's:
    never touched.

    `current` is the version just written: it is the newest kept whatever the
    folder holds, and the run's files above it are neither counted nor
    deleted. They are left by a resume from an earlier point of the run (the
    damaged newer files `--resume latest` skipped); the run overwrites each as
    it reaches its version. Counting them would delete the good file just
    written and keep a damaged one."""
    keep = max(keep, 1)
    mine = [p for v, r, p in found(directory)
            if r == run and (current is None or v <= current)]
    doomed = mine[:-keep]
    for p in doomed:
        p.unlink(missing_ok=True)
    return doomed
