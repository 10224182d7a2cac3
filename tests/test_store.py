"""ParameterStore without I/O: the update rule, staleness, validation, and
the staged apply that runs while an update's bytes arrive."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.errors import ConfigError, InvalidUpdate
from mlfabric.kernels import _core
from mlfabric.server import store as store_module
from mlfabric.server.store import ParameterStore
from mlfabric.wire.protocol import Connection, Push, layout, spec_of

from support import Reference, assert_model_equal, make_model, random_update

SIZES = {"a": (1000,), "b": (33, 7), "c": (5,)}


def frame_data(update):
    """Specs, offsets and the data block of a push frame, as the server's
    receive buffer holds it (taken from the real encoder's output)."""
    specs = [spec_of(n, a) for n, a in update.items()]
    offsets, total = layout(specs)
    frame = Connection().send_bytes(Push(req=1, base_version=0, tensors=update))
    data = np.frombuffer(frame[len(frame) - total :], np.uint8).copy()
    return specs, offsets, memoryview(data)


def stage(store, update, cuts, base_version=None, flat=False):
    """`flat`: hand the tensor list over as the codec does (a tuple), so an
    update in the store's layout is fed in one kernel call (segments_stage)."""
    specs, offsets, data = frame_data(update)
    base = store.version if base_version is None else base_version
    staged = store.begin_staged(base, tuple(specs) if flat else specs, offsets)
    assert staged is not None
    for cut in cuts:
        staged.feed(data, min(cut, len(data)))
    return staged, data


@pytest.mark.parametrize("flat", [False, True], ids=["per-tensor", "flat"])
@pytest.mark.parametrize("gamma", [0.0, 0.9])
@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(0, 5000 * 4), max_size=6).map(sorted), seed=st.integers(0, 99))
def test_staged_apply_is_bit_identical_to_whole_apply(gamma, flat, cuts, seed):
    model = make_model(seed, SIZES)
    whole = ParameterStore(model, momentum=gamma)
    staged_store = ParameterStore(model, momentum=gamma)
    ref = Reference(model, gamma)
    for step in range(3):
        u = random_update(model, seed=seed * 10 + step)
        want = whole.apply(whole.version, u)
        staged, data = stage(staged_store, u, cuts, flat=flat)
        assert staged._flat is flat
        got = staged.finish(data)
        ref.apply(u)
        assert got == want
        assert_model_equal(staged_store.weights, whole.weights)
        assert_model_equal(staged_store.weights, ref.w)
        if gamma:
            assert_model_equal(staged_store.previous, whole.previous)
    assert staged_store.staged is None


