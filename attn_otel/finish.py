"""Finish-time compute on the GPU for metrics-only captures, batched on the engine loop.

For each captured layer one kernel launch reads all of the step's finished requests' Q/K rows straight from
the tap by slot index (enqueued before the next step can reuse their blocks, so stream order keeps it
exact); streamed layers' rows are one gather by slot.  Per-row metrics are summarised where they are
(:func:`device_summaries`), so a few kB per request reach the host and the writers.  No host sync.
Maps captures, and every capture on a CPU, go through :mod:`attn_otel.compute` instead.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import torch

from . import triton_metrics
from .attention import metric_width
from .config import Config
from .handoff import ByteBudget, Handoff, Job
from .plan import Plan, Planner
from .slots import slots_of, upload, upload_many
from .stats import Stats, WarnOnce
from .stream import MetricsStream
from .stream import gather as stream_gather
from .tap import LayerSpec, QKTap
from .timing import DeviceTimer

FINISH_CHUNK_BYTES = 512 << 20  # per-row metrics of a step's finished requests on the device, per launch

SUMMARY_CHUNK_BYTES = 256 << 20


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
        names = [n for n in SUMMARY_METRICS[:M] if (vision or n not in VISION)
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


class BatchedMetrics:
    """Engine loop, GPU, metrics only: the step's finished requests' metrics in a few launches."""

    def __init__(self, config: Config, layers: Sequence[LayerSpec], tap: QKTap, stream: MetricsStream | None,
                 planner: Planner, handoff: Handoff, device_budget: ByteBudget, stats: Stats, warn: WarnOnce,
                 device: torch.device):
        self.config = config
        self.layers = list(layers)
        # metric rows per layer: the learned sink mass is a row of its own where some layer has learned sinks
        self.width = metric_width(self.layers)
        self.tap = tap
        self.stream = stream
        self.streamed = frozenset(stream.pos) if stream is not None else frozenset()
        self.planner = planner
        self.handoff = handoff
        self.device_budget = device_budget
        self.stats = stats
        self.warn = warn
        self.device = device
        self.timer = DeviceTimer()  # device time of the batched finish-time work

    def admit(self, plan: Plan) -> bool:
        """Reserve the device bytes of ``plan``'s rows (or summary); False: dropped and counted."""
        L = len(plan.layers)
        H = max(s.num_heads for s in plan.layers)
        plan.device = plan.nbytes if plan.summarised else self.width * L * H * plan.T * 4
        if not self.device_budget.reserve(plan.device):
            self.handoff.release(plan.nbytes)
            self.stats.add("dropped", reason="device_queue_full")
            return False
        return True

    def run(self, batch: list[Plan]) -> None:
        """Compute and hand off the admitted ``batch``; requests go in chunks of at most FINISH_CHUNK_BYTES
        of rows.  With ``ATTN_OTEL_ROW_METRICS=all`` the ``[L, 7, H, sum T]`` rows go to pinned host memory
        instead of their summaries.  Never raises: a failed chunk is dropped and counted."""
        chunks = [batch]
        if self.config.row_metrics != "all":
            # Rows summarised here: the [L, 7, H, sum T] rows are transient; bound them per launch.
            per_token = len(self.layers) * self.width * max(s.num_heads for s in self.layers) * 4
            chunks, size = [[]], 0
            for plan in batch:
                if chunks[-1] and size + plan.T * per_token > FINISH_CHUNK_BYTES:
                    chunks.append([])
                    size = 0
                chunks[-1].append(plan)
                size += plan.T * per_token
        for chunk in chunks:
            try:
                self._chunk(chunk)
            except Exception as e:  # noqa: BLE001 - capture must never take the engine down
                for plan in chunk:
                    self.handoff.release(plan.nbytes)
                    self.device_budget.release(plan.device)
                self.stats.add("dropped", len(chunk), reason="capture_error")
                self.warn(f"err:{type(e).__name__}", "capture of %d requests failed; dropped and counted "
                          "(logged once per error type)", len(chunk), exc=True)

    def _chunk(self, batch: list[Plan]) -> None:
        t0 = time.perf_counter()
        started = self.timer.start(self.device)
        layers = self.layers
        H = max(s.num_heads for s in layers)
        Ts = [plan.T for plan in batch]
        total = int(sum(Ts))
        cu = np.zeros(len(batch) + 1, dtype=np.int32)
        cu[1:] = np.cumsum(Ts)
        records, vision_any = [], False
        slots_host: dict[int, list[np.ndarray]] = {spec.group: [] for spec in layers}  # per KV-cache group
        vision_host = np.zeros(total, dtype=np.float32)
        tokens_dev: list[tuple[int, torch.Tensor]] = []
        for i, plan in enumerate(batch):
            T = plan.T
            rec, tok_dev = self.planner.record(plan)
            if rec.vision_mask is not None:
                vision_any = True
                vision_host[cu[i]:cu[i + 1]] = rec.vision_mask
            if tok_dev is not None:
                tokens_dev.append((i, tok_dev))
            records.append(rec)
            for group, parts in slots_host.items():
                parts.append(slots_of(plan.req.block_ids[group], int(plan.req.block_sizes[group]), 0, T))
        prompt = np.asarray([r.prompt_len for r in records], dtype=np.int32)
        dev = self.device

        def up(a: np.ndarray) -> torch.Tensor:
            return upload(a, dev)

        groups = list(slots_host)
        tapped = [li for li, spec in enumerate(layers) if spec.index not in self.streamed]
        streamed = [li for li, spec in enumerate(layers) if spec.index in self.streamed]
        host = [cu, prompt, *(np.concatenate(slots_host[g]) for g in groups)] + ([vision_host] if vision_any else [])
        if streamed:  # each row's position in its request: the stream's gather derives entropy_norm from it
            host.append(np.arange(total, dtype=np.int64) - np.repeat(cu[:-1].astype(np.int64), Ts))
        cu_dev, prompt_dev, *rest = upload_many(host, dev)  # one copy
        slots_dev = dict(zip(groups, rest[:len(groups)]))
        vision_dev = rest[len(groups)] if vision_any else None
        positions_dev = rest[-1] if streamed else None
        summarise = self.config.row_metrics != "all"
        # Rows of the tapped layers, computed now; with rows summarised here only those layers are in ``out``
        # (the streamed layers' float16 rows are summarised where they are, in float16).
        out_layers = tapped if summarise else list(range(len(layers)))
        out = torch.full((len(out_layers), self.width, H, total), float("nan"), dtype=torch.float32, device=dev)
        for oi, li in enumerate(out_layers):
            spec = layers[li]
            if spec.index in self.streamed:
                continue
            triton_metrics.row_metrics_slots(
                self.tap.q[spec.index], self.tap.k[spec.index], slots_dev[spec.group], cu_dev, prompt_dev,
                max(Ts), spec.scale, self.config.sink_tokens, vision_dev, out=out[oi, :, : spec.num_heads],
                terms=triton_metrics.terms([spec], dev))
        got = None
        if streamed:  # computed while the requests ran: one gather by slot for every streamed layer
            st = self.stream
            got = stream_gather(st, slots_dev[st.group], positions_dev)  # [streamed layers, total, width, H] float16
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
                out[:, : got.shape[1], : got.shape[2]].index_copy_(0, idx, got.float())
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
        event = self.timer.stop(started)
        loop = time.perf_counter() - t0
        jobs = []
        for i, (plan, rec) in enumerate(zip(batch, records)):
            # by layer index, as the planner picked them (comparing LayerSpecs field by field cost a finish batch
            # more than its summaries' launches)
            wanted = {s.index for s in plan.layers}
            keep = [li for li, spec in enumerate(layers) if spec.index in wanted]
            if host is not None:
                per_row = host[:, :, :, cu[i]:cu[i + 1]].permute(1, 0, 2, 3)  # a view: read after ``event``
                job = Job(rec, per_row, None, event, plan.nbytes, plan.t0, tok_host.get(i),
                          keep=keep if len(keep) < len(layers) else None)
            else:
                job = Job(rec, None, None, event, plan.nbytes, plan.t0, tok_host.get(i),
                          keep=keep if len(keep) < len(layers) else None, summary=summaries[i])
            jobs.append(job)
            if rec.part is None or rec.part.index == 0:  # a parallel capture counts once, on its first part
                self.stats.add("captured")
            self.device_budget.release(plan.device)  # a forward writes these slots only after the kernels (Side)
            self.stats.loop_times.append(loop / len(batch) + (t0 - plan.t0))
        self.handoff.put_many(jobs)  # a part a writer thread, each written in one message
