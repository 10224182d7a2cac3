"""mlfabric's settings for training processes, from four layers.

Precedence, highest first:

1. explicit arguments (``resolve(overrides={...})``) or command-line flags
   (``add_arguments(parser)`` then ``from_args(args)``);
2. ``MLFABRIC_*`` environment variables (``MLFABRIC_SERVER``, ...);
3. a TOML config file, named by ``config_file=`` / ``--config`` or else by
   ``MLFABRIC_CONFIG`` (no file is read unless one is named);
4. the defaults in :data:`SETTINGS`.

A layer only overrides a setting it sets: an argument or flag of ``None``
is "not given". Every value is checked for its type when it is read, and the
resulting :class:`Settings` remembers where each value came from, so an error
found later (an unreachable server, a missing token file) names the setting
and where to fix it. Every problem is a one-line :class:`~mlfabric.errors.ConfigError`.

Processes started by ``torchrun`` learn their place from its environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``): :func:`launch_info`.
"""

from __future__ import annotations

import argparse
import difflib
import os
import socket
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .client.core import parse_address
from .client.shards import split_addresses
from .errors import (
    AuthenticationError,
    ConfigError,
    ConnectError,
    MlfabricError,
    ProtocolError,
    TLSError,
    WrongPeer,
)

__all__ = [
    "SETTINGS",
    "Launch",
    "Setting",
    "Settings",
    "add_arguments",
    "connect",
    "from_args",
    "launch_info",
    "resolve",
]

ENV_PREFIX = "MLFABRIC_"
CONFIG_ENV = "MLFABRIC_CONFIG"


@dataclass(frozen=True)
class Setting:
    """One setting: its name (the config file's key), type, default and help."""

    name: str
    kind: str  # "address", "addresses", "str", "path", "float", "int", "choice"
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None  # for numbers: the smallest allowed value
    positive: bool = False  # for numbers: strictly greater than 0

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def expected(self) -> str:
        """The expected type, in words, for error messages."""
        return {
            "address": 'a string "HOST:PORT"',
            "addresses": 'a string "HOST:PORT" or, for shards, "HOST:PORT,HOST:PORT,..."',
            "str": "a string",
            "path": "a file path (string)",
            "float": "a number",
            "int": "an integer",
            "choice": "one of " + ", ".join(repr(c) for c in self.choices),
        }[self.kind]


#: Every setting, in the order the reference lists them.
SETTINGS: tuple[Setting, ...] = (
    Setting("server", "addresses", None,
            "the job's parameter server, HOST:PORT, or every shard of a sharded job, "
            "HOST:PORT,HOST:PORT,... in shard order (required; under torchrun, "
            "MASTER_ADDR:7070 if not set)"),
    Setting("job", "str", None, "the job's name, as the server was started with (required)"),
    Setting("token_file", "path", None,
            "file holding the job's secret token (required)"),
    Setting("controller", "addresses", None,
            "the job's controller, HOST:PORT, or with several controllers every one of them, "
            "HOST:PORT,HOST:PORT,... as their --controllers lists them (default: none; "
            "pushes go straight to the server)"),
    Setting("replica", "addresses", None,
            "the job's replica, HOST:PORT, or one per shard of a sharded job, "
            "HOST:PORT,HOST:PORT,... in shard order: every applied update (part) is also "
            "sent there (worker-driven replication; default: none)"),
    Setting("agent", "address", None,
            "this host's mlfabric agent, HOST:PORT: pushes are reported to it as bandwidth "
            "samples (default: none; needs agent_key_file)"),
    Setting("agent_key_file", "path", None,
            "file holding the job's key for the agents (the operator makes it with "
            "`mlfabric token agent-key`; needed with agent)"),
    Setting("timeout", "float", 10.0, "seconds to wait when connecting (default: 10)",
            positive=True),
    Setting("controller_fallback", "choice", "fifo",
            "when the controller goes away: 'fifo' sends updates at once, 'wait' waits for it "
            "(default: fifo)", choices=("fifo", "wait")),
    Setting("controller_timeout", "float", 30.0,
            "seconds an update waits for a lost controller with fallback 'wait' (default: 30)",
            positive=True),
    Setting("replica_timeout", "float", 10.0,
            "seconds a push waits for the replica's answer before it completes with the "
            "server's outcome alone (default: 10)", positive=True),
    Setting("push_timeout", "float", 600.0,
            "seconds within which every push resolves: past them it fails with PushTimeout "
            "saying where it was stuck (default: 600)", positive=True),
    Setting("name", "str", None,
            "this worker's name in the server's log (default: HOST:rankRANK under torchrun, "
            "else HOST:PID)"),
    Setting("host", "str", None,
            "this worker's host in the controller's network picture (default: its address)"),
    Setting("pull_every", "int", 1,
            "pull the newest model every N steps; 0: only when asked (default: 1)", minimum=0),
    Setting("max_in_flight", "int", 1,
            "pushes whose outcome a worker may await at once (default: 1)", minimum=1),
    Setting("compression", "str", None,
            "send updates compressed, with error feedback (what a push leaves out, and a "
            "dropped update, go with the next pushes): fp16, bf16, topk:F, randk:F (the "
            "fraction F of the elements) or lowrank:R; or adaptive[:A,B,...]: offer those "
            "forms (default fp16, topk:0.1, topk:0.01) and let the controller choose per "
            "transfer (default: none, updates go whole)"),
    Setting("significance", "float", None,
            "hold a push whose relative magnitude ||update + residual|| / ||model|| is below "
            "this threshold in (0, 1), after Gaia: it waits in the residual and goes with a "
            "later push, nothing lost (default: none, every push goes)", positive=True),
    Setting("tls_cert", "path", None,
            "this worker's TLS certificate (PEM); with tls_key and tls_ca, every link is "
            "mutual TLS (default: none, plain TCP)"),
    Setting("tls_key", "path", None, "the private key of tls_cert (PEM)"),
    Setting("tls_ca", "path", None,
            "the cluster CA's certificate (PEM): listeners must present a certificate it "
            "signed, naming the host dialled"),
)

