"""`mlfabric report DECISION_LOG -o schedule.png`: a picture of what the controller did.

The controller's decision log (`mlfabric controller --decision-log`) has a
line per decision. This reads it into a `Schedule` (pure: lines in,
transfers out) and draws, per link into a server (or shard):

- each transfer as a bar from its go to its done, coloured by outcome
  (sent and applied, sent through an aggregator, refused by the server as
  stale), a dropped one as a cross at its drop;
- its deadline: a tick where the server's version passed the transfer's
  staleness bound (the first `done` at or past its `deadline_version`);
- beneath, the bandwidth estimates the controller planned with, per path.

Transfers that overlap on a link are drawn on lanes of their own, so each
bar shows. Drawing needs matplotlib (`pip install 'mlfabric[report]'`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError

OUTCOMES = ("applied", "aggregated", "refused", "dropped", "unfinished")
COLOURS = {"applied": "tab:blue", "aggregated": "tab:purple", "refused": "tab:orange",
           "dropped": "tab:red", "unfinished": "tab:gray"}


@dataclass
class Transfer:
    """One transfer as the log tells it (times on the controller's clock)."""

    id: int
    host: str
    dst: str
    nbytes: int
    base_version: int
    go: float | None = None  # when it was let go (None: dropped)
    planned_seconds: float | None = None
    done: float | None = None  # when its worker reported the server's answer
    applied: bool | None = None
    dropped: float | None = None  # when it was dropped
    reason: str | None = None  # why it was dropped
    via: str | None = None  # the aggregator it went through
    codec: str | None = None
    deadline_version: int | None = None
    deadline: float | None = None  # when the server's version passed the bound

    @property
    def outcome(self) -> str:
        if self.dropped is not None:
            return "dropped"
        if self.done is None:
            return "unfinished"
        if not self.applied:
            return "refused"
        return "aggregated" if self.via is not None else "applied"


@dataclass
class Schedule:
    transfers: dict[int, Transfer] = field(default_factory=dict)
    # (src host, dst host) -> [(at, bytes per second)], as the plans used them
    estimates: dict[tuple[str, str], list[tuple[float, float]]] = field(default_factory=dict)
    start: float = 0.0  # the first event's time: the picture's 0
    skipped: int = 0  # lines that were not decisions (or not JSON)

    def links(self) -> list[str]:
        return sorted({t.dst for t in self.transfers.values()})

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(OUTCOMES, 0)
        for t in self.transfers.values():
            out[t.outcome] += 1
        return out


def read_schedule(lines: Iterable[str]) -> Schedule:
    """The schedule a decision log's lines describe. A line that is not a
    JSON object with an event is counted in `skipped`, not fatal: a log cut
    off by a crash is still worth reading."""
    s = Schedule()
    first: float | None = None
    applied_at: list[tuple[int, float]] = []  # (server version, when) from done lines
    for line in lines:
        try:
            e = json.loads(line)
            kind = e["event"]
            at = float(e["at"])
        except (ValueError, KeyError, TypeError):
            s.skipped += 1
            continue
        first = at if first is None else min(first, at)
        if kind in ("go", "drop"):
            t = s.transfers.get(e["id"])
            if t is None:
                t = s.transfers[e["id"]] = Transfer(
                    id=e["id"], host=e["host"], dst=e.get("dst", "server"),
                    nbytes=e.get("nbytes", 0), base_version=e.get("base_version", 0),
                    deadline_version=e.get("deadline_version"))
            if kind == "go":
                t.go = at if t.go is None else t.go  # a chunked one: its first grant
                t.planned_seconds = e.get("planned_seconds")
                t.via = e.get("via", t.via)
                t.codec = e.get("codec", t.codec)
            else:
                t.dropped, t.reason = at, e.get("reason")
        elif kind == "done":
            t = s.transfers.get(e["id"])
            if t is not None:
                t.done, t.applied = at, bool(e.get("applied"))
            if e.get("applied") and e.get("version") is not None:
                applied_at.append((int(e["version"]), at))
        elif kind == "estimates":
            for dst, rate in (e.get("used") or {}).items():
                s.estimates.setdefault((e["host"], dst), []).append((at, float(rate)))
        else:
            continue
    s.start = first or 0.0
    # When the server reached each version (the first done reporting it or later).
    applied_at.sort(key=lambda va: va[1])
    for t in s.transfers.values():
        if t.deadline_version is not None:
            t.deadline = next((at for version, at in applied_at
                               if version >= t.deadline_version), None)
    return s


def lanes(intervals: list[tuple[float, float]]) -> list[int]:
    """A lane for each interval (start, end), in their order, so that no two
    intervals on one lane overlap: the first lane free at its start (greedy
    by start, which uses the fewest lanes)."""
    order = sorted(range(len(intervals)), key=lambda i: intervals[i])
    free_at: list[float] = []  # each lane's end so far
    out = [0] * len(intervals)
    for i in order:
        start, end = intervals[i]
        lane = next((k for k, busy in enumerate(free_at) if busy <= start), len(free_at))
        if lane == len(free_at):
            free_at.append(end)
        else:
            free_at[lane] = end
        out[i] = lane
    return out


# -- drawing ----------------------------------------------------------------------------


def window(s: Schedule, since: float | None, until: float | None) -> Schedule:
    """`s` with only the transfers that were on the wire (or dropped)
    between `since` and `until`, seconds from its start (None: no bound)."""
    lo = s.start + (since if since is not None else float("-inf"))
    hi = s.start + (until if until is not None else float("inf"))

    def inside(t: Transfer) -> bool:
        first = t.go if t.go is not None else t.dropped
        last = _end(t)
        return first is not None and first <= hi and (last if last is not None else first) >= lo

    kept = {i: t for i, t in s.transfers.items() if inside(t)}
    return Schedule(kept, s.estimates, s.start, s.skipped)


def draw(s: Schedule, path: str | Path, title: str = "",
         span: tuple[float | None, float | None] = (None, None)) -> None:
    """The picture of `s` to `path` (PNG, SVG or PDF, by its suffix), over
    `span` (seconds from its start; None: all)."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("mlfabric report draws with matplotlib: pip install "
                          "'mlfabric[report]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    links = s.links()
    heights = [max(1, len(links))] + ([1] if s.estimates else [])
    fig, axes = plt.subplots(len(heights), 1, figsize=(12, 2.2 + 1.2 * sum(heights)),
                             sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    ax = axes[0][0]
    labels, ticks = [], []
    for row, link in enumerate(links):
        ts = [t for t in s.transfers.values() if t.dst == link]
        spans = [(_x(s, t.go if t.go is not None else t.dropped), _x(s, _end(t))) for t in ts]
        lane = lanes(spans)
        depth = max(lane, default=0) + 1
        for t, (x0, x1), k in zip(ts, spans, lane, strict=True):
            y = row + (k + 0.5) / depth * 0.8 - 0.4
            if t.outcome == "dropped":
                ax.plot([x0], [y], marker="x", color=COLOURS["dropped"], ms=4, lw=0)
                continue
            ax.plot([x0, x1], [y, y], color=COLOURS[t.outcome], lw=max(1.0, 6 / depth),
                    solid_capstyle="butt")
            if t.deadline is not None:
                ax.plot([_x(s, t.deadline)], [y], marker="|", color="black", ms=6, lw=0)
        labels.append(link)
        ticks.append(row)
    ax.set_yticks(ticks, labels)
    ax.set_ylim(-0.6, max(len(links), 1) - 0.4)
    ax.set_ylabel("link into")
    counts = s.counts()
    ax.legend(handles=[Patch(color=COLOURS[o], label=f"{o} ({counts[o]})") for o in OUTCOMES
                       if counts[o]]
              + [Line2D([], [], color="black", marker="|", lw=0, label="deadline passed")],
              loc="upper right", fontsize="small")
    ax.set_title(title or "transfers per link, as the controller let them go")
    ax.grid(alpha=0.3, axis="x")
    if s.estimates:
        est = axes[1][0]
        for (src, dst), points in sorted(s.estimates.items()):
            xs = [_x(s, at) for at, _ in points]
            est.step(xs, [rate * 8 / 1e6 for _, rate in points], where="post",
                     label=f"{src} to {dst}", lw=1)
        est.set_ylabel("estimate (Mbit/s)")
        est.grid(alpha=0.3)
        if len(s.estimates) <= 12:
            est.legend(fontsize="x-small", ncol=2)
    axes[-1][0].set_xlabel("seconds since the log's first event")
    if span != (None, None):
        axes[-1][0].set_xlim(left=span[0], right=span[1])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _x(s: Schedule, at: float | None) -> float:
    return (at if at is not None else s.start) - s.start


def _end(t: Transfer) -> float | None:
    if t.done is not None:
        return t.done
    if t.go is not None and t.planned_seconds is not None:
        return t.go + t.planned_seconds  # not reported: as planned
    return t.go if t.go is not None else t.dropped


# -- the command ------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("decision_log", metavar="DECISION_LOG",
                   help="a controller's decision log (mlfabric controller --decision-log)")
    p.add_argument("-o", "--output", default="schedule.png", metavar="PATH",
                   help="the picture to write: .png, .svg or .pdf (default: schedule.png)")
    p.add_argument("--title", default="", help="the picture's title")
    p.add_argument("--since", type=float, default=None, metavar="SECONDS",
                   help="draw from this many seconds after the log's first event")
    p.add_argument("--until", type=float, default=None, metavar="SECONDS",
                   help="draw up to this many seconds after the log's first event")


def run(args: argparse.Namespace) -> int:
    path = Path(args.decision_log)
    try:
        with path.open() as f:
            schedule = read_schedule(f)
    except OSError as exc:
        raise ConfigError(f"cannot read the decision log {str(path)!r}: {exc.strerror}; give "
                          f"the file `mlfabric controller --decision-log` writes") from None
    if not schedule.transfers:
        raise ConfigError(f"{str(path)!r} has no transfer decisions ({schedule.skipped} "
                          f"lines that are not): give the file `mlfabric controller "
                          f"--decision-log` writes")
    if Path(args.output).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise ConfigError(f"-o {args.output!r}: give a .png, .svg or .pdf file")
    if args.since is not None and args.until is not None and args.since >= args.until:
        raise ConfigError(f"--since {args.since:g} is not before --until {args.until:g}")
    schedule = window(schedule, args.since, args.until)
    if not schedule.transfers:
        raise ConfigError(f"no transfer between --since {args.since} and --until "
                          f"{args.until} (seconds from the log's first event)")
    draw(schedule, args.output, args.title, (args.since, args.until))
    counts = schedule.counts()
    print(f"{args.output}: {len(schedule.transfers)} transfers on {len(schedule.links())} "
          f"link(s) ({', '.join(f'{n} {o}' for o, n in counts.items() if n)})"
          + (f"; {schedule.skipped} lines skipped" if schedule.skipped else ""))
    return 0
