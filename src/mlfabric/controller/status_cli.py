"""`mlfabric status`: the job at a glance, from its controller (or from each
of its controllers, when several plan its shards)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from ..client.core import default_client_name
from ..client.link import open_link
from ..errors import (
    ConfigError,
    ConnectError,
    ConnectionLost,
    MlfabricError,
    ProtocolError,
    WrongPeer,
)
from ..runtime import loop as loops
from ..runtime.loop import within
from ..transport.listener import check_positive
from ..transport.tls import add_tls_arguments, from_args
from ..wire import auth
from ..wire.handshake import ClientHandshake
from ..wire.protocol import Error, Status, StatusRequest


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--controller", required=True, metavar="HOST:PORT[,HOST:PORT...]",
                   help="the job's controller; with several controllers (--etcd), all of "
                        "them (the --controllers list) to see each one's part of the job")
    p.add_argument("--job", required=True, help="the job's name")
    p.add_argument("--token-file", required=True, metavar="PATH",
                   help="file holding the job's secret token")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait (default: 10)")
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")
    p.add_argument("--watch", nargs="?", type=float, const=1.0, default=None,
                   metavar="SECONDS",
                   help="refresh the status every SECONDS (default 1) in the terminal, like "
                        "top, until Ctrl-C (needs rich: pip install 'mlfabric[watch]')")
    add_tls_arguments(p, "the controller (started with --tls-*)", listens=False)


def fetch_status(address: str, job: str, token: bytes, timeout: float = 10.0) -> dict[str, Any]:
    """The controller's status, over the same link every component dials."""
    return loops.run(_fetch_status(address, job, token, timeout))


async def _fetch_status(address: str, job: str, token: bytes, timeout: float
                        ) -> dict[str, Any]:
    answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def on_event(event: Any) -> None:
        if not answer.done():
            answer.set_result(event)

    def on_lost(link: Any, exc: BaseException | None) -> None:
        if not answer.done():
            answer.set_exception(
                ConnectionLost(f"the controller at {address} closed the connection"))

    try:
        link = await open_link(
            address, ClientHandshake(job, token, f"status@{default_client_name()}"), timeout,
            "controller", on_event=on_event, on_lost=on_lost)
    except ConnectError as exc:
        raise ConnectError(f"{exc} (--controller)") from None
    except WrongPeer as exc:  # e.g. the server's address: its challenge says so
        raise WrongPeer(f"{exc} (--controller)", exc.address) from None
    try:
        link.send(StatusRequest(req=1))
        try:
            event = await within(answer, timeout)
        except TimeoutError:
            raise ConnectError(f"no status from {address} within {timeout} s") from None
    finally:
        link.close()
    if isinstance(event, Status):
        return dict(event.status)
    if isinstance(event, Error):
        raise ProtocolError(
            f"{address} refused the status request ({event.message}): give the "
            f"address of the job's `mlfabric controller`, not of its server "
            f"(--controller)")
    raise ProtocolError(f"expected a status, got {type(event).__name__}")


def fetch_statuses(addresses: Sequence[str], job: str, token: bytes, timeout: float = 10.0
                   ) -> dict[str, dict[str, Any] | MlfabricError]:
    """Each controller's status, asked at once; a controller that does not
    answer gives its error instead (the others still count)."""
    async def each() -> list[dict[str, Any] | BaseException]:
        return await asyncio.gather(*(_fetch_status(a, job, token, timeout) for a in addresses),
                                    return_exceptions=True)

    out: dict[str, dict[str, Any] | MlfabricError] = {}
    for address, got in zip(addresses, loops.run(each()), strict=True):
        if isinstance(got, BaseException) and not isinstance(got, MlfabricError):
            raise got  # a bug, not a controller that did not answer
        out[address] = got
    return out


