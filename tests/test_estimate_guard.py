"""The controller's guard over the agents' estimates (issue 32)."""

from __future__ import annotations

import math

import pytest

from mlfabric.errors import ConfigError
from mlfabric.scheduling.estimates import EstimateGuard, Held

MB = 1e6  # bytes/s


def test_a_one_report_spike_is_never_planned_with() -> None:
    """A 30 Mbit/s path read 1,232 Mbit/s for a second (a token bucket let a
    short train through at the sender's pace): the plan keeps 30."""
    g = EstimateGuard()
    assert g.update("h0", {"h1": (3.75 * MB, False)}, 0.0) == ({"h1": (3.75 * MB, False)}, [])
    used, held = g.update("h0", {"h1": (154 * MB, False)}, 0.5)
    assert used == {"h1": (3.75 * MB, False)}
    assert held == [Held("h0", "h1", "jump", 154 * MB, 3.75 * MB)]
    assert g.update("h0", {"h1": (3.8 * MB, False)}, 1.0) == ({"h1": (3.8 * MB, False)}, [])


@pytest.mark.parametrize("factor", [4.0, 0.25])
def test_a_real_step_beyond_the_jump_factor_is_taken_once_confirmed(factor: float) -> None:
    g = EstimateGuard(jump=3.0, confirm=2)
    g.update("h0", {"h1": (25 * MB, False)}, 0.0)
    new = 25 * MB * factor
    used, held = g.update("h0", {"h1": (new, False)}, 0.5)
    assert used["h1"] == (25 * MB, False) and held[0].reason == "jump"
    used, held = g.update("h0", {"h1": (new * 1.1, False)}, 1.0)  # agrees within 25%
    assert used["h1"] == (new * 1.1, False) and held == []


def test_steps_within_the_factor_are_followed_at_once() -> None:
    g = EstimateGuard(jump=3.0)
    g.update("h0", {"h1": (25 * MB, False)}, 0.0)
    for rate in (50 * MB, 25 * MB, 12.5 * MB, 30 * MB):  # each within 3x of the last
        assert g.update("h0", {"h1": (rate, False)}, 1.0) == ({"h1": (rate, False)}, [])


def test_reports_that_disagree_with_each_other_are_never_taken() -> None:
    g = EstimateGuard(jump=3.0, confirm=2)
    g.update("h0", {"h1": (10 * MB, False)}, 0.0)
    for t, rate in enumerate((100 * MB, 300 * MB, 60 * MB, 200 * MB)):
        used, held = g.update("h0", {"h1": (rate, False)}, 0.5 * (t + 1))
        assert used["h1"] == (10 * MB, False) and held[0].reported == rate


def test_a_stale_estimate_keeps_the_last_good_one_for_a_while() -> None:
    g = EstimateGuard(keep_stale=30.0)
    g.update("h0", {"h1": (10 * MB, False)}, 0.0)
    used, held = g.update("h0", {"h1": (math.nan, True)}, 10.0)
    assert used == {"h1": (10 * MB, False)}
    assert held[0].reason == "stale" and held[0].used == 10 * MB
    used, held = g.update("h0", {"h1": (math.nan, True)}, 31.0)
    assert used["h1"][1] and held == []  # too old: the configured capacities apply
    # Never known: passed on as stale.
    assert g.update("h0", {"h2": (math.nan, True)}, 0.0)[0]["h2"][1]


def test_pairs_are_kept_apart() -> None:
    g = EstimateGuard()
    g.update("h0", {"h1": (10 * MB, False), "h2": (100 * MB, False)}, 0.0)
    g.update("h1", {"h0": (100 * MB, False)}, 0.0)
    used, held = g.update("h0", {"h1": (90 * MB, False), "h2": (90 * MB, False)}, 0.5)
    assert used == {"h1": (10 * MB, False), "h2": (90 * MB, False)}
    assert [h.peer for h in held] == ["h1"]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"jump": 1.0}, "jump factor must be above 1, got 1.0"),
    ({"confirm": 0}, "at least 1 report"),
    ({"agree": 1.5}, r"agree must be a fraction in \(0, 1\), got 1.5"),
    ({"keep_stale": -1}, "keep_stale must be >= 0 seconds, got -1"),
])
def test_bad_settings_say_what_was_wrong(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        EstimateGuard(**kwargs)
