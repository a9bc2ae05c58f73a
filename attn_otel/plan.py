"""What a finished request's capture will be: its options, layers, trace identity, maps decision and the
host bytes it reserves in the hand-off, decided on the engine loop before any device work is enqueued;
and the capture's record (:class:`attn_otel.store.CaptureRecord`), this rank's part of it under tensor or
pipeline parallelism."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Sequence

import numpy as np
import torch

from . import arrival
from .attention import METRICS
from .config import Config, RequestOptions, parse_request_options
from .handoff import Handoff
from .ids import (derived_span_id, derived_trace_id, maps_sampled, new_span_id, new_trace_id, parse_traceparent,
                  traceparent_sampled)
from .stats import Stats, WarnOnce
from .store import CaptureRecord
from .stream import MetricsStream
from .tap import LayerSpec, MapTap
from .tracking import FinishedRequest, Parallel

logger = logging.getLogger("attn_otel")

# Bytes a capture holds in the hand-off, per layer and head: its maps MAP_ITEM per (query, key) pair (float16),
# its per-row metrics ROW_ITEM per token (float32 each)
MAP_ITEM = 2
ROW_ITEM = len(METRICS) * 4


def map_token_limit(max_tokens: int, room: int, layers: int, heads: int) -> int:
    """The longest request, in tokens, that can get maps: at most ``max_tokens`` (ATTN_OTEL_MAX_MAP_TOKENS),
    and no longer than a capture of ``layers * heads`` maps that fits ``room``, the hand-off bytes maps may
    hold (ATTN_OTEL_QUEUE_BYTES less the room kept for captures without maps)."""
    if layers <= 0 or heads <= 0:
        return max_tokens
    # Planner.plan's bytes of a capture with maps, a T^2 + b T: the largest T within room, exactly in integers
    # (the floor of the square root keeps the floor of the root)
    a, b = MAP_ITEM * layers * heads, ROW_ITEM * layers * heads
    return min(max_tokens, (math.isqrt(b * b + 4 * a * max(room, 0)) - b) // (2 * a))


@dataclasses.dataclass
class Plan:
    """One finished request's capture, admitted: ``nbytes`` are reserved in the hand-off."""

    req: FinishedRequest
    layers: list[LayerSpec]  # the layers this rank computes
    wanted: tuple[int, ...]  # the capture's layers on every stage
    T: int
    want_maps: bool
    trace_id: str
    parent: str | None
    sampled: bool
    nbytes: int
    t0: float  # perf_counter at the finish
    summarised: bool  # ``nbytes`` is a summary's, not per-row metrics' (decided before any maps fallback)
    device: int = 0  # device bytes the batched path reserved


