"""Finished requests' capture work, batched over a few engine steps instead of run in the step each finishes.

A finished request's capture reads its KV-cache blocks (keys, values, per-slot metric rows) and, for the
streamed layers, computes its pending rows first; all of that must be enqueued before any forward writes
those blocks for another request.  vLLM hands a finished request's blocks back to its free queue, and it gives
them out again only when it allocates them to a request, which the scheduler's output of that step says.  So
the work can wait: :class:`DeferredFinish` keeps the finished requests of several steps, marks their blocks,
and says when they must be taken (:meth:`DeferredFinish.due`):

* a block of theirs is among the blocks this step gives a request to write (newly allocated, or past a new
  request's cached prefix): vLLM is reusing it;
* the step schedules no token: the engine is going idle, and nothing would come back to take them;
* one of them was planned for maps and this step's planned requests may want more of the map tap's fixed
  rows than are free (:meth:`attn_otel.tap.MapTap.short`; the held ones' rows come back only with their
  batch), or there are ``max_requests`` of them, or the oldest has waited ``max_steps`` steps.

A finished maps request used to be taken in the step it finished, rows wanted or not: run 50's 512+256 phases
took 9 of their 27 batches for it, as many as by the count, most in the run's tail where a batch holds the
engine loop past a short forward.

Where the count or a request planned for maps says so (and no held block is given out again), the batch is a
``chunk`` of them: every one planned for maps and the oldest others, the rest left for a later step.
Lock-stepped requests (a fixed-length workload, a burst) finish in groups in a few steps as the batch empties,
where a step's forward is short, and a batch of 64 held the engine loop past it (run 50's profile of 512+256:
the GPU idle 5-12 ms before and in each of the tail's steps that took one, most of the default's idle time).
Half a batch a step was to fit in the forward's shadow, but run 50 (H200, 512+256, one call) measured chunks of
32 at x0.979 of capture off against whole batches' x0.982, with 35 batches against 27 and more host time, so
``chunk`` is 0 (whole batches) unless ``ATTN_OTEL_FINISH_BATCH_CHUNK`` sets it.  The other rules take them all
(the reuse rule must, before the forward; an idle engine has no forward to hide behind; and the age bounds how
long any waits).

Taking them all at once costs each step's fixed work (uploads, launches, the flush's bookkeeping) once per
batch, not once per step that finishes a request (docs/benchmarks/history.md, run 19: the finish work was 5% of
vLLM's engine-loop time under online load).  vLLM-free: the adapter feeds it block ids.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Sequence

import numpy as np


class DeferredFinish:
    def __init__(self, max_steps: int = 16, max_requests: int = 64, chunk: int = 0) -> None:
        self.max_steps = int(max_steps)
        self.max_requests = int(max_requests)
        self.chunk = int(chunk)  # requests a batch due by its count or for maps takes (0: all)
        self.req_ids: list[str] = []  # every finished id of the steps held (the per-id cleanups take them)
        self.finished: list[Any] = []  # their FinishedRequest records (the ones with a capture to make)
        self._is_maps: list[bool] = []  # per record of ``finished``: planned for maps
        self._held: set[int] = set()  # the held requests' block ids (a set: a step looks up a few blocks)
        self._age = 0  # steps since the oldest held one finished
        self.batches = 0  # batches taken (stats)
        self.reason = ""  # why the last due() said yes: idle, maps, count, age or reuse (stats)
        self.reused = False  # whether the last due() found a held block among the step's (whatever its reason)
        self.limit: int | None = None  # what the batch due() said yes to may take (None: everything held)

    def __len__(self) -> int:
        return len(self.req_ids)

    @property
    def maps(self) -> bool:
        """One of them was planned for maps."""
        return any(self._is_maps)

    def add(self, req_ids: Iterable[str], finished: Sequence[Any], maps: bool | Sequence[bool] = False) -> None:
        """This step's finished ids, and the records of those with a capture to make (``block_ids`` per
        KV-cache group); ``maps``: whether each record was planned for maps (one bool: all of them or none)."""
        ids = list(req_ids)
        if not ids:
            return
        if not self.req_ids:
            self._age = 0
        flags = [bool(maps)] * len(finished) if isinstance(maps, (bool, int)) else [bool(m) for m in maps]
        if len(flags) != len(finished):
            raise ValueError(f"{len(flags)} maps flags for {len(finished)} records")
        self.req_ids.extend(ids)
        self.finished.extend(finished)
        self._is_maps.extend(flags)
        held = self._held
        for f in finished:
            held.update(itertools.chain.from_iterable(f.block_ids))

    def due(self, fresh: np.ndarray | Iterable[Iterable[int]], idle: bool, rows_short: bool = True) -> bool:
        """Whether the held requests must be taken before this step's forward: ``fresh`` are the block ids
        this step's requests may write that no earlier step gave them (an array, or lists of them);
        ``idle``: the step schedules no token; ``rows_short``: this step may want map-tap rows that the held
        maps requests have (only then are they due for being maps requests)."""
        self.reused = False
        self.limit = None
        if not self.req_ids:
            return False
        self._age += 1
        if self._held:
            ids = fresh.tolist() if isinstance(fresh, np.ndarray) else itertools.chain.from_iterable(fresh)
            self.reused = any(map(self._held.__contains__, ids))  # then the work must come before the forward
        if idle:
            self.reason = "idle"
        elif rows_short and self.maps:
            self.reason = "maps"
        elif len(self.finished) >= self.max_requests:
            self.reason = "count"
        elif self._age > self.max_steps:
            self.reason = "age"
        elif self.reused:
            self.reason = "reuse"
        else:
            return False
        if self.reason in ("maps", "count") and not self.reused and self.chunk > 0:
            k = max(self.chunk, sum(self._is_maps))
            if k < len(self.finished):
                self.limit = k
        return True

    def take(self, limit: int | None = None) -> tuple[list[str], list[Any]]:
        """Everything held, in finishing order; the blocks are no longer marked.  ``limit`` (what :meth:`due`
        left in ``self.limit``): ``limit`` records (each with a ``request_id``), every one planned for maps and
        the oldest others, and every id without a record, in finishing order; the others stay held, their blocks
        marked, the clock running from the oldest."""
        if limit is not None and 0 < limit < len(self.finished):
            room = limit - sum(self._is_maps)
            pick = []
            for m in self._is_maps:
                pick.append(m or room > 0)
                room -= not m
            now = [f for f, p in zip(self.finished, pick) if p]
            rest = [f for f, p in zip(self.finished, pick) if not p]
            later = {f.request_id for f in rest}
            ids = [r for r in self.req_ids if r not in later]
            self.req_ids = [r for r in self.req_ids if r in later]
            self.finished = rest
            self._is_maps = [False] * len(rest)
            self._held = set(itertools.chain.from_iterable(b for f in rest for b in f.block_ids))
            self.batches += 1
            return ids, now
        ids, finished = self.req_ids, self.finished
        self._held.clear()
        self.req_ids, self.finished, self._is_maps = [], [], []
        self.batches += 1
        return ids, finished


_NONE = np.zeros(0, dtype=np.int64)
_NONE.flags.writeable = False


def flat_blocks(block_lists: Iterable[Sequence[int]]) -> np.ndarray:
    """Block ids of several lists as one int64 array."""
    if isinstance(block_lists, (list, tuple)) and not block_lists:
        return _NONE
    return np.fromiter(itertools.chain.from_iterable(block_lists), dtype=np.int64)
