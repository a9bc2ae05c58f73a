"""attn-otel's own block table for windowed layers of a model with no full-attention KV-cache group.

vLLM's sliding-window KV-cache manager frees a request's blocks once they fall out of the window and gives them
to other requests while it still runs.  A windowed layer of a model that also has full-attention layers taps by
such a layer's slots (they keep every position until the request finishes: ``LayerSpec.slots_from``).  A model
whose every layer has a window (Mistral 7B v0.1) or chunks has no such group, so this keeps one: every position
of every running request gets a slot of its own here, in blocks of the window group's size, and the forward's
Q/K tap writes by that slot instead of vLLM's (a per-step table from vLLM's slot to this one, read in the graph).

To the rest of attn-otel the table is one more KV-cache group (index :attr:`group`, after vLLM's): the
adapter appends a request's blocks here to its per-group block ids, so planning, the finish-time gathers and
the capture stream's guard on reused blocks read it like any other group.

The pool has as many slots as the tap (the KV cache's token count): vLLM's window cache holds far more
positions in flight than that.  A request that finds no free block is not captured; it is counted as dropped
(``window_tap_full``), never mixed with another's rows.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import torch

from .slots import slots_of, upload


class ShadowBlocks:
    def __init__(self, group: int, num_slots: int, block_size: int, vllm_slots: dict[int, int], device) -> None:
        self.group = int(group)
        self.block_size = int(block_size)
        self.device = torch.device(device)
        self._free = list(range(int(num_slots) // self.block_size - 1, -1, -1))  # a stack: the lowest block first
        self._blocks: dict[str, list[int]] = {}
        self.lost: set[str] = set()  # requests some position of which found no slot: not captured
        # per windowed KV-cache group (of this block size): its vLLM slot -> this table's slot; -1: write nothing
        # (padding, or a request that is not captured).  Every token of a step gets its entry before the forward.
        self.tables = {int(g): torch.full((int(n) + 1,), -1, dtype=torch.int64, device=self.device)
                       for g, n in vllm_slots.items()}

    def free_blocks(self) -> int:
        return len(self._free)

    def schedule(self, items: Iterable[tuple[str, object, int, int]]) -> None:
        """This step's tokens ``(request id, tracked, first position, count)``: give their positions slots here
        (growing each request's blocks), set the table entries of the vLLM slots they are written to (in every
        windowed group), and put the request's blocks here at ``tracked.block_ids[group]``."""
        src: dict[int, list[np.ndarray]] = {g: [] for g in self.tables}
        dst: list[np.ndarray] = []
        for req_id, tracked, start, n in items:
            if n <= 0:
                continue
            for g in self.tables:  # the windowed groups share this block size (vLLM's hybrid allocator)
                src[g].append(slots_of(tracked.block_ids[g], self.block_size, start, n))
            mine = self._blocks.setdefault(req_id, [])
            need = -(-(start + n) // self.block_size) - len(mine)
            if req_id in self.lost or need > len(self._free):
                self.lost.add(req_id)
                dst.append(np.full(n, -1, dtype=np.int64))
            else:
                for _ in range(max(0, need)):
                    mine.append(self._free.pop())
                dst.append(slots_of(mine, self.block_size, start, n))
            ids = tracked.block_ids
            if len(ids) > self.group:
                ids[self.group] = mine
            else:
                while len(ids) < self.group:
                    ids.append([])
                ids.append(mine)
        if dst:
            to = np.concatenate(dst)
            for g, parts in src.items():
                pair = upload(np.stack([np.concatenate(parts), to]), self.device)
                self.tables[g].index_copy_(0, pair[0], pair[1])

    def release(self, req_ids: Sequence[str]) -> None:
        """Finished requests (after the capture work reading their blocks was enqueued and recorded with the
        capture stream's guard): their blocks go back to the pool."""
        for r in req_ids:
            self._free.extend(reversed(self._blocks.pop(r, [])))
            self.lost.discard(r)

    def map(self, slot_mapping: torch.Tensor, own_group: int) -> torch.Tensor:
        """The forward's slot mapping (vLLM's, of the windowed layer's own group) as this table's slots
        (-1 stays -1); graph-safe: a gather from the persistent table."""
        table = self.tables[own_group]
        return torch.where(slot_mapping >= 0, table[slot_mapping.clamp(min=0)], -1)
