"""Push throughput and latency: mlfabric vs a raw socket vs PyTorch gloo.

Everything runs on loopback in one invocation, the systems alternated within
every repeat, and medians are compared as ratios:

  large   a 64 MiB float32 update, worker -> server, received into the
          receiver's buffer: mlfabric push vs a blocking-socket sendall /
          recv_into into a preallocated buffer (the physical limit of this
          path from Python) vs torch.distributed gloo send/recv.
          Time = receiver has the last byte - sender started (perf_counter is
          CLOCK_MONOTONIC, shared by all processes of the machine).
  applied the same push until its outcome is back at the worker (received,
          validated, momentum applied, answered) vs the raw transfer alone.
  small   4 KiB push round trips (blocking and asyncio clients) vs a raw
          blocking-socket ping-pong of 4 KiB out, a small answer back.

    python benchmarks/bench_transfer.py [--mib 64] [--repeats 9] [--no-gloo]
        [--testbed MBIT]   # across two emulated hosts (root) instead of loopback
        [--before PATH]    # also the blocking client of another checkout, alternated
        [--tls]            # instead: the large push without and with mutual TLS

`--tls` measures what TLS costs: the large push, plain and over mutual TLS
(certificates from `mlfabric tls init`), alternated round by round, with
the throughput ratio TLS / plain and the CPU seconds per GB pushed of the
server and of the worker process (`time.process_time`, all threads).

`--before PATH` puts PATH first on the import path of extra client processes
(the large pusher on both servers and the small blocking client), so a
change to the client is measured against the code before it in the same run,
against the same servers: for example
    git worktree add /tmp/before COMMIT && (cd /tmp/before && python setup.py build_ext --inplace)
    python benchmarks/bench_transfer.py --before /tmp/before/src
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from typing import Any

import numpy as np

MiB = 1 << 20
JOB = "bench"
TOKEN = b"6NrT18XCOWxQ_54HcsKmwkCRAyAyWghUj1QEo6rop3Q"  # random


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recv_exactly_into(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed")
        view = view[n:]


# --- raw socket ------------------------------------------------------------------


HOST = "127.0.0.1"  # where receivers listen; the server host's address with --testbed


def raw_receiver(port: int, nbytes: int, ctl: Any, host: str = HOST) -> None:
    srv = socket.create_server((host, port))
    ctl.send("ready")
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = np.ones(nbytes, np.uint8)  # touched: no page faults during the transfer
    view = memoryview(buf)
    while True:
        head = conn.recv(1)
        if not head:
            return
        recv_exactly_into(conn, view[: nbytes - 1])
        t1 = time.perf_counter()
        conn.sendall(b"k")
        ctl.send(t1)


def raw_sender(port: int, nbytes: int, ctl: Any, host: str = HOST) -> None:
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = np.full(nbytes, 7, np.uint8)
    ctl.send("ready")
    while ctl.recv() == "go":
        t0 = time.perf_counter()
        sock.sendall(buf)
        sock.recv(1)
        ctl.send(t0)
    sock.close()


def raw_pingpong_server(port: int, size: int, ctl: Any, host: str = HOST) -> None:
    srv = socket.create_server((host, port))
    ctl.send("ready")
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(bytearray(size))
    reply = bytes(64)
    try:
        while True:
            recv_exactly_into(conn, view)
            conn.sendall(reply)
    except ConnectionError:
        return


def raw_pingpong_client(port: int, size: int, iters: int, ctl: Any, host: str = HOST) -> None:
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = bytes(size)
    view = memoryview(bytearray(64))
    ctl.send("ready")
    while ctl.recv() == "go":
        t0 = time.perf_counter()
        for _ in range(iters):
            sock.sendall(msg)
            recv_exactly_into(sock, view)
        ctl.send((time.perf_counter() - t0) / iters)
    sock.close()


# --- mlfabric --------------------------------------------------------------------


def tls_files(tls_dir: str, name: str) -> dict[str, str]:
    return {"tls_cert": f"{tls_dir}/{name}.pem", "tls_key": f"{tls_dir}/{name}.key",
            "tls_ca": f"{tls_dir}/ca.pem"}


def mlfabric_server(port: int, nbytes: int, momentum: float, overlap: bool, ctl: Any,
                    host: str = HOST, tls_dir: str | None = None) -> None:
    import asyncio

    from mlfabric.runtime import loop as loops
    from mlfabric.server.server import STAGE_MIN_BYTES, ParameterServer
    from mlfabric.server.store import ParameterStore

    class TimedServer(ParameterServer):
        """Reports when each push was fully received and when it was applied."""

        def handle_push(self, event, *rest):  # type: ignore[no-untyped-def]
            t_received = time.perf_counter()
            result = super().handle_push(event, *rest)
            # CPU so far (all threads): the difference between two pushes is
            # what receiving and applying one cost.
            ctl.send((t_received, time.perf_counter(), time.process_time()))
            return result

    model = {"w": np.zeros(nbytes // 4, np.float32)}
    store = ParameterStore(model, momentum=momentum, tau_max=None)

    async def main() -> None:
        server = TimedServer(store, job=JOB, token=TOKEN,
                             stage_min_bytes=STAGE_MIN_BYTES if overlap else None)
        if tls_dir is not None:
            from mlfabric.transport import tls

            f = tls_files(tls_dir, "server")
            found = tls.files(f["tls_cert"], f["tls_key"], f["tls_ca"])
            assert found is not None
            server.tls = tls.server_context(found)
        await server.start(host, port)
        ctl.send("ready")
        await asyncio.get_running_loop().run_in_executor(None, ctl.recv)  # "stop"
        await server.close()

    loops.run(main())


def use_before(before: str | None) -> None:
    """Import mlfabric from `before` (see --before) in this process."""
    if before:
        sys.path.insert(0, before)
        import mlfabric

        assert mlfabric.__file__.startswith(before), mlfabric.__file__


def mlfabric_pusher(port: int, ctl: Any, host: str = HOST, before: str | None = None,
                    tls_dir: str | None = None) -> None:
    use_before(before)
    import mlfabric

    secured = {} if tls_dir is None else tls_files(tls_dir, "worker")
    with mlfabric.connect(f"{host}:{port}", job=JOB, token=TOKEN, **secured) as ps:
        version, params = ps.pull()
        update = {n: np.full_like(a, 1e-3) for n, a in params.items()}
        ctl.send("ready")
        while ctl.recv() == "go":
            t0 = time.perf_counter()
            cpu0 = time.process_time()
            outcome = ps.push(update, base_version=version).result(60)
            t2 = time.perf_counter()
            cpu = time.process_time() - cpu0
            assert outcome.applied, outcome
            version = outcome.version
            ctl.send((t0, t2, cpu))


def mlfabric_small_client(port: int, iters: int, use_aio: bool, ctl: Any,
                          host: str = HOST, before: str | None = None) -> None:
    use_before(before)
    import mlfabric
    from mlfabric.client import aio
    from mlfabric.runtime import loop as loops

    if not use_aio:
        with mlfabric.connect(f"{host}:{port}", job=JOB, token=TOKEN) as ps:
            version, params = ps.pull()
            update = {n: np.zeros_like(a) for n, a in params.items()}
            ctl.send("ready")
            while ctl.recv() == "go":
                t0 = time.perf_counter()
                for _ in range(iters):
                    version = ps.push(update, base_version=version).result(10).version
                ctl.send((time.perf_counter() - t0) / iters)
        return

    async def main() -> None:
        import asyncio

        ps = await aio.connect(f"{host}:{port}", job=JOB, token=TOKEN)
        version, params = await ps.pull()
        update = {n: np.zeros_like(a) for n, a in params.items()}
        loop = asyncio.get_running_loop()
        ctl.send("ready")
        while await loop.run_in_executor(None, ctl.recv) == "go":
            t0 = time.perf_counter()
            for _ in range(iters):
                version = (await ps.push(update, base_version=version)).version
            ctl.send((time.perf_counter() - t0) / iters)
        await ps.close()

    loops.run(main())


def mlfabric_small_server(port: int, size: int, ctl: Any, host: str = HOST) -> None:
    import asyncio

    from mlfabric.runtime import loop as loops
    from mlfabric.server.server import ParameterServer
    from mlfabric.server.store import ParameterStore

    store = ParameterStore({"w": np.zeros(size // 4, np.float32)}, tau_max=None)

    async def main() -> None:
        server = ParameterServer(store, job=JOB, token=TOKEN)
        await server.start(host, port)
        ctl.send("ready")
        await asyncio.get_running_loop().run_in_executor(None, ctl.recv)
        await server.close()

    loops.run(main())


# --- PyTorch gloo ------------------------------------------------------------------


def gloo_rank(rank: int, port: int, nbytes: int, ctl: Any, host: str = HOST,
              ifname: str = "lo") -> None:
    import torch
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    dist.init_process_group(
        "gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=2
    )
    t = torch.full((nbytes // 4,), float(rank), dtype=torch.float32)
    ctl.send("ready")
    while ctl.recv() == "go":
        if rank == 0:
            t0 = time.perf_counter()
            dist.send(t, dst=1)
            ctl.send(t0)
        else:
            dist.recv(t, src=0)
            ctl.send(time.perf_counter())
    dist.destroy_process_group()


def thread_hop_seconds(n: int = 5000) -> float:
    """An empty round trip from this thread to a LoopThread and back (what
    the blocking client adds to each call over the asyncio client)."""
    import concurrent.futures

    from mlfabric.runtime.loop_thread import LoopThread

    runner = LoopThread()
    samples = []
    try:
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                f: concurrent.futures.Future[int] = concurrent.futures.Future()
                runner.call_soon(f.set_result, 1)
                f.result()
            samples.append((time.perf_counter() - t0) / n)
    finally:
        runner.stop()
    return med(samples)


def thread_pingpong_seconds(n: int = 5000) -> float:
    """Two plain threads handing a lock back and forth: the operating
    system's wake-up of a blocked thread, twice, with no event loop at all
    (the floor under any design that crosses a thread per call)."""
    import threading

    ping, pong = threading.Lock(), threading.Lock()
    ping.acquire()
    pong.acquire()
    stop = False

    def other() -> None:
        while True:
            ping.acquire()
            if stop:
                return
            pong.release()

    t = threading.Thread(target=other, daemon=True)
    t.start()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            ping.release()
            pong.acquire()
        samples.append((time.perf_counter() - t0) / n)
    stop = True
    ping.release()
    t.join(5.0)
    return med(samples)


# --- harness ---------------------------------------------------------------------------


class Procs:
    """Processes with a control pipe each; started, then driven round by round."""

    def __init__(self, ctx: Any, server_side: Any = None, client_side: Any = None) -> None:
        """server_side/client_side: context managers that put the calling
        thread (and so the processes it starts) into a host's namespace."""
        self.ctx = ctx
        self.procs: list[Any] = []
        self.pipes: list[Any] = []
        self.server_side = server_side or contextlib.nullcontext
        self.client_side = client_side or contextlib.nullcontext

    def start(self, target: Any, *args: Any, side: str = "server", **kwargs: Any) -> Any:
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=target, args=(*args, child), kwargs=kwargs, daemon=True)
        with (self.server_side if side == "server" else self.client_side)():
            p.start()
        self.procs.append(p)
        self.pipes.append(parent)
        if not parent.poll(120):
            raise RuntimeError(f"{target.__name__} did not start")
        assert parent.recv() == "ready"
        return parent

    def start_group(self, target: Any, arg_lists: list[tuple[tuple, dict, str]]) -> list[Any]:
        """Start processes that only become ready together (a gloo group)."""
        parents = []
        for args, kwargs, side in arg_lists:
            parent, child = self.ctx.Pipe()
            p = self.ctx.Process(target=target, args=(*args, child), kwargs=kwargs, daemon=True)
            with (self.server_side if side == "server" else self.client_side)():
                p.start()
            self.procs.append(p)
            self.pipes.append(parent)
            parents.append(parent)
        for parent in parents:
            if not parent.poll(120):
                raise RuntimeError(f"{target.__name__} group did not start")
            assert parent.recv() == "ready"
        return parents

    def stop(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send("stop")
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def fmt_rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:6.2f} GB/s"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="large update size (default 64)")
    ap.add_argument("--repeats", type=int, default=9, help="measured rounds (default 9)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--small-bytes", type=int, default=4096)
    ap.add_argument("--small-iters", type=int, default=2000)
    ap.add_argument("--no-gloo", action="store_true", help="skip PyTorch gloo")
    ap.add_argument("--before", default=None, metavar="PATH",
                    help="also run the blocking client imported from PATH (see above)")
    ap.add_argument("--testbed", type=float, default=None, metavar="MBIT",
                    help="run across two emulated hosts joined by links shaped to MBIT "
                         "(needs root) instead of loopback")
    ap.add_argument("--tls", action="store_true",
                    help="only the large push, without and with mutual TLS (see above)")
    args = ap.parse_args()

    gloo = not args.no_gloo and not args.tls
    if gloo:
        try:
            import torch  # noqa: F401
        except ImportError:
            print("torch is not installed: pip install torch==2.13.0 (or pass --no-gloo)")
            return 2

    nbytes = args.mib * MiB
    ctx = mp.get_context("spawn")
    testbed: Any = None
    where: dict[str, Any] = {}
    if args.testbed is not None:
        from mlfabric.tools.testbed import Testbed, require_root

        require_root()
        testbed = Testbed(hosts=2, rate_mbit=args.testbed).start()
        srv_host, cli_host = testbed.host("h0"), testbed.host("h1")
        where = {"host": srv_host.ip}
        procs = Procs(ctx, srv_host.enter, cli_host.enter)
        gloo_if = {0: cli_host.ifname, 1: srv_host.ifname}
        gloo_store = cli_host.ip
    else:
        procs = Procs(ctx)
        gloo_if = {0: "lo", 1: "lo"}
        gloo_store = None
    if args.tls:
        try:
            return tls_comparison(args, procs, where)
        finally:
            procs.stop()
            if testbed is not None:
                testbed.close()
    try:
        raw_port, gloo_port = free_port(), free_port()
        raw_rx = procs.start(raw_receiver, raw_port, nbytes, **where)
        raw_tx = procs.start(raw_sender, raw_port, nbytes, side="client", **where)
        mlf: dict[str, tuple[Any, Any]] = {}
        for overlap in (False, True):
            name = "overlap" if overlap else "plain"
            for tag, before in ([("", None), ("before_", args.before)] if args.before
                                else [("", None)]):
                port = free_port()
                srv = procs.start(mlfabric_server, port, nbytes, args.momentum, overlap, **where)
                mlf[tag + name] = (srv, procs.start(mlfabric_pusher, port, side="client",
                                                    before=before, **where))
        if gloo:
            # Rank 0 sends (from the client side) and hosts gloo's store there.
            store = {"host": gloo_store} if gloo_store else {}
            g0p, g1p = procs.start_group(gloo_rank, [
                ((0, gloo_port, nbytes), {**store, "ifname": gloo_if[0]}, "client"),
                ((1, gloo_port, nbytes), {**store, "ifname": gloo_if[1]}, "server")])

        systems = ["raw", *mlf] + (["gloo"] if gloo else [])
        t: dict[str, list[float]] = {"raw": [], "gloo": []}
        for name in mlf:
            t.update({f"{name}_received": [], f"{name}_applied": [], f"{name}_after": []})
        for r in range(args.warmup + args.repeats):
            keep = r >= args.warmup
            order = systems if r % 2 == 0 else systems[::-1]  # alternate round by round
            for system in order:
                if system == "raw":
                    raw_tx.send("go")
                    t0 = raw_tx.recv()
                    sample = {"raw": raw_rx.recv() - t0}
                elif system == "gloo":
                    g0p.send("go")
                    g1p.send("go")
                    t0 = g0p.recv()
                    sample = {"gloo": g1p.recv() - t0}
                else:
                    srv, cli = mlf[system]
                    cli.send("go")
                    t0, t2, _ = cli.recv()
                    t_recv, t_applied, _ = srv.recv()
                    sample = {f"{system}_received": t_recv - t0,
                              f"{system}_applied": t2 - t0,
                              f"{system}_after": t_applied - t_recv}
                if keep:
                    for k, v in sample.items():
                        t[k].append(v)
            print(f"  round {r + 1}/{args.warmup + args.repeats}"
                  f"{'' if keep else ' (warm-up)'} done", file=sys.stderr, flush=True)

        # Small messages.
        small_port_raw, small_port_mlf = free_port(), free_port()
        procs.start(raw_pingpong_server, small_port_raw, args.small_bytes, **where)
        raw_pp = procs.start(raw_pingpong_client, small_port_raw, args.small_bytes,
                             args.small_iters, side="client", **where)
        procs.start(mlfabric_small_server, small_port_mlf, args.small_bytes, **where)
        mlf_sync = procs.start(mlfabric_small_client, small_port_mlf, args.small_iters, False,
                               side="client", **where)
        mlf_aio = procs.start(mlfabric_small_client, small_port_mlf, args.small_iters, True,
                              side="client", **where)
        pipes = {"raw": raw_pp, "sync": mlf_sync, "aio": mlf_aio}
        if args.before:
            pipes["sync_before"] = procs.start(
                mlfabric_small_client, small_port_mlf, args.small_iters, False,
                side="client", before=args.before, **where)
        small: dict[str, list[float]] = {name: [] for name in pipes}
        for r in range(1 + args.repeats):
            order = list(pipes)
            if r % 2:
                order.reverse()
            for name in order:
                pipes[name].send("go")
                value = pipes[name].recv()
                if r:
                    small[name].append(value)
    finally:
        procs.stop()
        if testbed is not None:
            testbed.close()

    print()
    path = f"emulated {args.testbed:g} Mbit/s link" if args.testbed else "loopback"
    print(f"Large push: {args.mib} MiB float32, {path}, median of {args.repeats} rounds "
          f"(min..max), systems alternated; server momentum {args.momentum}")
    rows = [
        ("raw socket sendall/recv_into", "raw"),
        ("mlfabric push, last byte in", "plain_received"),
        ("  then applied, outcome back", "plain_applied"),
        ("mlfabric push, overlapped apply", "overlap_received"),
        ("  then applied, outcome back", "overlap_applied"),
    ] + ([("torch gloo send/recv", "gloo")] if gloo else [])
    for label, key in rows:
        xs = t[key]
        print(f"  {label:34s} {med(xs) * 1e3:8.2f} ms  {fmt_rate(nbytes, med(xs))}  "
              f"({min(xs) * 1e3:.1f}..{max(xs) * 1e3:.1f} ms)")
    print(f"  server work after the last byte: {med(t['plain_after']) * 1e3:.2f} ms plain, "
          f"{med(t['overlap_after']) * 1e3:.2f} ms overlapped")
    print()
    raw = med(t["raw"])

    def paired(a: str, b: str) -> float:
        """Median over rounds of a/b measured in the same round (cancels drift)."""
        return med([x / y for x, y in zip(t[a], t[b], strict=True)])

    print("Ratios: of the medians, and (paired) the median of the per-round ratios")
    print(f"  transfer: raw time / mlfabric time   {raw / med(t['plain_received']):5.2f}x   "
          f"({paired('raw', 'plain_received'):.2f}x)   target >= 0.85")
    if gloo:
        print(f"  transfer: gloo time / mlfabric time  "
              f"{med(t['gloo']) / med(t['plain_received']):5.2f}x   "
              f"({paired('gloo', 'plain_received'):.2f}x)   target >= 1.1")
    print(f"  push-to-applied / raw transfer       {med(t['overlap_applied']) / raw:5.2f}x   "
          f"({paired('overlap_applied', 'raw'):.2f}x)   target <= 1.5; without overlap "
          f"{med(t['plain_applied']) / raw:.2f}x ({paired('plain_applied', 'raw'):.2f}x)")
    print()
    print(f"Small push: {args.small_bytes} B, {args.small_iters} round trips per sample, "
          f"median of {args.repeats}")
    for name, label in (("raw", "raw socket ping-pong"), ("sync", "mlfabric blocking client"),
                        ("aio", "mlfabric asyncio client (uvloop)")):
        print(f"  {label:34s} {med(small[name]) * 1e6:8.1f} us per round trip")
    def paired_small(name: str) -> float:
        return med([r / x for r, x in zip(small["raw"], small[name], strict=True)])

    print(f"  blocking client / raw          {med(small['raw']) / med(small['sync']):5.2f}x   "
          f"({paired_small('sync'):.2f}x)   target >= 0.5")
    print(f"  asyncio client / raw           {med(small['raw']) / med(small['aio']):5.2f}x   "
          f"({paired_small('aio'):.2f}x)")
    if args.before:
        print()
        hop = thread_hop_seconds()
        bare = thread_pingpong_seconds()
        print(f"The bound on a blocking round trip through the client's loop thread: an "
              f"empty call there and back costs {hop * 1e6:.1f} us here (median of 5 x 5000); "
              f"two bare threads handing a lock back and forth, {bare * 1e6:.1f} us")
        print(f"Before ({args.before}) against after, the same servers, alternated round by "
              f"round: time before / time after (>1: after is faster)")
        for label, a, b, target in (
                ("64 MiB push, last byte in", "before_plain_received", "plain_received",
                 ">= 0.95 as throughput after/before"),
                ("push-to-applied, overlapped", "before_overlap_applied", "overlap_applied",
                 ">= 1.0 (no worse)"),
                ("push-to-applied, plain", "before_plain_applied", "plain_applied", "")):
            print(f"  {label:32s} {med(t[a]) / med(t[b]):5.2f}x   ({paired(a, b):.2f}x)   "
                  f"{med(t[a]) * 1e3:.2f} -> {med(t[b]) * 1e3:.2f} ms   {target}")
        rt = med([x / y for x, y in zip(small["sync_before"], small["sync"], strict=True)])
        print(f"  {'4 KiB round trip, blocking':32s} "
              f"{med(small['sync_before']) / med(small['sync']):5.2f}x   ({rt:.2f}x)   "
              f"{med(small['sync_before']) * 1e6:.1f} -> {med(small['sync']) * 1e6:.1f} us   "
              f">= 1.0 (no worse)")
    return 0


