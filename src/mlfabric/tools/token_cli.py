"""`mlfabric token new|check`: job tokens that cannot be guessed.

* ``new [FILE]`` writes a fresh token (256 random bits) to FILE, readable by
  its owner only, or prints it when no FILE is given. An existing FILE is
  kept unless ``--force``: overwriting a running job's token locks its
  members out.
* ``check FILE`` says whether FILE holds a token mlfabric accepts, and if
  not, why (see `mlfabric.wire.auth.token_weakness`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..errors import ConfigError
from ..wire import auth


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    sub.required = True
    new = sub.add_parser("new", help="make a random job token (to FILE, or print it)")
    new.add_argument("file", nargs="?", metavar="FILE",
                     help="where to write it, mode 0600 (default: print it)")
    new.add_argument("--force", action="store_true", help="replace FILE if it exists")
    check = sub.add_parser("check", help="say whether FILE holds a token mlfabric accepts")
    check.add_argument("file", metavar="FILE")


def run(args: argparse.Namespace) -> int:
    if args.action == "new":
        return _new(args.file, args.force)
    token = auth.load_token(args.file)  # a ConfigError says what is wrong
    print(f"{args.file}: a random token of {len(token)} characters: accepted")
    if not auth.token_file_is_private(args.file):
        print(f"{args.file}: warning: group or others may read it; `chmod 600 {args.file}`",
              file=sys.stderr)
    return 0


def _new(file: str | None, force: bool) -> int:
    token = auth.generate_token()
    if file is None:
        print(token)
        return 0
    path = Path(file)
    if path.is_dir():
        raise ConfigError(f"{file!r} is a folder: name the token file, e.g. {path / 'job.token'}")
    if not path.parent.is_dir():
        raise ConfigError(f"the folder of {file!r} does not exist: create it first")
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise ConfigError(f"{file!r} exists: keep it, or replace it with --force (members "
                          f"of a job running with the old token are then refused)") from None
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # also when --force replaced a wider file
        f.write(token + "\n")
    print(f"wrote a new job token to {file} (mode 0600)")
    return 0
