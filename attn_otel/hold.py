"""A finished request's uncached KV-cache blocks, held by vLLM's scheduler for one more step, so that its capture
work can run after the next forward's launch instead of before it.

vLLM puts a freed block that has no prefix-cache hash (a request's last, partly filled block; every block where
prefix caching is off) at the head of its free queue, so the next step's allocation usually gives it to another
request (attn_otel.spill).  The worker learns that a request finished from the next step's
``SchedulerOutput.finished_req_ids``; where that step's forward writes one of the request's blocks, the
request's pending rows must be flushed and its last block spilled before that forward is launched, on the
engine loop's critical path (run 30 on an H100: 718 of 797 such steps).

:class:`BlockHold` keeps those blocks out of the free queue through the one scheduler step that hands the
finished ids to the worker, and gives them back at the start of the step after (at once where that step
schedules no token: the worker then does the work before its forward, and an idle engine keeps no block).
The worker's check stays (``vllm_adapter._spill_now_or_later``): a block given out anyway (a hashed block
evicted at once, or no hold) still puts the work before the forward.

It holds only while vLLM's free blocks exceed the held ones by ``margin``: enough for any one step's
allocations and the admission checks of a new request's whole sequence, so that no allocation fails that
would not have failed anyway and vLLM's scheduling decisions stay its own.  Blocks with a hash are freed at once,
in vLLM's order, so the prefix cache's eviction order is unchanged.  vLLM-free: the adapter passes the
scheduler's block pool and the blocks (objects with ``block_hash``, ``is_null`` and ``ref_cnt``).
"""

from __future__ import annotations

from typing import Any, Sequence


class BlockHold:
    def __init__(self, margin: int) -> None:
        self.margin = int(margin)
        self._pending: list[Any] = []  # freed since the last schedule(): their ids go out with the next one
        self._ready: list[Any] = []  # held through the current schedule(): given back at the next
        self.held = 0  # blocks held now
        self.holds = self.skipped = 0  # requests whose blocks were held, or freed at once for want of room

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
        """At the start of a scheduler step: the blocks held through the last one go back; those freed since
        are held through this one."""
        self._give_back(pool)
        self._ready, self._pending = self._pending, []

    def after_schedule(self, pool: Any, scheduled_tokens: int) -> None:
        """A step that schedules no token: its held blocks go back now (the worker does their work before the
        step's forward, and an engine going idle steps no more)."""
        if scheduled_tokens == 0:
            self._give_back(pool)

    def release_all(self, pool: Any) -> None:
        """Every held block back now (before vLLM's prefix-cache reset, which fails while a block is in use)."""
        self.before_schedule(pool)
        self._give_back(pool)

    def _give_back(self, pool: Any) -> None:
        if self._ready:
            blocks, self._ready = self._ready, []
            self.held -= len(blocks)
            pool.free_blocks(blocks)


def margin_blocks(max_model_len: int, max_num_scheduled_tokens: int, max_num_seqs: int, block_size: int,
                  groups: int, watermark_blocks: int = 0) -> int:
    """Free blocks to leave beside the held ones: per KV-cache group a whole sequence (a new request's admission
    check), one step's scheduled tokens and a block for each running request, and vLLM's watermark."""
    bs = max(1, int(block_size))
    per_group = -(-int(max_model_len) // bs) + -(-int(max_num_scheduled_tokens) // bs) + int(max_num_seqs)
    return max(1, int(groups)) * per_group + int(watermark_blocks)
