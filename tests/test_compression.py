"""Compressed updates with error feedback (issue 35): each codec against a
numpy reference, error feedback conserving the sum, and the receiver's
bound check refusing what is malformed."""

from __future__ import annotations

import math

import numpy as np
import pytest

import mlfabric
from mlfabric.compression import ErrorFeedback, _kernels, check, decode, parse
from mlfabric.compression.codecs import Encoded, LowRank, RandK, TopK, sent_count
from mlfabric.errors import ConfigError, InvalidUpdate

from support import (
    JOB,
    TOKEN,
    RawClient,
    Reference,
    ServerThread,
    assert_model_equal,
    make_model,
    random_update,
)

SPECS = ["none", "fp16", "bf16", "topk:0.1", "randk:0.1", "lowrank:2"]


def wide(n: int, seed: int = 0) -> np.ndarray:
    """float32 values over the whole of fp16's range and past it: subnormals,
    normals, values that clamp, zeros, exact ties."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * np.exp(rng.uniform(-32, 13, n))
    x = x.astype(np.float32)
    x[:8] = [0.0, 65504.0, 65520.0, -70000.0, 2.0 ** -25, 3 * 2.0 ** -25, 1 + 2.0 ** -11,
             1 + 3 * 2.0 ** -11]  # ties: to even (down, then up)
    return x


def bf16_reference(acc: np.ndarray) -> np.ndarray:
    """numpy's float32 -> bfloat16 bits, rounded to nearest even, clamped."""
    top = np.float32(np.uint32(0x7F7F0000).view(np.float32))
    u = np.clip(acc, -top, top).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