def format_statuses(statuses: Mapping[str, dict[str, Any] | MlfabricError]) -> str:
    """Several controllers of one job: which answered and what each plans,
    who plans which shard, then each one's own status."""
    answered = {a: s for a, s in statuses.items() if isinstance(s, dict)}
    job = next((s.get("job") for s in answered.values()), None)
    lines = [f"job {job!r}: {len(statuses)} controllers, {len(answered)} answered"]
    rows: list[tuple[str, ...]] = []
    # Each part of an update is planned by the one controller of its shard,
    # so pending and active add up to the job's. Connections do not: a
    # worker connects to every controller.
    planned: set[int] = set()
    pending = active = 0
    for address, s in statuses.items():
        if isinstance(s, dict):
            ctl = s.get("controllers") or {}
            rows.append((address, "yes", _cell(ctl.get("plans", "all")), str(s["pending"]),
                         str(s["active"]), _cell(s.get("connections"))))
            planned.update(k for k in ctl.get("plans") or () if isinstance(k, int))
            pending += int(s["pending"])
            active += int(s["active"])
        else:
            rows.append((address, f"no: {s}", "-", "-", "-", "-"))
    if len(answered) > 1:
        rows.append(("job (answered)", "-", _cell(sorted(planned) or None), str(pending),
                     str(active), "-"))
    lines += _table(("controller", "answered", "plans shards", "pending", "active",
                     "connections"), rows)
    # Who plans which shard, as each answering controller last read etcd
    # (they can differ for a lease's time while a shard moves).
    views = {a: tuple((s.get("controllers") or {}).get("owners") or ())
             for a, s in answered.items()}
    distinct = set(views.values()) - {()}
    if len(distinct) == 1:
        (owners,) = distinct
        lines.append("shards planned by:")
        lines += _table(("shard", "controller"),
                        [(str(k), o or "nobody yet (being taken over)")
                         for k, o in enumerate(owners)])
    elif distinct:
        lines.append("shards planned by (the controllers' views differ while a shard moves):")
        lines += _table(("shard", *(f"as {a} reads it" for a, v in views.items() if v)),
                        [(str(k), *(v[k] if k < len(v) and v[k] else "nobody"
                                    for v in views.values() if v))
                         for k in range(max(len(v) for v in distinct))])
    if len(answered) > 1:
        lines += _job_servers_and_workers(list(answered.values()))
    for address, s in answered.items():
        lines += ["", format_status(s, address)]
    return "\n".join(lines)


_COUNTS = ("requests", "sent", "dropped", "applied", "refused")


def _job_servers_and_workers(statuses: list[dict[str, Any]]) -> list[str]:
    """The job's servers and workers, over the controllers that answered.
    A worker talks to every controller, each about the parts of its updates
    for the shards it plans: its counts add up to the worker's (a push of S
    shards is S requests). A server is counted by the controller of its
    shard, so its rows add up too; its version is the highest reported."""
    servers: dict[str, dict[str, Any]] = {}
    for s in statuses:
        for v in s.get("servers") or ():
            row = servers.setdefault(v["host"], {"version": None, "transfers": 0, "applied": 0,
                                                 "refused": 0, "last_heard_age_s": None})
            for key in ("transfers", "applied", "refused"):
                row[key] += int(v[key])
            if v.get("version") is not None:
                row["version"] = max(row["version"] or 0, int(v["version"]))
            age = v.get("last_heard_age_s")
            if age is not None:
                row["last_heard_age_s"] = min(age, row["last_heard_age_s"] or age)
    # A worker is known by the name in its hello: each controller's name for
    # it adds the address of its connection there.
    workers: dict[str, dict[str, Any]] = {}
    for s in statuses:
        for w in s.get("workers") or ():
            row = workers.setdefault(w.get("client") or w["name"],
                                     {"host": w.get("host"), "controllers": 0,
                                      **dict.fromkeys(_COUNTS, 0)})
            row["controllers"] += 1
            for key in _COUNTS:
                row[key] += int(w.get(key) or 0)
    lines = ["the job's servers (added up over the controllers that answered):"]
    lines += _table(("host", "version", "transfers", "applied", "refused", "last heard"),
                    [(host, _cell(v["version"]), str(v["transfers"]), str(v["applied"]),
                      str(v["refused"]), _ago(v["last_heard_age_s"]))
                     for host, v in sorted(servers.items())]) if servers else ["  none seen yet"]
    lines.append("the job's connected workers (parts of their updates, added up over the "
                 "controllers that answered):")
    lines += _table(("name", "host", "controllers", *_COUNTS),
                    [(name, w["host"] or "-", str(w["controllers"]),
                      *(str(w[k]) for k in _COUNTS))
                     for name, w in sorted(workers.items())]) if workers else ["  none"]
    gone = {g.get("client") or g["name"] for s in statuses for g in s.get("gone_workers") or ()
            } - set(workers)
    if gone:
        lines.append(f"  and {len(gone)} disconnected (each controller's list is below)")
    return lines


def _mbit(bytes_per_s: float) -> str:
    return f"{bytes_per_s * 8 / 1e6:g}"


