"""Checkpoints: exact round trip, atomic files, refusal of damaged ones, and a
server that resumes where it stopped."""

from __future__ import annotations

import dataclasses
import re
import shutil
import signal
import struct
import subprocess
import time

import numpy as np
import pytest

import mlfabric
from mlfabric.errors import ConfigError
from mlfabric.server import checkpoint
from mlfabric.server.store import ParameterStore

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
    newest = checkpoint.latest(ckdir)
    assert re.fullmatch(r"ckpt-000000000004-[0-9a-f]{12}\.mlfckpt", newest.name), newest
    run = checkpoint.read(newest).run

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
    # The resumed run is the same run: its checkpoint carries the same id.
    assert checkpoint.read(checkpoint.latest(ckdir)).run == run


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


# -- checkpoints that cannot mislead ------------------------------------------------


def edit_header(raw: bytes, old: bytes, new: bytes) -> bytes:
    """The file with `old` replaced by `new` (same length) in its header."""
    assert len(old) == len(new)
    head_len = struct.unpack_from("<8sII", raw)[2]
    head = raw[16:16 + head_len]
    assert head.count(old) == 1, head
    return raw[:16] + head.replace(old, new) + raw[16 + head_len:]


@pytest.mark.parametrize(
    ("old", "new"),
    [(b'"version":3', b'"version":8'), (b'"momentum":0.9', b'"momentum":0.5'),
     (b'[37,3]', b'[3,37]'), (b'"job":"' + JOB.encode()[:3], b'"job":"xyz'),
     (b'"run":"abc123"', b'"run":"abc124"')],
    ids=["version", "momentum", "shape", "job", "run"])
def test_an_edited_header_is_refused(tmp_path, old, new):
    """The checksum covers the header: before, these edits loaded silently."""
    store, _ = trained_store()
    path = checkpoint.write(tmp_path, dataclasses.replace(store.checkpoint(JOB), run="abc123"))
    path.write_bytes(edit_header(path.read_bytes(), old, new))
    with pytest.raises(ConfigError, match="corrupted \\(checksum mismatch\\): use an older"):
        checkpoint.read(path)


def test_a_format_1_checkpoint_still_resumes_with_a_warning(tmp_path, caplog):
    """Written before the header was covered: read as it was, and said so."""
    import hashlib
    import json

    store, _ = trained_store()
    raw = checkpoint.write(tmp_path, store.checkpoint(JOB)).read_bytes()
    head_len = struct.unpack_from("<8sII", raw)[2]
    header = json.loads(raw[16:16 + head_len])
    data = raw[16 + head_len:-32]
    header.pop("run")
    header["sha256"] = hashlib.sha256(data).hexdigest()
    head = json.dumps(header).encode()
    old = tmp_path / "ckpt-000000000003.mlfckpt"
    old.write_bytes(struct.pack("<8sII", b"MLFBCKPT", 1, len(head)) + head + data)
    ckpt = checkpoint.read(old)
    assert (ckpt.version, ckpt.run) == (3, "")
    assert_model_equal(ckpt.weights, store.weights)
    assert "format 1: its checksum covers the data, not the header" in caplog.text


def test_retention_keeps_the_current_runs_newest_and_never_touches_another_run(tmp_path):
    store, _ = trained_store(0)
    for version, run in ((80, "01d"), (81, "01d"), (1, "abc"), (2, "abc"), (3, "abc")):
        store.version = version
        checkpoint.write(tmp_path, dataclasses.replace(store.checkpoint(JOB), run=run))
    removed = checkpoint.prune(tmp_path, keep=1, run="abc")
    assert [p.name for p in removed] == ["ckpt-000000000001-abc.mlfckpt",
                                         "ckpt-000000000002-abc.mlfckpt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000000000003-abc.mlfckpt", "ckpt-000000000080-01d.mlfckpt",
        "ckpt-000000000081-01d.mlfckpt"]


def test_retention_never_deletes_the_checkpoint_just_written(tmp_path):
    """A run resumed below its own damaged newer files (which --resume latest
    skipped) writes versions under them: counting them, keep=1 deleted the
    good file just written and kept a damaged one."""
    store, _ = trained_store(0)
    for version in (3, 5, 6):
        store.version = version
        checkpoint.write(tmp_path, dataclasses.replace(store.checkpoint(JOB), run="abc"))
    removed = checkpoint.prune(tmp_path, keep=1, run="abc", current=3)
    assert removed == []
    store.version = 4
    checkpoint.write(tmp_path, dataclasses.replace(store.checkpoint(JOB), run="abc"))
    removed = checkpoint.prune(tmp_path, keep=1, run="abc", current=4)
    assert [p.name for p in removed] == ["ckpt-000000000003-abc.mlfckpt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000000000004-abc.mlfckpt", "ckpt-000000000005-abc.mlfckpt",
        "ckpt-000000000006-abc.mlfckpt"]
    # keep=0 keeps the newest all the same
    assert [p.name for p in checkpoint.prune(tmp_path, keep=0, run="abc")] == [
        "ckpt-000000000004-abc.mlfckpt", "ckpt-000000000005-abc.mlfckpt"]


