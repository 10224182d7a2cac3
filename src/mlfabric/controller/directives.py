"""Carrying out a decision's actions: each one counted, logged and sent.

The controller carries out each action as its decision takes it
(`ControlState.decide`'s on_action). The simulator, with decisions charged
their measured time (`sim.engine`), carries each out through this same code,
with the wire's encoder in place of the socket: what a decision costs there
includes telling the workers, which at 10,000 workers is up to 125 goes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from ..runtime.metrics import ControllerMetrics
from ..wire.protocol import Directive
from .state import Drop, Go

decision_log = logging.getLogger("mlfabric.decisions")


class DecisionFile(logging.FileHandler):
    """The file of --decision-log: one JSON line per record, flushed as it
    is written (write-ahead: a record is on disk before its directive goes
    out). `log_decision` writes each line straight to it (`write_line`):
    a LogRecord, the caller's frame and the formatter took about half of
    carrying out a go. Other records reach it as any handler's."""

    def __init__(self, path: str) -> None:
        super().__init__(path, mode="a", encoding="utf-8")
        self.setFormatter(logging.Formatter("%(message)s"))

    def write_line(self, line: str) -> None:
        assert self.lock is not None
        with self.lock:
            if self.stream is None:  # closed (at exit): opened again, as emit() does
                self.stream = self._open()
            self.stream.write(line + "\n")
            self.stream.flush()


def log_decision(record: dict[str, Any]) -> None:
    """One JSON line in the decision log, if it goes anywhere: unread (no
    --decision-log), the record is not serialised. Logged to nothing, a
    go's line still cost 8.5 us, and to stderr 15.6 us; a decision at
    10,000 workers lets up to 125 go."""
    own = decision_log.handlers
    if not decision_log.propagate and len(own) == 1 and isinstance(own[0], DecisionFile):
        own[0].write_line(json.dumps(record))  # the controller command's --decision-log
    elif decision_log.isEnabledFor(logging.INFO) and decision_log.hasHandlers():
        decision_log.info(json.dumps(record))  # (a test's capture, an embedding program's)


def carry_out(action: Go | Drop, now: float, *, metrics: ControllerMetrics,
              tau_max: int | None, version: int, send: Callable[[Directive], Any],
              log: Callable[[dict[str, Any]], None] = log_decision) -> None:
    """Count, log and send one action of the decision made at `now`, with
    the server at `version`: the directive goes to `send`, the decision
    log's record to `log`."""
    m = metrics
    t = action.transfer
    wait = now - t.arrival
    # Count and log first, then tell the worker: whoever sees the
    # directive's effect also sees it counted, and a controller killed
    # in between has logged a decision that did not go out rather than
    # sent one that its log lacks (a CI run killed one between the two:
    # a part went and no log held its decision).
    if isinstance(action, Go) and not action.first:
        # The next chunk of a transfer let go before.
        m.chunks.inc()
        log({
            "event": "chunk", "at": round(now, 6), "id": t.id, "host": t.host,
            "upto": action.upto, "nbytes": t.nbytes, "position": action.position,
            "planned_seconds": round(action.planned_seconds, 6)})
        send(Directive(req=t.req, action="go", position=action.position,
                       planned_seconds=action.planned_seconds, upto=action.upto))
        return
    m.queue_wait.observe(wait)
    if isinstance(action, Go):
        m.directives.labels("go").inc()
        m.planned_seconds.observe(action.planned_seconds)
        route = action.route
        directive = Directive(
            req=t.req, action="go", position=action.position,
            planned_seconds=action.planned_seconds,
            via=route.address if route else None, group=route.group if route else None,
            fan_in=route.fan_in if route else None,
            index=route.index if route else None, upto=action.upto,
            codec=action.codec, pace=action.pace, pace_seconds=action.pace_seconds,
            # (straight to the server only: its push names the transfer)
            ticket=None if route else t.id, after=action.after,
            after_seconds=action.after_seconds)
        record = {"event": "go", "at": round(now, 6), "position": action.position,
                  "planned_seconds": round(action.planned_seconds, 6)}
        if action.upto is not None:
            record["upto"] = action.upto
        if action.after is not None:  # (RunningOrder.must_follow)
            m.ordered_transfers.inc()
            record["after"] = list(action.after)
            record["after_seconds"] = round(action.after_seconds or 0.0, 6)
        if action.pace is not None:  # beside a critical transfer (observed.pace)
            m.paced_transfers.inc()
            record["pace"] = round(action.pace)
            if action.pace_seconds is not None:
                record["pace_seconds"] = round(action.pace_seconds, 6)
        if t.options:  # what it could have been sent as, and what was chosen
            record["codec"] = action.codec or "whole"
            m.compressed_transfers.labels(
                (action.codec or "none").partition(":")[0]).inc()
        if route is not None:
            m.aggregation_members.inc()
            record.update(via=route.host, group=route.group, index=route.index)
    else:
        assert isinstance(action, Drop)
        m.directives.labels("drop").inc()
        m.drops.labels(action.reason).inc()
        directive = Directive(req=t.req, action="drop",
                              reason=f"{action.reason}: {action.detail}".rstrip(": "))
        record = {"event": "drop", "at": round(now, 6), "reason": action.reason,
                  "detail": action.detail}
    # dst: the link it goes into; deadline_version: the server version
    # past which it is stale (`mlfabric report` marks when it came).
    deadline = ({} if tau_max is None
                else {"deadline_version": t.base_version + tau_max})
    log({
        **record, "id": t.id, "host": t.host, "dst": t.dst, "nbytes": t.nbytes,
        "base_version": t.base_version, "server_version": version,
        **deadline, "queue_wait": round(wait, 6)})
    send(directive)
