"""The capture engine: device-side Q/K taps paged like the KV cache, finish-time math, bounded hand-off.

vLLM-free: :mod:`attn_otel.vllm_adapter` feeds it tensors and request views; everything here works on
plain torch tensors, so it is tested without an engine as well as through one.

Why a tap and not the KV cache: a query is gone after its step, and a request's rows are only known in
full when it finishes.  Each step, every captured layer scatters its queries (and keys) into a tap
indexed by the same slot ids as the KV cache (``index_copy_`` by ``slot_mapping``: no host sync, valid
inside CUDA-graph capture).  Prefix caching then comes for free: a cached block still holds the Q/K the
request that computed it wrote, and those are bit-identical for identical tokens and positions.  Keys are
tapped too (not read back from the KV cache) so that one code path serves every backend and KV layout,
including the CPU backend's ISA-specific packing; see the README for what that costs.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch

from . import triton_metrics
from .attention import METRICS, ROWS, attention_metrics
from .config import Config, RequestOptions
from .metrics import summary_only
from .ids import (derived_span_id, derived_trace_id, maps_sampled, new_span_id, new_trace_id, parse_traceparent,
                  traceparent_sampled)
from .hostmem import SegmentPool, Staging
from .store import CapturePart, CaptureRecord
from .stream import MetricsStream, Side, slots_of, upload
from .writer_proc import os_thread_name as _os_thread_name

logger = logging.getLogger("attn_otel")

EXIT_DRAIN_S = 30.0
BAND_BYTES = 64 << 20  # float32 logits of one band of query rows, all heads (GPU)


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    index: int  # model layer number (0-based, in model order)
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    group: int = 0  # KV-cache group of the layer


@dataclasses.dataclass(frozen=True)
class Parallel:
    """Where this engine's rank sits in a tensor- and/or pipeline-parallel model.

    Each rank taps the heads and layers it holds and writes them as one :class:`CapturePart` of the
    request's capture; nothing crosses ranks on the serving path.  Every rank derives the same trace id,
    span id and maps decision for a request from ``id_seed`` (vLLM's instance id, shared by its workers)."""

    tp_rank: int
    tp: int
    pp_rank: int
    pp: int
    total_heads: int  # query heads of the whole model (this rank holds heads_per_rank of them)
    stage_of: dict[int, int]  # model layer -> pipeline stage that holds it
    capture_layers: tuple[int, ...]  # ATTN_OTEL_LAYERS resolved on the whole model, all stages
    id_seed: str = ""

    def part(self, layers: Sequence[int], local_heads: int, local: Sequence[int]) -> CapturePart | None:
        """This rank's part of a capture of ``layers`` (None: this rank's stage holds none of them);
        ``local`` are the layers this rank captures (a stage's layer it refuses stays empty)."""
        stages = sorted({self.stage_of.get(x, -1) for x in layers})
        if self.pp_rank not in stages:
            return None
        mine = tuple(x for x in layers if self.stage_of.get(x) == self.pp_rank and x in local)
        return CapturePart(index=stages.index(self.pp_rank) * self.tp + self.tp_rank, count=len(stages) * self.tp,
                           heads=(self.tp_rank * local_heads, (self.tp_rank + 1) * local_heads), layers=mine,
                           tp=self.tp, pp=self.pp)


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
                            dtype: torch.dtype) -> int:
    """Device bytes per KV-cache token of capture: the Q/K tap of the map layers and what streamed layers
    keep per token (see :meth:`attn_otel.stream.MetricsStream.bytes_per_token`); the ring comes on top."""
    per = QKTap.bytes_per_token(tapped, dtype)
    if streamed:
        per += MetricsStream.bytes_per_token(streamed, keys_from_cache, dtype)
    return per


@dataclasses.dataclass
class FinishedRequest:
    """What the adapter knows of a request when it finishes, before its blocks can be reused."""

    request_id: str
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int] | None  # None when only the device holds them (see token_ids_device)
    num_tokens: int  # tokens whose Q/K went through the model (prompt + generated - last sampled)
    block_ids: Sequence[Sequence[int]]  # per KV-cache group
    block_sizes: Sequence[int]  # per KV-cache group
    extra_args: dict[str, Any] | None = None
    vision_positions: np.ndarray | None = None  # bool [>= num_tokens], True on image-embedding tokens
    token_ids_device: torch.Tensor | None = None  # all token ids [>= num_tokens] on the device


@dataclasses.dataclass
class _Tracked:
    prompt_token_ids: list[int]
    extra_args: dict[str, Any] | None
    block_ids: list[list[int]]
    vision_positions: np.ndarray | None
    written: int = 0


class RequestTracker:
    """Follows each request through the scheduler's per-step output: its blocks (per KV-cache group) and
    how many of its tokens have been through the model.  Fed by the adapter; knows nothing of vLLM."""

    def __init__(self) -> None:
        self._reqs: dict[str, _Tracked] = {}

    def __len__(self) -> int:
        return len(self._reqs)

    def add(self, req_id: str, prompt_token_ids, extra_args, block_ids, num_computed: int, num_scheduled: int,
            vision_positions=None) -> _Tracked:
        t = self._reqs[req_id] = _Tracked(list(prompt_token_ids or []), extra_args, [list(b) for b in block_ids],
                                          vision_positions, int(num_computed) + int(num_scheduled))
        return t

    def update(self, req_id: str, new_block_ids, num_computed: int, num_scheduled: int,
               resumed: bool) -> _Tracked | None:
        t = self._reqs.get(req_id)
        if t is None:
            return None
        if new_block_ids is not None:
            if resumed:
                t.block_ids = [list(b) for b in new_block_ids]
            else:
                for group, extra in zip(t.block_ids, new_block_ids):
                    group.extend(extra)
        t.written = int(num_computed) + int(num_scheduled)
        return t

    def finish(self, req_id: str) -> _Tracked | None:
        return self._reqs.pop(req_id, None)

    def get(self, req_id: str) -> _Tracked | None:
        return self._reqs.get(req_id)


