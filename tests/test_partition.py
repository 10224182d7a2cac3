"""The partition of a model over server shards (mlfabric.sharding), pure:
deterministic, every element exactly once, balanced, and split/join exact."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.errors import ConfigError
from mlfabric.sharding import DEFAULT_CHUNK_BYTES, partition
from mlfabric.sharding.partition import MIN_CHUNK_BYTES

F4 = np.dtype("<f4")


def specs_of(model):
    return [(n, a.dtype, a.shape) for n, a in model.items()]


def embedding_and_small():
    """One 64 MB embedding beside 100 small tensors (the issue's example)."""
    specs = [("embedding", F4, (16_384, 1024))]
    specs += [(f"layer{i:03d}.w", F4, (64, 33 + i)) for i in range(100)]
    return specs


def covered(part):
    """element sets per tensor, checking that no element is held twice."""
    seen = {name: np.zeros(int(np.prod(shape)), np.int8) for name, _, shape in part.specs}
    for shard in part.pieces:
        for p in shard:
            seen[p.tensor][p.start:p.stop] += 1
    return seen


@pytest.mark.parametrize("shards", [2, 3, 4, 8])
def test_a_huge_tensor_beside_small_ones_is_balanced_within_5_percent(shards):
    part = partition(embedding_and_small(), shards)
    held = part.bytes_per_shard()
    mean = sum(held) / shards
    assert max(held) <= 1.05 * mean and min(held) >= 0.95 * mean, held
    assert all((c == 1).all() for c in covered(part).values())
    assert part.chunk_bytes <= DEFAULT_CHUNK_BYTES
    assert all(p.nbytes <= part.chunk_bytes for shard in part.pieces for p in shard)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 300_000), min_size=1, max_size=40),
       shards=st.integers(1, 9), chunk=st.sampled_from([64 << 10, 1 << 20, 4 << 20]))
def test_any_model_every_element_once_and_within_one_piece(sizes, shards, chunk):
    specs = [(f"t{i}", F4, (n,)) for i, n in enumerate(sizes)]
    part = partition(specs, shards, chunk)
    assert all((c == 1).all() for c in covered(part).values())
    held = part.bytes_per_shard()
    largest = max((p.nbytes for shard in part.pieces for p in shard), default=0)
    assert max(held) - min(held) <= largest
    mean = sum(held) / shards
    if shards > 1 and sum(held) // (shards * 20) >= max(MIN_CHUNK_BYTES, 4):
        # enough bytes for the chunk to be a twentieth of a share: within 5%
        assert max(held) <= 1.05 * mean and min(held) >= 0.95 * mean


def test_the_same_model_gives_the_same_partition_in_any_order_and_s_1_cuts_nothing():
    specs = embedding_and_small()
    a = partition(specs, 4)
    b = partition(list(reversed(specs)), 4)
    assert a == b and a.digest == b.digest
    one = partition(specs, 1)
    assert len(one.pieces) == 1 and len(one.pieces[0]) == len(specs)
    assert all(p.start == 0 and p.nbytes == np.prod(s) * 4
               for p, (_, _, s) in zip(one.pieces[0], sorted(specs), strict=True))


def test_another_s_chunk_or_shape_is_another_digest():
    """The digest names the partition: what changes it changes the digest. (A
    chunk size that the balance rule lowers anyway changes nothing: here
    4 MB and 1 MB both become 0.8 MB for 4 shards, and agree.)"""
    specs = embedding_and_small()
    assert partition(specs, 4).digest == partition(specs, 4, 1 << 20).digest
    digests = {partition(specs, 4).digest, partition(specs, 8).digest,
               partition(specs, 4, 128 << 10).digest,
               partition([("embedding", F4, (16384, 1023)), *specs[1:]], 4).digest,
               partition([("embedding", np.dtype("<f8"), (16384, 1024)), *specs[1:]], 4).digest}
    assert len(digests) == 5


def test_split_and_join_give_back_the_model_bit_for_bit_without_copies():
    rng = np.random.default_rng(0)
    model = {"emb": rng.standard_normal((3000, 70)).astype(np.float32),
             "b": rng.standard_normal(5).astype(np.float32),
             "w": rng.standard_normal((40, 30)).astype(np.float64)}
    part = partition(specs_of(model), 3, 64 << 10)
    parts = part.split(model)
    assert [sum(a.nbytes for a in p.values()) for p in parts] == part.bytes_per_shard()
    assert all(np.shares_memory(a, model[k.split("@")[0]]) for p in parts for k, a in p.items())
    joined = part.join(parts)
    for name, a in model.items():
        assert joined[name].dtype == a.dtype and np.array_equal(joined[name], a)


@pytest.mark.parametrize("args, message", [
    (([("w", F4, (4,))], 0), "number of shards must be a positive integer, got 0"),
    (([("w", F4, (4,))], 2, 0), "chunk size must be a positive number of bytes, got 0"),
    (([], 2), "without tensors"),
    (([("w", F4, (4,)), ("w", F4, (4,))], 2), "names must be unique"),
    (([("w@1", F4, (4,))], 2), "may not contain '@'.*'w@1'"),
])
def test_bad_input_says_what_and_which_value(args, message):
    with pytest.raises(ConfigError, match=message):
        partition(*args)


def test_split_refuses_a_model_the_partition_was_not_made_for():
    part = partition([("w", F4, (4, 4))], 2, 16)
    with pytest.raises(ConfigError, match=r"tensor 'w' is float32\[4, 5\], the partition was "
                                          r"made for float32\[4, 4\]"):
        part.split({"w": np.zeros((4, 5), np.float32)})
    with pytest.raises(ConfigError, match="'w' of the partitioned model is missing"):
        part.split({})
    with pytest.raises(ConfigError, match="1 parts for a partition over 2 shards"):
        part.join([{}])