def tls_comparison(args: Any, procs: Procs, where: dict[str, Any]) -> int:
    """The large push without and with mutual TLS, alternated round by round."""
    import tempfile

    from mlfabric.tools import tls_cli

    nbytes = args.mib * MiB
    tls_dir = tempfile.mkdtemp(prefix="mlfabric-bench-tls-")
    server_names = ",".join(["server", "127.0.0.1", *([where["host"]] if where else [])])
    tls_cli.init(tls_dir, [server_names, "worker"])
    pairs: dict[str, tuple[Any, Any]] = {}
    for name, secured in (("plain", None), ("tls", tls_dir)):
        port = free_port()
        srv = procs.start(mlfabric_server, port, nbytes, args.momentum, True, tls_dir=secured,
                          **where)
        pairs[name] = (srv, procs.start(mlfabric_pusher, port, side="client", tls_dir=secured,
                                        **where))
    t: dict[str, list[float]] = {f"{n}_{k}": [] for n in pairs
                                 for k in ("received", "applied", "server_cpu", "client_cpu")}
    last_cpu: dict[str, float] = {}
    for r in range(args.warmup + args.repeats):
        keep = r >= args.warmup
        order = list(pairs) if r % 2 == 0 else list(pairs)[::-1]
        for name in order:
            srv, cli = pairs[name]
            cli.send("go")
            t0, t2, client_cpu = cli.recv()
            t_recv, _, server_cpu = srv.recv()
            if keep:
                t[f"{name}_received"].append(t_recv - t0)
                t[f"{name}_applied"].append(t2 - t0)
                t[f"{name}_server_cpu"].append(server_cpu - last_cpu[name])
                t[f"{name}_client_cpu"].append(client_cpu)
            last_cpu[name] = server_cpu
        print(f"  round {r + 1}/{args.warmup + args.repeats}"
              f"{'' if keep else ' (warm-up)'} done", file=sys.stderr, flush=True)

    gb = nbytes / 1e9
    path = f"emulated {args.testbed:g} Mbit/s link" if args.testbed else "loopback"
    print()
    print(f"Large push without and with mutual TLS: {args.mib} MiB float32, {path}, median of "
          f"{args.repeats} rounds (min..max), alternated; server momentum {args.momentum}, "
          f"overlapped apply")
    for name, label in (("plain", "plain TCP"), ("tls", "mutual TLS")):
        for what, key in (("last byte in", "received"), ("outcome back", "applied")):
            xs = t[f"{name}_{key}"]
            print(f"  {label:11s} {what:13s} {med(xs) * 1e3:8.2f} ms  {fmt_rate(nbytes, med(xs))}"
                  f"  ({min(xs) * 1e3:.1f}..{max(xs) * 1e3:.1f} ms)")
        print(f"  {label:11s} CPU s per GB: server {med(t[f'{name}_server_cpu']) / gb:.3f}, "
              f"worker {med(t[f'{name}_client_cpu']) / gb:.3f}")

    def paired(a: str, b: str) -> float:
        return med([x / y for x, y in zip(t[a], t[b], strict=True)])

    print("Throughput TLS / plain: of the medians, and (paired) the median of per-round ratios")
    for what, key in (("last byte in", "received"), ("outcome back", "applied")):
        print(f"  {what:13s} {med(t[f'plain_{key}']) / med(t[f'tls_{key}']):5.2f}x   "
              f"({paired(f'plain_{key}', f'tls_{key}'):.2f}x)"
              f"{'   target >= 0.95 across a 1 Gbit/s link' if key == 'received' else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
