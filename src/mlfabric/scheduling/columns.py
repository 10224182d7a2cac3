"""The controller's pending and running transfers as columns kept between
events, and the links they cross numbered once.

A re-plan from scratch turned thousands of pending transfers into columns
on every event: a sort of the records, a pass per column, and a dictionary
lookup per host for its link and its rate. At 10,000 pending that was
three quarters of a re-plan (11 of 15 ms, benchmarks/RESULTS.md). Here an
arrival adds one row and a transfer let go or dropped removes one, so a
re-plan starts from arrays it does not build. Link rates are kept per host
and rebuilt only for the part of the network picture that changed (each
of `Network`'s tables is replaced, never edited, when a measurement
changes it). The running transfers are kept the same way
(`ActiveTransfers`). No I/O: `policies.Mlfabric.plan_columns` plans from
these.
"""

from __future__ import annotations

import math
from collections.abc import ItemsView, Iterable, Iterator, Mapping, MutableMapping, ValuesView
from dataclasses import replace
from typing import Literal

import numpy as np

from .plan import MIN_LEFT, Network, Transfer

_FIRST_ROOM = 64
# Below this many rows the three-key sort costs less than packing the keys
# (a dozen numpy calls): at 1,000 pending, 46 against 57 us.
PACKED_RANKING_FROM = 2048


class _Rows:
    """Columns with one row per transfer, unordered: a row is added at the
    end, and a removal moves the last row into the hole. A subclass names
    its columns in `_COLUMNS` (`ids` and `shard` among them) and makes each
    `_FIRST_ROOM` rows long; rows are counted per shard."""

    _COLUMNS: tuple[str, ...] = ()
    ids: np.ndarray
    shard: np.ndarray

    def __init__(self) -> None:
        self._row: dict[int, int] = {}  # transfer id -> row
        self.n = 0
        # Rows per shard: a re-plan asks which shards have any, and
        # np.unique over the shard column was 6% of a re-plan at 1,000 (RESULTS).
        self._per_shard: dict[int, int] = {}

    def _new_row(self, tid: int) -> int:
        """A row for transfer `tid` (its columns to be written)."""
        if self.n == len(self.ids):
            for name in self._COLUMNS:
                column = getattr(self, name)
                grown = np.empty(2 * len(column), column.dtype)
                grown[:self.n] = column[:self.n]
                setattr(self, name, grown)
        k = self._row[tid] = self.n
        self.n += 1
        return k

    def _count(self, shard: int, by: int) -> None:
        left = self._per_shard.get(shard, 0) + by
        if left:
            self._per_shard[shard] = left
        else:
            del self._per_shard[shard]

    def _free_row(self, tid: int) -> int:
        """Transfer `tid`'s row is no longer its: uncounted, and (once the
        caller has read it: call `_fill_hole`) filled by the last row."""
        k = self._row.pop(tid)
        self._count(int(self.shard[k]), -1)
        return k

    def _fill_hole(self, k: int) -> None:
        last = self.n - 1
        if k != last:
            for name in self._COLUMNS:
                column = getattr(self, name)
                column[k] = column[last]
            self._row[int(self.ids[k])] = k
        self.n = last


