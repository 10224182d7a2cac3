"""`mlfabric token new|check`: job tokens that cannot be guessed.

* ``new [FILE]`` writes a fresh token (256 random bits) to FILE, readable by
  its owner only, or prints it when no FILE is given. An existing FILE is
  kept unless ``--force``: overwriting a running job's token locks its
  members out.
* ``check FILE`` says whether FILE holds a token mlfabric accepts, and if
  not, why (see `mlfabric.wire.auth.token_weakness`).
* ``agent-key --cluster-token-file F --job JOB [FILE]`` writes job JOB's key
  for the agents' control API (`mlfabric.wire.agent_auth`): the job's
  controller reads estimates with it and its workers report transfers. The
  operator runs it; the job never sees the cluster token.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..errors import ConfigError
from ..wire import agent_auth, auth


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    sub.required = True
    new = sub.add_parser("new", help="make a random job token (to FILE, or print it)")
    new.add_argument("file", nargs="?", metavar="FILE",
                     help="where to write it, mode 0600 (default: print it)")
    new.add_argument("--force", action="store_true", help="replace FILE if it exists")
    check = sub.add_parser("check", help="say whether FILE holds a token mlfabric accepts")
    check.add_argument("file", metavar="FILE")
    key = sub.add_parser("agent-key", help="make a job's key for the agents (to FILE, or "
                                           "print it)")
    key.add_argument("file", nargs="?", metavar="FILE",
                     help="where to write it, mode 0600 (default: print it)")
    key.add_argument("--cluster-token-file", required=True, metavar="PATH",
                     help="the cluster's token, as the agents hold it")
    key.add_argument("--job", required=True, help="the job the key is for")
    key.add_argument("--force", action="store_true", help="replace FILE if it exists")


def run(args: argparse.Namespace) -> int:
    if args.action == "new":
        return _write(auth.generate_token(), args.file, args.force, "a new job token")
    if args.action == "agent-key":
        text = agent_auth.format_job_key(auth.load_token(args.cluster_token_file), args.job)
        return _write(text, args.file, args.force, f"job {args.job!r}'s agent key")
    token = auth.load_token(args.file)  # a ConfigError says what is wrong
    print(f"{args.file}: a random token of {len(token)} characters: accepted")
    if not auth.token_file_is_private(args.file):
        print(f"{args.file}: warning: group or others may read it; `chmod 600 {args.file}`",
              file=sys.stderr)
    return 0


def _write(token: str, file: str | None, force: bool, what: str) -> int:
    if file is None:
        print(token)
        return 0
    path = Path(file)
    if path.is_dir():
        raise ConfigError(f"{file!r} is a folder: name the token file, e.g. {path / 'job.token'}")
    if not path.parent.is_dir():
        raise ConfigError(f"the folder of {file!r} does not exist: create it first")
    try:
        write_private(path, token, replace=force)
    except FileExistsError:
        raise ConfigError(f"{file!r} exists: keep it, or replace it with --force (members "
                          f"of a job running with the old token are then refused)") from None
    print(f"wrote {what} to {file} (mode 0600)")
    return 0


def write_private(path: Path, text: str, replace: bool) -> None:
    """`text` and a newline into `path`, readable by its owner only;
    FileExistsError if it exists and not `replace`."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if replace else os.O_EXCL)
    with os.fdopen(os.open(path, flags, 0o600), "w") as f:
        os.fchmod(f.fileno(), 0o600)  # also when it replaced a wider file
        f.write(text + "\n")


def agent_secrets(folder: Path, job: str) -> tuple[Path, Path]:
    """A fresh cluster token and job `job`'s agent key, in files of mode 0600
    in `folder` (cluster.token, JOB.agent-key): what the tools' emulated
    clusters give their agents, controllers and workers."""
    cluster = folder / "cluster.token"
    token = auth.generate_token()
    key = folder / f"{job}.agent-key"
    write_private(cluster, token, replace=True)
    write_private(key, agent_auth.format_job_key(token.encode(), job), replace=True)
    return cluster, key