class Planner:
    """Decides each finished request's capture (``plan``) and builds its record (``record``)."""

    def __init__(self, config: Config, layers: Sequence[LayerSpec], map_layers: Sequence[int], handoff: Handoff,
                 stats: Stats, warn: WarnOnce, stream: MetricsStream | None = None,
                 parallel: Parallel | None = None, summarised_on_device: bool = False, model: str = "",
                 engine_version: str = "", attrs: dict[str, Any] | None = None, maptap: MapTap | None = None):
        self.config = config
        self.maptap = maptap  # queries of the streamed map layers, kept for the requests planned for maps
        self.layers = list(layers)
        self.layer_ids = tuple(s.index for s in self.layers)
        self.map_layers = tuple(map_layers)
        self.handoff = handoff
        self.stats = stats
        self.warn = warn
        self.stream = stream
        self.parallel = parallel
        self.summarised_on_device = summarised_on_device  # a GPU: metrics-only captures summarised there
        self.model = model
        self.engine_version = engine_version
        self.attrs = dict(attrs or {})
        self.maps_room = handoff.capacity - handoff.maps_headroom  # the hand-off bytes maps may hold
        self.heads = max((s.num_heads for s in self.layers), default=0)  # this rank's
        tapped = self.layer_ids if parallel is None else parallel.capture_layers
        limit = self.map_tokens(tapped)
        arrival.publish_map_tokens(limit)  # the scheduler of this process declines longer prompts at arrival
        if self.map_layers and limit < config.max_map_tokens:
            logger.info("attn-otel: maps for requests of up to %d tokens: a capture with maps of %d layers x %d "
                        "heads any longer would not fit the %d MiB of ATTN_OTEL_QUEUE_BYTES maps may hold (longer "
                        "ones get metrics, counted as map_too_long; ATTN_OTEL_MAX_MAP_TOKENS is %d)", limit,
                        sum(1 for x in tapped if x in self.map_layers), self.heads, self.maps_room >> 20,
                        config.max_map_tokens)

    def map_tokens(self, wanted: Sequence[int]) -> int:
        """The longest request that can get maps of the map layers among ``wanted`` (the capture's layers on
        every stage, so that every rank of a parallel engine decides alike): :func:`map_token_limit`."""
        n = sum(1 for x in wanted if x in self.map_layers)
        return map_token_limit(self.config.max_map_tokens, self.maps_room, n, self.heads)

    def options(self, req: FinishedRequest) -> RequestOptions:
        opts = parse_request_options(req.extra_args)
        for w in opts.warnings:
            self.warn("opt:" + w.split("=")[0], "request %s: %s", req.request_id, w)
        return opts

    def plan(self, req: FinishedRequest) -> Plan | None:
        """The request's capture with its hand-off bytes reserved, or None (skipped or dropped, counted)."""
        t0 = time.perf_counter()
        opts = self.options(req)
        if opts.mode == "off":
            self.stats.add("skipped", reason="request_off")
            return None
        T = int(req.num_tokens)
        if T < 1:
            self.stats.add("skipped", reason="no_tokens")
            return None
        par = self.parallel
        tapped = self.layer_ids if par is None else par.capture_layers
        wanted = tapped if opts.layers is None else tuple(x for x in tapped if x in opts.layers)
        if opts.layers is not None and len(wanted) < len(opts.layers):
            self.warn("layers-not-tapped", "request %s asked for layers %s; only %s are captured "
                      "(ATTN_OTEL_LAYERS); capturing those", req.request_id, list(opts.layers), list(tapped))
        if not wanted:
            self.stats.add("skipped", reason="no_layers")
            return None
        if self.stream is not None and self.stream.lost(req.request_id):
            self.stats.add("dropped", reason="stream_lost")
            self.warn("stream_lost", "the streamed layers of a request could not be computed (a step had more "
                      "tokens than ATTN_OTEL_STREAM_ROWS, or the query ring's row counter drifted: "
                      "stream_ring_drifts); such captures are dropped and counted")
            return None
        planned_id, planned_maps = arrival.planned(req.extra_args)  # decided in the scheduler (attn_otel.arrival)
        if planned_id is not None:
            trace_id, parent = planned_id, None
        elif par is not None and par.id_seed:
            trace_id, parent = derived_trace_id(par.id_seed, req.request_id), None
        else:
            trace_id, parent = new_trace_id(), None
        sampled = True
        if opts.traceparent:  # valid: parse_request_options kept only what OpenTelemetry's propagator accepts
            trace_id, parent = parse_traceparent(opts.traceparent)  # type: ignore[misc]
            sampled = traceparent_sampled(opts.traceparent)
        want_maps = opts.mode == "maps" or (opts.mode is None and maps_sampled(trace_id, self.config.maps_sample))
        if want_maps and T > self.map_tokens(wanted):
            self.stats.add("skipped", reason="map_too_long")
            want_maps = False
        if planned_maps is not None:  # the arrival decision stands (it knew the prompt's length only)
            want_maps = want_maps and planned_maps
        if want_maps and self.maptap is not None and not self.maptap.complete(req.request_id, T):
            # its queries were not all kept: a prefix-cache hit (no arrival decision), or the map tap was full
            self.stats.add("skipped", reason="map_rows_missing")
            self.warn("map_rows_missing", "request %s: not every query of it is in the map tap (a prefix-cache "
                      "hit the scheduler did not prevent, or ATTN_OTEL_MAP_TAP_TOKENS full); capturing metrics",
                      req.request_id)
            want_maps = False
        mapped = tuple(x for x in wanted if x in self.map_layers)
        if want_maps and mapped != tuple(wanted):  # a maps capture covers the map layers (streamed ones keep no Q)
            if mapped:
                wanted = mapped
            else:
                self.stats.add("skipped", reason="no_map_layers")
                self.warn("no_map_layers", "request %s asked for maps of layers %s, which are streamed "
                          "(metrics only; ATTN_OTEL_MAP_LAYERS); capturing metrics", req.request_id, list(wanted))
                want_maps = False
        layers = [s for s in self.layers if s.index in wanted]
        if not layers:  # pipeline parallel: the request's layers are all on other stages
            return None
        H = max(s.num_heads for s in layers)
        L = len(layers)
        summarised = self.summarised(want_maps)
        maps_bytes = MAP_ITEM * L * H * T * T
        if summarised:  # only its summary leaves the device (see attn_otel.finish)
            nbytes = 2 * len(METRICS) * 4 * L * H * 4
        else:
            nbytes = ROW_ITEM * L * H * T + (maps_bytes if want_maps else 0)
        if not self.handoff.reserve(nbytes, maps=want_maps):
            if want_maps and self.handoff.reserve(nbytes - maps_bytes):
                nbytes -= maps_bytes
                want_maps = False
                self.stats.add("skipped", reason="maps_queue_full")
            else:
                self.stats.add("dropped", reason="queue_full")
                self.warn("queue_full", "hand-off queue full (%d bytes, ATTN_OTEL_QUEUE_BYTES); dropping "
                          "captures and counting them", self.config.queue_bytes)
                return None
        return Plan(req, layers, tuple(wanted), T, want_maps, trace_id, parent, sampled, nbytes, t0, summarised)

    def summarised(self, want_maps: bool) -> bool:
        """Whether a capture's per-row metrics stay on the device, summarised there."""
        return not want_maps and self.summarised_on_device and self.config.row_metrics != "all"

    def record(self, plan: Plan) -> tuple[CaptureRecord, torch.Tensor | None]:
        """The capture's record and, where only the device holds them, its token ids there; under
        tensor/pipeline parallelism, this rank's part of the capture of ``plan.wanted`` (the request's
        layers on every stage), ``plan.layers`` being those this rank holds."""
        req, layers, T = plan.req, plan.layers, plan.T
        vision_np = None
        if req.vision_positions is not None and np.any(req.vision_positions[:T]):
            vision_np = np.zeros(T, dtype=bool)  # the mask ends with the last image; pad it to T
            n = min(T, len(req.vision_positions))
            vision_np[:n] = np.asarray(req.vision_positions[:n], dtype=bool)
        part, whole_layers, H = None, tuple(s.index for s in layers), max(s.num_heads for s in layers)
        par = self.parallel
        if par is not None:
            whole_layers = tuple(plan.wanted)
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
        span_id = derived_span_id(plan.trace_id, req.request_id) if par is not None else new_span_id()
        record = CaptureRecord(
            trace_id=plan.trace_id, request_id=req.request_id, span_id=span_id, parent_span_id=plan.parent,
            prompt_len=N, num_tokens=T, layers=whole_layers, num_heads=H,
            model=self.model, engine_version=self.engine_version, mode="maps" if plan.want_maps else "metrics",
            token_ids=tokens, vision_mask=vision_np,
            attrs={**self.attrs, "vision": vision_np is not None, "sink_tokens": self.config.sink_tokens,
                   **({"finish_reason": req.finish_reason} if getattr(req, "finish_reason", None) else {})},
            part=part, sampled=plan.sampled,
        )
        return record, tokens_dev
