"""Per-row metrics of the *streamed* layers, computed while requests run, so their queries need not stay.

The Q/K tap (:class:`attn_otel.tap.QKTap`) keeps every KV-cache token's query for the request's whole
life: on all 32 layers of an 8B model that is 2.5 times the KV cache's own bytes per token, and vLLM's KV
cache shrinks to 0.29x (docs/benchmarks/history.md, run 5).  A streamed layer instead keeps:

* a **query ring** ``[R, Hq, D]``: the model's own queries, written in the forward (in-graph, like the tap)
  in token order from a row counter on the device (:func:`attn_otel.triton_metrics.ring_advance`), each
  token's row recorded in a slot -> ring-row table there; the host only counts the step's tokens, so the
  rows a flush reads are found by their slots (which the host knows from the block tables), not assigned;
* a **per-slot metrics buffer** ``[slots, M, Hq]`` (float16, 256 B per token at 32 heads for a text model):
  every KV-cache token's per-row metrics once computed, those the finish cannot derive only
  (:func:`slot_rows`: entropy, the two sink masses, lookback, and the vision share and learned sink mass where
  the model has them; ``entropy_norm`` is the entropy over ln of the visible keys, which the position and the
  layer's window give, and a text model's vision rows are NaN);
* nothing for K: the keys are read from vLLM's own paged KV cache (a view of FLASH_ATTN's cache), or, where
  that layout is not known (the CPU backend, a quantised cache), from a K-only tap.

A **flush** computes pending rows, each against its request's keys in the cache, with the finish-time
kernel (:func:`attn_otel.triton_metrics.row_metrics_stream`), and frees their ring rows.  It runs on the
engine's stream before a forward, so the keys it reads are still the request's:

* when this step's tokens do not fit the free ring rows: every pending row (about ``R / running requests``
  decode steps of rows per request at a time, so each K load serves that many rows);
* when requests finish or are preempted, before their blocks can be reused: their rows, and the pending rows
  of any request whose blocks they share through the prefix cache (a cached prefix's rows were computed by
  the request that computed its blocks, and are the same rows: they depend on the prefix only).

At finish a request's per-row metrics of the streamed layers are a gather from the per-slot buffer by its
slots.  Maps need every query at finish, so map layers keep the tap (see ``ATTN_OTEL_MAP_LAYERS``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from . import triton_metrics
from .attention import KERNEL_METRICS, METRICS, attention_metrics, metric_width
from .direct import DirectRows, _paged, _prompt_and_vision, _row_slots
from .slots import blocks_many, slots_many, upload, upload_many
from .spill import SpillBlocks, spill_base
from .timing import DeviceTimer

logger = logging.getLogger("attn_otel")

DEFAULT_ROWS = 8192


@dataclasses.dataclass
class _Live:
    """A request whose rows have gone through the model while streaming."""

    idx: int  # owner id (MetricsStream._by_idx; per block, the request that wrote it: MetricsStream._writer)
    tracked: Any  # the tracker's record: ``block_ids`` (per KV-cache group), ``prompt_token_ids``, ``vision_positions``
    count: int = 0  # pending rows: positions ``next - count .. next - 1``
    next: int = 0  # the position its next row should have
    lo: int = 0  # the ring's row count (MetricsStream._head) when its first pending row was written
    shared: bool = False  # some of its positions were computed by another request (a prefix-cache hit)
    lost: bool = False  # some row could not be given a ring row: its capture is dropped


class Side:
    """A second CUDA stream for capture work, so that the engine's next forward runs beside it, not after it.

    The stream's flushes and the finish-time kernels read the query ring, the taps and vLLM's KV cache; the
    forwards on the engine's stream write them.  :meth:`begin` (before each flush and each step's finish
    work) makes the side stream wait for the forwards enqueued so far, so capture work reads what they
    wrote.  The engine's stream waits for capture work only where a forward would overwrite what it still
    reads:

    * ring rows that a flush freed (the stream reuses them once the flush is known done, or waits for it);
    * KV-cache blocks (and the taps' slots in them) of finished or preempted requests, which vLLM can hand to
      another request: :meth:`reading` records which capture work reads them, :meth:`guard` makes the engine's
      stream wait before a forward writes one of them.

    Work is numbered by :meth:`mark` (an event on the side stream); the side stream runs in order, so work
    ``n`` done means all work before it is done.  Off a GPU everything is synchronous and this does nothing.
    """

    def __init__(self, device) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._events: list[tuple[int, Any]] = []  # (seq, event) not yet known done, in order
        self._seq = 0
        self._safe = 0  # work up to this number is done, or the engine's stream already waits for it
        self._busy: dict[int, np.ndarray] = {}  # KV-cache group -> per block the last work reading it
        self._busy_max = 0
        self.waits = 0  # times the engine's stream had to wait for capture work
        self.wait_causes: collections.Counter[str] = collections.Counter()  # the same, by what it waited for

    def begin(self) -> None:
        """Before this step's capture work: it comes after the forwards enqueued so far."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def context(self):
        """Enqueue on the side stream (a no-op off a GPU)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def mark(self) -> int:
        """Number the capture work enqueued so far (0 off a GPU: done already)."""
        if self.stream is None:
            return 0
        ev = torch.cuda.Event()
        ev.record(self.stream)
        self._seq += 1
        self._events.append((self._seq, ev))
        return self._seq

    def safe(self, seq: int) -> bool:
        """Whether the engine's stream may overwrite what work ``seq`` reads (never a sync)."""
        if seq <= self._safe:
            return True
        while self._events and self._events[0][1].query():
            self._safe = max(self._safe, self._events.pop(0)[0])
        return seq <= self._safe

    def wait(self, seq: int, cause: str = "blocks") -> None:
        """Make the engine's stream wait for work ``seq`` (no host sync); ``cause`` names what the forward would
        overwrite (``blocks`` of finished requests, ``stream_ring`` or ``map_ring`` rows) in the stats."""
        if self.safe(seq):
            return
        ev = next(e for n, e in self._events if n >= seq)
        torch.cuda.current_stream(self.device).wait_event(ev)
        self.waits += 1
        self.wait_causes[cause] += 1
        self._safe = max(self._safe, seq)
        self._events = [(n, e) for n, e in self._events if n > seq]

    def reading(self, group: int, blocks: np.ndarray, seq: int) -> None:
        """Work ``seq`` reads these KV-cache blocks of ``group``."""
        if seq == 0 or blocks.size == 0:
            return
        busy = self._busy.get(group)
        top = int(blocks.max()) + 1
        if busy is None or busy.shape[0] < top:
            grown = np.zeros(max(top, 2 * (0 if busy is None else busy.shape[0])), dtype=np.int64)
            if busy is not None:
                grown[: busy.shape[0]] = busy
            busy = self._busy[group] = grown
        busy[blocks] = seq
        self._busy_max = seq

    def taken_back(self, block_ids: Sequence[Sequence[int]], seq: int, tokens: int | None = None,
                   block_sizes: Sequence[int] = ()) -> None:
        """A request's blocks (per group; with ``tokens``, those holding its first ``tokens``) go back to
        vLLM while work ``seq`` still reads them."""
        for group, blocks in enumerate(block_ids or ()):
            if tokens is not None:
                blocks = blocks[:-(-int(tokens) // block_sizes[group])]
            self.reading(group, np.asarray(blocks, dtype=np.int64), seq)

    def guard_items(self, items: Sequence[tuple[str, Any, int, int]], block_sizes: Sequence[int]) -> None:
        """Before a forward of these ``(request id, tracked, first position, count)``: :meth:`guard` on the
        blocks its tokens are written to."""
        if not self.busy():
            return
        writes: dict[int, list[np.ndarray]] = {}
        for _, t, start, n in items:
            if n <= 0:
                continue
            for g, blocks in enumerate(t.block_ids):
                bs = block_sizes[g]
                writes.setdefault(g, []).append(np.asarray(blocks[start // bs:(start + n - 1) // bs + 1],
                                                           dtype=np.int64))
        self.guard(writes)

    def busy(self) -> bool:
        """Whether capture work may still read blocks vLLM took back (never a sync)."""
        return self._busy_max > 0 and not self.safe(self._busy_max)

    def guard(self, writes: dict[int, list[np.ndarray]]) -> None:
        """Before a forward that writes these blocks (per group): wait for capture work still reading one."""
        if not self.busy():
            return
        need = 0
        for group, parts in writes.items():
            busy = self._busy.get(group)
            if busy is None or not parts:
                continue
            blocks = np.concatenate(parts)
            blocks = blocks[blocks < busy.shape[0]]
            if blocks.size:
                need = max(need, int(busy[blocks].max()))
        if need:
            self.wait(need)


class RowCounterCheck:
    """Whether the forwards' ring-row counter (on the device) and the host's count of the rows they took still
    agree, read without a sync: every ``every`` steps the counter is copied to pinned memory behind the
    forwards enqueued so far, and read once that copy is known done (a CPU tensor is read at once).  The two
    may differ by a constant (forwards before the first request); a change of that difference is drift:
    tokens with a slot the host did not count, or counted and no forward wrote.  The ring is flushed at half
    full, so rows still pending are written over only once the drift reaches about half the ring."""

    def __init__(self, head: torch.Tensor, rows: int, every: int = 64) -> None:
        self.head, self.rows, self.every = head, int(rows), int(every)
        self.gpu = head.device.type == "cuda"
        self.buf = torch.zeros(1, dtype=torch.int64, pin_memory=self.gpu)
        self.offset: int | None = None
        self.drifts = 0
        self.total = 0  # drift since the last overrun (rows, signed)
        self._steps = 0
        self._inflight: tuple[int, Any] | None = None  # (the host's count when copied, the copy's event)

    def poll(self, host: int) -> int:
        """Before a forward, ``host`` the rows the host counted for the forwards before it: the drift found
        since the last reading (rows, signed; 0 where they agree or nothing was read)."""
        if not self.gpu:
            return self._drift(int(self.head), host)
        if self._inflight is not None:
            counted, ev = self._inflight
            if not ev.query():
                return 0
            self._inflight = None
            return self._drift(int(self.buf[0]), counted)
        self._steps += 1
        if self._steps % self.every == 0:
            self.buf.copy_(self.head, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self._inflight = (host, ev)
        return 0

    def overrun(self, host: int) -> bool:
        """:meth:`poll`, the drift summed since the last overrun: True (and a warning) once it reaches a quarter
        of the ring, where rows still pending may have been written over."""
        self.total += self.poll(host)
        if abs(self.total) < self.rows // 4:
            return False
        logger.warning("attn-otel: the query ring's row counter drifted %d rows from the host's count of the "
                       "forwards' tokens; the captures of the requests running now are dropped "
                       "(stream_ring_drifts)", self.total)
        self.total = 0
        return True

    def _drift(self, device: int, host: int) -> int:
        off = (device - host) % self.rows
        d = 0 if self.offset is None else (off - self.offset + self.rows // 2) % self.rows - self.rows // 2
        self.offset = off
        self.drifts += d != 0
        return d


class MetricsStream:
    """Query ring, slot table and per-slot metrics buffer of the streamed layers (all in one KV-cache group,
    of one shape).  Host methods run on the engine loop; the device work they enqueue is stream-ordered with
    the forwards."""

    def __init__(self, layers: Sequence[Any], num_slots: int, rows: int, dtype: torch.dtype, device,
                 block_size: int, sink_tokens: int = 4, key_caches: dict[int, torch.Tensor] | None = None,
                 side: Side | None = None, vision: bool = True, spill_slots: int = 0):
        if not layers:
            raise ValueError("a stream needs at least one layer")
        shapes = {(s.num_heads, s.num_kv_heads, s.head_dim, s.group) for s in layers}
        if len(shapes) != 1:
            raise ValueError(f"streamed layers must share heads, head_dim and KV-cache group, got {shapes}")
        self.layers = list(layers)
        self.pos = {s.index: i for i, s in enumerate(self.layers)}
        H, Hkv, D, self.group = next(iter(shapes))
        L, S, R = len(self.layers), int(num_slots), int(rows)
        self.num_slots, self.rows, self.block_size = S, R, int(block_size)
        self.sink_tokens = int(sink_tokens)
        self.device = torch.device(device)
        self.side = side if side is not None else Side(self.device)  # flushes run beside the forwards
        self.q = torch.zeros((L, R + 1, H, D), dtype=dtype, device=device)  # row R absorbs padded tokens
        # the metrics kept per slot (slot_rows), and where each lands in the full [.., width, H] rows at gather
        self.slot_rows = slot_rows(self.layers, vision)
        self.width = metric_width(self.layers)
        # per-slot rows (slot S: padding), then spill blocks of finished requests' last blocks (attn_otel.spill)
        self.spill_base = spill_base(S, self.block_size) if spill_slots else S + 1
        self.metrics = torch.full((L, self.spill_base + spill_slots, len(self.slot_rows), H), float("nan"),
                                  dtype=torch.float16, device=device)
        self.spill = SpillBlocks(self) if spill_slots else None
        self._full_at = torch.tensor([METRICS.index(n) for n in self.slot_rows], dtype=torch.int64, device=device)
        self._window = torch.tensor([int(s.window or 0) for s in self.layers], dtype=torch.int64, device=device)
        self._chunk = torch.tensor([int(s.chunk or 0) for s in self.layers], dtype=torch.int64, device=device)
        self._local = any(s.window or s.chunk for s in self.layers)  # else a row sees its position + 1 keys
        # per slot the ring row its token's query went to (written in the forward), and the row counter the
        # forward takes its rows from: base of this forward, head of the next (triton_metrics.ring_advance)
        self.ring_of_slot = torch.full((S + 1,), R, dtype=torch.int64, device=device)
        self.head = torch.zeros(1, dtype=torch.int64, device=device)
        self.base = torch.zeros(1, dtype=torch.int64, device=device)
        self.counter = RowCounterCheck(self.head, R)
        key_caches = key_caches or {}
        # Keys: a [blocks, block_size, Hkv, D] view of vLLM's cache per layer, else a K-only tap.
        self.keys: dict[int, torch.Tensor] = {}
        self.k_tap: dict[int, torch.Tensor] = {}
        for s in self.layers:
            kc = key_caches.get(s.index)
            if kc is not None:
                self.keys[s.index] = kc
            else:
                tap = torch.zeros((S + 1, Hkv, D), dtype=dtype, device=device)
                self.k_tap[s.index] = tap
                self.keys[s.index] = tap[:, None]
        self.kernels = FlushKernels(self.layers, self.q, self.keys, self.metrics, self.sink_tokens, self.device,
                                    self.slot_rows)
        # host side: the rows the forwards took so far (the device counter's value, not wrapped, give or take
        # a constant: only differences are used); the oldest row that may still be pending (a bound); the
        # flushes whose rows may still be read: (work number, their oldest row); per block the owner of the
        # request that wrote it (for a shared prefix's pending rows, see finish)
        self._head = 0
        self._oldest: int | None = None
        self._inflight: list[tuple[int, int]] = []
        self.defer_flush = False  # the flush at half the ring waits for after_launch (ATTN_OTEL_AFTER_LAUNCH)
        self.flush_keys = "slots"  # or "blocks": what a flush gives the kernel of its keys (ATTN_OTEL_FLUSH_KEYS)
        self.flush_due = False
        self.direct = DirectRows(self)  # prefill chunks' rows in the forward (ATTN_OTEL_STREAM_DIRECT; off)
        self._writer = np.full(-(-S // self.block_size), -1, dtype=np.int64)
        self._live: dict[str, _Live] = {}
        self.steady = None  # attn_otel.steady.Steady: live requests counted by a step counter (set by the adapter)
        self._by_idx: dict[int, str] = {}
        self._next = 0
        self.flushes = self.flushed_rows = 0
        self.flush_times: collections.deque[float] = collections.deque(maxlen=10_000)  # seconds (see _flush)
        self.host_s = 0.0  # engine-loop time spent here (schedule and flush; a flush inside a schedule once)
        self._timing = False  # a schedule is being timed: a flush it calls adds no time of its own

    # ------------------------------------------------------------------ sizes
    @staticmethod
    def bytes_per_token(layers: Sequence[Any], keys_from_cache: bool, dtype: torch.dtype,
                        vision: bool = True) -> int:
        """Per KV-cache token: the metrics buffer, the slot table entry, and the K tap of the layers whose keys
        are not read from vLLM's cache (all where ``keys_from_cache`` is false; windowed and chunked layers
        always: vLLM frees their blocks while a request runs)."""
        size = torch.empty((), dtype=dtype).element_size()
        per = len(slot_rows(layers, vision)) * sum(s.num_heads for s in layers) * 2 + 8  # float16 rows, slot table
        per += sum(s.num_kv_heads * s.head_dim * size for s in layers
                   if not keys_from_cache or getattr(s, "local", False))
        return per

    @staticmethod
    def ring_bytes(layers: Sequence[Any], rows: int, dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        return sum((rows + 1) * s.num_heads * s.head_dim * size for s in layers)

    def nbytes(self) -> int:
        ts = [self.q, self.metrics, self.ring_of_slot, *self.k_tap.values()]
        return sum(t.numel() * t.element_size() for t in ts)

    def pending(self) -> int:
        """Rows written and not flushed yet.  Read-only, for the stats thread: the step counter's members count
        unsettled (settling them there raced the engine loop's own settling, and the walk failed the stats
        file with "dictionary changed size during iteration", run 44)."""
        steady = self.steady
        return sum(lv.count for lv in list(self._live.values())) + (steady.unsettled() if steady is not None else 0)

    def _reclaim(self, upto: int) -> None:
        """Before a forward writes the ring's rows up to ``upto`` (not wrapped), so over the rows before
        ``upto - rows``: the engine's stream waits for the flushes that may still read one of them; the done
        ones are dropped."""
        need = 0
        for seq, lo in self._inflight:
            if lo < upto - self.rows:
                need = max(need, seq)
        if need:
            self.side.wait(need, "stream_ring")
        self._inflight = [(seq, lo) for seq, lo in self._inflight if not self.side.safe(seq)]

    def warm_up(self) -> int:
        """Compile the flush kernel on the padding ring row (FlushKernels.warm_up); returns the launches."""
        return self.kernels.warm_up(self.rows, _paged(self, None))

    @property
    def device_s(self) -> float:
        """Device time of the flush kernels (and their uploads), as far as completed."""
        return self.kernels.device_s

    # ------------------------------------------------------------------ in the forward (graph-safe)
    def write(self, layer: int, query: torch.Tensor, key: torch.Tensor, slot_mapping: torch.Tensor,
              kv: tuple | None = None) -> bool:
        """The forward's query (and key, for a K-only tap) of ``layer``; with ``kv`` (see
        :func:`attn_otel.triton_metrics.scatter_rows`) also vLLM's KV-cache write, in the same launch.  True
        where that launch wrote the cache (else the caller must)."""
        # Tokens go to the ring in order from the row counter, moved on once a forward (by the first streamed
        # layer); padded tokens (slot -1) go to the ring's padding row.
        tap = self.k_tap.get(layer)
        li = self.pos[layer]
        if self.direct.write(layer, li, query, slot_mapping):  # a step with direct rows: the ring took the rest
            if tap is not None:
                triton_metrics.scatter_rows(tap, key, slot_mapping, self.num_slots)
            return False  # the cache's own write, then direct.run() once the layer's keys are in it
        if li == 0:
            triton_metrics.ring_advance(slot_mapping, self.head, self.base, self.rows)
        done = triton_metrics.scatter_rows(self.q[li], query, slot_mapping, self.rows, table=self.ring_of_slot,
                                           kv=kv if tap is None else None, base=self.base)
        if tap is not None:
            triton_metrics.scatter_rows(tap, key, slot_mapping, self.num_slots)
            return False
        return done and kv is not None

    # ------------------------------------------------------------------ engine loop, before a forward
    def schedule(self, items: Iterable[tuple[str, Any, int, int]], total: int | None = None) -> None:
        """This step's tokens: ``(request id, tracked record, first position, count)`` per request, and
        ``total``, every token of the forward that has a slot (default: the items' tokens; the forward takes
        a ring row for each, captured or not).  Counts them as pending, flushing first what the forward's
        rows would otherwise overwrite (one short Python step per request; nothing goes to the device)."""
        t0, self._timing = time.perf_counter(), True  # a flush it runs adds no time of its own
        try:
            self._schedule([it for it in items if it[3] > 0], total)
        finally:
            self._timing = False
            self.host_s += time.perf_counter() - t0

    def _schedule(self, items: list, total: int | None) -> None:
        self.direct.settle()
        if self.counter.overrun(self._head):  # pending rows may have been written over: not computed
            for lv in self._live.values():
                lv.lost = True
        if total is None:
            total = sum(it[3] for it in items)
        if total <= 0:
            return
        stale = []
        lives = []
        head, bs, writer = self._head, self.block_size, self._writer
        for req_id, tracked, start, n in items:
            live = self._live.get(req_id)
            if live is None:
                live = self._live[req_id] = _Live(self._next, tracked)
                self._by_idx[self._next] = req_id
                self._next += 1
            live.tracked = tracked
            if start != live.next:  # rows it did not compute itself (a prefix hit), or positions went back
                live.shared = True
                if live.count:  # speculative tokens rejected, or a resumed request: compute what is pending
                    stale.append(live)
            lives.append((live, start, n))
            if n > 1 or start % bs == 0:  # it writes into blocks it did not write before
                blocks = tracked.block_ids[self.group]
                for b in range(start // bs, (start + n - 1) // bs + 1):
                    writer[blocks[b]] = live.idx
        if stale:
            self.flush(stale)
        lives, total = self.direct.take(lives, head, total)  # prefill chunks: in the forward, no ring rows
        # Flush everything pending at half the ring, so the steps after it have rows while it runs beside their
        # forwards: after this forward's launch (after_launch) where ``defer_flush``, unless the forward writes
        # over a pending row (those before ``head + total - rows``), then now.
        if self._oldest is not None and head + total - self._oldest > self.rows // 2:
            _settled(self)
            self._oldest = min((lv.lo for lv in self._live.values() if lv.count), default=None)
            if self._oldest is not None and head + total - self._oldest > self.rows // 2:
                if self.defer_flush and head + total - self._oldest <= self.rows:
                    self.flush_due = True
                else:
                    self._flush_all()
        self._reclaim(head + total)
        lost = total > self.rows  # a step larger than the ring: cannot happen with rows >= max_num_batched_tokens
        for live, start, n in lives:
            if live.count == 0:
                live.lo = head
            live.count += n
            live.next = start + n
            live.lost = live.lost or lost
        if self._oldest is None:
            self._oldest = head
        self._head = head + total

    def after_launch(self) -> None:
        """After the forward :meth:`schedule` counted is launched: the flush at half the ring it left for now."""
        self.direct.settle()
        if self.flush_due:
            self._flush_all()

    def _flush_all(self) -> None:
        """Every live request's pending rows: nothing is pending (or due) after it."""
        _settled(self)
        self.flush([lv for lv in self._live.values() if lv.count])
        self._oldest, self.flush_due = None, False

    def finish(self, req_ids: Iterable[str]) -> None:
        """Before finished requests' blocks can be reused: compute their pending rows and those of any live
        request that owns a pending row in their slots (a shared prefix)."""
        self.direct.settle()
        todo: dict[int, _Live] = {}
        for r in req_ids:
            live = _settled(self, r)
            if live is not None:
                todo[live.idx] = live
                todo.update(_pending_owners(self, live))
        self.flush(list(todo.values()))

    def preempt(self, req_ids: Iterable[str]) -> None:
        """Preempted requests' blocks are freed this step: compute their pending rows now."""
        if req_ids:
            self.direct.settle()
            self.flush([_settled(self, r) for r in req_ids if r in self._live])

    def lost(self, req_id: str) -> bool:
        return bool(req_id in self._live and self._live[req_id].lost)

    def forget(self, req_ids: Iterable[str]) -> None:
        """Finished requests (after :meth:`finish` and their captures were gathered)."""
        for r in req_ids:
            _settled(self, r, leave=True)
            live = self._live.pop(r, None)
            if live is not None:
                self._by_idx.pop(live.idx, None)

    def flush(self, lives: Sequence[_Live]) -> None:
        """Compute these requests' pending rows (one kernel launch per streamed layer) and free their rows."""
        t0 = time.perf_counter()
        try:
            self._flush(lives, t0)
        finally:
            if not self._timing:  # (inside a schedule, whose time holds it)
                self.host_s += time.perf_counter() - t0

    def _flush(self, lives: Sequence[_Live], t0: float) -> None:
        lives = sorted((lv for lv in lives if lv.count), key=lambda lv: lv.idx)
        if not lives:
            return
        counts = [lv.count for lv in lives]
        cnt = np.asarray(counts, dtype=np.int64)
        ends_np = np.asarray([lv.next for lv in lives], dtype=np.int64)
        firsts = (ends_np - cnt).tolist()
        n = int(cnt.sum())
        prompt, vm_parts, vc_parts = _prompt_and_vision([lv.tracked for lv in lives], ends_np, firsts, counts)
        block_lists = [lv.tracked.block_ids[self.group] for lv in lives]
        seq = 0
        if self.kernels.fused:
            # every key position's slot, in one vectorised pass, or (ATTN_OTEL_FLUSH_KEYS=blocks) each request's
            # blocks, the kernel finding its keys' slots, and its pending rows' (their last ``count`` positions),
            # whose ring rows are in the table the forwards wrote; a vision mask is per key: slots with one
            paged = _paged(self, vm_parts)
            keys, cu_k = blocks_many(block_lists) if paged else slots_many(block_lists, self.block_size, ends_np)
            self.side.begin()  # after the forwards that wrote the rows
            with self.side.context():
                self.kernels.run_fused(firsts, counts, keys, cu_k, prompt, vm_parts, vc_parts,
                                       table=self.ring_of_slot, paged=paged)
                seq = self.side.mark()
        else:
            ks_flat, cu_k = slots_many(block_lists, self.block_size, ends_np)
            starts, row_slots = _row_slots(ks_flat, cu_k, cnt)  # the pending rows' slots
            rows = self.ring_of_slot[torch.from_numpy(row_slots).to(self.device)].cpu().numpy()
            self.kernels.run_torch(firsts, counts, rows, starts, np.split(ks_flat, cu_k[1:-1]), prompt, vm_parts)
        if seq:  # the forwards may write these rows again once the flush has read them (see _reclaim)
            self._inflight.append((seq, min(lv.lo for lv in lives)))
        for lv in lives:  # (a request counted by the step counter writes its next row at the head or after it)
            lv.count, lv.lo = 0, self._head
        self.flushes += 1
        self.flushed_rows += n
        self.flush_times.append(time.perf_counter() - t0)  # host time of a flush that had rows to compute


def gather(st: MetricsStream, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """At finish: per-row metrics of every streamed layer of ``st`` at these slots, whose tokens are at these
    ``positions`` of their requests: ``[layers, len(slots), 7, Hq]`` float16 (``[.., 8, Hq]`` where a streamed
    layer has learned sinks: :func:`attn_otel.attention.metric_width`), the kept rows (:func:`slot_rows`) put in
    place and ``entropy_norm`` derived: the entropy over ln n_i, n_i the keys row i sees (its position + 1, or
    fewer under the layer's window or chunks; NaN where n_i = 1), as the kernel computes it."""
    local = st._local
    return full_rows(st.metrics.index_select(1, slots), st._full_at, st.width, positions,
                     st._window if local else None, st._chunk if local else None)


def _settled(st: MetricsStream, req_id: str | None = None, leave: bool = False) -> _Live | None:
    """Live records with the steps the step counter counted for them applied (:mod:`attn_otel.steady`): one
    request's (``req_id``, returned; with ``leave`` it stops being counted there), else every one's."""
    steady = st.steady
    if steady is not None:
        if req_id is None:
            steady.settle_all()
        elif leave:
            steady.leave(req_id)
        else:
            steady.settle(req_id)
    return None if req_id is None else st._live.get(req_id)


def _pending_owners(st: MetricsStream, live: _Live) -> dict[int, _Live]:
    """The live requests (by owner id) with pending rows in the blocks ``live`` shares through the prefix cache:
    the requests that wrote those blocks."""
    t = live.tracked
    n = int(getattr(t, "written", 0))
    if not (live.shared and n > 0 and t.block_ids and len(t.block_ids) > st.group):
        return {}
    blocks = np.asarray(t.block_ids[st.group][:-(-n // st.block_size)], dtype=np.int64)
    owners = np.unique(st._writer[blocks])
    out = {}
    for o in owners[owners >= 0].tolist():
        other = st._by_idx.get(int(o))
        if other is not None and _settled(st, other).count:
            out[int(o)] = st._live[other]
    return out


_NORM = METRICS.index("entropy_norm")


def full_rows(kept: torch.Tensor, full_at: torch.Tensor, width: int, positions: torch.Tensor,
              window: torch.Tensor | None, chunk: torch.Tensor | None) -> torch.Tensor:
    """``kept [L, n, len(slot_rows), H]`` (entropy first) as ``[L, n, width, H]`` rows in METRICS order: each
    kept row at ``full_at``, ``entropy_norm`` derived from the entropy and the rows' ``positions`` under each
    layer's ``window`` and ``chunk`` (``[L]``, 0: none; both None where no layer has either: the finish batch's
    path for most models, four kernels fewer), the rest NaN."""
    L, n, _, H = kept.shape
    out = torch.full((L, n, width, H), float("nan"), dtype=kept.dtype, device=kept.device)
    out.index_copy_(2, full_at, kept)
    pos = positions.to(device=kept.device, dtype=torch.int64).view(1, -1)
    if window is None:
        n_vis = (pos + 1).float().expand(L, n)  # [L, n]: the keys each row sees
    else:
        w, c = window.view(-1, 1), chunk.view(-1, 1)
        lo = torch.where(w > 0, (pos - w + 1).clamp_min(0), torch.zeros_like(pos))
        lo = torch.where(c > 0, torch.maximum(lo, pos // c.clamp_min(1) * c), lo)
        n_vis = (pos + 1 - lo).float()  # [L, n]: the keys each row sees
    norm = kept[:, :, 0].float() / torch.log(n_vis.clamp_min(2.0)).unsqueeze(-1)
    out[:, :, _NORM] = torch.where((n_vis > 1).unsqueeze(-1), norm, torch.nan).to(out.dtype)
    return out


def slot_rows(layers: Sequence[Any], vision: bool = True) -> tuple[str, ...]:
    """The metrics the per-slot buffer keeps, in that order: what the finish cannot derive.  Not
    ``entropy_norm`` (the entropy over ln of the visible keys: :meth:`MetricsStream.gather`), the vision pair
    only for a model that takes images (``vision``), the learned sink mass only where a layer has sinks."""
    rows = ["entropy", "sink_mass_first", "sink_mass_k"]
    if vision:
        rows += ["vision_share", "vision_share_norm"]
    rows.append("lookback_ratio")
    if metric_width(layers) > len(KERNEL_METRICS):
        rows.append("learned_sink_mass")
    return tuple(rows)


def keys_at(keys: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[n, Hkv, D]`` keys at these slots of a ``[blocks, block_size, Hkv, D]`` key source (a stream's
    ``keys[layer]``) as the attention read them: an fp8 cache's own values, exactly, in ``dtype`` (its
    scale is in the layer's scale)."""
    bs = keys.shape[1]
    if keys.element_size() == 1:  # fp8: indexed as bytes, then widened (exact)
        return keys.view(torch.uint8)[slots // bs, slots % bs].view(keys.dtype).to(dtype)
    return keys[slots // bs, slots % bs]


class FlushKernels:
    """The device side of a flush: the pending rows' metrics against their keys, into the per-slot buffer,
    with the Triton kernels (one launch for every layer where their key caches allow it) or, on a CPU,
    the torch reference (:func:`attn_otel.attention.attention_metrics`)."""

    def __init__(self, layers: Sequence[Any], q: torch.Tensor, keys: dict[int, torch.Tensor],
                 metrics: torch.Tensor, sink_tokens: int, device: torch.device,
                 rows: tuple[str, ...] | None = None):
        self.layers = layers
        self.pos = {s.index: i for i, s in enumerate(layers)}
        self.q, self.keys, self.metrics = q, keys, metrics
        self.sink_tokens = sink_tokens
        self.device = device
        self.fused = triton_metrics.available(device, [s.head_dim for s in layers])
        # the attention terms of every layer, for a launch of them all (one layer's: triton_metrics.terms([spec]))
        self.terms = triton_metrics.terms(layers, device) if self.fused else None
        self.width = metric_width(layers)
        self.rows = tuple(rows) if rows is not None else tuple(METRICS[: self.width])  # the buffer's metrics
        self._rows_idx = [METRICS.index(n) for n in self.rows]
        self.vision = "vision_share" in self.rows
        # one launch for every layer where their keys allow it (vLLM's per-layer caches: one shape and dtype)
        self._layered = None
        if self.fused and len({s.scale for s in layers}) == 1:
            caches = [keys[s.index] for s in layers]
            offs = triton_metrics.key_offsets(caches)
            if offs is not None:
                self._layered = (caches, torch.tensor(offs, dtype=torch.int64, device=device))
        self.timer = DeviceTimer()  # device time of the flush kernels (and their uploads)

    def run_fused(self, firsts, counts, key_slots, cu_keys, prompt, vm_parts, vc_parts, table: torch.Tensor,
                  paged: int = 0) -> None:
        """``key_slots``: every request's key slots, concatenated (request ``b``'s at ``cu_keys[b]:cu_keys[b + 1]``),
        or with ``paged`` (the cache's block size) its block ids (:func:`attn_otel.slots.blocks_many`); its
        pending rows are its last ``counts[b]`` positions, whose ring rows the kernel reads from ``table`` (slot
        -> ring row, on the device) at their slots."""
        started = self.timer.start(self.device)
        cu_rows_d, first_d, keys_d, cu_keys_d, prompt_d, vm_d, vc_d = self.upload(
            firsts, counts, key_slots, cu_keys, prompt, vm_parts, vc_parts)
        if self._layered is not None:  # every layer in one launch
            caches, offs = self._layered
            triton_metrics.row_metrics_stream_layers(
                self.q, None, cu_rows_d, first_d, caches, offs, keys_d, cu_keys_d, prompt_d, max(counts),
                self.layers[0].scale, self.sink_tokens, vm_d, vc_d, self.metrics, terms=self.terms, rows=self.rows,
                row_table=table, paged=paged)
        else:
            for spec in self.layers:
                li = self.pos[spec.index]
                triton_metrics.row_metrics_stream(
                    self.q[li], None, cu_rows_d, first_d, self.keys[spec.index], keys_d, cu_keys_d, prompt_d,
                    max(counts), spec.scale, self.sink_tokens, vm_d, vc_d, self.metrics[li],
                    terms=triton_metrics.terms([spec], self.device), rows=self.rows, row_table=table, paged=paged)
        self.timer.stop(started)

    @property
    def device_s(self) -> float:
        """Device time of the flush kernels (and their uploads), as far as completed."""
        return self.timer.seconds

    def upload(self, firsts, counts, key_slots, cu_keys, prompt, vm_parts, vc_parts, extra=()) -> list:
        """A launch's per-request arrays on the device, in one copy: cu_rows, firsts, key slots, cu_keys, prompt
        lengths, the vision mask and counts (None, None for a text model or no vision key), then ``extra``."""
        cu_rows = np.zeros(len(counts) + 1, dtype=np.int32)
        cu_rows[1:] = np.cumsum(counts)
        host = [cu_rows, np.asarray(firsts, dtype=np.int32), key_slots, np.asarray(cu_keys, dtype=np.int32),
                np.asarray(prompt, dtype=np.int32), *extra]
        vision = vm_parts is not None
        if vision:
            host += [np.concatenate(vm_parts).astype(np.float32), np.concatenate(vc_parts).astype(np.float32)]
        got = upload_many(host, self.device)  # one copy
        vis = got[len(host) - 2:] if vision and self.vision else [None, None]  # (a text model keeps no vision rows)
        return [*got[:5], *vis, *got[5:5 + len(extra)]]

    def run_direct(self, li: int, q: torch.Tensor, args: tuple, table: torch.Tensor, slots: torch.Tensor) -> None:
        """Layer ``li``'s rows of a step's direct chunks (DirectRows.take's plan ``args``), their queries
        rows of ``q [n, Hq, D]`` (the forward's own) found by ``table`` at their key ``slots``."""
        spec = self.layers[li]
        if self.fused:
            cu_rows_d, first_d, keys_d, cu_keys_d, prompt_d, vm_d, vc_d, max_rows, paged = args
            triton_metrics.row_metrics_stream(
                q, None, cu_rows_d, first_d, self.keys[spec.index], keys_d, cu_keys_d, prompt_d, max_rows,
                spec.scale, self.sink_tokens, vm_d, vc_d, self.metrics[li],
                terms=triton_metrics.terms([spec], self.device), rows=self.rows, row_table=table, paged=paged)
            return
        firsts, counts, starts, key_slots, prompt, vm_parts = args
        rows = table.index_select(0, slots).cpu().numpy()
        self.run_torch(firsts, counts, rows, starts, key_slots, prompt, vm_parts, source=q, layers=[spec])

    def run_torch(self, firsts, counts, rows_np, starts, key_slots, prompt, vm_parts, source=None,
                  layers=None) -> None:
        """The same rows through the torch reference (CPU builds): a query tensor of the request's length with
        only the pending rows filled, metrics from the first pending row on.  ``source``: the rows' queries
        come from it (``[n, Hq, D]``, one layer's: a forward's) instead of the ring, for ``layers`` only."""
        for b in range(len(firsts)):
            a, n = firsts[b], counts[b]
            end = a + n
            ks = torch.from_numpy(key_slots[b]).to(self.device)
            rows = torch.from_numpy(rows_np[starts[b]:starts[b] + n]).to(self.device)
            vm = None
            if vm_parts is not None and vm_parts[b].any():
                vm = torch.from_numpy(vm_parts[b]).to(self.device)
            out_slots = ks[a:end]
            q = torch.zeros((end,) + tuple(self.q.shape[2:]), dtype=self.q.dtype, device=self.device)
            for spec in self.layers if layers is None else layers:
                li = self.pos[spec.index]
                kc = self.keys[spec.index]
                k = kc[ks // kc.shape[1], ks % kc.shape[1]]
                src = self.q[li] if source is None else source
                q[a:end] = src.index_select(0, rows).to(q.dtype)  # rows before a are never read
                res = attention_metrics(q, k, spec.scale, prompt[b], self.sink_tokens, vm, start=a,
                                        **spec.terms(self.device))
                rows_m = res[self._rows_idx, :, a:end]  # the metrics the buffer keeps (slot_rows)
                self.metrics[li].index_copy_(0, out_slots, rows_m.permute(2, 0, 1).to(torch.float16))

    def warm_up(self, pad_row: int, paged: int = 0) -> int:
        """Compile the flush kernel by running it on one row, the ring's padding row ``pad_row``, against the
        key at slot 0 (block 0 with ``paged``, the variant a flush without vision launches: see
        :meth:`run_fused`), whose metrics entry is reset after.  At engine start, before any request; returns
        the number of launches."""
        if not self.fused:
            return 0

        def up(a: np.ndarray) -> torch.Tensor:
            return upload(a, self.device)

        z = np.zeros(1, dtype=np.int32)
        one = np.asarray([0, 1], dtype=np.int32)
        table_d, cu_d, first_d, prompt_d = up(np.asarray([pad_row], dtype=np.int64)), up(one), up(z), up(one[1:])
        keys_d = up(np.zeros(1, dtype=np.int64))  # key slot (or block) 0, whose row the one-entry table gives
        if self._layered is not None:
            caches, offs = self._layered
            triton_metrics.row_metrics_stream_layers(
                self.q, None, cu_d, first_d, caches, offs, keys_d, cu_d, prompt_d, 1, self.layers[0].scale,
                self.sink_tokens, None, None, self.metrics, terms=self.terms, rows=self.rows, row_table=table_d,
                paged=paged)
            launches = 1
        else:  # one launch per kernel variant the layers need: their keys' dtype and their terms' switches
            variants = {}
            for spec in self.layers:
                t = triton_metrics.terms([spec], self.device)
                variants.setdefault((self.keys[spec.index].dtype, self.keys[spec.index].stride(),
                                     None if t is None else t.switches), (spec, t))
            for spec, t in variants.values():
                li = self.pos[spec.index]
                triton_metrics.row_metrics_stream(
                    self.q[li], None, cu_d, first_d, self.keys[spec.index], keys_d, cu_d, prompt_d, 1, spec.scale,
                    self.sink_tokens, None, None, self.metrics[li], terms=t, rows=self.rows, row_table=table_d,
                    paged=paged)
            launches = len(variants)
        self.metrics[:, 0].fill_(float("nan"))
        return launches
