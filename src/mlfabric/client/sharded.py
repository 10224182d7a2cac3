"""The client of a sharded job: one asyncio client per shard, one model to the user.

`connect("h0:7070,h1:7070,h2:7070", ...)` dials every shard at once and
checks that they serve one partition of one model in that order
(`shards.check_shards`). Then:

- `pull()` asks every shard at once and returns the whole model as one dict,
  with the version a tuple of the shards' versions;
- `push(update, base_version=version)` cuts the update into the shards'
  parts (views of the caller's arrays, no copy) and sends them at once; the
  future resolves once every shard answered, to a `ShardedOutcome`.

Each shard keeps its own version and applies its part by itself (tau_max per
shard), as ps-lite's and Bösen's servers keep their own clocks: docs/design.md,
"Sharded servers", says what a pull may see and what an outcome means. With a
controller, each part is a transfer of its own to its shard's host.

One address gives the plain `AsyncClient`: nothing changes for S = 1.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import kernels
from ..compression import Significance
from ..compression import parse as parse_compression
from ..errors import ConfigError
from ..runtime.metrics import ClientMetrics
from ..sharding.partition import Partition
from ..wire.protocol import (
    ALIGN,
    BlockPlan,
    FrameTensors,
    LaidOutTensors,
    Scatter,
    TensorSpec,
    layout,
)
from . import aio
from .core import DEFAULT_PUSH_TIMEOUT, check_base_version, check_update, laid_out_update
from .futures import AsyncPushFuture
from .outcome import PushOutcome
from .shards import check_shards, split_addresses


@dataclass(frozen=True)
class ShardedOutcome(PushOutcome):
    """A sharded push's outcome: `applied` if every shard applied its part,
    `version` the shards' versions after it (a tuple, what pull() returns),
    `delay` the largest delay among the shards that applied it, `reason` each
    refusal with its shard; `shards[i]` shard i's own PushOutcome."""

    shards: tuple[PushOutcome, ...] = ()

    @classmethod
    def of(cls, addresses: list[str], parts: list[PushOutcome]) -> ShardedOutcome:
        delays = [p.delay for p in parts if p.applied and p.delay is not None]
        refused = [f"shard {i} ({a}): {p.reason}" for i, (a, p)
                   in enumerate(zip(addresses, parts, strict=True)) if not p.applied]
        bases = [p.base_version for p in parts]
        return cls(applied=not refused,
                   version=tuple(p.version for p in parts),  # type: ignore[arg-type]
                   delay=max(delays) if delays else None,
                   reason="; ".join(refused) or None,
                   base_version=None if None in bases else tuple(bases),  # type: ignore[arg-type]
                   shards=tuple(parts))


class ShardedPushFuture(AsyncPushFuture):
    """A sharded push: resolves when every part's future has; `parts[i]` is
    shard i's (what pull(including=...) waits on, part by part)."""

    parts: tuple[asyncio.Future[PushOutcome], ...] = ()


