"""mlfabric.torch against a live parameter server: what step() pushes, what
pull() writes into the module, and how outcomes and failures are handled."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mlfabric  # noqa: E402
import mlfabric.torch as mt  # noqa: E402
from mlfabric.errors import ConfigError, InvalidUpdate  # noqa: E402
from mlfabric.server.store import ParameterStore  # noqa: E402

from support import (  # noqa: E402
    JOB,
    TOKEN,
    Reference,
    ServerThread,
    assert_model_equal,
    sample,
)


class Net(torch.nn.Module):
    def __init__(self, seed: int = 0, unused: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(8, 6)
        self.fc2 = torch.nn.Linear(6, 3)
        if unused:
            self.spare = torch.nn.Parameter(torch.ones(2))

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def backward(model: torch.nn.Module, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 8, generator=g)
    y = torch.randint(0, 3, (16,), generator=g)
    model.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()


def arrays(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def server_model(st: ServerThread) -> tuple[int, dict[str, np.ndarray]]:
    return st.call(st.store.snapshot)  # type: ignore[return-value]


@pytest.fixture
def serve():
    started = []

    def start(model, **kwargs):
        st = ServerThread(ParameterStore(model, **kwargs)).__enter__()
        started.append(st)
        return st

    yield start
    for st in started:
        st.__exit__(None, None, None)


@pytest.fixture
def client():
    clients = []

    def connect(st):
        ps = mlfabric.connect(st.address, job=JOB, token=TOKEN, timeout=5)
        clients.append(ps)
        return ps

    yield connect
    for ps in clients:
        ps.close()


def test_save_init_writes_the_named_parameters_as_float32(tmp_path):
    model = Net(seed=3).double()
    path = tmp_path / "init.npz"
    mt.save_init(model, path)
    with np.load(path) as npz:
        saved = {n: npz[n] for n in npz.files}
    assert sorted(saved) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    for name, p in model.named_parameters():
        assert saved[name].dtype == np.float32
        np.testing.assert_array_equal(saved[name], p.detach().numpy().astype(np.float32))
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_construction_pulls_the_servers_model_into_the_module_in_place(serve, client):
    served = mt.model_arrays(Net(seed=1))
    st = serve(served)
    model = Net(seed=2)
    pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
    assert not np.array_equal(arrays(model)["fc1.weight"], served["fc1.weight"])
    opt = mt.DistributedOptimizer(model, client(st), lr=0.1)
    assert opt.version == 0
    assert_model_equal(arrays(model), served)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == pointers


def test_one_sgd_step_pushes_exactly_minus_lr_times_the_gradient(serve, client):
    model = Net()
    st = serve(mt.model_arrays(model), momentum=0.5)
    opt = mt.DistributedOptimizer(model, client(st), lr=0.05)
    pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
    ref = Reference(arrays(model), gamma=0.5)
    for step in range(3):
        backward(model, seed=step)
        update = {n: np.float32(-0.05) * p.grad.numpy() for n, p in model.named_parameters()}
        outcome = opt.step()
        ref.apply(update)
        assert outcome is not None and outcome.applied and outcome.delay == 0
        version, weights = server_model(st)
        assert version == step + 1 == opt.version
        assert_model_equal(weights, ref.w)  # bit-exact: the update was -lr*grad in float32
        assert_model_equal(arrays(model), ref.w)  # and the pull landed in the module
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == pointers
    stats = opt.stats()
    assert (stats.steps, stats.applied, stats.dropped, stats.last_delay) == (3, 3, 0, 0)
    assert stats.delays == {0: 3}


def loss_closure(model: torch.nn.Module, seed: int):
    def closure():
        backward(model, seed)
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(16, 8, generator=g)
        y = torch.randint(0, 3, (16,), generator=g)
        return torch.nn.functional.cross_entropy(model(x), y)

    return closure


LOCAL_OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "lbfgs": lambda params: torch.optim.LBFGS(params, lr=0.5, max_iter=3),
}


@pytest.mark.parametrize("kind", list(LOCAL_OPTIMIZERS))
def test_a_local_optimizers_step_is_pushed_as_the_parameter_change(serve, client, kind):
    model = Net()
    st = serve(mt.model_arrays(model))
    twin = copy.deepcopy(model)
    twin_opt = LOCAL_OPTIMIZERS[kind](twin.parameters())
    local = LOCAL_OPTIMIZERS[kind](model.parameters())
    opt = mt.DistributedOptimizer(model, client(st), local_optimizer=local)
    ref = Reference(arrays(model), gamma=0.0)
    for step in range(3):
        before = arrays(twin)
        if kind == "lbfgs":  # needs a closure: step(closure) passes it on
            twin_opt.step(loss_closure(twin, step))
            outcome = opt.step(loss_closure(model, step))
        else:
            backward(model, seed=step)
            backward(twin, seed=step)
            twin_opt.step()
            outcome = opt.step()
        assert outcome.applied
        update = {n: arrays(twin)[n] - before[n] for n in before}
        ref.apply(update)
        assert_model_equal(server_model(st)[1], ref.w)
        assert_model_equal(arrays(model), ref.w)
        assert np.abs(update["fc1.weight"]).max() > 1e-4  # the optimizer really moved it
        # The module now holds w + (new - w), which may differ from the twin's
        # `new` in the last bit: give the twin the same weights to go on from.
        np.testing.assert_allclose(arrays(twin)["fc1.weight"], ref.w["fc1.weight"], atol=1e-6)
        with torch.no_grad():
            for n, p in twin.named_parameters():
                p.copy_(torch.from_numpy(ref.w[n]))


def test_a_parameter_without_gradient_is_pushed_as_zeros(serve, client):
    model = Net(unused=True)
    st = serve(mt.model_arrays(model))
    opt = mt.DistributedOptimizer(model, client(st), lr=0.1)
    backward(model)
    assert model.spare.grad is None
    assert opt.step().applied
    _, weights = server_model(st)
    np.testing.assert_array_equal(weights["spare"], np.ones(2, np.float32))
    assert not np.array_equal(weights["fc1.weight"], mt.model_arrays(Net())["fc1.weight"])


def test_between_pulls_the_module_trains_on_its_own_updates(serve, client):
    model = Net()
    st = serve(mt.model_arrays(model))
    opt = mt.DistributedOptimizer(model, client(st), lr=0.1, pull_every=3)
    local = arrays(model)
    delays = []
    for step in range(3):
        backward(model, seed=step)
        for n, p in model.named_parameters():
            local[n] = local[n] + np.float32(-0.1) * p.grad.numpy()
        delays.append(opt.step().delay)
        if step < 2:  # no pull yet: the module holds its own updates, version stays
            assert opt.version == 0
            assert_model_equal(arrays(model), local)
    # Every update was tagged with the last pull's version: delays 0, 1, 2.
    assert delays == [0, 1, 2]
    assert opt.version == 3
    assert_model_equal(arrays(model), server_model(st)[1])


def test_a_stale_update_is_counted_and_not_applied(serve, client):
    model_a, model_b = Net(), Net()
    st = serve(mt.model_arrays(model_a), tau_max=0)
    opt_a = mt.DistributedOptimizer(model_a, client(st), lr=0.1)
    opt_b = mt.DistributedOptimizer(model_b, client(st), lr=0.1)
    backward(model_a)
    assert opt_a.step().applied
    _, after_a = server_model(st)
    backward(model_b, seed=7)
    outcome = opt_b.step()  # computed on version 0, the server is at 1: delay 1 > tau_max 0
    assert not outcome.applied and outcome.reason.startswith("stale: delay 1")
    version, weights = server_model(st)
    assert version == 1
    assert_model_equal(weights, after_a)
    stats = opt_b.stats()
    assert (stats.applied, stats.dropped, stats.dropped_reasons) == (0, 1, {"stale": 1})
    # The worker went on: it pulled the newest model and can push from it.
    assert opt_b.version == 1
    assert_model_equal(arrays(model_b), after_a)
    backward(model_b, seed=8)
    assert opt_b.step().applied


@pytest.mark.parametrize("local", [False, True], ids=["sgd", "local-optimizer"])
def test_a_push_that_raises_leaves_the_module_as_before_the_step(serve, client, local):
    model = Net()
    st = serve(mt.model_arrays(model))
    kwargs = ({"local_optimizer": torch.optim.SGD(model.parameters(), lr=0.1)} if local
              else {"lr": 0.1})
    opt = mt.DistributedOptimizer(model, client(st), **kwargs)
    before = arrays(model)
    backward(model)
    model.fc1.weight.grad[0, 0] = float("nan")
    with pytest.raises(InvalidUpdate, match="NaN"):
        opt.step()
    assert_model_equal(arrays(model), before)
    assert server_model(st)[0] == 0
    backward(model)  # a good step afterwards works
    assert opt.step().applied


def test_with_several_pushes_in_flight_flush_collects_them(serve, client):
    model = Net()
    st = serve(mt.model_arrays(model))
    opt = mt.DistributedOptimizer(model, client(st), lr=0.1, max_in_flight=3, pull_every=0)
    for step in range(4):
        backward(model, seed=step)
        opt.step()
    assert opt.stats().in_flight == 2
    opt.flush()
    stats = opt.stats()
    assert (stats.in_flight, stats.applied, stats.version) == (0, 4, 0)
    assert opt.pull() == 4
    assert_model_equal(arrays(model), server_model(st)[1])


def test_a_model_that_does_not_match_the_server_is_a_config_error(serve, client):
    st = serve({"w": np.zeros((3, 3), np.float32)})
    with pytest.raises(ConfigError, match=r"server has no tensor 'fc1.bias'.*save_init"):
        mt.DistributedOptimizer(Net(), client(st), lr=0.1)
    served = mt.model_arrays(Net())
    served["fc2.bias"] = np.zeros(4, np.float32)
    st2 = serve(served)
    with pytest.raises(ConfigError, match=r"'fc2.bias' has shape \(4,\).*\(3,\)"):
        mt.DistributedOptimizer(Net(), client(st2), lr=0.1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of lr"),
        ({"lr": 0.1, "local_optimizer": "x"}, "exactly one of lr"),
        ({"lr": -1.0}, "lr must be a positive number, got -1.0"),
        ({"lr": 0.1, "pull_every": -1}, "pull_every must be an integer >= 0, got -1"),
        ({"lr": 0.1, "max_in_flight": 0}, "max_in_flight must be an integer >= 1, got 0"),
    ],
)
def test_bad_arguments_are_config_errors(serve, client, kwargs, message):
    model = Net()
    st = serve(mt.model_arrays(model))
    with pytest.raises(ConfigError, match=message):
        mt.DistributedOptimizer(model, client(st), **kwargs)


def test_a_local_optimizer_over_other_tensors_is_refused(serve, client):
    model = Net()
    st = serve(mt.model_arrays(model))
    other = torch.optim.SGD(Net().parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="not a parameter of the module"):
        mt.DistributedOptimizer(model, client(st), local_optimizer=other)


def test_through_a_controller_its_drops_are_counted(serve, tmp_path):
    from mlfabric import config
    from mlfabric.controller.controller import Controller
    from mlfabric.scheduling.plan import PlanItem

    def drop_even(snap):  # the worker's 2nd, 4th, ... request is dropped
        return [PlanItem(t.id, start=snap.now) if t.req % 2 else
                PlanItem(t.id, drop="deadline_missed", detail="test") for t in snap.pending]

    model = Net()
    st = serve(mt.model_arrays(model))
    token = tmp_path / "job.token"
    token.write_bytes(TOKEN)
    with ServerThread(None, endpoint=Controller(drop_even, job=JOB, token=TOKEN,
                                                tau_max=None)) as controller:
        settings = config.resolve({"server": st.address, "controller": controller.address,
                                   "job": JOB, "token_file": str(token)}, environ={})
        with config.connect(settings) as ps:
            opt = mt.DistributedOptimizer(model, ps, lr=0.1)
            outcomes = []
            for step in range(4):
                backward(model, seed=step)
                outcomes.append(opt.step())
            assert [o.applied for o in outcomes] == [True, False, True, False]
            assert outcomes[1].reason == "dropped by the controller: deadline_missed: test"
            stats = opt.stats()
            assert (stats.applied, stats.dropped) == (2, 2)
            assert stats.dropped_reasons == {"dropped by the controller": 2}
            assert opt.version == 2
            assert_model_equal(arrays(model), server_model(st)[1])
    # Each step's pull went out with its push; a dropped one's pull, if the
    # drop had not come back first, was cancelled at the server, never left
    # to expire (the applied ones were answered with the update in them).
    m = st.server.metrics
    assert sample(m.pulls_cancelled) <= 2
    assert (sample(m.pulls_held), sample(m.pulls_expired)) == (0, 0)


def test_a_sharded_job_trains_as_one_model(client):
    """Two shards: the optimizer pulls the whole model into the module and
    pushes -lr*grad; the shards together hold the numpy replay bit for bit."""
    from mlfabric.server.cli import shard_store

    model = Net()
    served = mt.model_arrays(model)
    threads = []
    try:
        for i in range(2):
            tensors, info = shard_store(served, (i, 2), 1 << 16)
            store = ParameterStore(tensors, momentum=0.5)
            store.shard = info
            threads.append(ServerThread(store).__enter__())
        ps = mlfabric.connect(",".join(t.address for t in threads), job=JOB, token=TOKEN)
        try:
            opt = mt.DistributedOptimizer(model, ps, lr=0.05)
            assert opt.version == (0, 0)
            ref = Reference(arrays(model), gamma=0.5)
            for step in range(3):
                backward(model, seed=step)
                update = {n: np.float32(-0.05) * p.grad.numpy()
                          for n, p in model.named_parameters()}
                outcome = opt.step()
                ref.apply(update)
                assert outcome.applied and outcome.delay == 0
                assert opt.version == (step + 1, step + 1)
                assert_model_equal(arrays(model), ref.w)
            assert opt.stats().delays == {0: 3}
        finally:
            ps.close()
    finally:
        for t in threads:
            t.__exit__(None, None, None)


# --- a torch.optim.Optimizer: schedulers, GradScaler, state dicts, Horovod's order (issue 36)


def test_it_is_an_optimizer_whose_lr_a_scheduler_sets(serve, client):
    """StepLR halves the param groups' lr after each step: each push is
    float32(-lr) * grad at that step's lr, bit for bit on the server."""
    model = Net()
    st = serve(mt.model_arrays(model))
    opt = mt.DistributedOptimizer(model, client(st), lr=0.2)
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref = Reference(arrays(model), gamma=0.0)
    for step, lr in enumerate([0.2, 0.1, 0.05]):
        assert opt.lr == pytest.approx(lr) and opt.param_groups[0]["lr"] == pytest.approx(lr)
        backward(model, seed=step)
        ref.apply({n: np.float32(-opt.param_groups[0]["lr"]) * p.grad.numpy()
                   for n, p in model.named_parameters()})
        assert opt.step().applied
        sched.step()
        assert_model_equal(server_model(st)[1], ref.w)


