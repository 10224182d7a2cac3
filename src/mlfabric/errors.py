"""One exception hierarchy for everything mlfabric raises on purpose.

Every message says what was wrong, with which value, and what to do about it.
"""

from __future__ import annotations


class MlfabricError(Exception):
    """Base class of every error mlfabric raises on purpose."""


class ConfigError(MlfabricError):
    """A setting, flag or input file is wrong; the message names it and the fix."""


class ProtocolError(MlfabricError):
    """A frame on the wire is malformed; the connection cannot continue."""


class FrameTooLarge(ProtocolError):
    """A frame announces more bytes than the receiver's maximum frame size."""


class IntegrityError(ProtocolError):
    """A frame of an authenticated connection failed its MAC check (or came
    without one): altered, injected, replayed or reordered in transit."""


class NotMlfabric(ProtocolError):
    """The peer's bytes are not mlfabric frames (bad magic). `head`: the first
    of them, which tell what kind of process answered (an HTTP server, an
    agent)."""

    def __init__(self, message: str, head: bytes = b"") -> None:
        super().__init__(message)
        self.head = head


class WrongPeer(ConfigError):
    """The address dialled answers as another kind of process than the one
    asked for: a controller given as the server, a server as the controller,
    a metrics (HTTP) port, an agent's port. `address`: the address dialled."""

    def __init__(self, message: str, address: str) -> None:
        super().__init__(message)
        self.address = address


class AuthenticationError(MlfabricError):
    """The peer did not prove it holds the job's token, or named another job."""


class ConnectError(MlfabricError):
    """The server could not be reached (refused, unreachable, or timed out)."""


class TLSError(ConnectError):
    """The TLS handshake failed: a certificate missing or not accepted (by
    either side), or one side does not use TLS."""


class ConnectionLost(MlfabricError):
    """The connection closed before the answer to a request arrived."""


class PushTimeout(MlfabricError, TimeoutError):
    """A push got no outcome within the client's push_timeout; the message
    says where it was stuck (no directive from the controller: not sent; no
    answer from the server: applied or not, unknown)."""


class ServerError(MlfabricError):
    """The server answered a request with an error; `code` is the error's code
    on the wire, when it came from one."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class InvalidUpdate(ServerError):
    """The server refused a push as malformed: unknown tensor, wrong dtype or shape,
    non-finite values, or a base version from the future. The model is untouched.

    `reason` is one short code from mlfabric.runtime.metrics.REJECT_REASONS."""

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message, code=reason)
        self.reason = reason


class SequenceGap(MlfabricError):
    """A replica was handed an update too far ahead of the next one it can
    apply: an earlier update is missing and its out-of-order buffer is full."""
