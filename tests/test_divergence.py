"""The divergence bound against the true ||w_s - w_r|| of a numpy replay."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.errors import ConfigError
from mlfabric.replication.divergence import PrefixBound, sequence_bound, weight


def replay(w0, v0, updates, order, gamma):
    """The brief's rule in float64 from (w_0, w_-1 = w_0 - v_0)."""
    w, prev = w0.copy(), w0 - v0
    for g in order:
        w, prev = w + updates[g] + gamma * (w - prev), w
    return w


def norms_of(updates):
    return {g: float(np.linalg.norm(u)) for g, u in updates.items()}


@st.composite
def scenarios(draw):
    n = draw(st.integers(1, 12))
    dim = draw(st.integers(1, 6))
    gamma = draw(st.sampled_from([0.0, 0.5, 0.9, 0.99]) | st.floats(0.0, 0.999))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scales = rng.choice([1e-3, 1.0, 1e3], size=n)
    updates = {g: scales[g] * rng.standard_normal(dim) for g in range(n)}
    server = draw(st.permutations(range(n)))
    server = server[: draw(st.integers(0, n))]
    replica = draw(st.permutations(range(n)))
    replica = replica[: draw(st.integers(0, n))]
    v0 = rng.standard_normal(dim) * draw(st.sampled_from([0.0, 0.1, 10.0]))
    return gamma, updates, list(server), list(replica), rng.standard_normal(dim), v0


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_bound_holds_for_any_two_sequences(case):
    gamma, updates, server, replica, w0, v0 = case
    true = np.linalg.norm(replay(w0, v0, updates, server, gamma)
                          - replay(w0, v0, updates, replica, gamma))
    bound = sequence_bound(server, replica, norms_of(updates), gamma,
                           velocity_norm=float(np.linalg.norm(v0)))
    assert bound >= true * (1 - 1e-9) - 1e-9


@settings(max_examples=300, deadline=None)
@given(scenarios(), st.data())
def test_prefix_bound_holds_and_equals_the_general_one(case, data):
    gamma, updates, _, _, w0, v0 = case
    order = list(updates)
    m = data.draw(st.integers(0, len(order)))
    pb = PrefixBound(gamma, velocity_norm=float(np.linalg.norm(v0)))
    for g in order:
        pb.server_applied(float(np.linalg.norm(updates[g])))
    pb.replica_applied(m)
    assert pb.lag == len(order) - m
    true = np.linalg.norm(replay(w0, v0, updates, order, gamma)
                          - replay(w0, v0, updates, order[:m], gamma))
    general = sequence_bound(order, order[:m], norms_of(updates), gamma,
                             velocity_norm=float(np.linalg.norm(v0)))
    assert pb.bound() == pytest.approx(general, rel=1e-9, abs=1e-12)
    assert pb.bound() >= true * (1 - 1e-9) - 1e-9


def test_swapped_pair_bound_is_tight_for_opposite_updates():
    # u1 then u2 at the server, u2 then u1 at the replica: w_s - w_r = gamma * (u1 - u2).
    gamma = 0.9
    u1 = np.array([3.0, 4.0])
    updates = {1: u1, 2: -2 * u1}
    true = np.linalg.norm(replay(np.zeros(2), np.zeros(2), updates, [1, 2], gamma)
                          - replay(np.zeros(2), np.zeros(2), updates, [2, 1], gamma))
    assert true == pytest.approx(gamma * 15.0)
    assert sequence_bound([1, 2], [2, 1], norms_of(updates), gamma) == pytest.approx(true)


def test_one_lagging_update_after_momentum_history():
    # Replica lacks only the last update: the gap is Delta_n = a_n + gamma * Delta_{n-1}.
    pb = PrefixBound(0.5)
    for norm in (4.0, 2.0, 1.0):
        pb.server_applied(norm)
    pb.replica_applied(2)
    # B_2 = 2 + 0.5 * 4 = 4; bound = B_3 = 1 + 0.5 * 4 = 3
    assert pb.bound() == pytest.approx(3.0)
    assert pb.bound_after([2.0]) == pytest.approx(3.0 + 2.0 + 0.5 * 3.0)
    pb.replica_applied()
    assert pb.lag == 0 and pb.bound() == 0.0


def test_weights_and_bad_input():
    assert [weight(k, 0.5) for k in (-1, 0, 1, 2)] == [0.0, 1.0, 1.5, 1.75]
    assert weight(5, 0.0) == 1.0
    with pytest.raises(ConfigError, match=r"momentum must be in \[0, 1\), got 1.0"):
        PrefixBound(1.0)
    pb = PrefixBound(0.9)
    with pytest.raises(ValueError, match="cannot apply 1 updates: it lags by 0"):
        pb.replica_applied()
    with pytest.raises(ValueError, match="norm must be >= 0, got nan"):
        pb.server_applied(float("nan"))
    with pytest.raises(ValueError, match="appears twice in the server's sequence"):
        sequence_bound([1, 1], [], {1: 1.0}, 0.5)