@pytest.fixture(params=["f16c", "portable"])
def f16c(request):
    """The fp16 kernels on the CPU's F16C conversions (where it has them) and
    on the portable loops: both must round as numpy does."""
    if request.param == "f16c" and not _kernels.uses_f16c():
        pytest.skip("this CPU has no F16C: only the portable loops run here")
    old = _kernels.set_f16c(request.param == "f16c")
    yield request.param
    _kernels.set_f16c(old)


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_the_fused_cast_rounds_as_numpy_and_keeps_the_rest_exactly(fmt, f16c):
    n = 200_003  # not a multiple of 8: the vector loop's tail too
    x = wide(n)
    r = (wide(n, seed=1) * np.float32(1e-3)).astype(np.float32)
    acc = x + r  # what the kernel sends, rounded as numpy adds
    h = np.empty(len(x), np.uint16)
    kernel = _kernels.ef_half if fmt == "fp16" else _kernels.ef_bf16
    r_after = r.copy()
    kernel(x, r_after, h)
    if fmt == "fp16":
        want = np.clip(acc, -65504, 65504).astype(np.float16).view(np.uint16)
        decoded = want.view(np.float16).astype(np.float32)
    else:
        want = bf16_reference(acc)
        decoded = (want.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(h, want)
    out = np.empty(len(x), np.float32)
    (_kernels.half_to_float if fmt == "fp16" else _kernels.bf16_to_float)(h, out)
    np.testing.assert_array_equal(out, decoded)
    # Nothing lost: sent + kept is acc, bit for bit (the clamped ones too).
    np.testing.assert_array_equal(out + r_after, acc)
    assert np.all(np.isfinite(out))


def test_the_kernels_refuse_arrays_of_different_lengths():
    with pytest.raises(ValueError, match="differ in length: 3, 2, 3"):
        _kernels.ef_half(np.zeros(3, np.float32), np.zeros(2, np.float32),
                       np.zeros(3, np.uint16))


def test_topk_sends_the_largest_in_magnitude_and_keeps_the_rest_exactly():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((40, 25)).astype(np.float32)
    r = rng.standard_normal((40, 25)).astype(np.float32)
    acc = x + r
    codec = TopK(0.05)
    r_after = r.copy()
    e = codec.encode(x, r_after)
    k = sent_count(0.05, 1000)
    assert k == 50 and e.arrays["i"].dtype == np.int32 and len(e.arrays["i"]) == k
    assert np.all(np.diff(e.arrays["i"]) > 0)
    largest = np.sort(np.abs(acc).ravel())[-k:]
    np.testing.assert_array_equal(np.sort(np.abs(e.arrays["v"])), largest)
    np.testing.assert_array_equal(e.arrays["v"], acc.ravel()[e.arrays["i"]])
    d = decode(e)
    assert d.shape == (40, 25) and np.count_nonzero(d) == k
    np.testing.assert_array_equal(d + r_after, acc)
    assert codec.encoded_bytes((40, 25)) == e.nbytes == k * 8


def test_randk_sends_distinct_random_elements():
    x = np.arange(1, 1001, dtype=np.float32)
    codec = RandK(0.01, seed=7)
    r = np.zeros_like(x)
    first = codec.encode(x, r)
    i = first.arrays["i"]
    assert len(i) == 10 and np.all(np.diff(i) > 0)
    np.testing.assert_array_equal(first.arrays["v"], x[i])
    np.testing.assert_array_equal(decode(first) + r, x)
    second = codec.encode(np.zeros_like(x), r)  # another draw, from what was kept
    assert not np.array_equal(second.arrays["i"], i)


def test_lowrank_recovers_a_low_rank_update_and_keeps_what_it_missed():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((64, 2)), rng.standard_normal((2, 48))
    x = (a @ b).astype(np.float32).reshape(64, 6, 8)  # rank 2, seen as 64 x 48
    codec = LowRank(2)
    r = np.zeros_like(x)
    e = codec.encode(x, r, key="w")
    assert e.arrays["p"].shape == (64, 2) and e.arrays["q"].shape == (48, 2)
    p = e.arrays["p"]
    np.testing.assert_allclose(p.T @ p, np.eye(2), atol=1e-5)  # orthonormal
    d = decode(e)
    # The fixed-order product: each element the rank's sum in double, rounded once.
    want = (p.astype(np.float64) @ e.arrays["q"].T.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(d, want.reshape(x.shape))
    # One power iteration from a random start already spans a rank-2 matrix.
    assert np.linalg.norm(r) <= 1e-4 * np.linalg.norm(x)
    np.testing.assert_allclose(d + r, x, rtol=0, atol=1e-5 * float(np.abs(x).max()))
    assert codec.encoded_bytes(x.shape) == e.nbytes == 4 * 2 * (64 + 48)
    # The warm start is kept per tensor.
    assert set(codec.q) == {"w"}


def test_lowrank_sends_small_and_1d_tensors_as_they_are():
    codec = LowRank(4)
    for shape in [(10,), (4, 4), (3, 100)]:  # 1-D; 4*(4+4) >= 16; 4*(3+100) >= 300
        x = np.ones(shape, np.float32)
        r = np.full(shape, 0.5, np.float32)
        e = codec.encode(x, r)
        assert e.codec == "none" and codec.encoded_bytes(shape) == e.nbytes
        np.testing.assert_array_equal(decode(e), np.full(shape, 1.5, np.float32))
        assert not r.any()


def dyadic_updates(steps: int, shape: tuple[int, ...], seed: int) -> list[np.ndarray]:
    """Multiples of 2^-20 between 2^-10 and 1 in magnitude: every value the
    codecs send or keep, and every sum of a few of them, is exact in
    float32, so conservation can be checked bit for bit."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        k = rng.integers(1 << 10, 1 << 20, shape) * rng.choice([-1, 1], shape)
        out.append((k * 2.0 ** -20).astype(np.float32))
    return out


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "topk:0.1", "randk:0.1"])
def test_error_feedback_conserves_the_sum_exactly(spec):
    """What was pushed (decoded) plus the residual equals what was computed,
    bit for bit, over pushes and a dropped update folded in."""
    fb = ErrorFeedback(parse(spec))
    updates = {n: dyadic_updates(5, shape, seed) for seed, (n, shape) in
               enumerate({"w": (30, 20), "b": (20,)}.items())}
    sent = {n: np.zeros(u[0].shape, np.float32) for n, u in updates.items()}
    for step in range(5):
        update = {n: u[step] for n, u in updates.items()}
        if step == 2:
            fb.fold(update)  # dropped by the controller: kept, not lost
            continue
        for n, e in fb.encode(update).items():
            check(e, updates[n][0].shape)
            sent[n] += decode(e)
    for n, u in updates.items():
        computed = np.sum(u, axis=0, dtype=np.float64)
        assert np.array_equal((sent[n].astype(np.float64) + fb.residual[n]), computed), n
    assert fb.norm() >= 0.0


def test_error_feedback_with_lowrank_conserves_the_sum_to_rounding():
    rng = np.random.default_rng(4)
    fb = ErrorFeedback(LowRank(2))
    total = np.zeros((50, 40))
    sent = np.zeros((50, 40))
    for _ in range(6):
        u = rng.standard_normal((50, 40)).astype(np.float32)
        total += u
        sent += decode(fb.encode({"w": u})["w"])
    np.testing.assert_allclose(sent + fb.residual["w"], total, rtol=0, atol=1e-4)
    # Over the pushes the residual stays bounded: a power iteration per push
    # sends the largest directions of what waits.
    assert np.linalg.norm(fb.residual["w"]) < np.linalg.norm(total)


def test_error_feedback_refuses_other_dtypes_with_the_fix():
    with pytest.raises(ConfigError, match="tensor 'w' is float64: cast the model to float32"):
        ErrorFeedback(parse("fp16")).encode({"w": np.zeros(3)})


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", [(1,), (7,), (33, 17), (8, 4, 5)])
def test_the_wire_size_is_known_before_encoding(spec, shape):
    """The controller plans with encoded_bytes: it must be the size sent."""
    codec = parse(spec)
    x = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    e = codec.encode(x, np.zeros_like(x), key="t")
    assert codec.encoded_bytes(shape) == e.nbytes
    check(e, shape)
    assert decode(e).shape == shape


@pytest.mark.parametrize("spec, message", [
    ("zip", "unknown compression 'zip': use one of none, fp16, bf16, topk:F, randk:F, "
            "lowrank:R"),
    ("topk", "topk needs the fraction of elements to send, in (0, 1], e.g. topk:0.01"),
    ("randk:2", "randk needs the fraction"),
    ("topk:nan", "topk needs the fraction"),
    ("lowrank:0", "lowrank needs a rank 1..1024, e.g. lowrank:4"),
    ("lowrank:x", "lowrank needs a rank"),
    ("fp16:2", "fp16 takes no parameter"),
])
def test_bad_compression_settings_say_what_to_give(spec, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[")):
        parse(spec)


def test_specs_read_back():
    assert [parse(s).spec for s in SPECS] == SPECS


def _sparse(i, v, codec="topk", shape=(10,)):
    return Encoded(codec, shape, {"i": np.asarray(i), "v": np.asarray(v, np.float32)})


I32 = np.int32
MALFORMED = [
    (_sparse(np.array([1, 10], I32), [1, 2]), "index out of range 0..9: first 1, last 10"),
    (_sparse(np.array([-1, 3], I32), [1, 2]), "index out of range 0..9: first -1"),
    (_sparse(np.array([3, 3], I32), [1, 2]), "strictly increasing"),
    (_sparse(np.array([4, 3], I32), [1, 2]), "strictly increasing"),
    (_sparse(np.array([1, 3], I32), [1, np.inf]), "holds 1 non-finite value"),
    (_sparse(np.array([1, 3], I32), [np.nan, 2], codec="randk"), "holds 1 non-finite"),
    (_sparse(np.array([1, 3], np.float32), [1, 2]), "array 'i' of a topk tensor must be "
                                                    "int32 or int64, got float32"),
    (_sparse(np.array([1, 3], I32), [1, 2, 3]), "must have shape (2,), got (3,)"),
    (_sparse(np.arange(11, dtype=I32), np.ones(11)), "at most the tensor's 10 elements"),
    (Encoded("topk", (10,), {"i": np.array([1], I32)}), "needs its array 'v'"),
    (Encoded("fp16", (10,), {"h": np.full(10, 0x7C00, np.uint16)}),
     "holds 10 non-finite value"),
    (Encoded("bf16", (10,), {"h": np.full(10, 0xFFC0, np.uint16)}), "non-finite"),
    (Encoded("fp16", (10,), {"h": np.zeros(10, np.float16)}), "must be uint16"),
    (Encoded("fp16", (10,), {"h": np.zeros(9, np.uint16)}), "must have shape (10,), got (9,)"),
    (Encoded("fp16", (10,), {"h": np.zeros(10, np.uint16), "x": np.zeros(1)}),
     "has no array 'x'"),
    (Encoded("none", (10,), {"v": np.zeros(10)}), "must be float32, got float64"),
    (Encoded("gzip", (10,), {}), "unknown compression 'gzip'"),
    (Encoded("fp16", (5, 2), {"h": np.zeros(10, np.uint16)}),
     "compressed as shape (5, 2), the tensor is (10,)"),
    (Encoded("lowrank", (10,), {"p": np.zeros((10, 1), np.float32),
                                "q": np.zeros((1, 1), np.float32)}),
     "lowrank is for tensors of 2 or more axes; this one has shape (10,)"),
    (Encoded("lowrank", (6, 4), {"p": np.zeros((6, 5), np.float32),
                                 "q": np.zeros((4, 5), np.float32)}),
     "lowrank's P must be 6 x R with 1 <= R <= 4, got shape (6, 5)"),
    (Encoded("lowrank", (6, 4), {"p": np.zeros((6, 2), np.float32),
                                 "q": np.zeros((2, 4), np.float32)}),
     "array 'q' of a lowrank tensor must have shape (4, 2), got (2, 4)"),
    (Encoded("lowrank", (6, 4), {"p": np.full((6, 2), np.nan, np.float32),
                                 "q": np.zeros((4, 2), np.float32)}), "non-finite"),
]


@pytest.mark.parametrize("encoded, message", MALFORMED)
def test_a_malformed_compressed_tensor_is_refused_with_the_reason(encoded, message):
    shape = (6, 4) if encoded.codec == "lowrank" and encoded.shape == (6, 4) else (10,)
    with pytest.raises(InvalidUpdate) as info:
        check(encoded, shape, "tensor 'w'")
    assert message in str(info.value)
    assert str(info.value).startswith("tensor 'w': ")


def test_a_well_formed_one_passes_and_decodes_in_place():
    e = _sparse(np.array([0, 9], I32), [1.5, -2.0])
    check(e, (10,))
    out = np.full(10, 7.0, np.float32)
    assert decode(e, out) is out
    np.testing.assert_array_equal(out, [1.5, 0, 0, 0, 0, 0, 0, 0, 0, -2.0])
    assert math.isclose(float(np.abs(out).sum()), 3.5)


# --- the server's side: compressed pushes over the wire ---------------------------------


def _compressed_push(req: int, encoded: dict[str, Encoded], base: int = 0):
    from mlfabric.wire.protocol import PART_SEP, Push

    return Push(req=req, base_version=base,
                tensors={f"{n}{PART_SEP}{p}": a for n, e in encoded.items()
                         for p, a in e.arrays.items()},
                codecs=tuple((n, e.codec) for n, e in encoded.items()))


@pytest.mark.parametrize("spec", SPECS)
def test_the_server_applies_a_compressed_push_as_its_decoded_update(spec):
    """Each codec over the wire: the server decodes, then applies with its
    kernels, bit for bit as the numpy update rule applied to the decoded
    update. The counter says which codec."""
    from mlfabric.server.store import ParameterStore
    from mlfabric.wire.protocol import PushResult

    model = make_model(sizes={"w": (40, 30), "b": (30,)})
    ref = Reference(model, 0.5)
    fb = ErrorFeedback(parse(spec))
    with ServerThread(ParameterStore(model, momentum=0.5)) as st:
        raw = RawClient(st.port, job=JOB)
        for step in range(3):
            update = {n: np.random.default_rng(step).standard_normal(a.shape).astype(np.float32)
                      for n, a in model.items()}
            encoded = fb.encode(update)
            raw.send(_compressed_push(step + 1, encoded, base=step))
            answer = raw.recv_event()
            assert isinstance(answer, PushResult) and answer.applied, answer
            ref.apply({n: decode(e) for n, e in encoded.items()})
        assert_model_equal(st.server.store.weights, ref.w)
        codec = spec.partition(":")[0]
        counted = st.server.metrics.compressed_tensors.labels(codec)._value.get()
        # low rank sends the 1-D bias as it is ("none")
        assert counted == (3 if codec == "lowrank" else 6)


MALFORMED_PUSHES = [
    ("an index past the tensor", "topk:0.1", lambda a: {**a, "i": a["i"] + 1200},
     "index out of range 0..1199", "malformed"),
    ("a NaN value", "topk:0.1", lambda a: {**a, "v": np.full_like(a["v"], np.nan)},
     "non-finite", "nonfinite"),
    ("a wrong rank", "lowrank:2", lambda a: {"p": a["p"], "q": a["q"][:, :1].copy()},
     "array 'q' of a lowrank tensor must have shape (30, 2), got (30, 1)", "malformed"),
    ("an inf code", "fp16", lambda a: {"h": np.full_like(a["h"], 0x7C00)}, "non-finite",
     "nonfinite"),
    ("indices as floats", "topk:0.1", lambda a: {**a, "i": a["i"].astype(np.float32)},
     "must be int32 or int64, got float32", "malformed"),
]


@pytest.mark.parametrize("what, spec, spoil, message, reason", MALFORMED_PUSHES,
                         ids=[m[0] for m in MALFORMED_PUSHES])
def test_a_malformed_compressed_push_is_refused_and_the_model_untouched(
        what, spec, spoil, message, reason):
    from mlfabric.server.store import ParameterStore
    from mlfabric.wire.protocol import Error

    model = make_model(sizes={"w": (40, 30), "b": (30,)})
    codec = parse(spec)
    encoded = {n: codec.encode(np.ones_like(a), np.zeros_like(a), key=n)
               for n, a in model.items()}
    encoded["w"] = Encoded(encoded["w"].codec, (40, 30), spoil(dict(encoded["w"].arrays)))
    with ServerThread(ParameterStore(model, momentum=0.5)) as st:
        raw = RawClient(st.port, job=JOB)
        raw.send(_compressed_push(1, encoded))
        answer = raw.recv_event()
        assert isinstance(answer, Error) and answer.code == reason, answer
        assert message in answer.message and answer.message.startswith("tensor 'w': ")
        assert st.server.store.version == 0
        assert_model_equal(st.server.store.weights, model)
        assert st.server.metrics.updates_rejected.labels(reason)._value.get() == 1


def test_a_compressed_push_must_cover_the_model():
    from mlfabric.server.store import ParameterStore
    from mlfabric.wire.protocol import Error

    model = make_model(sizes={"w": (40, 30), "b": (30,)})
    codec = parse("fp16")
    only_w = {"w": codec.encode(np.ones((40, 30), np.float32), np.zeros((40, 30), np.float32))}
    with ServerThread(ParameterStore(model)) as st:
        raw = RawClient(st.port, job=JOB)
        raw.send(_compressed_push(1, only_w))
        answer = raw.recv_event()
        assert isinstance(answer, Error) and answer.code == "unknown_tensor"
        assert "compressed update lacks tensor 'b'" in answer.message


def test_the_metrics_know_every_codec():
    from mlfabric.compression import NAMES
    from mlfabric.runtime.metrics import COMPRESSION_CODECS

    assert COMPRESSION_CODECS == NAMES


# --- the worker's side: mlfabric.connect(compression=...) -------------------------------


def _mirror_apply(model, gamma, codec_spec, steps, dropped=()):
    """The numpy reference of what a compressing worker makes the server
    hold: its own error feedback (the same codec), the decoded updates applied
    by the update rule, a dropped step folded into the residuals."""
    ref = Reference(model, gamma)
    fb = ErrorFeedback(parse(codec_spec))
    for step in range(steps):
        u = random_update(model, seed=step)
        if step in dropped:
            fb.fold(u)
        else:
            ref.apply({n: decode(e) for n, e in fb.encode(u).items()})
    return ref.w


@pytest.mark.parametrize("spec", ["fp16", "topk:0.05", "lowrank:2"])
def test_a_compressing_worker_makes_the_server_apply_what_it_sent(spec):
    from mlfabric.server.store import ParameterStore

    model = make_model(sizes={"w": (40, 30), "b": (30,)})
    with ServerThread(ParameterStore(model, momentum=0.5)) as st, \
            mlfabric.connect(st.address, job=JOB, token=TOKEN, compression=spec) as ps:
        for step in range(6):
            outcome = ps.push(random_update(model, seed=step), base_version=step).result(10)
            assert outcome.applied and not outcome.folded
        assert_model_equal(ps.pull(timeout=10)[1], _mirror_apply(model, 0.5, spec, 6))
        codec = spec.partition(":")[0]
        assert st.server.metrics.compressed_tensors.labels(codec)._value.get() > 0


def test_through_a_controller_a_dropped_update_goes_with_the_next_push(caplog):
    """The controller drops every other update: with compression each
    dropped one is folded into the residuals (the outcome says so), so the
    server ends as if it had been sent with the next push. The controller
    plans each transfer at its compressed size."""
    import json
    import logging

    from mlfabric.controller.controller import Controller
    from mlfabric.scheduling.plan import PlanItem, Snapshot
    from mlfabric.server.store import ParameterStore

    def drop_odd(snap: Snapshot) -> list[PlanItem]:
        return [PlanItem(t.id, start=snap.now) if t.req % 2 else
                PlanItem(t.id, drop="deadline_missed", detail="test") for t in snap.pending]

    caplog.set_level(logging.INFO, logger="mlfabric.decisions")
    model = make_model(sizes={"w": (40, 30), "b": (30,)})
    with ServerThread(ParameterStore(model, momentum=0.5)) as st, \
            ServerThread(None, endpoint=Controller(drop_odd, job=JOB, token=TOKEN,
                                                   tau_max=None)) as ctl, \
            mlfabric.connect(st.address, job=JOB, token=TOKEN, controller=ctl.address,
                             compression="fp16") as ps:
        outcomes = [ps.push(random_update(model, seed=step), base_version=0).result(10)
                    for step in range(6)]
        assert [o.applied for o in outcomes] == [True, False] * 3
        assert [o.folded for o in outcomes] == [False, True] * 3
        assert outcomes[1].reason == ("dropped by the controller: deadline_missed: test; "
                                      "folded into the next push (compression's error "
                                      "feedback)")
        assert_model_equal(ps.pull(timeout=10)[1],
                           _mirror_apply(model, 0.5, "fp16", 6, dropped={1, 3, 5}))
    sizes = {json.loads(r.getMessage())["nbytes"] for r in caplog.records
             if r.name == "mlfabric.decisions" and json.loads(r.getMessage())["event"] == "go"}
    assert sizes == {2 * (40 * 30 + 30)}  # 16-bit: half the update's 4 bytes per element


def test_without_compression_a_dropped_update_is_not_folded():
    from mlfabric.controller.controller import Controller
    from mlfabric.scheduling.plan import PlanItem, Snapshot
    from mlfabric.server.store import ParameterStore

    def drop_all(snap: Snapshot) -> list[PlanItem]:
        return [PlanItem(t.id, drop="would_idle_server", detail="test") for t in snap.pending]

    model = make_model()
    with ServerThread(ParameterStore(model)) as st, \
            ServerThread(None, endpoint=Controller(drop_all, job=JOB, token=TOKEN,
                                                   tau_max=None)) as ctl, \
            mlfabric.connect(st.address, job=JOB, token=TOKEN, controller=ctl.address) as ps:
        outcome = ps.push(model, base_version=0).result(10)
        assert not outcome.applied and not outcome.folded
        assert outcome.reason == "dropped by the controller: would_idle_server: test"


def test_a_compression_setting_that_cannot_work_is_refused_at_connect():
    """Before anything is dialled: the setting is checked first."""
    with pytest.raises(ConfigError, match="unknown compression 'zip'"):
        mlfabric.connect("127.0.0.1:9", job=JOB, token=TOKEN, compression="zip")


@pytest.mark.parametrize("spec", ["fp16", "topk:0.1"])
def test_each_shard_applies_its_compressed_parts(spec):
    """A sharded job: each shard's client compresses its shard's pieces with
    error feedback of its own, and each shard's server ends bit for bit as
    the numpy update rule on those decoded pieces."""
    from test_sharded import SIZES, addresses, shard_servers, store_state

    from mlfabric.sharding.partition import partition

    model = make_model(sizes=SIZES)
    part = partition([(n, a.dtype, a.shape) for n, a in model.items()], 2, 1 << 16)
    refs = [Reference(p, 0.5) for p in part.split(model)]
    mirrors = [ErrorFeedback(parse(spec)) for _ in range(2)]
    with shard_servers(model, 2) as servers, \
            mlfabric.connect(addresses(servers), job=JOB, token=TOKEN, compression=spec) as ps:
        for step in range(4):
            u = random_update(model, seed=step)
            outcome = ps.push(u, base_version=ps.pull(timeout=10)[0]).result(10)
            assert outcome.applied, outcome
            for ref, fb, piece in zip(refs, mirrors, part.split(u), strict=True):
                ref.apply({n: decode(e) for n, e in fb.encode(piece).items()})
        for server, ref in zip(servers, refs, strict=True):
            version, weights = store_state(server)
            assert version == 4
            assert_model_equal(weights, ref.w)


def test_the_replica_applies_the_same_bits_and_takes_over_with_nothing_lost():
    """A compressing worker through a controller, feeding a replica: the
    replica gets the very parts the server decoded, so the two hold the same
    model bit for bit. The server is lost; the promoted replica goes on, and
    ends as the numpy mirror of the worker's compressed pushes: no update
    encoded twice, none lost."""
    from test_failover import server_state, watched_job


    gamma = 0.5
    model = make_model(sizes={"w": (40, 30), "b": (30,)})
    server, replica, _, controller = watched_job(model, gamma)
    try:
        with mlfabric.connect(server.address, job=JOB, token=TOKEN,
                              controller=controller.address, controller_fallback="wait",
                              replica=replica.address, failover_timeout=10,
                              compression="fp16") as ps:
            for step in range(8):
                if step == 4:
                    # (a push resolves once the replica has it too)
                    assert _same(server_state(server), server_state(replica))
                    server.__exit__(None, None, None)  # lost: the replica is promoted
                version, _ = ps.pull(timeout=20)
                outcome = ps.push(random_update(model, seed=step), base_version=version)
                assert outcome.result(30).applied
            final_version, final = server_state(replica)
    finally:
        for t in (controller, replica, server):
            if t._thread.is_alive():
                t.__exit__(None, None, None)
    assert final_version == 8
    assert_model_equal(final, _mirror_apply(model, gamma, "fp16", 8))


def _same(a, b) -> bool:
    (va, wa), (vb, wb) = a, b
    return va == vb == 4 and all(np.array_equal(wa[n].view(np.uint32), wb[n].view(np.uint32))
                                 for n in wa)


def test_through_an_aggregator_an_update_goes_whole_with_what_waited_in_the_residual():
    """Compression composes with aggregation. A push the controller sends
    compressed leaves a residual; one it routes through an aggregator goes
    whole (aggregators sum whole updates) and carries that residual, emptied
    into it, so nothing waits for a straight push that may never come. The
    server ends bit for bit at the numpy replay: the fp16 push, the aggregate
    of (u1 + residual) and u2 as one step, then fp16 again. A fixed codec,
    which the controller plans at its compressed size, is refused with
    aggregators, with what to use instead; significance alone is not."""
    from mlfabric.agent.aggregator import Aggregator
    from mlfabric.controller.controller import Controller
    from mlfabric.runtime.metrics import AggregatorMetrics
    from mlfabric.scheduling.aggregation import apply_aggregate
    from mlfabric.scheduling.plan import PlanItem, Route, Snapshot
    from mlfabric.server.store import ParameterStore

    mode = ["fp16"]
    aggregator: list[str] = []

    def policy(snap: Snapshot) -> list[PlanItem]:
        if mode[0] == "fp16":
            return [PlanItem(t.id, start=snap.now, codec="fp16") for t in snap.pending]
        if len(snap.pending) < 2:
            return []  # the group waits for its second member
        first = snap.pending[0].id
        return [PlanItem(t.id, start=snap.now, position=i, planned_seconds=0.01,
                         route=Route("agg", aggregator[0], first, 2, i))
                for i, t in enumerate(snap.pending[:2])]

    model = make_model(sizes={"w": (40, 30), "b": (30,)})
    u = [random_update(model, seed=step) for step in range(4)]
    with ServerThread(ParameterStore(model, momentum=0.5)) as st, \
            ServerThread(None, endpoint=Aggregator(
                job=JOB, token=TOKEN, servers=[st.address],
                metrics=AggregatorMetrics())) as agg, \
            ServerThread(None, endpoint=Controller(policy, job=JOB, token=TOKEN, tau_max=None,
                                                   aggregators={"h1": "127.0.0.1:9"})) as ctl, \
            mlfabric.connect(st.address, job=JOB, token=TOKEN, controller=ctl.address,
                             compression="adaptive:fp16") as ps:
        aggregator.append(agg.address)
        assert ps.push(u[0], base_version=0).result(10).applied
        mode[0] = "group"
        futures = [ps.push(u[1], base_version=1), ps.push(u[2], base_version=1)]
        grouped = [f.result(10) for f in futures]
        mode[0] = "fp16"
        assert ps.push(u[3], base_version=3).result(10).applied
        got = ps.pull(timeout=10)[1]
    assert [(o.applied, o.fan_in, o.index) for o in grouped] == [(True, 2, 0), (True, 2, 1)]
    assert agg.metrics.members._value.get() == 2
    # the replay: the worker's error feedback and the server's update rule
    fb = ErrorFeedback(parse("fp16"))
    w, prev, version = dict(model), dict(model), 0

    def step(members):
        nonlocal w, prev, version
        w, prev, version, _ = apply_aggregate(w, prev, version, [(m, version) for m in members],
                                              0.5)

    step([{n: decode(e) for n, e in fb.encode(u[0]).items()}])
    assert any(np.any(r != 0) for r in fb.residual.values())  # fp16 left something
    step([{n: decode(e) for n, e in fb.encode(u[1], parse("none")).items()}, u[2]])
    assert all(not np.any(r) for r in fb.residual.values())  # emptied into the member
    step([{n: decode(e) for n, e in fb.encode(u[3]).items()}])
    assert_model_equal(got, w)

    # a fixed codec with aggregators: refused, saying what to use
    with ServerThread(ParameterStore(make_model())) as st, \
            ServerThread(None, endpoint=Controller(policy, job=JOB, token=TOKEN, tau_max=None,
                                                   aggregators={"h1": "127.0.0.1:9"})) as ctl:
        with pytest.raises(ConfigError, match="routes updates through aggregators, which sum "
                                              "whole updates, and compression='fp16' makes "
                                              "every transfer compressed: connect with "
                                              "compression='adaptive'"):
            mlfabric.connect(st.address, job=JOB, token=TOKEN, controller=ctl.address,
                             compression="fp16")
        mlfabric.connect(st.address, job=JOB, token=TOKEN, controller=ctl.address,
                         significance=0.01).close()


# --- the controller's choice (issue 35) -----------------------------------------------


def _straggler(options=()):
    """test_schedule's straggler: its update (deadline position 0) crawls at
    1 B/s and would end at 10 s; the other would end at 1 s. Forcing the
    first in idles the server 9 s for 1 s displaced: the plan drops it
    (would_idle_server) unless it is small enough."""
    from mlfabric.scheduling.plan import Network, Snapshot, Transfer

    ts = (Transfer(id=1, owner=None, req=1, nbytes=10, base_version=0, norm=1.0, host="slow",
                   dst="s", arrival=0.0, options=options),
          Transfer(id=2, owner=None, req=2, nbytes=10, base_version=3, norm=1.0, host="b",
                   dst="s", arrival=1.0, options=options))
    return Snapshot(now=0.0, version=3, tau_max=3, pending=ts, active=(),
                    network=Network(default=10.0, up={"slow": 1.0}))


def _straggler_gos(options):
    """The straggler example through ControlState (the columns the
    controller keeps): its go actions by request."""
    from mlfabric.controller.state import ControlState, Go
    from mlfabric.scheduling.plan import Network
    from mlfabric.scheduling.policies import Mlfabric

    state = ControlState(Mlfabric(), tau_max=3, network=Network(default=10.0, up={"slow": 1.0}))
    state.version = 3
    for worker, req, host, base in (("w1", 1, "slow", 0), ("w2", 2, "b", 3)):
        state.request(worker, req, host=host, dst="s", nbytes=10, base_version=base, norm=1.0,
                      now=0.0, options=options)
    return {a.transfer.req: a for a in state.decide(0.0).actions if isinstance(a, Go)}


@pytest.mark.parametrize("mode, options, want", [
    # adaptive: whole when it goes whole; else the least compression that lets it go
    ("adaptive", (), {1: "would_idle_server", 2: None}),
    ("adaptive", (("fp16", 5, 0.0), ("topk:0.1", 1, 0.0)), {1: "topk:0.1", 2: None}),
    ("adaptive", (("fp16", 1, 0.0), ("topk:0.1", 1, 0.0)), {1: "fp16", 2: None}),
    ("adaptive", (("fp16", 5, 0.0),), {1: "would_idle_server", 2: None}),  # not small enough
    # the worker's encoding time counts at the path's rate (1 B/s): top-k's
    # 6 s of CPU outlast the 4 s it saves over fp16 on the wire, so it is no
    # smaller and not chosen; a form no smaller than the last one is skipped
    ("adaptive", (("fp16", 5, 0.0), ("topk:0.1", 1, 6.0)), {1: "would_idle_server", 2: None}),
    ("adaptive", (("fp16", 12, 0.0), ("topk:0.1", 1, 0.0)), {1: "topk:0.1", 2: None}),
    ("off", (("fp16", 1, 0.0),), {1: "would_idle_server", 2: None}),
    ("fixed:fp16", (("fp16", 5, 0.0), ("topk:0.1", 1, 0.0)),
     {1: "would_idle_server", 2: "fp16"}),
    # fixed shrinks the other too (0.1 s): the straggler's 1 s idles the
    # server 0.9 s for 0.1 s displaced, and it is dropped; adaptive (above)
    # sends it, with the other whole
    ("fixed:topk:0.1", (("fp16", 5, 0.0), ("topk:0.1", 1, 0.0)),
     {1: "would_idle_server", 2: "topk:0.1"}),
])
def test_the_controller_shrinks_an_update_it_would_drop(mode, options, want):
    """For each transfer: its codec if it goes (None: whole), or why it is dropped."""
    from mlfabric.scheduling.policies import Mlfabric

    plan = Mlfabric(compression=mode)(_straggler(options))
    got = {i.id: i.drop if i.drop else i.codec for i in plan}
    assert got == want
    sent = {i.id: i.planned_seconds for i in plan if not i.drop and i.start == 0.0}
    if want[1] == "topk:0.1":  # 1 byte at 1 B/s
        assert sent[1] == pytest.approx(1.0)


def test_a_forms_encoding_time_is_planned_as_link_time():
    """Top-k's 1 byte and 0.5 s of encoding at 1 B/s: planned as 1.5 s,
    in the plan from a snapshot and in the controller's columns alike."""
    from mlfabric.scheduling.policies import Mlfabric

    options = (("fp16", 5, 0.0), ("topk:0.1", 1, 0.5))
    plan = Mlfabric()(_straggler(options))
    assert {i.id: (i.codec, i.planned_seconds) for i in plan if not i.drop}[1] == \
        ("topk:0.1", pytest.approx(1.5))
    gos = _straggler_gos(options)
    assert gos[1].codec == "topk:0.1" and gos[1].transfer.nbytes == 1
    assert gos[1].planned_seconds == pytest.approx(1.5)


def test_a_worker_offers_each_form_with_its_measured_encoding_time():
    """What the worker tells the controller: each form's bytes, and seconds
    timed on the model's shapes (positive, and top-k's argpartition slower
    than fp16's one pass over a 1000 x 1000 tensor); a push sent so moves
    the estimate halfway to what it took."""
    import asyncio

    import mlfabric.aio
    from mlfabric.server.store import ParameterStore

    async def offered(address):
        client = await mlfabric.aio.connect(address, job=JOB, token=TOKEN,
                                            compression="adaptive")
        try:
            before = client.options
            client.note_encoded("fp16", 1.0)
            return before, client.options
        finally:
            await client.close()

    model = make_model(sizes={"w": (1000, 1000)})
    with ServerThread(ParameterStore(model)) as st:
        options, after = asyncio.run(offered(st.address))
    assert [(c, n) for c, n, _ in options] == [("fp16", 2_000_000), ("topk:0.1", 800_000),
                                               ("topk:0.01", 80_000)]
    seconds = {c: s for c, _, s in options}
    assert all(s > 0 for s in seconds.values())
    assert seconds["topk:0.1"] > seconds["fp16"]
    assert {c: s for c, _, s in after} == {**seconds, "fp16": (seconds["fp16"] + 1.0) / 2}


def test_the_controllers_state_lets_a_shrunk_update_go_at_its_compressed_size():
    """Through ControlState (the columns the controller keeps): the go names
    the codec, the transfer then holds its links for the compressed bytes,
    and the plan is the one planned from a snapshot."""
    from mlfabric.scheduling.policies import Mlfabric

    options = (("fp16", 5, 0.0), ("topk:0.1", 1, 0.0))
    gos = _straggler_gos(options)
    assert gos[1].codec == "topk:0.1" and gos[1].transfer.nbytes == 1
    assert gos[1].planned_seconds == pytest.approx(1.0)
    snapshot_plan = Mlfabric()(_straggler(options))
    assert {i.id: i.codec for i in snapshot_plan if not i.drop}[1] == "topk:0.1"


def test_compression_modes_are_checked():
    from mlfabric.controller.cli import parse_compression_mode

    assert parse_compression_mode("adaptive") == "adaptive"
    assert parse_compression_mode("fixed:topk:0.01") == "fixed:topk:0.01"
    with pytest.raises(ConfigError, match="compression mode must be off, adaptive or "
                                          "fixed:CODEC"):
        parse_compression_mode("sometimes")
    with pytest.raises(ConfigError, match="unknown compression 'zip'"):
        parse_compression_mode("fixed:zip")


def test_adaptive_offers_are_parsed():
    from mlfabric.compression import parse_offer

    assert [c.spec for c in parse_offer("adaptive")] == ["fp16", "topk:0.1", "topk:0.01"]
    assert [c.spec for c in parse_offer("adaptive:bf16,randk:0.05")] == ["bf16", "randk:0.05"]
    assert parse_offer("fp16") is None
    with pytest.raises(ConfigError, match="list each compressed form once, without none"):
        parse_offer("adaptive:fp16,fp16")


@pytest.mark.parametrize("mode, sent_as", [("fixed:fp16", "fp16"), ("adaptive", None),
                                           ("off", None)])
def test_a_worker_offering_forms_sends_what_the_controller_chose(mode, sent_as, caplog):
    """compression="adaptive": the worker offers its forms and sends each
    update as its go says. With fixed:fp16 every one goes as fp16; adaptive,
    on a link with room, and off send them whole (the residual stays empty).
    The decision log records the choice."""
    import json
    import logging

    from mlfabric.compression.codecs import Dense
    from mlfabric.controller.controller import Controller
    from mlfabric.scheduling.policies import Mlfabric
    from mlfabric.server.store import ParameterStore

    caplog.set_level(logging.INFO, logger="mlfabric.decisions")
    model = make_model(sizes={"w": (40, 30), "b": (30,)})
    ref = Reference(model, 0.5)
    mirror = ErrorFeedback(Dense())
    ctl = Controller(Mlfabric(compression=mode), job=JOB, token=TOKEN, tau_max=None)
    with ServerThread(ParameterStore(model, momentum=0.5)) as st, \
            ServerThread(None, endpoint=ctl) as controller, \
            mlfabric.connect(st.address, job=JOB, token=TOKEN, controller=controller.address,
                             compression="adaptive") as ps:
        for step in range(4):
            u = random_update(model, seed=step)
            assert ps.push(u, base_version=step).result(10).applied
            encoded = mirror.encode(u, None if sent_as is None else parse(sent_as))
            ref.apply({n: decode(e) for n, e in encoded.items()})
        assert_model_equal(ps.pull(timeout=10)[1], ref.w)
    records = [json.loads(r.getMessage()) for r in caplog.records
               if r.name == "mlfabric.decisions"]
    gos = [r for r in records if r["event"] == "go"]
    assert [r["codec"] for r in gos] == [sent_as or "whole"] * 4
    # The controller planned the chosen form's bytes.
    dense = 4 * (40 * 30 + 30)
    assert {r["nbytes"] for r in gos} == {dense // 2 if sent_as else dense}
    chosen = (sent_as or "none").partition(":")[0]
    assert ctl.metrics.compressed_transfers.labels(chosen)._value.get() == 4


# --- the significance filter (Gaia): mlfabric.connect(significance=...) -----------------


def test_significance_measures_against_the_model_pulled_last():
    from mlfabric.compression import Significance

    s = Significance(0.01)
    assert s.holds(1e-9) is None  # no model pulled yet: everything goes
    s.observe({"w": np.full(4, 3.0, np.float32), "b": np.full(9, 4.0 / 3, np.float32)})
    assert s.model_norm == pytest.approx(math.sqrt(36 + 16))
    assert s.holds(0.0999 * s.model_norm / 10) == pytest.approx(0.00999)
    assert s.holds(0.01 * s.model_norm) is None  # at the threshold: it goes
    s.observe({"w": np.zeros(3, np.float32)})
    assert s.holds(1e-9) is None  # a zero model: any update is significant


@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.1, "x", math.nan])
def test_a_significance_outside_0_1_says_what_fits(bad):
    from mlfabric.compression import Significance

    with pytest.raises(ConfigError, match=r"in \(0, 1\); Gaia used 0.01 to 0.05"):
        Significance(bad)


def test_the_pending_norm_is_that_of_update_plus_residual():
    fb = ErrorFeedback(parse("topk:0.1"))
    u = {"w": wide(50)[:50].clip(-10, 10), "b": np.arange(7, dtype=np.float32)}
    assert fb.pending_norm(u) == pytest.approx(
        math.sqrt(sum(float(np.sum(a.astype(np.float64) ** 2)) for a in u.values())))
    fb.encode(u)  # leaves 90% of w in the residual
    want = math.sqrt(sum(float(np.sum((u[n] + fb.residual[n]).astype(np.float64) ** 2))
                         for n in u))
    assert fb.pending_norm(u) == pytest.approx(want, rel=1e-6)


def _small_update(model):
    """An update of relative magnitude about 0.004 to each tensor."""
    rng = np.random.default_rng(7)
    return {n: (rng.standard_normal(a.shape) * 0.004 * float(np.linalg.norm(a)) /
                math.sqrt(a.size)).astype(np.float32) for n, a in model.items()}


def _significance_run(ps, model, steps, threshold):
    """Push `steps` copies of one small update, pulling after each: the
    outcomes, and the numpy reference of which are held (relative magnitude
    of update + what was held, against the model pulled last) and of what
    the server then holds (each update that goes carries the held ones)."""
    update = _small_update(model)
    ref = Reference(model, 0.5)
    held = {n: np.zeros_like(a) for n, a in update.items()}
    version, pulled = ps.pull(timeout=10)
    outcomes, want = [], []
    for _ in range(steps):
        pending = {n: update[n] + held[n] for n in update}
        rel = math.sqrt(sum(float(np.sum(p.astype(np.float64) ** 2)) for p in pending.values())) \
            / math.sqrt(sum(float(np.sum(a.astype(np.float64) ** 2)) for a in pulled.values()))
        if rel < threshold:
            for n in held:
                held[n] += update[n]
            want.append(False)
        else:
            ref.apply(pending)
            held = {n: np.zeros_like(a) for n, a in update.items()}
            want.append(True)
        outcomes.append(ps.push(update, base_version=version).result(10))
        version, pulled = ps.pull(timeout=10)
    return outcomes, want, ref.w


def test_a_push_below_the_significance_threshold_waits_in_the_residual():
    """One update of relative magnitude 0.004, pushed again and again with a
    threshold of 0.01: two are held, the third goes with both, and so on.
    The server holds exactly the numpy update rule over what went, nothing
    lost; held outcomes say so at once and are counted."""
    from mlfabric.runtime.metrics import ClientMetrics
    from mlfabric.server.store import ParameterStore

    model = make_model(sizes={"w": (40, 30), "b": (30,)})
    metrics = ClientMetrics()
    with ServerThread(ParameterStore(model, momentum=0.5)) as st, \
            mlfabric.connect(st.address, job=JOB, token=TOKEN, significance=0.01,
                             metrics=metrics) as ps:
        outcomes, want, weights = _significance_run(ps, model, 9, 0.01)
        assert [o.applied for o in outcomes] == want == [False, False, True] * 3
        for o in outcomes:
            assert o.folded is not o.applied
        held = outcomes[0]
        assert held.delay is None and held.version == 0 and held.base_version == 0
        assert held.reason.startswith("held: relative magnitude 0.00")
        assert held.reason.endswith("is below the significance threshold 0.01; kept in the "
                                    "residual for a later push")
        assert_model_equal(ps.pull(timeout=10)[1], weights)
        assert metrics.pushes.labels("held")._value.get() == 6
        assert metrics.pushes.labels("applied")._value.get() == 3


def test_significance_composes_with_compression_and_sharding():
    """Two shards, fp16: a push is held by both shards or goes to both,
    measured over the whole model, and each shard's server ends as the numpy
    update rule on the decoded parts (error feedback mirrored per shard)."""
    from test_sharded import SIZES, addresses, shard_servers, store_state

    from mlfabric.client.sharded import ShardedOutcome
    from mlfabric.sharding.partition import partition

    model = make_model(sizes=SIZES)
    part = partition([(n, a.dtype, a.shape) for n, a in model.items()], 2, 1 << 16)
    with shard_servers(model, 2) as servers, \
            mlfabric.connect(addresses(servers), job=JOB, token=TOKEN, compression="fp16",
                             significance=0.01) as ps:
        outcomes, want, _ = _significance_run(ps, model, 6, 0.01)
        assert [o.applied for o in outcomes] == want and sum(want) == 2, want
        for o in outcomes:
            assert isinstance(o, ShardedOutcome) and len(o.shards) == 2
            assert [s.applied for s in o.shards] == [o.applied] * 2
            assert o.folded is not o.applied
        # Each shard's mirror: the update folded while held, encoded when it went.
        update = _small_update(model)
        for server, piece, original in zip(servers, part.split(update), part.split(model),
                                           strict=True):
            ref, fb = Reference(original, 0.5), ErrorFeedback(parse("fp16"))
            for goes in want:
                if goes:
                    ref.apply({n: decode(e) for n, e in fb.encode(piece).items()})
                else:
                    fb.fold(piece)
            version, weights = store_state(server)
            assert version == sum(want)
            assert_model_equal(weights, ref.w)


def test_a_significance_setting_is_checked_with_where_it_came_from(tmp_path):
    from mlfabric import config

    token = tmp_path / "t"
    token.write_bytes(TOKEN)
    token.chmod(0o600)
    s = config.resolve(environ={"MLFABRIC_SERVER": "127.0.0.1:9", "MLFABRIC_JOB": JOB,
                                "MLFABRIC_TOKEN_FILE": str(token),
                                "MLFABRIC_SIGNIFICANCE": "2"})
    with pytest.raises(ConfigError) as exc:
        config.connect(s)
    assert "(setting significance (from MLFABRIC_SIGNIFICANCE))" in str(exc.value)
    assert "in (0, 1)" in str(exc.value)


def test_an_adaptive_compression_setting_is_taken_from_the_environment(tmp_path):
    """compression=adaptive from a setting passes the check (it once was
    refused as an unknown codec) and the connection is what fails here."""
    from mlfabric import config

    token = tmp_path / "t"
    token.write_bytes(TOKEN)
    token.chmod(0o600)
    s = config.resolve(environ={"MLFABRIC_SERVER": "127.0.0.1:9", "MLFABRIC_JOB": JOB,
                                "MLFABRIC_TOKEN_FILE": str(token), "MLFABRIC_TIMEOUT": "2",
                                "MLFABRIC_COMPRESSION": "adaptive:fp16,topk:0.1"})
    with pytest.raises(ConfigError) as exc:
        config.connect(s)
    assert "cannot reach the server at 127.0.0.1:9" in str(exc.value)
