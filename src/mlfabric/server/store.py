"""The parameter server's model state and update rule, without I/O.

`ParameterStore` holds the named tensors, the previous weights (for
momentum) and the version. It decides whether a push is applied and applies
it with the Cython kernels:

    w_{t+1} = w_t + u + gamma * (w_t - w_{t-1})

Every applied update advances the version by one. The delay of an update is
the version it is applied to minus the version it was computed on.

An aggregate of k updates (their sum, formed at an aggregator) is applied as
one step with the sum and advances the version by k; each member's delay is
the version before the step minus its base version (docs/design.md,
"Aggregation"). Updates that carry a `uid` are applied at most once: the
store remembers the outcome of the newest `dedup_window` uids, so a member
re-sent directly after its aggregate failed is never applied twice.

The model stays finite: a step whose result would hold NaN or Inf (a finite
update can overflow float32) is refused with reason "overflow" and leaves
everything as it was, unless `allow_nonfinite`. The store records the L2
norm of every update it applies, by the version it produced, for the
controller's divergence gate (`norms_since`).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .. import compression, kernels
from ..client.outcome import PushOutcome
from ..errors import ConfigError, InvalidUpdate
from ..wire.protocol import PART_SEP, FrameTensors, Push, ShardInfo, TensorSpec, layout
from .checkpoint import Checkpoint

MODEL_DTYPE = np.dtype(np.float32)
# How many applied uids the store remembers. A re-sent update older than
# that would be applied again, but with a staleness bound it is refused as
# stale long before (its base version is that many versions old).
DEDUP_WINDOW = 1 << 16
# How many versions' update norms the store keeps (norms_since). A heartbeat
# asks for the norms since the last one it got: this covers minutes of
# updates even at thousands per second.
NORM_WINDOW = 1 << 16


@dataclass(frozen=True)
class AggregateOutcome:
    """What became of an aggregate: applied (version after it) or not (reason);
    `delays` are the members' delays, in member order."""

    applied: bool
    version: int
    delays: tuple[int, ...]
    reason: str | None = None


def c_contiguous(a: np.ndarray) -> np.ndarray:
    """`a` if C-contiguous, else a C-contiguous copy; unlike np.ascontiguousarray,
    a 0-d array stays 0-d."""
    return a if a.flags.c_contiguous else np.array(a, order="C")