class ShardedClient:
    """The asyncio client of S shards, with the API of `AsyncClient`."""

    def __init__(self, shards: list[aio.AsyncClient], part: Partition,
                 metrics: ClientMetrics | None = None) -> None:
        self.shards = shards
        self.partition = part
        self.metrics = metrics
        self._nbytes = part.bytes_per_shard()
        self.addresses = [c.address for c in shards]
        self.address = ",".join(self.addresses)
        self.specs: tuple[TensorSpec, ...] = tuple(TensorSpec(n, d, s) for n, d, s in part.specs)
        self.tau_max = shards[0].tau_max
        self.momentum = shards[0].momentum
        self.session = ",".join(c.session for c in shards)
        # Where each shard's pieces lie in the whole model's frame block and in
        # the shard's: a small update gathered into the former is cut into the
        # latter with one memcpy per piece, in C; a larger one goes to each
        # shard straight from the update's arrays, as each shard's plan says
        # (see submit).
        self._block = layout(self.specs)
        self._plan = BlockPlan.whole(self.specs)
        where = {sp.name: off for sp, off in zip(self.specs, self._block[0], strict=True)}
        number = {sp.name: i for i, sp in enumerate(self.specs)}
        itemsize = {sp.name: sp.dtype.itemsize for sp in self.specs}
        self._cuts = []
        self._plans = []
        for client, pieces in zip(shards, part.pieces, strict=True):
            src = [where[p.tensor] + p.start * itemsize[p.tensor] for p in pieces]
            dst = np.array(client.block_layout[0], np.intp)
            lengths = np.array([p.nbytes for p in pieces], np.intp)
            self._cuts.append((dst, np.array(src, np.intp), lengths))
            self._plans.append(BlockPlan(
                np.array([number[p.tensor] for p in pieces], np.intp),
                np.array([p.start * itemsize[p.tensor] for p in pieces], np.intp),
                lengths, dst, client.block_layout[1]))
        # A pull receives each shard's block straight into the whole model's:
        # the block's runs, in order, as (offset in the whole block, length),
        # offset -1 for padding (into a spare buffer).
        self._runs = [_runs(*cut, client.block_layout[1]) for cut, client
                      in zip(self._cuts, shards, strict=True)]
        self._spare = memoryview(bytearray(ALIGN))
        # significance=: a push too small to matter is held by every shard at
        # once, measured against the whole model (`hold_insignificant`).
        self.significance: Significance | None = None

    def hold_insignificant(self, threshold: float) -> None:
        """As AsyncClient.hold_insignificant(), over the whole model: an
        update is held, in every shard's residuals, or goes to every shard."""
        significance = Significance(threshold)
        for c in self.shards:
            if c.compression is None:
                c.compress_with(parse_compression("none"))
        self.significance = significance

    @property
    def last_version(self) -> tuple[int, ...]:
        return tuple(c.last_version for c in self.shards)

    @property
    def closed(self) -> bool:
        return any(c.closed for c in self.shards)

    def check_base(self, base_version: Any) -> tuple[int, ...]:
        """`base_version` as the shards' versions, or TypeError/ValueError."""
        n = len(self.shards)
        if not (isinstance(base_version, tuple) and len(base_version) == n):
            raise TypeError(
                f"base_version must be the version pull() returned: with {n} shards, a tuple "
                f"of {n} versions, one per shard; got {base_version!r:.80}")
        return tuple(check_base_version(v) for v in base_version)

    async def pull(self, *, including: asyncio.Future[PushOutcome] | None = None,
                   ) -> tuple[tuple[int, ...], dict[str, np.ndarray]]:
        """The whole model as (versions, {name: array}): every shard's part at
        that shard's version. With `including` (a future push() returned), each
        part once that shard's outcome of the update is known."""
        parts = getattr(including, "parts", None) if including is not None else None
        if including is not None and parts is None:
            raise TypeError("including= takes the future this client's push() returned")
        model, into = self._new_model()
        pulls = [c.pull(including=parts[i] if parts is not None else None, into=into[i])
                 for i, c in enumerate(self.shards)]
        answers = await _all(pulls)
        for i, (_, params) in enumerate(answers):
            if params is not model:  # the shard listed other tensors: received apart
                self.partition.put(model, i, params)
        if self.metrics is not None:
            for i, n in enumerate(self._nbytes):
                self.metrics.shard_model_bytes.labels(str(i)).inc(n)
        if self.significance is not None:
            self.significance.observe(model)
        return tuple(v for v, _ in answers), model

    def _new_model(self) -> tuple[dict[str, np.ndarray], list[Scatter]]:
        """A new whole model (views of one buffer in its frame layout), and
        for each shard where its part goes in it."""
        whole = np.empty(self._block[1], np.uint8)
        model = {sp.name: whole[off:off + sp.nbytes].view(sp.dtype).reshape(sp.shape)
                 for sp, off in zip(self.specs, self._block[0], strict=True)}
        view, spare = whole.data, self._spare
        return model, [
            Scatter(client.specs, [spare[:n] if at < 0 else view[at:at + n] for at, n in runs],
                    model)
            for client, runs in zip(self.shards, self._runs, strict=True)]

    def push(self, update: Mapping[str, Any], *, base_version: Any) -> ShardedPushFuture:
        """Hand an update over; returns a future of its ShardedOutcome at once.
        As with AsyncClient.push(), the arrays are sent without a copy: do not
        modify them until the future is done."""
        base = self.check_base(base_version)
        return self.submit(self.prepare(update), base)

    def prepare(self, update: Mapping[str, Any]) -> Mapping[str, np.ndarray]:
        """`update` checked against the whole model (cut into parts at submit):
        for many small tensors, checked in one pass and laid out as the whole
        model's block (`core.laid_out_update`)."""
        if self.shards[0].compression is not None:  # each shard encodes its parts by name
            return check_update(update, self.specs)
        fast = laid_out_update(update, self.specs, self._block, self._plan)
        return fast if fast is not None else check_update(update, self.specs)

    def refusal(self) -> BaseException | None:
        for c in self.shards:
            error = c.refusal()
            if error is not None:
                return error
        return None

    def submit(self, arrays: Mapping[str, np.ndarray], base: tuple[int, ...]
               ) -> ShardedPushFuture:
        """push() of a checked update (`check_update` against `specs`)."""
        if self.significance is not None:
            held = self._hold(self.partition.split(arrays), base)
            if held is not None:
                return held
        cut: Sequence[Mapping[str, np.ndarray]]
        if isinstance(arrays, FrameTensors) and arrays.specs is self.specs:
            blocks = []
            for client, (dst, src, lengths) in zip(self.shards, self._cuts, strict=True):
                block = np.zeros(client.block_layout[1], np.uint8)
                kernels.copy_ranges(block, dst, arrays.data, src, lengths)
                blocks.append(FrameTensors(client.specs, client.block_layout[0], block))
            cut = blocks
        elif isinstance(arrays, LaidOutTensors) and arrays.specs is self.specs:
            cut = [LaidOutTensors(client.specs, arrays.arrays, plan)
                   for client, plan in zip(self.shards, self._plans, strict=True)]
        else:
            cut = self.partition.split(arrays)
        parts = []
        try:
            for client, part, b in zip(self.shards, cut, base, strict=True):
                parts.append(client.submit(part, b))
        except BaseException:
            for f in parts:
                f.cancel()
            raise
        if self.metrics is not None:
            self._count(parts)
        done = ShardedPushFuture(loop=asyncio.get_running_loop())
        done.parts = tuple(parts)
        uids = [getattr(f, "uid", None) for f in parts]
        done.uid = None if None in uids else ",".join(uids)  # type: ignore[arg-type]
        _combine(done, parts, self.addresses)
        return done

    def _hold(self, cut: Sequence[Mapping[str, np.ndarray]], base: tuple[int, ...]
              ) -> ShardedPushFuture | None:
        """An update below the significance threshold over the whole model,
        folded into every shard's residuals and answered at once (None: it
        goes)."""
        assert self.significance is not None
        feedback = [c.compression for c in self.shards]
        pending = 0.0
        for ef, part in zip(feedback, cut, strict=True):
            assert ef is not None  # hold_insignificant gave every shard residuals
            pending += ef.pending_norm(part) ** 2
        relative = self.significance.holds(pending ** 0.5)
        if relative is None:
            return None
        reason = self.significance.reason(relative)
        parts = [c.fold_held(part, b, reason)
                 for c, part, b in zip(self.shards, cut, base, strict=True)]
        if self.metrics is not None:
            self.metrics.pushes.labels("held").inc()
        done = ShardedPushFuture(loop=asyncio.get_running_loop())
        done.parts = tuple(parts)
        done.set_result(ShardedOutcome(
            applied=False, version=self.last_version, delay=None,  # type: ignore[arg-type]
            reason=reason, base_version=base, folded=True,  # type: ignore[arg-type]
            shards=tuple(p.result() for p in parts)))
        return done

    def _count(self, parts: list[AsyncPushFuture]) -> None:
        m = self.metrics
        assert m is not None
        for i, (f, n) in enumerate(zip(parts, self._nbytes, strict=True)):
            shard = str(i)
            m.shard_update_bytes.labels(shard).inc(n)

            def answered(f: asyncio.Future[PushOutcome], shard: str = shard) -> None:
                if f.cancelled() or f.exception() is not None:
                    m.shard_parts.labels(shard, "error").inc()
                    return
                outcome = f.result()
                m.shard_parts.labels(shard, "applied" if outcome.applied else "rejected").inc()
                if outcome.applied and outcome.delay is not None:
                    m.shard_delay.labels(shard).observe(outcome.delay)

            f.add_done_callback(answered)

    async def flushed(self) -> None:
        await asyncio.gather(*(c.flushed() for c in self.shards))

    async def drain(self) -> None:
        await asyncio.gather(*(c.drain() for c in self.shards))

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.shards), return_exceptions=True)

    async def __aenter__(self) -> ShardedClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return (f"<mlfabric.ShardedClient {self.address} shards={len(self.shards)} "
                f"tensors={len(self.specs)}>")