def test_bound_holds_for_the_real_stores_as_the_replica_lags():
    """Server and replica ParameterStores (float32 kernels): the measured
    divergence stays within the bound at every lag, and is 0 once caught up."""
    from mlfabric.kernels import _core
    from mlfabric.server.store import ParameterStore

    from support import make_model, random_update

    model = make_model()
    server = ParameterStore(model, momentum=0.9)
    replica = ParameterStore(model, momentum=0.9)
    pb = PrefixBound(0.9)
    updates = [random_update(model, seed, scale=0.1) for seed in range(30)]
    for i, u in enumerate(updates):
        server.apply(server.version, u)
        pb.server_applied(float(np.sqrt(sum(_core.l2_norm(a) ** 2 for a in u.values()))))
        if i % 3 == 2:  # the replica catches up by one every third step
            replica.apply_sequenced(replica.version + 1, 0, updates[replica.version])
            pb.replica_applied()
        true = np.sqrt(sum(_core.l2_norm_diff(server.weights[n], replica.weights[n]) ** 2
                           for n in model))
        w_norm = np.sqrt(sum(_core.l2_norm(w) ** 2 for w in server.weights.values()))
        assert true <= pb.bound(w_norm), (i, true, pb.bound(w_norm))
    while replica.version < server.version:
        replica.apply_sequenced(replica.version + 1, 0, updates[replica.version])
        pb.replica_applied()
    assert pb.bound() == 0.0
    for n in model:
        assert _core.l2_norm_diff(server.weights[n], replica.weights[n]) == 0.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1e3), min_size=0, max_size=8), st.floats(0, 0.999),
       st.floats(0, 10), st.randoms(use_true_random=False))
def test_unordered_bound_covers_every_order(norms, gamma, velocity, rnd):
    from mlfabric.replication.divergence import unordered_bound

    shuffled = list(norms)
    rnd.shuffle(shuffled)
    pb = PrefixBound(gamma, velocity_norm=velocity)
    for norm in shuffled:
        pb.server_applied(norm)
    assert unordered_bound(velocity, norms, gamma) >= pb.bound() * (1 - 1e-12)


def test_gate_holds_server_transfers_until_the_replica_catches_up():
    from mlfabric.replication.divergence import DivergenceGate

    gate = DivergenceGate(0.5, div_max=3.0)
    assert gate.admit([], 1.0)  # bound 1
    assert gate.admit([1.0], 1.0)  # two in flight: c(1) + c(0) = 2.5
    assert not gate.admit([1.0, 1.0], 1.0)  # 1.75 + 1.5 + 1 = 4.25 > 3
    gate.server_applied(2, 1.0)  # reported out of order: version 1 still unknown
    gate.replica_applied(2)  # the replica is at 2, but 1's norm is not known yet
    assert gate.replica == 0 and gate.lag(in_flight=1) == 2
    gate.server_applied(1, 1.0)
    assert gate.replica == 2 and gate.lag() == 0
    assert gate.velocity == pytest.approx(1.0 + 0.5 * 1.0)  # B_2 = a_2 + gamma * a_1
    # Lag 0 but momentum: the next server step moves by up to a + gamma * B = a + 0.75.
    assert gate.bound([1.0]) == pytest.approx(1.75)
    assert gate.admit([], 2.0) and gate.overrides == 0
    assert not gate.admit([2.0], 0.1)
    # 0.75 + 2.5 = 3.25 > 3, but with nothing lagging it must go (or never would).
    assert gate.admit([], 2.5) and gate.overrides == 1



# -- aggregates: one momentum step of the members' sum, version += k ----------------


def test_an_aggregate_is_folded_as_one_step_not_one_per_version():
    """The server's heartbeat: versions 1..3 are one aggregate of norm 2 (spans
    (3, 3)). Folded once: B = 2 + gamma * 4, not 2 + gamma^3 * 4."""
    from mlfabric.replication.divergence import DivergenceGate

    gate = DivergenceGate(0.5, div_max=100.0)
    gate.start(0, 4.0)
    gate.server_applied(3, 2.0, 3)
    assert gate.lag() == 3 and gate.bound() == pytest.approx(2.0 + 0.5 * 4.0)
    gate.replica_applied(3)
    assert (gate.replica, gate.lag(), gate.velocity) == (3, 0, 2.0 + 0.5 * 4.0)
    # One step ahead (norm 1): 1 + gamma * 4, where a per-version fold says 1 + 0.5 * 2.5.
    gate.server_applied(4, 1.0)
    assert gate.bound() == 1.0 + 0.5 * 4.0


