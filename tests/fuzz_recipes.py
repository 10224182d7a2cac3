"""Fuzzed streams as recipes, for the fuzz tests (test_fuzz*.py).

A stream is drawn as a list of parts: a base event's frame (maybe with its
header and fields mutated, a bit flipped anywhere, or cut short), junk bytes,
or a frame sent out of its place (two swapped, one sent twice, one made and
never sent). The bytes are made only at exchange time, by the connection that
sends them: once a job connection is authenticated, each frame it makes
carries its MAC and its number on that connection (`RawClient.frame`), so a
frame cannot be made ahead. Frames made in order and sent intact are what a
good client sends; anything else must be refused, at the latest at the
frame's MAC trailer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hypothesis import strategies as st


@dataclass(frozen=True)
class Frame:
    """Base event `event`'s frame: `mutations` applied in order (positions
    within the header and fields, except "flip_any", anywhere in the frame,
    its data and MAC trailer included), then cut to `cut` bytes if set."""

    event: int
    mutations: tuple[tuple, ...] = ()
    cut: int | None = None


@dataclass(frozen=True)
class Junk:
    data: bytes


@dataclass(frozen=True)
class Swapped:
    """Frames of `first` then `second` made in this order, sent the other way round."""

    first: int
    second: int


@dataclass(frozen=True)
class Twice:
    """One frame of `event` sent twice (a replay)."""

    event: int


@dataclass(frozen=True)
class Dropped:
    """A frame of `event` made and never sent (the next one's number is off)."""

    event: int


Part = Frame | Junk | Swapped | Twice | Dropped


def _mutation(prefix: int, total: int) -> st.SearchStrategy[tuple]:
    at = st.integers(0, max(0, prefix - 1))
    return st.one_of(
        st.tuples(st.just("flip"), at, st.integers(0, 7)),
        st.tuples(st.just("set"), at, st.integers(0, 255)),
        st.tuples(st.just("insert"), at, st.binary(min_size=1, max_size=8)),
        st.tuples(st.just("delete"), at),
        st.tuples(st.just("flip_any"), st.integers(0, max(0, total - 1)), st.integers(0, 7)),
    )


def streams(sizes: Sequence[tuple[int, int]], *, favoured: int = 0, max_parts: int = 5,
            max_junk: int = 300) -> st.SearchStrategy[list[Part]]:
    """Recipes of 1..max_parts parts. `sizes[i]`: (header + fields length,
    whole frame length, MAC included) of base event i's frame, for where
    mutations and cuts go (clamped to the frame actually made). The first
    `favoured` base events (those the listener takes and reads on after)
    are drawn more often, so that intact streams get past their first frame."""
    n = len(sizes)
    event = st.integers(0, n - 1)
    if favoured:
        event = st.one_of(st.integers(0, favoured - 1), event)

    @st.composite
    def frame(draw: st.DrawFn) -> Frame:
        i = draw(event)
        prefix, total = sizes[i]
        mutations = tuple(draw(st.lists(_mutation(prefix, total), max_size=4)))
        cut = draw(st.none() | st.integers(0, total))
        return Frame(i, mutations, cut)

    part = st.one_of(
        st.builds(Frame, event),  # intact: what a good client sends, twice as often
        st.builds(Frame, event),
        frame(),
        st.builds(Junk, st.binary(max_size=max_junk)),
        st.builds(Swapped, event, event),
        st.builds(Twice, event),
        st.builds(Dropped, event),
    )
    return st.lists(part, min_size=1, max_size=max_parts)


def mutate(frame: bytes, prefix: int, mutations: Sequence[tuple], cut: int | None) -> bytes:
    """`frame` with `mutations` applied; `prefix`: its header and fields length."""
    b = bytearray(frame)
    prefix = max(1, min(prefix, len(b)))
    for m in mutations:
        kind = m[0]
        if kind == "flip_any":
            if b:
                b[min(m[1], len(b) - 1)] ^= 1 << m[2]
            continue
        i = min(m[1], prefix - 1, len(b) - 1)
        if i < 0:
            continue
        if kind == "flip":
            b[i] ^= 1 << m[2]
        elif kind == "set":
            b[i] = m[2]
        elif kind == "insert":
            b[i:i] = m[2]
            prefix += len(m[2])
        elif len(b) > 1:  # delete
            del b[i]
            prefix -= 1
        prefix = max(1, min(prefix, len(b)))
    if cut is not None:
        b = b[:cut]
    return bytes(b)


def render(parts: Sequence[Part], make: Callable[[int], bytes],
           prefix_of: Callable[[bytes], int]) -> tuple[bytes, list[int]]:
    """The stream's bytes, and the base events it carries intact and in order
    up to its first flaw (an altered, cut, replayed, early or late frame, or
    junk): on a protected connection the listener takes those, and nothing
    after. `make(i)` is the sending connection's next frame of base event i
    (each call makes one frame, numbered in call order); `prefix_of(frame)`
    the length of its header and fields."""
    out: list[bytes] = []
    intact: list[int] = []
    made = 0  # frames made so far: the next one's number
    expected = 0  # the number of the frame the receiver takes next
    flawed = False

    def new(i: int) -> tuple[int, bytes]:
        nonlocal made
        made += 1
        return made - 1, make(i)

    def send(data: bytes, event: int | None = None, number: int = -1,
             whole: bool = False) -> None:
        nonlocal expected, flawed
        out.append(data)
        if flawed or (event is None and not data):
            return  # (no junk at all is no flaw)
        if event is not None and whole and number == expected:
            intact.append(event)
            expected += 1
        else:
            flawed = True

    for p in parts:
        if isinstance(p, Frame):
            n, f = new(p.event)
            sent = mutate(f, prefix_of(f), p.mutations, p.cut)
            send(sent, p.event, n, whole=sent == f)
        elif isinstance(p, Junk):
            send(p.data)
        elif isinstance(p, Swapped):
            (na, a), (nb, b) = new(p.first), new(p.second)
            send(b, p.second, nb, whole=True)
            send(a, p.first, na, whole=True)
        elif isinstance(p, Twice):
            n, f = new(p.event)
            send(f, p.event, n, whole=True)
            send(f, p.event, n, whole=True)
        else:  # Dropped
            new(p.event)
    return b"".join(out), intact
