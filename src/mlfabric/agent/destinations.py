"""The servers an aggregator may forward to, without I/O (issue 33).

A member push names the server its aggregate goes to (`Push.dst`, the
address its worker connected to). The aggregator dials that address with
the job's token, so an authenticated worker could otherwise steer it to any
address: another tenant's service, a host inside the network. It forwards
only to the operator's list (`mlfabric agent --servers`), matched after
normalising: the host's letters in lower case, an IP address in its
canonical form (`[::1]` and `0:0::1` are one), the port as a number. Host
names are not resolved: a member must name a server as the list does (as
the workers and the controller's --replica name it).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from ..client.core import parse_address
from ..errors import ConfigError


def normal_address(address: str) -> tuple[str, int]:
    """(host, port) of "HOST:PORT" in one form per address; ConfigError if
    it is not HOST:PORT with a port in 1..65535."""
    host, port = parse_address(address)
    if port == 0:
        raise ConfigError(f"address must be HOST:PORT with a port in 1..65535, got "
                          f"{address!r}")
    try:
        host = str(ipaddress.ip_address(host))
    except ValueError:
        host = host.lower()
    return host, port


class Destinations:
    """The configured servers; `match(dst)` is the configured address a
    member's `dst` stands for, or None."""

    def __init__(self, addresses: Iterable[str], what: str = "--servers") -> None:
        self.addresses: tuple[str, ...] = ()
        self._by_key: dict[tuple[str, int], str] = {}
        for text in addresses:
            if not isinstance(text, str):
                raise ConfigError(f"{what}: a server's address must be a \"HOST:PORT\" "
                                  f"string, got {text!r}")
            address = text.strip()
            try:
                key = normal_address(address)
            except ConfigError:
                raise ConfigError(f"{what}: {text!r} is not HOST:PORT (for example "
                                  f"10.0.0.1:7070)") from None
            if key not in self._by_key:
                self._by_key[key] = address
                self.addresses += (address,)
        if not self.addresses:
            raise ConfigError(f"{what} is empty: give the address of every server (and "
                              f"replica) of the job, as its workers name them")

    def match(self, dst: str) -> str | None:
        """The configured address `dst` names, None if it names none (or is
        not an address at all: it comes from a peer)."""
        try:
            return self._by_key.get(normal_address(dst))
        except ConfigError:
            return None

    def __str__(self) -> str:
        return ",".join(self.addresses)


def split_servers(value: object, what: str) -> list[str]:
    """--servers "A,B" (repeatable) or the config file's "A,B" / ["A", "B"]
    -> the addresses, every entry checked by Destinations."""
    if isinstance(value, str):
        return [a.strip() for a in value.split(",")]
    if isinstance(value, list) and all(isinstance(a, str) for a in value):
        return [a.strip() for part in value for a in part.split(",")]
    raise ConfigError(f"{what} must be \"HOST:PORT,HOST:PORT,...\" or a list of "
                      f"\"HOST:PORT\" strings, got {value!r}")