def test_a_scheduler_reaches_the_local_optimizer(serve, client):
    model = Net()
    st = serve(mt.model_arrays(model))
    local = torch.optim.SGD(model.parameters(), lr=0.4, momentum=0.9)
    opt = mt.DistributedOptimizer(model, client(st), local_optimizer=local)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.25)
    backward(model)
    opt.step()
    sched.step()
    assert local.param_groups[0]["lr"] == pytest.approx(0.1)
    assert opt.param_groups is local.param_groups and opt.state is local.state
    assert opt.lr is None


def test_state_dicts_round_trip_the_local_optimizers_state(serve, client):
    """Adam's moments and a scheduled lr survive state_dict() and
    load_state_dict() into a new optimizer of a new worker."""
    model = Net()
    st = serve(mt.model_arrays(model))
    ps = client(st)
    opt = mt.DistributedOptimizer(model, ps, local_optimizer=torch.optim.Adam(
        model.parameters(), lr=0.01))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(2):
        backward(model, seed=step)
        opt.step()
        sched.step()
    saved = copy.deepcopy(opt.state_dict())
    assert saved["param_groups"][0]["lr"] == pytest.approx(0.0025)
    assert saved["state"][0]["step"] == 2

    other = Net(seed=5)
    again = mt.DistributedOptimizer(other, ps, local_optimizer=torch.optim.Adam(
        other.parameters(), lr=0.01))
    again.load_state_dict(saved)
    loaded = again.local_optimizer.state_dict()
    assert loaded["param_groups"][0]["lr"] == pytest.approx(0.0025)
    for k, state in saved["state"].items():
        torch.testing.assert_close(loaded["state"][k]["exp_avg"], state["exp_avg"])
        torch.testing.assert_close(loaded["state"][k]["exp_avg_sq"], state["exp_avg_sq"])
    assert again.state is again.local_optimizer.state  # still one optimizer after loading
    backward(other)
    assert again.step().applied

    sgd = mt.DistributedOptimizer(Net(), ps, lr=0.3)
    sgd.param_groups[0]["lr"] = 0.15  # as a scheduler would have set it
    plain = copy.deepcopy(sgd.state_dict())
    fresh = mt.DistributedOptimizer(Net(), ps, lr=0.3)
    fresh.load_state_dict(plain)
    assert fresh.lr == pytest.approx(0.15)


