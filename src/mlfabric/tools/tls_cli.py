"""`mlfabric tls init DIR --host NAME[,ALT...] ...`: a CA and certificates
for a small cluster's mutual TLS (issue 33).

Writes DIR/ca.pem (the CA's certificate: every process gets it as
--tls-ca), DIR/ca.key (keep it off the cluster), and for each --host a
certificate NAME.pem and its key NAME.key, usable both to listen and to
dial (extended key usage serverAuth and clientAuth). The certificate names
NAME and every ALT (DNS names or IP addresses) in its subjectAltName: a
client checks that the listener's certificate names the host it dialled, so
list every name and IP the cluster uses to reach that host. Keys are
written mode 0600. Existing files are kept unless --force.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import re
from collections.abc import Sequence
from pathlib import Path

from ..errors import ConfigError

DEFAULT_DAYS = 365
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")  # what may name a file in DIR


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    sub.required = True
    init = sub.add_parser("init", help="make a CA and a certificate per host in DIR")
    init.add_argument("dir", metavar="DIR", help="where to write them (created if missing)")
    init.add_argument("--host", action="append", required=True, metavar="NAME[,ALT...]",
                      help="a host to make a certificate for, NAME.pem and NAME.key, naming "
                           "NAME and each ALT (host names or IP addresses); repeat per host, "
                           "workers included")
    init.add_argument("--days", type=int, default=DEFAULT_DAYS,
                      help=f"days the certificates are valid (default: {DEFAULT_DAYS})")
    init.add_argument("--force", action="store_true", help="replace files that exist")


def run(args: argparse.Namespace) -> int:
    written = init(args.dir, args.host, days=args.days, force=args.force)
    for path in written:
        print(path)
    return 0


def parse_host(value: str) -> tuple[str, list[str]]:
    """'node1,10.0.0.1' -> ('node1', ['node1', '10.0.0.1']): the file name
    and the names the certificate carries."""
    names = [n.strip() for n in value.split(",")]
    if not names or any(not n for n in names):
        raise ConfigError(f"--host {value!r} has an empty name: give NAME or NAME,ALT,... "
                          f"(host names or IP addresses)")
    if not _NAME.match(names[0]):
        raise ConfigError(f"--host {value!r}: {names[0]!r} cannot name a file; start with a "
                          f"name of letters, digits, '.', '-' or '_'")
    if names[0] == "ca":
        raise ConfigError(f"--host {value!r}: 'ca' is the CA's file name; name the host "
                          f"otherwise")
    return names[0], names


def init(directory: str | os.PathLike[str], hosts: Sequence[str], *, days: int = DEFAULT_DAYS,
         force: bool = False) -> list[Path]:
    """Write the CA and one certificate per host; returns the paths written."""
    if days < 1:
        raise ConfigError(f"--days must be at least 1, got {days}")
    parsed = [parse_host(h) for h in hosts]
    seen: set[str] = set()
    for name, _ in parsed:
        if name in seen:
            raise ConfigError(f"--host {name!r} is given twice: one certificate per host")
        seen.add(name)
    out = Path(directory)
    targets = [out / "ca.pem", out / "ca.key"]
    for name, _ in parsed:
        targets += [out / f"{name}.pem", out / f"{name}.key"]
    existing = [str(p) for p in targets if p.exists()]
    if existing and not force:
        raise ConfigError(f"{', '.join(existing)} already exist: give --force to replace "
                          f"them (certificates made with the old CA then stop working)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {str(out)!r}: {exc.strerror}") from None

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    # A little slack backwards: clocks in a cluster are seldom exactly together.
    start, end = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=days)

    def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM,
                                 serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mlfabric cluster CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, key_cert_sign=True, crl_sign=True,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    written = [_write(out / "ca.key", key_pem(ca_key), private=True),
               _write(out / "ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM))]
    for name, names in parsed:
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = []
        for n in names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(n)))
            except ValueError:
                sans.append(x509.DNSName(n))
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(
                ca_ski), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        written.append(_write(out / f"{name}.key", key_pem(key), private=True))
        written.append(_write(out / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM)))
    return written


def _write(path: Path, data: bytes, private: bool = False) -> Path:
    """Write `data` to `path`; a key is never readable by others, not even
    for a moment (created 0600, not chmodded after)."""
    try:
        if path.exists():
            path.unlink()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except OSError as exc:
        raise ConfigError(f"cannot write {str(path)!r}: {exc.strerror}") from None
    return path
