"""Mutual TLS for mlfabric's links (issue 33): the ssl contexts, built from
a certificate, its key and the cluster's CA, with one-line errors.

Both sides present a certificate signed by the cluster's CA and check the
other's (CERT_REQUIRED both ways). A client also checks that the listener's
certificate names the host it dialled (`server_hostname` is the host of the
address, an IP or a name): `mlfabric tls init --host ...` puts every name
and IP given into the certificate's subjectAltName. A listener cannot check
a client's name (clients dial from any port and often any address), only
that the CA signed it. TLS adds secrecy; the job-token handshake still runs
inside it, so a certificate alone does not let a peer into a job.

A process started with --tls-* (a server, replica, controller or agent)
uses the same certificate for the links it opens itself (a replica to its
server, the controller's heartbeats and its reads of the agents, an
aggregator's pushes, an agent's probe sessions...): `use_for_process`
keeps the client context that `client.link.open_link` and
`agent_login.open_agent` fall back on. `tls_refused` and `tls_failure` word
a failed handshake for both kinds of links.
"""

from __future__ import annotations

import argparse
import os
import ssl
from dataclasses import dataclass

from ..errors import ConfigError, TLSError

# What each of the three files is called where it was given: on the command
# line (--tls-cert) or as a client setting (tls_cert).
FLAGS = ("--tls-cert", "--tls-key", "--tls-ca")
SETTINGS = ("tls_cert", "tls_key", "tls_ca")


@dataclass(frozen=True)
class TLSFiles:
    """A certificate, its private key and the CA that signs the cluster's."""

    cert: str
    key: str
    ca: str


def files(cert: str | os.PathLike[str] | None, key: str | os.PathLike[str] | None,
          ca: str | os.PathLike[str] | None,
          names: tuple[str, str, str] = FLAGS) -> TLSFiles | None:
    """The three files, or None when none is given. Some but not all of them
    is an error: a certificate without the CA to check the peer with (or the
    other way round) would silently be half of mutual TLS."""
    given = [cert, key, ca]
    if all(v is None for v in given):
        return None
    missing = [n for n, v in zip(names, given, strict=True) if v is None]
    if missing:
        have = [n for n, v in zip(names, given, strict=True) if v is not None]
        raise ConfigError(f"TLS needs all three of {', '.join(names)}: {', '.join(have)} "
                          f"given without {', '.join(missing)}; give all three, or none "
                          f"for plain TCP")
    assert cert is not None and key is not None and ca is not None
    for name, value in zip(names, (cert, key, ca), strict=True):
        _check_readable(name, os.fspath(value))
    return TLSFiles(os.fspath(cert), os.fspath(key), os.fspath(ca))


def _check_readable(name: str, path: str) -> None:
    if not os.path.exists(path):
        raise ConfigError(f"{name} file {path!r} does not exist: give the path of a PEM "
                          f"file (`mlfabric tls init DIR` makes them)")
    try:
        with open(path, "rb") as f:
            head = f.read(64 << 10)
    except OSError as exc:
        raise ConfigError(f"cannot read {name} file {path!r}: {exc.strerror}") from None
    if b"-----BEGIN " not in head:
        raise ConfigError(f"{name} file {path!r} is not a PEM file (no '-----BEGIN' line): "
                          f"give the PEM certificate or key")


def _context(purpose: ssl._SSLMethod, tls: TLSFiles, names: tuple[str, str, str]
             ) -> ssl.SSLContext:
    ctx = ssl.SSLContext(purpose)
    # TLS 1.3 is negotiated whenever both sides have it; 1.2 is the floor.
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED  # mutual: the listener checks clients too
    try:
        ctx.load_cert_chain(tls.cert, tls.key)
    except ssl.SSLError as exc:
        why = ("the key does not belong to the certificate"
               if "KEY_VALUES_MISMATCH" in str(exc) else _reason(exc))
        raise ConfigError(f"cannot use {names[0]} {tls.cert!r} with {names[1]} {tls.key!r}: "
                          f"{why}; give the certificate and the key made with it") from None
    try:
        ctx.load_verify_locations(cafile=tls.ca)
    except ssl.SSLError as exc:
        raise ConfigError(f"cannot use {names[2]} {tls.ca!r}: {_reason(exc)}; give the "
                          f"cluster CA's certificate (ca.pem)") from None
    return ctx


def _reason(exc: ssl.SSLError) -> str:
    return getattr(exc, "reason", None) or str(exc)


def server_context(tls: TLSFiles, names: tuple[str, str, str] = FLAGS) -> ssl.SSLContext:
    """A listener's context: presents `tls.cert`, requires a client
    certificate signed by `tls.ca`."""
    return _context(ssl.PROTOCOL_TLS_SERVER, tls, names)


