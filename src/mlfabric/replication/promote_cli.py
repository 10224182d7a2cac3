"""`mlfabric promote`: make a replica the server, by an operator's word.

The controller's failover monitor promotes the replica by itself when the
server stops answering its heartbeats. This command is for when it cannot:
no controller runs, or it runs without --server/--replica. Without --force
the replica checks the server it would replace (--server) itself and
refuses while that server still answers it: a replica promoted beside a
live server makes two servers, whose histories part. --force skips the
check; the operator then answers for the old server (stop it first).

Workers learn of a promotion only from a controller: after this command,
point them at the promoted replica (restart them with its address).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from ..client.core import default_client_name, parse_address
from ..errors import ConfigError, ServerError
from ..runtime import loop
from ..runtime.loop import within
from ..transport.listener import check_positive
from ..transport.tls import add_tls_arguments, from_args
from ..wire import auth
from ..wire.handshake import ClientHandshake
from ..wire.protocol import Error, Pong, Promote
from .failover import PROMOTE_CHECK_TIMEOUT


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replica", required=True, metavar="HOST:PORT",
                   help="the replica to promote (mlfabric server --role replica)")
    p.add_argument("--server", metavar="HOST:PORT", default=None,
                   help="the server it replaces: the replica refuses while that server still "
                        "answers it (needed unless --force)")
    p.add_argument("--force", action="store_true",
                   help="promote without checking the server (stop the old server first: two "
                        "servers would part the job's history)")
    p.add_argument("--job", required=True, help="the job's name")
    p.add_argument("--token-file", required=True, metavar="PATH",
                   help="file holding the job's secret token")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds to wait for the replica's answer (default: 10)")
    add_tls_arguments(p, "the replica (started with --tls-*)", listens=False)


async def promote(replica: str, *, job: str, token: bytes, server: str | None, force: bool,
                  timeout: float) -> int:
    """Ask the replica to take over; the version it serves from, or
    ServerError with the replica's reason."""
    from ..client.link import open_link

    answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def on_event(event: Any) -> None:
        if isinstance(event, (Pong, Error)) and not answer.done():
            answer.set_result(event)

    link = await open_link(replica, ClientHandshake(job, token, f"promote@{default_client_name()}"),
                           timeout, "replica server", on_event=on_event,
                           command="mlfabric server --role replica")
    try:
        link.send(Promote(1, server=server, force=True if force else None))
        result = await within(asyncio.shield(answer), timeout + PROMOTE_CHECK_TIMEOUT)
    finally:
        link.close()
    if isinstance(result, Error):
        raise ServerError(f"the replica at {replica} refused: {result.message}", result.code)
    return int(result.version)


def run(args: argparse.Namespace) -> int:
    parse_address(args.replica)
    if args.server is None and not args.force:
        raise ConfigError("give --server HOST:PORT (the server the replica replaces, which it "
                          "checks is gone) or --force")
    if args.server is not None:
        parse_address(args.server)
    check_positive("--timeout", args.timeout)
    token = auth.load_token(args.token_file)
    from_args(args)  # the link to the replica is TLS with --tls-*
    try:
        version = loop.run(promote(args.replica, job=args.job, token=token, server=args.server,
                                   force=args.force, timeout=args.timeout))
    except TimeoutError:
        raise ServerError(f"the replica at {args.replica} did not answer within "
                          f"{args.timeout} s") from None
    print(f"mlfabric promote: the replica at {args.replica} is the server from version "
          f"{version}{' (forced)' if args.force else ''}; point the workers at it", flush=True)
    return 0