_BY_NAME = {s.name: s for s in SETTINGS}
_REQUIRED = ("server", "job", "token_file")
#: MLFABRIC_* variables that are not settings of this module (no typo check).
_OTHER_ENV = frozenset({"loop", "agent_args"})


@dataclass(frozen=True)
class Settings:
    """Resolved settings; ``sources`` says where each value came from."""

    server: str | None = None
    job: str | None = None
    token_file: str | None = None
    controller: str | None = None
    replica: str | None = None
    agent: str | None = None
    agent_key_file: str | None = None
    timeout: float = 10.0
    controller_fallback: str = "fifo"
    controller_timeout: float = 30.0
    replica_timeout: float = 10.0
    push_timeout: float = 600.0
    name: str | None = None
    host: str | None = None
    pull_every: int = 1
    max_in_flight: int = 1
    compression: str | None = None
    significance: float | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def source(self, name: str) -> str:
        """Where `name` came from: "--server", "MLFABRIC_SERVER", "config file
        'x.toml'", "argument server=" or "default"."""
        return self.sources.get(name, "default")

    def where(self, name: str) -> str:
        """'setting server (from MLFABRIC_SERVER)': for error messages."""
        return f"setting {name} (from {self.source(name)})"

    def require(self) -> Settings:
        """Self, or a ConfigError naming the first required setting missing."""
        for name in _REQUIRED:
            if getattr(self, name) is None:
                s = _BY_NAME[name]
                example = {"server": "HOST:PORT", "job": "NAME", "token_file": "PATH"}[name]
                raise ConfigError(
                    f"setting {name} is not set: give {s.flag} {example}, set {s.env}, or "
                    f"write {name} = \"{example}\" in the config file ({CONFIG_ENV})"
                )
        return self

    def load_token(self) -> bytes:
        """The job's token from `token_file`, with errors naming the setting."""
        from .wire import auth

        self.require()
        assert self.token_file is not None
        try:
            return auth.load_token(self.token_file)
        except ConfigError as exc:
            raise ConfigError(
                f"{self.where('token_file')}: {exc}; or fix {self._fix('token_file')}"
            ) from None

    def _fix(self, name: str) -> str:
        src = self.source(name)
        if src == FROM_MASTER_ADDR:
            return (f"--server or MLFABRIC_SERVER (without them, torchrun's MASTER_ADDR "
                    f"names the server, on port {SERVER_PORT})")
        return "the default" if src == "default" else src


