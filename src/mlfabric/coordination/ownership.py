"""Which controller plans which server shard: the rules, without I/O.

A job may run several controllers (`controllers`: their addresses, the same
list, in the same order, that the workers are given). Each shard is planned
by exactly one of them, the holder of the shard's key in etcd. A key is held
under its controller's lease, so it disappears when that controller stops
renewing it (crashed, cut off), and another controller claims the shard.

Who claims what, so that controllers do not race for keys (etcd's atomic
create would settle a race, but a balanced start is nicer):

- shard s's *home* is controllers[s % N]; its order of succession is the
  home, then the controllers after it round the list;
- an unowned shard is claimed by the first controller in its order that is
  live (its member key is in etcd);
- at start, before it has been up one lease's time (`settled`), a
  controller claims only its home shards, so a peer that starts a moment
  later still finds its own free.

A controller that comes back does not take its home shards back from the
one that took them over (moving a shard moves its workers' links); it
claims only shards that are free.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

from .etcd import KeyValue

MAX_SHARDS = 4096


def prefix(job: str) -> str:
    return f"/mlfabric/jobs/{job}/"


def member_key(job: str, address: str) -> str:
    return f"{prefix(job)}controllers/{address}"


def shard_key(job: str, shard: int) -> str:
    return f"{prefix(job)}shards/{shard}"


def read(job: str, kvs: Iterable[KeyValue], shards: int
         ) -> tuple[set[str], dict[int, tuple[str, int]]]:
    """The live controllers, and each owned shard's (owner address, lease),
    from the keys under `prefix(job)`. Keys that do not parse (another
    version's, or written by hand) are ignored."""
    live: set[str] = set()
    owners: dict[int, tuple[str, int]] = {}
    members, shard_keys = f"{prefix(job)}controllers/", f"{prefix(job)}shards/"
    for kv in kvs:
        if kv.key.startswith(members):
            live.add(kv.key[len(members):])
        elif kv.key.startswith(shard_keys):
            index = kv.key[len(shard_keys):]
            if index.isdigit() and int(index) < shards and kv.value:
                owners[int(index)] = (kv.value, kv.lease)
    return live, owners


def succession(shard: int, n: int) -> list[int]:
    """The positions of the controllers in `shard`'s order: its home first."""
    return [(shard + k) % n for k in range(n)]


def claims(*, shards: int, controllers: Sequence[str], me: str, owned: Collection[int],
           live: Collection[str], settled: bool) -> list[int]:
    """The free shards `me` should claim now (`owned`: the shards someone
    holds; `live`: the controllers whose member key is in etcd)."""
    n = len(controllers)
    out = []
    for shard in range(shards):
        if shard in owned:
            continue
        for position in succession(shard, n):
            address = controllers[position]
            if address == me:
                if position == shard % n or settled:
                    out.append(shard)
                break
            if address in live:
                break
    return out


def owned_by(owners: Mapping[int, tuple[str, int]], me: str, lease: int) -> frozenset[int]:
    """The shards held under `me`'s current lease (a key left from an
    earlier lease of the same address is not ours: that lease is ending)."""
    return frozenset(s for s, (owner, held) in owners.items() if owner == me and held == lease)