def wait_for(predicate, what: str, timeout: float = 10.0) -> None:
    """Poll the file system (there is no event to wait on) for at most `timeout` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.01)


def serve(tmp_path, *args: str):
    token = tmp_path / "job.token"
    token.write_bytes(TOKEN)
    token.chmod(0o600)
    np.savez(tmp_path / "init.npz", **make_model())
    return subprocess.run(
        mlfabric_cmd("server", "--listen", "127.0.0.1:0", "--job", JOB, "--token-file",
                     str(token), *args),
        capture_output=True, text=True, timeout=60, cwd=tmp_path)


def test_a_fresh_run_in_another_runs_folder_is_refused_unless_told(tmp_path):
    ckdir = tmp_path / "ckpts"
    store, _ = trained_store(0)
    store.version = 80
    checkpoint.write(ckdir, dataclasses.replace(store.checkpoint(JOB), run="01d"))
    proc = serve(tmp_path, "--init", "init.npz", "--checkpoint-dir", str(ckdir))
    assert proc.returncode == 2, proc.stderr
    assert (f"--checkpoint-dir '{ckdir}' holds checkpoints of another run (newest: "
            f"ckpt-000000000080-01d.mlfckpt, version 80): continue that run with --resume "
            f"latest, or start a new one beside it with --fresh") in proc.stderr
    proc = serve(tmp_path, "--init", "init.npz", "--resume", "latest", "--fresh",
                 "--checkpoint-dir", str(ckdir))
    assert proc.returncode == 2 and "give one of them" in proc.stderr
    # A replica joining a running server is a new run too (refused before it connects).
    proc = serve(tmp_path, "--role", "replica", "--join-from", "127.0.0.1:9", "--controller",
                 "127.0.0.1:9", "--checkpoint-dir", str(ckdir))
    assert proc.returncode == 2, proc.stderr
    assert ("holds checkpoints of another run (newest: ckpt-000000000080-01d.mlfckpt, version "
            "80): start this replica's checkpoints beside them with --fresh, or give another "
            "--checkpoint-dir") in proc.stderr

    # With --fresh: a new run beside it, whose checkpoints survive its retention.
    model = make_model()
    server = Server(tmp_path, "--momentum", "0.9", "--checkpoint-dir", str(ckdir),
                    "--fresh", "--keep-checkpoints", "1", "--checkpoint-interval", "0.05",
                    model=model)
    def mine() -> list[str]:
        return sorted(p.name for p in ckdir.iterdir() if "-01d." not in p.name)

    with mlfabric.connect(server.address, job=JOB, token=TOKEN) as ps:
        for i in range(3):
            ps.push(random_update(model, seed=i), base_version=i).result(10)
            # a periodic checkpoint of this version, and retention after it
            wait_for(lambda v=i + 1: [n[:17] for n in mine()] == [f"ckpt-{v:012d}"],
                     f"checkpoint of version {i + 1} alone")
    code, _, err = server.stop(signal.SIGTERM)
    assert code == 0, err
    names = sorted(p.name for p in ckdir.iterdir())
    assert names[-1] == "ckpt-000000000080-01d.mlfckpt"  # the other run: untouched
    assert len(names) == 2 and re.fullmatch(r"ckpt-000000000003-[0-9a-f]{12}\.mlfckpt",
                                            names[0]), names
    ours = checkpoint.read(ckdir / names[0]).run

    # "latest" is the other run's version 80; the choice is said, not silent.
    other = Server(tmp_path, "--checkpoint-dir", str(ckdir), "--resume", "latest")
    _, out, err = other.stop()
    assert "stopped at version 80" in out
    assert (f"--resume latest: {ckdir} holds checkpoints of 2 runs (01d up to version 80, "
            f"{ours} up to version 3); resuming run 01d, the newest valid version; give "
            f"--resume PATH to continue another") in err


def test_resume_latest_takes_the_newest_valid_checkpoint_and_says_what_it_skipped(tmp_path):
    ckdir = tmp_path / "ckpts"
    store, ref = trained_store(3)
    checkpoint.write(ckdir, dataclasses.replace(store.checkpoint(JOB), run="abc"))
    store.apply(3, random_update(ref.w, seed=50))
    bad = checkpoint.write(ckdir, dataclasses.replace(store.checkpoint(JOB), run="abc"))
    bad.write_bytes(bad.read_bytes()[:-10])
    model = make_model()
    server = Server(tmp_path, "--checkpoint-dir", str(ckdir), "--resume", "latest",
                    model=model)
    try:
        with mlfabric.connect(server.address, job=JOB, token=TOKEN) as ps:
            version, params = ps.pull(timeout=10)
    finally:
        _, _, err = server.stop()
    assert version == 3
    assert_model_equal(params, ref.w)
    lines = [line for line in err.splitlines() if "--resume latest: skipped" in line]
    assert len(lines) == 1, err
    assert "ckpt-000000000004-abc.mlfckpt' is truncated" in lines[0]
    assert "resuming from ckpt-000000000003-abc.mlfckpt" in lines[0]
    bad3 = ckdir / "ckpt-000000000003-abc.mlfckpt"
    bad3.write_bytes(bad3.read_bytes()[:-10])
    proc = serve(tmp_path, "--checkpoint-dir", str(ckdir), "--resume", "latest")
    assert proc.returncode == 2
    assert "--resume latest: no valid checkpoint in" in proc.stderr


def test_a_failed_final_checkpoint_fails_the_exit_code(tmp_path):
    """The folder is gone and a file stands in its place (a failure even
    root cannot write through): the server says so and exits 1."""
    ckdir = tmp_path / "ckpts"
    model = make_model()
    server = Server(tmp_path, "--checkpoint-dir", str(ckdir), model=model)
    with mlfabric.connect(server.address, job=JOB, token=TOKEN) as ps:
        ps.push(random_update(model, seed=1), base_version=0).result(10)
    shutil.rmtree(ckdir, ignore_errors=True)
    ckdir.write_text("not a folder")
    code, _, err = server.stop(signal.SIGTERM)
    assert code == 1, err
    assert (f"mlfabric server: error: the final checkpoint of version 1 to {ckdir} failed: "
            f"[Errno 17] File exists: '{ckdir}'; no checkpoint of this run is on disk: its "
            f"model at version 1 is lost with this process") in err


def test_a_failed_final_checkpoint_names_the_last_good_one(tmp_path):
    ckdir = tmp_path / "ckpts"
    model = make_model()
    first = Server(tmp_path, "--checkpoint-dir", str(ckdir), model=model)
    with mlfabric.connect(first.address, job=JOB, token=TOKEN) as ps:
        ps.push(random_update(model, seed=1), base_version=0).result(10)
    assert first.stop()[0] == 0
    good = checkpoint.latest(ckdir)
    saved = tmp_path / "saved"
    saved.mkdir()
    good = good.rename(saved / good.name)  # resumed from outside --checkpoint-dir
    server = Server(tmp_path, "--checkpoint-dir", str(ckdir), "--resume", str(good))
    with mlfabric.connect(server.address, job=JOB, token=TOKEN) as ps:
        for i in range(1, 3):
            ps.push(random_update(model, seed=i), base_version=i).result(10)
    shutil.rmtree(ckdir)
    ckdir.write_text("not a folder")
    code, _, err = server.stop(signal.SIGTERM)
    assert code == 1, err
    assert (f"the final checkpoint of version 3 to {ckdir} failed: [Errno 17] File exists: "
            f"'{ckdir}'; the last good checkpoint is {good} (version 1): resuming from it "
            f"loses versions 2 to 3") in err


def test_resuming_a_run_below_its_own_later_checkpoints_is_refused(tmp_path):
    """Going back to version 3 while the folder holds the run's version 5:
    after a crash, --resume latest would take 5, not the continuation."""
    ckdir = tmp_path / "ckpts"
    store, _ = trained_store(0)
    for version in (3, 4, 5):
        store.version = version
        checkpoint.write(ckdir, dataclasses.replace(store.checkpoint(JOB), run="abc"))
    three = ckdir / "ckpt-000000000003-abc.mlfckpt"
    proc = serve(tmp_path, "--checkpoint-dir", str(ckdir), "--resume", str(three))
    assert proc.returncode == 2, proc.stderr
    assert (f"--resume '{three}' is version 3 of run abc, but --checkpoint-dir '{ckdir}' holds "
            f"that run's later checkpoints (ckpt-000000000004-abc.mlfckpt, "
            f"ckpt-000000000005-abc.mlfckpt): after a crash --resume latest would take those, "
            f"not this continuation. Move them out of '{ckdir}' to go back past them, or give "
            f"another --checkpoint-dir") in proc.stderr


def test_resume_auto_starts_from_init_once_and_continues_after_every_restart(tmp_path):
    """What a systemd unit or a StatefulSet runs on every (re)start: the
    first finds no checkpoint and starts from --init; the next continues."""
    ckdir = tmp_path / "ckpts"
    model = make_model()
    ref = Reference(model, 0.5)
    for start in range(2):
        server = Server(tmp_path, "--momentum", "0.5", "--checkpoint-dir", str(ckdir),
                        "--resume", "auto", model=model)
        try:
            with mlfabric.connect(server.address, job=JOB, token=TOKEN) as ps:
                version, params = ps.pull(timeout=10)
                assert version == 2 * start
                assert_model_equal(params, ref.w)
                for i in range(2):
                    u = random_update(model, seed=10 * start + i)
                    assert ps.push(u, base_version=version + i).result(10).applied
                    ref.apply(u)
        finally:
            code, _, err = server.stop(signal.SIGTERM)
        assert code == 0, err
    assert checkpoint.read(checkpoint.latest(ckdir)).version == 4
    proc = serve(tmp_path, "--init", "init.npz", "--resume", "auto")
    assert proc.returncode != 0
    assert ("--resume auto needs --checkpoint-dir (where to look) and --init MODEL.npz (the "
            "model of the first start)") in proc.stderr
