"""The capture engine: the stages of a capture, put together.  vLLM-free: :mod:`attn_otel.vllm_adapter`
feeds it tensors and request views, so it is tested without an engine as well as through one.

Data goes one way::

    device capture        stream.MetricsStream (streamed layers), tap.MapTap (their queries, for the requests
                          planned for maps), tap.QKTap (windowed layers of all-window models, and windowed
                          layers where the KV budget favours the tap: vllm_adapter._plan), in-graph
    -> finish             plan.Planner decides each finished request's capture, then either
                          finish.BatchedMetrics (GPU, metrics only: a few launches on the engine loop) or
                          compute.ComputeThread (maps, and the CPU: a thread of its own)
    -> hand-off           handoff.Handoff: bounded in bytes, drop and count, never wait
    -> writers            writers.WriterPool: writer processes run the exporters (store, spans, Prometheus)

This module owns their lifetimes (start, warm-up, flush, close) and the stats file; nothing downstream
calls back into it.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, Sequence

import torch

from . import timing, triton_metrics
from .attention import metric_width
from .compute import ComputeThread
from .config import Config
from .finish import BatchedMetrics
from .handoff import ByteBudget, Handoff, at_exit
from .hold import counts as hold_counts
from .hostmem import SegmentPool
from .plan import Planner
from .slots import ring_waits
from .stats import Stats, WarnOnce, gc_pauses, quantiles, write_stats_file
from .stream import MetricsStream, Side
from .tap import LayerSpec, MapTap, QKTap, capture_bytes_per_token
from .tracking import FinishedRequest, Parallel
from .writer_proc import os_thread_name
from .writers import WriterPool

logger = logging.getLogger("attn_otel")


def cuda_alloc_stats(device: torch.device) -> dict[str, int]:
    """The caching allocator's counters for ``device`` (all of the process's allocations, vLLM's included):
    cudaMalloc and cudaFree calls, retries after a failed cudaMalloc (a device sync and the cache freed), and
    the bytes reserved now and at the peak."""
    m = torch.cuda.memory_stats(device)
    return {"device_allocs": int(m.get("num_device_alloc", 0)), "device_frees": int(m.get("num_device_free", 0)),
            "alloc_retries": int(m.get("num_alloc_retries", 0)),
            "sync_all_streams": int(m.get("num_sync_all_streams", 0)),
            "reserved_bytes": int(m.get("reserved_bytes.all.current", 0)),
            "reserved_peak_bytes": int(m.get("reserved_bytes.all.peak", 0))}


class CaptureEngine:
    """Owns the tap, turns finished requests into captures, and hands them to the writers."""

    def __init__(self, config: Config, layers: Sequence[LayerSpec], num_slots: int, dtype: torch.dtype,
                 device, model: str = "", engine_version: str = "", attrs: dict[str, Any] | None = None,
                 parallel: Parallel | None = None, stream: MetricsStream | None = None,
                 map_layers: Sequence[int] | None = None, map_tap_rows: int = 0,
                 block_sizes: Sequence[int] = ()):
        self.config = config
        self.block_sizes = list(block_sizes)  # per KV-cache group (the adapter's, from vLLM's cache config)
        self.layers = list(layers)
        self.layer_ids = tuple(s.index for s in self.layers)
        self.device = torch.device(device)
        self.parallel = parallel  # this rank's place under tensor/pipeline parallelism (None: one GPU)
        self.attrs = dict(attrs or {})  # attributes every capture carries (e.g. the attention backend)
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
        # The streamed map layers keep queries only for the requests planned for maps (attn_otel.arrival).
        mapped = [s for s in stream.layers if s.index in self.map_layers] if stream is not None else []
        # ATTN_OTEL_VERIFY: the tapped map layers of the same slots keep their output rows there too
        group = stream.group if stream is not None else tapped[0].group if tapped else 0
        block_size = stream.block_size if stream is not None else self.block_sizes[group] if self.block_sizes else 0
        checked = [s for s in tapped if s.index in self.map_layers and s.group == group] if (
            config.verify and block_size) else []
        self.maptap = (MapTap(mapped, num_slots, map_tap_rows or config.max_map_tokens, dtype, device,
                              block_size, group, self.side, checked) if mapped or checked else None)
        self.fused_kv_layers = 0  # layers whose K/V write to vLLM's cache shares the Q write's launch (adapter)
        # Metrics-only captures on a GPU are computed on the engine's stream straight from the tap.
        self._fused = triton_metrics.available(self.device, [s.head_dim for s in layers])
        self.stats = Stats()
        self.gc = gc_pauses()  # the collector's pauses in this process (stats: gc_pauses)
        # the engine loop's current step (vllm_adapter._step_interval): its start, attn-otel's host time in it so
        # far, and whether it ran tokens
        self.step_start: float | None = None
        self.step_own = 0.0
        self.step_ran = False
        self.warn_once = WarnOnce()
        self.maps_pool = SegmentPool(config.queue_bytes)
        self.writers = WriterPool(config, self.stats, self.warn_once)
        self.handoff = Handoff(config, self.stats, self.writers, self.maps_pool,
                               1 if parallel is None else parallel.tp * parallel.pp)
        self.device_budget = ByteBudget(config.device_queue_bytes, first_always=True)
        self.planner = Planner(config, self.layers, self.map_layers, self.handoff, self.stats, self.warn_once,
                               stream, parallel, summarised_on_device=self._fused, model=model,
                               engine_version=engine_version, attrs=self.attrs, maptap=self.maptap)
        self.batched = BatchedMetrics(config, self.layers, self.tap, stream, self.planner, self.handoff,
                                      self.device_budget, self.stats, self.warn_once, self.device)
        self.compute = ComputeThread(config, self.tap, stream, self.planner, self.handoff, self.device_budget,
                                     self.maps_pool, self.stats, self.warn_once, self.device, self.maptap)
        at_exit(self.close)  # registered after the hand-off's drain, so it runs before it
        # The compute and writer-feeding threads share the engine loop's GIL: hand it back within this long.
        if config.gil_switch_ms > 0 and config.gil_switch_ms / 1000 < sys.getswitchinterval():
            sys.setswitchinterval(config.gil_switch_ms / 1000)
        # Their waits for device work sleep in the driver instead of polling its lock (ATTN_OTEL_EVENT_WAIT).
        timing.SLEEP[0] = config.event_wait == "sleep"
        # Counters change on the engine loop, the compute thread and the writers: a timer keeps the stats
        # file at most a second behind.
        self._stop_dumper = threading.Event()
        self._dump_lock = threading.Lock()
        if config.stats_dir:
            threading.Thread(target=self._dump_loop, name="attn-otel-stats", daemon=True).start()

    @property
    def finish_device_s(self) -> float:
        """Device time of the batched finish-time work (metrics-only captures), as far as completed."""
        return self.batched.timer.seconds

    def warm_up(self) -> None:
        """Compile the Triton kernels the finish path and the stream's flushes launch, for the shapes a text
        model's requests use, at engine start (each would otherwise compile mid-serving, a stall of seconds
        on the first request of its shape; Triton's on-disk cache makes later starts quick).  The maps
        path's pinned staging buffer is allocated here too.  Never raises."""
        if self.compute.staging is not None and self.map_layers:
            try:
                self.compute.staging.allocate()
            except Exception:  # noqa: BLE001 - allocated on the first maps capture instead
                logger.warning("attn-otel: pinning the maps staging buffer at start failed", exc_info=True)
        if not self._fused:
            return
        t0 = time.perf_counter()
        try:
            # rows of 8 metrics where a layer has learned sinks (learned_sink_mass), else 7
            launches = triton_metrics.warm_up_summaries(self.device, tuple(sorted({7, metric_width(self.layers)})))
            if self.stream is not None:
                launches += self.stream.warm_up()
            # one kernel variant per set of attention terms (window or chunk, soft-cap, sinks) of tapped layers
            variants: dict = {}
            for s in self.layers:
                if s.index not in self.streamed:
                    t = triton_metrics.terms([s], self.device)
                    variants.setdefault(None if t is None else t.switches, (s, t))
            for spec, terms in variants.values():
                slots = torch.zeros(1, dtype=torch.int64, device=self.device)
                cu = torch.tensor([0, 1], dtype=torch.int32, device=self.device)
                prompt = torch.ones(1, dtype=torch.int32, device=self.device)  # its own (aligned) allocation
                triton_metrics.row_metrics_slots(self.tap.q[spec.index], self.tap.k[spec.index], slots, cu, prompt,
                                                 1, spec.scale, self.config.sink_tokens, terms=terms)
                launches += 1
            torch.cuda.synchronize(self.device)
            logger.info("attn-otel: %d metric kernel variants ready in %.1f s", launches, time.perf_counter() - t0)
        except Exception:  # noqa: BLE001 - a kernel that fails here compiles (or fails) when first used
            logger.warning("attn-otel: compiling the metric kernels at start failed; they compile when first "
                           "used", exc_info=True)

    def device_bytes(self) -> int:
        """Device memory this engine holds: the Q/K tap and the stream's ring, table and metrics buffer."""
        return (self.tap.nbytes() + (self.stream.nbytes() if self.stream is not None else 0)
                + (self.maptap.nbytes() if self.maptap is not None else 0))

    def bytes_per_token(self) -> int:
        """Device bytes per KV-cache token (the stream's fixed-size ring not included)."""
        st = self.stream
        return capture_bytes_per_token(list(self.tap.layers.values()), st.layers if st else [],
                                       st is not None and not st.k_tap, self.tap.dtype,
                                       st is None or "vision_share" in st.slot_rows)

    # ----------------------------------------------------------------- engine-loop side (no I/O here)
    def on_finished(self, req: FinishedRequest) -> None:
        self.on_finished_many([req])

    def on_finished_many(self, reqs: Sequence[FinishedRequest]) -> None:
        """Capture the requests that finished this step.  Never raises: a failure is logged once and
        counted.  On a GPU, metrics-only captures are batched: one fused kernel launch per layer reads
        every such request's rows straight out of the tap (:class:`attn_otel.finish.BatchedMetrics`)."""
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
            self._capture_all(reqs)
        try:  # their blocks go back to vLLM now: a forward that writes one waits for this work (Side.guard)
            seq = side.mark()
            for req in reqs:
                side.taken_back(req.block_ids, seq, req.num_tokens if req.block_sizes else None,
                                req.block_sizes)
        except Exception:  # noqa: BLE001
            self.warn_once("side-blocks", "could not record which blocks the capture stream reads", exc=True)

    def _capture_all(self, reqs: Sequence[FinishedRequest]) -> None:
        batch = []
        for req in reqs:
            try:
                plan = self.planner.plan(req)
                if plan is None:
                    continue
                # batched with the step's others (the Triton kernels have every attention term: windows,
                # soft-caps, sinks, chunks); maps go to the compute thread
                if not plan.want_maps and self._fused:
                    if self.batched.admit(plan):
                        batch.append(plan)
                    continue
                self.compute.submit(plan)
                self.stats.loop_times.append(time.perf_counter() - plan.t0)
            except Exception as e:  # noqa: BLE001 - capture must never take the request or engine down
                self.stats.add("dropped", reason="capture_error")
                self.warn_once(f"err:{type(e).__name__}", "capture of request %s failed; dropped and counted "
                               "(logged once per error type)", req.request_id, exc=True)
        if batch:
            self.batched.run(batch)

    # ----------------------------------------------------------------- stats, flush, close
    def stats_snapshot(self) -> dict[str, Any]:
        """The counters with the engine's gauges: what the stats file holds."""
        snap = self.stats.snapshot(percentiles=True)
        snap.update(queue_pending_bytes=self.handoff.pending_bytes,
                    device_queue_pending_bytes=self.device_budget.pending_bytes,
                    tap_bytes=self.device_bytes(), tap_slots=self.tap.num_slots, layers=list(self.layer_ids),
                    tap_bytes_per_token=self.bytes_per_token(), finish_device_s=self.finish_device_s,
                    side_stream_waits=self.side.waits, side_stream_wait_causes=dict(self.side.wait_causes),
                    upload_ring_waits=ring_waits(), fused_kv_layers=self.fused_kv_layers)
        snap["gc_pauses"] = self.gc.snapshot()
        if self.device.type == "cuda":  # the caching allocator's trips to the driver: each cudaFree syncs the device
            snap["cuda_alloc"] = cuda_alloc_stats(self.device)
        held = hold_counts()
        if held is not None:  # vLLM's scheduler of this process holds finished requests' blocks (attn_otel.hold)
            snap["block_hold"] = held
        steady = getattr(self, "steady", None)  # (set by the adapter; the step counter's members, attn_otel.steady)
        if steady is not None:
            snap.update(steady_joins=steady.joins, steady_kept=steady.kept)
        st = self.stream
        if st is not None:
            snap.update(streamed_layers=sorted(self.streamed), stream_rows=st.rows, stream_flushes=st.flushes,
                        stream_flushed_rows=st.flushed_rows, stream_pending_rows=st.pending(),
                        stream_host_s=st.host_s, stream_device_s=st.device_s,
                        stream_flush_times=quantiles(st.flush_times),
                        stream_spilled_blocks=st.spill.spilled if st.spill is not None else None,
                        stream_ring_drifts=st.counter.drifts, stream_direct_rows=st.direct.computed,
                        stream_direct_steps=st.direct.steps, stream_direct_side_steps=st.direct.side_steps,
                        stream_direct_replayed=st.direct.replayed, stream_direct_device_s=st.direct.device_s)
        return snap

    def _dump_loop(self) -> None:
        os_thread_name("attn-otel-stats")
        while not self._stop_dumper.wait(1.0):
            self._dump_stats()

    def _dump_stats(self) -> None:
        if not self.config.stats_dir:
            return
        with self._dump_lock:
            try:
                write_stats_file(self.config.stats_dir, self.stats_snapshot())
            except Exception as e:  # noqa: BLE001
                self.warn_once("stats", "could not write stats to %s: %s", self.config.stats_dir, e)

    def flush(self, timeout: float | None = 60.0) -> bool:
        """Wait until every handed-off capture is written (or dropped).  For tests and shutdown."""
        deadline = None if timeout is None else time.monotonic() + timeout
        done = self.device_budget.wait_idle(timeout)
        done = done and self.handoff.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._dump_stats()
        return done

    def close(self) -> None:
        """Drain what is pending, then let the exporters flush and stop: all of it within EXIT_DRAIN_S, one
        deadline for every step (a writer stuck on a store that does not answer is killed at it)."""
        deadline = self.handoff.begin_closing()
        self.flush(max(0.0, deadline - time.monotonic()))
        self._stop_dumper.set()
        self.writers.close(deadline)
        self.maps_pool.close()  # after the writers: none reads a segment any more
