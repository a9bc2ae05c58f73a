"""Direct rows: a prefill chunk's per-row metrics of the streamed layers, computed in the forward.

The query ring (:class:`attn_otel.stream.MetricsStream`) must hold every token a forward writes until a flush
computes its rows, so it was sized by the scheduler's step (16,384 tokens offline on an H100: 4.3 GiB on all 32
layers of an 8B model).  But a prefill chunk's rows are compute-bound, like the attention itself, and gain
nothing from waiting: only decode rows do (a flush reads a request's keys once for many of its decode steps).
So, with ``ATTN_OTEL_STREAM_DIRECT``, a request's chunk of more than a decode step's tokens (1, or 1 + the
speculative tokens) with nothing pending before it is **direct**:

* before the forward the engine loop uploads a plan: the chunks' key slots and terms, as a flush would;
* the forward's first streamed layer marks the plan's tokens in the stream's slot -> row table, where each gets
  its index in the forward, and gives ring rows, in order from the row counter, to the other tokens only;
* after each streamed layer's attention (its keys are in the cache then) the flush kernel computes the direct
  rows from the forward's own queries into the per-slot buffer (:meth:`DirectRows.run`): on the side stream
  (``ATTN_OTEL_DIRECT_STREAM=side``), which waits for that layer's attention and nothing after it,
  so the forward's later layers and the next forward run beside the kernel; or on the engine's stream, in the
  forward's order (``engine``, the default, and always in a forward replayed as PIECEWISE CUDA graphs: its
  queries are in the graphs' own memory pool, which the next piece writes over).  Beside the forward the
  kernel's inputs (the forward's queries, the plan's uploads) are marked as used on the side stream, so torch's
  allocator gives their memory to nothing else before it is done; the blocks it reads are the running requests'
  own, and where one goes back to vLLM (finished, preempted) the capture work that follows on the side stream is
  what a forward that writes it waits for (:class:`attn_otel.stream.Side`).

The ring then holds decode tokens only, and is sized by ``max_num_seqs`` (``vllm_adapter._ring_rows``).  This
needs the attention of a forward with a prefill chunk to run eagerly, where the taps see the plan: vLLM's
PIECEWISE graphs for mixed batches.  A plan no tap took (that forward ran as a CUDA graph after all, whose
captured taps write every token to the ring) becomes pending ring rows (:meth:`DirectRows.settle`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Sequence

import numpy as np
import torch

from . import triton_metrics
from .slots import blocks_many, slots_many, slots_of
from .timing import DeviceTimer


@dataclasses.dataclass
class _Plan:
    """One step's direct rows: the requests, their rows' key slots, and what the kernel reads, uploaded
    before the forward."""

    items: list  # (live, first position, count)
    head: int  # the ring's row count before this step (MetricsStream._head)
    slots: torch.Tensor  # the direct rows' key slots, on the device
    args: tuple  # the flush kernel's arguments for them (FlushKernels.run_direct)
    used: bool = False  # the forward's first streamed layer took it (else it ran as a CUDA graph: see settle)
    side: bool | None = None  # its kernels beside the forward (decided at its first layer: DirectRows.run)
    queries: dict = dataclasses.field(default_factory=dict)  # layer -> the forward's queries, until run()


class DirectRows:
    """A stream's direct rows: the plan of each step (:meth:`take`), the forward's part (:meth:`write`,
    :meth:`run`) and the bookkeeping after it (:meth:`settle`).  ``min`` is the most tokens a decode step's
    chunk has; None: off (the adapter sets it where forwards with a prefill chunk run their attention
    eagerly)."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.min: int | None = None
        self.beside = False  # the kernels on the side stream (ATTN_OTEL_DIRECT_STREAM=side; the adapter sets it)
        # whether this forward runs with no CUDA graph, asked once a forward where beside (the adapter gives
        # vllm_adapter._uncaptured_forward: a PIECEWISE replay's queries are in the graphs' own memory pool)
        self.uncaptured: Callable[[], bool] = lambda: True
        # beside: the most tokens a forward replayed as CUDA graphs has (vLLM's largest graph, at most the ring's
        # rows; the adapter sets it): a step of no more has no plan, its chunks' rows go through the ring (written
        # in the graphs, computed by flushes on the side stream) rather than on vLLM's stream in the forward
        self.graphed = 0
        self.plan: _Plan | None = None
        self.ring_index: torch.Tensor | None = None  # this forward's ring row per token (-1: padding row)
        self.computed = self.steps = self.replayed = 0  # rows computed in forwards; their steps; plans replayed
        self.side_steps = 0  # of those steps, the ones whose kernels ran beside the forward (plan.side)
        self.timer = DeviceTimer()  # each layer's launch of the direct rows' kernel

    # ------------------------------------------------------------------ engine loop, before a forward
    def take(self, lives: list, head: int, total: int) -> tuple[list, int]:
        """Of this step's ``(live, first position, count)``, the direct chunks get a plan; returns the others
        (the ring's) and the ring's tokens of the step (``total`` less the direct ones)."""
        if self.min is None or (self.beside and total <= self.graphed):
            return lives, total
        direct = [it for it in lives if it[2] > self.min and not it[0].lost]
        if not direct:
            return lives, total
        # a chunk behind rows still pending in the ring (a step replayed as graphs, or too small to go direct):
        # those are computed first, so the chunk goes direct and the ring never holds a prefill chunk it was not
        # sized for (with direct rows it holds the decode tokens of max_num_seqs requests)
        behind = [it[0] for it in direct if it[0].count]
        if behind:
            self.stream.flush(behind)
        self.plan = self._make(direct, head)
        ids = {id(it) for it in direct}
        for live, start, n in direct:
            live.next = start + n
        return [it for it in lives if id(it) not in ids], total - sum(n for _, _, n in direct)

    def _make(self, items: list, head: int) -> _Plan:
        """The key slots and terms of each chunk, uploaded in one copy."""
        st = self.stream
        lives = [lv for lv, _, _ in items]
        firsts = np.asarray([p for _, p, _ in items], dtype=np.int64)
        cnt = np.asarray([n for _, _, n in items], dtype=np.int64)
        ends = firsts + cnt
        block_lists = [lv.tracked.block_ids[st.group] for lv in lives]
        counts, first_l = cnt.tolist(), firsts.tolist()
        prompt, vm_parts, vc_parts = _prompt_and_vision([lv.tracked for lv in lives], ends, first_l, counts)
        if _paged(st, vm_parts):  # the kernel reads the chunks' blocks, the table marks their rows' slots
            blocks, cu_b = blocks_many(block_lists)
            row_slots = np.concatenate([slots_of(bl, st.block_size, p, c)
                                        for bl, p, c in zip(block_lists, first_l, counts)])
            *args, slots = st.kernels.upload(first_l, counts, blocks, cu_b, prompt, None, None, extra=[row_slots])
            return _Plan(items, head, slots, (*args, max(counts), st.block_size))
        ks_flat, cu_k = slots_many(block_lists, st.block_size, ends)
        starts, row_slots = _row_slots(ks_flat, cu_k, cnt)
        row_slots = row_slots.astype(np.int64)
        if st.kernels.fused:
            *args, slots = st.kernels.upload(first_l, counts, ks_flat, cu_k, prompt, vm_parts, vc_parts,
                                             extra=[row_slots])
            args = (*args, max(counts), 0)
        else:
            slots = torch.from_numpy(row_slots).to(st.device)
            args = (first_l, counts, starts, np.split(ks_flat, cu_k[1:-1]), prompt, vm_parts)
        return _Plan(items, head, slots, tuple(args))

    # ------------------------------------------------------------------ in the forward (eager only)
    def write(self, layer: int, li: int, query: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
        """A streamed layer's queries in a forward with a plan: the ring's tokens to the ring, the forward's
        queries kept for :meth:`run`.  False (nothing done) without a plan the forward takes."""
        plan = self.plan
        if plan is None:
            return False
        capturing = query.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if li == 0 and not plan.used and not capturing:
            self._index(slot_mapping, plan)
        if not plan.used:
            return False
        st = self.stream
        triton_metrics.scatter_rows(st.q[li], query, self.ring_index, st.rows)
        plan.queries[layer] = query
        return True

    def _index(self, slot_mapping: torch.Tensor, plan: _Plan) -> None:
        """Which of the forward's tokens are direct (their slots are the plan's): each direct token's query row
        (its index in the forward) and every other token's ring row in order from the row counter, both in the
        slot -> row table, and the ring index the layers scatter by (direct and padded tokens: the padding
        row).  Graph-unsafe, and only in forwards that are not captured."""
        st = self.stream
        S, R = st.num_slots, st.rows
        n = slot_mapping.shape[0]
        sm = slot_mapping.to(torch.int64)
        at = torch.where(sm >= 0, sm, S)  # padded tokens: the table's padding entry
        table = st.ring_of_slot
        table.index_fill_(0, plan.slots, -2)
        direct = table.index_select(0, at) == -2
        t = torch.arange(n, device=sm.device)
        table.scatter_(0, torch.where(direct, at, S), torch.where(direct, t, R))
        ring = torch.where(direct, -1, sm)
        triton_metrics.ring_advance(ring, st.head, st.base, R)
        keep = ring >= 0
        rows = torch.where(keep, (st.base + torch.cumsum(keep, 0) - 1) % R, -1)
        table.scatter_(0, torch.where(keep, at, S), torch.where(keep, rows, R))
        # a planned slot the forward did not have (never, with a right plan) reads query row 0, not out of bounds
        table.index_copy_(0, plan.slots, table.index_select(0, plan.slots).clamp_min(0))
        self.ring_index = rows
        plan.used = True

    def run(self, layer: int) -> None:
        """After ``layer``'s attention has written this forward's keys to the cache (or the stream's write to
        its K-only tap): that layer's direct rows, from the forward's own queries, into the per-slot buffer, on
        the side stream behind the work enqueued so far on the engine's (:attr:`beside`, in a forward with no
        CUDA graph: :attr:`uncaptured`), else on the engine's."""
        plan = self.plan
        if plan is None or not plan.used:
            return
        q = plan.queries.pop(layer, None)
        if q is None:
            return
        st = self.stream
        li = st.pos[layer]
        spec = st.layers[li]
        if q.dim() == 2:
            q = q.unflatten(1, (spec.num_heads, spec.head_dim))
        if q.stride(-1) != 1 or q.dtype != st.q.dtype:
            q = q.to(st.q.dtype).contiguous()
        side = st.side
        if plan.side is None:  # once a forward; its uploads (one buffer) go when the step settles, kernels or not
            plan.side = bool(self.beside and st.kernels.fused and side.stream is not None and self.uncaptured())
            if plan.side:
                for t in (plan.slots, *plan.args):
                    if isinstance(t, torch.Tensor):
                        t.record_stream(side.stream)
        if plan.side:
            side.begin()  # after this layer's attention: its queries and keys are written
            q.record_stream(side.stream)  # the forward frees its queries long before the kernel has read them
        with side.context() if plan.side else contextlib.nullcontext():
            started = self.timer.start(q.device)
            st.kernels.run_direct(li, q, plan.args, st.ring_of_slot, plan.slots)
            self.timer.stop(started)

    @property
    def device_s(self) -> float:
        """Device time of the direct rows' kernels (each layer's launch), as far as completed; read without a
        sync."""
        return self.timer.seconds

    # ------------------------------------------------------------------ engine loop, after the launch
    def settle(self) -> None:
        """The last step's plan, once its forward was launched: counted if its first streamed layer took it;
        else that forward ran as a CUDA graph (which writes every token to the ring), and its chunks are pending
        ring rows like any other."""
        plan, self.plan = self.plan, None
        if plan is None:
            return
        n = sum(c for _, _, c in plan.items)
        if plan.used:
            self.steps += 1
            self.side_steps += bool(plan.side)
            self.computed += n
            return
        self.replayed += 1
        st = self.stream
        for live, _, c in plan.items:
            if live.count == 0:
                live.lo = plan.head
            live.count += c
        st._head += n
        st._oldest = plan.head if st._oldest is None else min(st._oldest, plan.head)


def _paged(st, vm_parts) -> int:
    """Where a flush kernel launch of stream ``st`` gives each request's block ids (ATTN_OTEL_FLUSH_KEYS=blocks,
    the Triton kernel, no vision mask: that is per key), the block size they are of; else 0: key slots."""
    return st.block_size if st.kernels.fused and st.flush_keys == "blocks" and vm_parts is None else 0


def _row_slots(key_slots: np.ndarray, cu_keys: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows that are each request's last ``counts[b]`` key positions (request ``b``'s keys at
    ``key_slots[cu_keys[b]:cu_keys[b + 1]]``): each request's first row's index among them, and their slots."""
    starts = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    return starts, key_slots[np.repeat(cu_keys[1:] - counts - starts, counts) + np.arange(int(counts.sum()))]


def _prompt_and_vision(tracked: Sequence[Any], ends: np.ndarray, firsts: list[int], counts: list[int]):
    """A flush's per-request terms: each request's prompt length within its ``ends[b]`` keys, and, where some
    request has vision positions, per request its keys' vision mask and its pending rows' running vision count
    (else None, None)."""
    prompt, vm_parts = [], []
    vision_any = False
    for b, t in enumerate(tracked):
        end = int(ends[b])
        prompt.append(min(len(t.prompt_token_ids or ()), end))
        vp = getattr(t, "vision_positions", None)
        vm = None
        if vp is not None:
            vm = np.zeros(end, dtype=np.float32)
            k = min(end, len(vp))
            vm[:k] = np.asarray(vp[:k], dtype=np.float32)
            vision_any = vision_any or bool(vm.any())
        vm_parts.append(vm)
    if not vision_any:
        return prompt, None, None
    vm_parts = [np.zeros(int(e), dtype=np.float32) if vm is None else vm for vm, e in zip(vm_parts, ends)]
    vc_parts = [np.cumsum(vm)[firsts[b]:firsts[b] + counts[b]] for b, vm in enumerate(vm_parts)]
    return prompt, vm_parts, vc_parts
