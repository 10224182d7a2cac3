"""Job-token authentication: challenge-response with HMAC-SHA256, both ways.

The token never crosses the wire. Each side sends a fresh nonce; each proves
it holds the token by the HMAC of both nonces and the job name, with a
different label per direction so one side's proof cannot be replayed as the
other's. Proofs are compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import math
import os
import re
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


def frame_keys(token: bytes, job: str, client_nonce: bytes,
               server_nonce: bytes) -> tuple[bytes, bytes]:
    """The keys of a session's frame MACs (wire.protocol), (client -> server,
    server -> client): fresh per session (both nonces), one per direction so
    that a frame cannot be reflected back to its sender."""
    return (_proof(b"frames client->server", token, job, client_nonce, server_nonce),
            _proof(b"frames server->client", token, job, client_nonce, server_nonce))


def proofs_match(expected: bytes, received: bytes) -> bool:
    return hmac.compare_digest(expected, received)


# --- tokens must be random ------------------------------------------------------
#
# A recorded handshake lets anyone test token guesses offline (the proofs are
# HMACs of the token over nonces sent in the clear): a human-chosen token such
# as "mnist-secret-2024" fell after 660 guesses (issue 33). Rather than a
# handshake that resists guessing (a PAKE), mlfabric requires tokens with at
# least 128 random bits, which no offline search reaches. Randomness cannot be
# proven from one string; `token_weakness` refuses what a random generator's
# text almost never looks like (short, one character class, few distinct
# characters, repeats, runs, common words, words joined by separators), so
# that a token typed by a person is refused with what to do instead.

MIN_TOKEN_BITS = 128
_HEX = frozenset("0123456789abcdefABCDEF")
_BASE64 = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/-_")
# Words people put in secrets; 5 letters or more, so that a random base64
# token holds one by chance about once in 10^5 (4-letter words: 1 in 10^3).
_COMMON_WORDS = (
    "secret", "token", "passw", "admin", "mnist", "train", "qwert", "letmein",
    "change", "default", "cluster", "mlfabric", "example", "sample", "hello",
    "welcome", "master", "shadow", "dragon", "monkey",
)
TOKEN_ADVICE = "make a random one with `mlfabric token new FILE`"


def _expected_distinct(alphabet: int, n: int) -> tuple[float, float]:
    """Mean and standard deviation of the number of distinct characters in
    `n` characters drawn uniformly from `alphabet` (the occupancy problem)."""
    a = float(alphabet)
    miss = (1 - 1 / a) ** n
    mean = a * (1 - miss)
    var = a * (a - 1) * (1 - 2 / a) ** n + a * miss - a * a * miss * miss
    return mean, math.sqrt(max(var, 0.0))


def _longest_step_run(text: str) -> int:
    """The longest run of characters each one code point above (or each one
    below) the last: "2345", "fedc"."""
    best = run_up = run_down = 1
    for prev, cur in itertools.pairwise(text):
        run_up = run_up + 1 if ord(cur) == ord(prev) + 1 else 1
        run_down = run_down + 1 if ord(cur) == ord(prev) - 1 else 1
        best = max(best, run_up, run_down)
    return best


def _wordlike(group: str) -> bool:
    """Letters cased as words are: "horse", "Horse", "HORSE" (random letters
    of four or more are cased so about one time in 20)."""
    return (len(group) >= 3 and group.isalpha()
            and (group.islower() or group.isupper() or group.istitle()))


def token_weakness(token: bytes) -> str | None:
    """Why `token` does not look like at least MIN_TOKEN_BITS random bits,
    or None when it does. Hex (openssl rand -hex 16 and longer), base64 and
    base64url (`mlfabric token new`, openssl rand -base64, secrets.token_urlsafe)
    and printable random text from a password manager all pass."""
    try:
        text = token.decode("ascii").strip().rstrip("=")
    except UnicodeDecodeError:
        text = ""
    if not text or not text.isprintable():
        return "it is not printable ASCII text, as random generators write"
    chars = set(text)
    alphabet = 16 if chars <= _HEX else 64 if chars <= _BASE64 else 94
    bits = len(text) * math.log2(alphabet)
    if bits < MIN_TOKEN_BITS:
        need = math.ceil(MIN_TOKEN_BITS / math.log2(alphabet))
        return (f"{len(text)} characters hold at most {bits:.0f} random bits; a token needs "
                f"{MIN_TOKEN_BITS} (at least {need} such characters)")
    classes = sum(any(f(c) for c in text) for f in (str.isupper, str.islower, str.isdigit))
    if alphabet == 16:
        classes = sum(any(f(c) for c in text) for f in (str.isalpha, str.isdigit))
    if classes < 2:
        return "it uses a single kind of character (only letters or only digits)"
    mean, sd = _expected_distinct(alphabet, len(text))
    if len(chars) < mean - 6 * sd:
        return (f"it repeats characters: {len(chars)} distinct in {len(text)}, where random "
                f"text has about {mean:.0f}")
    for period in range(1, len(text) // 2 + 1):
        if text == (text[:period] * (len(text) // period + 1))[:len(text)]:
            return f"it repeats {text[:period]!r}"
    if _longest_step_run(text) >= 6:
        return "it holds a run such as '123456' or 'abcdef'"
    lower = text.lower()
    for word in _COMMON_WORDS:
        if word in lower:
            return f"it holds the word {word!r}"
    groups = [g for g in re.split(r"[-_.+/ ]", text) if g]
    if len(groups) >= 3 and all(_wordlike(g) or g.isdigit() for g in groups):
        return "it is words joined by separators, as a passphrase"
    return None


def check_token(token: bytes, where: str) -> bytes:
    """`token`, or a ConfigError saying why it looks human-chosen (`where`:
    which token, for the message)."""
    weakness = token_weakness(token)
    if weakness is not None:
        raise ConfigError(f"{where} looks chosen by a person, not random: {weakness}; "
                          f"{TOKEN_ADVICE}")
    return token


def generate_token() -> str:
    """A fresh job token: 256 random bits as URL-safe text (43 characters).
    Drawn again in the rare case that random text trips `token_weakness`
    (about one in 10^4), so that every generated token is accepted; that
    costs far less than a bit of its randomness."""
    while True:
        token = secrets.token_urlsafe(32)
        if token_weakness(token.encode()) is None:
            return token


def load_token(path: str | os.PathLike[str]) -> bytes:
    """Read a job token from a file, refusing a missing, empty or too short one."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            f"token file {str(p)!r} does not exist: create it with `mlfabric token new {p}`"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read token file {str(p)!r}: {exc.strerror}") from None
    token = raw.strip()
    if len(token) < _MIN_TOKEN_BYTES:
        raise ConfigError(
            f"token file {str(p)!r} holds {len(token)} bytes; a job token needs at least "
            f"{_MIN_TOKEN_BYTES}: {TOKEN_ADVICE}"
        )
    return check_token(token, f"the token in {str(p)!r}")


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
            f"{TOKEN_ADVICE}"
        )
    return check_token(data, "the job token")