def test_model_is_unchanged_until_the_staged_update_finishes():
    model = make_model(0, SIZES)
    store = ParameterStore(model, momentum=0.9)
    staged, data = stage(store, random_update(model, 1), [len(frame_data(model)[2]) // 2])
    version, snap = store.snapshot()
    assert version == 0
    assert_model_equal(snap, model)
    assert staged.finish(data).version == 1


def test_nan_in_the_last_chunk_voids_the_staging_and_the_model_stays():
    model = make_model(0, SIZES)
    store = ParameterStore(model, momentum=0.9)
    u = random_update(model, 1)
    u["c"][-1] = np.nan
    staged, data = stage(store, u, [4000])
    assert staged.finish(data) is None
    with pytest.raises(InvalidUpdate, match="'c' holds NaN") as info:
        store.apply(0, u)  # what the server falls back to
    assert info.value.reason == "nonfinite"
    assert_model_equal(store.weights, model)
    assert store.version == 0 and store.staged is None


def test_an_update_applied_meanwhile_voids_the_staging():
    model = make_model(0, SIZES)
    store = ParameterStore(model, momentum=0.5, tau_max=None)
    ref = Reference(model, 0.5)
    u1, u2 = random_update(model, 1), random_update(model, 2)
    staged, data = stage(store, u1, [100])
    assert store.begin_staged(0, *frame_data(u2)[:2]) is None  # one staging at a time
    assert store.apply(0, u2).version == 1
    ref.apply(u2)
    assert staged.finish(data) is None
    assert store.apply(0, u1).delay == 1
    ref.apply(u1)
    assert_model_equal(store.weights, ref.w)


def test_staging_is_refused_for_updates_that_will_not_apply():
    model = make_model(0, SIZES)
    store = ParameterStore(model, tau_max=0)
    specs, offsets, _ = frame_data(model)
    assert store.begin_staged(1, specs, offsets) is None  # from the future
    store.apply(0, {n: np.zeros_like(a) for n, a in model.items()})
    assert store.begin_staged(0, specs, offsets) is None  # stale
    wrong = {**model, "c": np.zeros(6, np.float32)}
    assert store.begin_staged(1, *frame_data(wrong)[:2]) is None  # wrong shape
    staged = store.begin_staged(1, specs, offsets)
    assert staged is not None
    staged.cancel()
    assert store.staged is None


def test_store_refuses_bad_models():
    with pytest.raises(ConfigError, match="no tensors"):
        ParameterStore({})
    with pytest.raises(ConfigError, match="float64; mlfabric serves float32"):
        ParameterStore({"w": np.zeros(3)})
    with pytest.raises(ConfigError, match="NaN or Inf"):
        ParameterStore({"w": np.float32([np.nan])})
    with pytest.raises(ConfigError, match="momentum must be in"):
        ParameterStore(make_model(), momentum=1.0)
    with pytest.raises(ConfigError, match="tau_max must be >= 0"):
        ParameterStore(make_model(), tau_max=-1)


def test_store_keeps_its_own_copy_of_the_initial_model():
    model = make_model()
    store = ParameterStore(model)
    model["w"][:] = 0
    assert not np.all(store.weights["w"] == 0)


# -- aggregates and update ids -----------------------------------------------------


@pytest.mark.parametrize("gamma", [0.0, 0.9])
@settings(max_examples=30, deadline=None)
@given(plan=st.lists(st.integers(1, 5), min_size=1, max_size=6), seed=st.integers(0, 99))
def test_aggregates_and_single_updates_match_the_numpy_definition(gamma, plan, seed):
    """A run of aggregates (k > 1) and single updates (k = 1) leaves exactly
    the weights of aggregation.apply_aggregate, with its versions and delays."""
    from mlfabric.scheduling.aggregation import apply_aggregate

    model = make_model(seed, SIZES)
    store = ParameterStore(model, momentum=gamma)
    w, prev, version = dict(model), dict(model), 0
    for step, k in enumerate(plan):
        updates = [random_update(model, seed=100 * step + j) for j in range(k)]
        bases = [max(0, version - j) for j in range(k)]
        uids = [f"{step}-{j}" for j in range(k)]
        w, prev, version, delays = apply_aggregate(
            w, prev, version, list(zip(updates, bases, strict=True)), gamma)
        if k == 1:
            outcome = store.apply(bases[0], updates[0], uids[0])
            assert (outcome.version, outcome.delay) == (version, delays[0])
        else:
            total = {n: functools.reduce(np.add, [u[n] for u in updates]) for n in model}
            agg = store.apply_aggregate(list(zip(uids, bases, strict=True)), total)
            assert (agg.applied, agg.version, list(agg.delays)) == (True, version, delays)
        for uid, delay in zip(uids, delays, strict=True):
            assert store.applied_before(uid).version == version
            assert store.applied_before(uid).delay == delay
    assert_model_equal(store.weights, w)


@pytest.mark.parametrize("gamma", [0.0, 0.9])
def test_a_staged_aggregate_matches_the_whole_one(gamma):
    """Staged while its bytes arrive, an aggregate leaves the weights,
    momentum history, version, delays and remembered members of
    apply_aggregate() exactly."""
    model = make_model(0, SIZES)
    staged_store = ParameterStore(model, momentum=gamma, version=4)
    whole = ParameterStore(model, momentum=gamma, version=4)
    members = [("m0", 4), ("m1", 3), ("m2", 1)]
    total = random_update(model, 7)
    specs, offsets, data = frame_data(total)
    staged = staged_store.begin_staged(0, specs, offsets, members)
    assert staged is not None
    for cut in (100, 2500, 4001):
        staged.feed(data, cut)
    assert staged_store.version == 4  # nothing served changes until the end
    assert_model_equal(staged_store.weights, model)
    got = staged.finish_aggregate(data)
    want = whole.apply_aggregate(members, total)
    assert got == want and got.version == 7 and got.delays == (0, 1, 3)
    assert_model_equal(staged_store.weights, whole.weights)
    assert_model_equal(staged_store.previous, whole.previous)
    for uid, _ in members:
        assert staged_store.applied_before(uid) == whole.applied_before(uid)
    assert staged_store.staged is None


@pytest.mark.parametrize(("members", "why"), [
    ([], "no member"),
    ([("a", 0), ("a", 0)], "a member twice"),
    ([("a", 0), ("b", 9)], "a member from the future"),
    ([("x", 1), ("done", 0)], "a member applied already"),
    ([("x", 1), ("old", 0)], "a stale member (tau_max 0)"),
])
def test_an_aggregate_that_will_not_apply_is_not_staged(members, why):
    """The whole-update path then refuses it and says why."""
    model = make_model(0, SIZES)
    store = ParameterStore(model, tau_max=0)
    store.apply(0, random_update(model, 1), uid="done")
    specs, offsets, _ = frame_data(model)
    assert store.begin_staged(0, specs, offsets, members) is None, why
    assert store.staged is None


def test_an_aggregate_with_a_stale_member_is_not_applied():
    model = make_model(0, SIZES)
    store = ParameterStore(model, tau_max=2, version=5)
    total = random_update(model, 1)
    out = store.apply_aggregate([("fresh", 5), ("old", 2)], total)
    assert (out.applied, out.version, out.delays) == (False, 5, (0, 3))
    assert out.reason == "stale: delay 3 exceeds tau_max 2; pull a fresher model (aggregate " \
                         "member 'old')"
    assert_model_equal(store.weights, model)
    assert store.applied_before("fresh") is None


@pytest.mark.parametrize(("members", "reason", "message"), [
    ([], "malformed", "at least one member"),
    ([("a", 0), ("a", 0)], "malformed", "lists a member twice"),
    ([("a", 0), ("b", 9)], "future_version", "base_version 9 is ahead"),
    ([("x", 0), ("done", 0)], "duplicate", "member 'done' was applied already"),
])
def test_a_malformed_aggregate_is_refused_and_the_model_untouched(members, reason, message):
    model = make_model(0, SIZES)
    store = ParameterStore(model)
    store.apply(0, random_update(model, 1), uid="done")
    before = {n: w.copy() for n, w in store.weights.items()}
    with pytest.raises(InvalidUpdate, match=message) as info:
        store.apply_aggregate(members, random_update(model, 2))
    assert info.value.reason == reason
    assert_model_equal(store.weights, before)
    assert store.version == 1


def test_an_update_id_is_applied_once_and_the_window_is_bounded():
    model = make_model(0, SIZES)
    store = ParameterStore(model, dedup_window=2)
    first = store.apply(0, random_update(model, 1), uid="u1")
    with pytest.raises(InvalidUpdate, match="'u1' was applied already") as info:
        store.apply(0, random_update(model, 1), uid="u1")
    assert info.value.reason == "duplicate" and store.version == 1
    assert store.applied_before("u1") == first
    store.apply(1, random_update(model, 2), uid="u2")
    store.apply(2, random_update(model, 3), uid="u3")
    assert store.applied_before("u1") is None  # the oldest is forgotten past the window
    assert [store.applied_before(u).version for u in ("u2", "u3")] == [2, 3]


# -- the model stays finite ---------------------------------------------------------


def _near_overflow(momentum: float) -> tuple[ParameterStore, dict[str, np.ndarray]]:
    big = np.float32(3.0e38)
    model = {"w": np.array([1.0, big, -2.0], np.float32), "b": np.zeros(2, np.float32)}
    store = ParameterStore(model, momentum=momentum)
    store.apply(0, {"w": np.array([0.5, 0.0, 0.0], np.float32), "b": np.ones(2, np.float32)})
    return store, model


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_an_update_that_would_overflow_the_model_is_refused_and_changes_nothing(momentum):
    """A finite update (3e38 + 1e38 overflows float32) used to take the model
    to Inf, and then to NaN."""
    store, _ = _near_overflow(momentum)
    before = ({n: w.copy() for n, w in store.weights.items()},
              {n: p.copy() for n, p in store.previous.items()}, store.version)
    update = {"w": np.array([0.0, 1.0e38, 0.0], np.float32), "b": np.ones(2, np.float32)}
    with pytest.raises(InvalidUpdate, match=r"applying this update would make tensor 'w' "
                                            r"non-finite .* the model was left as it was") as e:
        store.apply(1, update, uid="u-1")
    assert e.value.reason == "overflow"
    assert store.version == before[2] and store.applied_before("u-1") is None
    assert_model_equal(store.weights, before[0])
    assert_model_equal(store.previous, before[1])
    # A later update applies exactly as if the refused one never came.
    ok = {"w": np.array([1.0, -1.0e37, 0.0], np.float32), "b": np.ones(2, np.float32)}
    ref = ParameterStore(dict(before[0]), momentum=momentum)
    ref.previous = {n: p.copy() for n, p in before[1].items()}
    ref.version = before[2]
    assert store.apply(1, ok).version == ref.apply(1, ok).version == 2
    assert_model_equal(store.weights, ref.weights)


def test_an_aggregate_that_would_overflow_is_refused_too():
    store, _ = _near_overflow(0.5)
    total = {"w": np.array([0.0, 2.0e38, 0.0], np.float32), "b": np.zeros(2, np.float32)}
    with pytest.raises(InvalidUpdate) as e:
        store.apply_aggregate([("a", 1), ("b", 1)], total)
    assert e.value.reason == "overflow" and store.version == 1


def test_a_staged_update_that_would_overflow_is_voided_then_refused_whole():
    store, _ = _near_overflow(0.9)
    w_before = {n: w.copy() for n, w in store.weights.items()}
    update = {"w": np.array([0.0, 1.0e38, 0.0], np.float32), "b": np.ones(2, np.float32)}
    specs = store.specs
    offsets, nbytes = layout(specs)
    data = np.zeros(nbytes, np.uint8)
    for sp, off in zip(specs, offsets, strict=True):
        data[off:off + sp.nbytes] = np.frombuffer(update[sp.name].tobytes(), np.uint8)
    staged = store.begin_staged(1, specs, offsets)
    assert staged is not None
    assert staged.finish(memoryview(data)) is None  # void: would overflow
    with pytest.raises(InvalidUpdate, match="non-finite"):
        store.apply(1, update)
    assert_model_equal(store.weights, w_before)


def test_with_allow_nonfinite_the_overflow_is_applied_as_before():
    big = np.float32(3.0e38)
    store = ParameterStore({"w": np.array([big], np.float32)}, allow_nonfinite=True)
    store.apply(0, {"w": np.array([big], np.float32)})
    assert np.isinf(store.weights["w"][0])


def test_an_update_holding_nan_is_refused_as_nonfinite_even_if_it_would_also_overflow():
    store, _ = _near_overflow(0.9)
    update = {"w": np.array([0.0, 1.0e38, 0.0], np.float32),
              "b": np.array([np.nan, 0.0], np.float32)}
    with pytest.raises(InvalidUpdate, match=r"tensor 'b' holds NaN or Inf") as e:
        store.apply(1, update)
    assert e.value.reason == "nonfinite" and store.version == 1


def test_a_staged_aggregate_that_would_overflow_is_voided_and_changes_nothing():
    store, _ = _near_overflow(0.9)
    before = ({n: w.copy() for n, w in store.weights.items()},
              {n: p.copy() for n, p in store.previous.items()})
    total = {"w": np.array([0.0, 1.0e38, 0.0], np.float32), "b": np.ones(2, np.float32)}
    specs, offsets, data = frame_data(total)
    staged = store.begin_staged(0, specs, offsets, [("a", 1), ("b", 1)])
    assert staged is not None
    assert staged.finish_aggregate(data) is None
    with pytest.raises(InvalidUpdate) as e:
        store.apply_aggregate([("a", 1), ("b", 1)], total)
    assert e.value.reason == "overflow"
    assert store.version == 1 and store.applied_before("a") is None
    assert_model_equal(store.weights, before[0])
    assert_model_equal(store.previous, before[1])


def test_a_replica_applies_what_its_server_applied_even_an_overflow():
    """The server (allow_nonfinite) applied it; a replica that refused would
    be stuck behind it for good."""
    big = np.float32(3.0e38)
    server = ParameterStore({"w": np.array([big, 1.0], np.float32)}, allow_nonfinite=True)
    replica = ParameterStore({"w": np.array([big, 1.0], np.float32)})
    u = {"w": np.array([big, 1.0], np.float32)}
    server.apply(0, u)
    assert replica.apply_sequenced(1, 0, u).version == 1
    assert_model_equal(replica.weights, server.weights)
    assert np.isinf(replica.weights["w"][0])


# -- the norms of applied updates ------------------------------------------------


def reference_norm(update):
    """How a worker computes the norm it reports (control_book.controlled_update)."""
    norms = [_core.l2_norm(np.asarray(a).reshape(-1)) for a in update.values()]
    return math.sqrt(sum(n * n for n in norms))


@pytest.mark.parametrize("gamma", [0.0, 0.9])
def test_every_applied_update_norm_is_recorded_by_the_version_it_produced(gamma):
    model = make_model(0, SIZES)
    store = ParameterStore(model, momentum=gamma, version=10)
    assert store.norms_since(0) == (11, []) and store.last_norm is None
    updates = [{n: u * np.float32(s) for n, u in random_update(model, s).items()}
               for s in (1, 2, 3)]
    for u in updates:
        store.apply(store.version, u)
    want = [reference_norm(u) for u in updates]
    assert len(set(want)) == 3
    # The whole-update path sums the tensors' norms as workers do: exact.
    assert store.norms_since(10) == (11, want)
    assert store.norms_since(0) == (11, want)  # older versions: unknown
    assert store.norms_since(11) == (12, want[1:])
    assert store.norms_since(10, limit=2) == (11, want[:2])
    assert store.norms_since(13) == (14, [])
    assert store.norms_since(99) == (100, [])
    assert store.last_norm == want[-1]


def test_refused_and_stale_updates_record_no_norm():
    model = make_model(0, SIZES)
    store = ParameterStore(model, tau_max=0)
    store.apply(0, random_update(model, 1))
    assert not store.apply(0, random_update(model, 2)).applied  # stale
    bad = random_update(model, 3)
    bad["a"][5] = np.inf
    with pytest.raises(InvalidUpdate):
        store.apply(1, bad)
    assert store.norms_since(0) == (1, [reference_norm(random_update(model, 1))])


@pytest.mark.parametrize("gamma", [0.0, 0.9])
def test_a_staged_update_records_its_norm_chunk_by_chunk(gamma):
    model = make_model(0, SIZES)
    store = ParameterStore(model, momentum=gamma)
    u = random_update(model, 4)
    staged, data = stage(store, u, [7, 1000, 2999, 4004, 4500])
    assert staged.finish(data).version == 1
    first, norms = store.norms_since(0)
    assert first == 1 and len(norms) == 1
    # Partial sums per chunk add up in another order: equal to rounding.
    assert norms[0] == pytest.approx(reference_norm(u), rel=1e-14)
    assert store.last_norm == norms[0]


def test_an_aggregate_records_its_sum_norm_at_its_last_version_and_zero_before():
    """One momentum step with the sum: no step at the versions it skips."""
    model = make_model(0, SIZES)
    whole = ParameterStore(model, momentum=0.9, version=4)
    staged_store = ParameterStore(model, momentum=0.9, version=4)
    members = [("m0", 4), ("m1", 3), ("m2", 1)]
    total = random_update(model, 7)
    whole.apply_aggregate(members, total)
    specs, offsets, data = frame_data(total)
    staged = staged_store.begin_staged(0, specs, offsets, members)
    assert staged is not None
    staged.feed(data, 3000)
    assert staged.finish_aggregate(data).version == 7
    assert whole.norms_since(4) == (5, [0.0, 0.0, reference_norm(total)])
    first, norms = staged_store.norms_since(4)
    assert first == 5 and norms[:2] == [0.0, 0.0]
    assert norms[2] == pytest.approx(reference_norm(total), rel=1e-14)


@pytest.mark.parametrize("gamma", [0.0, 0.9])
def test_a_replica_records_the_norms_its_server_recorded(gamma):
    """A replica promoted to server reports norms too; and its step (in
    place: it never refuses) is bit-identical to the server's (into the
    spare buffers, checked)."""
    model = make_model(0, SIZES)
    server = ParameterStore(model, momentum=gamma)
    replica = ParameterStore(model, momentum=gamma)
    for s in range(4):
        u = random_update(model, s)
        server.apply(server.version, u)
        replica.apply_sequenced(replica.version + 1, server.version - 1, u)
        assert_model_equal(replica.weights, server.weights)
        assert_model_equal(replica.previous, server.previous)
    assert replica.norms_since(0) == server.norms_since(0)


def test_aggregates_are_listed_as_spans_and_norms_never_end_inside_one():
    """The divergence gate counts steps: the heartbeat's norms carry each
    aggregate's span, and a list cut at `limit` ends where a step ends."""
    model = make_model(0, SIZES)
    store = ParameterStore(model, momentum=0.9)
    u = [random_update(model, s) for s in range(6)]
    store.apply(0, u[0])  # version 1
    store.apply_aggregate([("a", 1), ("b", 1), ("c", 1)],
                          {n: u[1][n] + u[2][n] + u[3][n] for n in model})  # 2..4
    store.apply(4, u[4])  # 5
    store.apply_aggregate([("d", 5), ("e", 5)], {n: u[5][n] + u[0][n] for n in model})  # 6..7
    assert store.spans_between(1, 7) == [(4, 3), (7, 2)]
    assert store.spans_between(5, 6) == []
    first, norms = store.norms_since(0)
    assert first == 1 and len(norms) == 7 and norms[1:3] == [0.0, 0.0]
    for limit, last in ((1, 1), (2, 1), (3, 1), (4, 4), (5, 5), (6, 5), (7, 7)):
        assert store.norms_since(0, limit) == (1, norms[:last]), limit
    # A replica that replays the same steps lists the same spans.
    replica = ParameterStore(model, momentum=0.9)
    replica.apply_sequenced(1, 0, u[0])
    replica.apply_sequenced_aggregate(2, [(1, u[1]), (1, u[2]), (1, u[3])])
    replica.apply_sequenced(5, 4, u[4])
    replica.apply_sequenced_aggregate(6, [(5, u[5]), (5, u[0])])
    assert replica.spans_between(1, 7) == store.spans_between(1, 7)
    assert_model_equal(replica.weights, store.weights)


def test_norms_before_a_version_set_from_outside_are_unknown():
    """A replica's resync writes the server's state and version into its
    store: the norms of the versions it skipped were never seen here."""
    model = make_model(0, SIZES)
    store = ParameterStore(model)
    store.apply(0, random_update(model, 1))
    store.version = 50
    assert store.norms_since(0) == (51, [])
    u = random_update(model, 2)
    store.apply(50, u)
    assert store.norms_since(0) == (51, [reference_norm(u)])


def test_the_norm_window_keeps_the_newest_versions(monkeypatch):
    monkeypatch.setattr(store_module, "NORM_WINDOW", 8)
    model = {"w": np.zeros(3, np.float32)}
    store = ParameterStore(model)
    norms = []
    for s in range(1, 12):
        u = {"w": np.full(3, s, np.float32)}
        store.apply(store.version, u)
        norms.append(reference_norm(u))
    # Versions 1..11 applied; the window holds 4..11.
    assert store.norms_since(0) == (4, norms[3:])
    assert store.norms_since(0, limit=3) == (4, norms[3:6])
    assert store.norms_since(9) == (10, norms[9:])
    # An aggregate of more members than the window: only its zeros fit.
    store.apply_aggregate([(f"m{i}", store.version) for i in range(20)], {"w": np.ones(3,
                                                                             np.float32)})
    assert store.version == 31
    assert store.norms_since(0) == (24, [0.0] * 7 + [math.sqrt(3.0)])
    assert store.spans_between(0, 31) == [(31, 20)]
    # Spans leave with their version's norm.
    store.apply_aggregate([("a", 31), ("b", 31)], {"w": np.ones(3, np.float32)})  # 33
    for _ in range(6):
        store.apply(store.version, {"w": np.ones(3, np.float32)})
    assert store.version == 39
    assert store.spans_between(0, 39) == [(33, 2)]
    assert store.norms_since(0, limit=1) == (32, [])  # 32 is inside the aggregate at 33
    with pytest.raises(ValueError, match="limit must be >= 0, got -1"):
        store.norms_since(0, limit=-1)


def test_with_allow_nonfinite_the_norm_of_a_nonfinite_update_is_recorded():
    store = ParameterStore({"w": np.zeros(2, np.float32)}, allow_nonfinite=True)
    store.apply(0, {"w": np.array([np.inf, 1.0], np.float32)})
    assert store.norms_since(0) == (1, [math.inf])


# --- a received push: the store decides how it is applied ---------------------------


def test_the_store_decides_which_arriving_pushes_are_staged_and_how_they_end():
    model = make_model(sizes=SIZES)
    store = ParameterStore(model, momentum=0.9)
    u = random_update(model, seed=1)
    specs, _, data = frame_data(u)
    head = Push(req=1, base_version=0, tensors={}, uid="w-1")
    nbytes = len(data)
    # Too small, or sequenced (only a replica takes those): applied whole.
    assert store.stage_for(head, specs, nbytes, nbytes + 1) is None
    assert store.stage_for(head, specs, nbytes, None) is None
    seq_head = Push(req=1, base_version=0, tensors={}, seq=5)
    assert store.stage_for(seq_head, specs, nbytes, 1) is None
    # Staged, fed, and finished by apply_push with the whole update's result.
    staged = store.stage_for(head, specs, nbytes, 1)
    assert staged is not None and staged.uids == ("w-1",)
    staged.feed(data, nbytes)
    outcome, duplicate = store.apply_push(
        Push(req=1, base_version=0, tensors=u, uid="w-1"), staged, data)
    assert (outcome.applied, outcome.version, duplicate) == (True, 1, False)
    want = Reference(model, 0.9)
    want.apply(u)
    assert_model_equal(store.weights, want.w)
    # The same uid again: not staged, answered with its first outcome, not applied.
    assert store.stage_for(head, specs, nbytes, 1) is None
    again, duplicate = store.apply_push(Push(req=2, base_version=0, tensors=u, uid="w-1"),
                                        None, None)
    assert (again, duplicate, store.version) == (outcome, True, 1)
    assert_model_equal(store.weights, want.w)


# -- a push in the store's own layout: applied over its data block in one call ---------


def decoded_push(update, base_version, uid=None):
    """The Push event a server decodes from the real encoder's frame."""
    conn = Connection()
    conn.receive_data(Connection().send_bytes(Push(req=1, base_version=base_version,
                                                   tensors=update, uid=uid)))
    return conn.next_event()


@pytest.mark.parametrize("gamma", [0.0, 0.9])
def test_a_push_in_the_stores_layout_is_applied_flat_bit_for_bit(gamma):
    sizes = {f"t{i:03d}": (7 + i % 5, 3) for i in range(200)}
    model = make_model(1, sizes)
    flat, per_tensor = (ParameterStore(model, momentum=gamma, tau_max=3) for _ in range(2))
    ref = Reference(model, gamma)
    for step in range(4):
        u = random_update(model, seed=step)
        push = decoded_push(u, base_version=flat.version, uid=f"u{step}")
        assert flat.flat_layout(push.tensors.specs)
        got, duplicate = flat.apply_push(push, None, None)
        want = per_tensor.apply(per_tensor.version, u, uid=f"u{step}")
        ref.apply(u)
        assert not duplicate and got == want
        assert_model_equal(flat.weights, ref.w)
        assert_model_equal(flat.previous, per_tensor.previous)
        assert flat.norms_since(0) == per_tensor.norms_since(0)  # the norms bit for bit
    # Its tensors were never made into views: nothing but the block was read.
    assert push.tensors._views is None
    # A duplicate uid, a stale base and the tensor order of another client
    # behave as on the per-tensor path.
    again = decoded_push(u, base_version=flat.version, uid="u3")
    assert flat.apply_push(again, None, None) == (flat.applied_before("u3"), True)
    stale = flat.apply_push(decoded_push(u, base_version=0), None, None)[0]
    assert not stale.applied and stale.reason.startswith("stale: delay 4 exceeds tau_max 3")
    reordered = decoded_push(dict(reversed(list(u.items()))), base_version=flat.version)
    assert not flat.flat_layout(reordered.tensors.specs)
    assert flat.apply_push(reordered, None, None)[0].applied


def test_a_flat_push_holding_nan_or_overflowing_names_its_tensor_and_changes_nothing():
    model = make_model(2, {"a": (100,), "b": (10,), "c": (50,)})
    store = ParameterStore(model, momentum=0.5)
    before = {n: w.copy() for n, w in store.weights.items()}
    bad = {n: np.zeros_like(w) for n, w in model.items()}
    bad["b"][3] = np.nan
    with pytest.raises(InvalidUpdate, match="'b' holds NaN or Inf") as exc:
        store.apply_push(decoded_push(bad, 0), None, None)
    assert exc.value.reason == "nonfinite"
    huge = {n: np.zeros_like(w) for n, w in model.items()}
    huge["c"][:] = np.float32(3e38)
    store.weights["c"][...] = np.float32(3e38)
    before["c"][...] = np.float32(3e38)
    with pytest.raises(InvalidUpdate, match="tensor 'c' non-finite") as exc:
        store.apply_push(decoded_push(huge, 0), None, None)
    assert exc.value.reason == "overflow"
    assert store.version == 0
    assert_model_equal(store.weights, before)


def test_the_tensors_are_views_of_one_buffer_through_rotations():
    model = make_model(3, SIZES)
    store = ParameterStore(model, momentum=0.9)
    for step in range(3):
        store.apply_push(decoded_push(random_update(model, step), store.version), None, None)
        for name, w in store.weights.items():
            assert np.shares_memory(w, store._flat_w)
            assert np.shares_memory(store.previous[name], store._flat_prev)
            assert np.shares_memory(store.spare[name], store._flat_spare)
    # The padding between tensors stays zero.
    used = np.zeros(store._flat_w.size, bool)
    for a, n in zip(store._starts, store._counts, strict=True):
        used[a:a + n] = True
    assert not store._flat_w[~used].any() and not store._flat_prev[~used].any()
