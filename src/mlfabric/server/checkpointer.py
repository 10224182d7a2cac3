"""Periodic checkpoints of a running server: copy in the loop, write in a thread."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from pathlib import Path

from ..runtime.metrics import ServerMetrics
from . import checkpoint
from .store import ParameterStore

log = logging.getLogger("mlfabric.checkpoint")


class Checkpointer:
    """Writes a checkpoint every `interval` seconds when the model changed, and
    one more at close; keeps the `keep` newest of its run (`run`, the id
    every checkpoint of this training run carries, a new one if not given;
    other runs' files in the folder are left alone). `resumed` is the
    (version, path) the run resumed from: its last good checkpoint until this
    one writes another."""

    def __init__(self, store: ParameterStore, job: str, directory: str | Path, *,
                 interval: float = 60.0, keep: int = 3,
                 metrics: ServerMetrics | None = None, run: str | None = None,
                 resumed: tuple[int, Path] | None = None) -> None:
        self.store = store
        self.job = job
        self.directory = Path(directory)
        self.interval = interval
        self.keep = keep
        self.metrics = metrics
        # Without a run id, its retention would take format-1 files (which name
        # no run) for its own.
        self.run = checkpoint.new_run_id() if run is None else run
        self.written_version: int | None = None
        self.written: Path | None = None  # the newest checkpoint this run wrote
        self.error: str | None = None  # why the last write failed (None: it did not)
        # (version, path) of the newest checkpoint of this run known good on disk
        self.last_good: tuple[int, Path] | None = resumed
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.write_now()

    async def write_now(self) -> Path | None:
        """Checkpoint now if the model changed since the last one."""
        if self.written_version == self.store.version:
            return None
        started = time.perf_counter()
        # The copy is taken in the loop thread, between two updates: consistent.
        ckpt = dataclasses.replace(self.store.checkpoint(self.job), run=self.run)
        try:
            path = await asyncio.get_running_loop().run_in_executor(
                None, checkpoint.write, self.directory, ckpt)
        except OSError as exc:
            self.error = f"checkpoint of version {ckpt.version} to {self.directory} failed: {exc}"
            log.error("%s", self.error)
            if self.metrics is not None:
                self.metrics.checkpoint_failures.inc()
            return None
        self.error = None
        self.written_version, self.written = ckpt.version, path
        self.last_good = (ckpt.version, path)
        if self.metrics is not None:
            self.metrics.checkpoints.inc()
            self.metrics.checkpoint_seconds.observe(time.perf_counter() - started)
            self.metrics.last_checkpoint.set(time.time())
            self.metrics.last_checkpoint_version.set(ckpt.version)
        log.info("checkpoint of version %d written to %s", ckpt.version, path)
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, functools.partial(checkpoint.prune, self.directory, self.keep,
                                        self.run, current=ckpt.version))
        except OSError as exc:  # the new checkpoint is on disk: only retention failed
            log.warning("deleting this run's older checkpoints in %s failed: %s",
                        self.directory, exc)
        return path

    async def close(self) -> bool:
        """Stop the periodic task and write a final checkpoint; False if the
        model's last version is not on disk (see `error`)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.write_now()
        return self.written_version == self.store.version