class ParameterStore:
    """Named float32 tensors, their previous values and a version counter."""

    def __init__(
        self,
        tensors: Mapping[str, np.ndarray],
        *,
        momentum: float = 0.0,
        tau_max: int | None = None,
        allow_nonfinite: bool = False,
        version: int = 0,
        dedup_window: int = DEDUP_WINDOW,
    ) -> None:
        if not tensors:
            raise ConfigError("the model has no tensors: give at least one named float32 array")
        if not 0.0 <= momentum < 1.0:
            raise ConfigError(f"momentum must be in [0, 1), got {momentum}")
        if tau_max is not None and tau_max < 0:
            raise ConfigError(f"tau_max must be >= 0 (or None for no bound), got {tau_max}")
        arrays = {}
        for name, value in tensors.items():
            arr = np.asarray(value)
            if arr.dtype != MODEL_DTYPE:
                raise ConfigError(
                    f"tensor {name!r} is {arr.dtype}; mlfabric serves float32 tensors: "
                    f"convert with arr.astype(np.float32)"
                )
            if not np.all(np.isfinite(arr)):
                raise ConfigError(f"tensor {name!r} holds NaN or Inf values")
            arrays[name] = arr
        self.momentum = float(momentum)
        self.tau_max = tau_max
        self.allow_nonfinite = allow_nonfinite
        self.version = version
        self.specs = tuple(
            TensorSpec(n, MODEL_DTYPE.newbyteorder("<"), a.shape) for n, a in arrays.items()
        )
        offsets, self.nbytes = layout(self.specs)
        # The weights, the previous weights (w_{t-1}) and the spare buffer a
        # step writes the next weights into (rotated in when complete, so w
        # and w_prev are never half-updated) each live in one flat buffer laid
        # out as a frame's data block, the tensors being views into it: a push
        # whose frame has this layout is applied with one kernel call over its
        # data, not one per tensor (`_apply_flat`). The padding stays zero.
        self._starts = np.array([off // 4 for off in offsets], np.intp)
        self._counts = np.array([sp.nbytes // 4 for sp in self.specs], np.intp)
        self._flat_w, self._flat_prev, self._flat_spare = (
            np.zeros(self.nbytes // 4, MODEL_DTYPE) for _ in range(3))
        self.weights = self._views(self._flat_w)
        self.previous = self._views(self._flat_prev)
        self.spare = self._views(self._flat_spare)
        for name, arr in arrays.items():
            self.weights[name][...] = arr
        # w_{t-1}: equal to w_0 at the start, so the first update has no momentum term.
        self._flat_prev[...] = self._flat_w
        # The tensor list of the frames found to have this layout (the codec
        # hands out one tuple per distinct list), so the check is done once.
        self._flat_specs: tuple[TensorSpec, ...] | None = None
        self.staged: StagedApply | None = None
        # After a failover, workers hold base versions of the lost server,
        # which may be ahead of this one's: accepted, with delay 0.
        self.accept_future_base = False
        self.dedup_window = dedup_window
        self._applied_uids: OrderedDict[str, PushOutcome] = OrderedDict()
        # ||u||_2 of the update that produced version v is at v % NORM_WINDOW,
        # for v from max(_norms_from, version - NORM_WINDOW + 1) to version.
        self._norms = np.zeros(NORM_WINDOW, np.float64)
        self._norms_from = version + 1
        self._norms_at = version  # the version the ring is up to date with
        # version -> k of each aggregate of k > 1 among the kept norms (the
        # norms of the k - 1 versions it skipped are 0.0 and no step), in
        # version order: the divergence gate counts steps, not versions.
        self._spans: dict[int, int] = {}
        self._span_versions: list[int] = []  # its keys, ascending (bisected per heartbeat)
        # The norm of the newest applied update (None before the first).
        self.last_norm: float | None = None
        # A sharded server's part of the model (its tensors are the pieces);
        # None for a server that keeps the whole model.
        self.shard: ShardInfo | None = None

    def _views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        return {sp.name: flat[a:a + n].reshape(sp.shape)
                for sp, a, n in zip(self.specs, self._starts.tolist(), self._counts.tolist(),
                                    strict=True)}

    def check_layout(self, specs: Iterable[tuple[str, np.dtype, tuple[int, ...]]]) -> None:
        """Raise InvalidUpdate unless (name, dtype, shape) triples match the model."""
        names = set()
        for name, dtype, shape in specs:
            names.add(name)
            w = self.weights.get(name)
            if w is None:
                raise InvalidUpdate(
                    f"unknown tensor {name!r}; the model's tensors are {sorted(self.weights)}",
                    reason="unknown_tensor",
                )
            if dtype != MODEL_DTYPE:
                raise InvalidUpdate(
                    f"tensor {name!r} is {dtype}, the model's is float32: push "
                    f"arr.astype(np.float32)",
                    reason="bad_dtype",
                )
            if tuple(shape) != w.shape:
                raise InvalidUpdate(
                    f"tensor {name!r} has shape {tuple(shape)}, the model's is {w.shape}",
                    reason="bad_shape",
                )
        missing = [n for n in self.weights if n not in names]
        if missing:
            raise InvalidUpdate(
                f"update lacks tensor {missing[0]!r}: push a value for every tensor of the "
                f"model (zeros where nothing changes)",
                reason="unknown_tensor",
            )

    def decompress(self, codecs: Sequence[tuple[str, str]], parts: Mapping[str, np.ndarray]
                   ) -> dict[str, np.ndarray]:
        """A compressed push's update (issue 35), whole: each of the model's
        tensors rebuilt from its parts (`parts["w#i"]`, ...) once
        `compression.check` has found them well formed. Raises InvalidUpdate
        naming the fault; nothing is applied then."""
        by_tensor: dict[str, dict[str, np.ndarray]] = {name: {} for name, _ in codecs}
        for key, array in parts.items():
            name, _, part = key.rpartition(PART_SEP)
            by_tensor[name][part] = array  # the protocol checked every key names one
        for name in by_tensor:
            if name not in self.weights:
                raise InvalidUpdate(f"unknown tensor {name!r}; the model's tensors are "
                                    f"{sorted(self.weights)}", reason="unknown_tensor")
        missing = [n for n in self.weights if n not in by_tensor]
        if missing:
            raise InvalidUpdate(f"compressed update lacks tensor {missing[0]!r}: compress "
                                f"every tensor of the model", reason="unknown_tensor")
        update = {}
        for name, codec in codecs:
            encoded = compression.Encoded(codec, self.weights[name].shape, by_tensor[name])
            compression.check(encoded, encoded.shape, f"tensor {name!r}")
            update[name] = compression.decode(encoded)
        return update

    def check_base_version(self, base_version: int) -> None:
        if base_version > self.version and not self.accept_future_base:
            raise InvalidUpdate(
                f"base_version {base_version} is ahead of the server's version "
                f"{self.version}: pass the version that pull() returned",
                reason="future_version",
            )

    def validate(self, base_version: int, update: Mapping[str, np.ndarray]) -> float:
        """Raise InvalidUpdate if `update` cannot be applied to this model (a
        step that would overflow it is found only by computing the step);
        return the update's L2 norm over all its tensors.

        One pass over the update: its norm is non-finite exactly when it holds
        NaN or Inf (float32 squares summed in double cannot overflow), so the
        norm is the finiteness check."""
        self.check_layout((n, u.dtype, u.shape) for n, u in update.items())
        self.check_base_version(base_version)
        return self._update_norm(update)

    def _update_norm(self, update: Mapping[str, np.ndarray], check: bool = True) -> float:
        """The update's L2 norm; InvalidUpdate if it is not finite and this
        store does not allow it (`check`: a replica replaying its server's
        steps does not check again)."""
        # Summed exactly as workers compute the norm they report
        # (control_book.controlled_update), so the two agree bit for bit.
        squares = 0.0
        for name, u in update.items():
            norm = kernels.l2_norm(c_contiguous(u).reshape(-1))
            if check and not self.allow_nonfinite and not math.isfinite(norm):
                raise InvalidUpdate(_nonfinite_message(name), reason="nonfinite")
            squares += norm * norm  # as kernels.norm_of (checked tensor by tensor here)
        return math.sqrt(squares)

    def stale_reason(self, delay: int) -> str | None:
        if self.tau_max is not None and delay > self.tau_max:
            return f"stale: delay {delay} exceeds tau_max {self.tau_max}; pull a fresher model"
        return None

    def apply(self, base_version: int, update: Mapping[str, np.ndarray],
              uid: str | None = None) -> PushOutcome:
        """Validate, check staleness, and apply one update.

        Raises InvalidUpdate (model untouched) for a malformed update; returns
        an outcome with applied=False for one that is too stale. An update
        whose `uid` was applied before is not applied again: call
        `applied_before(uid)` first for its outcome.
        """
        update = {n: np.asarray(u) for n, u in update.items()}
        norm = self.validate(base_version, update)
        delay, stale = self._judge(base_version, uid)
        if stale is not None:
            return stale
        self._step(update, norm)
        return self._applied(delay, base_version, uid)

    def _judge(self, base_version: int, uid: str | None) -> tuple[int, PushOutcome | None]:
        """A valid update's delay, and its outcome if it is too stale to apply;
        InvalidUpdate if its uid was applied already."""
        if uid is not None and uid in self._applied_uids:
            raise InvalidUpdate(f"update {uid!r} was applied already (version "
                                f"{self._applied_uids[uid].version})", reason="duplicate")
        delay = max(0, self.version - base_version)
        reason = self.stale_reason(delay)
        if reason is None:
            return delay, None
        return delay, PushOutcome(False, self.version, delay, reason, base_version)

    def _applied(self, delay: int, base_version: int, uid: str | None) -> PushOutcome:
        """The outcome of an update just applied, remembered by its uid."""
        outcome = PushOutcome(applied=True, version=self.version, delay=delay,
                              base_version=base_version)
        self.remember(uid, outcome)
        return outcome

    def applied_before(self, uid: str | None) -> PushOutcome | None:
        """The outcome of the update `uid` if this store applied it already."""
        return None if uid is None else self._applied_uids.get(uid)

    def remember(self, uid: str | None, outcome: PushOutcome) -> None:
        """Record that update `uid` was applied with `outcome`."""
        if uid is None or not outcome.applied:
            return
        self._applied_uids[uid] = outcome
        while len(self._applied_uids) > self.dedup_window:
            self._applied_uids.popitem(last=False)

    def apply_aggregate(self, members: Sequence[tuple[str, int]],
                        total: Mapping[str, np.ndarray]) -> AggregateOutcome:
        """Apply the sum `total` of k members ((uid, base_version) each) as one
        momentum step; the version advances by k.

        Raises InvalidUpdate (model untouched) for a malformed sum, a member
        from the future, a uid listed twice or one applied already (its
        members must then be re-sent one by one). Returns applied=False when
        a member would exceed tau_max: the aggregate is not applied, so the
        members can be judged one by one."""
        if not members:
            raise InvalidUpdate("an aggregate needs at least one member", reason="malformed")
        uids = [uid for uid, _ in members]
        if len(set(uids)) != len(uids):
            raise InvalidUpdate(f"an aggregate lists a member twice: {uids}", reason="malformed")
        total = {n: np.asarray(u) for n, u in total.items()}
        # Layout, finiteness, and no member from the future (the newest base).
        norm = self.validate(max(base for _, base in members), total)
        self._check_members_new(members)
        delays = tuple(max(0, self.version - base) for _, base in members)
        reason = self._members_stale_reason(members, delays)
        if reason is not None:
            return AggregateOutcome(False, self.version, delays, reason)
        self._step(total, norm, steps=len(members))
        return self._remember_members(members, delays)

    def _check_members_new(self, members: Sequence[tuple[str, int]]) -> None:
        for uid, _ in members:
            done = self._applied_uids.get(uid)
            if done is not None:
                raise InvalidUpdate(f"aggregate member {uid!r} was applied already (version "
                                    f"{done.version}): send the members one by one",
                                    reason="duplicate")

    def _members_stale_reason(self, members: Sequence[tuple[str, int]],
                              delays: Sequence[int]) -> str | None:
        for (uid, _), delay in zip(members, delays, strict=True):
            reason = self.stale_reason(delay)
            if reason is not None:
                return f"{reason} (aggregate member {uid!r})"
        return None

    def _remember_members(self, members: Sequence[tuple[str, int]],
                          delays: tuple[int, ...]) -> AggregateOutcome:
        k = len(members)
        for index, ((uid, base), delay) in enumerate(zip(members, delays, strict=True)):
            # With its place in the aggregate: a member re-sent after its
            # aggregate was applied is answered with it, and its worker
            # sends it to the replica at that place.
            self.remember(uid, PushOutcome(True, self.version, delay, None, base,
                                           fan_in=k, index=index))
        return AggregateOutcome(True, self.version, delays)

    def apply_sequenced(self, seq: int, base_version: int,
                        update: Mapping[str, np.ndarray]) -> PushOutcome:
        """Apply the update the server applied as version `seq` (a replica).

        The server already decided it is applied (staleness, finiteness), so
        only the layout and the order are checked: `seq` must be version + 1.
        The arithmetic is apply()'s, so the weights are bit-identical; it is
        never refused for overflow (the server, perhaps with allow_nonfinite,
        applied it: refusing would leave this replica behind for good). Its
        norm is recorded as the server records it, so a replica promoted to
        server reports the norms of the updates it applied."""
        if seq != self.version + 1:
            raise InvalidUpdate(
                f"sequence number {seq} is not the next one ({self.version + 1}): "
                f"updates must reach a replica's store in the server's order",
                reason="out_of_order",
            )
        update = {n: np.asarray(u) for n, u in update.items()}
        self.check_layout((n, u.dtype, u.shape) for n, u in update.items())
        self._step(update, self._update_norm(update, check=False), check=False)
        return PushOutcome(True, self.version, max(0, seq - 1 - base_version), None,
                           base_version)

    def apply_sequenced_aggregate(self, first: int,
                                  members: Sequence[tuple[int, Mapping[str, np.ndarray]]]
                                  ) -> AggregateOutcome:
        """Apply the aggregate the server applied as versions first ..
        first + k - 1 from its k members ((base_version, update) each, in
        member order), as a replica: their sum, formed left to right in
        member order with the aggregator's kernel (so bit for bit the sum the
        server applied), is one step, and the version advances by k. Only
        the layout and the order are checked, as in `apply_sequenced`."""
        if not members:
            raise InvalidUpdate("an aggregate needs at least one member", reason="malformed")
        if first != self.version + 1:
            raise InvalidUpdate(
                f"sequence number {first} is not the next one ({self.version + 1}): "
                f"updates must reach a replica's store in the server's order",
                reason="out_of_order")
        for _, update in members:
            self.check_layout((n, np.asarray(u).dtype, np.asarray(u).shape)
                              for n, u in update.items())
        total = {}
        for name, w in self.weights.items():
            out = np.empty(w.shape, w.dtype)
            kernels.sum_into(out, tuple(c_contiguous(np.asarray(u[name])) for _, u in members))
            total[name] = out
        delays = tuple(max(0, first - 1 - base) for base, _ in members)
        self._step(total, self._update_norm(total, check=False), steps=len(members),
                   check=False)
        return AggregateOutcome(True, self.version, delays)

    def _step(self, update: Mapping[str, np.ndarray], norm: float, *, steps: int = 1,
              check: bool = True) -> None:
        """One momentum step with `update` (whose L2 norm is `norm`),
        advancing the version by `steps`; or InvalidUpdate ("overflow") with
        the model untouched when a finite update would make it non-finite.

        The next weights are computed into the spare buffers (the staged
        path's arithmetic: bit-identical to momentum_apply) and only rotated
        in if the kernel, which tracks the finiteness of what it writes in a
        register, says they are finite: so a refused step leaves w, w_prev,
        the version and the remembered uids as they were, at no copy and no
        second pass."""
        gamma = self.momentum
        if self.staged is not None:
            # Its partial results live in the spare buffers: void it (it
            # would be void anyway once the version moves), but leave it in
            # place until its push completes, as a version change does.
            self.staged.valid = False
        if not check or self.allow_nonfinite:
            # Nothing can be refused (a replica, or non-finite allowed): in
            # place, which touches three arrays instead of four (measured
            # faster when they are not in cache), with the same arithmetic.
            for name, w in self.weights.items():
                u = c_contiguous(update[name])
                if gamma:
                    kernels.momentum_apply(w, self.previous[name], u, gamma)
                else:
                    kernels.sum_into(w, (w, u))
        else:
            for name, w in self.weights.items():
                u = c_contiguous(update[name])
                prev = self.previous[name] if gamma else None
                if not kernels.momentum_into(self.spare[name], w, prev, u, gamma):
                    raise InvalidUpdate(_overflow_message(name), reason="overflow")
            self._rotate()
        self._advance(steps, norm)

    def _advance(self, steps: int, norm: float) -> None:
        """The version moves on by `steps` with one applied step of norm
        `norm`: an aggregate of k is one momentum step with the sum, so its
        norm is recorded at the last version and 0.0 at the k - 1 it skips
        (no step was taken there: the norms of the versions add up to what
        moved the model, which is what the divergence bound sums)."""
        self._norms_sync()
        ring, window = self._norms, NORM_WINDOW
        first = self.version + 1
        self.version += steps
        for v in range(max(first, self.version - window + 1), self.version):
            ring[v % window] = 0.0
        ring[self.version % window] = norm
        self._norms_at = self.version
        self.last_norm = norm
        if steps > 1:
            self._spans[self.version] = steps
            self._span_versions.append(self.version)
        old = bisect.bisect_right(self._span_versions, self.version - window)
        if old:
            for v in self._span_versions[:old]:
                del self._spans[v]
            del self._span_versions[:old]

    def _norms_sync(self) -> None:
        # The version was set from outside (a replica resynced from its
        # server's state): the norms up to it are not known here.
        if self._norms_at != self.version:
            self._norms_from = self.version + 1
            self._norms_at = self.version
            self._spans.clear()
            self._span_versions.clear()

    def norms_since(self, version: int, limit: int = 4096) -> tuple[int, list[float]]:
        """The L2 norms of the updates that produced versions version + 1,
        version + 2, ... (at most `limit`, in order) as (first_version, norms),
        first_version being the version of norms[0]. It is above version + 1
        when older norms are not known (before this store started, or fallen
        out of the last NORM_WINDOW versions). Empty list when nothing newer.
        The list ends where a step ends: never inside an aggregate."""
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self._norms_sync()
        first = max(version + 1, self._norms_from, self.version - NORM_WINDOW + 1)
        last = min(self.version, first + limit - 1)
        # End on a step: an aggregate cut short would read as zero steps.
        after = bisect.bisect_right(self._span_versions, last)
        if after < len(self._span_versions):
            end = self._span_versions[after]
            if end - self._spans[end] < last:
                last = end - self._spans[end]
        if last < first:
            return first, []
        lo, hi = first % NORM_WINDOW, last % NORM_WINDOW
        if lo <= hi:
            return first, self._norms[lo:hi + 1].tolist()
        return first, self._norms[lo:].tolist() + self._norms[:hi + 1].tolist()

    def spans_between(self, first: int, last: int) -> list[tuple[int, int]]:
        """(version, k) of each aggregate of k > 1 whose step is at a version
        from first to last (see `norms_since`; the other versions there were
        single steps), in version order."""
        versions = self._span_versions
        lo, hi = bisect.bisect_left(versions, first), bisect.bisect_right(versions, last)
        return [(v, self._spans[v]) for v in versions[lo:hi]]

    def _rotate(self) -> None:
        """The spare buffers hold the next weights: w_prev <- w, w <- spare
        (spare <- the old w_prev, reused next time). Whole buffers and their
        views move together: no copy, and no loop over the tensors."""
        if self.momentum:
            self._flat_w, self._flat_prev, self._flat_spare = (
                self._flat_spare, self._flat_w, self._flat_prev)
            self.weights, self.previous, self.spare = self.spare, self.weights, self.previous
        else:
            self._flat_w, self._flat_spare = self._flat_spare, self._flat_w
            self.weights, self.spare = self.spare, self.weights

    def flat_layout(self, specs: tuple[TensorSpec, ...]) -> bool:
        """Whether a frame listing `specs` lays its data out exactly as this
        store's buffers (the same tensors in the same order)."""
        if specs is self._flat_specs:
            return True
        if specs != self.specs:
            return False
        self._flat_specs = specs
        return True

    def _apply_flat(self, base_version: int, data: np.ndarray, uid: str | None
                    ) -> PushOutcome:
        """apply() of an update given as a frame's data block in this store's
        layout (`flat_layout`): the same checks, outcome and arithmetic, bit
        for bit, in one kernel call each instead of one per tensor."""
        self.check_base_version(base_version)
        norm, bad = kernels.segments_l2_norm(data, self._starts, self._counts)
        if bad >= 0:
            raise InvalidUpdate(_nonfinite_message(self.specs[bad].name), reason="nonfinite")
        delay, stale = self._judge(base_version, uid)
        if stale is not None:
            return stale
        if self.staged is not None:
            self.staged.valid = False  # as _step: its partial results are in spare
        gamma = self.momentum
        bad = kernels.segments_momentum_into(
            self._flat_spare, self._flat_w, self._flat_prev if gamma else None, data, gamma,
            self._starts, self._counts)
        if bad >= 0:
            raise InvalidUpdate(_overflow_message(self.specs[bad].name), reason="overflow")
        self._rotate()
        self._advance(1, norm)
        return self._applied(delay, base_version, uid)

    # -- a received push: the store decides how it is applied ------------------

    def stage_for(self, push: Push, specs: Sequence[TensorSpec], nbytes: int,
                  min_bytes: int | None) -> StagedApply | None:
        """Whether a push whose bytes are arriving (`push`: its checked head,
        `nbytes` of data) is applied as they come in: its staging, or None
        (applied whole at its end by `apply_push`). Only pushes of at least
        `min_bytes` (None: none) are staged; never a sequenced one (only a
        replica takes those), a duplicate (answered, never applied twice),
        nor one the server may hold for others (`Push.after`)."""
        if min_bytes is None or nbytes < min_bytes or push.seq is not None \
                or push.codecs is not None \
                or push.after is not None:  # compressed: decoded whole, then applied
            return None
        if push.members is not None:
            members = [(uid, base) for uid, base, _ in push.members]
            return self.begin_staged(push.base_version, specs, None, members)
        if push.uid is not None and self.applied_before(push.uid) is not None:
            return None
        return self.begin_staged(push.base_version, specs, None, uid=push.uid)

    def apply_push(self, push: Push, staged: StagedApply | None, data: memoryview | None
                   ) -> tuple[PushOutcome, bool]:
        """Apply a received push (not an aggregate), as staged while it
        arrived if `staged` still holds, else whole. Returns its outcome and
        whether it was a duplicate: a uid applied before is answered with its
        first outcome and not applied again. Raises InvalidUpdate."""
        before = self.applied_before(push.uid)
        if before is not None:
            if staged is not None:
                staged.cancel()
            return before, True
        outcome = staged.finish(data) if staged is not None and data is not None else None
        if outcome is None:
            tensors = push.tensors
            if (isinstance(tensors, FrameTensors) and not self.allow_nonfinite
                    and self.flat_layout(tensors.specs)):
                return self._apply_flat(push.base_version, tensors.flat(), push.uid), False
            return self.apply(push.base_version, push.tensors, push.uid), False
        self.remember(push.uid, outcome)
        return outcome, False

    def apply_aggregate_push(self, push: Push, staged: StagedApply | None,
                             data: memoryview | None) -> AggregateOutcome:
        """Apply a received aggregate: as staged if `staged` staged these very
        members and still holds, else whole. Raises InvalidUpdate."""
        assert push.members is not None
        members = [(uid, base) for uid, base, _ in push.members]
        if staged is not None and data is not None:
            if staged.members == tuple(members):
                outcome = staged.finish_aggregate(data)
                if outcome is not None:
                    return outcome
            else:
                staged.cancel()
        return self.apply_aggregate(members, push.tensors)

    def begin_staged(
        self, base_version: int, specs: Sequence[TensorSpec], offsets: Sequence[int] | None,
        members: Sequence[tuple[str, int]] | None = None, uid: str | None = None,
    ) -> StagedApply | None:
        """Start applying an update whose bytes are still arriving, or None
        when it will not be applied as it stands (malformed, stale, or another
        update is being staged); the caller then applies it whole with apply()
        (or apply_aggregate(), which says why).

        `members` ((uid, base_version) each) makes it an aggregate, judged as
        apply_aggregate() judges one: `base_version` is then ignored. `uid`
        names a single update (one applied already is not staged). `offsets`:
        where each tensor starts in the data block (None: computed from
        `specs`, when needed at all)."""
        if self.staged is not None or (uid is not None and uid in self._applied_uids):
            return None
        if members is not None:
            uids = [uid for uid, _ in members]
            if not members or len(set(uids)) != len(uids):
                return None
            base_version = max(base for _, base in members)
        try:
            if not (isinstance(specs, tuple) and self.flat_layout(specs)):
                self.check_layout((sp.name, sp.dtype, sp.shape) for sp in specs)
            self.check_base_version(base_version)
            if members is not None:
                self._check_members_new(members)
        except InvalidUpdate:
            return None
        if members is None:
            stale = self.stale_reason(max(0, self.version - base_version))
        else:
            stale = self._members_stale_reason(
                members, [max(0, self.version - base) for _, base in members])
        if stale is not None:
            return None
        self.staged = StagedApply(self, base_version, specs, offsets, members)
        if members is None and uid is not None:
            self.staged.uids = (uid,)
        return self.staged

    def checkpoint(self, job: str) -> Checkpoint:
        """A consistent copy of the whole state (weights, momentum history, version)."""
        return Checkpoint(
            job=job,
            version=self.version,
            momentum=self.momentum,
            weights={n: w.copy() for n, w in self.weights.items()},
            previous={n: w.copy() for n, w in self.previous.items()},
            shard=self.shard,
        )

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, *, momentum: float | None = None,
                        tau_max: int | None = None,
                        allow_nonfinite: bool = False) -> ParameterStore:
        """The store a checkpoint was taken of (momentum may be changed)."""
        store = cls(ckpt.weights, momentum=ckpt.momentum if momentum is None else momentum,
                    tau_max=tau_max, allow_nonfinite=allow_nonfinite, version=ckpt.version)
        for name, prev in ckpt.previous.items():
            if name not in store.previous or prev.shape != store.previous[name].shape:
                raise ConfigError(f"checkpoint's momentum history does not match tensor {name!r}")
            store.previous[name][...] = prev
        store.shard = ckpt.shard
        return store

    def snapshot(self) -> tuple[int, dict[str, np.ndarray]]:
        """A consistent copy of the model at the current version."""
        return self.version, {n: w.copy() for n, w in self.weights.items()}


def _overflow_message(name: str) -> str:
    return (
        f"applying this update would make tensor {name!r} non-finite (overflow to Inf or "
        f"NaN); the update was not applied and the model was left as it was (lower the "
        f"learning rate and check the loss for divergence)"
    )


def _nonfinite_message(name: str) -> str:
    return (
        f"tensor {name!r} holds NaN or Inf; the update was not applied "
        f"(check the learning rate and loss for divergence)"
    )


@dataclass
class _Piece:
    """One tensor of a staged update: where its bytes are, how far it is done."""

    name: str
    offset: int  # in the data block, bytes
    count: int  # elements
    done: int = 0  # elements computed so far


class StagedApply:
    """One update applied piece by piece while its bytes arrive.

    The next weights are computed into the store's spare buffers as each
    chunk of the update lands, with the same kernel arithmetic as apply(), so
    the result is bit-identical. Nothing the store serves changes until
    finish(), which rotates buffers: w_prev <- w, w <- spare, spare <- old
    w_prev. If the model moved on meanwhile (another update was applied), or
    a chunk holds NaN/Inf, the staging is void and finish() returns None.
    """

    def __init__(
        self,
        store: ParameterStore,
        base_version: int,
        specs: Sequence[TensorSpec],
        offsets: Sequence[int] | None,
        members: Sequence[tuple[str, int]] | None = None,
    ) -> None:
        self.store = store
        self.base_version = base_version
        self.members = None if members is None else tuple(members)
        # The updates this staging applies (what a pull for an update waits on).
        self.uids: tuple[str, ...] = () if members is None else tuple(u for u, _ in members)
        self.version = store.version
        # The version once committed (an aggregate of k advances it by k).
        self.next_version = store.version + (1 if members is None else len(members))
        self.valid = True
        self.fed = 0  # bytes of the data block seen by feed()
        self.committed = False
        # An update laid out as the store's buffers is fed in one kernel call
        # over them (segments_stage), with its progress in two arrays;
        # otherwise tensor by tensor.
        self._flat = isinstance(specs, tuple) and store.flat_layout(specs)
        self._plan: list[_Piece] = []
        if self._flat:
            self._done = np.zeros(len(specs), np.intp)
            self._flat_squares = np.zeros(len(specs), np.float64)
        else:
            if offsets is None:
                offsets = layout(specs)[0]
            self._plan = [_Piece(sp.name, off, sp.nbytes // 4)
                          for sp, off in zip(specs, offsets, strict=True)]
        # Per tensor, the sum of squares of the update's elements fed so far.
        self._squares = [0.0] * len(self._plan)

    def feed(self, data: memoryview, received: int) -> None:
        """Compute the next weights for every element fully received so far."""
        store = self.store
        if not self.valid or store.staged is not self or store.version != self.version:
            self.valid = False
            return
        self.fed = received
        gamma = store.momentum
        check = not store.allow_nonfinite
        if self._flat:
            u = np.frombuffer(data, np.float32, count=len(data) // 4)
            if kernels.segments_stage(
                    store._flat_spare, store._flat_w, store._flat_prev if gamma else None, u,
                    gamma, store._starts, store._counts, self._done, self._flat_squares,
                    received // 4, check) >= 0:
                self.valid = False  # NaN/Inf, or an overflow: see the loop below
            return
        for k, piece in enumerate(self._plan):
            name, done = piece.name, piece.done
            avail = min(piece.count, max(0, (received - piece.offset) // 4))
            if avail <= done:
                if avail < piece.count:
                    break  # later tensors have not started arriving
                continue
            u = np.frombuffer(data, np.float32, count=avail - done,
                              offset=piece.offset + 4 * done)
            # The norm is the update's finiteness check (see validate()).
            norm = kernels.l2_norm(u)
            if check and not math.isfinite(norm):
                self.valid = False
                return
            out = store.spare[name].reshape(-1)[done:avail]
            w = store.weights[name].reshape(-1)[done:avail]
            prev = store.previous[name].reshape(-1)[done:avail] if gamma else None
            if not kernels.momentum_into(out, w, prev, u, gamma) and check:
                # It would overflow the model: void, so the whole-update
                # path refuses it with the reason.
                self.valid = False
                return
            self._squares[k] += norm * norm
            piece.done = avail

    def computed(self) -> dict[str, int]:
        """Per tensor, how many leading elements of the next weights are in
        the store's spare buffers (final if the staging commits)."""
        if self._flat:
            return dict(zip((sp.name for sp in self.store.specs), self._done.tolist(),
                            strict=True))
        return {p.name: p.done for p in self._plan}

    def cancel(self) -> None:
        """Give up (the connection carrying the update is gone)."""
        self.valid = False
        if self.store.staged is self:
            self.store.staged = None

    def finish(self, data: memoryview) -> PushOutcome | None:
        """Commit the staged update (all its bytes have arrived), or None if
        the staging is void and the update must be applied whole. For an
        aggregate, see finish_aggregate()."""
        assert self.members is None, "an aggregate's staging ends with finish_aggregate()"
        if not self._commit(data):
            return None
        store = self.store
        delay = max(0, store.version - self.base_version)
        store._advance(1, self._norm())
        return PushOutcome(True, store.version, delay, None, self.base_version)

    def finish_aggregate(self, data: memoryview) -> AggregateOutcome | None:
        """Commit a staged aggregate: one step, version + k, every member
        remembered; None if the staging is void (apply it whole)."""
        assert self.members is not None
        if not self._commit(data):
            return None
        store = self.store
        delays = tuple(max(0, store.version - base) for _, base in self.members)
        store._advance(len(self.members), self._norm())
        return store._remember_members(self.members, delays)

    def _norm(self) -> float:
        # Summed per tensor first, as _update_norm sums its tensors' norms:
        # equal to the whole update's norm to rounding (the chunks' partial
        # sums add up in another order).
        return math.sqrt(sum(self._flat_squares.tolist() if self._flat else self._squares))

    def _commit(self, data: memoryview) -> bool:
        store = self.store
        total = (store.nbytes if self._flat else
                 max((p.offset + p.count * 4 for p in self._plan), default=0))
        self.feed(data, total)
        if store.staged is self:
            store.staged = None
        if not self.valid:
            return False
        store._rotate()
        self.committed = True
        return True