def _ago(age: float | None) -> str:
    return "never" if age is None else f"{age:.1f} s ago"


def _cell(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    rows = [header, *rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return ["  " + "  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip()
            for r in rows]


def _without_controller(s: dict[str, Any]) -> list[str]:
    """The workers that trained (or may train) without this controller, as
    far as it can know (issue 33): those that came back say what they sent
    straight to the server; of those that disconnected it knows only when.
    Nothing when there are none."""
    lines = []
    back = [w for w in s["workers"] if w.get("fell_back_seconds")]
    if back:
        lines.append("workers that went on without this controller (it did not answer "
                     "them) and came back:")
        lines += _table(
            ("name", "host", "updates sent straight to the server", "time without it"),
            [(w["name"], w["host"] or "-", str(w["fell_back_updates"]),
              f"{w['fell_back_seconds']:.1f} s") for w in back])
    gone = s.get("gone_workers") or []
    if gone:
        lines.append("disconnected workers (finished, died, or lost this controller: with "
                     "controller_fallback 'fifo' those send straight to the server until "
                     "they reconnect):")
        lines += _table(("name", "host", "requests", "disconnected"),
                        [(g["name"], g["host"] or "-", str(g["requests"]),
                          _ago(g["gone_age_s"])) for g in gone])
    return lines


def format_status(s: dict[str, Any], address: str) -> str:
    lines = [
        f"job {s.get('job')!r} on controller {address}   policy {s.get('policy')}   "
        f"tau_max {s.get('tau_max')}",
        f"server version {s['server_version']}   transfers pending {s['pending']}, active "
        f"{s['active']}   connections {s.get('connections')}"
        + (f"   servers reporting landings {s['landing_feeds']}" if s.get("landing_feeds")
           else ""),
    ]
    ctl = s.get("controllers")
    if ctl:
        lines.append(f"several controllers (etcd {ctl['etcd']}, lease {ctl['lease_ttl_s']} s): "
                     f"this one plans shards {ctl['plans']} of {len(ctl['owners'])}; the "
                     f"status below is this one's")
        lines += _table(("shard", "planned by"),
                        [(str(k), owner or "nobody yet (being taken over)")
                         for k, owner in enumerate(ctl["owners"])])
    servers = s.get("servers") or []
    if servers:
        lines.append("servers (versions as their workers reported them):")
        lines += _table(
            ("host", "version", "transfers", "applied", "refused", "last heard"),
            [(v["host"], _cell(v["version"]), str(v["transfers"]), str(v["applied"]),
              str(v["refused"]), _ago(v["last_heard_age_s"])) for v in servers])
    else:
        lines.append("servers: none seen yet (no transfer requested)")
    shards = s.get("shards") or []
    if shards:
        lines.append(f"shards: {len(shards)}, each with its own version:")
        lines += _table(("shard", "host", "version"),
                        [(str(x["shard"]), _cell(x.get("host")), _cell(x["version"]))
                         for x in shards])
    replicas = s.get("replicas") or []
    if replicas:
        # Whatever a replica reports, one column per key, in the order first seen.
        keys = list(dict.fromkeys(k for r in replicas for k in r))
        lines.append("replicas:")
        lines += _table(tuple(keys), [tuple(_cell(r.get(k)) for k in keys) for r in replicas])
    else:
        lines.append("replicas: none reported (workers replicate with replica=HOST:PORT; "
                     "the controller tracks replicas with --div-max)")
    agents = s.get("agents") or []
    if agents:
        lines.append("agents:")
        lines += _table(
            ("host", "address", "reachable", "last report", "peers", "fresh", "error"),
            [(a["host"], a["address"], _cell(a["reachable"]), _ago(a["last_report_age_s"]),
              str(a["peers"]), str(a["fresh"]), _cell(a["error"])) for a in agents])
    else:
        lines.append("agents: none (start the controller with --agent HOST=ADDR:PORT or "
                     "--agents-dns NAME:PORT)")
    d = s["delay"]
    if d.get("count"):
        lines.append(f"delay of applied updates: count {d['count']}  mean {d['mean']:.2f}  "
                     f"std {d['std']:.2f}  max {d['max']}")
    else:
        lines.append("delay of applied updates: none reported yet")
    lines.append("workers:")
    lines += _table(
        ("name", "host", "requests", "sent", "dropped", "applied", "refused", "last delay"),
        [(w["name"], w["host"] or "-", str(w["requests"]), str(w["sent"]), str(w["dropped"]),
          str(w["applied"]), str(w["refused"]), _cell(w["last_delay"]))
         for w in s["workers"]])
    lines += _without_controller(s)
    lines.append("bandwidth picture (Mbit/s, up / down):")
    for host, bw in sorted(s["bandwidth"].items()):
        lines.append(f"  {host}  {_mbit(bw['up_bytes_per_s'])} / {_mbit(bw['down_bytes_per_s'])}")
    lines.append(f"  any other host  {_mbit(s['default_bytes_per_s'])} / "
                 f"{_mbit(s['default_bytes_per_s'])}")
    paths = s.get("measured_paths") or {}
    lines.append("measured by agents (Mbit/s available):" if paths else
                 "measured by agents: none (no --agent or --agents-dns, or no fresh estimate yet)")
    for path, rate in paths.items():
        lines.append(f"  {path}  {_mbit(rate)}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    timeout = check_positive("--timeout", args.timeout)
    if args.watch is not None:
        if args.json:
            raise ConfigError("--watch shows the status as a table: give --json without it to "
                              "print the raw status once")
        check_positive("--watch", args.watch)
    token = auth.load_token(args.token_file)
    from_args(args)  # the link to the controller is TLS with --tls-*
    addresses = [a.strip() for a in args.controller.split(",") if a.strip()]
    if len(set(addresses)) != len(addresses) or not addresses:
        raise ConfigError(f"--controller {args.controller!r}: give HOST:PORT, or the job's "
                          f"controllers separated by commas, each once")
    if args.watch is not None:
        return watch(lambda: status_text(addresses, args.job, token, timeout), args.watch)
    if len(addresses) == 1:
        status = fetch_status(addresses[0], args.job, token, timeout)
        print(json.dumps(status, indent=2) if args.json else format_status(status, addresses[0]))
        return 0
    statuses = fetch_statuses(addresses, args.job, token, timeout)
    errors = [s for s in statuses.values() if isinstance(s, MlfabricError)]
    if len(errors) == len(statuses):
        raise errors[0]  # none answered: the first one's reason, as with one controller
    if args.json:
        print(json.dumps({"controllers": {a: s if isinstance(s, dict) else {"error": str(s)}
                                          for a, s in statuses.items()}}, indent=2))
    else:
        print(format_statuses(statuses))
    return 0


def status_text(addresses: Sequence[str], job: str, token: bytes, timeout: float) -> str:
    """The status as `mlfabric status` prints it: of the one controller, or of
    each; an error if none answers."""
    if len(addresses) == 1:
        return format_status(fetch_status(addresses[0], job, token, timeout), addresses[0])
    statuses = fetch_statuses(addresses, job, token, timeout)
    errors = [s for s in statuses.values() if isinstance(s, MlfabricError)]
    if len(errors) == len(statuses):
        raise errors[0]
    return format_statuses(statuses)


def watch(text: Callable[[], str], interval: float) -> int:
    """`mlfabric status --watch`: `text()` redrawn in place every `interval`
    seconds until Ctrl-C, which ends it with status 0; into a pipe or a file,
    each view printed after the last, as `top -b` does. The first fetch fails
    as `mlfabric status` does (a wrong address or token is not worth
    watching); later a controller that stops answering is shown as such, and
    asked again at the next refresh."""
    try:
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text
    except ImportError:
        raise ConfigError("--watch draws with rich: pip install 'mlfabric[watch]' (or run "
                          "mlfabric status without --watch)") from None
    console = Console()

    def view(body: str) -> Text:
        head = (f"every {interval:g} s, press Ctrl-C to stop; updated "
                f"{time.strftime('%H:%M:%S')}\n\n")
        return Text(head + body, no_wrap=True)  # a wide table is cropped, as top does

    def bodies() -> Iterator[str]:
        yield text()
        while True:
            time.sleep(interval)  # the refresh period, not a wait for an event
            try:
                yield text()
            except MlfabricError as exc:
                yield f"no answer: {exc}\n(asking again in {interval:g} s)"

    views = bodies()
    first = next(views)  # raises as mlfabric status does
    try:
        if not console.is_terminal:
            for body in itertools.chain([first], views):
                print(view(body).plain, end="\n\n", flush=True)
        else:
            with Live(view(first), console=console, auto_refresh=False,
                      vertical_overflow="visible") as live:
                for body in views:
                    live.update(view(body), refresh=True)
    except KeyboardInterrupt:
        pass
    return 0
