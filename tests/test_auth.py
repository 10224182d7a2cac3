"""Challenge-response with HMAC: what proves what, and token files."""

from __future__ import annotations

import os

import pytest

from mlfabric.errors import ConfigError
from mlfabric.wire import auth

TOKEN = b"t" * 32


def test_proofs_bind_token_job_nonces_and_direction():
    cn, sn = auth.new_nonce(), auth.new_nonce()
    base = auth.client_proof(TOKEN, "job", cn, sn)
    assert base == auth.client_proof(TOKEN, "job", cn, sn)
    assert base != auth.client_proof(b"u" * 32, "job", cn, sn)
    assert base != auth.client_proof(TOKEN, "job2", cn, sn)
    assert base != auth.client_proof(TOKEN, "job", sn, cn)
    assert base != auth.server_proof(TOKEN, "job", cn, sn)
    assert len(base) == 32 and TOKEN not in base


def test_nonces_are_fresh():
    assert len({auth.new_nonce() for _ in range(100)}) == 100
    assert len(auth.new_nonce()) == auth.NONCE_BYTES


def test_proofs_match_is_exact():
    p = auth.client_proof(TOKEN, "j", b"a", b"b")
    assert auth.proofs_match(p, p)
    assert not auth.proofs_match(p, p[:-1] + bytes([p[-1] ^ 1]))
    assert not auth.proofs_match(p, b"")


def test_load_token(tmp_path):
    f = tmp_path / "job.token"
    f.write_text(auth.generate_token() + "\n")
    assert len(auth.load_token(f)) >= 32
    f.chmod(0o600)
    assert auth.token_file_is_private(f)
    f.chmod(0o644)
    assert not auth.token_file_is_private(f)


def test_missing_and_short_token_files_say_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="does not exist: create it"):
        auth.load_token(tmp_path / "nope")
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(ConfigError, match="holds 3 bytes; a job token needs at least 16"):
        auth.load_token(short)
    with pytest.raises(ConfigError, match="at least 16 bytes, got 2"):
        auth.as_token("ab")
    if os.geteuid() != 0:  # root reads anything
        unreadable = tmp_path / "unreadable"
        unreadable.write_text("x" * 40)
        unreadable.chmod(0)
        with pytest.raises(ConfigError, match="cannot read token file"):
            auth.load_token(unreadable)