@dataclass(frozen=True)
class Launch:
    """Where this process sits in a torchrun launch (0 of 1 without torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    under_launcher: bool = False
    master_addr: str | None = None  # torchrun's MASTER_ADDR: rank 0's host


def launch_info(environ: Mapping[str, str] | None = None) -> Launch:
    """RANK, WORLD_SIZE and LOCAL_RANK as torchrun sets them.

    Without them the process is rank 0 of 1. Malformed values are a ConfigError."""
    env = os.environ if environ is None else environ
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return Launch()
    values: dict[str, int] = {}
    for var, default in (("RANK", None), ("WORLD_SIZE", None), ("LOCAL_RANK", "0")):
        text = env.get(var, default)
        if text is None:
            other = "WORLD_SIZE" if var == "RANK" else "RANK"
            raise ConfigError(
                f"environment variable {other} is set but {var} is not: start workers with "
                f"torchrun, or set both RANK and WORLD_SIZE"
            )
        try:
            values[var] = int(text)
        except ValueError:
            raise ConfigError(
                f"environment variable {var}={text!r} is not an integer: start workers with "
                f"torchrun, or unset {var}"
            ) from None
    rank, world, local = values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"]
    if world < 1 or not 0 <= rank < world or local < 0:
        raise ConfigError(
            f"RANK={rank}, WORLD_SIZE={world}, LOCAL_RANK={local} are inconsistent: need "
            f"0 <= RANK < WORLD_SIZE; start workers with torchrun"
        )
    return Launch(rank, world, local, under_launcher=True,
                  master_addr=env.get("MASTER_ADDR") or None)


#: The port of the job's server where no setting names it: under torchrun,
#: the server is MASTER_ADDR:SERVER_PORT (the port every example and
#: manifest of this project gives `mlfabric server --listen`).
SERVER_PORT = 7070
FROM_MASTER_ADDR = "MASTER_ADDR (torchrun)"


def server_from_launcher(settings: Settings, launch: Launch) -> Settings:
    """`settings` with the server at MASTER_ADDR:SERVER_PORT if no setting
    names one and torchrun gives MASTER_ADDR (rank 0's host, where a job
    runs its server beside the rendezvous); else `settings` as they are."""
    if settings.server is not None or not launch.under_launcher or not launch.master_addr:
        return settings
    host = launch.master_addr
    server = f"[{host}]:{SERVER_PORT}" if ":" in host else f"{host}:{SERVER_PORT}"
    return replace(settings, server=server,
                   sources={**settings.sources, "server": FROM_MASTER_ADDR})


# --- reading and checking values ---------------------------------------------------


def _convert(s: Setting, value: Any, where: str, typed: bool = False) -> Any:
    """`value` as the setting's type, or a ConfigError naming `where` it came from.

    Strings (from the environment or flags) are parsed; with `typed` (TOML
    values) a number must be a number, not a string."""
    is_text = isinstance(value, str)
    if typed and is_text and s.kind in ("int", "float"):
        raise ConfigError(
            f"setting {s.name} (from {where}) must be {s.expected}, got {value!r} (str): "
            f"write it without quotes in {where}"
        )

    def bad(why: str = "") -> ConfigError:
        return ConfigError(
            f"setting {s.name} (from {where}) must be {s.expected}, got {value!r}"
            f"{why}: fix {where}"
        )

    if s.kind in ("address", "addresses", "str", "path", "choice"):
        if not is_text:
            raise bad(f" ({type(value).__name__})")
        if value == "":
            raise bad(" (empty)")
        if s.kind == "choice" and value not in s.choices:
            raise bad()
        if s.kind == "address":
            try:
                parse_address(value)
            except ConfigError:
                raise bad(" (not HOST:PORT)") from None
        if s.kind == "addresses":
            try:
                for address in split_addresses(value):
                    parse_address(address)
            except ConfigError as exc:
                raise bad(f" ({exc})") from None
        return value
    if isinstance(value, bool):
        raise bad(f" ({type(value).__name__})")
    number: float | int
    if s.kind == "int":
        if is_text:
            try:
                number = int(value.strip())
            except ValueError:
                raise bad() from None
        elif isinstance(value, int):
            number = value
        else:
            raise bad(f" ({type(value).__name__})")
    else:
        if is_text:
            try:
                number = float(value.strip())
            except ValueError:
                raise bad() from None
        elif isinstance(value, int | float):
            number = float(value)
        else:
            raise bad(f" ({type(value).__name__})")
        if number != number or number in (float("inf"), float("-inf")):
            raise bad(" (not finite)")
    if s.positive and not number > 0:
        raise bad(" (must be > 0)")
    if s.minimum is not None and number < s.minimum:
        raise bad(f" (must be >= {s.minimum:g})")
    return number


def _closest(key: str) -> str:
    match = difflib.get_close_matches(key.replace("-", "_").lower(), list(_BY_NAME), n=1,
                                      cutoff=0.5)
    return f"did you mean {match[0]!r}?" if match else "valid keys: " + ", ".join(_BY_NAME)


def read_config_file(path: str | os.PathLike[str], where: str) -> dict[str, Any]:
    """The settings in a TOML file (top-level keys), checked for unknown keys."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(
            f"config file {str(p)!r} (from {where}) does not exist: create it or fix {where}"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(p)!r} (from {where}): "
                          f"{exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {detail}") from None
    for key, value in data.items():
        if key not in _BY_NAME:
            hint = " (settings are top-level keys)" if isinstance(value, dict) else ""
            raise ConfigError(
                f"config file {str(p)!r}: unknown setting {key!r}{hint}; {_closest(key)}"
            )
    return data


