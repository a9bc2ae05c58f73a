"""Finish-time compute off the engine loop: maps captures (and every capture on a CPU).

On the engine loop, :meth:`ComputeThread.submit` only enqueues device copies of the request's Q/K out of
the tap (before its blocks can be reused) and the gather of its streamed layers' rows; the compute thread
then runs softmax(QK^T * scale) in float32 band by band on a stream of its own, the per-row metrics and the
maps, which reach the host through the pinned staging buffer into a reused shared-memory segment
(:mod:`attn_otel.hostmem` says why).
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
from typing import Any

import numpy as np
import torch

from . import triton_metrics
from .attention import METRICS, ROWS, attention_metrics, metric_width, reconstruction_error
from .config import Config
from .handoff import ByteBudget, Handoff, Job
from .hostmem import SegmentPool, Staging
from .plan import MAP_ITEM, Plan, Planner
from .slots import slots_of, upload
from .stats import Stats, WarnOnce
from .store import CaptureRecord
from .stream import MetricsStream, keys_at
from .stream import gather as stream_gather
from .tap import LayerSpec, MapTap, QKTap
from .timing import wait_event
from .writer_proc import os_thread_name

BAND_BYTES = 64 << 20  # float32 logits of one band of query rows, all heads (GPU)


@dataclasses.dataclass
class Pending:
    """A finished request's gathered Q/K, waiting for the compute thread."""

    record: CaptureRecord
    layers: list[LayerSpec]
    qk: list[tuple[torch.Tensor, torch.Tensor] | None]
    tokens_dev: torch.Tensor | None
    ready: Any  # torch.cuda.Event on the engine's stream after the gathers, or None
    want_maps: bool
    nbytes: int  # host bytes reserved in the hand-off
    gathered: int  # device bytes held by qk
    t_finish: float = 0.0
    streamed: torch.Tensor | None = None  # [streamed layers, T, 7 or 8, H] float16 (MetricsStream.gather)
    checks: list | None = None  # per layer (values, v_scale, outputs) or None: ATTN_OTEL_VERIFY