def _combine(done: ShardedPushFuture, parts: list[AsyncPushFuture],
             addresses: list[str]) -> None:
    """Resolve `done` once every part has; at the first failed part, with its
    error (which names its shard). Cancelling `done` cancels the parts."""
    left = [len(parts)]

    def one_done(f: asyncio.Future[PushOutcome]) -> None:
        left[0] -= 1
        if done.done():
            return
        if f.cancelled():
            done.cancel()
        elif f.exception() is not None:
            done.set_exception(f.exception())  # type: ignore[arg-type]
        elif left[0] == 0:
            done.set_result(ShardedOutcome.of(addresses, [p.result() for p in parts]))

    def cancel_parts(f: asyncio.Future[PushOutcome]) -> None:
        if f.cancelled():
            for p in parts:
                p.cancel()

    for p in parts:
        p.add_done_callback(one_done)
    done.add_done_callback(cancel_parts)


def _runs(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray, total: int
          ) -> list[tuple[int, int]]:
    """A shard block of `total` bytes whose pieces lie at `dst` and come from
    `src` in the whole block, as runs (offset in the whole block, or -1 for
    padding; length) in the shard block's order."""
    runs, pos = [], 0
    for at, start, n in zip(dst.tolist(), src.tolist(), lengths.tolist(), strict=True):
        if at > pos:
            runs.append((-1, at - pos))
        runs.append((start, n))
        pos = at + n
    if total > pos:
        runs.append((-1, total - pos))
    return runs