def test_amps_grad_scaler_unscales_before_the_push_and_skips_an_inf_step(serve, client):
    """With a scale of 2^10 the pushed update is float32(-lr) * the unscaled
    gradient, bit for bit (unscaling by a power of two is exact); a step with
    an Inf gradient is skipped, so nothing is pushed, and the scale backs off."""
    model = Net()
    st = serve(mt.model_arrays(model))
    opt = mt.DistributedOptimizer(model, client(st), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    twin = copy.deepcopy(model)
    backward(twin, seed=3)
    ref = Reference(arrays(model), gamma=0.0)
    ref.apply({n: np.float32(-0.1) * p.grad.numpy() for n, p in twin.named_parameters()})

    def scaled_backward(seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(16, 8, generator=g)
        y = torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()

    scaled_backward(3)
    outcome = scaler.step(opt)
    scaler.update()
    assert outcome.applied
    assert_model_equal(server_model(st)[1], ref.w)

    scaled_backward(4)
    model.fc1.weight.grad[0, 0] = float("inf")
    assert scaler.step(opt) is None  # skipped: no push
    scaler.update()
    assert server_model(st)[0] == 1 and opt.stats().steps == 1
    assert scaler.get_scale() == 2.0 ** 9


def test_horovods_order_takes_the_optimizer_first(serve, client):
    model = Net()
    st = serve(mt.model_arrays(model))
    local = torch.optim.SGD(model.parameters(), lr=0.05)
    opt = mt.DistributedOptimizer(local, client(st), named_parameters=model.named_parameters())
    assert opt.local_optimizer is local and opt.module is None
    before = arrays(model)
    backward(model)
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
    assert opt.step().applied
    version, weights = server_model(st)
    assert version == 1
    for n in before:  # w + ((w - lr g) - w): the change SGD made, to float32 rounding
        np.testing.assert_allclose(weights[n], before[n] - 0.05 * grads[n], atol=1e-6)


@pytest.mark.parametrize(("first", "kwargs", "message"), [
    ("optimizer", {}, "with an optimizer first \\(Horovod's order\\), give "
                      "named_parameters=model.named_parameters\\(\\)"),
    ("optimizer", {"named_parameters": [("w", 3)]},
     "named_parameters must be \\(name, parameter\\) pairs"),
    ("module", {"lr": 0.1, "named_parameters": []},
     "named_parameters= goes with an optimizer first"),
    ("text", {"lr": 0.1}, "DistributedOptimizer takes the model first .* got str"),
    ("module-no-ps", {"lr": 0.1}, "give DistributedOptimizer the job's client: ps="),
])
def test_the_argument_order_is_explained_when_wrong(serve, client, first, kwargs, message):
    model = Net()
    st = serve(mt.model_arrays(model))
    ps = client(st)
    target = {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "module": model,
              "text": "model", "module-no-ps": model}[first]
    with pytest.raises(ConfigError, match=message):
        if first == "module-no-ps":
            mt.DistributedOptimizer(target, **kwargs)
        else:
            mt.DistributedOptimizer(target, ps, **kwargs)


# --- BatchNorm's buffers through the server (sync_buffers) ---------------------------


class BNNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bn = torch.nn.BatchNorm1d(4)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(self.bn(x))


def bn_backward(model: torch.nn.Module, seed: int, mean: float = 0.0) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 4, generator=g) + mean
    y = torch.randint(0, 3, (32,), generator=g)
    model.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()


def test_save_init_with_buffers_adds_the_float_buffers_only(tmp_path):
    path = tmp_path / "init.npz"
    mt.save_init(BNNet(), path, buffers=True)
    with np.load(path) as npz:
        assert sorted(npz.files) == ["bn.bias", "bn.running_mean", "bn.running_var",
                                     "bn.weight", "fc.bias", "fc.weight"]
    assert "bn.num_batches_tracked" not in mt.model_arrays(BNNet(), buffers=True)
    assert "bn.running_mean" not in mt.model_arrays(BNNet())


def test_a_synced_buffer_pushes_what_the_forward_pass_changed(serve, client):
    """Each push carries -lr * grad for the parameters and, for the running
    statistics, new - pulled: the server's model is the numpy replay bit for
    bit, and the pull brings the buffers back into the module."""
    model = BNNet()
    st = serve(mt.model_arrays(model, buffers=True))
    opt = mt.DistributedOptimizer(model, client(st), lr=0.1, sync_buffers=True)
    ref = Reference(mt.model_arrays(model, buffers=True), gamma=0.0)
    for step in range(3):
        pulled = {n: b.detach().numpy().copy() for n, b in model.named_buffers()}
        bn_backward(model, seed=step)
        update = {n: np.float32(-0.1) * p.grad.numpy() for n, p in model.named_parameters()}
        update.update({n: model.get_buffer(n).numpy() - pulled[n]
                       for n in ("bn.running_mean", "bn.running_var")})
        assert np.abs(update["bn.running_mean"]).max() > 1e-3  # the forward pass moved it
        ref.apply(update)
        assert opt.step().applied
        assert_model_equal(server_model(st)[1], ref.w)
        for n in ("bn.running_mean", "bn.running_var"):
            np.testing.assert_array_equal(model.get_buffer(n).numpy(), ref.w[n])


def test_synced_buffers_hold_the_statistics_of_every_workers_data(serve, client):
    """Two workers whose inputs have means +2 and -2: synchronised, both
    normalise with a running mean near the job's (0); each alone drifts to
    its own data's (+2 or -2)."""
    def train(sync: bool) -> list[float]:
        models = [BNNet(), BNNet()]
        init = mt.model_arrays(models[0], buffers=True)
        st = serve(init if sync else mt.model_arrays(models[0]))
        opts = [mt.DistributedOptimizer(m, client(st), lr=0.01, sync_buffers=sync)
                for m in models]
        for step in range(60):
            for k, (m, opt) in enumerate(zip(models, opts, strict=True)):
                bn_backward(m, seed=2 * step + k, mean=2.0 if k == 0 else -2.0)
                opt.step()
        for opt in opts:
            opt.pull()
        return [float(m.bn.running_mean.mean()) for m in models]

    synced = train(sync=True)
    alone = train(sync=False)
    assert all(abs(v) < 0.3 for v in synced), synced
    assert alone[0] > 1.7 and alone[1] < -1.7, alone


def test_sync_buffers_needs_buffers_on_both_sides(serve, client):
    model = BNNet()
    st = serve(mt.model_arrays(model))  # started without the buffers
    with pytest.raises(ConfigError, match=r"the server has no tensor 'bn.running_mean', "
                                          r"'bn.running_var'; .*save_init\(model, path, "
                                          r"buffers=True\)"):
        mt.DistributedOptimizer(model, client(st), lr=0.1, sync_buffers=True)
    plain = Net()
    st2 = serve(mt.model_arrays(plain))
    with pytest.raises(ConfigError, match="Net has no floating-point buffers"):
        mt.DistributedOptimizer(plain, client(st2), lr=0.1, sync_buffers=True)
    with pytest.raises(ConfigError, match="sync_buffers needs the module"):
        mt.DistributedOptimizer(torch.optim.SGD(plain.parameters(), lr=0.1), client(st2),
                                named_parameters=plain.named_parameters(), sync_buffers=True)