class ComputeThread:
    """Gathers on the engine loop, computes on a thread of its own, hands the jobs off."""

    def __init__(self, config: Config, tap: QKTap, stream: MetricsStream | None, planner: Planner,
                 handoff: Handoff, device_budget: ByteBudget, maps_pool: SegmentPool, stats: Stats,
                 warn: WarnOnce, device: torch.device, maptap: MapTap | None = None):
        self.config = config
        self.tap = tap
        self.maptap = maptap
        self.stream = stream
        self.streamed = frozenset(stream.pos) if stream is not None else frozenset()
        self.planner = planner
        self.handoff = handoff
        self.device_budget = device_budget
        self.maps_pool = maps_pool
        self.stats = stats
        self.warn = warn
        self.device = device
        cuda = device.type == "cuda"
        # Maps reach the host through a small pinned buffer into reused shared memory (attn_otel.hostmem).
        self.staging = Staging() if cuda else None
        self._stream = torch.cuda.Stream(device) if cuda else None
        self._q: queue.Queue[Pending] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="attn-otel-compute", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- engine loop (no I/O, no sync)
    def submit(self, plan: Plan) -> None:
        """Enqueue the copies of ``plan``'s rows on the engine's stream and the capture for the thread;
        drops and counts it (``device_queue_full``) when the device budget is spent."""
        gathered = sum(plan.T * (s.num_heads + s.num_kv_heads) * s.head_dim * self.tap.itemsize
                       if s.index not in self.streamed or self._mapped(plan, s)
                       else plan.T * len(METRICS) * s.num_heads * 2 for s in plan.layers)
        if not self.device_budget.reserve(gathered):
            self.handoff.release(plan.nbytes)
            self.stats.add("dropped", reason="device_queue_full")
            self.warn("device_full", "finish-time work waiting on the device exceeds %d bytes "
                      "(ATTN_OTEL_DEVICE_QUEUE_BYTES); dropping captures and counting them",
                      self.config.device_queue_bytes)
            return
        try:
            pending = self._gather(plan, gathered)
        except BaseException:
            self.handoff.release(plan.nbytes)
            self.device_budget.release(gathered)
            raise
        pending.t_finish = plan.t0
        self._q.put_nowait(pending)

    def _mapped(self, plan: Plan, spec: LayerSpec) -> bool:
        """A maps capture's streamed layer whose queries the map tap kept."""
        return plan.want_maps and self.maptap is not None and spec.index in self.maptap.layers

    def _slots(self, plan: Plan, group: int) -> torch.Tensor:
        a = slots_of(plan.req.block_ids[group], int(plan.req.block_sizes[group]), 0, plan.T)
        return upload(a, self.device)

    def _gather(self, plan: Plan, gathered: int) -> Pending:
        """Copy the request's Q/K out of the tap before its blocks can be reused.  Only device copies are
        enqueued here (on the engine's stream); the math runs on the compute thread."""
        slots_by_group: dict[int, torch.Tensor] = {}
        qk: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        streamed = None
        map_rows = None
        checks: list = []
        for spec in plan.layers:
            if spec.group not in slots_by_group:
                slots_by_group[spec.group] = self._slots(plan, spec.group)
            if self._mapped(plan, spec):  # queries from the map tap, keys where the stream reads them
                if map_rows is None:
                    map_rows = self.maptap.rows_of(plan.req.request_id, plan.T)
                qk.append((self.maptap.gather(spec.index, map_rows),
                           keys_at(self.stream.keys[spec.index], slots_by_group[spec.group], self.tap.dtype)))
                checks.append(self.maptap.gather_check(spec.index, map_rows, slots_by_group[spec.group]))
            elif spec.index in self.streamed:
                checks.append(None)
                qk.append(None)
                if streamed is None:
                    positions = torch.arange(plan.T, device=self.device)
                    streamed = stream_gather(self.stream, slots_by_group[spec.group], positions)  # [layers, T, 7 or 8, H]
            else:
                check = None
                if plan.want_maps and self.maptap is not None and spec.index in self.maptap.checked:
                    if map_rows is None:
                        map_rows = self.maptap.rows_of(plan.req.request_id, plan.T)
                    check = self.maptap.gather_check(spec.index, map_rows, slots_by_group[spec.group])
                checks.append(check)
                qk.append(self.tap.gather(spec.index, slots_by_group[spec.group]))
        record, tokens_dev = self.planner.record(plan)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return Pending(record, plan.layers, qk, tokens_dev, ready, plan.want_maps, plan.nbytes, gathered,
                       streamed=streamed, checks=checks if any(c is not None for c in checks) else None)

    def idle(self) -> bool:
        return self._q.empty()

    # ----------------------------------------------------------------- the compute thread
    def _loop(self) -> None:
        os_thread_name("attn-otel-comp")
        while True:
            try:
                pending = self._q.get(timeout=self.maps_pool.idle_s / 2)
            except queue.Empty:  # nothing to do: give back the maps segments no capture has used lately
                self.maps_pool.trim()
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
                    self.maps_pool.release(job.maps_seg)
                self.handoff.release(pending.nbytes)
                self.stats.add("dropped", reason="capture_error")
                self.warn(f"err:{type(e).__name__}", "capture of request %s failed; dropped and counted "
                          "(logged once per error type)", pending.record.request_id, exc=True)
            finally:
                pending.qk = []
                pending.streamed = None
                pending.checks = None
                self.device_budget.release(pending.gathered)

    def _compute(self, p: Pending) -> Job:
        rec, layers, T = p.record, p.layers, p.record.num_tokens
        L, H = len(layers), max(s.num_heads for s in layers)  # this rank's heads (all, on one GPU)
        cuda = self.device.type == "cuda"
        host = dict(pin_memory=True) if cuda else {}
        # the learned sink mass is a row of its own only where some layer has learned sinks (NaN elsewhere)
        width = metric_width(layers)
        per_row_host = torch.full((width, L, H, T), float("nan"), dtype=torch.float32, **host)
        # Maps land in a reused shared-memory segment through the pinned staging buffer, on this thread
        # (attn_otel.hostmem says why neither a pinned nor a pageable buffer per capture will do).
        maps_host, maps_seg = None, None
        if p.want_maps:
            maps_seg = self.maps_pool.acquire(MAP_ITEM * L * H * T * T)  # float16, as the planner reserved
            maps_host = (maps_seg.tensor((L, H, T, T), torch.float16) if maps_seg is not None
                         else torch.empty((L, H, T, T), dtype=torch.float16))
            for li, spec in enumerate(layers):
                if spec.num_heads < H:
                    maps_host[li, spec.num_heads:].zero_()
        try:
            tokens_host, event = self._compute_into(p, per_row_host, maps_host)
        except BaseException:
            self.maps_pool.release(maps_seg)
            raise
        return Job(rec, per_row_host, maps_host, event, p.nbytes, 0.0, tokens_host, maps_seg=maps_seg)

    def _compute_into(self, p: Pending, per_row_host: torch.Tensor,
                      maps_host: torch.Tensor | None) -> tuple[torch.Tensor | None, Any]:
        """Per-row metrics (and maps) of ``p`` into the host buffers; returns the token ids' host copy and
        the event after which all of it is there (None on a CPU)."""
        rec, layers, T = p.record, p.layers, p.record.num_tokens
        cuda = self.device.type == "cuda"
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
                for c in p.checks or ():
                    if c is not None:
                        c[0].record_stream(self._stream)
                        c[2].record_stream(self._stream)
            vision = torch.from_numpy(rec.vision_mask).to(self.device) if rec.vision_mask is not None else None
            fused = cuda and not p.want_maps and triton_metrics.available(self.device, [s.head_dim for s in layers])
            errors: list[torch.Tensor] = []
            for li, (spec, qk) in enumerate(zip(layers, p.qk)):
                if qk is None:  # streamed: computed while the request ran
                    got = p.streamed[self.stream.pos[spec.index]]  # [T, 7 or 8, H]: see metric_width
                    per_row_host[: got.shape[1], li, : spec.num_heads].copy_(got.permute(1, 2, 0),
                                                                            non_blocking=cuda)
                    continue
                q, k = qk
                if fused:  # one launch per layer instead of a band loop (docs/benchmarks/history.md, run 5)
                    res = triton_metrics.row_metrics(q[None], k[None], spec.scale, rec.prompt_len,
                                                     self.config.sink_tokens, vision,
                                                     terms=triton_metrics.terms([spec], self.device))
                    per_row_host[: res.shape[1], li, : spec.num_heads].copy_(res[0], non_blocking=True)
                    continue
                maps_dev = None
                if p.want_maps:
                    maps_dev = maps_host[li, : spec.num_heads] if not cuda else torch.empty(
                        (spec.num_heads, T, T), dtype=torch.float16, device=self.device)
                check = p.checks[li] if p.checks is not None else None
                on_band = None
                if check is not None:  # ATTN_OTEL_VERIFY: maps x V of each band, in float32, against the output
                    values, v_scale, out, *v_up = check

                    def on_band(r0, r1, band, values=values, v_scale=v_scale, out=out, v_up=v_up):
                        errors.append(reconstruction_error(band, values, v_scale, out[r0:r1], *v_up))
                per_row = attention_metrics(q, k, spec.scale, rec.prompt_len, self.config.sink_tokens, vision,
                                            maps_out=maps_dev, rows=self._rows(spec.num_heads, T),
                                            on_band=on_band, **spec.terms(self.device))
                per_row_host[:, li, : spec.num_heads].copy_(per_row[: per_row_host.shape[0]], non_blocking=cuda)
                if p.want_maps and cuda:
                    self.staging.copy(maps_dev, maps_host[li, : spec.num_heads], self._stream)
            if errors:  # a sync of this thread's stream only (ATTN_OTEL_VERIFY is a check, not the hot path)
                err = torch.cat(errors).float().cpu().numpy()
                rec.attrs["reconstruction"] = {"median": float(np.median(err)), "p99": float(np.quantile(err, 0.99)),
                                               "max": float(err.max()), "rows": int(err.size)}
            if p.tokens_dev is not None:
                host = dict(pin_memory=True) if cuda else {}
                tokens_host = torch.empty((T,), dtype=p.tokens_dev.dtype, **host)
                tokens_host.copy_(p.tokens_dev, non_blocking=cuda)
            event = None
            if cuda:
                event = wait_event()  # the writer thread waits on it
                event.record()
        return tokens_host, event

    def _rows(self, heads: int, T: int) -> int:
        """Query rows per band: on a GPU as many as fit BAND_BYTES (fewer kernel launches); memory stays
        linear in T either way (at least ROWS rows, at most BAND_BYTES or ROWS * heads * T * 4 bytes)."""
        if self.device.type != "cuda":
            return ROWS
        return max(ROWS, min(T, BAND_BYTES // max(1, heads * T * 4)))
