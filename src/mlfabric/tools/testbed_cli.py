"""`mlfabric testbed up|down|status`: an emulated cluster of network namespaces.

* ``up --hosts N --rate MBIT [--delay-ms D]`` builds one, prints its hosts and
  keeps it until Ctrl-C (or SIGTERM), then tears it down.
* ``down`` removes what crashed or killed runs left behind: their namespaces
  and the processes in them. Runs whose owner process is still alive are left
  alone (they tear themselves down) unless ``--all`` is given.
* ``status`` lists the testbed runs on this machine.
"""

from __future__ import annotations

import argparse
import sys
import threading

from ..errors import ConfigError
from .testbed import DEFAULT_MTU, MTU_RANGE, Testbed, cleanup, list_runs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    sub.required = True
    up = sub.add_parser("up", help="create a testbed and keep it until Ctrl-C")
    up.add_argument("--hosts", type=int, default=3, help="number of hosts (default: 3)")
    up.add_argument(
        "--rate", type=float, default=100.0, help="uplink and downlink rate, Mbit/s (default: 100)"
    )
    up.add_argument("--up-mbit", type=float, default=None, help="uplink rate (default: --rate)")
    up.add_argument("--down-mbit", type=float, default=None, help="downlink rate (default: --rate)")
    up.add_argument(
        "--unshaped", action="store_true", help="do not shape the links (ignores the rates)"
    )
    up.add_argument(
        "--delay-ms", type=float, default=0.0, help="one-way latency added on every uplink"
    )
    up.add_argument(
        "--burst", default="1ms",
        help="every shaper's token bucket: bytes (64KB) or time at the rate (10ms); "
             "default 1ms",
    )
    up.add_argument(
        "--queue-ms", type=float, default=50.0,
        help="every shaper's queue, in milliseconds at the rate (default: 50)",
    )
    up.add_argument(
        "--mtu", type=int, default=DEFAULT_MTU,
        help=f"every link's MTU, {MTU_RANGE[0]}-{MTU_RANGE[1]} bytes (default: {DEFAULT_MTU})",
    )
    down = sub.add_parser("down", help="remove testbeds left by crashed runs")
    down.add_argument(
        "--all", action="store_true", help="also remove testbeds whose owner is still running"
    )
    down.add_argument("--run", default=None, help="only this run id")
    sub.add_parser("status", help="list testbed runs on this machine")


def run(args: argparse.Namespace) -> int:
    if args.action == "up":
        return _up(args)
    if args.action == "down":
        return _down(args)
    return _status()


def _up(args: argparse.Namespace) -> int:
    if args.unshaped:
        tb = Testbed(hosts=args.hosts, rate_mbit=None, delay_ms=args.delay_ms, mtu=args.mtu)
    else:
        tb = Testbed(
            hosts=args.hosts,
            rate_mbit=args.rate,
            delay_ms=args.delay_ms,
            up_mbit=args.up_mbit,
            down_mbit=args.down_mbit,
            burst=args.burst,
            queue_ms=args.queue_ms,
            mtu=args.mtu,
        )
    try:
        with tb:
            print(f"testbed {tb.run_id} up: {len(tb.hosts)} hosts on {tb.subnet}")
            print(f"  switch  netns={tb.switch_netns}  bridge={tb.bridge}")
            for h in tb.hosts:
                print(
                    f"  {h.name:<6}  netns={h.netns}  ip={h.ip}  if={h.ifname}"
                    f"  up={_fmt(h.up_mbit)}  down={_fmt(h.down_mbit)}"
                    + (f"  delay={tb.delay_ms:g}ms" if tb.delay_ms else "")
                    + (f"  burst={tb.burst}" if str(tb.burst) != "1ms" else "")
                    + (f"  mtu={tb.mtu}" if tb.mtu != DEFAULT_MTU else "")
                )
            print(f"run a command in a host: ip netns exec {tb.hosts[0].netns} <command>")
            print("press Ctrl-C to tear it down", flush=True)
            forever = threading.Event()
            while not forever.wait(1.0):  # wake up so Ctrl-C is handled promptly
                pass
    except KeyboardInterrupt:
        pass
    print(f"testbed {tb.run_id} torn down", file=sys.stderr)
    return 0


def _fmt(rate: float | None) -> str:
    return "unshaped" if rate is None else f"{rate:g}Mbit/s"


def _down(args: argparse.Namespace) -> int:
    if args.run is not None and not all(c in "0123456789abcdef" for c in args.run):
        raise ConfigError(f"--run must be a run id like 3fa2 (hex), got {args.run!r}")
    removed = cleanup(run=args.run, include_live=args.all)
    for info in removed:
        owner = f"owner pid {info.owner_pid}" if info.owner_pid else "no owner record"
        names = " ".join(info.namespaces) or "(no namespaces, stale record)"
        print(f"removed run {info.run} ({owner}): {names}")
    live = [r for r in list_runs() if args.run in (None, r.run) and r.owner_alive]
    for info in live:
        print(
            f"kept run {info.run}: owner pid {info.owner_pid} is alive "
            "(stop it with Ctrl-C, or use --all)"
        )
    if not removed and not live:
        print("no testbed leftovers")
    return 0


def _status() -> int:
    runs = list_runs()
    if not runs:
        print("no testbeds")
        return 0
    for info in runs:
        state = "live" if info.owner_alive else "LEFTOVER (mlfabric testbed down removes it)"
        owner = f"pid {info.owner_pid}" if info.owner_pid else "unknown owner"
        print(f"run {info.run}: {state}, {owner}, {len(info.namespaces)} namespaces")
        for ns in info.namespaces:
            print(f"  {ns}")
    return 0