class Stats:
    """Capture counters, read by the exporters (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.captured = 0
        self.stored = 0
        self.maps_stored = 0
        self.dropped: collections.Counter[str] = collections.Counter()
        self.skipped: collections.Counter[str] = collections.Counter()
        self.export_errors: collections.Counter[str] = collections.Counter()  # by exporter, store excluded
        self.bytes_written = 0
        # seconds, per capture: request finish -> metrics on the host, ready for the exporters
        self.latencies: collections.deque[float] = collections.deque(maxlen=10_000)
        # seconds, per capture: request finish -> stored
        self.write_latencies: collections.deque[float] = collections.deque(maxlen=10_000)
        # seconds the engine loop spent in a capture (enqueueing device work; no I/O, no sync)
        self.loop_times: collections.deque[float] = collections.deque(maxlen=10_000)

    def add(self, field: str, n: int = 1, reason: str | None = None) -> None:
        with self._lock:
            if reason is None:
                setattr(self, field, getattr(self, field) + n)
            else:
                getattr(self, field)[reason] += n

    def snapshot(self, percentiles: bool = False) -> dict[str, Any]:
        with self._lock:
            snap: dict[str, Any] = {"captured": self.captured, "stored": self.stored,
                                    "maps_stored": self.maps_stored, "dropped": dict(self.dropped),
                                    "skipped": dict(self.skipped), "export_errors": dict(self.export_errors),
                                    "bytes_written": self.bytes_written}
            if percentiles:
                for name in ("latencies", "write_latencies", "loop_times"):
                    vals = np.asarray(getattr(self, name), dtype=np.float64)
                    snap[name] = ({q: float(np.quantile(vals, float(q[1:]) / 100)) for q in ("p50", "p90", "p99")}
                                  | {"n": int(vals.size), "max": float(vals.max())}) if vals.size else {"n": 0}
            return snap


@dataclasses.dataclass
class _Job:
    record: CaptureRecord
    per_row: torch.Tensor  # [len(METRICS), L, H, T] on host (pinned when the device is a GPU)
    maps: torch.Tensor | None  # float16 [L, H, T, T] on host
    event: Any  # torch.cuda.Event or None
    nbytes: int
    t_finish: float
    token_ids: torch.Tensor | None = None  # host copy of device-held token ids, valid after ``event``
    keep: list[int] | None = None  # the request's layers among per_row's, picked after ``event``
    # Instead of per_row (None then): its summary computed on the device, [part, metric, stat, L, H] host
    # float32 (attn_otel.metrics.summary_to_array's layout), when no per-row metrics are stored.
    summary: torch.Tensor | None = None
    # Where ``maps`` lives when it is a pool segment (attn_otel.hostmem): the writer process reads it there;
    # it goes back to the pool once the job is written or dropped (the hand-off's ``done``).
    maps_seg: Any = None


SUMMARY_CHUNK_BYTES = 256 << 20
FINISH_CHUNK_BYTES = 512 << 20  # per-row metrics of a step's finished requests on the device, per launch


def device_summaries(per_row: torch.Tensor, cu: Sequence[int], prompt_lens: Sequence[int],
                     vision: bool = True, fused: bool | None = None) -> torch.Tensor:
    """:func:`attn_otel.metrics.summarize` + :func:`~attn_otel.metrics.summary_to_array` of several
    requests at once, in torch on ``per_row``'s device: ``per_row [L, 7, H, sum T]`` (request b's rows at
    ``cu[b]:cu[b+1]``, NaN where undefined; float32, or float16 as the streamed layers keep them: sorted
    as they are, summed in float32) -> ``[B, part, metric, stat, L, H]`` float32.  The same
    statistics (mean over defined rows, and NumPy's "linear" quantiles of them), computed where the rows
    are, so that only a few kB per request cross to the host and the writers.  Each part sorts only its own
    rows and the metrics it can have (no vision metrics unless ``vision``; lookback on generated rows).  On a
    GPU one Triton program selects the quantiles of each part of each layer and head
    (:func:`attn_otel.triton_metrics.summaries`: a few launches where this torch code makes hundreds);
    ``fused=False`` forces the torch code."""
    from .metrics import GENERATED_ONLY, PARTS, QUANTILES, SUMMARY_METRICS, SUMMARY_STATS, VISION

    L, M, H, _ = per_row.shape
    dev = per_row.device
    B = len(cu) - 1

    def up(values) -> torch.Tensor:  # indices to the device with no sync, as every index here
        return upload(np.asarray(values, dtype=np.int64), dev)

    out = torch.full((B, len(PARTS), len(SUMMARY_METRICS), len(SUMMARY_STATS), L, H), float("nan"),
                     dtype=torch.float32, device=dev)
    if fused is not False and triton_metrics.summaries(per_row, [int(x) for x in cu], list(prompt_lens), vision,
                                                       tuple(QUANTILES.values()), out):
        return out  # one Triton launch per bucket of part lengths (on a GPU)
    for pi, part in enumerate(PARTS):
        names = [n for n in SUMMARY_METRICS if (vision or n not in VISION)
                 and (part == "generated" or n not in GENERATED_ONLY)]
        mi = up([SUMMARY_METRICS.index(n) for n in names])
        src = per_row.index_select(1, mi)  # [L, m, H, sum T]
        m = len(names)
        starts, lens = [], []
        for b in range(B):
            T = int(cu[b + 1] - cu[b])
            N = min(int(prompt_lens[b]), T)
            starts.append(int(cu[b]) if part == "prompt" else int(cu[b]) + N)
            lens.append(N if part == "prompt" else T - N)
        b0 = 0
        while b0 < B:  # chunks of requests, each padded to its longest part
            tmax = max(lens[b0], 1)
            b1 = b0 + 1
            while b1 < B and (b1 + 1 - b0) * max(tmax, lens[b1]) * L * m * H * 4 <= SUMMARY_CHUNK_BYTES:
                tmax = max(tmax, lens[b1])
                b1 += 1
            n = b1 - b0
            ar = torch.arange(tmax, device=dev)
            start = up(starts[b0:b1])
            ln = up(lens[b0:b1])
            idx = (start[:, None] + ar[None, :]).clamp(max=src.shape[-1] - 1)  # [n, tmax]
            v = src[..., idx.reshape(-1)].reshape(L, m, H, n, tmax)
            v = torch.where(ar[None, :] < ln[:, None], v, torch.full((), float("nan"), device=dev))
            defined = ~torch.isnan(v)
            count = defined.sum(-1)
            total = torch.where(defined, v, 0.0).sum(-1, dtype=torch.float32)
            stats = [torch.where(count > 0, total / count.clamp(min=1), float("nan"))]
            srt = torch.sort(v, dim=-1).values  # NaN sorts last
            last = (count - 1).clamp(min=0)
            for q in QUANTILES.values():
                pos = q * last.double()
                lo = torch.floor(pos).long()
                hi = torch.minimum(lo + 1, last)
                t = (pos - lo).float()
                a = torch.gather(srt, -1, lo[..., None])[..., 0]
                bv = torch.gather(srt, -1, hi[..., None])[..., 0]
                a, bv = a.float(), bv.float()
                val = torch.where(t >= 0.5, bv - (bv - a) * (1 - t), a + (bv - a) * t)
                stats.append(torch.where(count > 0, val, float("nan")))
            # [L, m, H, n] per stat -> [n, m, stat, L, H]
            out[b0:b1, pi, mi] = torch.stack(stats, 0).permute(4, 2, 0, 1, 3)
            b0 = b1
    return out


def _at_exit(fn: Callable[[], None]) -> None:
    """Run ``fn`` at interpreter exit *before* thread-pool executors shut down (zarr's stores do their
    I/O through one), the way concurrent.futures itself registers; plain atexit runs too late."""
    import concurrent.futures.thread  # noqa: F401 - registered first, so it runs after ``fn``

    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(fn)
            return
    except RuntimeError:  # already shutting down
        return
    import atexit

    atexit.register(fn)


@dataclasses.dataclass
class _Pending:
    """A finished request's gathered Q/K, waiting for the compute thread."""

    record: CaptureRecord
    layers: list[LayerSpec]
    qk: list[tuple[torch.Tensor, torch.Tensor]]
    tokens_dev: torch.Tensor | None
    ready: Any  # torch.cuda.Event on the engine's stream after the gathers, or None
    want_maps: bool
    nbytes: int  # host bytes reserved in the hand-off
    gathered: int  # device bytes held by qk
    t_finish: float = 0.0
    streamed: torch.Tensor | None = None  # [streamed layers, T, 7, Hq] float16 (see attn_otel.stream)


class Handoff:
    """Bounded (in bytes) queue from the engine loop to one writer thread: put never blocks; when a
    capture does not fit, it is dropped and counted."""

    def __init__(self, config: Config, stats: Stats, sink: Callable[[_Job], None], ranks: int = 1,
                 done: Callable[[_Job], None] | None = None):
        self.capacity = config.queue_bytes
        self.stats = stats
        self._sink = sink
        self._done = done  # after each job, written or dropped
        self._bytes = 0
        self._closing = 0.0
        self._lock = threading.Lock()
        self._q: queue.Queue[_Job | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        from .config import writer_count

        self._threads = [threading.Thread(target=self._run, name=f"attn-otel-writer-{i}", daemon=True)
                         for i in range(writer_count(config, ranks))]
        for t in self._threads:
            t.start()
        _at_exit(self._drain_at_exit)

    def reserve(self, nbytes: int) -> bool:
        with self._lock:
            if self._bytes + nbytes > self.capacity:
                return False
            self._bytes += nbytes
            self._idle.clear()
            return True

    def put(self, job: _Job) -> None:
        self._q.put_nowait(job)

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._bytes -= nbytes
            if self._bytes <= 0 and self._q.empty():
                self._idle.set()

    @property
    def pending_bytes(self) -> int:
        return self._bytes

    def _run(self) -> None:
        _os_thread_name("attn-otel-write")
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                if self._closing and time.monotonic() > self._closing:  # a hung store must not hang exit
                    self.stats.add("dropped", reason="shutdown")
                else:
                    self._sink(job)
            finally:
                self.release(job.nbytes)
                if self._done is not None:
                    self._done(job)

    def begin_closing(self, seconds: float) -> float:
        """From now on, exit is near: jobs still queued ``seconds`` from the first call are dropped
        (``shutdown``).  Returns that deadline, shared by every step of the exit."""
        if not self._closing:
            self._closing = time.monotonic() + seconds
        return self._closing

    def _drain_at_exit(self) -> None:
        deadline = self.begin_closing(EXIT_DRAIN_S)
        self.flush(max(0.0, deadline - time.monotonic()) + 0.1)

    def flush(self, timeout: float | None = None) -> bool:
        return self._idle.wait(timeout)


class CaptureEngine:
    """Owns the tap, turns finished requests into captures, and hands them to the writer."""

    def __init__(self, config: Config, layers: Sequence[LayerSpec], num_slots: int, dtype: torch.dtype,
                 device, model: str = "", engine_version: str = "", attrs: dict[str, Any] | None = None,
                 parallel: Parallel | None = None, stream: MetricsStream | None = None,
                 map_layers: Sequence[int] | None = None):
        self.config = config
        self.layers = list(layers)
        self.layer_ids = tuple(s.index for s in self.layers)
        # Streamed layers (attn_otel.stream) have no Q/K tap: their rows are computed while requests run.
        self.stream = stream
        self.streamed = frozenset(stream.pos) if stream is not None else frozenset()
        # Finish-time device work runs on a second stream, beside the next forward (see attn_otel.stream.Side).
        self.side = stream.side if stream is not None else Side(device)
        tapped = [s for s in self.layers if s.index not in self.streamed]
        self.tap = QKTap(tapped, num_slots, dtype, device)
        # Layers a maps capture covers (the whole model's, under pipeline parallelism): the tapped ones.
        if map_layers is None:  # no streamed layer: every captured layer (of every stage) has maps
            map_layers = parallel.capture_layers if parallel is not None else [s.index for s in tapped]
        self.map_layers = tuple(map_layers)
        self.device = torch.device(device)
        self.model = model
        self.engine_version = engine_version
        self.attrs = dict(attrs or {})
        self.stats = Stats()
        self.parallel = parallel  # this rank's place under tensor/pipeline parallelism (None: one GPU)
        self._warned: set[str] = set()
        # Per writer thread: its exporters (ATTN_OTEL_WRITER=thread) or its writer process.
        self._local = threading.local()
        self._fanouts: list = []
        self._writer_procs: list = []
        # Maps reach the host through a small pinned buffer into reused shared memory (attn_otel.hostmem).
        self._staging = Staging() if self.device.type == "cuda" else None
        self._maps_pool = SegmentPool(config.queue_bytes)
        self.handoff = Handoff(config, self.stats, self._write, 1 if parallel is None else parallel.tp * parallel.pp,
                               done=lambda job: self._maps_pool.release(job.maps_seg))
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.fused_kv_layers = 0  # layers whose K/V write to vLLM's cache shares the Q write's launch (adapter)
        # Metrics-only captures on a GPU are computed on the engine's stream straight from the tap.
        self._fused = triton_metrics.available(self.device)
        self._device_lock = threading.Lock()
        self._device_bytes = 0
        self.finish_device_s = 0.0  # device time of the batched finish-time work (metrics-only captures)
        self._finish_timing: list = []
        self._device_idle = threading.Event()
        self._device_idle.set()
        self._compute_q: queue.Queue[_Pending] = queue.Queue()
        self._compute_thread = threading.Thread(target=self._compute_loop, name="attn-otel-compute", daemon=True)
        self._compute_thread.start()
        _at_exit(self.close)  # registered after the hand-off's drain, so it runs before it
        # Counters change on the engine loop and the compute thread too (drops there never reach a writer):
        # a timer keeps the stats file at most a second behind.
        self._stop_dumper = threading.Event()
        self._dump_lock = threading.Lock()
        if config.stats_dir:
            threading.Thread(target=self._dump_loop, name="attn-otel-stats", daemon=True).start()

    def warm_up(self) -> None:
        """Compile the Triton kernels the finish path and the stream's flushes launch, for the shapes a text
        model's requests use, at engine start (each would otherwise compile mid-serving, a stall of seconds
        on the first request of its shape; Triton's on-disk cache makes later starts quick).  The maps
        path's pinned staging buffer is allocated here too.  Never raises."""
        if self._staging is not None and self.map_layers:
            try:
                self._staging.allocate()
            except Exception:  # noqa: BLE001 - allocated on the first maps capture instead
                logger.warning("attn-otel: pinning the maps staging buffer at start failed", exc_info=True)
        if not self._fused:
            return
        t0 = time.perf_counter()
        try:
            launches = triton_metrics.warm_up_summaries(self.device)
            if self.stream is not None:
                launches += self.stream.warm_up()
            tapped = [s for s in self.layers if s.index not in self.streamed]
            if tapped:
                spec = tapped[0]
                slots = torch.zeros(1, dtype=torch.int64, device=self.device)
                cu = torch.tensor([0, 1], dtype=torch.int32, device=self.device)
                prompt = torch.ones(1, dtype=torch.int32, device=self.device)  # its own (aligned) allocation
                triton_metrics.row_metrics_slots(self.tap.q[spec.index], self.tap.k[spec.index], slots, cu, prompt,
                                                 1, spec.scale, self.config.sink_tokens)
                launches += 1
            torch.cuda.synchronize(self.device)
            logger.info("attn-otel: %d metric kernel variants ready in %.1f s", launches, time.perf_counter() - t0)
        except Exception:  # noqa: BLE001 - a kernel that fails here compiles (or fails) when first used
            logger.warning("attn-otel: compiling the metric kernels at start failed; they compile when first "
                           "used", exc_info=True)

    def device_bytes(self) -> int:
        """Device memory this engine holds: the Q/K tap and the stream's ring, table and metrics buffer."""
        return self.tap.nbytes() + (self.stream.nbytes() if self.stream is not None else 0)

    def bytes_per_token(self) -> int:
        """Device bytes per KV-cache token (the stream's fixed-size ring not included)."""
        st = self.stream
        return capture_bytes_per_token(list(self.tap.layers.values()), st.layers if st else [],
                                       st is not None and not st.k_tap, self.tap.dtype)

    # ----------------------------------------------------------------- engine-loop side (no I/O here)
    def warn_once(self, key: str, msg: str, *args: Any, exc: bool = False) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        (logger.exception if exc else logger.warning)("attn-otel: " + msg, *args)

    def on_finished(self, req: FinishedRequest) -> None:
        self.on_finished_many([req])

    def on_finished_many(self, reqs: Sequence[FinishedRequest]) -> None:
        """Capture the requests that finished this step.  Never raises: a failure is logged once and
        counted.  On a GPU, metrics-only captures are batched: one fused kernel launch per layer reads
        every such request's rows straight out of the tap (see :meth:`_metrics_from_tap`)."""
        side = self.side
        try:
            side.begin()  # after the forwards that wrote these requests' rows
            if side.stream is not None:
                for req in reqs:  # allocated on the engine's stream, read on the side stream
                    if req.token_ids_device is not None and req.token_ids_device.is_cuda:
                        req.token_ids_device.record_stream(side.stream)
        except Exception:  # noqa: BLE001 - capture must never take the engine down
            self.stats.add("dropped", len(reqs), reason="capture_error")
            self.warn_once("side", "could not order the capture stream after the forwards; %d captures dropped "
                           "(logged once)", len(reqs), exc=True)
            return
        with side.context():
            self._on_finished_many(reqs)
        try:  # their blocks go back to vLLM now: a forward that writes one waits for this work (Side.guard)
            seq = side.mark()
            for req in reqs:
                side.taken_back(req.block_ids, seq, req.num_tokens if req.block_sizes else None,
                                req.block_sizes)
        except Exception:  # noqa: BLE001
            self.warn_once("side-blocks", "could not record which blocks the capture stream reads", exc=True)

    def _on_finished_many(self, reqs: Sequence[FinishedRequest]) -> None:
        batch: list[tuple[FinishedRequest, dict[str, Any]]] = []
        for req in reqs:
            try:
                fast = self._capture(req)
                if fast is not None:
                    batch.append((req, fast))
            except Exception as e:  # noqa: BLE001 - capture must never take the request or engine down
                self.stats.add("dropped", reason="capture_error")
                self.warn_once(f"err:{type(e).__name__}", "capture of request %s failed; dropped and counted "
                               "(logged once per error type)", req.request_id, exc=True)
        if batch:
            self._metrics_from_tap(batch)

    def _capture(self, req: FinishedRequest) -> dict[str, Any] | None:
        """Either enqueue the request's capture (gather + compute thread), or, for a metrics-only capture
        on a GPU, return what :meth:`_metrics_from_tap` needs to batch it with the step's others."""
        t0 = time.perf_counter()
        opts = self._options(req)
        if opts.mode == "off":
            self.stats.add("skipped", reason="request_off")
            return
        T = int(req.num_tokens)
        if T < 1:
            self.stats.add("skipped", reason="no_tokens")
            return
        par = self.parallel
        tapped = self.layer_ids if par is None else par.capture_layers
        wanted = tapped if opts.layers is None else tuple(x for x in tapped if x in opts.layers)
        if opts.layers is not None and len(wanted) < len(opts.layers):
            self.warn_once("layers-not-tapped", "request %s asked for layers %s; only %s are captured "
                           "(ATTN_OTEL_LAYERS); capturing those", req.request_id, list(opts.layers), list(tapped))
        if not wanted:
            self.stats.add("skipped", reason="no_layers")
            return
        if self.stream is not None and self.stream.lost(req.request_id):
            self.stats.add("dropped", reason="stream_lost")
            self.warn_once("stream_lost", "a step had more tokens than ATTN_OTEL_STREAM_ROWS; the streamed layers "
                           "of its requests were not computed, their captures are dropped and counted")
            return
        if par is not None and par.id_seed:
            trace_id, parent = derived_trace_id(par.id_seed, req.request_id), None
        else:
            trace_id, parent = new_trace_id(), None
        sampled = True
        if opts.traceparent:
            trace_id, parent = parse_traceparent(opts.traceparent)  # type: ignore[misc]
            sampled = traceparent_sampled(opts.traceparent)
        want_maps = opts.mode == "maps" or (opts.mode is None and maps_sampled(trace_id, self.config.maps_sample))
        if want_maps and T > self.config.max_map_tokens:
            self.stats.add("skipped", reason="map_too_long")
            want_maps = False
        mapped = tuple(x for x in wanted if x in self.map_layers)
        if want_maps and mapped != tuple(wanted):  # a maps capture covers the map layers (streamed ones keep no Q)
            if mapped:
                wanted = mapped
            else:
                self.stats.add("skipped", reason="no_map_layers")
                self.warn_once("no_map_layers", "request %s asked for maps of layers %s, which are streamed "
                               "(metrics only; ATTN_OTEL_MAP_LAYERS); capturing metrics", req.request_id,
                               list(wanted))
                want_maps = False
        layers = [s for s in self.layers if s.index in wanted]
        if not layers:  # pipeline parallel: the request's layers are all on other stages
            return
        H = max(s.num_heads for s in layers)
        L = len(layers)
        summarised = not want_maps and self._fused and self.config.row_metrics != "all"
        if summarised:  # only its summary leaves the device (see device_summaries)
            nbytes = 2 * len(METRICS) * 4 * L * H * 4
        else:
            nbytes = len(METRICS) * L * H * T * 4 + (L * H * T * T * 2 if want_maps else 0)
        if not self.handoff.reserve(nbytes):
            if want_maps and self.handoff.reserve(nbytes - L * H * T * T * 2):
                nbytes -= L * H * T * T * 2
                want_maps = False
                self.stats.add("skipped", reason="maps_queue_full")
            else:
                self.stats.add("dropped", reason="queue_full")
                self.warn_once("queue_full", "hand-off queue full (%d bytes, ATTN_OTEL_QUEUE_BYTES); dropping "
                               "captures and counting them", self.config.queue_bytes)
                return
        if not want_maps and self._fused:
            device = nbytes if summarised else len(METRICS) * L * H * T * 4
            if not self._device_reserve(device):
                self.handoff.release(nbytes)
                self.stats.add("dropped", reason="device_queue_full")
                return None
            return {"layers": layers, "T": T, "nbytes": nbytes, "device": device, "trace_id": trace_id,
                    "parent": parent, "t0": t0, "wanted": wanted, "sampled": sampled}
        gathered = sum(T * (s.num_heads + s.num_kv_heads) * s.head_dim * self.tap.itemsize
                       if s.index not in self.streamed else T * len(METRICS) * s.num_heads * 2 for s in layers)
        if not self._device_reserve(gathered):
            self.handoff.release(nbytes)
            self.stats.add("dropped", reason="device_queue_full")
            self.warn_once("device_full", "finish-time work waiting on the device exceeds %d bytes "
                           "(ATTN_OTEL_DEVICE_QUEUE_BYTES); dropping captures and counting them",
                           self.config.device_queue_bytes)
            return
        try:
            pending = self._gather(req, layers, T, want_maps, nbytes, gathered, trace_id, parent, wanted, sampled)
        except BaseException:
            self.handoff.release(nbytes)
            self._device_release(gathered)
            raise
        pending.t_finish = t0
        self._compute_q.put_nowait(pending)
        self.stats.loop_times.append(time.perf_counter() - t0)
        return None

    def _metrics_from_tap(self, batch: list[tuple[FinishedRequest, dict[str, Any]]]) -> None:
        """Engine loop, GPU, metrics only: for each captured layer one kernel launch on the engine's stream
        reads all of the step's finished requests' Q/K rows from the tap by slot index (enqueued before the
        next step can reuse their blocks, so stream order keeps it exact); streamed layers' rows are one
        gather by slot.  Then one copy to pinned host memory of each request's summary (computed here, see
        :func:`device_summaries`) or, with ``ATTN_OTEL_ROW_METRICS=all``, of the ``[L, 7, H, sum T]`` rows.
        Requests go in chunks of at most FINISH_CHUNK_BYTES of rows.  No host sync."""
        chunks = [batch]
        if self.config.row_metrics != "all":
            # Rows summarised here: the [L, 7, H, sum T] rows are transient; bound them per launch.
            per_token = len(self.layers) * len(METRICS) * max(s.num_heads for s in self.layers) * 4
            chunks, size = [[]], 0
            for item in batch:
                if chunks[-1] and size + item[1]["T"] * per_token > FINISH_CHUNK_BYTES:
                    chunks.append([])
                    size = 0
                chunks[-1].append(item)
                size += item[1]["T"] * per_token
        for chunk in chunks:
            try:
                self._metrics_from_tap_chunk(chunk)
            except Exception as e:  # noqa: BLE001 - capture must never take the engine down
                for _, info in chunk:
                    self.handoff.release(info["nbytes"])
                    self._device_release(info["device"])
                self.stats.add("dropped", len(chunk), reason="capture_error")
                self.warn_once(f"err:{type(e).__name__}", "capture of %d requests failed; dropped and counted "
                               "(logged once per error type)", len(chunk), exc=True)

    def _metrics_from_tap_chunk(self, batch: list[tuple[FinishedRequest, dict[str, Any]]]) -> None:
        t0 = time.perf_counter()
        while self._finish_timing and self._finish_timing[0][1].query():  # completed: never a sync
            a, b = self._finish_timing.pop(0)
            self.finish_device_s += a.elapsed_time(b) / 1000.0
        started = torch.cuda.Event(enable_timing=True)
        started.record()
        layers = self.layers
        H = max(s.num_heads for s in layers)
        Ts = [info["T"] for _, info in batch]
        total = int(sum(Ts))
        cu = np.zeros(len(batch) + 1, dtype=np.int32)
        cu[1:] = np.cumsum(Ts)
        records, vision_any = [], False
        slots_host: dict[int, list[np.ndarray]] = {spec.group: [] for spec in layers}  # per KV-cache group
        vision_host = np.zeros(total, dtype=np.float32)
        tokens_dev: list[tuple[int, torch.Tensor]] = []
        for i, (req, info) in enumerate(batch):
            T = info["T"]
            rec, tok_dev = self._record(req, info["layers"], T, False, info["trace_id"], info["parent"],
                                        info["wanted"], info["sampled"])
            if rec.vision_mask is not None:
                vision_any = True
                vision_host[cu[i]:cu[i + 1]] = rec.vision_mask
            if tok_dev is not None:
                tokens_dev.append((i, tok_dev))
            records.append(rec)
            for group, parts in slots_host.items():
                parts.append(self._slots_np(req, group, T))
        prompt = np.asarray([r.prompt_len for r in records], dtype=np.int32)
        dev = self.device

        def up(a: np.ndarray) -> torch.Tensor:
            return upload(a, dev)

        cu_dev, prompt_dev = up(cu), up(prompt)
        slots_dev = {g: up(np.concatenate(parts)) for g, parts in slots_host.items()}
        vision_dev = up(vision_host) if vision_any else None
        summarise = self.config.row_metrics != "all"
        tapped = [li for li, spec in enumerate(layers) if spec.index not in self.streamed]
        streamed = [li for li, spec in enumerate(layers) if spec.index in self.streamed]
        # Rows of the tapped layers, computed now; with rows summarised here only those layers are in ``out``
        # (the streamed layers' float16 rows are summarised where they are, in float16).
        out_layers = tapped if summarise else list(range(len(layers)))
        out = torch.full((len(out_layers), len(METRICS), H, total), float("nan"), dtype=torch.float32, device=dev)
        for oi, li in enumerate(out_layers):
            spec = layers[li]
            if spec.index in self.streamed:
                continue
            triton_metrics.row_metrics_slots(
                self.tap.q[spec.index], self.tap.k[spec.index], slots_dev[spec.group], cu_dev, prompt_dev,
                max(Ts), spec.scale, self.config.sink_tokens, vision_dev, out=out[oi, :, : spec.num_heads])
        got = None
        if streamed:  # computed while the requests ran: one gather by slot for every streamed layer
            st = self.stream
            got = st.gather(slots_dev[st.group])  # [streamed layers, total, 7, H] float16
            order = [st.pos[layers[li].index] for li in streamed]
            if order != list(range(len(order))):
                got = got.index_select(0, up(np.asarray(order, dtype=np.int64)))
            got = got.permute(0, 2, 3, 1)  # [streamed layers, 7, H, total]
        # Rows stored for no capture here (ATTN_OTEL_ROW_METRICS=maps): summarise on the device, so a few kB
        # per request reach the host and the writers instead of [L, 7, H, T] rows (28 MB at 8B scale).
        summaries = None
        if summarise:
            cu_l, prompt_l = cu.tolist(), prompt.tolist()
            parts = []
            if tapped:
                parts.append((tapped, device_summaries(out, cu_l, prompt_l, vision=vision_any)))
            if got is not None:
                parts.append((streamed, device_summaries(got, cu_l, prompt_l, vision=vision_any)))
            dev_sum = parts[0][1]
            if len(parts) > 1 or parts[0][0] != list(range(len(layers))):
                dev_sum = torch.full(dev_sum.shape[:4] + (len(layers), H), float("nan"), dtype=torch.float32,
                                     device=dev)
                for lis, part in parts:
                    dev_sum[..., : part.shape[-1]].index_copy_(4, up(np.asarray(lis, dtype=np.int64)), part)
            summaries = torch.empty(dev_sum.shape, dtype=torch.float32, pin_memory=True)
            summaries.copy_(dev_sum, non_blocking=True)
            host = None
        else:
            if got is not None:
                idx = up(np.asarray(streamed, dtype=np.int64))
                out[:, :, : got.shape[2]].index_copy_(0, idx, got.float())
            host = torch.empty(out.shape, dtype=torch.float32, pin_memory=True)
            host.copy_(out, non_blocking=True)
        tok_host = {}
        if tokens_dev:  # one copy to the host for the chunk's requests
            flat = torch.cat([t for _, t in tokens_dev])
            host_ids = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host_ids.copy_(flat, non_blocking=True)
            off = 0
            for i, t in tokens_dev:
                tok_host[i] = host_ids[off:off + t.shape[0]]
                off += t.shape[0]
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._finish_timing.append((started, event))
        loop = time.perf_counter() - t0
        for i, ((req, info), rec) in enumerate(zip(batch, records)):
            keep = [li for li, spec in enumerate(layers) if spec in info["layers"]]
            if host is not None:
                per_row = host[:, :, :, cu[i]:cu[i + 1]].permute(1, 0, 2, 3)  # a view: read after ``event``
                job = _Job(rec, per_row, None, event, info["nbytes"], info["t0"], tok_host.get(i),
                           keep=keep if len(keep) < len(layers) else None)
            else:
                job = _Job(rec, None, None, event, info["nbytes"], info["t0"], tok_host.get(i),
                           keep=keep if len(keep) < len(layers) else None, summary=summaries[i])
            self.handoff.put(job)
            if rec.part is None or rec.part.index == 0:  # a parallel capture counts once, on its first part
                self.stats.add("captured")
            self._device_release(info["device"])  # a forward writes these slots only after the kernels (Side)
            self.stats.loop_times.append(loop / len(batch) + (t0 - info["t0"]))

    def _options(self, req: FinishedRequest) -> RequestOptions:
        from .config import parse_request_options

        opts = parse_request_options(req.extra_args)
        for w in opts.warnings:
            self.warn_once("opt:" + w.split("=")[0], "request %s: %s", req.request_id, w)
        return opts

    def _slots(self, req: FinishedRequest, group: int, T: int) -> torch.Tensor:
        t = torch.from_numpy(self._slots_np(req, group, T))
        if self.device.type == "cuda":
            t = t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _slots_np(self, req: FinishedRequest, group: int, T: int) -> np.ndarray:
        return slots_of(req.block_ids[group], int(req.block_sizes[group]), 0, T)

    def _record(self, req, layers, T, want_maps, trace_id, parent, wanted: Sequence[int] = (),
                sampled: bool = True) -> tuple[CaptureRecord, torch.Tensor | None]:
        """The capture's record; under tensor/pipeline parallelism, this rank's part of the capture of
        ``wanted`` (the request's layers on every stage), ``layers`` being those this rank holds."""
        vision_np = None
        if req.vision_positions is not None and np.any(req.vision_positions[:T]):
            vision_np = np.zeros(T, dtype=bool)  # the mask ends with the last image; pad it to T
            n = min(T, len(req.vision_positions))
            vision_np[:n] = np.asarray(req.vision_positions[:n], dtype=bool)
        part, whole_layers, H = None, tuple(s.index for s in layers), max(s.num_heads for s in layers)
        par = self.parallel
        if par is not None:
            whole_layers = tuple(wanted)
            part = par.part(whole_layers, H, [s.index for s in layers])
            H = par.total_heads
        tokens = None
        tokens_dev = None
        # One part writes the token ids: tensor rank 0 of the capture's last stage, which under pipeline
        # parallelism is the stage that samples when the capture reaches the last layer.
        if self.config.store_tokens and (part is None or part.index == part.count - part.tp):
            if req.output_token_ids is not None:
                ids = list(req.prompt_token_ids) + list(req.output_token_ids)
                ids += [-1] * (T - len(ids))  # unknown to this worker (documented in the README)
                tokens = np.asarray(ids[:T], dtype=np.int32)
            elif req.token_ids_device is not None:
                tokens_dev = req.token_ids_device[:T]  # a view of the step's own copy (adapter)
        N = min(len(req.prompt_token_ids), T)
        # Every rank of a parallel engine must name the capture's span alike.
        span_id = derived_span_id(trace_id, req.request_id) if par is not None else new_span_id()
        record = CaptureRecord(
            trace_id=trace_id, request_id=req.request_id, span_id=span_id, parent_span_id=parent,
            prompt_len=N, num_tokens=T, layers=whole_layers, num_heads=H,
            model=self.model, engine_version=self.engine_version, mode="maps" if want_maps else "metrics",
            token_ids=tokens, vision_mask=vision_np,
            attrs={**self.attrs, "vision": vision_np is not None, "sink_tokens": self.config.sink_tokens},
            part=part, sampled=sampled,
        )
        return record, tokens_dev

    def _gather(self, req, layers, T, want_maps, nbytes, gathered, trace_id, parent,
                wanted: Sequence[int] = (), sampled: bool = True) -> "_Pending":
        """Engine loop: copy the request's Q/K out of the tap before its blocks can be reused.  Only
        device copies are enqueued here (on the engine's stream); the math runs on the compute thread."""
        cuda = self.device.type == "cuda"
        slots_by_group: dict[int, torch.Tensor] = {}
        qk = []
        streamed = None
        for spec in layers:
            if spec.group not in slots_by_group:
                slots_by_group[spec.group] = self._slots(req, spec.group, T)
            if spec.index in self.streamed:
                qk.append(None)
                if streamed is None:
                    streamed = self.stream.gather(slots_by_group[spec.group])  # [streamed layers, T, 7, H]
            else:
                qk.append(self.tap.gather(spec.index, slots_by_group[spec.group]))
        record, tokens_dev = self._record(req, layers, T, want_maps, trace_id, parent, wanted, sampled)
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record()
        return _Pending(record, layers, qk, tokens_dev, ready, want_maps, nbytes, gathered, streamed=streamed)

    def _compute_loop(self) -> None:
        _os_thread_name("attn-otel-comp")
        while True:
            try:
                pending = self._compute_q.get(timeout=self._maps_pool.idle_s / 2)
            except queue.Empty:  # nothing to do: give back the maps segments no capture has used lately
                self._maps_pool.trim()
                continue
            job = None
            try:
                job = self._compute(pending)
                job.t_finish = pending.t_finish
                self.handoff.put(job)
                if pending.record.part is None or pending.record.part.index == 0:
                    self.stats.add("captured")
            except Exception as e:  # noqa: BLE001
                if job is not None:
                    self._maps_pool.release(job.maps_seg)
                self.handoff.release(pending.nbytes)
                self.stats.add("dropped", reason="capture_error")
                self.warn_once(f"err:{type(e).__name__}", "capture of request %s failed; dropped and counted "
                               "(logged once per error type)", pending.record.request_id, exc=True)
            finally:
                pending.qk = []
                pending.streamed = None
                self._device_release(pending.gathered)

    def _compute(self, p: "_Pending") -> _Job:
        layers, T = p.layers, p.record.num_tokens
        L, H = len(layers), max(s.num_heads for s in layers)  # this rank's heads (all, on one GPU)
        cuda = self.device.type == "cuda"
        host = dict(pin_memory=True) if cuda else {}
        per_row_host = torch.full((len(METRICS), L, H, T), float("nan"), dtype=torch.float32, **host)
        # Maps land in a reused shared-memory segment through the pinned staging buffer, on this thread
        # (attn_otel.hostmem says why neither a pinned nor a pageable buffer per capture will do).
        maps_host, maps_seg = None, None
        if p.want_maps:
            maps_seg = self._maps_pool.acquire(L * H * T * T * 2)
            maps_host = (maps_seg.tensor((L, H, T, T), torch.float16) if maps_seg is not None
                         else torch.empty((L, H, T, T), dtype=torch.float16))
            for li, spec in enumerate(layers):
                if spec.num_heads < H:
                    maps_host[li, spec.num_heads:].zero_()
        try:
            return self._compute_into(p, per_row_host, maps_host, maps_seg)
        except BaseException:
            self._maps_pool.release(maps_seg)
            raise

    def _compute_into(self, p: "_Pending", per_row_host: torch.Tensor, maps_host: torch.Tensor | None,
                      maps_seg: Any) -> _Job:
        rec, layers, T = p.record, p.layers, p.record.num_tokens
        cuda = self.device.type == "cuda"
        host = dict(pin_memory=True) if cuda else {}
        tokens_host = None
        ctx = torch.cuda.stream(self._stream) if cuda else contextlib.nullcontext()
        with ctx:
            if cuda:
                self._stream.wait_event(p.ready)  # the gathers on the engine's stream are done
                # They were allocated on the engine's stream: keep the allocator from handing their memory
                # back to it before this stream's kernels have read them.
                for t in (*(x for pair in p.qk if pair is not None for x in pair), p.tokens_dev, p.streamed):
                    if t is not None:
                        t.record_stream(self._stream)
            vision = torch.from_numpy(rec.vision_mask).to(self.device) if rec.vision_mask is not None else None
            fused = cuda and not p.want_maps and triton_metrics.available(self.device)
            for li, (spec, qk) in enumerate(zip(layers, p.qk)):
                if qk is None:  # streamed: computed while the request ran
                    got = p.streamed[self.stream.pos[spec.index]]  # [T, 7, H]
                    per_row_host[:, li, : spec.num_heads].copy_(got.permute(1, 2, 0), non_blocking=cuda)
                    continue
                q, k = qk
                if fused:  # one launch per layer instead of a band loop (see docs/benchmarks/overhead.md)
                    res = triton_metrics.row_metrics(q[None], k[None], spec.scale, rec.prompt_len,
                                                     self.config.sink_tokens, vision)
                    per_row_host[:, li, : spec.num_heads].copy_(res[0], non_blocking=True)
                    continue
                maps_dev = None
                if p.want_maps:
                    maps_dev = maps_host[li, : spec.num_heads] if not cuda else torch.empty(
                        (spec.num_heads, T, T), dtype=torch.float16, device=self.device)
                per_row = attention_metrics(q, k, spec.scale, rec.prompt_len, self.config.sink_tokens, vision,
                                            maps_out=maps_dev, rows=self._rows(spec.num_heads, T))
                per_row_host[:, li, : spec.num_heads].copy_(per_row, non_blocking=cuda)
                if p.want_maps and cuda:
                    self._staging.copy(maps_dev, maps_host[li, : spec.num_heads], self._stream)
            if p.tokens_dev is not None:
                tokens_host = torch.empty((T,), dtype=p.tokens_dev.dtype, **host)
                tokens_host.copy_(p.tokens_dev, non_blocking=cuda)
            event = None
            if cuda:
                event = torch.cuda.Event()
                event.record()
        return _Job(rec, per_row_host, maps_host, event, p.nbytes, 0.0, tokens_host, maps_seg=maps_seg)

    def _rows(self, heads: int, T: int) -> int:
        """Query rows per band: on a GPU as many as fit BAND_BYTES (fewer kernel launches); memory stays
        linear in T either way (at least ROWS rows, at most BAND_BYTES or ROWS * heads * T * 4 bytes)."""
        if self.device.type != "cuda":
            return ROWS
        return max(ROWS, min(T, BAND_BYTES // max(1, heads * T * 4)))

    def _device_reserve(self, n: int) -> bool:
        with self._device_lock:
            if self._device_bytes + n > self.config.device_queue_bytes and self._device_bytes > 0:
                return False
            self._device_bytes += n
            self._device_idle.clear()
            return True

    def _device_release(self, n: int) -> None:
        with self._device_lock:
            self._device_bytes -= n
            if self._device_bytes <= 0:
                self._device_idle.set()

    # ----------------------------------------------------------------- writer-thread side
    def _write(self, job: _Job) -> None:
        try:
            if job.event is not None:
                job.event.synchronize()
            if job.keep is not None:
                if job.per_row is not None:
                    job.per_row = job.per_row[:, job.keep]
                if job.summary is not None:
                    job.summary = job.summary[:, :, :, job.keep]
            latency = time.perf_counter() - job.t_finish
            self.stats.latencies.append(latency)
            rec = job.record
            if job.token_ids is not None:
                rec.token_ids = job.token_ids.numpy().astype(np.int32)
            names = [name for name in METRICS
                     if name not in ("vision_share", "vision_share_norm") or rec.attrs.get("vision")]
            if self.config.writer == "process":
                reply = self._write_in_process(rec, job, names, latency)
            else:
                reply = self._write_in_thread(rec, job, names, latency)
            errors = dict(reply.get("errors") or {})
            store_error = errors.pop("zarr", None)
            for name in errors:
                self.stats.add("export_errors", reason=name)
            if store_error is not None:
                raise RuntimeError(store_error)
            if reply.get("complete", True):  # a parallel capture counts once, on the part that completed it
                self.stats.add("stored")
                if reply.get("maps_stored", job.maps is not None):
                    self.stats.add("maps_stored")
            self.stats.add("bytes_written", int(reply.get("bytes", 0)))
            self.stats.write_latencies.append(time.perf_counter() - job.t_finish)
        except Exception as e:  # noqa: BLE001
            self.stats.add("dropped", reason="store_error")
            from .store import redact_url

            self.warn_once(f"store:{type(e).__name__}", "writing capture of request %s to %s failed: %s "
                           "(dropped and counted; logged once per error type)", job.record.request_id,
                           redact_url(self.config.store), e)
        finally:
            self._dump_stats()

    def _write_in_thread(self, rec: CaptureRecord, job: _Job, names: list[str], latency: float) -> dict:
        from .exporters import ExportItem, build_exporters

        summary = None
        if job.per_row is not None:
            per_row = job.per_row.numpy()
            rec.metrics = {name: per_row[METRICS.index(name)] for name in names}
        else:
            rec.metrics, summary = summary_only(job.summary.numpy(), names)
        rec.maps = job.maps.numpy() if job.maps is not None else None
        fanout = getattr(self._local, "fanout", None)
        if fanout is None:
            fanout = self._local.fanout = build_exporters(self.config)
            self._fanouts.append(fanout)
        item = ExportItem(rec, latency_s=latency, _summary=summary)
        errors = fanout.export(item)
        return {"ok": True, "bytes": item.bytes_written, "errors": errors, "complete": item.complete,
                "maps_stored": bool(item.maps_stored)}

    def _write_in_process(self, rec: CaptureRecord, job: _Job, names: list[str], latency: float) -> dict:
        """Hand the capture to the writer process: arrays through one shared-memory segment, the rest as
        one JSON line; block this (writer-feeding) thread, not the engine, until it answers."""
        import json
        from multiprocessing import shared_memory

        arrays: dict[str, tuple[torch.Tensor | np.ndarray, str]] = (
            {"per_row": (job.per_row, "float32")} if job.per_row is not None else {"summary": (job.summary, "float32")})
        if job.maps is not None and job.maps_seg is None:
            arrays["maps"] = (job.maps, "float16")
        if rec.token_ids is not None:
            arrays["token_ids"] = (np.asarray(rec.token_ids, dtype=np.int32), "int32")
        if rec.vision_mask is not None:
            arrays["vision_mask"] = (np.asarray(rec.vision_mask, dtype=bool), "bool")
        layout, offset = {}, 0
        for name, (a, dtype) in arrays.items():
            nbytes = int(np.prod(a.shape)) * np.dtype(dtype).itemsize
            layout[name] = [offset, list(a.shape), dtype]
            offset += (nbytes + 63) // 64 * 64
        shm = shared_memory.SharedMemory(create=True, size=max(offset, 64))
        try:
            for name, (a, dtype) in arrays.items():
                off, shape, _ = layout[name]
                view = np.ndarray(tuple(shape), dtype=np.dtype(dtype), buffer=shm.buf, offset=off)
                if isinstance(a, torch.Tensor):
                    torch.from_numpy(view).copy_(a)  # torch releases the GIL for the copy
                else:
                    view[...] = a
                del view
            meta = {f.name: getattr(rec, f.name) for f in dataclasses.fields(rec)
                    if f.name not in ("token_ids", "maps", "metrics", "vision_mask")}
            meta["layers"] = [int(x) for x in meta["layers"]]
            if rec.part is not None:
                meta["part"] = rec.part.to_json()
            if job.maps_seg is not None:  # read in place, from its own segment
                layout["maps"] = [0, list(job.maps.shape), "float16", job.maps_seg.name]
            msg = {"id": id(job), "shm": shm.name, "record": meta, "arrays": layout,
                   "metrics": {name: METRICS.index(name) for name in names}, "latency_s": latency}
            reply = self._writer_call(json.dumps(msg))
        finally:
            shm.close()
            shm.unlink()
        if not reply.get("ok"):
            raise RuntimeError(f"writer process: {reply.get('error')}")
        return reply

    def _writer_call(self, line: str) -> dict:
        import json
        import select
        import subprocess
        import sys

        from .config import writer_timeout_s

        timeout = writer_timeout_s(self.config)

        for _ in range(2):  # a writer that died is restarted once per capture
            proc = getattr(self._local, "proc", None)
            if proc is None or proc.poll() is not None:
                if proc is not None and self.handoff._closing:
                    raise RuntimeError("the writer process is gone at shutdown")  # killed by close(): no restart
                if proc is not None:
                    self.warn_once("writer-died", "the writer process exited (%s); restarting it", proc.returncode)
                env = dict(os.environ)
                if self.config.stats_dir:
                    env["ATTN_OTEL_STATS_DIR"] = self.config.stats_dir  # an explicit Config wins
                config = json.dumps(dataclasses.asdict(self.config))  # the writer uses this very Config
                proc = self._local.proc = subprocess.Popen(
                    [sys.executable, "-m", "attn_otel.writer_proc", self.config.store, config],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env)
                self._writer_procs.append(proc)
            try:
                proc.stdin.write(line + "\n")
                proc.stdin.flush()
                # A writer that hangs (a stuck store client, a stopped process) must not hold this writer
                # thread for ever: past the deadline it is killed, this capture is counted, the next one
                # gets a fresh writer.
                if not select.select([proc.stdout], [], [], timeout)[0]:
                    proc.kill()
                    self.warn_once("writer-hung", "a writer process did not answer within %.0f s "
                                   "(ATTN_OTEL_WRITER_TIMEOUT_S); killed, a new one takes the next capture", timeout)
                    raise RuntimeError(f"the writer process did not answer within {timeout:.0f} s; killed")
                answer = proc.stdout.readline()
                if answer:
                    return json.loads(answer)
            except (BrokenPipeError, OSError, ValueError):
                pass
            proc.kill()
        raise RuntimeError("the writer process does not answer")

    def _dump_loop(self) -> None:
        _os_thread_name("attn-otel-stats")
        while not self._stop_dumper.wait(1.0):
            self._dump_stats(force=True)

    def _dump_stats(self, force: bool = False) -> None:
        if not self.config.stats_dir:
            return
        now = time.monotonic()
        if not force and now - getattr(self, "_last_dump", 0.0) < 1.0:
            return
        if not self._dump_lock.acquire(blocking=force):
            return  # another thread is writing the same file right now; a forced dump waits for it
        try:
            self._last_dump = now
            self._dump_stats_locked()
        finally:
            self._dump_lock.release()

    def _dump_stats_locked(self) -> None:
        try:
            import json
            import os

            os.makedirs(self.config.stats_dir, exist_ok=True)
            path = os.path.join(self.config.stats_dir, f"attn-otel-stats-{os.getpid()}.json")
            snap = self.stats.snapshot(percentiles=True)
            snap.update(queue_pending_bytes=self.handoff.pending_bytes, device_queue_pending_bytes=self._device_bytes,
                        tap_bytes=self.device_bytes(), tap_slots=self.tap.num_slots, layers=list(self.layer_ids),
                        tap_bytes_per_token=self.bytes_per_token(), finish_device_s=self.finish_device_s,
                        side_stream_waits=self.side.waits, fused_kv_layers=self.fused_kv_layers)
            st = self.stream
            if st is not None:
                snap.update(streamed_layers=sorted(self.streamed), stream_rows=st.rows, stream_flushes=st.flushes,
                            stream_flushed_rows=st.flushed_rows, stream_pending_rows=st.pending(),
                            stream_host_s=st.host_s, stream_device_s=st.device_s)
            with open(path + ".tmp", "w") as f:
                json.dump(snap, f)
            os.replace(path + ".tmp", path)
        except Exception as e:  # noqa: BLE001
            self.warn_once("stats", "could not write stats to %s: %s", self.config.stats_dir, e)

    def flush(self, timeout: float | None = 60.0) -> bool:
        """Wait until every handed-off capture is written (or dropped).  For tests and shutdown."""
        deadline = None if timeout is None else time.monotonic() + timeout
        done = self._device_idle.wait(timeout)
        done = done and self.handoff.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._dump_stats(force=True)
        return done

    def close(self) -> None:
        """Drain what is pending, then let the exporters flush and stop: all of it within EXIT_DRAIN_S, one
        deadline for every step (a writer stuck on a store that does not answer is killed at it)."""
        deadline = self.handoff.begin_closing(EXIT_DRAIN_S)
        self.flush(max(0.0, deadline - time.monotonic()))
        self._stop_dumper.set()
        fanouts, self._fanouts = self._fanouts, []
        for fanout in fanouts:
            fanout.shutdown()
        procs, self._writer_procs = self._writer_procs, []
        import subprocess

        for proc in procs:
            if proc.poll() is None:
                try:
                    proc.stdin.close()  # EOF: the writer shuts its exporters down (spans are flushed), exits
                except OSError:
                    pass
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        self._maps_pool.close()  # after the writers: none reads a segment any more
