"""Several controllers for one job (issue 34): who plans which shard, held in
a real etcd under leases; a controller killed outright loses its shards to
the next one within 2 s, and every pending transfer resolves."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
from test_sharded import SIZES, addresses, shard_servers

import mlfabric
from mlfabric.controller.status_cli import (
    fetch_status,
    fetch_statuses,
    format_status,
    format_statuses,
)
from mlfabric.coordination import ownership
from mlfabric.coordination.etcd import (
    EtcdClient,
    EtcdError,
    KeyValue,
    parse_endpoints,
    prefix_end,
)
from mlfabric.coordination.leases import ShardLeases
from mlfabric.errors import ConfigError
from mlfabric.runtime.metrics import ClientMetrics
from mlfabric.server.store import ParameterStore
from mlfabric.tools import tls_cli
from mlfabric.transport import tls

from support import (
    JOB,
    TOKEN,
    EtcdServer,
    RawClient,
    ServerThread,
    free_port,
    make_model,
    sample,
    secret_file,
    wait_until,
)
from test_cli import mlfabric_cmd

# --- the rules, without etcd ------------------------------------------------------------

A, B, C = "10.0.0.1:7071", "10.0.0.2:7071", "10.0.0.3:7071"


@pytest.mark.parametrize("me, owned, live, settled, want", [
    # At start each claims its home shards (s mod 3) only, whoever else is up.
    (A, set(), {A}, False, [0, 3]),
    (B, set(), {B}, False, [1, 4]),
    # Settled, alone: every free shard, in order.
    (A, set(), {A}, True, [0, 1, 2, 3, 4]),
    # B gone: its shards go to the next after it (C), not to A.
    (C, {0, 2, 3}, {A, C}, True, [1, 4]),
    (A, {0, 2, 3}, {A, C}, True, []),
    # B and C gone: A, the next live one round the list.
    (A, {0, 3}, {A}, True, [1, 2, 4]),
    # Not settled yet: an orphan is left for a moment (its home may be starting).
    (C, {0, 2, 3}, {A, C}, False, []),
    # Held shards are never claimed, whoever's home they are.
    (A, {0, 1, 2, 3, 4}, {A}, True, []),
])
def test_claims_follow_each_shards_order_of_succession(me, owned, live, settled, want):
    assert ownership.claims(shards=5, controllers=[A, B, C], me=me, owned=owned, live=live,
                            settled=settled) == want


def test_the_keys_read_back_ignore_what_is_not_ours():
    p = ownership.prefix(JOB)
    kvs = [KeyValue(ownership.member_key(JOB, A), A, 7),
           KeyValue(ownership.shard_key(JOB, 1), A, 7),
           KeyValue(ownership.shard_key(JOB, 2), B, 9),
           KeyValue(f"{p}shards/9", A, 7),  # past the job's shards
           KeyValue(f"{p}shards/x", A, 7),
           KeyValue(f"{p}other", "?", 0)]
    live, owners = ownership.read(JOB, kvs, shards=4)
    assert live == {A}
    assert owners == {1: (A, 7), 2: (B, 9)}
    assert ownership.owned_by(owners, A, 7) == {1}
    assert ownership.owned_by(owners, A, 8) == frozenset()  # an earlier lease's key


def test_prefix_end_and_endpoints():
    assert prefix_end("/a/b/") == "/a/b0"
    assert parse_endpoints("http://10.0.0.2:2379,10.0.0.3") == (
        [("10.0.0.2", 2379), ("10.0.0.3", 2379)], False)
    assert parse_endpoints("https://10.0.0.2:2379") == ([("10.0.0.2", 2379)], True)
    with pytest.raises(ConfigError, match="mix http:// and https://"):
        parse_endpoints("https://10.0.0.2:2379,http://10.0.0.3:2379")
    with pytest.raises(ConfigError, match="expected http://HOST:PORT or https://HOST:PORT"):
        parse_endpoints("etcd://10.0.0.2:2379")


def test_a_controller_list_without_this_controller_is_named():
    with pytest.raises(ConfigError, match=r"'10.0.0.9:7071' is not in --controllers"):
        ShardLeases(EtcdClient([("127.0.0.1", 1)]), job=JOB, me="10.0.0.9:7071",
                    controllers=[A, B], shards=2)


# --- leases in a real etcd ------------------------------------------------------------


@pytest.fixture
def etcd(tmp_path):
    server = EtcdServer(tmp_path)
    yield server
    server.close()


def _leases(etcd: EtcdServer, me: str, *, shards: int = 4, changes: list | None = None,
            ) -> ShardLeases:
    def changed(owned, owners):
        if changes is not None:
            changes.append((time.monotonic(), owned))

    return ShardLeases(EtcdClient(parse_endpoints(etcd.url)[0]), job=JOB, me=me,
                       controllers=[A, B], shards=shards, ttl=1, on_change=changed)


async def _until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.01)


def test_two_controllers_split_the_shards_and_a_clean_stop_hands_them_over(etcd, run_async):
    async def body():
        a, b = _leases(etcd, A), _leases(etcd, B)
        for leases in (a, b):
            await leases.tick()
            leases.start()
        # Each takes its home shards at once, and nothing else while the other is live.
        await _until(lambda: a.owned == {0, 2} and b.owned == {1, 3}, 5, "the split")
        # ... and each reads who holds the others (to send their workers there).
        await _until(lambda: a.owners == b.owners == {0: A, 1: B, 2: A, 3: B}, 5,
                     "both to read the owners")
        await a.close()  # revokes its lease: its shards are free at once
        stopped = time.monotonic()
        await _until(lambda: b.owned == {0, 1, 2, 3}, 5, "B to take A's shards")
        assert time.monotonic() - stopped < 1.0  # not a lease's expiry: the revoke
        await b.close()

    run_async(body())


def test_a_controller_cut_off_from_etcd_stops_planning_before_its_lease_can_lapse(
        etcd, run_async):
    """etcd stops answering (SIGSTOP): the controller gives its shards up
    within its lease's TTL of the last renewal it sent, so another
    controller, which can claim them only once the lease expired in etcd,
    never plans them at the same time. It claims them again once etcd is
    back."""
    changes: list = []

    async def body():
        a = _leases(etcd, A, shards=1, changes=changes)
        await a.tick()
        a.start()
        assert a.owned == {0}
        os.kill(etcd.proc.pid, signal.SIGSTOP)
        cut = time.monotonic()
        try:
            await _until(lambda: not a.owned, 3, "A to give shard 0 up")
            assert time.monotonic() - cut < 1.0  # the TTL, counted from before the cut
        finally:
            os.kill(etcd.proc.pid, signal.SIGCONT)
        await _until(lambda: a.owned == {0}, 10, "A to claim shard 0 again")
        await a.close()

    run_async(body(), timeout=30)
    assert [sorted(owned) for _, owned in changes] == [[0], [], [0]]


# --- controllers killed outright ------------------------------------------------------


class Controller:
    """`mlfabric controller --etcd` in a process of its own."""

    def __init__(self, tmp_path, me: str, controllers: list[str], etcd: EtcdServer,
                 shards: int, *more: str) -> None:
        self.address = me
        self.log = tmp_path / f"decisions-{me.replace(':', '-')}.jsonl"
        if self.log.exists():  # the same controller again: its own log
            self.log.rename(self.log.with_suffix(f".{time.monotonic_ns()}"))
        self.proc = subprocess.Popen(
            mlfabric_cmd("controller", "--listen", me, "--job", JOB, "--token-file",
                         str(secret_file("job.token", TOKEN.decode())),
                         "--etcd", etcd.url, "--controllers", ",".join(controllers),
                         "--shards", str(shards), "--lease-ttl", "1",
                         "--decision-log", str(self.log), *more),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stdout]
                         + [self.lines.put(None)], daemon=True).start()
        line = self.lines.get(timeout=30)
        assert line and "serving job" in line, self.proc.stderr.read() if line is None else line
        self.line = line

    def events(self, kind: str) -> list[dict]:
        if not self.log.exists():
            return []
        return [e for e in map(json.loads, self.log.read_text().splitlines())
                if e["event"] == kind]

    def gos(self) -> int:
        return len(self.events("go"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for f in (self.proc.stdout, self.proc.stderr):
            f.close()


def _owner(etcd: EtcdServer, shard: int) -> str:
    async def read():
        client = EtcdClient(parse_endpoints(etcd.url)[0])
        try:
            _, owners = ownership.read(JOB, await client.range(ownership.prefix(JOB)), 16)
        finally:
            await client.close()
        return owners.get(shard, ("", 0))[0]

    return asyncio.run(read())


def test_a_killed_controllers_shards_move_within_2_s_and_every_pending_transfer_resolves(
        tmp_path, etcd):
    """Two controllers plan two shards, one each. Workers (fallback "wait":
    nothing goes unscheduled) push; the controller of shard 0 is killed
    with SIGKILL while their next updates wait for it. The other holds
    shard 0 within 2 s, the workers' links find it, and every update is
    applied on both shards, decided by a controller."""
    model = make_model(sizes=SIZES)
    names = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    with contextlib.ExitStack() as stack:
        servers = stack.enter_context(shard_servers(model, 2))
        first = Controller(tmp_path, names[0], names, etcd, shards=2)
        stack.callback(first.stop)
        second = Controller(tmp_path, names[1], names, etcd, shards=2)
        stack.callback(second.stop)
        assert "planning shards [0] of 2" in first.line
        assert "planning shards [1] of 2" in second.line
        metrics = [ClientMetrics() for _ in range(3)]
        workers = [stack.enter_context(mlfabric.connect(
            addresses(servers), job=JOB, token=TOKEN, controller=",".join(names),
            controller_fallback="wait", controller_timeout=30, host=f"w{k}", metrics=m))
            for k, m in enumerate(metrics)]
        rng = np.random.default_rng(0)

        def update():
            return {n: (rng.standard_normal(a.shape) * 0.01).astype(a.dtype)
                    for n, a in model.items()}

        for ps in workers:
            version, _ = ps.pull(timeout=10)
            assert ps.push(update(), base_version=version).result(10).applied
        # One part per shard per push, each decided by its shard's controller.
        wait_until(lambda: first.gos() == 3 and second.gos() == 3, 10, "the decision logs")

        first.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        futures = [ps.push(update(), base_version=ps.pull(timeout=10)[0]) for ps in workers]
        wait_until(lambda: _owner(etcd, 0) == names[1], 5, "shard 0 to move")
        moved = time.monotonic() - killed
        assert moved < 2.0, f"shard 0 moved {moved:.2f} s after its controller was killed"
        outcomes = [f.result(20) for f in futures]
        assert all(o.applied for o in outcomes), outcomes
        # Every part of them was decided, all by the controller left.
        wait_until(lambda: second.gos() == 3 + 2 * len(workers), 10, "the second's decisions")
        assert first.gos() == 3
        for m in metrics:  # nothing went unscheduled
            assert sample(m.controller_fallback_updates) == 0


def test_a_controller_back_from_the_dead_sends_workers_to_the_one_that_took_over(
        tmp_path, etcd):
    """One server, two controllers: the second stands by. Killed, the first
    loses the job to it; started again, it does not take the job back (that
    would move every worker's link), and a worker that dials it first is
    sent on to the second at once (MOVED), with nothing unscheduled."""
    names = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    model = make_model()
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(ServerThread(ParameterStore(model, momentum=0.5)))
        first = Controller(tmp_path, names[0], names, etcd, shards=1)
        stack.callback(first.stop)
        second = Controller(tmp_path, names[1], names, etcd, shards=1)
        stack.callback(second.stop)
        assert "planning shards [0] of 1" in first.line
        assert "planning shards [] of 1" in second.line  # standing by
        first.proc.send_signal(signal.SIGKILL)
        first.stop()
        wait_until(lambda: _owner(etcd, 0) == names[1], 5, "the job to move")
        back = Controller(tmp_path, names[0], names, etcd, shards=1)
        stack.callback(back.stop)
        assert "planning shards [] of 1" in back.line
        metrics = ClientMetrics()
        with mlfabric.connect(server.address, job=JOB, token=TOKEN, controller=",".join(names),
                              controller_fallback="wait", metrics=metrics) as ps:
            version, _ = ps.pull(timeout=10)
            outcomes = [ps.push({n: np.full_like(a, 0.01) for n, a in model.items()},
                                base_version=version) for _ in range(3)]
            assert all(f.result(10).applied for f in outcomes)
        assert back.gos() == 0
        wait_until(lambda: second.gos() == 3, 10, "the second's decisions")
        # `mlfabric status` of either says who plans the job's one shard.
        status = fetch_status(names[0], JOB, TOKEN)
        assert status["controllers"]["plans"] == []
        assert status["controllers"]["owners"] == [names[1]]
        text = format_status(fetch_status(names[1], JOB, TOKEN), names[1])
        assert "this one plans shards [0] of 1" in text
        assert re.search(rf"^\s*0\s+{re.escape(names[1])}\s*$", text, re.M), text
        # Asked of every controller at once, one of them gone: who answered,
        # what each plans, and each one's own view.
        gone = f"127.0.0.1:{free_port()}"
        text = format_statuses(fetch_statuses([*names, gone], JOB, TOKEN, timeout=5))
        assert text.splitlines()[0] == f"job {JOB!r}: 3 controllers, 2 answered", text
        assert re.search(rf"^\s*{re.escape(names[0])}\s+yes\s+\[\]\s", text, re.M), text
        assert re.search(rf"^\s*{re.escape(names[1])}\s+yes\s+\[0\]\s", text, re.M), text
        assert re.search(rf"^\s*{re.escape(gone)}\s+no: .*{re.escape(gone)}", text, re.M), text
        assert text.count("on controller 127.0.0.1:") == 2
        assert sample(metrics.controller_fallback_updates) == 0
        assert sample(metrics.controller_unreachable) == 0  # a move, not an outage


def test_failover_follows_the_shards_from_controller_to_controller(tmp_path, etcd):
    """Two shards, each with a replica the workers feed; two controllers
    with --etcd, each watching the servers of the shard it plans. The
    controller of shard 0 is killed: the other takes the shard and its
    watch over, and when shard 0's server then dies, it promotes the
    replica and the workers fail over. That controller is killed in turn,
    and the first, started again, takes both shards: it finds shard 0's
    replica already serving and watches it as the server (no second
    promotion). Every acknowledged part is applied once, and each shard's
    final model is the numpy replay of its parts, bit for bit."""
    from test_sharded import assert_each_shard_replays, replicated_shards, store_state

    from support import random_update

    gamma = 0.5
    model = make_model(sizes=SIZES)
    servers, endpoints, replicas, _, _ = replicated_shards(model, gamma)
    names = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    acked: list[dict[int, dict[str, np.ndarray]]] = [{}, {}]
    with contextlib.ExitStack() as stack:
        for st in (servers[1], *replicas):
            stack.enter_context(st)
        servers[0].__enter__()
        lost: list[bool] = []  # shard 0's server was stopped (and must not be again)
        stack.callback(lambda: lost or servers[0].__exit__(None, None, None))
        watch = ("--server", ",".join(s.address for s in servers),
                 "--replica", ",".join(r.address for r in replicas),
                 "--heartbeat-interval", "0.05", "--heartbeat-timeout", "0.5",
                 # a bound that holds nothing here: each shard's gate is live
                 "--div-max", "100", "--momentum", str(gamma))

        def controller(k: int) -> Controller:
            c = Controller(tmp_path, names[k], names, etcd, 2, *watch)
            stack.callback(c.stop)
            return c

        first, second = controller(0), controller(1)
        assert "planning shards [0] of 2" in first.line
        workers = [stack.enter_context(mlfabric.connect(
            addresses(servers), job=JOB, token=TOKEN, controller=",".join(names),
            controller_fallback="wait", controller_timeout=30, host=f"w{k}",
            replica=",".join(r.address for r in replicas), failover_timeout=20))
            for k in range(3)]
        seed = iter(range(1000))

        def round_of_pushes() -> None:
            futures = []
            for ps in workers:
                u = random_update(model, seed=next(seed))
                futures.append((u, ps.push(u, base_version=ps.pull(timeout=10)[0])))
            for u, f in futures:
                outcome = f.result(30)
                assert outcome.applied, outcome
                for shard, part in enumerate(outcome.shards):
                    assert part.version not in acked[shard], outcome
                    acked[shard][part.version] = u

        round_of_pushes()
        first.proc.send_signal(signal.SIGKILL)
        wait_until(lambda: _owner(etcd, 0) == names[1], 5, "shard 0 to move")
        round_of_pushes()
        # Shard 0's server dies: the controller that took the shard over
        # promotes its replica.
        lost.append(True)
        servers[0].__exit__(None, None, None)
        round_of_pushes()
        wait_until(lambda: second.events("failover"), 10, "the failover's record")
        assert [e["shard"] for e in second.events("failover")] == [0]
        assert endpoints[0].serving and not endpoints[1].serving

        second.proc.send_signal(signal.SIGKILL)
        back = controller(0)
        wait_until(lambda: _owner(etcd, 1) == names[0] and _owner(etcd, 0) == names[0], 5,
                   "both shards to the controller started again")
        wait_until(lambda: back.events("adopted"), 10, "the promoted replica's adoption")
        assert [(e["shard"], e["server"]) for e in back.events("adopted")] == [
            (0, replicas[0].address)]
        round_of_pushes()
        assert back.events("failover") == []  # nothing promoted twice
        # Shard 1, taken over with its replica, is bounded again (its share
        # of --div-max), from the replica's heartbeats.
        wait_until(lambda: any(r.get("shard") == 1 and "div_max" in r for r in fetch_status(
            names[0], JOB, TOKEN)["replicas"]), 10, "shard 1's replica in the status")
        (row,) = [r for r in fetch_status(names[0], JOB, TOKEN)["replicas"]
                  if r.get("shard") == 1]
        assert row["div_max"] == pytest.approx(100 / 2 ** 0.5)
        assert row["address"] == replicas[1].address
        assert not endpoints[1].serving  # shard 1's server never went away
        final = [store_state(replicas[0]), store_state(servers[1])]
    assert_each_shard_replays(model, gamma, acked, final, 4 * len(workers))


@pytest.fixture(scope="module")
def etcd_certs(tmp_path_factory):
    """A CA with certificates for etcd and a controller; and another CA's."""
    ours = tmp_path_factory.mktemp("etcd-certs")
    tls_cli.init(ours, ["etcd,127.0.0.1", "controller"])
    theirs = tmp_path_factory.mktemp("other-certs")
    tls_cli.init(theirs, ["controller"])
    return ours, theirs


def test_an_etcd_over_tls_serves_only_controllers_with_a_certificate_its_ca_signed(
        tmp_path, etcd_certs, run_async):
    ours, theirs = etcd_certs
    server = EtcdServer(tmp_path, certs=ours)
    endpoints, secure = parse_endpoints(server.url)
    assert secure

    def context(folder):
        return tls.client_context(tls.files(folder / "controller.pem",
                                            folder / "controller.key", ours / "ca.pem"))

    async def body():
        leases = ShardLeases(EtcdClient(endpoints, tls=context(ours)), job=JOB, me=A,
                             controllers=[A, B], shards=2, ttl=1)
        await leases.tick()
        assert leases.owned == {0}
        await leases.close()
        for stranger in (EtcdClient(endpoints, tls=context(theirs)),  # another CA's
                         EtcdClient(endpoints)):  # plain http to etcd's https port
            with pytest.raises(EtcdError, match=r"etcd /v3/lease/grant failed: "):
                await stranger.grant(1)
            await stranger.close()

    try:
        run_async(body())
    finally:
        server.close()


def test_a_controller_reaches_an_etcd_over_tls_with_its_own_certificate(tmp_path, etcd_certs):
    """--etcd https://... with --etcd-cert, --etcd-key and --etcd-ca: it holds
    the job's one shard, and a clean stop (SIGTERM) exits 0."""
    ours, _ = etcd_certs
    server = EtcdServer(tmp_path, certs=ours)
    me = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        mlfabric_cmd("controller", "--listen", me, "--job", JOB, "--token-file",
                     str(secret_file("job.token", TOKEN.decode())), "--etcd", server.url,
                     "--controllers", me, "--etcd-cert", str(ours / "controller.pem"),
                     "--etcd-key", str(ours / "controller.key"),
                     "--etcd-ca", str(ours / "ca.pem")),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        line = proc.stdout.readline()
        assert "planning shards [0] of 1 (etcd)" in line, line + proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()
        server.close()


# --- the controller's side, without etcd ---------------------------------------------


class _Held:
    """What a controller needs of its ShardLeases, held by hand."""

    def __init__(self, owned, owners, shards=2):
        self.owned, self.owners, self.shards, self.me = frozenset(owned), owners, shards, A
        self.etcd, self.ttl = EtcdClient([("127.0.0.1", 1)]), 1  # (named by the status only)

    def owner(self, shard):
        return self.owners.get(shard, "")

    async def tick(self):
        pass

    def start(self):
        pass

    async def close(self):
        pass


def test_a_controller_sends_on_links_of_shards_it_does_not_plan_and_those_it_loses():
    """A link that says (SHARD_AT) or asks (a request) for a shard another
    controller plans gets MOVED naming it, and is closed; when this
    controller loses a shard, its links get MOVED too (no owner yet: the
    shard is being taken over), and its part of the uplinks follows."""
    from mlfabric.controller.controller import Controller
    from mlfabric.scheduling.plan import fifo_policy
    from mlfabric.wire.protocol import Moved, ShardAt, TransferRequest

    controller = Controller(fifo_policy, job=JOB, token=TOKEN, tau_max=None)
    held = _Held({0}, {0: A, 1: B})
    with ServerThread(None, endpoint=controller) as thread:
        thread.run(controller.coordinate(held))
        other = RawClient(thread.port)
        other.send(ShardAt(shard=1, dst="s1", version=0))
        assert other.recv_event() == Moved(shard=1, owner=B)
        assert other.recv_event() is None  # closed
        unsharded = RawClient(thread.port)  # a client of one server asks for shard 0 only
        unsharded.send(TransferRequest(req=1, host="h", dst="s1", nbytes=10, base_version=0,
                                       norm=1.0, shard=1))
        assert unsharded.recv_event() == Moved(shard=1, owner=B)
        mine = RawClient(thread.port)
        mine.send(ShardAt(shard=0, dst="s0", version=0))
        wait_until(lambda: thread.call(lambda: dict(controller.state.shard_hosts)) == {0: "s0"},
                   5, "shard 0's link to be heard")
        held.owned, held.owners = frozenset(), {1: B}
        thread.call(lambda: held.on_change(held.owned, held.owners))  # the lease is lost
        assert mine.recv_event() == Moved(shard=0, owner="")
        assert mine.recv_event() is None
        assert thread.call(lambda: controller.state.network.up_share) == 0.5
        assert sample(controller.metrics.links_moved) == 3
        for c in (other, unsharded, mine):
            c.close()
