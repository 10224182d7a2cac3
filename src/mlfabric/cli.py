"""The `mlfabric` command: one subcommand per component.

Each subcommand lives in its own module, which provides
`add_arguments(parser)` and `run(args) -> int`; this file only dispatches and
turns mlfabric errors into one-line messages instead of tracebacks.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .errors import MlfabricError

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "server": ("mlfabric.server.cli", "run a parameter server (or its replica) for one job"),
    "demo": ("mlfabric.tools.demo", "train a small model through a local parameter server"),
    "testbed": (
        "mlfabric.tools.testbed_cli",
        "create or remove an emulated cluster of network namespaces",
    ),
    "agent": ("mlfabric.agent.cli", "run the per-host bandwidth agent"),
    "controller": ("mlfabric.controller.cli", "order a job's transfers (the controller)"),
    "status": ("mlfabric.controller.status_cli",
               "show a job's workers, servers, agents, versions, delays and bandwidth"),
    "token": ("mlfabric.tools.token_cli", "make a random job token, or check one"),
    "tls": ("mlfabric.tools.tls_cli", "make a CA and certificates for mutual TLS"),
    "kube": ("mlfabric.tools.kube",
             "print the Kubernetes manifests of a whole job, for its size"),
    "report": ("mlfabric.tools.report",
               "draw what the controller did from its decision log (needs matplotlib)"),
    "promote": ("mlfabric.replication.promote_cli",
                "make a replica the server by hand (checks the old server is gone, or --force)"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `only`, just that subcommand's flags are
    added (the others keep their one-line help), so a command imports only
    its own module: `mlfabric token` need not load the server, the scheduler
    and the agent, which roughly halves its start-up time."""
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="mlfabric",
        description="Network-aware communication for distributed ML training.",
    )
    parser.add_argument("--version", action="version", version=f"mlfabric {__version__}")
    levels = ["DEBUG", "INFO", "WARNING", "ERROR"]
    parser.add_argument("--log-level", default="INFO", choices=levels,
                        help="logging verbosity (default: INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is not None and name != only:
            continue
        module = importlib.import_module(module_name)
        # after the subcommand too (issue 33: it only worked before it); not
        # given there, the value before it (or the default) stands
        p.add_argument("--log-level", default=argparse.SUPPRESS, choices=levels,
                       help="logging verbosity (default: INFO; also before COMMAND)")
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _command_in(argv: list[str]) -> str | None:
    """The subcommand `argv` names: its first word that is one. Before it
    come only top-level options, whose one value (--log-level's, or an
    abbreviation's such as `--log DEBUG`) is never a command's name."""
    return next((word for word in argv if word in COMMANDS), None)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    # No subcommand named (--version, --help, a typo): none of them is loaded.
    parser = build_parser(only=_command_in(argv) or "")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args._run(args) or 0)
    except MlfabricError as exc:
        print(f"mlfabric {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"mlfabric {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
