"""KV-cache slot ids of a request's positions, and host index arrays moved to the device without a sync.

Shared by the device capture (:mod:`attn_otel.stream`), the finish-time kernels (:mod:`attn_otel.triton_metrics`)
and the finish paths (:mod:`attn_otel.finish`, :mod:`attn_otel.compute`); it imports nothing of theirs.
"""

from __future__ import annotations

import collections
import itertools
import threading
from typing import Sequence

import numpy as np
import torch

from .timing import wait_event

_ALIGN = 64


class _PinnedRing:
    """One pinned host buffer that small uploads go through in turn, so an upload is a NumPy copy and one
    asynchronous copy on the current stream (a fresh ``pin_memory()`` per upload went through torch's host
    allocator: about 2.8% of the engine loop's time under online load, the largest single item in
    run 17's profile, docs/benchmarks/history.md).  A region is written again only once the copy that read it
    is done: each upload records an event, checked before the region's bytes are reused (in practice long
    done: the ring holds hundreds of steps' uploads).  Thread-safe (the compute thread uploads too)."""

    def __init__(self, device: torch.device, nbytes: int = 32 << 20) -> None:
        self.device = device
        self.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.host = self.buf.numpy()
        self.size = nbytes
        self.head = 0
        self.inflight: collections.deque = collections.deque()  # (start, end, event), oldest first
        self.lock = threading.Lock()
        self.waits = 0  # uploads that found their region still being read (a host sync)

    def _free(self, start: int, end: int) -> None:
        # Copies on one stream finish in order, but uploads go to several streams (the engine's, the side
        # stream, the compute thread's): drop the done ones from the front, then check every one left.
        while self.inflight and self.inflight[0][2].query():
            self.inflight.popleft()
        for s, e, ev in self.inflight:
            if s < end and e > start and not ev.query():
                self.waits += 1
                ev.synchronize()

    def upload(self, a: np.ndarray) -> torch.Tensor:
        return self.upload_many([a])[0]

    def upload_many(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Several arrays in one copy: packed (16-byte aligned) into one region, returned as views of one
        device buffer."""
        offs, total = [], 0
        for a in arrays:
            offs.append(total)
            total = -(-(total + a.nbytes) // 16) * 16
        with self.lock:
            if self.head + total > self.size:
                self.head = 0
            start, end = self.head, self.head + total
            self._free(start, end)
            for a, o in zip(arrays, offs):
                if a.nbytes:
                    self.host[start + o:start + o + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
            out = torch.empty(total, dtype=torch.uint8, device=self.device)
            out.copy_(self.buf[start:end], non_blocking=True)
            ev = wait_event()  # waited on only where the ring comes round to a copy still in flight
            ev.record()
            self.inflight.append((start, end, ev))
            self.head = -(-end // _ALIGN) * _ALIGN
        return [out[o:o + a.nbytes].view(_torch_dtype(a.dtype)).view(a.shape) for a, o in zip(arrays, offs)]


_DTYPES: dict = {}


def _torch_dtype(dt: np.dtype) -> torch.dtype:
    t = _DTYPES.get(dt)
    if t is None:
        t = _DTYPES[dt] = torch.from_numpy(np.empty(0, dtype=dt)).dtype
    return t


_RINGS: dict[torch.device, _PinnedRing] = {}
RING_MAX = 4 << 20  # the largest upload through the pinned ring (an eighth of it): a flush's key slots for 100
# requests of 4k tokens (3.2 MB of int64) are one; only larger ones pin memory of their own
_RINGS_LOCK = threading.Lock()


def _ring(device: torch.device) -> _PinnedRing:
    ring = _RINGS.get(device)
    if ring is None:
        with _RINGS_LOCK:
            ring = _RINGS.setdefault(device, _PinnedRing(device))
    return ring


def ring_waits() -> int:
    """Uploads, on every device, that found their region of the pinned ring still being read: each a host sync."""
    return sum(r.waits for r in list(_RINGS.values()))


def upload(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` with no sync: through pinned memory, non-blocking, on a GPU (a blocking
    copy would wait for, and so drain, the work the engine has queued ahead)."""
    a = np.ascontiguousarray(a)
    if device.type != "cuda":
        return torch.from_numpy(a).to(device)
    if a.size == 0 or a.nbytes > RING_MAX or a.dtype.hasobject:  # rare large ones: torch's own pinned copy
        return torch.from_numpy(a).pin_memory().to(device, non_blocking=True)
    return _ring(device).upload(a)


def upload_many(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """:func:`upload` of several arrays in one host-to-device copy (one launch instead of one per array)."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    if device.type != "cuda" or sum(a.nbytes for a in arrays) > RING_MAX or any(a.dtype.hasobject for a in arrays):
        return [upload(a, device) for a in arrays]
    return _ring(device).upload_many(arrays)


def slots_of(block_ids: Sequence[int], block_size: int, start: int, n: int) -> np.ndarray:
    """KV-cache slots of positions ``start .. start + n - 1`` of a request with these blocks."""
    if n == 1:
        return np.asarray([block_ids[start // block_size] * block_size + start % block_size], dtype=np.int64)
    pos = np.arange(start, start + n, dtype=np.int64)
    return np.asarray(block_ids, dtype=np.int64)[pos // block_size] * block_size + pos % block_size


def slots_many(block_lists: Sequence[Sequence[int]], block_size: int, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`slots_of` of positions ``0 .. ends[b] - 1`` for each request ``b`` (its blocks
    ``block_lists[b]``), concatenated in one vectorised pass: ``(slots, cu)`` with request ``b``'s slots at
    ``slots[cu[b]:cu[b + 1]]``."""
    ends = np.asarray(ends, dtype=np.int64)
    nb = np.fromiter(map(len, block_lists), dtype=np.int64, count=len(block_lists))
    flat = np.fromiter(itertools.chain.from_iterable(block_lists), dtype=np.int64, count=int(nb.sum()))
    cu = np.zeros(len(ends) + 1, dtype=np.int64)
    np.cumsum(ends, out=cu[1:])
    pos = np.arange(cu[-1], dtype=np.int64) - np.repeat(cu[:-1], ends)
    first_block = np.repeat(np.cumsum(nb) - nb, ends)
    return flat[first_block + pos // block_size] * block_size + pos % block_size, cu


def blocks_many(block_lists: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """The block ids of several requests, concatenated: ``(blocks, cu)`` with request ``b``'s at
    ``blocks[cu[b]:cu[b + 1]]``.  What the flush kernel reads in place of :func:`slots_many`'s slots (it finds
    position ``p``'s slot in block ``p // block_size`` itself): one entry a block, not a position, so a flush of
    a hundred requests of a thousand tokens builds and uploads about 6,000 entries instead of 100,000."""
    nb = np.fromiter(map(len, block_lists), dtype=np.int64, count=len(block_lists))
    cu = np.zeros(len(block_lists) + 1, dtype=np.int64)
    np.cumsum(nb, out=cu[1:])
    flat = np.fromiter(itertools.chain.from_iterable(block_lists), dtype=np.int64, count=int(cu[-1]))
    return flat, cu