class PendingColumns(_Rows):
    """One row per pending transfer: id, bytes to send, base version,
    arrival, shard and the indices of its source and destination hosts.
    Rows are unordered (a removal moves the last row into the hole); a plan
    ranks them itself."""

    def __init__(self) -> None:
        super().__init__()
        self.ids = np.empty(_FIRST_ROOM, np.int64)
        self.size = np.empty(_FIRST_ROOM, np.float64)
        self.base_version = np.empty(_FIRST_ROOM, np.int64)
        self.arrival = np.empty(_FIRST_ROOM, np.float64)
        self.shard = np.empty(_FIRST_ROOM, np.int64)
        self.src = np.empty(_FIRST_ROOM, np.intp)
        self.dst = np.empty(_FIRST_ROOM, np.intp)
        # The order of adds; `late` marks a row added before some earlier
        # add by (arrival, id). The rows not late are in (arrival, id) order
        # by seq, so while no late row is pending a plan ranks by seq (see
        # `ranked`). Transfers come in about arrival order: the controller
        # stamps a request's arrival when it takes it.
        self.seq = np.empty(_FIRST_ROOM, np.int64)
        self.late = np.empty(_FIRST_ROOM, bool)
        self._adds = 0
        self._latest: tuple[float, int] = (-math.inf, 0)  # the greatest (arrival, id) added
        self._n_late = 0
        self.hosts = HostTable()
        # The compressed forms offered, by transfer id (only those that offer any).
        self.offers: dict[int, tuple[tuple[str, int, float], ...]] = {}

    _COLUMNS = ("ids", "size", "base_version", "arrival", "shard", "src", "dst", "seq", "late")

    def __len__(self) -> int:
        return self.n

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._row

    def add(self, t: Transfer) -> None:
        """`t` waits for a decision, with `t.rest` bytes still to send."""
        if t.id in self._row:
            raise ValueError(f"transfer {t.id} is pending already")
        k = self._new_row(t.id)
        self.ids[k], self.size[k], self.base_version[k] = t.id, t.rest, t.base_version
        self.arrival[k], self.shard[k] = t.arrival, t.shard
        self.src[k], self.dst[k] = self.hosts.index(t.host), self.hosts.index(t.dst)
        self.seq[k], self._adds = self._adds, self._adds + 1
        key = (t.arrival, t.id)
        self.late[k] = key < self._latest
        if self.late[k]:
            self._n_late += 1
        else:
            self._latest = key
        self._count(t.shard, 1)
        if t.options and not t.chunk:
            self.offers[t.id] = t.options

    def remove(self, transfer_id: int) -> None:
        """The transfer is no longer pending (let go, dropped or withdrawn)."""
        k = self._free_row(transfer_id)
        self.offers.pop(transfer_id, None)
        self._n_late -= int(self.late[k])
        self._fill_hole(k)

    def shards(self) -> list[int]:
        """The shards with pending rows, in order."""
        return sorted(self._per_shard)

    def rows(self, shard: int | None = None) -> np.ndarray:
        """The rows of `shard` (None: all), in row order."""
        if shard is None:
            return np.arange(self.n)
        return np.flatnonzero(self.shard[:self.n] == shard)

    def ranked(self, rows: np.ndarray) -> np.ndarray:
        """`rows` earliest deadline first: by (base version, arrival, id), the
        order `policies.mlfabric_policy` ranks a snapshot's transfers in.

        A stable sort by those three keys (np.lexsort) took 0.7 ms of a
        re-plan at 10,000 pending, every pass over rows that removals leave
        in no order. While no row is `late`, the add order (seq) is the
        (arrival, id) order, so the base version, the add order and the
        row's place in `rows` are packed into one integer per row and numpy
        sorts plain integers several times faster. When a row is late, the
        spreads of base versions and adds do not fit in 63 bits, or there
        are fewer than PACKED_RANKING_FROM rows, the three keys are sorted."""
        n = len(rows)
        if n < PACKED_RANKING_FROM or self._n_late:
            return rows[np.lexsort((self.ids[rows], self.arrival[rows], self.base_version[rows]))]
        base, seq = self.base_version[rows], self.seq[rows]
        low, s_low = int(base.min()), int(seq.min())
        bits, s_bits = n.bit_length(), (int(seq.max()) - s_low).bit_length()
        if (int(base.max()) - low).bit_length() + s_bits + bits > 63:
            return rows[np.lexsort((self.ids[rows], self.arrival[rows], base))]
        key = ((base - low) << (s_bits + bits)) | ((seq - s_low) << bits) | np.arange(n)
        # Keys are unique, so any sort gives the same order. Nearly in order
        # already (base versions that rise with arrival, rows not moved
        # much), a merge sort that finds the runs takes a fraction of the
        # vectorised quicksort; scattered, the quicksort is several times
        # faster.
        descents = int(np.count_nonzero(key[1:] < key[:-1]))
        kind: Literal["stable", "quicksort"] = "stable" if descents * 64 < n else "quicksort"
        return rows[np.sort(key, kind=kind) & ((1 << bits) - 1)]