def test_members_are_summed_and_folded_only_once_all_reported():
    from mlfabric.replication.divergence import DivergenceGate

    gate = DivergenceGate(0.5, div_max=100.0)
    gate.start(0, 4.0)
    gate.server_applied(3, 1.0, 3, member=True)  # each member reports the aggregate's end
    gate.server_applied(3, 2.0, 3, member=True)
    gate.replica_applied(3)
    # Incomplete: counted as one lagging step of 3.0 (the third member is in
    # flight, counted there), not folded; its two versions count in the lag.
    assert (gate.replica, gate.applied, gate.lag(in_flight=1)) == (0, {3: 3.0}, 3)
    assert gate.bound([0.5]) == pytest.approx(0.5 * 1.5 * 4.0 + 1.5 * 3.0 + 0.5)
    gate.server_applied(3, 0.5, 3, member=True)
    assert (gate.replica, gate.lag()) == (3, 0)
    assert gate.velocity == 3.5 + 0.5 * 4.0  # sum of member norms >= ||A||
    # The server's exact norm replaces a partial sum; later members are ignored.
    gate.server_applied(5, 9.0, 2, member=True)
    gate.server_applied(5, 1.0, 2)
    gate.server_applied(5, 9.0, 2, member=True)
    assert gate.applied == {5: 1.0}
    gate.replica_applied(5)
    assert (gate.replica, gate.velocity) == (5, 1.0 + 0.5 * (3.5 + 0.5 * 4.0))


def test_versions_an_aggregate_skipped_are_no_steps():
    """A heartbeat without spans (a server that does not send them) lists
    0.0 at the versions an aggregate skipped: taken for steps of zero until
    a member's report says they were one aggregate, and ignored after."""
    from mlfabric.replication.divergence import DivergenceGate

    gate = DivergenceGate(0.9, div_max=100.0)
    gate.start(0, 10.0)
    for version, norm in ((1, 0.0), (2, 0.0), (3, 5.0)):
        gate.server_applied(version, norm)
    assert gate.lag() == 3 and sorted(gate.applied) == [1, 2, 3]
    gate.server_applied(3, 2.0, 3, member=True)
    assert gate.applied == {3: 5.0} and gate.lag() == 3
    gate.server_applied(2, 0.0)  # the same heartbeat again
    assert gate.applied == {3: 5.0}
    gate.replica_applied(3)
    assert gate.velocity == 5.0 + 0.9 * 10.0
    # A report of a version the gate folded already changes nothing.
    gate.server_applied(3, 7.0)
    assert (gate.replica, gate.applied) == (3, {})


def test_a_step_waits_for_the_versions_before_it():
    """The replica reported 5, but the step ending at 2 is not known: nothing
    past it folds, and steps are never folded past the replica's report."""
    from mlfabric.replication.divergence import DivergenceGate

    gate = DivergenceGate(0.5, div_max=100.0)
    gate.server_applied(5, 1.0, 3)
    gate.server_applied(1, 1.0)
    gate.replica_applied(5)
    assert (gate.replica, gate.lag()) == (1, 3)
    gate.server_applied(2, 2.0)
    assert (gate.replica, gate.lag()) == (5, 0)
    assert gate.velocity == 1.0 + 0.5 * (2.0 + 0.5 * 1.0)
    gate.server_applied(8, 1.0, 3)
    gate.replica_applied(6)  # not a step's end (wrong input): nothing folds
    assert gate.replica == 5
    gate.start(8, 0.0)  # drops the steps ending at or below 8
    assert gate.applied == {} and gate.lag() == 0
    gate.server_applied(12, 1.0, 4)
    gate.forget_above(11)
    assert gate.applied == {}


def test_step_input_is_checked():
    from mlfabric.replication.divergence import DivergenceGate

    gate = DivergenceGate(0.5, div_max=1.0)
    with pytest.raises(ValueError,
                       match=r"a step spans 1 or more versions \(an aggregate's fan-in\), got 0"):
        gate.server_applied(3, 1.0, 0)
    with pytest.raises(ValueError, match=r"norm must be >= 0, got -1\.0"):
        gate.server_applied(3, -1.0, 2, member=True)


def replay_steps(w0, v0, steps, gamma):
    """The server's rule over steps in float64: each step one momentum step
    of its update (an aggregate: the sum of its members)."""
    w, prev = w0.copy(), w0 - v0
    for a in steps:
        w, prev = w + a + gamma * (w - prev), w
    return w


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([0.0, 0.5, 0.9, 0.99]) | st.floats(0, 0.999),
       st.data())
