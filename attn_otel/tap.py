"""Device capture for the map layers: a Q/K tap paged like the KV cache, written inside vLLM's CUDA graphs.

Why a tap and not the KV cache: a query is gone after its step, and a request's rows are only known in
full when it finishes.  Each step, every tapped layer scatters its queries (and keys) into a tap indexed
by the same slot ids as the KV cache (by ``slot_mapping``: no host sync, valid inside CUDA-graph capture).
Prefix caching then comes for free: a cached block still holds the Q/K the request that computed it wrote,
and those are bit-identical for identical tokens and positions.  Keys are tapped too (not read back from
the KV cache) so that one code path serves every backend and KV layout, including the CPU backend's
ISA-specific packing; docs/configuration.md says what that costs.  Streamed layers keep no tap
(:mod:`attn_otel.stream`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import numpy as np
import torch

from . import triton_metrics
from .slots import slots_of, upload
from .spill import spill_bytes
from .stream import MetricsStream, keys_at


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    index: int  # model layer number (0-based, in model order)
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # vLLM's impl.scale (carries a model's own query scaling, e.g. Gemma's query_pre_attn_scalar)
    group: int = 0  # KV-cache group whose slots index the layer's tap (its own, or see ``slots_from``)
    soft_cap: float = 0.0  # logits soft-cap c (c * tanh(logits / c)); 0: none
    window: int = 0  # sliding window W (row i sees keys i-W+1 .. i); 0: none
    sinks: tuple[float, ...] | None = None  # learned sink logit per query head (this rank's heads); None: none
    slots_from: str = ""  # a full-attention layer whose slot mapping indexes this (windowed) layer's tap
    chunk: int = 0  # chunked local attention C (Llama 4): row i sees keys C * floor(i / C) .. i; 0: none
    # A windowed (or chunked) layer of a model with no full-attention KV-cache group: its own group, whose freed
    # blocks vLLM reuses while the request runs; ``group`` is then attn-otel's own block table
    # (:class:`attn_otel.shadow.ShadowBlocks`), which the forward's slots are mapped to.  -1: not so.
    own_group: int = -1
    # MLA: the latent rank L (kv_lora_rank).  Such a layer is captured as the multi-query attention vLLM's
    # decode path runs: one KV head of ``head_dim = L + rope`` (the latent cache row ``[c_kv | k_pe]``), queries
    # absorbed (``[q_nope W_UK^T | q_pe]``), values ``c_kv`` up-projected per head by ``W_UV``.  0: not MLA.
    latent: int = 0

    @property
    def plain(self) -> bool:
        """No window, soft-cap, sinks or chunks."""
        return not self.window and not self.soft_cap and self.sinks is None and not self.chunk

    @property
    def local(self) -> bool:
        """A sliding window or chunked local attention: keys fall out of the layer's view while the request
        runs (and vLLM frees their blocks), so it is streamed with a K-only tap by a full-attention group's
        slots, or keeps the Q/K tap (see :func:`attn_otel.vllm_adapter._plan`)."""
        return bool(self.window or self.chunk)

    def terms(self, device) -> dict:
        """The keyword arguments of :func:`attn_otel.attention.attention_metrics` for this layer's terms (the
        sinks as a float32 device tensor, made once per device)."""
        sinks = None if self.sinks is None else _sinks_tensor(self.sinks, str(torch.device(device)))
        return dict(soft_cap=float(self.soft_cap), window=int(self.window), sinks=sinks, chunk=int(self.chunk))


@functools.lru_cache(maxsize=256)
def _sinks_tensor(sinks: tuple[float, ...], device: str) -> torch.Tensor:
    return torch.tensor(sinks, dtype=torch.float32, device=device)


class QKTap:
    """Per captured layer, Q ``[slots+1, Hq, D]`` and K ``[slots+1, Hkv, D]`` on the model's device.

    The extra last slot absorbs padded tokens (``slot_mapping == -1``), so a write never branches.
    """

    def __init__(self, layers: Sequence[LayerSpec], num_slots: int, dtype: torch.dtype, device):
        self.layers = {spec.index: spec for spec in layers}
        self.num_slots = int(num_slots)
        self.dtype = dtype
        self.q: dict[int, torch.Tensor] = {}
        self.k: dict[int, torch.Tensor] = {}
        for spec in layers:
            self.q[spec.index] = torch.zeros((num_slots + 1, spec.num_heads, spec.head_dim), dtype=dtype, device=device)
            self.k[spec.index] = torch.zeros((num_slots + 1, spec.num_kv_heads, spec.head_dim), dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(layers: Sequence[LayerSpec], dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        return sum((s.num_heads + s.num_kv_heads) * s.head_dim * size for s in layers)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.q.values(), *self.k.values()))

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def write(self, layer: int, query: torch.Tensor, key: torch.Tensor, slot_mapping: torch.Tensor,
              kv: tuple | None = None) -> bool:
        """One launch for the query and key (padded tokens: slot S), and with ``kv`` vLLM's KV-cache write
        too (see :func:`attn_otel.triton_metrics.scatter_rows`); True where that launch wrote the cache."""
        done = triton_metrics.scatter_rows(self.q[layer], query, slot_mapping, self.num_slots,
                                           dst2=self.k[layer], src2=key, kv=kv)
        return done and kv is not None

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q[layer].index_select(0, slots), self.k[layer].index_select(0, slots)


def capture_bytes_per_token(tapped: Sequence[LayerSpec], streamed: Sequence[LayerSpec], keys_from_cache: bool,
                            dtype: torch.dtype, vision: bool = True) -> int:
    """Device bytes per KV-cache token of capture: the Q/K tap of the map layers and what streamed layers
    keep per token (see :meth:`attn_otel.stream.MetricsStream.bytes_per_token`; ``vision``: a model that takes
    images); the ring comes on top."""
    per = QKTap.bytes_per_token(tapped, dtype)
    if streamed:
        per += MetricsStream.bytes_per_token(streamed, keys_from_cache, dtype, vision)
    return per


@dataclasses.dataclass(frozen=True)
class Budget:
    """What :func:`kv_budget` leaves vLLM, and how the capture takes its share."""

    kv_bytes: int  # the KV-cache budget left
    per_token: int  # capture bytes per KV-cache token
    fixed: int  # bytes of the query ring and the map tap's fixed rows
    tapped: list  # layers on the Q/K tap
    streamed: list  # streamed layers
    mapped: list  # streamed map layers (the map tap)
    local_streamed: bool  # windowed and chunked layers streamed (else on the Q/K tap)


def kv_budget(available: int, kv_per_token: float, specs: Sequence[LayerSpec], maps: Sequence[int],
              streamed: Sequence[LayerSpec], keys_from_cache: bool, rows: int, dtype: torch.dtype, vision: bool,
              map_tap_rows: int, block_size: int = 16) -> Budget:
    """vLLM's KV-cache budget (``available`` bytes, ``kv_per_token`` bytes a token over every layer) once the
    capture has its share, as the engine sizes it before the KV-cache groups are known: the stream's query
    ring of ``rows``, its spill blocks (of ``block_size`` tokens: attn_otel.spill) and the map tap's fixed rows
    come off first, then tokens shrink by
    ``kv / (kv + capture bytes per token)``.  Windowed and chunked layers among ``streamed`` are weighed against
    keeping them on the Q/K tap (as map layers): on a small budget their share of the ring costs more; whichever
    leaves more KV cache is returned (``local_streamed`` says which; streamed on a tie).  ``bench/kv_capacity.py``
    runs it on production shapes."""
    if streamed and all(s.local for s in specs):
        # a model whose every layer has a window or chunks has no full-attention group: its layers will keep a
        # Q/K tap by attn-otel's own table (vllm_adapter._window_groups)
        maps, streamed = tuple(s.index for s in specs), []
    options = [_budget(available, kv_per_token, specs, maps, list(streamed), keys_from_cache, rows, dtype, vision,
                       map_tap_rows, True, block_size)]
    local = {s.index for s in streamed if s.local}
    if local:
        options.append(_budget(available, kv_per_token, specs, tuple(sorted(set(maps) | local)),
                               [s for s in streamed if not s.local], keys_from_cache, rows, dtype, vision,
                               map_tap_rows, False, block_size))
    return max(options, key=lambda b: b.kv_bytes)


def _budget(available, kv_per_token, specs, maps, streamed, keys_from_cache, rows, dtype, vision, map_tap_rows,
            local_streamed, block_size) -> Budget:
    tapped = [s for s in specs if s not in streamed]
    tap = capture_bytes_per_token(tapped, streamed, keys_from_cache, dtype, vision)
    fixed = MetricsStream.ring_bytes(streamed, rows, dtype) + spill_bytes(streamed, block_size) if streamed else 0
    mapped = [s for s in streamed if s.index in maps]
    if mapped:  # the map tap: a fixed number of rows (its slot table counted per token)
        fixed += MapTap.nbytes_for(mapped, map_tap_rows, 0, dtype)
        tap += 8
    scaled = int(max(0, available - fixed) * kv_per_token / (kv_per_token + tap))
    return Budget(scaled, tap, fixed, tapped, streamed, mapped, local_streamed)


@dataclasses.dataclass
class _Planned:
    """A request planned for maps: its map-tap row per position (-1: none yet), the slots pointed at them."""

    rows: np.ndarray
    slots: list = dataclasses.field(default_factory=list)
    lost: bool = False
    pointed: int = 0  # positions below this have their slots pointed at their rows (0 after an unpoint)


class MapTap:
    """Queries of the streamed map layers, kept only for the requests planned for maps at arrival.

    ``q[layer]`` is ``[rows + 1, Hq, D]`` (the last row absorbs every other token); the forward writes each
    token's query through ``row_of_slot`` (KV-cache slot -> row, graph-safe like the stream's ring), which
    points only the planned requests' slots at rows.  Rows are given per position as the request runs, and
    come back when it finishes, once the finish-time gather that reads them is done.  The keys (and values)
    stay where vLLM keeps them: the stream's key source (:class:`attn_otel.stream.MetricsStream`), read at
    finish by the request's slots.  A request whose every position did not get a row (the tap full, or a
    prefix-cache hit nothing prevented) is captured without maps, and counted."""

    def __init__(self, layers: Sequence[LayerSpec], num_slots: int, rows: int, dtype: torch.dtype, device,
                 block_size: int, group: int, side=None, checked: Sequence[LayerSpec] = ()):
        self.layers = {s.index: s for s in layers}
        # ATTN_OTEL_VERIFY only: layers whose queries the Q/K tap keeps (a window, soft-cap or sinks; tapped by
        # this group's slots), here for their output (and value) rows, on the same rows as the map layers
        self.checked = {s.index: s for s in checked}
        self.num_slots, self.rows = int(num_slots), int(rows)
        self.block_size, self.group = int(block_size), int(group)
        self.dtype = dtype
        self.device = torch.device(device)
        self.side = side
        self.q = {s.index: torch.zeros((self.rows + 1, s.num_heads, s.head_dim), dtype=dtype, device=device)
                  for s in layers}
        self.row_of_slot = torch.full((self.num_slots + 1,), self.rows, dtype=torch.int64, device=device)
        # ATTN_OTEL_VERIFY: the layer's attention output rows (and, where vLLM's cache is not read, its value
        # rows) of the planned requests too, so that a maps capture can check maps x V against the output.
        self.out: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}  # V rows, where no cache view is given
        self.values: dict[int, tuple[torch.Tensor, float]] = {}  # [blocks, bs, Hkv, Dv] cache view, v_scale
        self.v_up: dict[int, torch.Tensor] = {}  # MLA: W_UV [Hq, L, Dv], the values' per-head up-projection
        self._free = list(range(self.rows - 1, -1, -1))
        self._inflight: list[tuple[int, list[int]]] = []  # rows a finish-time gather still reads
        self._reqs: dict[str, _Planned] = {}
        self.lost = 0  # requests that could not keep every query
        # no token of the step about to run belongs to a planned request: every write would go to the padding
        # row, so the forward's writes are skipped where they run eagerly (never while a CUDA graph is being
        # captured: a graph replays whatever it captured)
        self.idle = False

    @staticmethod
    def nbytes_for(layers: Sequence[LayerSpec], rows: int, num_slots: int, dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        return sum((rows + 1) * s.num_heads * s.head_dim * size for s in layers) + 8 * (num_slots + 1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.q.values(), self.row_of_slot))

    def verify(self, layer: int, head_dim_v: int, value_cache: tuple[torch.Tensor, float] | None,
               v_up: torch.Tensor | None = None) -> None:
        """Keep ``layer``'s output rows (and its value rows unless ``value_cache`` gives vLLM's values); an MLA
        layer's values are its latent rows, up-projected per head by ``v_up`` (``W_UV``) at the check."""
        s = self.layers.get(layer) or self.checked[layer]
        self.out[layer] = torch.zeros((self.rows + 1, s.num_heads, head_dim_v), dtype=self.dtype, device=self.device)
        if v_up is not None:
            self.v_up[layer] = v_up
        if value_cache is not None:
            self.values[layer] = value_cache
        else:
            width = s.latent if v_up is not None else head_dim_v
            self.v[layer] = torch.zeros((self.rows + 1, s.num_kv_heads, width), dtype=self.dtype, device=self.device)

    def _skip(self) -> bool:
        """Whether this forward's writes can be left out (see ``idle``)."""
        return self.idle and not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing())

    def write(self, layer: int, query: torch.Tensor, slot_mapping: torch.Tensor,
              value: torch.Tensor | None = None) -> None:
        """In the forward (graph-safe): this step's queries of ``layer``, the planned requests' to their rows."""
        if self._skip():
            return
        v = self.v.get(layer) if value is not None else None
        if layer not in self.q:  # a checked layer: its queries are in the Q/K tap, only its values here
            if v is not None:
                triton_metrics.scatter_rows(v, value, slot_mapping, self.num_slots, table=self.row_of_slot)
            return
        triton_metrics.scatter_rows(self.q[layer], query, slot_mapping, self.num_slots, table=self.row_of_slot,
                                    dst2=v, src2=value if v is not None else None)

    def write_out(self, layer: int, output: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """After the attention (graph-safe): its output rows of the planned requests (ATTN_OTEL_VERIFY)."""
        if self._skip():
            return
        triton_metrics.scatter_rows(self.out[layer], output, slot_mapping, self.num_slots, table=self.row_of_slot)

    # ------------------------------------------------------------------ engine loop, before a forward
    def schedule(self, items: Sequence[tuple[str, Any, int, int]]) -> None:
        """This step's tokens ``(request id, tracked record, first position, count)``: rows for the positions
        of the requests planned for maps (``tracked.maps``), and their slots pointed at them.

        Slots are pointed a block at a time: the step that first writes into a block points the rest of that
        block's slots too (rows given for positions the request has not reached; the request owns the block,
        so nothing else writes them), and the decode steps after it upload nothing.  Before, every step of a
        planned request uploaded its one slot and row (about 1% of the engine loop's main thread under online
        load, run 34's profile: a planned request runs in most steps)."""
        slots_l, rows_l = [], []
        idle = True
        bs = self.block_size
        for req_id, tracked, start, n in items:
            if n <= 0 or not tracked.maps:
                continue
            r = self._reqs.get(req_id)
            if r is None:
                r = self._reqs[req_id] = _Planned(np.full(max(64, start + n), -1, dtype=np.int64))
            if r.lost:
                continue
            idle = False
            end = start + n
            if end <= r.pointed:  # a position of a block already pointed (decode steps inside a block)
                continue
            lo = max(start, r.pointed)
            for hi in (-(-end // bs) * bs, end):  # to the end of the last token's block, else the step's own
                if self._take_rows(r, lo, hi):
                    break
            else:
                self._lose(req_id, r)
                continue
            slots = slots_of(tracked.block_ids[self.group], bs, lo, hi - lo)
            r.slots.append(slots)
            slots_l.append(slots)
            rows_l.append(r.rows[lo:hi])
        if slots_l:
            pair = upload(np.stack([np.concatenate(slots_l), np.concatenate(rows_l)]), self.device)
            self.row_of_slot.index_copy_(0, pair[0], pair[1])
        self.idle = idle

    def short(self, items: Sequence[tuple[str, Any, int, int]]) -> bool:
        """Whether this step's tokens (as :meth:`schedule` takes them) may want more rows than are free: an upper
        bound, each planned request's positions from where its slots are pointed to the end of its last
        token's block.  Then the finished requests planned for maps that the deferred finish holds must give
        their rows back before the forward (:mod:`attn_otel.deferred`, the ``maps`` rule); otherwise they can
        wait like the others."""
        want = 0
        bs = self.block_size
        for req_id, tracked, start, n in items:
            if n <= 0 or not tracked.maps:
                continue
            r = self._reqs.get(req_id)
            if r is not None and r.lost:
                continue
            end = start + n
            lo = start if r is None else max(start, r.pointed)
            if end > lo:
                want += -(-end // bs) * bs - lo
        if want > len(self._free):
            self._reclaim()
        return want > len(self._free)

    def _take_rows(self, r: _Planned, lo: int, hi: int) -> bool:
        """Rows for positions ``lo .. hi - 1`` of ``r`` (those without one); False (nothing taken) where the tap
        has too few free rows even after the finish-time gathers done so far gave theirs back."""
        if hi > r.rows.shape[0]:
            grown = np.full(max(hi, 2 * r.rows.shape[0]), -1, dtype=np.int64)
            grown[: r.rows.shape[0]] = r.rows
            r.rows = grown
        need = np.flatnonzero(r.rows[lo:hi] < 0)
        if need.size > len(self._free):
            self._reclaim(wait=True)
        if need.size > len(self._free):
            return False
        for i in need.tolist():
            r.rows[lo + i] = self._free.pop()
        r.pointed = hi
        return True

    def _lose(self, req_id: str, r: _Planned) -> None:
        r.lost = True
        self.lost += 1
        self._unpoint(r)
        self._free.extend(int(x) for x in r.rows[r.rows >= 0])
        r.rows[:] = -1

    def _unpoint(self, r: _Planned) -> None:
        """Point the request's slots back at the padding row (on the engine's stream, before any forward
        that could write them for another request)."""
        if r.slots:
            self.row_of_slot.index_fill_(0, upload(np.concatenate(r.slots), self.device), self.rows)
            r.slots = []
        r.pointed = 0

    def preempt(self, req_ids) -> None:
        """Preempted requests' blocks go to others: their slots stop pointing at its rows (it keeps them;
        recomputed positions are written again when it resumes)."""
        for req_id in req_ids:
            r = self._reqs.get(req_id)
            if r is not None:
                self._unpoint(r)

    # ------------------------------------------------------------------ at finish
    def complete(self, req_id: str, T: int) -> bool:
        """Whether every one of the request's first ``T`` positions has its query here."""
        r = self._reqs.get(req_id)
        return r is not None and not r.lost and r.rows.shape[0] >= T and bool((r.rows[:T] >= 0).all())

    def rows_of(self, req_id: str, T: int) -> torch.Tensor:
        return upload(self._reqs[req_id].rows[:T], self.device)

    def gather(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        return self.q[layer].index_select(0, rows)

    def gather_check(self, layer: int, rows: torch.Tensor, slots: torch.Tensor) -> tuple | None:
        """``(values [T, Hkv, Dv] as the attention read them, v_scale, outputs [T, Hq, Dv])`` of ``layer``
        for ATTN_OTEL_VERIFY (MLA: values ``[T, 1, L]`` and ``W_UV`` fourth), or None where it is off."""
        out = self.out.get(layer)
        if out is None:
            return None
        if layer in self.values:
            cache, v_scale = self.values[layer]
            v = keys_at(cache, slots, self.dtype)
        else:
            v, v_scale = self.v[layer].index_select(0, rows), 1.0
        up = self.v_up.get(layer)
        return (v, v_scale, out.index_select(0, rows)) + ((up,) if up is not None else ())

    def release(self, req_ids, seq: int = 0) -> None:
        """Finished requests (after their gathers were enqueued, as work ``seq`` of the side stream): their
        slots unpointed now, their rows free once that work is done."""
        back: list[int] = []
        for req_id in req_ids:
            r = self._reqs.pop(req_id, None)
            if r is None:
                continue
            self._unpoint(r)
            back.extend(int(x) for x in r.rows[r.rows >= 0])
        if back:
            if seq and self.side is not None:
                self._inflight.append((seq, back))
            else:
                self._free.extend(back)
        self._reclaim()

    def _reclaim(self, wait: bool = False) -> None:
        if not self._inflight or self.side is None:
            return
        if wait:
            self.side.wait(self._inflight[-1][0], "map_ring")
        while self._inflight and self.side.safe(self._inflight[0][0]):
            self._free.extend(self._inflight.pop(0)[1])