def resolve(
    overrides: Mapping[str, Any] | None = None,
    *,
    config_file: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    override_source: Callable[[str], str] | None = None,
    config_source: str = "argument config_file=",
) -> Settings:
    """Settings from, in order of precedence: `overrides` (None values are
    skipped) > MLFABRIC_* variables in `environ` (default os.environ) > the
    config file (`config_file`, else $MLFABRIC_CONFIG) > defaults.

    Required settings (server, job, token_file) may stay unset here;
    :meth:`Settings.require` and :func:`connect` insist on them."""
    env = os.environ if environ is None else environ
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    for key in given:
        if key not in _BY_NAME:
            raise ConfigError(f"unknown mlfabric setting {key!r}; {_closest(key)}")
    label = override_source or (lambda name: f"argument {name}=")

    file_values: dict[str, Any] = {}
    file_where = ""
    if config_file is not None:
        file_values = read_config_file(config_file, config_source)
        file_where = f"config file {str(config_file)!r}"
    elif env.get(CONFIG_ENV):
        file_values = read_config_file(env[CONFIG_ENV], CONFIG_ENV)
        file_where = f"config file {env[CONFIG_ENV]!r}"

    for var in env:
        if var.startswith(ENV_PREFIX) and var != CONFIG_ENV:
            name = var[len(ENV_PREFIX):].lower()
            if name not in _BY_NAME and name not in _OTHER_ENV:
                match = difflib.get_close_matches(name, list(_BY_NAME), n=1, cutoff=0.75)
                if match:  # a likely typo of ours; other MLFABRIC_* variables are left alone
                    raise ConfigError(
                        f"unknown environment variable {var}; did you mean "
                        f"{_BY_NAME[match[0]].env}?"
                    )

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for s in SETTINGS:
        if s.name in given:
            where, raw = label(s.name), given[s.name]
        elif s.env in env:
            where, raw = s.env, env[s.env]
        elif s.name in file_values:
            values[s.name] = _convert(s, file_values[s.name], file_where, typed=True)
            sources[s.name] = file_where
            continue
        else:
            values[s.name] = s.default
            continue
        values[s.name] = _convert(s, raw, where)
        sources[s.name] = where
    return Settings(**values, sources=sources)



# --- command-line flags -----------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --config and one flag per setting; all default to None ("not given")."""
    group = parser.add_argument_group(
        "mlfabric settings",
        "flags override MLFABRIC_* environment variables, which override the config file",
    )
    group.add_argument("--config", metavar="FILE.toml", default=None,
                       help=f"read settings from this TOML file (default: ${CONFIG_ENV})")
    for s in SETTINGS:
        metavar = {"address": "HOST:PORT", "addresses": "HOST:PORT[,...]", "path": "PATH",
                   "float": "SECONDS", "int": "N",
                   "choice": "{" + ",".join(s.choices) + "}"}.get(s.kind, "NAME")
        # Values stay strings here: resolve() checks them with the other layers'
        # rules, so a bad flag gets the same one-line error as a bad variable.
        group.add_argument(s.flag, dest=f"mlfabric_{s.name}", metavar=metavar, default=None,
                           help=f"{s.help}; env {s.env}")


def from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Settings:
    """Settings from flags added by :func:`add_arguments`, then the other layers."""
    overrides = {s.name: getattr(args, f"mlfabric_{s.name}", None) for s in SETTINGS}
    return resolve(overrides, config_file=getattr(args, "config", None), environ=environ,
                   override_source=lambda name: _BY_NAME[name].flag, config_source="--config")


# --- connecting ------------------------------------------------------------------


