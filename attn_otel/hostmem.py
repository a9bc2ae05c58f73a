"""Host memory for attention maps, set up once and reused, so that a maps capture never pins or maps fresh
memory in the engine's process while it serves.

A maps capture moves hundreds of MB to the host (Llama-3-8B, 4 map layers, 767 tokens: 150 MB).  Two
simpler ways to do that each cost the engine throughput (docs/benchmarks/history.md, run 11):

* a pinned host buffer per capture: ``cudaHostAlloc`` of that size holds a driver lock for up to 129 ms,
  and the engine thread's CUDA calls wait on it (GPU idle);
* pageable host memory: the driver stages the copy itself, and maps for 1% of requests measured 0.955x of
  capture-off throughput with it (0.990x for metrics alone in the same call).

Here the device-to-host copies go through one small pinned :class:`Staging` buffer (allocated at engine
start), two halves in turn, and land in a :class:`SegmentPool` segment: shared memory that the writer
process reads in place (no copy into a message segment) and that is kept mapped for the next capture.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import torch

logger = logging.getLogger("attn_otel")

STAGING_BYTES = 16 << 20  # each of the two halves
IDLE_S = 60.0  # a free segment unused this long is given back to the system (SegmentPool.trim)


class Staging:
    """A pinned buffer of two halves for device-to-host copies of large tensors, one caller at a time."""

    def __init__(self, half_bytes: int = STAGING_BYTES):
        self.half_bytes = int(half_bytes)
        self._bufs: list[torch.Tensor] = []

    def allocate(self) -> None:
        """Pin the buffer now (at engine start), not on the first maps capture."""
        if not self._bufs:
            self._bufs = [torch.empty(self.half_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]

    def copy(self, src: torch.Tensor, dst: torch.Tensor, stream: Any) -> None:
        """Copy the device tensor ``src`` into the host tensor ``dst`` (contiguous, same size and dtype),
        after the work already on ``stream``; returns when ``dst`` holds it.  The copy of one half to the
        host overlaps the device's copy into the other."""
        if src.dtype != dst.dtype or src.numel() != dst.numel() or not dst.is_contiguous():
            raise ValueError(f"cannot copy {src.dtype}{tuple(src.shape)} into {dst.dtype}{tuple(dst.shape)}")
        self.allocate()
        s = src.contiguous().reshape(-1).view(torch.uint8)
        d = dst.reshape(-1).view(torch.uint8)
        n = s.numel()
        pending: list[tuple[Any, torch.Tensor, torch.Tensor] | None] = [None, None]
        try:
            for i, off in enumerate(range(0, n, self.half_bytes)):
                half = i & 1
                if pending[half] is not None:
                    self._land(pending[half])
                    pending[half] = None
                m = min(self.half_bytes, n - off)
                buf = self._bufs[half][:m]
                buf.copy_(s[off: off + m], non_blocking=True)
                done = torch.cuda.Event(blocking=True)  # this thread sleeps, not spins, until it is done
                done.record(stream)
                pending[half] = (done, d[off: off + m], buf)
            for half in (0, 1):
                if pending[half] is not None:
                    self._land(pending[half])
                    pending[half] = None
        finally:
            for p in pending:  # an error part way: the halves must not be reused while a copy is in flight
                if p is not None:
                    p[0].synchronize()

    @staticmethod
    def _land(p: tuple[Any, torch.Tensor, torch.Tensor]) -> None:
        done, dst, buf = p
        done.synchronize()
        dst.copy_(buf)  # host to host; torch releases the GIL for it


class Segment:
    """One shared-memory segment of the pool."""

    def __init__(self, size: int):
        from multiprocessing import shared_memory

        self.shm = shared_memory.SharedMemory(create=True, size=size)
        self.size = size
        self.released = 0.0  # when it last went back to the pool (time.monotonic)

    @property
    def name(self) -> str:
        return self.shm.name

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor over the start of the segment (valid while the segment lives)."""
        return torch.frombuffer(self.shm.buf, dtype=dtype, count=math.prod(shape)).view(shape)

    def destroy(self) -> None:
        try:
            self.shm.close()
        except BufferError:  # a view still alive: the mapping goes with the process
            pass
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass


def _rounded(nbytes: int) -> int:
    """Sizes in steps of 1/8 of their power of two (at least 1 MiB): requests of nearby lengths share."""
    n = max(int(nbytes), 1 << 20)
    step = 1 << max(0, n.bit_length() - 4)
    return -(-n // step) * step


class SegmentPool:
    """Shared-memory segments for maps, handed out and taken back.  Free ones stay mapped for the next
    capture while all the pool holds (out and free) is at most ``keep_bytes``: the segments out are maps
    already bounded by the hand-off (``ATTN_OTEL_QUEUE_BYTES``), so the free ones never add to that bound.
    A free segment unused for ``idle_s`` goes at the next :meth:`trim` (the compute thread calls it when it
    has nothing to do), so a burst of maps captures does not hold memory for good.  Every segment it made is unlinked by :meth:`close` (or, for one still
    out at exit, by Python's resource tracker)."""

    def __init__(self, keep_bytes: int, idle_s: float = IDLE_S):
        self.keep_bytes = int(keep_bytes)
        self.idle_s = float(idle_s)
        self._free: list[Segment] = []  # oldest release first
        self._out: set[Segment] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.created = 0

    def acquire(self, nbytes: int) -> Segment | None:
        """A segment of at least ``nbytes``: a free one that fits, or a new one; None when none can be made
        (the caller falls back to ordinary memory)."""
        with self._lock:
            if self._closed:
                return None
            fits = [s for s in self._free if s.size >= nbytes]
            if fits:
                seg = min(fits, key=lambda s: s.size)
                self._free.remove(seg)
                self._out.add(seg)
                return seg
        try:
            seg = Segment(_rounded(nbytes))
        except OSError as e:
            logger.warning("attn-otel: no shared-memory segment of %d bytes for maps (%s); using process memory",
                           nbytes, e)
            return None
        with self._lock:
            self.created += 1
            self._out.add(seg)
        return seg

    def release(self, seg: Segment | None) -> None:
        if seg is None:
            return
        drop: list[Segment] = []
        with self._lock:
            self._out.discard(seg)
            if self._closed:
                drop.append(seg)
            else:
                seg.released = time.monotonic()
                self._free.append(seg)
                held = sum(s.size for s in self._free) + sum(s.size for s in self._out)
                while self._free and held > self.keep_bytes:  # keep the newest
                    held -= self._free[0].size
                    drop.append(self._free.pop(0))
        for s in drop:
            s.destroy()

    def trim(self, now: float | None = None) -> int:
        """Give back the free segments unused for ``idle_s``; returns how many went."""
        now = time.monotonic() if now is None else now
        with self._lock:
            # released + idle_s <= now, not now - released >= idle_s: (t + 60.0) - t can round to 59.99999999
            drop = [s for s in self._free if s.released + self.idle_s <= now]
            self._free = [s for s in self._free if s not in drop]
        for s in drop:
            s.destroy()
        return len(drop)

    def free_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._free)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            drop = self._free + list(self._out)
            self._free, self._out = [], set()
        for s in drop:
            s.destroy()
