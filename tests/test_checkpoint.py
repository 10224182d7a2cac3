"""Checkpoints: exact round trip, atomic files, refusal of damaged ones, and a
server that resumes where it stopped."""

from __future__ import annotations

import signal
import subprocess

import numpy as np
import pytest

import mlfabric
from mlfabric import checkpoint
from mlfabric.errors import ConfigError
from mlfabric.store import ParameterStore

from support import JOB, TOKEN, Reference, assert_model_equal, make_model, random_update
from test_cli import Server, mlfabric_cmd


def trained_store(steps: int = 3) -> tuple[ParameterStore, Reference]:
    model = make_model(sizes={"w": (37, 3), "b": (5,), "s": ()})
    store = ParameterStore(model, momentum=0.9)
    ref = Reference(model, 0.9)
    for i in range(steps):
        u = random_update(model, seed=i)
        store.apply(store.version, u)
        ref.apply(u)
    return store, ref


def test_round_trip_is_exact(tmp_path):
    store, _ = trained_store()
    path = checkpoint.write(tmp_path, store.checkpoint(JOB))
    assert path.name == "ckpt-000000000003.mlfckpt"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left
    ckpt = checkpoint.read(path)
    assert (ckpt.job, ckpt.version, ckpt.momentum) == (JOB, 3, 0.9)
    assert_model_equal(ckpt.weights, store.weights)
    assert_model_equal(ckpt.previous, store.previous)


def test_a_resumed_store_continues_exactly(tmp_path):
    store, ref = trained_store()
    resumed = ParameterStore.from_checkpoint(
        checkpoint.read(checkpoint.write(tmp_path, store.checkpoint(JOB))))
    u = random_update(ref.w, seed=99)
    assert resumed.apply(3, u).version == 4
    ref.apply(u)
    assert_model_equal(resumed.weights, ref.w)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda raw: raw[:-1], "truncated"),
        (lambda raw: raw[:-100] + bytes([raw[-100] ^ 1]) + raw[-99:], "checksum mismatch"),
        (lambda raw: b"NOTACKPT" + raw[8:], "not an mlfabric checkpoint"),
        (lambda raw: raw[:20] + b"\xff" + raw[21:], "damaged header"),
        (lambda raw: raw[:5], "not an mlfabric checkpoint"),
    ],
    ids=["truncated", "bit-flip", "magic", "header", "tiny"],
)
def test_damaged_checkpoints_are_refused(tmp_path, damage, message):
    store, _ = trained_store()
    path = checkpoint.write(tmp_path, store.checkpoint(JOB))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ConfigError, match=message):
        checkpoint.read(path)


def test_latest_and_prune(tmp_path):
    store, _ = trained_store(0)
    assert checkpoint.latest(tmp_path) is None
    for _ in range(5):
        checkpoint.write(tmp_path, store.checkpoint(JOB))
        store.apply(store.version, {n: np.zeros_like(w) for n, w in store.weights.items()})
    assert checkpoint.latest(tmp_path).name == "ckpt-000000000004.mlfckpt"
    removed = checkpoint.prune(tmp_path, keep=2)
    assert [p.name for p in removed] == [f"ckpt-00000000000{i}.mlfckpt" for i in range(3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000000000003.mlfckpt", "ckpt-000000000004.mlfckpt"]


def test_server_checkpoints_at_shutdown_and_resumes(tmp_path):
    ckdir = tmp_path / "ckpts"
    model = make_model()
    server = Server(tmp_path, "--momentum", "0.9", "--checkpoint-dir", str(ckdir), model=model)
    ref = Reference(model, 0.9)
    with mlfabric.connect(server.address, job=JOB, token=TOKEN) as ps:
        for i in range(4):
            u = random_update(model, seed=i)
            ps.push(u, base_version=i).result(10)
            ref.apply(u)
    code, _, err = server.stop(signal.SIGTERM)
    assert code == 0, err
    assert checkpoint.latest(ckdir).name == "ckpt-000000000004.mlfckpt"

    resumed = Server(tmp_path, "--checkpoint-dir", str(ckdir), "--resume", "latest",
                     model=model)
    try:
        with mlfabric.connect(resumed.address, job=JOB, token=TOKEN) as ps:
            version, params = ps.pull(timeout=10)
            assert version == 4 and ps.momentum == 0.9
            assert_model_equal(params, ref.w)
            u = random_update(model, seed=7)
            assert ps.push(u, base_version=4).result(10).version == 5
            ref.apply(u)  # the momentum history came back too
            assert_model_equal(ps.pull(timeout=10)[1], ref.w)
    finally:
        resumed.stop()


def test_resume_refuses_another_jobs_or_a_damaged_checkpoint(tmp_path):
    store, _ = trained_store()
    other = checkpoint.write(tmp_path / "a", store.checkpoint("otherjob"))
    damaged = checkpoint.write(tmp_path / "b", store.checkpoint(JOB))
    damaged.write_bytes(damaged.read_bytes()[:-8])
    token = tmp_path / "job.token"
    token.write_bytes(TOKEN)
    token.chmod(0o600)
    for path, message in ((other, "belongs to job 'otherjob'"), (damaged, "truncated"),
                          (tmp_path / "none", "does not exist")):
        proc = subprocess.run(
            mlfabric_cmd("server", "--listen", "127.0.0.1:0", "--job", JOB, "--token-file",
                         str(token), "--resume", str(path)),
            capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert proc.returncode == 2
        assert message in proc.stderr and "Traceback" not in proc.stderr