async def _all(coros: list[Any]) -> list[Any]:
    """Every result, or the first error with the rest cancelled."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        raise


async def connect(address: str, *, job: str, token: str | bytes | None = None,
                  token_file: str | os.PathLike[str] | None = None, timeout: float = 10.0,
                  metrics: ClientMetrics | None = None, replica: str | None = None,
                  push_timeout: float | None = DEFAULT_PUSH_TIMEOUT,
                  **options: Any) -> aio.AsyncClient | ShardedClient:
    """The client of the server at `address`, or of the shards at
    "HOST:PORT,HOST:PORT,..." (in shard order). Takes aio.connect()'s
    arguments; `replica` names one replica per shard, in the same order
    ("HOST:PORT,HOST:PORT,..."), each fed with its shard's parts."""
    addresses = split_addresses(address)
    replicas: list[str | None] = [None] * len(addresses)
    if replica is not None:
        named = split_addresses(replica)
        if len(named) != len(addresses):
            raise ConfigError(
                f"replica= names {len(named)} replica(s) for {len(addresses)} server "
                f"address(es): give one replica per shard, in shard order")
        replicas = list(named)
    significance = options.pop("significance", None)
    if significance is not None and options.get("compression") is None:
        # Held pushes need residuals from the start: whole parts, not chunks.
        options["compression"] = "none"
    common = dict(job=job, token=token, token_file=token_file, timeout=timeout,
                  metrics=metrics, push_timeout=push_timeout, **options)
    if len(addresses) == 1:
        client = await aio.connect(addresses[0], replica=replicas[0], significance=significance,
                                   **common)
        info = client.welcome_shard
        if info is not None and info.count > 1:  # one shard of several: say so
            await client.close()
            check_shards(addresses, [info], [client.specs])
        return client
    clients = await _all([aio.connect(a, replica=r, **common)
                          for a, r in zip(addresses, replicas, strict=True)])
    try:
        part = check_shards(addresses, [c.welcome_shard for c in clients],
                            [c.specs for c in clients])
        _check_same_settings(clients)
        assert part is not None
        sharded = ShardedClient(clients, part, metrics)
        if significance is not None:
            sharded.hold_insignificant(significance)
        return sharded
    except BaseException:
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
        raise


def _check_same_settings(clients: list[aio.AsyncClient]) -> None:
    first = clients[0]
    for c in clients[1:]:
        for what, mine, theirs in (("--tau-max", first.tau_max, c.tau_max),
                                   ("--momentum", first.momentum, c.momentum)):
            if mine != theirs:
                raise ConfigError(
                    f"the shards serve with different {what}: {theirs} at {c.address}, "
                    f"{mine} at {first.address}; start every shard with the same {what}")


__all__ = ["ShardedClient", "ShardedOutcome", "ShardedPushFuture", "connect"]