def connect(settings: Settings, *, launch: Launch | None = None, **extra: Any) -> Any:
    """`mlfabric.connect` with `settings`; every failure that a setting can fix
    (missing token file, unreachable server or controller, wrong job or token)
    is a one-line ConfigError naming the setting and where it came from.

    A configured controller must be reachable at start (a wrong address would
    otherwise only be a warning); `controller_fallback` governs what happens
    when it goes away later. Under torchrun, with no server setting, the
    server is MASTER_ADDR:7070 (`server_from_launcher`)."""
    from .client.blocking import connect as client_connect

    if settings.server is None:
        launch = launch or launch_info()
        settings = server_from_launcher(settings, launch)
    settings.require()
    assert settings.server is not None and settings.job is not None
    token = settings.load_token()
    if settings.compression is not None:
        from .compression import parse, parse_offer

        try:
            parse_offer(settings.compression) or parse(settings.compression)
        except ConfigError as exc:
            raise ConfigError(f"{exc} ({settings.where('compression')})") from None
    if settings.significance is not None:
        from .compression.significance import check_threshold

        try:
            check_threshold(settings.significance)
        except ConfigError as exc:
            raise ConfigError(f"{exc} ({settings.where('significance')})") from None
    for which in ("controller", "replica"):
        if getattr(settings, which) is not None:
            _probe(settings, which)
    name = settings.name
    if name is None:
        launch = launch or launch_info()
        if launch.under_launcher:
            name = f"{socket.gethostname()}:rank{launch.rank}"
    try:
        return client_connect(
            settings.server, job=settings.job, token=token, timeout=settings.timeout,
            name=name, controller=settings.controller, host=settings.host,
            controller_fallback=settings.controller_fallback,
            controller_timeout=settings.controller_timeout, replica=settings.replica,
            replica_timeout=settings.replica_timeout, push_timeout=settings.push_timeout,
            agent=settings.agent, agent_key_file=settings.agent_key_file,
            tls_cert=settings.tls_cert, tls_key=settings.tls_key, tls_ca=settings.tls_ca,
            compression=settings.compression, significance=settings.significance, **extra,
        )
    except TLSError as exc:
        raise ConfigError(f"{exc} ({_tls_sources(settings)})") from None
    except WrongPeer as exc:
        # The address answers as another kind of process: name the setting that holds it.
        raise ConfigError(f"{exc} ({settings.where(_holding(settings, exc.address))})") from None
    except ConfigError as exc:
        if "tls_" in str(exc):  # a TLS file missing, unreadable, or not matching
            raise ConfigError(f"{exc} ({_tls_sources(settings)})") from None
        raise
    except ConnectError as exc:
        which = "controller" if "controller" in str(exc) else "server"
        raise _unreachable(settings, which, exc) from None
    except AuthenticationError as exc:
        raise ConfigError(
            f"{exc} (setting job from {settings.source('job')}, setting token_file from "
            f"{settings.source('token_file')})"
        ) from None
    except ProtocolError as exc:
        raise ConfigError(
            f"the server at {settings.server} ({settings.where('server')}) does not speak "
            f"mlfabric's protocol ({exc}); give the address `mlfabric server` printed, "
            f"not e.g. its metrics port"
        ) from None


def _tls_sources(settings: Settings) -> str:
    return ", ".join(f"setting {n} from {settings.source(n)}"
                     for n in ("tls_cert", "tls_key", "tls_ca"))


def _holding(settings: Settings, address: str) -> str:
    """Which address setting holds `address` (the server's, by default)."""
    for which in ("controller", "replica"):
        value = getattr(settings, which)
        if value is not None and address in (a.strip() for a in value.split(",")):
            return which
    return "server"


def _probe(settings: Settings, which: str) -> None:
    addresses = getattr(settings, which).split(",")  # a replica per shard: each of them
    for address in addresses:
        host, port = parse_address(address.strip())
        try:
            sock = socket.create_connection((host, port), timeout=settings.timeout)
        except OSError as exc:
            raise _unreachable(settings, which, exc,
                               address.strip() if len(addresses) > 1 else None) from None
        sock.close()


def _unreachable(settings: Settings, which: str, exc: BaseException,
                 one: str | None = None) -> ConfigError:
    """The error for a `which` that cannot be reached (`one`: the address of
    several that could not)."""
    cause: BaseException = exc
    if isinstance(exc, MlfabricError) and isinstance(exc.__context__, OSError):
        cause = exc.__context__
    if isinstance(cause, OSError):
        reason = cause.strerror or type(cause).__name__
        if isinstance(cause, TimeoutError):
            reason = f"no answer within {settings.timeout:g} s (setting timeout)"
    else:
        reason = str(cause)
    command = {"server": "mlfabric server", "controller": "mlfabric controller",
               "replica": "mlfabric server --role replica"}[which]
    address = getattr(settings, which)
    if "," in address and isinstance(exc, MlfabricError):
        reason = str(exc)  # it names the shard that could not be reached
    elif one is not None:
        reason = f"{one}: {reason}"
    return ConfigError(
        f"cannot reach the {which} at {address} ({settings.where(which)}): {reason}; start "
        f"`{command}` there or fix {settings._fix(which)}"
    )
