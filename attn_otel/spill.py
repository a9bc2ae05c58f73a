"""A finished request's last KV-cache block, copied out, so that its capture can wait for a batch.

vLLM puts a freed block that has no prefix-cache hash (a request's last, partly filled block) at the head of its
free queue (``BlockPool.free_blocks``: ``prepend_n`` in 0.26, "evict first" in 0.32), so the next allocation,
usually the next step's, gives it to another request.  The batched finish (:mod:`attn_otel.deferred`) must take
a request's capture work before a forward writes one of its blocks, so under load nearly every batch held one
request (run 22 on an H100: ``finish_batch_sizes`` p50 1; the CPU build's ``bench/finish_batch.py`` shows the
same, each batch taken for ``reuse``).

Where a capture reads nothing but the streamed layers' per-slot metric rows (no Q/K-tapped layer, not planned
for maps, no block table of attn-otel's own), the work that must come before that reuse is small: the request's
pending rows are flushed (they read its keys) and its last block's metric rows are copied to a spill block, a
block of the stream's metrics buffer past its real slots (:class:`SpillBlocks`).  The request's capture then reads
the spill block in place of the real one, through a block id past vLLM's, which vLLM never hands out; its other
blocks are full, carry a hash and go to the tail of vLLM's free queue, and stay marked for the reuse rule until
the batch is taken.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from .slots import slots_of, upload_many

SPILL_BLOCKS = 72  # a full batch (attn_otel.deferred's 64 requests) and a step's more
SPILL_MAX_SLOTS = 4096  # fewer blocks where blocks are large (the CPU build's 128 tokens: 32)


def spill_slots(block_size: int) -> int:
    """The metric-row slots of a stream's spill blocks, for this KV-cache block size."""
    bs = int(block_size)
    return max(1, min(SPILL_BLOCKS, SPILL_MAX_SLOTS // bs)) * bs


def spill_bytes(layers: Sequence[Any], block_size: int, width: int = 8) -> int:
    """A bound of the device bytes spill blocks add to a stream of these layers (float16 rows of at most
    ``width`` metrics, the spill slots and up to a block's more for their alignment)."""
    return (spill_slots(block_size) + int(block_size)) * width * sum(int(s.num_heads) for s in layers) * 2


def spill_base(num_slots: int, block_size: int) -> int:
    """The first spill slot: past the ``num_slots`` real slots and the padding slot, at a block boundary."""
    return -(-(int(num_slots) + 1) // int(block_size)) * int(block_size)


class SpillBlocks:
    """Spill blocks of a stream's per-slot metrics buffer (``stream.metrics [L, slots, rows, H]``, whose entries
    from ``stream.spill_base`` on are this pool's), handed out as virtual block ids."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.block_size = int(stream.block_size)
        self.first = int(stream.spill_base) // self.block_size  # the virtual id of the first spill block
        n = (int(stream.metrics.shape[1]) - int(stream.spill_base)) // self.block_size
        self._free = list(range(self.first + n - 1, self.first - 1, -1))  # a stack: the lowest id first
        self.spilled = 0  # blocks copied out so far (stats)

    def free(self) -> int:
        return len(self._free)

    def copy(self, blocks: Sequence[int]) -> list[int]:
        """Copy these real blocks' metric rows (every streamed layer) to spill blocks, on the capture stream
        after the work enqueued there so far (the flush that computed their last rows); returns the virtual ids,
        as many as there are free spill blocks (the first ones)."""
        n = min(len(blocks), len(self._free))
        if n == 0:
            return []
        virtual = [self._free.pop() for _ in range(n)]
        bs = self.block_size
        src, dst = slots_of(blocks[:n], bs, 0, n * bs), slots_of(virtual, bs, 0, n * bs)  # every slot, in order
        side, m = self.stream.side, self.stream.metrics
        side.begin()
        with side.context():
            s, d = upload_many([src, dst], m.device)
            m.index_copy_(1, d, m.index_select(1, s))
        self.spilled += n
        return virtual

    def release(self, virtual: Iterable[int]) -> None:
        """Spill blocks whose captures are enqueued (a later copy to them is ordered after their gathers on the
        capture stream)."""
        self._free.extend(int(v) for v in virtual)
