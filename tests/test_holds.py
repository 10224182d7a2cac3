"""The bookkeeping of pushes a server holds for the transfers their go named
(mlfabric.server.holds, issue 34)."""

from __future__ import annotations

import pytest

from mlfabric.server.holds import Holds


def test_a_push_goes_once_every_ticket_it_waits_for_has_landed_in_the_order_held():
    h = Holds()
    h.landed(1)
    assert h.missing([1, 2, 3]) == {2, 3}
    assert h.hold("b", {2, 3}) and h.hold("c", {2}) and h.hold("d", {4})
    assert len(h) == 3 and "b" in h
    assert h.landed(2) == ["c"]  # b still waits for 3
    assert h.landed(3) == ["b"]
    assert h.landed(3) == []  # landing again frees nothing more
    assert h.missing([2, 3]) == set()
    assert list(h.landed(4)) == ["d"] and len(h) == 0


def test_a_dropped_push_is_forgotten_and_frees_nothing():
    h = Holds()
    assert h.hold("b", {2}) and h.hold("c", {2})
    assert h.drop("b") and not h.drop("b")
    assert h.landed(2) == ["c"]
    assert not h.drop("c")  # released already


def test_holds_are_bounded_and_landings_are_remembered_only_so_long():
    h = Holds(memory=2, limit=1)
    assert h.hold("b", {9})
    assert not h.hold("c", {9})  # full: the server applies it as it lands
    for t in (1, 2, 3):
        h.landed(t)
    assert h.missing([1, 2, 3]) == {1}  # the oldest forgotten
    with pytest.raises(ValueError, match="held already"):
        h.hold("b", {5})
    with pytest.raises(ValueError, match="at least one ticket"):
        h.hold("e", set())
    with pytest.raises(ValueError, match="memory must be >= 1"):
        Holds(memory=0)
