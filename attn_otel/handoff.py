"""The bounded hand-offs between the engine loop and the writers: byte budgets that refuse rather than wait,
and the queue of finished captures that writer threads take from.

Nothing here ever blocks the engine: a capture that does not fit is dropped and counted by the caller.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable

import torch

from .config import Config, writer_count
from .stats import Stats
from .store import CaptureRecord
from .writer_proc import os_thread_name

EXIT_DRAIN_S = 30.0


@dataclasses.dataclass
class Job:
    """A capture computed (or being computed) on the device, ready for the writers once ``event`` is done."""

    record: CaptureRecord
    per_row: torch.Tensor | None  # [len(METRICS), L, H, T] on host (pinned when the device is a GPU)
    maps: torch.Tensor | None  # float16 [L, H, T, T] on host
    event: Any  # torch.cuda.Event or None
    nbytes: int
    t_finish: float
    token_ids: torch.Tensor | None = None  # host copy of device-held token ids, valid after ``event``
    keep: list[int] | None = None  # the request's layers among per_row's, picked after ``event``
    # Instead of per_row (None then): its summary computed on the device, [part, metric, stat, L, H] host
    # float32 (attn_otel.metrics.summary_to_array's layout), when no per-row metrics are stored.
    summary: torch.Tensor | None = None
    # Where ``maps`` lives when it is a pool segment (attn_otel.hostmem): the writer process reads it there;
    # it goes back to the pool once the job is written or dropped.
    maps_seg: Any = None


def at_exit(fn: Callable[[], None]) -> None:
    """Run ``fn`` at interpreter exit *before* thread-pool executors shut down (zarr's stores do their
    I/O through one), the way concurrent.futures itself registers; plain atexit runs too late."""
    import concurrent.futures.thread  # noqa: F401 - registered first, so it runs after ``fn``

    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(fn)
            return
    except RuntimeError:  # already shutting down
        return
    import atexit

    atexit.register(fn)


MAPS_HEADROOM = 0.125
"""Share of the host hand-off queue (``ATTN_OTEL_QUEUE_BYTES``) that captures with maps leave free."""


class ByteBudget:
    """Bytes held somewhere (host or device) by captures in flight, at most ``capacity``: ``reserve`` says
    no rather than wait.  With ``first_always``, one reservation is granted however large when nothing is
    held, so that a single capture bigger than the bound still goes through (device work, which is freed
    in stream order)."""

    def __init__(self, capacity: int, first_always: bool = False):
        self.capacity = int(capacity)
        self._first_always = first_always
        self._bytes = 0
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()

    def reserve(self, nbytes: int, headroom: int = 0) -> bool:
        """Hold ``nbytes`` if the bytes held stay within ``capacity - headroom`` (``headroom`` keeps room free
        for the reservations made without one)."""
        with self._lock:
            if self._bytes + nbytes > self.capacity - headroom and not (self._first_always and self._bytes <= 0):
                return False
            self._bytes += nbytes
            self._idle.clear()
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._bytes -= nbytes
            if self._bytes <= 0:
                self._idle.set()

    @property
    def pending_bytes(self) -> int:
        return self._bytes

    def wait_idle(self, timeout: float | None = None) -> bool:
        return self._idle.wait(timeout)


class Handoff:
    """Bounded (in bytes, ``ATTN_OTEL_QUEUE_BYTES``) queue from the engine loop to the writer threads, each
    of which hands its jobs to ``writers`` (a :class:`attn_otel.writers.WriterPool`): ``put`` never blocks; a capture whose bytes cannot be reserved
    is dropped and counted by the caller.  A written or dropped job's maps segment goes back to ``maps_pool`` (a :class:`attn_otel.hostmem.SegmentPool`).

    Maps (up to ``layers * heads * T * T * 2`` bytes each) may fill the queue only up to ``capacity -
    maps_headroom`` (:data:`MAPS_HEADROOM` of it kept free): a burst of maps waiting on the store then makes later
    maps fall back to metrics (``maps_queue_full``), but never drops a capture without maps (a few kB each)."""

    def __init__(self, config: Config, stats: Stats, writers: Any, maps_pool: Any, ranks: int = 1):
        self.stats = stats
        self.budget = ByteBudget(config.queue_bytes)
        self.capacity = self.budget.capacity
        self.maps_headroom = int(self.capacity * MAPS_HEADROOM)
        self._writers = writers
        self._maps_pool = maps_pool
        self._closing = 0.0
        self._q: queue.Queue[Job | None] = queue.Queue()
        self._threads = [threading.Thread(target=self._run, name=f"attn-otel-writer-{i}", daemon=True)
                         for i in range(writer_count(config, ranks))]
        for t in self._threads:
            t.start()
        at_exit(self._drain_at_exit)

    def reserve(self, nbytes: int, maps: bool = False) -> bool:
        """Hold a capture's bytes; one with maps leaves ``maps_headroom`` free."""
        return self.budget.reserve(nbytes, self.maps_headroom if maps else 0)

    def put(self, job: Job) -> None:
        self._q.put_nowait(job)

    def put_many(self, jobs: list[Job]) -> None:
        """Several jobs at once (a finish batch's): split among the writer threads, each part one queue item,
        which its thread writes in one message (:meth:`attn_otel.writers.WriterPool.write_many`), so that the
        batch wakes each thread once and costs the engine's process one round trip a part, not one a job."""
        if not jobs:
            return
        parts = min(len(self._threads), len(jobs))
        size = -(-len(jobs) // parts)
        for i in range(0, len(jobs), size):
            self._q.put_nowait(jobs[i:i + size])

    def release(self, nbytes: int) -> None:
        self.budget.release(nbytes)

    @property
    def pending_bytes(self) -> int:
        return self.budget.pending_bytes

    def _run(self) -> None:
        os_thread_name("attn-otel-write")
        while True:
            item = self._q.get()
            if item is None:
                return
            jobs = item if isinstance(item, list) else [item]
            try:
                if self._closing and time.monotonic() > self._closing:  # a hung store must not hang exit
                    self.stats.add("dropped", len(jobs), reason="shutdown")
                else:
                    self._writers.write_many(jobs)
            finally:
                for job in jobs:
                    self.release(job.nbytes)
                    self._maps_pool.release(job.maps_seg)

    def begin_closing(self, seconds: float | None = None) -> float:
        """From now on, exit is near: jobs still queued ``seconds`` (default EXIT_DRAIN_S) from the first call
        are dropped (``shutdown``), and a writer process that dies is not restarted.  Returns that deadline,
        shared by every step of the exit."""
        if not self._closing:
            self._closing = time.monotonic() + (EXIT_DRAIN_S if seconds is None else seconds)
            self._writers.closing = True
        return self._closing

    def _drain_at_exit(self) -> None:
        deadline = self.begin_closing()
        self.flush(max(0.0, deadline - time.monotonic()) + 0.1)

    def flush(self, timeout: float | None = None) -> bool:
        return self.budget.wait_idle(timeout)