def client_context(tls: TLSFiles, names: tuple[str, str, str] = FLAGS) -> ssl.SSLContext:
    """A dialling side's context: presents `tls.cert`, requires the
    listener's certificate to be signed by `tls.ca` and to name the host
    dialled (check_hostname)."""
    ctx = _context(ssl.PROTOCOL_TLS_CLIENT, tls, names)
    ctx.check_hostname = True
    return ctx


# -- why a TLS handshake failed, for both sides' messages -------------------------------


def tls_failure(exc: BaseException) -> str:
    """Why a TLS handshake failed, in a few words (the OpenSSL reason, e.g.
    "PEER_DID_NOT_RETURN_A_CERTIFICATE", "CERTIFICATE_VERIFY_FAILED",
    "WRONG_VERSION_NUMBER" for a peer not speaking TLS)."""
    reason = getattr(exc, "reason", None)
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate not accepted: {exc.verify_message}"
    if reason:
        hint = {"PEER_DID_NOT_RETURN_A_CERTIFICATE": "the peer presented no certificate",
                "WRONG_VERSION_NUMBER": "the peer does not speak TLS",
                "HTTP_REQUEST": "the peer does not speak TLS (HTTP)",
                "TLSV1_ALERT_UNKNOWN_CA": "the peer does not accept our CA",
                "SSLV3_ALERT_BAD_CERTIFICATE": "the peer rejected our certificate",
                "TLSV13_ALERT_CERTIFICATE_REQUIRED": "the peer wants a certificate"}.get(reason)
        return f"{hint} ({reason})" if hint else str(reason)
    if isinstance(exc, ConnectionError):
        return ("the peer closed the connection during it (it did not accept this side's "
                "certificate, or gave up)")
    return str(exc) or type(exc).__name__


def tls_refused(exc: ssl.SSLError, what: str, address: str, command: str, *,
                by_us: bool) -> TLSError:
    """The error for a TLS handshake with the `what` at `address` that
    failed: `by_us`, this side did not accept the listener; else the
    listener refused this side (TLS 1.3 says so after the client's part of
    the handshake is done, on the first read)."""
    reason = getattr(exc, "reason", None)
    if reason == "WRONG_VERSION_NUMBER" or reason == "RECORD_LAYER_FAILURE":
        return TLSError(f"the {what} at {address} does not use TLS ({reason}): start "
                        f"`{command}` with --tls-cert, --tls-key and --tls-ca, or connect "
                        f"without TLS settings")
    if by_us and isinstance(exc, ssl.SSLCertVerificationError):
        return TLSError(f"the {what} at {address} presented a certificate this client does "
                        f"not accept: {exc.verify_message}; it must be signed by the CA in "
                        f"tls_ca and name the host dialled (`mlfabric tls init --host`)")
    return TLSError(f"the {what} at {address} refused this client's TLS certificate: "
                    f"{tls_failure(exc)}; give tls_cert and tls_key signed by the cluster's "
                    f"CA (the one `{command}` was given as --tls-ca)")


# -- the process's own links ------------------------------------------------------

_process_client: ssl.SSLContext | None = None


def use_for_process(ctx: ssl.SSLContext | None) -> None:
    """The client context for the links this process opens without being
    given one (a TLS server's replica link, a TLS controller's heartbeats)."""
    global _process_client
    _process_client = ctx


def process_client_context() -> ssl.SSLContext | None:
    return _process_client


# -- command-line flags -------------------------------------------------------------


def add_tls_arguments(p: argparse.ArgumentParser, peers: str, *, listens: bool = True
                      ) -> None:
    """--tls-cert, --tls-key, --tls-ca: all three turn on mutual TLS (on a
    listener, `peers` are who connects; else, who is dialled)."""
    what = (f"{peers} must connect over mutual TLS" if listens
            else f"the link to {peers} is mutual TLS")
    p.add_argument("--tls-cert", default=None, metavar="FILE",
                   help=f"this process's TLS certificate (PEM); with --tls-key and --tls-ca, "
                        f"{what} (default: plain TCP)")
    p.add_argument("--tls-key", default=None, metavar="FILE",
                   help="the private key of --tls-cert (PEM)")
    p.add_argument("--tls-ca", default=None, metavar="FILE",
                   help="the cluster CA's certificate (PEM): peers must present a "
                        "certificate it signed")


def from_args(args: argparse.Namespace) -> tuple[ssl.SSLContext, ssl.SSLContext] | None:
    """(server context, client context) from --tls-*, or None for plain TCP.
    The client context is also made the process's (`use_for_process`)."""
    tls = files(getattr(args, "tls_cert", None), getattr(args, "tls_key", None),
                getattr(args, "tls_ca", None))
    if tls is None:
        use_for_process(None)
        return None
    contexts = server_context(tls), client_context(tls)
    use_for_process(contexts[1])
    return contexts


def describe(ctx: ssl.SSLContext | None) -> str:
    """For start lines: ", mutual TLS" or ""."""
    return "" if ctx is None else ", mutual TLS"
