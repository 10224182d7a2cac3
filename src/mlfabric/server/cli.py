"""`mlfabric server`: serve one job's model until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import logging
import sys
import zipfile
import zlib
from pathlib import Path

import numpy as np

from ..client.core import parse_address
from ..client.shards import shard_info
from ..errors import ConfigError
from ..replication.chain import ChainLink
from ..replication.divergence_sampling import ReplicaSampler
from ..replication.replica import (
    DEFAULT_MAX_PENDING,
    DEFAULT_RECOVERY,
    MAX_PENDING_LIMIT,
    ReplicaServer,
    announce,
    fetch_state,
)
from ..runtime import loop
from ..runtime.metrics import ServerMetrics, serve_metrics
from ..sharding.partition import DEFAULT_CHUNK_BYTES, partition
from ..transport import tls
from ..transport.listener import (
    MAX_TAU_MAX,
    add_listener_arguments,
    add_metrics_arguments,
    check_at_least,
    check_count,
    check_metrics_host,
    check_momentum,
    check_not_negative,
    check_port,
    check_positive,
    handshake_timeout,
    job_name,
    listen,
    parse_tau_max,
    stop_on_signals,
)
from ..wire import auth
from ..wire.protocol import ShardInfo
from . import checkpoint
from .checkpointer import Checkpointer
from .landings import LandingFeed
from .server import ParameterServer
from .store import ParameterStore

log = logging.getLogger("mlfabric.server")

# The most --keep-checkpoints takes: each is the whole model on disk, and
# more than this is an archive, which is the operator's to keep (issue 33:
# the flag had no upper bound).
MAX_KEEP_CHECKPOINTS = 1000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = (
        "Replication: start a replica with --role replica from the same --init (or "
        "checkpoint) and --momentum. Chain replication: give the server --replicate-to "
        "REPLICA. Worker-driven replication (no second hop through the server): workers "
        "connect with replica=REPLICA, and `mlfabric controller --div-max X` bounds "
        "||w_server - w_replica||. Failover: `mlfabric controller --server S --replica R` "
        "promotes the replica when the server stops answering heartbeats. "
        "See docs/design.md, Replicas.")
    add_listener_arguments(p, "clients")
    p.add_argument("--role", choices=("server", "replica"), default="server",
                   help="server: apply pushes as they come and number them (versions); "
                        "replica: hold the same model and apply only numbered pushes, "
                        "strictly in the server's order, whatever order they arrive in "
                        "(start it from the same --init or checkpoint as the server) "
                        "(default: server)")
    p.add_argument("--replicate-to", metavar="HOST:PORT", default=None,
                   help="chain replication: forward every applied update to the replica "
                        "there (started with --role replica from the same model) and "
                        "acknowledge a push once the replica applied it too")
    p.add_argument("--sample-replica", metavar="HOST:PORT", default=None,
                   help="server: every --sample-interval seconds pull the replica's model and "
                        "export the measured ||w_server - w_replica||_2 (a whole model over "
                        "this server's downlink per sample)")
    p.add_argument("--sample-interval", type=float, default=5.0, metavar="SECONDS",
                   help="seconds between divergence samples (default: 5)")
    p.add_argument("--join-from", metavar="HOST:PORT", default=None,
                   help="replica: start from the whole state of the running server there "
                        "(instead of --init/--resume) and announce to --controller; the "
                        "workers then send it every update above that state's version")
    p.add_argument("--controller", metavar="HOST:PORT[,HOST:PORT...]", default=None,
                   help="the job's controller (several, with `mlfabric controller --etcd`: "
                        "every one, as the workers are given them). The server tells it of "
                        "each push it applies or refuses, a message before the worker can, so "
                        "the next transfer goes sooner and is planned with the server's "
                        "version (a replica does once promoted). A replica with --join-from "
                        "also tells it where it serves")
    p.add_argument("--advertise", metavar="HOST:PORT", default=None,
                   help="replica with --join-from: the address workers reach it at (default: "
                        "the address it listens on)")
    p.add_argument("--recovery-seconds", type=float, default=DEFAULT_RECOVERY, metavar="S",
                   help="replica: once promoted (failover), how long to take updates of the "
                        f"lost server still on their way before serving (default: "
                        f"{DEFAULT_RECOVERY})")
    p.add_argument("--max-pending", type=int, default=DEFAULT_MAX_PENDING, metavar="N",
                   help=f"replica: updates that may wait for an earlier one, 1.."
                        f"{MAX_PENDING_LIMIT} (each is held whole); a push further ahead is "
                        f"refused (default: {DEFAULT_MAX_PENDING})")
    p.add_argument("--shard", metavar="I/S", default=None,
                   help="serve shard I of S (0 <= I < S): the model is partitioned over S "
                        "servers, each started with the same --init and --chunk-bytes; "
                        "workers list all S addresses in shard order (default: the whole "
                        "model, as --shard 0/1)")
    p.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, metavar="N",
                   help="with --shard: tensors larger than this are cut into pieces of at "
                        "most N bytes (smaller still when needed to keep every shard within "
                        f"5%% of the mean) (default: {DEFAULT_CHUNK_BYTES}, as BytePS)")
    p.add_argument("--init", metavar="MODEL.npz",
                   help="initial model: named float32 arrays in a .npz file "
                        "(required unless --resume)")
    p.add_argument("--momentum", type=float, default=None, metavar="G",
                   help="server momentum gamma in [0, 1) (default: 0, or the checkpoint's)")
    p.add_argument("--tau-max", type=int, default=16, metavar="N",
                   help=f"refuse updates older than N versions at apply, 0..{MAX_TAU_MAX}; "
                        f"-1 for no bound (default: 16)")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="apply updates holding NaN/Inf instead of refusing them")
    p.add_argument("--checkpoint-dir", metavar="DIR", default=None,
                   help="write checkpoints (weights, momentum history, version) here")
    p.add_argument("--checkpoint-interval", type=float, default=60.0, metavar="SECONDS",
                   help="seconds between checkpoints when the model changed (default: 60)")
    p.add_argument("--keep-checkpoints", type=int, default=3, metavar="N",
                   help=f"keep this run's N newest checkpoints, 1..{MAX_KEEP_CHECKPOINTS} "
                        f"(default: 3); other runs' files in --checkpoint-dir are left alone")
    p.add_argument("--resume", metavar="PATH", default=None,
                   help="start from a checkpoint file, or 'latest': the newest valid one in "
                        "--checkpoint-dir (the run goes on: same run id), or 'auto': "
                        "'latest' if --checkpoint-dir holds any checkpoint, else a new run "
                        "from --init (for a service manager that restarts the server)")
    p.add_argument("--fresh", action="store_true",
                   help="start a new run although --checkpoint-dir holds another run's "
                        "checkpoints (they are left alone); without it the server refuses, "
                        "so a crashed run is not silently replaced")
    add_metrics_arguments(p)


# What --init takes, said in every error about it.
INIT_FORMAT = ("--init takes a .npz file of named float32 arrays, as "
               "np.savez('model.npz', w=w, b=b) writes")


def load_model(path: str) -> dict[str, np.ndarray]:
    """The named arrays of an .npz file, with errors that say what to fix."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--init {path!r}: no such file; give a .npz written by np.savez")
    try:
        with open(p, "rb") as f:
            head = f.read(6)
    except OSError as exc:
        raise ConfigError(f"cannot read --init {path!r}: {exc.strerror}") from None
    # np.load takes a .npy as one unnamed array, and anything else as a
    # pickle (whose refusal told users to allow pickles): say what it is.
    if head == b"\x93NUMPY":
        raise ConfigError(f"--init {path!r} is a single array (.npy), not a model; "
                          f"{INIT_FORMAT}")
    if not zipfile.is_zipfile(p):
        raise ConfigError(f"--init {path!r} is not a valid .npz model (not a zip archive); "
                          f"{INIT_FORMAT}")
    try:
        with np.load(p, allow_pickle=False) as npz:
            tensors = {name: npz[name] for name in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise ConfigError(f"--init {path!r} is not a valid .npz model ({exc}); "
                          f"{INIT_FORMAT}") from None
    if not tensors:
        raise ConfigError(f"--init {path!r} holds no arrays; {INIT_FORMAT}")
    for name, arr in tensors.items():
        if arr.dtype != np.float32:
            raise ConfigError(
                f"--init {path!r}: tensor {name!r} is {arr.dtype}; mlfabric serves float32 "
                f"tensors: save arr.astype(np.float32)"
            )
    return tensors


def parse_shard(value: str | None) -> tuple[int, int] | None:
    """--shard "I/S" as (I, S); None for the whole model (no flag, or 0/1)."""
    if value is None:
        return None
    try:
        index, count = (int(x) for x in value.split("/"))
    except ValueError:
        raise ConfigError(f"--shard takes I/S, shard I of S (for example 0/4), got "
                          f"{value!r}") from None
    if not 0 <= index < count:
        raise ConfigError(f"--shard {value}: the index I must be in 0..S-1 (S = {count}), got "
                          f"{index}")
    return None if count == 1 else (index, count)


def shard_store(model: dict[str, np.ndarray], shard: tuple[int, int] | None,
                chunk_bytes: int) -> tuple[dict[str, np.ndarray], ShardInfo | None]:
    """The tensors this server keeps of `model`: all of them, or shard I's pieces."""
    if shard is None:
        return model, None
    index, count = shard
    part = partition([(n, a.dtype, a.shape) for n, a in model.items()], count, chunk_bytes)
    return part.split(model)[index], shard_info(part, index)


def check_joined_shard(address: str, have: ShardInfo | None,
                       shard: tuple[int, int] | None) -> None:
    """A replica that joins keeps what the server it joins from keeps: with
    --shard given, that must be the server's shard."""
    if shard is None or (have is not None and (have.index, have.count) == shard):
        return
    what = "the whole model" if have is None else f"shard {have.index} of {have.count}"
    raise ConfigError(f"the server at {address} keeps {what}, not shard {shard[0]} of "
                      f"{shard[1]}: join from that shard's server, or drop --shard (a joining "
                      f"replica keeps what its server keeps)")


def check_resumed_shard(path: str, ckpt: checkpoint.Checkpoint,
                        shard: tuple[int, int] | None, chunk_bytes: int) -> None:
    """A checkpoint resumes only as the shard of the partition it was made under."""
    have = ckpt.shard
    if have is None:
        if shard is None:
            return
        raise ConfigError(f"checkpoint {path!r} holds a whole model, not shard {shard[0]} of "
                          f"{shard[1]}: resume it without --shard")
    if shard is None:
        raise ConfigError(f"checkpoint {path!r} holds shard {have.index} of {have.count}: "
                          f"resume it with --shard {have.index}/{have.count}")
    if shard != (have.index, have.count):
        raise ConfigError(f"checkpoint {path!r} holds shard {have.index} of {have.count}, "
                          f"not {shard[0]} of {shard[1]}: give its shard's checkpoint, or "
                          f"--shard {have.index}/{have.count}")
    again = partition([(m.name, m.dtype, m.shape) for m in have.model], have.count, chunk_bytes)
    if again.digest != have.digest:
        raise ConfigError(f"checkpoint {path!r} was made with --chunk-bytes giving "
                          f"{have.chunk}-byte pieces, this server cuts {again.chunk_bytes}: "
                          f"resume with the --chunk-bytes it was made with")


def refuse_other_runs(args: argparse.Namespace) -> None:
    """A new run (--init, --join-from) in a folder holding checkpoints starts
    only with --fresh: the folder may hold a crashed run that the operator
    meant to resume, and --resume latest would later take its files over the
    new run's."""
    if args.checkpoint_dir is None or args.fresh:
        return
    others = checkpoint.found(args.checkpoint_dir)
    if others:
        version, _, other = others[-1]
        ways = ("start this replica's checkpoints beside them with --fresh, or give another "
                "--checkpoint-dir" if args.join_from is not None else
                "continue that run with --resume latest, or start a new one beside it with "
                "--fresh")
        raise ConfigError(
            f"--checkpoint-dir {args.checkpoint_dir!r} holds checkpoints of another "
            f"run (newest: {other.name}, version {version}): {ways}")


def build_store(args: argparse.Namespace, tau_max: int | None
                ) -> tuple[ParameterStore, str, tuple[int, Path] | None]:
    """The model to serve, from --resume if given, else from --init; the run id
    its checkpoints carry (the resumed run's, or a new one); and the
    (version, path) it resumed from."""
    if args.resume == "auto":
        # A unit or pod restarted by its manager: the first start finds no
        # checkpoint and starts from --init; every restart after continues.
        # Damaged files only still count as checkpoints: 'latest' then says
        # so rather than a new run silently starting over them.
        if args.checkpoint_dir is None or args.init is None:
            raise ConfigError("--resume auto needs --checkpoint-dir (where to look) and "
                              "--init MODEL.npz (the model of the first start)")
        which = "latest" if checkpoint.found(args.checkpoint_dir) else None
        args = argparse.Namespace(**{**vars(args), "resume": which})
    if args.resume is None:
        if args.init is None:
            raise ConfigError("give the initial model with --init MODEL.npz (or --resume PATH)")
        refuse_other_runs(args)
        tensors, info = shard_store(load_model(args.init), parse_shard(args.shard),
                                    args.chunk_bytes)
        store = ParameterStore(tensors, momentum=args.momentum or 0.0, tau_max=tau_max,
                               allow_nonfinite=args.allow_nonfinite)
        store.shard = info
        return store, checkpoint.new_run_id(), None
    if args.fresh:
        raise ConfigError("--fresh starts a new run and --resume continues one: give one of them")
    path = args.resume
    if path == "latest":
        if args.checkpoint_dir is None:
            raise ConfigError("--resume latest needs --checkpoint-dir")
        newest, ckpt, skipped = checkpoint.newest_valid(args.checkpoint_dir)
        if skipped:
            log.warning("--resume latest: skipped %s; resuming from %s",
                        "; ".join(reason for _, reason in skipped), newest.name)
        runs = checkpoint.runs(args.checkpoint_dir)
        if len(runs) > 1:
            # "latest" is the highest version, whichever run wrote it: say so,
            # so a run started with --fresh beside another is not replaced unseen.
            log.warning("--resume latest: %s holds checkpoints of %d runs (%s); resuming "
                        "run %s, the newest valid version; give --resume PATH to continue "
                        "another", args.checkpoint_dir, len(runs),
                        ", ".join(f"{r or 'format 1'} up to version {v}"
                                  for r, v in sorted(runs.items(), key=lambda rv: -rv[1])),
                        ckpt.run or "(format 1)")
        path = str(newest)
    else:
        ckpt = checkpoint.read(path)
    if ckpt.job != args.job:
        raise ConfigError(
            f"checkpoint {path!r} belongs to job {ckpt.job!r}, not {args.job!r}"
        )
    check_resumed_shard(path, ckpt, parse_shard(args.shard), args.chunk_bytes)
    if args.resume != "latest":  # latest is the newest valid: only damaged files are later
        refuse_rollback(args, path, ckpt)
    run = ckpt.run or checkpoint.new_run_id()  # a format-1 file had none
    log.info("resuming job %r (run %s) at version %d from %s", args.job, run, ckpt.version,
             path)
    return ParameterStore.from_checkpoint(ckpt, momentum=args.momentum, tau_max=tau_max,
                                          allow_nonfinite=args.allow_nonfinite
                                          ), run, (ckpt.version, Path(path))


def refuse_rollback(args: argparse.Namespace, path: str, ckpt: checkpoint.Checkpoint) -> None:
    """Resuming a run from an earlier checkpoint than its newest in
    --checkpoint-dir would leave the later ones there: after a crash, --resume
    latest would take them, not the continuation. The operator moves them."""
    if args.checkpoint_dir is None or not ckpt.run:
        return
    later = [p.name for v, r, p in checkpoint.found(args.checkpoint_dir)
             if r == ckpt.run and v > ckpt.version]
    if later:
        raise ConfigError(
            f"--resume {path!r} is version {ckpt.version} of run {ckpt.run}, but "
            f"--checkpoint-dir {args.checkpoint_dir!r} holds that run's later checkpoints "
            f"({', '.join(later)}): after a crash --resume latest would take those, not "
            f"this continuation. Move them out of {args.checkpoint_dir!r} to go back past "
            f"them, or give another --checkpoint-dir")


def check_numbers(args: argparse.Namespace) -> None:
    """Every numeric flag within its range, whatever the role (issue 33)."""
    check_positive("--sample-interval", args.sample_interval)
    check_not_negative("--recovery-seconds", args.recovery_seconds)
    check_count("--max-pending", args.max_pending, 1, MAX_PENDING_LIMIT)
    check_at_least("--chunk-bytes", args.chunk_bytes, 1)
    check_momentum("--momentum", args.momentum)
    check_positive("--checkpoint-interval", args.checkpoint_interval)
    check_count("--keep-checkpoints", args.keep_checkpoints, 1, MAX_KEEP_CHECKPOINTS)
    check_port("--metrics-port", args.metrics_port)
    check_metrics_host(args.metrics_port, args.metrics_host)


def run_server(args: argparse.Namespace) -> int:
    host, port = parse_address(args.listen)
    shake = handshake_timeout(args)  # settings first: before a model is loaded
    # TLS files checked before the model is loaded; the client context is
    # also this process's, for the links it opens (replica, chain, sampler).
    secured = tls.from_args(args)
    check_numbers(args)
    token = auth.load_token(args.token_file)
    if not auth.token_file_is_private(args.token_file):
        log.warning("token file %s is readable by other users: chmod 600 it", args.token_file)
    tau_max = parse_tau_max(args.tau_max)
    job_name(args.job)
    if args.replicate_to is not None and args.role != "server":
        raise ConfigError("--replicate-to is for the server (--role server); a replica "
                          "only applies what it is sent")
    if parse_shard(args.shard) is not None:
        # A shard's replica (--role replica --shard I/S) is fed by the
        # shard's workers (mlfabric.connect(..., replica=...)) or joins from
        # the shard's server (--join-from), and the shard may sample its
        # divergence from it (--sample-replica); the server-driven replica
        # is one server's only for now.
        for flag, given in (("--replicate-to", args.replicate_to is not None),):
            if given:
                raise ConfigError(f"{flag} with --shard is not supported yet: a shard's "
                                  f"replica is fed by its workers (start it with --role replica "
                                  f"--shard I/S and give the workers replica=...), drop {flag}")
    metrics = ServerMetrics()
    metrics_url = None
    if args.metrics_port is not None:  # before the model is loaded: a port in use fails fast
        # by default where the clients are served: --listen 127.0.0.1 keeps them local
        metrics_url = serve_metrics(metrics.registry, args.metrics_port,
                                    args.metrics_host or host)
    controllers = [] if args.controller is None else \
        [c.strip() for c in args.controller.split(",") if c.strip()]
    for controller in controllers:
        try:
            parse_address(controller)
        except ConfigError as exc:
            raise ConfigError(f"--controller: {exc}") from None
    if args.join_from is not None:
        if args.role != "replica" or args.controller is None:
            raise ConfigError("--join-from is for a replica (--role replica) and needs "
                              "--controller HOST:PORT to announce itself to")
        if args.init is not None or args.resume is not None:
            raise ConfigError("--join-from takes the running server's state: drop --init "
                              "and --resume")
        parse_address(args.join_from)
        refuse_other_runs(args)
        store, resumed = None, None
        run = checkpoint.new_run_id()
    else:
        store, run, resumed = build_store(args, tau_max)
    if store is not None and store.shard is not None:
        sh = store.shard
        metrics.shard.labels(str(sh.index), str(sh.count), sh.digest).set(1)

    async def main() -> int:
        nonlocal store
        if store is None:
            store = await fetch_state(args.join_from, job=args.job, token=token)
            log.info("took the state of %s at version %d", args.join_from, store.version)
            check_joined_shard(args.join_from, store.shard, parse_shard(args.shard))
        server: ParameterServer
        if args.role == "replica":
            server = ReplicaServer(store, job=args.job, token=token, metrics=metrics,
                                   max_pending=args.max_pending,
                                   recovery=args.recovery_seconds, handshake_timeout=shake)
        else:
            server = ParameterServer(store, job=args.job, token=token, metrics=metrics,
                                     handshake_timeout=shake)
        server.tls = None if secured is None else secured[0]
        if args.replicate_to is not None:
            server.chain = await ChainLink.connect(args.replicate_to, job=args.job, token=token,
                                                   store=store, metrics=metrics)
            log.info("chain replication to %s", args.replicate_to)
        checkpointer = None
        if args.checkpoint_dir is not None:
            checkpointer = Checkpointer(store, args.job, args.checkpoint_dir,
                                        interval=args.checkpoint_interval,
                                        keep=args.keep_checkpoints, metrics=metrics, run=run,
                                        resumed=resumed)
        stopped = stop_on_signals()  # before the "serving" line: see stop_on_signals
        bound = await listen(server, host, port, args.listen)
        # The "serving" line is what scripts wait for: it carries the bound port.
        part = ("" if store.shard is None else
                f"shard {store.shard.index} of {store.shard.count}, partition "
                f"{store.shard.digest}, ")
        print(
            f"mlfabric {args.role}: serving job {args.job!r} on {bound[0]}:{bound[1]} "
            f"({part}{len(store.specs)} tensors, {store.nbytes} bytes, version "
            f"{store.version}, tau_max {'none' if tau_max is None else tau_max}"
            f"{tls.describe(server.tls)}"
            f"{'' if metrics_url is None else f', metrics {metrics_url}'})",
            flush=True,
        )
        if checkpointer is not None:
            checkpointer.start()
        if controllers:
            server.landings = LandingFeed(controllers, job=args.job, token=token,
                                          shard=0 if store.shard is None else store.shard.index,
                                          metrics=metrics)
            server.landings.start()
        sampler = None
        if args.sample_replica is not None:
            sampler = ReplicaSampler(store, args.sample_replica, job=args.job, token=token,
                                     interval=args.sample_interval, metrics=metrics)
            sampler.start()
        if args.join_from is not None:
            if args.advertise is None and bound[0] in ("0.0.0.0", "::"):
                raise ConfigError("listening on all addresses: give --advertise HOST:PORT, "
                                  "the address workers reach this replica at")
            address = args.advertise or f"{bound[0]}:{bound[1]}"
            await announce(controllers, address=address,
                           store=store, job=args.job, token=token, server=args.join_from)
        await stopped.wait()
        log.info("shutting down at version %d", store.version)
        if sampler is not None:
            await sampler.close()
        await server.close()
        if server.chain is not None:
            await server.chain.close()
        if checkpointer is not None and not await checkpointer.close():
            if checkpointer.last_good is not None:
                good, path = checkpointer.last_good
                lost = (f"the last good checkpoint is {path} (version {good}): resuming "
                        f"from it loses versions {good + 1} to {store.version}")
            else:
                lost = (f"no checkpoint of this run is on disk: its model at version "
                        f"{store.version} is lost with this process")
            print(f"mlfabric {args.role}: error: the final {checkpointer.error}; {lost}",
                  file=sys.stderr, flush=True)
            return 1
        print(f"mlfabric {args.role}: stopped at version {store.version}", flush=True)
        return 0

    return loop.run(main())


run = run_server