def test_a_lagging_aggregate_counted_as_its_members_stays_a_bound(seed, gamma, data):
    """Splitting one lagging step of ||A|| into items n_1..n_j with
    sum n_j >= ||A|| never lowers the bound (module docstring, "Aggregates"):
    here A's members are counted as separate items (some reported and summed,
    the others in flight), against a float64 replay of A as one step."""
    from mlfabric.replication.divergence import unordered_bound

    rng = np.random.default_rng(seed)
    dim = data.draw(st.integers(1, 4))
    n = data.draw(st.integers(1, 6))
    k = data.draw(st.integers(2, 6))
    at = data.draw(st.integers(0, n - 1))  # which lagging step is the aggregate
    m = data.draw(st.integers(0, at))  # the replica's steps: A lags
    aligned = data.draw(st.booleans())  # same-direction updates: a tight triangle inequality

    def update(scale):
        d = np.ones(dim) + 0.01 * rng.standard_normal(dim) if aligned else \
            rng.standard_normal(dim)
        return scale * d

    members = [update(rng.choice([0.0, 1e-3, 1.0])) for _ in range(k)]
    steps = [update(rng.choice([1e-3, 1.0, 10.0])) for _ in range(n)]
    steps[at] = sum(members)
    w0, v0 = rng.standard_normal(dim), update(rng.choice([0.0, 1.0, 10.0]))
    true = np.linalg.norm(replay_steps(w0, v0, steps, gamma)
                          - replay_steps(w0, v0, steps[:m], gamma))
    b_m = np.linalg.norm(v0)
    for a in steps[:m]:
        b_m = np.linalg.norm(a) + gamma * b_m
    exact = unordered_bound(b_m, [np.linalg.norm(a) for a in steps[m:]], gamma)
    norms = [float(np.linalg.norm(u)) for u in members]
    reported = data.draw(st.integers(0, k))
    items = [np.linalg.norm(a) for j, a in enumerate(steps[m:], m) if j != at]
    split = unordered_bound(b_m, [*items, *([sum(norms[:reported])] if reported else []),
                                  *norms[reported:]], gamma)
    assert exact >= true * (1 - 1e-9) - 1e-9
    assert split >= exact * (1 - 1e-12)
    assert split >= true * (1 - 1e-9) - 1e-9


def test_folding_an_aggregate_per_version_or_per_member_is_not_a_bound():
    """The counter-example. From rest, update u (||u|| = 10) is applied on
    both sides, so B = 10 exactly. Then an aggregate of two members 0.1 e
    (same direction) on both sides: the true velocity is ||A + gamma u|| =
    9.2. Then one more step of a zero update at the server only: the truth
    is gamma * 9.2 = 8.28. Folding the aggregate once (the gate) bounds it;
    folding its versions (0, ||A||) or its members as steps does not."""
    from mlfabric.replication.divergence import DivergenceGate

    gamma = 0.9
    e = np.array([1.0, 0.0])
    u, member, zero = 10.0 * e, 0.1 * e, 0.0 * e
    w0 = np.zeros(2)
    server = replay_steps(w0, w0, [u, member + member, zero], gamma)
    replica = replay_steps(w0, w0, [u, member + member], gamma)
    true = np.linalg.norm(server - replica)
    assert true == pytest.approx(0.9 * 9.2)

    def fed(reports):
        gate = DivergenceGate(gamma, div_max=100.0)
        gate.start(0, 0.0)
        gate.server_applied(1, 10.0)
        for version, norm, span, is_member in reports:
            gate.server_applied(version, norm, span, member=is_member)
        gate.server_applied(4, 0.0)
        gate.replica_applied(3)
        assert gate.replica == 3
        return gate.bound()

    one_step = fed([(3, 0.2, 2, False)])
    members_summed = fed([(3, 0.1, 2, True), (3, 0.1, 2, True)])
    per_version = fed([(2, 0.0, 1, False), (3, 0.2, 1, False)])
    # Members as steps: the old controller's overwrite aside, fold 0.1 then 0.1.
    per_member = fed([(2, 0.1, 1, False), (3, 0.1, 1, False)])
    assert one_step == pytest.approx(0.9 * (0.2 + 0.9 * 10.0)) and one_step >= true
    assert members_summed == pytest.approx(one_step)
    assert per_version == pytest.approx(0.9 * (0.2 + 0.81 * 10.0)) and per_version < true
    assert per_member == pytest.approx(0.9 * (0.1 + 0.9 * (0.1 + 0.9 * 10.0)))
    assert per_member < true
