"""A finished request's uncached KV-cache blocks, held by vLLM's scheduler until the request's finish batch is due,
so that its capture work joins that batch instead of costing the engine loop a flush and a spill of its own.

vLLM puts a freed block that has no prefix-cache hash (a request's last, partly filled block; every block where
prefix caching is off) at the head of its free queue, so the next step's allocation usually gives it to another
request (attn_otel.spill).  The worker learns that a request finished from the next step's
``SchedulerOutput.finished_req_ids``; where that step's forward writes one of the request's blocks, the
request's pending rows must be flushed and its last block spilled before that forward is launched: one flush,
one copy and their bookkeeping on the engine loop for nearly every step that finishes a request (run 29 on an
H100: 1.3 s of attn-otel's 3.8 s of host time a server life).

:class:`BlockHold` keeps those blocks out of the free queue for ``steps`` scheduler steps, counted from the one
that hands the finished ids to the worker.  The worker (``vllm_adapter._spill_or_hold``) then leaves the request
unspilled with its finish batch (attn_otel.deferred), which it takes after a step's forward is launched once
the batch is old or large enough: one flush of every held request's rows and one launch of their captures.
``steps`` is the batch's age limit and a little more, so the worker has taken the batch before its blocks go
back.  The worker's reuse rule stays: a block given out anyway (no room to hold, a hashed block evicted, the
hold given back early) takes the batch before the forward that writes it, as without the hold.

It holds only while vLLM's free blocks exceed the held ones by ``margin``: enough for any one step's
allocations and the admission checks of a new request's whole sequence, so that no allocation fails that
would not have failed anyway and vLLM's scheduling decisions stay its own.  Where the free blocks fall below
that with blocks held, the oldest go back at the next step until it holds again.  Blocks with a hash are freed at
once, in vLLM's order, so the prefix cache's eviction order is unchanged.  A step that schedules no token gives
everything back (the worker takes the batch before it: an idle engine holds nothing).  vLLM-free: the adapter
passes the scheduler's block pool and the blocks (objects with ``block_hash``, ``is_null`` and ``ref_cnt``).
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, Sequence


_HOLDS: "weakref.WeakSet[BlockHold]" = weakref.WeakSet()  # the live schedulers' holds in this process


def counts() -> dict[str, int] | None:
    """The holds of this process, summed, for the stats (``None`` where no scheduler here holds blocks, as in
    a worker process of a multiprocess executor): requests whose blocks were held, ``skipped`` for want of
    room, blocks given back ``early`` for want of room, and blocks ``held`` now."""
    if not _HOLDS:
        return None
    return {k: sum(int(getattr(h, k)) for h in _HOLDS) for k in ("holds", "skipped", "early", "held")}


class BlockHold:
    def __init__(self, margin: int, steps: int = 1, register: bool = False) -> None:
        self.margin = int(margin)
        self.steps = max(1, int(steps))
        self._pending: list[Any] = []  # freed since the last schedule(): their ids go out with the next one
        self._held: collections.deque[list] = collections.deque()  # [schedules held through, blocks], oldest first
        self.held = 0  # blocks held now
        self.holds = self.skipped = 0  # requests whose blocks were held, or freed at once for want of room
        self.early = 0  # blocks given back before their steps were up, for want of room
        if register:
            _HOLDS.add(self)

    def free(self, pool: Any, blocks: Sequence[Any]) -> None:
        """A finished request's blocks (allocation order, as ``pop_blocks_for_free`` gives them): those with a
        hash freed now, the others held where the pool has room, else freed now too."""
        caching = bool(getattr(pool, "enable_caching", True))
        keep = [b for b in blocks if not getattr(b, "is_null", False)
                and (getattr(b, "block_hash", None) is None or not caching)]
        if not keep or pool.get_num_free_blocks() < self.held + len(keep) + self.margin:
            if keep:
                self.skipped += 1
            pool.free_blocks(reversed(list(blocks)))
            return
        kept = {id(b) for b in keep}
        pool.free_blocks(reversed([b for b in blocks if id(b) not in kept]))
        self._pending.extend(reversed(keep))  # tail first, as vLLM frees them
        self.held += len(keep)
        self.holds += 1

    def before_schedule(self, pool: Any) -> None:
        """At the start of a scheduler step: the blocks held through ``steps`` steps go back, and older ones
        too while the pool's free blocks are under the margin; those freed since the last step are held from
        this one on."""
        for group in self._held:
            group[0] += 1
        while self._held and self._held[0][0] >= self.steps:
            self._give_back(pool, self._held.popleft()[1])
        while self._held and pool.get_num_free_blocks() < self.held + self.margin:
            blocks = self._held.popleft()[1]
            self.early += len(blocks)
            self._give_back(pool, blocks)
        if self._pending:
            self._held.append([0, self._pending])
            self._pending = []

    def after_schedule(self, pool: Any, scheduled_tokens: int) -> None:
        """A step that schedules no token: its held blocks go back now (the worker takes their batch before the
        step's forward, and an engine going idle steps no more)."""
        if scheduled_tokens == 0:
            self._give_back_held(pool)

    def release_all(self, pool: Any) -> None:
        """Every held block back now (before vLLM's prefix-cache reset, which fails while a block is in use)."""
        if self._pending:
            self._held.append([0, self._pending])
            self._pending = []
        self._give_back_held(pool)

    def _give_back_held(self, pool: Any) -> None:
        while self._held:
            self._give_back(pool, self._held.popleft()[1])

    def _give_back(self, pool: Any, blocks: list) -> None:
        if blocks:
            self.held -= len(blocks)
            pool.free_blocks(blocks)


def margin_blocks(max_model_len: int, max_num_scheduled_tokens: int, max_num_seqs: int, block_size: int,
                  groups: int, watermark_blocks: int = 0) -> int:
    """Free blocks to leave beside the held ones: per KV-cache group a whole sequence (a new request's admission
    check), one step's scheduled tokens and a block for each running request, and vLLM's watermark."""
    bs = max(1, int(block_size))
    per_group = -(-int(max_model_len) // bs) + -(-int(max_num_scheduled_tokens) // bs) + int(max_num_seqs)
    return max(1, int(groups)) * per_group + int(watermark_blocks)
