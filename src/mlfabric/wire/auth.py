"""Job-token authentication: challenge-response with HMAC-SHA256, both ways.

The token never crosses the wire. Each side sends a fresh nonce; each proves
it holds the token by the HMAC of both nonces and the job name, with a
different label per direction so one side's proof cannot be replayed as the
other's. Proofs are compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from ..errors import ConfigError

NONCE_BYTES = 32
_MIN_TOKEN_BYTES = 16


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _proof(label: bytes, token: bytes, job: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    msg = b"\x00".join([b"mlfabric-auth-v1", label, job.encode(), client_nonce, server_nonce])
    return hmac.new(token, msg, hashlib.sha256).digest()


def server_proof(token: bytes, job: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return _proof(b"server", token, job, client_nonce, server_nonce)


def client_proof(token: bytes, job: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return _proof(b"client", token, job, client_nonce, server_nonce)


def proofs_match(expected: bytes, received: bytes) -> bool:
    return hmac.compare_digest(expected, received)


def generate_token() -> str:
    """A fresh job token (256 random bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def load_token(path: str | os.PathLike[str]) -> bytes:
    """Read a job token from a file, refusing a missing, empty or too short one."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            f"token file {str(p)!r} does not exist: create it with a random secret, "
            f"e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))' > {p}`"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read token file {str(p)!r}: {exc.strerror}") from None
    token = raw.strip()
    if len(token) < _MIN_TOKEN_BYTES:
        raise ConfigError(
            f"token file {str(p)!r} holds {len(token)} bytes; a job token needs at least "
            f"{_MIN_TOKEN_BYTES}: write a longer random secret into it"
        )
    return token


def token_file_is_private(path: str | os.PathLike[str]) -> bool:
    """False when group or others may read the token file (worth a warning)."""
    mode = os.stat(path).st_mode
    return not (mode & (stat.S_IRGRP | stat.S_IROTH))


def as_token(token: str | bytes) -> bytes:
    data = token.encode() if isinstance(token, str) else bytes(token)
    data = data.strip()
    if len(data) < _MIN_TOKEN_BYTES:
        raise ConfigError(
            f"a job token needs at least {_MIN_TOKEN_BYTES} bytes, got {len(data)}: "
            f"use the job's token (see mlfabric.wire.auth.generate_token)"
        )
    return data