class HostTable:
    """Hosts numbered in the order first seen, and each host's uplink and
    downlink rate under a `Network` (as `Network.up_rate` and `down_rate`
    compute them, for every host at once)."""

    def __init__(self) -> None:
        self._index: dict[str, int] = {}
        self.names: list[str] = []
        # Network table name -> (the table, its fill, hosts covered, values per host).
        self._tables: dict[str, tuple[Mapping[str, float], float, int, np.ndarray]] = {}
        self._pairs: tuple[Mapping[tuple[str, str], float], int,
                           np.ndarray, np.ndarray] | None = None
        # (network, hosts covered, uplink rates, downlink rates, all usable)
        self._rates: tuple[Network, int, np.ndarray, np.ndarray, bool] | None = None

    def __len__(self) -> int:
        return len(self.names)

    def index(self, host: str) -> int:
        k = self._index.get(host)
        if k is None:
            k = self._index[host] = len(self.names)
            self.names.append(host)
        return k

    def lookup(self, host: str) -> int | None:
        return self._index.get(host)

    def _table(self, name: str, table: Mapping[str, float], fill: float) -> np.ndarray:
        """`table`'s value for every host (`fill` where it has none). Built
        again only when the table is another object; new hosts are looked up
        alone."""
        hosts = len(self.names)
        cached = self._tables.get(name)
        same = cached is not None and cached[0] is table and cached[1] == fill
        if same and cached is not None and cached[2] == hosts:
            return cached[3]
        if same and cached is not None:
            values = np.empty(hosts, np.float64)
            values[:cached[2]] = cached[3]
            values[cached[2]:] = [table.get(h, fill) for h in self.names[cached[2]:]]
        else:
            values = np.full(hosts, fill, np.float64)
            for host, value in table.items():
                k = self._index.get(host)
                if k is not None:
                    values[k] = value
        self._tables[name] = (table, fill, hosts, values)
        return values

    def rates(self, net: Network) -> tuple[np.ndarray, np.ndarray]:
        """(uplink rates, downlink rates) per host index, bytes/s. Computed
        again only when the network is another object or hosts were added
        (a `Network` is frozen, and replaced when anything in it changes)."""
        cached = self._rates
        if cached is None or cached[0] is not net or cached[1] != len(self.names):
            up, down = self._compute_rates(net)
            up.setflags(write=False)  # shared by every plan until the network changes
            down.setflags(write=False)
            usable = bool(np.all(np.isfinite(up) & (up > 0))
                          and np.all(np.isfinite(down) & (down > 0)))
            cached = self._rates = (net, len(self.names), up, down, usable)
        return cached[2], cached[3]

    def usable(self, net: Network) -> bool:
        """Every host's uplink and downlink rate is finite and > 0 (the
        scheduling core refuses any other), so no link of a plan needs
        checking."""
        self.rates(net)
        assert self._rates is not None
        return self._rates[4]

    def _compute_rates(self, net: Network) -> tuple[np.ndarray, np.ndarray]:
        out = []
        for side in ("up", "down"):
            capacity = self._table(side, getattr(net, side), net.default)
            load = self._table(f"load_{side}", getattr(net, f"load_{side}"), 0.0)
            observed = self._table(f"observed_{side}", getattr(net, f"observed_{side}"),
                                   np.inf)
            left = np.maximum(capacity - load, MIN_LEFT * capacity)
            if side == "up" and net.up_share != 1.0:
                left = left * net.up_share
            out.append(np.minimum(left, observed))
        return out[0], out[1]

    def pairs(self, pair: Mapping[tuple[str, str], float]) -> tuple[np.ndarray, np.ndarray]:
        """The measured pairs between known hosts: (codes, rates), sorted by
        code, a pair's code being source index * hosts + destination index
        (`pair_code`)."""
        hosts = len(self.names)
        if self._pairs is not None and self._pairs[0] is pair and self._pairs[1] == hosts:
            return self._pairs[2], self._pairs[3]
        codes, rates = [], []
        for (a, b), rate in pair.items():
            ka, kb = self._index.get(a), self._index.get(b)
            if ka is not None and kb is not None:
                codes.append(ka * hosts + kb)
                rates.append(rate)
        code = np.array(codes, np.int64)
        order = np.argsort(code, kind="stable")
        out = code[order], np.array(rates, np.float64)[order]
        self._pairs = (pair, hosts, *out)
        return out

    def pair_code(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        return src.astype(np.int64) * len(self.names) + dst


class ActiveTransfers(_Rows, MutableMapping[int, Transfer]):
    """The transfers let go and not yet ended, by id (a dictionary), with
    what a plan reads of them kept as columns: the hosts' numbers, start,
    planned seconds and bytes, shard, base version, and whether each goes
    direct and whole.

    A re-plan at 10,000 simulated workers read each of the hundred-odd
    running transfers' fields into arrays twice per decision, once for the
    links they hold (`policies._held_columns`) and once for the order they
    land in (`observed.RunningOrder`): a fifth of a decision (RESULTS).
    Here a transfer let go or ended changes one row. A transfer changed in
    place while active (the rest of a chunked one joining the chunk under
    way) is stored again (`active[t.id] = t`) to refresh its row.

    Bytes are what the transfer sends under its go: a chunked one's chunk
    (`piece`), as the policies plan it. Rows are unordered; `by_id` gives
    them in id order, the order plans read the running transfers in."""

    _COLUMNS = ("ids", "src", "dst", "shard", "started", "planned", "nbytes",
                "base_version", "direct", "whole", "chunked")

    def __init__(self, hosts: HostTable | None = None) -> None:
        super().__init__()
        self.hosts = hosts if hosts is not None else HostTable()
        self._map: dict[int, Transfer] = {}
        self.ids = np.empty(_FIRST_ROOM, np.int64)
        self.src = np.empty(_FIRST_ROOM, np.intp)
        self.dst = np.empty(_FIRST_ROOM, np.intp)
        self.shard = np.empty(_FIRST_ROOM, np.int64)
        self.started = np.empty(_FIRST_ROOM, np.float64)  # NaN: not stamped
        self.planned = np.empty(_FIRST_ROOM, np.float64)  # 0: no planned time
        self.nbytes = np.empty(_FIRST_ROOM, np.float64)
        self.base_version = np.empty(_FIRST_ROOM, np.int64)
        self.direct = np.empty(_FIRST_ROOM, bool)  # straight to its server
        self.whole = np.empty(_FIRST_ROOM, bool)  # all of it let go
        self.chunked = np.empty(_FIRST_ROOM, bool)
        self._routed = 0  # rows through an aggregator
        self._order: np.ndarray | None = None  # by_id, until a change
        self._planned_view: tuple[Transfer, ...] | None = None

    @classmethod
    def of(cls, transfers: Iterable[Transfer], hosts: HostTable | None = None
           ) -> ActiveTransfers:
        active = cls(hosts)
        for t in transfers:
            active[t.id] = t
        return active

    # The mapping: what the controller's bookkeeping reads and writes.
    def __getitem__(self, tid: int) -> Transfer:
        return self._map[tid]

    def get(self, tid: int, default: Transfer | None = None) -> Transfer | None:  # type: ignore[override]
        return self._map.get(tid, default)

    def __contains__(self, tid: object) -> bool:
        return tid in self._map

    def __iter__(self) -> Iterator[int]:
        return iter(self._map)

    def __len__(self) -> int:
        return self.n

    def values(self) -> ValuesView[Transfer]:
        return self._map.values()

    def items(self) -> ItemsView[int, Transfer]:
        return self._map.items()

    def __setitem__(self, tid: int, t: Transfer) -> None:
        if tid != t.id:
            raise ValueError(f"transfer {t.id} stored under id {tid}")
        k = self._row.get(tid)
        if k is None:
            k = self._new_row(tid)
        else:  # stored again: counted again below
            self._count(int(self.shard[k]), -1)
            self._routed -= not self.direct[k]
        self._map[tid] = t
        self.ids[k], self.shard[k], self.base_version[k] = t.id, t.shard, t.base_version
        self.src[k], self.dst[k] = self.hosts.index(t.host), self.hosts.index(t.dst)
        self.started[k] = math.nan if t.started is None else t.started
        self.planned[k] = t.planned_seconds or 0.0
        self.nbytes[k] = t.piece if t.chunk and t.piece else t.nbytes
        self.direct[k] = t.route is None
        self.chunked[k] = bool(t.chunk)
        self.whole[k] = not t.chunk or t.granted >= t.nbytes
        self._count(t.shard, 1)
        self._routed += t.route is not None
        self._order = self._planned_view = None

    def __delitem__(self, tid: int) -> None:
        k = self._free_row(tid)
        del self._map[tid]
        self._routed -= not self.direct[k]
        self._fill_hole(k)
        self._order = self._planned_view = None

    # What plans read.
    def in_flight(self, shard: int) -> int:
        """How many run into `shard`."""
        return self._per_shard.get(shard, 0)

    @property
    def all_direct(self) -> bool:
        """None goes through an aggregator."""
        return not self._routed

    def by_id(self) -> np.ndarray:
        """The rows in transfer id order."""
        if self._order is None:
            self._order = np.argsort(self.ids[:self.n], kind="stable")
        return self._order

    def planned_view(self) -> tuple[Transfer, ...]:
        """The transfers by id as the policies plan them: a chunked one by
        the chunk it is sending (the policies know nothing of chunks)."""
        if self._planned_view is None:
            self._planned_view = tuple(
                replace(t, nbytes=t.piece) if t.chunk and t.piece else t
                for t in (self._map[int(i)] for i in self.ids[self.by_id()]))
        return self._planned_view

    def landing_row(self, tid: int, version: int
                    ) -> tuple[float, int, float, int, bool] | None:
        """Transfer `tid`'s row as `landing_rows` has it, with its staleness
        at `version` instead of its base version (a `RunningOrder` row);
        None if it does not land as itself."""
        k = self._row[tid]
        started, planned = float(self.started[k]), float(self.planned[k])
        if math.isnan(started) or planned == 0 or not self.whole[k]:
            return None
        return (started + planned, tid, planned, version - int(self.base_version[k]),
                bool(self.direct[k]))

    def landing_rows(self, shard: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The transfers into `shard` that land as themselves, as columns
        (planned end, id, planned seconds, base version, direct), in row
        order: stamped with a start and a planned time, and whole (a chunked
        transfer between chunks lands only after its last)."""
        n = self.n
        rows = np.flatnonzero((self.shard[:n] == shard) & (self.planned[:n] != 0)
                              & ~np.isnan(self.started[:n]) & self.whole[:n])
        planned = self.planned[rows]
        return (self.started[rows] + planned, self.ids[rows], planned,
                self.base_version[rows], self.direct[rows])
