"""A request's capture decided when it arrives, in vLLM's scheduler, before any of its tokens run.

Maps need every query of a request, and a query is gone after its step.  Keeping every token's queries
until its request finishes (the old Q/K tap) took a quarter of the KV cache for the 1% of requests that get
maps.  Deciding at arrival lets the workers keep queries only for those requests (:class:`attn_otel.tap.MapTap`):

- the request's trace id is fixed here (its ``traceparent``'s, else a new one), so the maps sample
  (:func:`attn_otel.ids.maps_sampled`) and every rank of a parallel engine agree;
- a request that gets maps skips *reading* the prefix cache (``Request.skip_reading_prefix_cache``, the
  switch vLLM has for prompt logprobs): its every token runs through the model, so every query of it passes
  the tap.  Its own blocks still go into the cache for the requests after it.  That is a recomputed prefix
  on about ``ATTN_OTEL_MAPS_SAMPLE`` of the requests (1% by default): the price of exact maps.

The decision travels to the workers in the request's ``SamplingParams.extra_args`` (keys
:data:`TRACE_ID_KEY` and :data:`MAPS_KEY`), as the traceparent already does.  vLLM-free: the adapter
calls :func:`decide` from ``Scheduler.add_request``.
"""

from __future__ import annotations

from typing import Any, Mapping

from .config import Config, parse_request_options
from .ids import maps_sampled, new_trace_id, parse_traceparent

TRACE_ID_KEY = "attn_otel_trace_id"  # the trace id chosen at arrival (a request without a traceparent)
MAPS_KEY = "attn_otel_maps_planned"  # True: the workers keep this request's queries for its maps
_MAP_TOKENS: list[int] = []  # the longest request that can get maps, as this process's worker planned it


def publish_map_tokens(limit: int) -> None:
    """The longest request that can get maps (:meth:`attn_otel.plan.Planner.map_tokens`), published by the
    worker of this process, so that the scheduler's arrival decision agrees with the finish's.  A scheduler
    whose workers run in other processes (tensor or pipeline parallel) does not see it and decides by
    ``ATTN_OTEL_MAX_MAP_TOKENS`` alone; the finish still declines what does not fit (``map_too_long``)."""
    _MAP_TOKENS[:] = [int(limit)]


def map_tokens(config: Config) -> int:
    """The arrival's limit on a maps request's prompt: the published one, else ``ATTN_OTEL_MAX_MAP_TOKENS``."""
    return min(_MAP_TOKENS[0], config.max_map_tokens) if _MAP_TOKENS else config.max_map_tokens


def decide(extra_args: Mapping[str, Any] | None, prompt_len: int, config: Config) -> tuple[dict[str, Any] | None, bool]:
    """``(extra_args with the decision, maps?)`` for a request arriving with these extra args and a prompt
    of ``prompt_len`` tokens.  ``None`` extra args back when capture is off for the request."""
    opts = parse_request_options(extra_args)
    if opts.mode == "off":
        return (dict(extra_args) if extra_args else None), False
    extra = dict(extra_args or {})
    if TRACE_ID_KEY in extra and MAPS_KEY in extra:  # decided already (a resumed or re-added request)
        return extra, bool(extra[MAPS_KEY])
    parsed = parse_traceparent(opts.traceparent) if opts.traceparent else None
    trace_id = parsed[0] if parsed else new_trace_id()
    maps = opts.mode == "maps" or (opts.mode is None and maps_sampled(trace_id, config.maps_sample))
    maps = maps and 0 < int(prompt_len) <= map_tokens(config)
    extra[TRACE_ID_KEY] = trace_id
    extra[MAPS_KEY] = bool(maps)
    return extra, bool(maps)


def planned(extra_args: Mapping[str, Any] | None) -> tuple[str | None, bool | None]:
    """The arrival decision carried by a request's extra args: ``(trace id or None, maps or None)``; None
    where no scheduler decided (a request the scheduler hook did not see)."""
    if not extra_args or not isinstance(extra_args, Mapping):
        return None, None
    tid = extra_args.get(TRACE_ID_KEY)
    maps = extra_args.get(MAPS_KEY)
    return (tid if isinstance(tid, str) and len(tid) == 32 else None), (bool(maps) if maps is not None else None)
