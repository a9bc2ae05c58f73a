"""The only module that touches vLLM internals (vLLM 0.26 CUDA and 0.32 CPU build share it).

Entry point ``vllm.general_plugins: attn_otel = attn_otel.vllm_adapter:register``.  vLLM calls it in
every process, sometimes more than once; with ``ATTN_OTEL`` unset or ``0`` it returns before importing
anything, so nothing is patched or allocated.  With ``ATTN_OTEL=1`` it wraps, at the class level, four
methods (no vLLM source is modified):

- ``Worker.determine_available_memory`` (GPU and CPU workers): the KV-cache budget is shared with the
  Q/K tap, so vLLM's total memory stays what the operator gave it;
- ``GPUModelRunner.initialize_kv_cache`` (the CPU runner inherits it): sizes the tap to the KV cache's
  slots and wraps each captured layer's ``impl.forward`` to scatter its queries and keys by the layer's
  ``slot_mapping`` (inside the opaque attention op: eager, piecewise or full CUDA graph alike);
- ``GPUModelRunner._update_states`` (V1 runner, CPU build) or ``finish_requests`` (0.26's default
  "model runner V2"): the first thing a step does with the scheduler's output.  Requests in
  ``finished_req_ids`` are captured *before* the original runs, i.e. before this step can zero or
  overwrite their freed blocks; then the step's new and scheduled requests are recorded (blocks, and how
  many tokens have been through the model);
- ``Scheduler._free_request``, ``Scheduler.schedule`` and ``Scheduler.finish_requests`` (EngineCore process)
  and ``OutputProcessor.process_outputs`` (front end): each finished request's finish reason (``stop``,
  ``length``, ``abort``, ...), which the worker is never told, rides to it on the ``SchedulerOutput`` that
  carries its id; a stop string, found by the front end, is tagged on the abort it sends
  (:func:`_patch_scheduler`).

The capture's ``model`` is the served model name, never a local path (:func:`attn_otel.tracking.model_name`).

A layer's own attention terms (scale, logit soft-capping, sliding window, learned sinks, chunked local
attention) are read here into its ``LayerSpec``, MLA layers as the multi-query attention of their latent cache;
layers attn-otel cannot reproduce exactly (ALiBi, encoder or cross attention, KV sharing, linear and
state-space layers, sparse or fp8 MLA, a window or chunk with no full-attention KV-cache group to tap it by)
are refused by name with one log line; the rest of the model is still captured (docs/support.md).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time

from .deferred import DeferredFinish, flat_blocks

logger = logging.getLogger("attn_otel")

_PATCHED = False
_ENGINES: list = []  # CaptureEngines of this process, for tests and exporters


def register() -> None:
    """vLLM general-plugin entry point.  Idempotent; does nothing unless ``ATTN_OTEL=1``."""
    global _PATCHED
    if os.environ.get("ATTN_OTEL", "0").strip().lower() not in ("1", "true", "yes", "on"):
        return
    if _PATCHED:
        return
    try:
        _patch()
        _PATCHED = True
    except Exception:  # noqa: BLE001 - a vLLM we cannot patch must still serve
        logger.exception("attn-otel: could not hook into this vLLM version; capture is off")


def engines() -> list:
    return list(_ENGINES)


def _patch() -> None:
    from vllm.platforms import current_platform

    # vLLM 0.32's CPU runner and 0.26's V1 GPU runner: requests finish in _update_states.
    from vllm.v1.worker import gpu_model_runner

    _wrap(gpu_model_runner.GPUModelRunner, "initialize_kv_cache", _after_initialize_kv_cache)
    _wrap(gpu_model_runner.GPUModelRunner, "_update_states", _before_step)
    _wrap(gpu_model_runner.GPUModelRunner, "execute_model", _after_launch)
    _wrap(gpu_model_runner.GPUModelRunner, "sample_tokens", _after_sample)
    try:  # vLLM 0.26's default GPU runner ("model runner V2"): requests finish in finish_requests.
        from vllm.v1.worker.gpu import model_runner as v2

        _wrap(v2.GPUModelRunner, "initialize_kv_cache", _after_initialize_kv_cache)
        _wrap(v2.GPUModelRunner, "finish_requests", _before_step)
        _wrap(v2.GPUModelRunner, "execute_model", _after_launch)
        _wrap(v2.GPUModelRunner, "sample_tokens", _after_sample)
    except Exception:  # noqa: BLE001 - not in this build (the CPU build has no V2 runner)
        pass
    _patch_scheduler()
    _patch_engine_core()
    if current_platform.is_cpu():
        # Imported only on CPU: the CPU runner's module replaces torch.cuda.Event process-wide.
        from vllm.v1.worker.cpu_worker import CPUWorker as worker_cls
    else:
        from vllm.v1.worker import gpu_worker
        from vllm.v1.worker.gpu_worker import Worker as worker_cls

        from .config import Config

        if Config.from_env().engine_priority == "high":  # before the worker makes its stream (engine_stream.py)
            from vllm.utils import torch_utils

            from . import engine_stream

            engine_stream.install(gpu_worker, torch_utils)
    for cls in worker_cls.__mro__:
        if "determine_available_memory" in vars(cls):
            _wrap(cls, "determine_available_memory", _scale_available_memory)
            break
    from vllm.v1.core.sched.scheduler import Scheduler

    _wrap(Scheduler, "add_request", _on_arrival)
    if _is_api_server():
        try:
            _patch_api_server()
        except Exception:  # noqa: BLE001 - the server still serves, with capture but without these extras
            logger.exception("attn-otel: could not hook into vLLM's API server (no traceresponse, no "
                             "/attn-otel/metrics); capture itself is on")
    logger.info("attn-otel: capture on (vLLM hooks installed)")


# ------------------------------------------------------------------------------ engine-core process
_ARRIVAL_CONFIG: list = []


def _on_arrival(orig, scheduler, request, *args, **kwargs):
    """``Scheduler.add_request``: decide the request's trace id and maps before any of its tokens run
    (:mod:`attn_otel.arrival`); a maps request skips reading the prefix cache.  Never raises."""
    try:
        from . import arrival
        from .config import Config

        if not _ARRIVAL_CONFIG:
            _ARRIVAL_CONFIG.append(Config.from_env())
        sp = getattr(request, "sampling_params", None)
        if sp is not None and getattr(request, "pooling_params", None) is None:
            extra, maps = arrival.decide(sp.extra_args, _prompt_len(request), _ARRIVAL_CONFIG[0])
            sp.extra_args = extra
            if maps:
                request.skip_reading_prefix_cache = True
    except Exception:  # noqa: BLE001 - the request is served; its capture decides at finish instead
        logger.warning("attn-otel: could not decide request %s's capture at arrival",
                       getattr(request, "request_id", "?"), exc_info=True)
    return orig(scheduler, request, *args, **kwargs)


def _prompt_len(request) -> int:
    n = getattr(request, "num_prompt_tokens", None)
    return int(n) if n is not None else len(getattr(request, "prompt_token_ids", None) or ())


# ------------------------------------------------------------------------------ scheduler (EngineCore)
_REASONS = "attn_otel_finish_reasons"  # SchedulerOutput attribute: {request id: finish reason}
# SchedulerOutput attribute: {request id: its generated token ids}, where token ids are stored.  A worker knows a
# request's generated ids only as far as its runner keeps them on the host: vLLM's V1 runner under async
# scheduling (DeepSeek, gpt-oss, hybrids: models not on the default "model runner V2") keeps -1 placeholders.
_OUTPUTS = "attn_otel_output_ids"
# SchedulerOutput attribute: {request id: its prompt + output token count}.  With speculative decoding the worker
# has run draft tokens past the end (rejected, or cut by max_tokens or a stop): the capture keeps the sequence's
# own positions, count - 1 (the last sampled token never goes through the model).
_LENGTHS = "attn_otel_lengths"
# Prefix of the marker ids the front end adds to an abort for requests it stopped on a stop string (NUL: no
# request id from HTTP or the offline counter has one; an unpatched engine core ignores an unknown id).
_STOP_MARK = "\x00attn-otel:stop\x00"


def _patch_engine_core() -> None:
    """``EngineCore.post_step``, which vLLM calls once the step's output is taken (queued for the front end):
    work after the launch runs there with ``ATTN_OTEL_AFTER_LAUNCH=output`` (see :func:`_after_output`)."""
    try:
        from vllm.v1.engine.core import EngineCore
    except Exception:  # noqa: BLE001
        return
    if "post_step" in vars(EngineCore):
        _wrap(EngineCore, "post_step", _after_output)


def _patch_scheduler() -> None:
    """Finish reasons for the worker.  The worker learns that a request finished only from its id in
    ``SchedulerOutput.finished_req_ids``; why it finished (``RequestStatus``) is known to the scheduler,
    in ``_free_request``, which every finish goes through (stop, length, abort, error, ...).  The reason is
    noted there and handed over on the ``SchedulerOutput`` that carries the id (an attribute of the
    dataclass instance: the same object in-process, pickled with it to multiprocess workers).

    One finish the scheduler gets wrong: a stop string is found by the front end's detokenizer (vLLM's
    ``OutputProcessor``), which then *aborts* the request in the engine core (``reqs_to_abort``; vLLM's
    own ``EngineCore.abort_requests`` has a TODO on passing the reason).  The front end therefore adds a
    marker id (``_STOP_MARK`` + id) to that abort for each such request, and ``finish_requests`` here takes
    the markers out and records ``stop`` for those requests, ``abort`` for the rest."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except Exception:  # noqa: BLE001
        logger.warning("attn-otel: no vLLM v1 scheduler here; captures carry no finish reason")
        return
    if not {"_free_request", "schedule", "finish_requests"} <= set(vars(Scheduler)):
        logger.warning("attn-otel: this vLLM's scheduler has no _free_request/schedule/finish_requests; "
                       "captures carry no finish reason")
        return
    _wrap(Scheduler, "_free_request", _note_finish_reason)
    _wrap(Scheduler, "schedule", _hand_over_finish_reasons)
    if "_free_request_blocks" in vars(Scheduler):  # attn_otel.hold (none in a vLLM without it: nothing held)
        _wrap(Scheduler, "_free_request_blocks", _hold_finished_blocks)
        if "reset_prefix_cache" in vars(Scheduler):
            _wrap(Scheduler, "reset_prefix_cache", _give_back_before_reset)
    _wrap(Scheduler, "finish_requests", _take_stop_marks)
    try:
        from vllm.v1.engine.output_processor import OutputProcessor

        _wrap(OutputProcessor, "process_outputs", _mark_stop_string_aborts)
    except Exception:  # noqa: BLE001 - stop-string finishes are then recorded as abort
        logger.warning("attn-otel: cannot tell stop-string finishes from aborts in this vLLM; both are "
                       "recorded as abort")


def _mark_stop_string_aborts(orig, processor, *args, **kwargs):
    """Front end: the requests in ``reqs_to_abort`` are exactly those its detokenizer stopped on a stop
    string while the engine core still ran them (vLLM aborts them in the engine core next)."""
    out = orig(processor, *args, **kwargs)
    try:
        stopped = getattr(out, "reqs_to_abort", None)
        if stopped:
            stopped.extend([_STOP_MARK + r for r in stopped if isinstance(r, str)])
    except Exception:  # noqa: BLE001
        pass
    return out


def _take_stop_marks(orig, scheduler, request_ids, *args, **kwargs):
    if request_ids is None or isinstance(request_ids, str):
        return orig(scheduler, request_ids, *args, **kwargs)
    ids = list(request_ids)
    stops = {r[len(_STOP_MARK):] for r in ids if isinstance(r, str) and r.startswith(_STOP_MARK)}
    if not stops:
        return orig(scheduler, ids, *args, **kwargs)
    scheduler.__dict__["_attn_otel_stops"] = stops
    try:
        return orig(scheduler, [r for r in ids if not (isinstance(r, str) and r.startswith(_STOP_MARK))],
                    *args, **kwargs)
    finally:
        scheduler.__dict__.pop("_attn_otel_stops", None)


def _note_finish_reason(orig, scheduler, request, *args, **kwargs):
    try:
        reason = request.get_finished_reason()
        if reason is not None:
            reason = str(reason)  # FinishReason's str: stop, length, abort, error, repetition
            if reason == "abort" and request.request_id in scheduler.__dict__.get("_attn_otel_stops", ()):
                reason = "stop"  # stopped by the front end on a stop string (see _patch_scheduler)
            scheduler.__dict__.setdefault("_attn_otel_reasons", {})[request.request_id] = reason
        scheduler.__dict__.setdefault("_attn_otel_lengths", {})[request.request_id] = int(request.num_tokens)
        if _store_tokens():
            scheduler.__dict__.setdefault("_attn_otel_outputs", {})[request.request_id] = [
                int(t) for t in request.output_token_ids]
    except Exception:  # noqa: BLE001 - a capture without its reason, never a failed finish
        pass
    return orig(scheduler, request, *args, **kwargs)


def _block_hold(scheduler):
    """The scheduler's :class:`attn_otel.hold.BlockHold`, made at its first finish; ``None`` where nothing is held:
    ``ATTN_OTEL_HOLD_FINISHED=0`` (it is off too with ``ATTN_OTEL_FINISH_BATCH_STEPS=0``, where the worker does
    the finish work in the step anyway), or a KV connector that defers vLLM's own frees.  Blocks are
    held two steps past the finish batch's age limit, so that the worker takes the batch first."""
    hold = scheduler.__dict__.get("_attn_otel_hold", False)
    if hold is not False:
        return hold
    hold = None
    try:
        from .config import Config
        from .hold import BlockHold, margin_blocks

        if not _ARRIVAL_CONFIG:
            _ARRIVAL_CONFIG.append(Config.from_env())
        config = _ARRIVAL_CONFIG[0]
        if config.hold_finished and not getattr(scheduler, "defer_block_free", False):
            groups = scheduler.kv_cache_config.kv_cache_groups
            sizes = [int(g.kv_cache_spec.block_size) for g in groups] or [int(scheduler.block_size)]
            hold = BlockHold(margin_blocks(
                scheduler.max_model_len, scheduler.max_num_scheduled_tokens, scheduler.max_num_running_reqs,
                min(sizes), len(sizes), getattr(scheduler.kv_cache_manager, "watermark_blocks", 0)),
                steps=config.finish_batch_steps + 2, register=True)
    except Exception:  # noqa: BLE001 - vLLM frees as it would without attn-otel
        logger.warning("attn-otel: finished requests' blocks are not held for their finish batch (their flush "
                       "and spill then come before the next forward)", exc_info=True)
    scheduler.__dict__["_attn_otel_hold"] = hold
    return hold


def _hold_finished_blocks(orig, scheduler, request, *args, **kwargs):
    """``Scheduler._free_request_blocks`` (a finished request's blocks back to the pool): the uncached ones held
    for its finish batch where the pool has room (attn_otel.hold)."""
    hold = _block_hold(scheduler)
    if hold is None or getattr(scheduler, "defer_block_free", False):
        return orig(scheduler, request, *args, **kwargs)
    manager = scheduler.kv_cache_manager
    try:
        blocks = manager.pop_blocks_for_free(request)
    except Exception:  # noqa: BLE001
        return orig(scheduler, request, *args, **kwargs)
    try:
        hold.free(manager.block_pool, blocks)
    except Exception:  # noqa: BLE001 - never a failed finish: vLLM's own free of what is not given back yet
        logger.warning("attn-otel: could not hold a finished request's blocks", exc_info=True)
        scheduler.__dict__["_attn_otel_hold"] = None
        try:
            manager.block_pool.free_blocks(reversed([b for b in blocks if getattr(b, "ref_cnt", 0) > 0]))
        except Exception:  # noqa: BLE001
            logger.warning("attn-otel: a finished request's blocks could not be freed", exc_info=True)
    return None


def _give_held_back(scheduler, step: str, *args) -> None:
    """The scheduler's held blocks (if any) at ``step`` of :class:`attn_otel.hold.BlockHold`
    (``before_schedule``, ``after_schedule`` or ``release_all``).  Never raises."""
    hold = scheduler.__dict__.get("_attn_otel_hold")
    if hold:
        try:
            getattr(hold, step)(scheduler.kv_cache_manager.block_pool, *args)
        except Exception:  # noqa: BLE001
            logger.warning("attn-otel: could not give held blocks back", exc_info=True)


def _give_back_before_reset(orig, scheduler, *args, **kwargs):
    """``Scheduler.reset_prefix_cache``, which fails while any block is in use: held blocks go back first (the
    worker's own check puts a finished request's work before a forward that writes one of its blocks)."""
    _give_held_back(scheduler, "release_all")
    return orig(scheduler, *args, **kwargs)


def _hand_over_finish_reasons(orig, scheduler, *args, **kwargs):
    _give_held_back(scheduler, "before_schedule")
    out = orig(scheduler, *args, **kwargs)
    _give_held_back(scheduler, "after_schedule", int(out.total_num_scheduled_tokens))
    for key, attr in (("_attn_otel_reasons", _REASONS), ("_attn_otel_outputs", _OUTPUTS),
                      ("_attn_otel_lengths", _LENGTHS)):
        noted = scheduler.__dict__.get(key)
        if noted:
            try:
                setattr(out, attr, {r: noted.pop(r) for r in out.finished_req_ids if r in noted})
            except Exception:  # noqa: BLE001
                pass
    return out


_STORE_TOKENS: list = []


def _store_tokens() -> bool:
    if not _STORE_TOKENS:
        from .config import Config

        _STORE_TOKENS.append(Config.from_env().store_tokens)
    return _STORE_TOKENS[0]


# ------------------------------------------------------------------------------ API-server process
_API_SERVER_MODULES = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.launchers.api_server.entry",
                       "vllm.entrypoints.cli.serve")


def _is_api_server() -> bool:
    import sys

    return any(m in sys.modules for m in _API_SERVER_MODULES)


def _patch_api_server() -> None:
    """In vLLM's OpenAI server process: a stats directory for the engine processes to inherit, attn-otel's
    endpoint plugin (trace-context middleware, ``/attn-otel/metrics``) appended to the ones vLLM attaches
    to its app (both 0.26 and 0.32 look ``vllm.plugins.load_endpoint_plugins`` up when building the app),
    and the request's traceparent copied into its sampling params when requests enter the engine."""
    import vllm.plugins as plugins
    from vllm.v1.engine.async_llm import AsyncLLM

    from . import server

    server.prepare_stats_dir()
    orig = plugins.load_endpoint_plugins
    if not getattr(orig, "_attn_otel", False):
        def load_endpoint_plugins(*args, **kwargs):
            found = list(orig(*args, **kwargs))
            try:
                from vllm.v1.metrics.prometheus import get_prometheus_registry

                registry = get_prometheus_registry()
            except Exception:  # noqa: BLE001
                registry = None
            return [*found, server.EndpointPlugin(registry)]

        load_endpoint_plugins._attn_otel = True  # type: ignore[attr-defined]
        load_endpoint_plugins.__wrapped__ = orig  # type: ignore[attr-defined]
        plugins.load_endpoint_plugins = load_endpoint_plugins
    _wrap_async(AsyncLLM, "add_request", _before_add_request)


def _wrap_async(cls, name: str, wrapper) -> None:
    orig = vars(cls)[name]
    if getattr(orig, "_attn_otel", False):
        return

    async def patched(self, *args, **kwargs):
        wrapper(args, kwargs)
        return await orig(self, *args, **kwargs)

    patched._attn_otel = True  # type: ignore[attr-defined]
    patched.__wrapped__ = orig  # type: ignore[attr-defined]
    patched.__name__ = orig.__name__
    setattr(cls, name, patched)


def _before_add_request(args: tuple, kwargs: dict) -> None:
    """``AsyncLLM.add_request(request_id, prompt, params, ...)``: the prompt may already be an
    ``EngineCoreRequest`` holding its own (possibly cloned) sampling params; both get the traceparent."""
    from . import server

    prompt = args[1] if len(args) > 1 else kwargs.get("prompt")
    params = args[2] if len(args) > 2 else kwargs.get("params")
    server.inject_traceparent(params, getattr(prompt, "sampling_params", None))


def _wrap(cls, name: str, wrapper) -> None:
    orig = vars(cls)[name]
    if getattr(orig, "_attn_otel", False):
        return

    def patched(self, *args, **kwargs):
        return wrapper(orig, self, *args, **kwargs)

    patched._attn_otel = True  # type: ignore[attr-defined]
    patched.__wrapped__ = orig  # type: ignore[attr-defined]
    patched.__name__ = orig.__name__
    setattr(cls, name, patched)


# --------------------------------------------------------------------------------- model inspection
def _attention_layers(static_forward_context) -> dict[str, object]:
    from vllm.model_executor.layers.attention.attention import Attention

    kinds = (Attention, *_mla_classes())
    return {name: m for name, m in static_forward_context.items() if isinstance(m, kinds)}


def _mla_classes() -> tuple:
    try:
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    except Exception:  # noqa: BLE001 - a build without MLA
        return ()
    return (MLAAttention,)


def _is_mla(layer) -> bool:
    return isinstance(layer, _mla_classes())


def _mla_refusal(layer) -> str | None:
    """Why an MLA layer cannot be captured exactly (or None).  attn-otel reads the latent cache row
    ``[c_kv | k_pe]`` as it is (an unquantised cache) and absorbs the queries with the layer's own ``W_UK^T``."""
    if getattr(layer, "use_sparse", False) or getattr(layer, "indexer", None) is not None:
        return "sparse MLA (top-k indexer)"
    dtype = str(getattr(layer, "kv_cache_dtype", "auto") or "auto")
    if dtype != "auto":
        return f"MLA with a {dtype} KV cache"
    if getattr(layer, "use_pcp", False) or int(getattr(getattr(layer, "impl", None), "dcp_world_size", 1) or 1) > 1:
        return "MLA under context parallelism"
    if not isinstance(getattr(layer, "W_UK_T", None), __import__("torch").Tensor) or not isinstance(
            getattr(layer, "W_UV", None), __import__("torch").Tensor):
        return "MLA with quantised W_UK/W_UV (no absorbed weights kept)"
    return None


def _refusal(layer) -> str | None:
    if _is_mla(layer):
        return _mla_refusal(layer)
    impl = layer.impl
    attn_type = str(getattr(impl, "attn_type", "decoder")).lower()
    if "decoder" not in attn_type or "encoder" in attn_type:
        return f"attention type {attn_type}"
    if getattr(impl, "alibi_slopes", None) is not None:
        return "ALiBi"
    if getattr(layer, "kv_sharing_target_layer_name", None):
        return "KV sharing"
    if _window(impl) < 0:
        return f"sliding window {getattr(impl, 'sliding_window', None)!r} not causal-left only"
    return None


def _window(impl) -> int:
    """The layer's sliding window W (row i sees keys i-W+1 .. i), 0 for none, -1 for one this cannot read.

    The CPU backend keeps vLLM's ``sliding_window`` W as given (the KV-cache manager's convention: i - j < W);
    FLASH_ATTN, FLASHINFER and TRITON_ATTN keep it as (left, right) = (W - 1, 0)."""
    sw = getattr(impl, "sliding_window", None)
    if sw is None:
        return 0
    if isinstance(sw, (tuple, list)):
        left, right = (int(x) for x in sw)
        if left < 0:
            return 0
        return left + 1 if right == 0 else -1
    return int(sw) if int(sw) > 0 else 0


def _terms(impl) -> dict:
    """The LayerSpec fields of the layer's attention terms: soft-cap, window, sinks (this rank's heads)."""
    cap = getattr(impl, "logits_soft_cap", None)
    sinks = getattr(impl, "sinks", None)
    if sinks is not None:
        sinks = tuple(float(x) for x in sinks.detach().float().cpu().reshape(-1).tolist())
        if len(sinks) != int(impl.num_heads):
            raise ValueError(f"{len(sinks)} sink logits for {impl.num_heads} heads")
    return dict(soft_cap=float(cap or 0.0), window=_window(impl), sinks=sinks)


def _window_groups(specs, kv_cache_config):
    """Point windowed layers whose KV-cache group frees blocks out of the window (vLLM's SlidingWindowManager,
    the hybrid KV-cache manager) at a full-attention group's slots: a freed block is reused by other requests
    while this one runs, which would overwrite the tap rows its finish still reads; a full-attention group
    keeps every position of the request until it finishes.  Where the model has no full-attention group of
    their block size (every layer windowed, as Mistral 7B v0.1), they tap by attn-otel's own block table
    instead (:mod:`attn_otel.shadow`; ``group`` = ``len(kv_cache_groups)``, ``own_group`` their own).  Returns
    (specs kept, refusals)."""
    groups = kv_cache_config.kv_cache_groups
    def keeps_all(spec) -> bool:  # FullAttentionSpec or a subclass of it (MLAAttentionSpec)
        return any(c.__name__ == "FullAttentionSpec" for c in type(spec).__mro__)

    freeing = {g for g, grp in enumerate(groups) if not keeps_all(grp.kv_cache_spec)}
    full = [g for g, grp in enumerate(groups) if keeps_all(grp.kv_cache_spec) and grp.layer_names]
    kept, refused = [], []
    for s in specs:
        if s.group not in freeing:
            kept.append(s)
            continue
        bs = int(groups[s.group].kv_cache_spec.block_size)
        same = [g for g in full if int(groups[g].kv_cache_spec.block_size) == bs]
        if not (s.window or s.chunk):
            refused.append(f"{s.name} (KV-cache group of type {type(groups[s.group].kv_cache_spec).__name__})")
            continue
        if same:
            kept.append(dataclasses.replace(s, group=same[0], slots_from=groups[same[0]].layer_names[0]))
            continue
        own = [k.own_group for k in kept if k.own_group >= 0]
        if own and int(groups[own[0]].kv_cache_spec.block_size) != bs:  # one block size for the table
            refused.append(f"{s.name} (a windowed KV-cache group of block size {bs} beside another of "
                           f"{int(groups[own[0]].kv_cache_spec.block_size)}, with no full-attention group)")
            continue
        kept.append(dataclasses.replace(s, group=len(groups), own_group=s.group, slots_from=SHADOW))
    return kept, refused


SHADOW = "(attn-otel's own block table)"  # LayerSpec.slots_from of a layer tapped by attn_otel.shadow


def _layer_specs(runner, config, groups_by_layer=None, log=False):
    from vllm.model_executor.models.utils import extract_layer_index

    from .tap import LayerSpec
    from .config import resolve_layers

    ctx = runner.vllm_config.compilation_config.static_forward_context
    attn = _attention_layers(ctx)
    all_names = {n for n, m in ctx.items() if hasattr(m, "impl") or "attn" in n}
    by_index: dict[int, tuple[str, object]] = {}
    refused: list[str] = []
    for name, layer in attn.items():
        why = _refusal(layer) or _fp8_terms(layer)[1]
        if why:
            refused.append(f"{name} ({why})")
            continue
        by_index[extract_layer_index(name)] = (name, layer)
    for name in sorted(all_names - set(attn)):
        refused.append(f"{name} (not softmax attention: {type(ctx[name]).__name__})")
    num_layers = _total_layers(runner, max(by_index) + 1 if by_index else 0)
    wanted = resolve_layers(config.layers, num_layers)
    specs = []
    for i in wanted:
        if i not in by_index:
            continue
        name, layer = by_index[i]
        if _is_mla(layer):
            specs.append(_mla_spec(i, name, layer, (groups_by_layer or {}).get(name, 0)))
            continue
        impl = layer.impl
        specs.append(LayerSpec(index=i, name=name, num_heads=int(impl.num_heads), num_kv_heads=int(impl.num_kv_heads),
                               head_dim=int(impl.head_size), scale=float(impl.scale) * _fp8_terms(layer)[0],
                               group=(groups_by_layer or {}).get(name, 0), **_terms(impl),
                               chunk=int(getattr(layer, "attention_chunk_size", 0) or 0)))
    if log:
        if refused:
            logger.warning("attn-otel: not capturing %d layer(s) it cannot reproduce exactly: %s",
                           len(refused), ", ".join(refused[:8]) + (" ..." if len(refused) > 8 else ""))
        logger.info("attn-otel: capturing layers %s of %d", [s.index for s in specs], num_layers)
    return specs, {s.name: attn[s.name] for s in specs}


def _mla_spec(index: int, name: str, layer, group: int):
    """An MLA layer as the multi-query attention of vLLM's decode path (see ``LayerSpec.latent``): one KV head
    of the latent cache row's width, this rank's query heads, the layer's own softmax scale."""
    from .tap import LayerSpec

    L = int(layer.kv_lora_rank)
    return LayerSpec(index=index, name=name, num_heads=int(layer.num_heads), num_kv_heads=1,
                     head_dim=L + int(layer.qk_rope_head_dim), scale=float(layer.scale), group=group, latent=L)


def _layer_kinds(runner, specs) -> dict[str, str]:
    """Every attention-like layer of this rank's part of the model by layer number: what it is and whether it is
    captured (``attention``, ``mla``, with their terms), left out by ``ATTN_OTEL_LAYERS`` (``not selected``),
    or refused and why (a hybrid's linear or state-space layers among them).  Stored with every capture."""
    from vllm.model_executor.models.utils import extract_layer_index

    ctx = runner.vllm_config.compilation_config.static_forward_context
    attn = _attention_layers(ctx)
    total = _total_layers(runner, 1 << 30)
    kinds: dict[str, str] = {}
    for name, m in ctx.items():
        if not (hasattr(m, "impl") or "attn" in name):
            continue
        try:
            i = int(extract_layer_index(name))
        except Exception:  # noqa: BLE001 - not a numbered decoder layer
            continue
        if i >= total:  # EAGLE's and MTP's layers are numbered after the target model's own
            kinds[str(i)] = "not captured: the speculative decoding draft model's layer"
            continue
        if name not in attn:
            kinds[str(i)] = f"refused: not softmax attention ({type(m).__name__})"
            continue
        why = _refusal(m) or _fp8_terms(m)[1]
        kinds[str(i)] = f"refused: {why}" if why else ("mla" if _is_mla(m) else "attention") + " (not selected)"
    for s in specs:
        terms = [f"window {s.window}"] * bool(s.window) + [f"soft-cap {s.soft_cap:g}"] * bool(s.soft_cap)
        terms += [f"chunk {s.chunk}"] * bool(s.chunk)
        terms += ["sinks"] * (s.sinks is not None)
        terms += [f"KV-cache group {s.own_group}, tapped by attn-otel's own block table" if s.own_group >= 0
                  else f"KV-cache group {s.group}"]
        kinds[str(s.index)] = ("mla" if s.latent else "attention") + " (" + ", ".join(terms) + ")"
    return dict(sorted(kinds.items(), key=lambda kv: int(kv[0])))


def _total_layers(runner, fallback: int) -> int:
    """The whole model's layer count (under pipeline parallelism a rank holds only some of them)."""
    try:
        return int(runner.vllm_config.model_config.get_total_num_hidden_layers())
    except Exception:  # noqa: BLE001
        return fallback


def _parallel(runner, config, specs):
    """This rank's place in a tensor/pipeline-parallel model, or None on a single GPU."""
    from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank
    from vllm.distributed.utils import get_pp_indices

    from .tracking import Parallel
    from .config import resolve_layers

    pc = runner.vllm_config.parallel_config
    tp, pp = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
    if tp * pp == 1:
        return None
    total = _total_layers(runner, max(s.index for s in specs) + 1)
    stage_of = {}
    for stage in range(pp):
        start, end = get_pp_indices(total, stage, pp)
        stage_of.update({layer: stage for layer in range(start, end)})
    pp_rank = int(get_pp_group().rank_in_group) if pp > 1 else 0
    # Under pipeline parallelism no rank sees the other stages' layers: every rank captures the same
    # selection of the whole model (a layer a stage cannot capture stays empty in the capture, and listed).
    capture = tuple(s.index for s in specs) if pp == 1 else resolve_layers(config.layers, total)
    heads = max(s.num_heads for s in specs)
    par = Parallel(tp_rank=int(get_tensor_model_parallel_rank()), tp=tp, pp_rank=pp_rank, pp=pp,
                   total_heads=heads * tp, stage_of=stage_of, capture_layers=tuple(capture),
                   id_seed=str(getattr(runner.vllm_config, "instance_id", "") or ""))
    logger.info("attn-otel: tensor parallel rank %d/%d (heads %d-%d of %d), pipeline stage %d/%d (layers %s)",
                par.tp_rank, tp, par.tp_rank * heads, (par.tp_rank + 1) * heads - 1, par.total_heads, pp_rank, pp,
                [s.index for s in specs])
    return par


def _model_dtype(runner):
    return runner.vllm_config.model_config.dtype


def _cache_views(layer, spec, dtype):
    """``(kv_cache, key_cache, value_cache)``: the layer's bound cache tensor and ``[blocks, block_size, Hkv,
    D]`` views of its keys and values, or None where the layout is not one this knows (FLASH_ATTN's and
    TRITON_ATTN's, unquantised or per-tensor fp8, and MLA's latent rows)."""
    import torch

    kv = getattr(layer, "kv_cache", None)
    if isinstance(kv, (list, tuple)):
        kv = kv[0] if kv else None
    if not isinstance(kv, torch.Tensor):
        return None
    if spec.latent:  # MLA: (blocks, block_size, L + rope), one row [c_kv | k_pe] per token (every MLA backend)
        if kv.dtype != dtype or kv.dim() != 3 or kv.shape[2] != spec.head_dim or kv.stride(2) != 1:
            return None
        t = kv.unsqueeze(2)
        return kv, t, t[..., :spec.latent]
    cache_dtype = _kv_dtype(getattr(layer, "impl", None))
    if cache_dtype in _FP8 and kv.element_size() == 1:  # vLLM allocates fp8 caches as bytes
        kv = kv.view(_fp8_dtype(cache_dtype))
    elif kv.dtype != dtype:
        return None
    D, hkv = spec.head_dim, spec.num_kv_heads
    if kv.dim() == 4 and kv.shape[1] == hkv and kv.shape[3] == 2 * D:  # vLLM 0.26: (blocks, Hkv, bs, K|V)
        t = kv.transpose(1, 2)
        return kv, t[..., :D], t[..., D:]
    if kv.dim() == 5 and kv.shape[0] == 2 and kv.shape[3] == hkv and kv.shape[4] == D:  # (K|V, blocks, bs, Hkv, D)
        return kv, kv[0], kv[1]
    return None


def _key_cache_view(layer, spec, dtype):
    """``[blocks, block_size, Hkv, D]`` view of a layer's keys in vLLM's KV cache, or None (see
    :func:`_cache_views`)."""
    views = _cache_views(layer, spec, dtype)
    return views[1] if views is not None else None


_FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2")


def _fp8_dtype(cache_dtype: str):
    """The torch dtype of an fp8 cache format (``fp8`` and ``fp8_e4m3`` are e4m3)."""
    import torch

    return torch.float8_e5m2 if cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn


def _kv_dtype(impl) -> str:
    return str(getattr(impl, "kv_cache_dtype", "auto") or "auto")


def _flash_unquantised(impl) -> bool:
    """FLASH_ATTN with an unquantised KV cache: the layouts :func:`_fused_kv` writes."""
    return type(impl).__name__ == "FlashAttentionImpl" and _kv_dtype(impl) == "auto"


# vLLM 0.26's FLASH_ATTN and TRITON_ATTN keep one layout, (blocks, Hkv, block_size, K|V), and one fp8 scheme:
# the cache holds k / k_scale (per tensor), the query is quantised by q_scale where the backend takes fp8 queries.
_PAGED_IMPLS = ("FlashAttentionImpl", "TritonAttentionImpl")


def _flash_readable(impl) -> bool:
    """FLASH_ATTN or TRITON_ATTN with an unquantised or per-tensor fp8 KV cache: the layouts
    :func:`_cache_views` reads (TRITON_ATTN's per-token-head scales are not among them)."""
    return type(impl).__name__ in _PAGED_IMPLS and _kv_dtype(impl) in ("auto", *_FP8)


def _cache_readable(layer, device_type: str) -> bool:
    """Whether attn-otel reads the layer's keys (and values) from vLLM's cache: FLASH_ATTN or TRITON_ATTN on a
    GPU with an unquantised or fp8 cache, and MLA's latent cache on any device (its one layout)."""
    if _is_mla(layer):
        return True
    return device_type == "cuda" and _flash_readable(layer.impl)


def _keys_from_cache(layers: list, device_type: str) -> bool:
    """Whether streamed layers can read their keys from vLLM's cache (else they keep a K-only tap)."""
    return all(_cache_readable(layer, device_type) for layer in layers)


def _fp8_terms(layer) -> tuple[float, str | None]:
    """An fp8 KV cache's factor on the layer's scale, or a refusal.  The cache holds ``k / k_scale`` in fp8
    (and FLASH_ATTN or TRITON_ATTN get ``q / q_scale`` in fp8 too); the captures read those very values,
    exactly, and put ``q_scale * k_scale`` into the logits' scale, as the kernel's descaling does."""
    impl = layer.impl
    if _is_mla(layer) or _kv_dtype(impl) not in _FP8:  # MLA: refused with a quantised cache (_mla_refusal)
        return 1.0, None
    if not _flash_readable(impl):
        return 1.0, (f"{_kv_dtype(impl)} KV cache on {type(impl).__name__} (attn-otel reads per-tensor fp8 keys from "
                     "FLASH_ATTN's and TRITON_ATTN's cache)")
    if getattr(layer, "calculate_kv_scales", False):
        return 1.0, "fp8 KV cache with scales computed at run time (calculate_kv_scales)"
    for which in ("k", "v", "q"):  # compressed-tensors' attn_head strategy: one scale per KV head
        scale = getattr(layer, f"_{which}_scale", None)
        n = scale.numel() if hasattr(scale, "numel") else 1
        if n > 1:
            return 1.0, (f"fp8 KV cache with per-head scales ({which}_scale has {n} values; attn-otel applies "
                         "one scale per tensor)")
    factor = float(getattr(layer, "_k_scale_float", 1.0))
    if getattr(layer, "query_quant", None) is not None and getattr(impl, "supports_quant_query_input", False):
        factor *= float(getattr(layer, "_q_scale_float", 1.0))
    return factor, None


def _plan(runner, config, specs, layers, par=None, stream_local: bool | None = None):
    """Split the captured layers into map layers (Q/K tap) and streamed ones (attn_otel.stream): returns
    (map layers of the whole model, streamed specs, keys from vLLM's cache?, ring rows, direct rows' threshold
    or None: :func:`_ring_rows`).  ``stream_local``:
    whether windowed and chunked layers are streamed (None: as the KV-budget sizing chose for this runner,
    ``_scale_available_memory``; streamed where it did not run)."""
    from .config import resolve_map_layers

    captured = par.capture_layers if par is not None else tuple(s.index for s in specs)
    maps = resolve_map_layers(config.map_layers, captured)
    # Every layer is streamed (metrics for every request while it runs, its window, chunks, soft-cap and
    # learned sinks in the stream's kernels) but windowed or chunked layers of a model with no full-attention
    # group, tapped by attn-otel's own block table (attn_otel.shadow): those keep the Q/K tap (and so have maps).
    # A windowed layer whose group vLLM frees out of the window streams with a K-only tap by a full-attention
    # group's slots (see _window_groups), never reading its own freed blocks.  The map layers among the streamed
    # ones also keep the queries of the requests planned for maps (attn_otel.tap.MapTap).  (Under pipeline
    # parallelism only this stage's own-table layers are known here.)
    if stream_local is None:  # the install
        stream_local = getattr(runner, "_attn_otel_local_streamed", True)
    # Where the KV budget is small, the ring of streamed windowed layers can cost more than their Q/K tap: then
    # they keep the tap (the sizing compares both, bench/kv_capacity.py shows where).
    own = {s.index for s in specs if s.own_group >= 0 or (s.local and not stream_local)}
    if own - set(maps):
        maps = type(maps)(sorted(set(maps) | own))
    streamed = [s for s in specs if s.index not in own]
    if streamed:
        first = streamed[0]
        shape = (first.num_heads, first.num_kv_heads, first.head_dim, first.group)
        odd = [s for s in streamed if (s.num_heads, s.num_kv_heads, s.head_dim, s.group) != shape]
        if odd:
            logger.warning("attn-otel: layers %s differ in shape or KV-cache group from layer %d; they keep the "
                           "Q/K tap", [s.index for s in odd], first.index)
            streamed = [s for s in streamed if s not in odd]
    from_cache = bool(streamed) and _keys_from_cache([layers[s.name] for s in streamed], runner.device.type)
    rows, direct = _ring_rows(runner, config, streamed)
    return maps, streamed, from_cache, rows, direct


def _ring_rows(runner, config, streamed, available: int | None = None) -> tuple[int, int | None]:
    """The query ring's rows and the direct rows' threshold (:func:`_direct_min`; None: off): one step's ring
    tokens always fit, every token of the step, or with direct rows its decode tokens.  ``auto``: on where their
    kernels go beside the forward (ATTN_OTEL_DIRECT_STREAM=side); on vLLM's stream it weighs the ring saved against
    ``available``, the KV budget vLLM computed (by default the one the start-up sizing saw)."""
    from .config import DIRECT_AUTO_BYTES, DIRECT_AUTO_SHARE
    from .stream import DEFAULT_ROWS, MetricsStream

    sched = runner.vllm_config.scheduler_config
    plain = max(config.stream_rows or DEFAULT_ROWS, int(sched.max_num_batched_tokens))
    direct = _direct_min(runner, config) if streamed else None
    if direct is None:
        return plain, None
    rows = max(config.stream_rows or DEFAULT_ROWS, int(sched.max_num_seqs) * direct)
    if config.stream_direct == "auto" and config.direct_stream != "side":  # beside the forward: on (run 47)
        dtype = _model_dtype(runner)
        saved = MetricsStream.ring_bytes(streamed, plain, dtype) - MetricsStream.ring_bytes(streamed, rows, dtype)
        budget = available if available is not None else getattr(runner, "_attn_otel_kv_available", None)
        if saved < (DIRECT_AUTO_SHARE * budget if budget else DIRECT_AUTO_BYTES):
            return plain, None
    return rows, direct


def _direct_min(runner, config) -> int | None:
    """The tokens of a decode step's chunk (1, or 1 + the speculative tokens), beyond which a chunk's rows are
    computed in the forward (ATTN_OTEL_STREAM_DIRECT); None where off, or where a forward with a prefill chunk
    may run as one CUDA graph (cudagraph mode FULL for mixed batches), whose taps cannot take a step's plan."""
    if config.stream_direct == "0":
        return None
    vc = runner.vllm_config
    try:
        mode = vc.compilation_config.cudagraph_mode
        if mode is not None and mode.mixed_mode().name == "FULL":
            return None
    except Exception:  # noqa: BLE001  (a build without cudagraph modes: eager)
        pass
    spec = getattr(vc, "speculative_config", None)
    return 1 + int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 1


def _graphed_tokens(runner) -> int:
    """The most tokens a forward vLLM replays as CUDA graphs has (its largest captured size); 0 where it
    captures none (enforce_eager, cudagraph mode NONE) or where unknown."""
    try:
        cc = runner.vllm_config.compilation_config
        mode = cc.cudagraph_mode
        if mode is None or mode.name == "NONE":
            return 0
        sizes = cc.cudagraph_capture_sizes or []
        return int(cc.max_cudagraph_capture_size or max(sizes, default=0))
    except Exception:  # noqa: BLE001
        return 0


def _takes_images(runner) -> bool:
    """Whether the served model takes images (else the stream keeps no vision rows per token); True where
    unknown."""
    try:
        return bool(runner.vllm_config.model_config.is_multimodal_model)
    except Exception:  # noqa: BLE001
        return True


def _map_tap_rows(config) -> int:
    return int(config.map_tap_tokens or config.max_map_tokens)


# --------------------------------------------------------------------------------- hooks
def _scale_available_memory(orig, worker, *args, **kwargs):
    """Give the tap its share of the KV budget: KV tokens shrink by kv/(kv + tap) per token."""
    available = orig(worker, *args, **kwargs)
    try:
        from .tap import kv_budget
        from .config import Config

        runner = worker.model_runner
        config = Config.from_env()
        specs, layers = _layer_specs(runner, config)
        if not specs:
            return available
        kv_per_token = 0
        for spec in runner.get_kv_cache_spec().values():
            kv_per_token += spec.page_size_bytes / spec.block_size
        dtype = _model_dtype(runner)
        runner._attn_otel_kv_available = int(available)  # ATTN_OTEL_STREAM_DIRECT=auto weighs the ring against it
        maps, streamed, from_cache, rows, _ = _plan(runner, config, specs, layers, _parallel(runner, config, specs),
                                                    stream_local=True)
        cache_config = getattr(getattr(runner, "vllm_config", None), "cache_config", None)
        block_size = int(getattr(cache_config, "block_size", None) or 16)  # the spill blocks' (attn_otel.spill)
        b = kv_budget(available, kv_per_token, specs, maps, streamed, from_cache, rows, dtype, _takes_images(runner),
                      _map_tap_rows(config), block_size)
        runner._attn_otel_local_streamed = b.local_streamed  # the install plans the same way (_plan)
        logger.info("attn-otel: capture takes %d B per token beside %d B of KV cache (%d layers with a Q/K tap, "
                    "%d streamed with a %d-row query ring, %d of them map layers, ring and map tap %.2f GiB); KV "
                    "budget %.2f -> %.2f GiB", b.per_token, int(kv_per_token), len(b.tapped), len(b.streamed),
                    rows if b.streamed else 0, len(b.mapped), b.fixed / 2**30, available / 2**30,
                    b.kv_bytes / 2**30)
        return b.kv_bytes
    except Exception:  # noqa: BLE001
        logger.exception("attn-otel: could not size the tap; leaving the KV budget unchanged")
        return available


def _after_initialize_kv_cache(orig, runner, kv_cache_config, *args, **kwargs):
    result = orig(runner, kv_cache_config, *args, **kwargs)
    if kwargs.get("is_profiling") or (args and args[0] is True):
        return result
    try:
        _install(runner, kv_cache_config)
    except Exception:  # noqa: BLE001
        logger.exception("attn-otel: could not set up capture on this worker; serving without it")
    return result


def _install(runner, kv_cache_config) -> None:
    import vllm

    from .capture import CaptureEngine
    from .tracking import RequestTracker, model_name
    from . import triton_metrics
    from .config import Config

    config = Config.from_env()
    triton_metrics.bound_launch(config.launch)
    groups_by_layer = {}
    block_sizes = []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        block_sizes.append(int(group.kv_cache_spec.block_size))
        for name in group.layer_names:
            groups_by_layer[name] = g
    specs, layers = _layer_specs(runner, config, groups_by_layer, log=True)
    specs, refused = _window_groups(specs, kv_cache_config)
    if refused:
        logger.warning("attn-otel: not capturing %d layer(s) it cannot reproduce exactly: %s", len(refused),
                       ", ".join(refused[:8]) + (" ..." if len(refused) > 8 else ""))
        layers = {s.name: layers[s.name] for s in specs}
        logger.info("attn-otel: capturing layers %s after those", [s.index for s in specs])
    shadowed = [s for s in specs if s.own_group >= 0]
    if shadowed:
        block_sizes.append(block_sizes[shadowed[0].own_group])  # attn-otel's own block table, one group more
        logger.info("attn-otel: windowed layers %s tap by attn-otel's own block table: no full-attention group "
                    "keeps their positions (vLLM frees blocks out of the window while a request runs)",
                    [s.index for s in shadowed])
    windowed = [s.index for s in specs if s.slots_from and s.own_group < 0]
    if windowed:
        logger.info("attn-otel: windowed layers %s tap by the slots of full-attention layer %s (their own KV "
                    "blocks are freed out of the window)", windowed, specs[[s.index for s in specs].index(
                        windowed[0])].slots_from)
    if not specs:
        logger.warning("attn-otel: no layer of this model can be captured; capture is off")
        return
    num_slots = kv_cache_config.num_blocks * max(block_sizes[s.group] for s in specs)
    mc = runner.vllm_config.model_config
    model = model_name(getattr(mc, "served_model_name", None), mc.model)
    backend = type(layers[specs[0].name].impl).__name__
    par = _parallel(runner, config, specs)
    dtype = _model_dtype(runner)
    maps, streamed, from_cache, rows, direct_min = _plan(runner, config, specs, layers, par)
    stream = None
    if streamed:
        from .spill import spill_slots
        from .stream import MetricsStream

        keys = {}
        if from_cache:
            for s in streamed:
                if s.slots_from:  # a windowed layer: its own blocks are freed while the request runs
                    continue
                view = _key_cache_view(layers[s.name], s, dtype)
                if view is None:
                    logger.warning("attn-otel: the KV cache of %s has a layout this does not know; its keys are "
                                   "tapped", s.name)
                else:
                    keys[s.index] = view
        # spill blocks where a capture reads only streamed rows, so finished requests can wait for a batch
        spill = (spill_slots(block_sizes[streamed[0].group])
                 if config.finish_batch_steps > 0 and len(streamed) == len(specs) and not shadowed else 0)
        stream = MetricsStream(streamed, num_slots, rows, dtype, runner.device, block_sizes[streamed[0].group],
                               config.sink_tokens, keys, vision=_takes_images(runner), spill_slots=spill)
        stream.defer_flush = config.after_launch  # its flush at half the ring after the forward's launch
        stream.flush_keys = config.flush_keys  # slots or blocks to the flush kernel (ATTN_OTEL_FLUSH_KEYS)
        stream.direct.min = direct_min  # prefill chunks' rows in the forward (None: every token through the ring)
        stream.direct.beside = config.direct_stream == "side"  # on the side stream (ATTN_OTEL_DIRECT_STREAM)
        stream.direct.uncaptured = _uncaptured_forward  # (not in a PIECEWISE replay)
        stream.direct.graphed = min(_graphed_tokens(runner), rows)  # steps replayed as graphs: through the ring
        logger.info("attn-otel: map layers %s (Q/K tap); %d layers streamed (query ring of %d rows, %.1f MiB in "
                    "all, keys %s)", [s.index for s in specs if s not in streamed], len(streamed), rows,
                    stream.nbytes() / 2**20, "read from the KV cache" if len(keys) == len(streamed) else "tapped")
    engine = CaptureEngine(config, specs, num_slots, dtype, runner.device,
                           model=model, engine_version=f"vllm {vllm.__version__}",
                           attrs={"attention_impl": backend, "layer_kinds": _layer_kinds(runner, specs)}, parallel=par, stream=stream, map_layers=maps,
                           map_tap_rows=_map_tap_rows(config), block_sizes=block_sizes)
    engine.tracker = RequestTracker()
    engine.deferred = DeferredFinish(config.finish_batch_steps, config.finish_batch_requests,
                                     config.finish_batch_chunk)
    engine.after_launch = None  # (ids, records) of a finish batch left for after the forward's launch
    engine.shadow = None
    engine.steady = None
    if shadowed:
        from .shadow import ShadowBlocks

        own = sorted({s.own_group for s in shadowed})
        engine.shadow = ShadowBlocks(shadowed[0].group, num_slots, block_sizes[-1],
                                     {g: kv_cache_config.num_blocks * block_sizes[g] for g in own}, runner.device)
    elif config.steady:  # (attn-otel's own block table of windowed layers follows every request's every step)
        from .steady import Steady

        engine.steady = Steady(math.gcd(*block_sizes) if block_sizes else 16)
        if stream is not None:
            stream.steady = engine.steady
    if config.verify and engine.maptap is not None:
        for s in (*engine.maptap.layers.values(), *engine.maptap.checked.values()):
            layer = layers[s.name]
            # values from vLLM's cache where it is read by this layer's own slots (a windowed layer tapped by a
            # full group's slots keeps its value rows from the forward instead)
            views = _cache_views(layer, s, dtype) if (
                _cache_readable(layer, runner.device.type) and not s.slots_from) else None
            scale = float(getattr(layer, "_v_scale_float", 1.0)) if _kv_dtype(layer.impl) in _FP8 else 1.0
            if s.latent:  # MLA: maps x c_kv, up-projected by the layer's W_UV, against its output
                engine.maptap.verify(s.index, int(layer.v_head_dim), (views[2], 1.0) if views is not None else None,
                                     v_up=layer.W_UV)
            else:
                engine.maptap.verify(s.index, int(getattr(layer, "head_size_v", s.head_dim)),
                                     (views[2], scale) if views is not None else None)
        logger.info("attn-otel: ATTN_OTEL_VERIFY=1: maps captures check maps x V against the attention output "
                    "(values %s)", "read from vLLM's cache" if engine.maptap.values else "kept from the forward")
    runner._attn_otel = engine
    fused = sum(_tap_layer(engine, spec, layers[spec.name]) for spec in specs)
    engine.fused_kv_layers = fused
    _ENGINES.append(engine)
    engine.warm_up()
    logger.info("attn-otel: tap of %.1f MiB for %d slots; store %s; keys and values written with the queries "
                "(one launch) on %d of %d captured layers", engine.tap.nbytes() / 2**20, num_slots, config.store,
                fused, len(specs))


def _fused_kv(layer, spec, dtype, device):
    """``(kv_cache, key_cache, value_cache)`` where attn-otel can write the layer's keys and values itself,
    in the launch that keeps its queries (``ATTN_OTEL_KV_WRITE=fused``), else None: FLASH_ATTN decoder
    attention with an unquantised cache of its own, whose write vLLM does in ``impl.do_kv_cache_update``
    (not inside the attention kernel), with a cache layout this knows, on a device with Triton."""
    import torch

    from . import triton_metrics

    impl = layer.impl
    if (not _flash_unquantised(impl) or not callable(getattr(impl, "do_kv_cache_update", None))
            or getattr(impl, "attn_type", "decoder") != "decoder"
            or getattr(layer, "kv_sharing_target_layer_name", None) is not None
            or getattr(getattr(layer, "attn_backend", None), "forward_includes_kv_cache_update", True)
            or getattr(layer, "head_size_v", spec.head_dim) != spec.head_dim
            or not triton_metrics.available(torch.device(device))):
        return None
    return _cache_views(layer, spec, dtype)


def _tap_layer(engine, spec, layer) -> bool:
    """Wrap the layer's ``impl.forward`` so that each forward keeps its queries (and keys) for capture; with
    ``ATTN_OTEL_KV_WRITE=fused`` where :func:`_fused_kv` allows it, that same launch also writes the layer's
    keys and values to vLLM's cache: ``impl.do_kv_cache_update`` (which vLLM calls just before the forward,
    and only when it has a write to make) then leaves its write to the forward.  Whatever fails, the cache
    is written exactly when and where vLLM would have written it: by the fused launch, or else by vLLM's own
    update from the forward.  True where the layer's K/V write is fused."""
    from vllm.forward_context import get_forward_context

    if spec.latent:
        return _tap_mla_layer(engine, spec, layer)
    impl = layer.impl
    orig = impl.forward
    if getattr(orig, "_attn_otel", False):
        return False
    tap, index, name = engine.tap, spec.index, spec.name
    # a windowed layer may tap by a full-attention layer's slots, or by attn-otel's own block table
    shadow = engine.shadow if spec.own_group >= 0 else None
    slots_name = name if shadow is not None else spec.slots_from or name
    if spec.index in engine.streamed:
        tap = engine.stream
    maptap = engine.maptap if engine.maptap is not None and (
        index in engine.maptap.layers or index in engine.maptap.checked) else None
    fused = None
    if engine.config.kv_write == "fused" and not spec.slots_from and not (
            spec.index in engine.streamed and spec.index in tap.k_tap):
        try:
            fused = _fused_kv(layer, spec, engine.tap.dtype, engine.device)
        except Exception:  # noqa: BLE001
            fused = None
    kv_own, views = (fused[0], fused[1:]) if fused is not None else (None, None)
    orig_update = impl.do_kv_cache_update if fused is not None else None
    owed: list = []  # the arguments of a do_kv_cache_update that left its write to the forward

    checked = maptap is not None and index in maptap.out
    direct = tap is engine.stream  # a streamed layer: a step's prefill rows are computed after its attention
    # where this tap keeps the layer's keys itself (not read from vLLM's cache): an fp8 cache's values of them
    keeps_keys = spec.index not in engine.streamed or spec.index in engine.stream.k_tap
    quantise = _fp8_rounding(layer, engine.tap.dtype, "k") if keeps_keys else None
    values = _fp8_rounding(layer, engine.tap.dtype, "v") if maptap is not None and index in maptap.v else None

    def forward(layer_, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        update = owed.pop() if owed else None
        wrote = False
        slot_mapping = None
        if attn_metadata is not None and key is not None:
            try:
                if update is not None:
                    slot_mapping = update[4]
                else:
                    slots = get_forward_context().slot_mapping
                    if isinstance(slots, list):
                        slots = slots[0]
                    slot_mapping = slots.get(slots_name) if isinstance(slots, dict) else None
                    if slot_mapping is None and (not spec.slots_from or shadow is not None):
                        slot_mapping = getattr(attn_metadata, "slot_mapping", None)
                    elif slot_mapping is None:  # never the window group's own slots (freed blocks)
                        engine.warn_once("tap-slots", "no slot mapping of %s for windowed layer %s: its "
                                         "captures will be wrong", slots_name, name)
                    if slot_mapping is not None and shadow is not None:
                        slot_mapping = shadow.map(slot_mapping, spec.own_group)
                if slot_mapping is not None:
                    q = query
                    if q.element_size() == 1:  # fp8-quantised query: its values, exactly (q_scale is in
                        q = q.to(engine.tap.dtype)  # the layer's scale, see _fp8_terms)
                    kv = (update[1], update[2], *views) if update is not None else None
                    k = key if quantise is None else quantise(key)  # what an fp8 cache holds
                    wrote = tap.write(index, q, k, slot_mapping, kv=kv)
                    if maptap is not None:
                        maptap.write(index, q, slot_mapping, value if values is None else values(value))
            except Exception:  # noqa: BLE001
                engine.warn_once("tap", "Q/K tap of %s failed; its captures will be wrong or dropped", name,
                                 exc=True)
        if update is not None and not wrote:  # vLLM's own write, before the attention reads the cache
            orig_update(*update)
        result = orig(layer_, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
        if direct and slot_mapping is not None:
            _direct_rows(engine, tap, index, name)
        if checked and attn_metadata is not None and slot_mapping is not None:
            _keep_output(engine, maptap, spec, result, args, kwargs, slot_mapping)
        return result

    forward._attn_otel = True  # type: ignore[attr-defined]
    impl.forward = forward
    if fused is None:
        return False

    def do_kv_cache_update(layer_, key, value, kv_cache, slot_mapping):
        if kv_cache is kv_own and key is not None and value is not None:
            owed.clear()
            owed.append((layer_, key, value, kv_cache, slot_mapping))
            return None  # the forward writes K and V, in the launch that keeps the queries
        return orig_update(layer_, key, value, kv_cache, slot_mapping)

    do_kv_cache_update._attn_otel = True  # type: ignore[attr-defined]
    impl.do_kv_cache_update = do_kv_cache_update
    return True


def _fp8_rounding(layer, dtype, which: str = "k"):
    """For a layer with an fp8 KV cache, a function giving its keys (``which="k"``) as the cache holds them,
    ``k / k_scale`` rounded to the cache's fp8 format (saturating, as vLLM's cache write does) and widened to
    ``dtype`` (exactly; the layer's scale carries ``k_scale``, :func:`_fp8_terms`), or its values
    (``which="v"``) as the kernel's P V reads them, rounded so and multiplied back by ``v_scale``.  None for
    other caches.  Used where attn-otel keeps keys or values from the forward rather than reading vLLM's cache
    (windowed, soft-capped and sink layers; ATTN_OTEL_VERIFY's value rows)."""
    import torch

    cache_dtype = _kv_dtype(getattr(layer, "impl", None))
    scale = getattr(layer, f"_{which}_scale", None)
    if cache_dtype not in _FP8 or _is_mla(layer) or not isinstance(scale, torch.Tensor):
        return None
    f8 = _fp8_dtype(cache_dtype)
    big = float(torch.finfo(f8).max)

    def rounded(x):
        r = (x.float() / scale).clamp(-big, big).to(f8)
        return (r.to(dtype) if which == "k" else (r.float() * scale).to(dtype))

    return rounded


def _keep_output(engine, maptap, spec, result, args, kwargs, slot_mapping) -> None:
    """ATTN_OTEL_VERIFY, after a wrapped attention call (graph-safe): its output as the backend computed it
    (the ``output`` argument, else the return value), the planned requests' rows into the map pool."""
    try:
        out = kwargs.get("output", args[0] if args else None)
        out = result if out is None else out
        maptap.write_out(spec.index, out.view(out.shape[0], spec.num_heads, -1), slot_mapping)
    except Exception:  # noqa: BLE001
        engine.warn_once("verify", "keeping the attention output of %s failed", spec.name, exc=True)


def _direct_rows(engine, stream, index: int, name: str) -> None:
    """A streamed layer's direct rows of this forward (attn_otel.direct.DirectRows.run), after its
    attention: its keys are in the cache then.  Never raises."""
    try:
        stream.direct.run(index)
    except Exception:  # noqa: BLE001
        engine.warn_once("direct", "direct rows of %s failed; its captures will be wrong or dropped", name,
                         exc=True)


def _uncaptured_forward() -> bool:
    """Whether this forward runs with no CUDA graph (vLLM's cudagraph runtime mode NONE: a batch larger than the
    graphs captured, or eager).  In a PIECEWISE replay the queries an attention call gets are a graph's output, in
    the graphs' own memory pool, which the next piece's replay writes over without torch's allocator knowing: a
    kernel that reads them later, on another stream, would read what that piece wrote.  False where unknown."""
    try:
        from vllm.forward_context import get_forward_context

        return getattr(get_forward_context().cudagraph_runtime_mode, "name", None) == "NONE"
    except Exception:  # noqa: BLE001
        return False


def _tap_mla_layer(engine, spec, layer) -> bool:
    """Wrap an MLA layer's ``forward_impl`` (what vLLM's attention op calls, after its latent-cache write) so
    that each forward keeps its queries, absorbed as vLLM's decode path absorbs them: ``[q_nope W_UK^T | q_pe]``
    per head, one ``[L + rope]`` row to score against the latent cache row ``[c_kv | k_pe]`` (prefill runs the
    same scores un-absorbed, as ``q_nope . (W_UK c_kv) + q_pe . k_pe``).  The keys and values stay in vLLM's
    latent cache; a CPU build without a cache view keeps them in the taps.  Never the KV-cache write (False)."""
    import torch
    from vllm.forward_context import get_forward_context

    orig = layer.forward_impl
    if getattr(orig, "_attn_otel", False):
        return False
    index, name, P, L = spec.index, spec.name, int(layer.qk_nope_head_dim), spec.latent
    tap = engine.stream if spec.index in engine.streamed else engine.tap
    maptap = engine.maptap if engine.maptap is not None and index in engine.maptap.layers else None
    checked = maptap is not None and index in maptap.out
    keyed = tap is not engine.stream or index in tap.k_tap  # keys kept by attn-otel, not read from vLLM's cache
    w_uk_t = layer.W_UK_T  # [Hq, P, L]

    def forward_impl(q, k_c_normed, k_pe, kv_cache, attn_metadata, *args, **kwargs):
        slot_mapping = None
        if attn_metadata is not None:
            try:
                slots = get_forward_context().slot_mapping
                if isinstance(slots, list):
                    slots = slots[0]
                slot_mapping = slots.get(name) if isinstance(slots, dict) else None
                if slot_mapping is None:
                    slot_mapping = getattr(attn_metadata, "slot_mapping", None)
                if slot_mapping is not None:
                    n = slot_mapping.shape[0]
                    qn = q[:n]
                    qa = torch.cat([torch.bmm(qn[..., :P].transpose(0, 1), w_uk_t).transpose(0, 1), qn[..., P:]], -1)
                    key = (torch.cat([k_c_normed[:n], k_pe[:n].reshape(n, -1)], -1).unsqueeze(1) if keyed
                           else None)
                    tap.write(index, qa, key, slot_mapping)
                    if maptap is not None:
                        maptap.write(index, qa, slot_mapping, k_c_normed[:n].unsqueeze(1))
            except Exception:  # noqa: BLE001
                engine.warn_once("tap", "query tap of MLA layer %s failed; its captures will be wrong or dropped",
                                 name, exc=True)
        result = orig(q, k_c_normed, k_pe, kv_cache, attn_metadata, *args, **kwargs)
        if tap is engine.stream and slot_mapping is not None:
            _direct_rows(engine, tap, index, name)
        if checked and attn_metadata is not None and slot_mapping is not None:  # MLA: the output after W_UV
            _keep_output(engine, maptap, spec, result, args, kwargs, slot_mapping)
        return result

    forward_impl._attn_otel = True  # type: ignore[attr-defined]
    layer.forward_impl = forward_impl
    return False


def _vision_positions(new_req):
    """Image-embedding token positions of a new request (``PlaceholderRange.is_embed``, not offset+length)."""
    from .attention import vision_mask

    ranges = []
    for f in getattr(new_req, "mm_features", None) or []:
        if getattr(f, "modality", None) == "image":
            pr = f.mm_position
            ranges.append((pr.offset, pr.length, None if pr.is_embed is None else pr.is_embed.cpu().numpy()))
    return vision_mask(ranges) if ranges else None


def _output_tokens(runner, req_ids: list[str]) -> list[tuple[list[int] | None, object]]:
    """Per finished request: (host list of its generated ids, or None; a device tensor of all its ids, or
    None).  On the V2 runner the ids live on the device: one gather for all of the step's requests, enqueued
    before this step can give their rows to new requests."""
    state = getattr(runner, "requests", None)
    if isinstance(state, dict):  # V1 runner: host-side request state
        return [(list(state[r].output_token_ids), None) if r in state else (None, None) for r in req_ids]
    rs = getattr(runner, "req_states", None)  # V2 runner: token ids live on the device
    if rs is None:
        return [(None, None)] * len(req_ids)
    index = [rs.req_id_to_index.get(r) for r in req_ids]
    have = [i for i in index if i is not None]
    if not have:
        return [(None, None)] * len(req_ids)
    import numpy as np

    from .slots import upload

    src = rs.all_token_ids.gpu
    rows = iter(src.index_select(0, upload(np.asarray(have, dtype=np.int64), src.device)))  # a row each
    return [(None, None) if i is None else (None, next(rows)) for i in index]


def _before_step(orig, runner, scheduler_output, *args, **kwargs):
    engine = getattr(runner, "_attn_otel", None)
    if engine is not None:
        t0 = time.perf_counter()
        _step_interval(engine, scheduler_output, t0)
        try:
            _track(runner, engine, scheduler_output, t0)
        except Exception:  # noqa: BLE001
            engine.stats.add("dropped", reason="capture_error")
            engine.warn_once("track", "could not follow this step's requests", exc=True)
            steady = getattr(engine, "steady", None)
            if steady is not None and steady.due:  # its members took this step's token all the same
                steady.bump()
        dt = time.perf_counter() - t0
        engine.stats.step_times.append(dt)
        engine.step_own += dt
    return orig(runner, scheduler_output, *args, **kwargs)


def _step_interval(engine, so, t0: float) -> None:
    """The interval from the last step's start to this one's, with attn-otel's own host time in it (stats:
    ``step_intervals``), where the last step ran tokens and this one runs a request that was running before it
    (so the loop did not wait for requests between: after the last request of a burst finishes, the next step
    runs new requests only, and its interval holds the idle wait; run 33 counted a 10 s one)."""
    last = getattr(engine, "step_start", None)
    cached = getattr(getattr(so, "scheduled_cached_reqs", None), "req_ids", None)
    if last is not None and engine.step_ran and cached:
        engine.stats.step_intervals.append((t0 - last, engine.step_own))
    total = getattr(so, "total_num_scheduled_tokens", None)
    engine.step_start, engine.step_own, engine.step_ran = t0, 0.0, bool(total)


def _after_launch(orig, runner, *args, **kwargs):
    """vLLM's step (its forward launched, the device running it), then the capture work that forward does not
    wait for, left by :func:`_track` (ATTN_OTEL_AFTER_LAUNCH): the engine loop does it while the device runs
    the forward, instead of before the launch.  With ``sample`` or ``output`` it waits for the step's
    ``sample_tokens`` (which vLLM calls next where this left ``execute_model_state``), so that the sampler's
    launch does not wait for it."""
    try:
        return orig(runner, *args, **kwargs)
    finally:
        engine = getattr(runner, "_attn_otel", None)
        if engine is not None and not _later(engine, runner):
            _run_after_launch(engine, "execute")


def _later(engine, runner) -> bool:
    """Whether this step's work after the launch waits past ``execute_model``: for the engine core's
    ``post_step`` (``output``, where it runs in this process: it follows every step), or for ``sample_tokens``
    (``sample``, or ``output`` without it here), which vLLM calls next only where execute_model left state
    for it."""
    if _at_post_step(engine):
        return True
    return engine.config.after_launch_at != "execute" and getattr(runner, "execute_model_state", None) is not None


def _at_post_step(engine) -> bool:
    """``output``, with vLLM's engine core stepping in this process: :func:`_after_output` runs the work."""
    return engine.config.after_launch_at == "output" and _ENGINE_CORE_HERE[0]


def _after_sample(orig, runner, *args, **kwargs):
    """vLLM's ``sample_tokens`` (the step's sampler enqueued), then the work after the launch where it waits for
    this (``sample``; ``output`` where no engine core of this process takes it, as in a multiprocess worker)."""
    try:
        return orig(runner, *args, **kwargs)
    finally:
        engine = getattr(runner, "_attn_otel", None)
        if engine is not None and not _at_post_step(engine):
            _run_after_launch(engine, "sample")


_ENGINE_CORE_HERE = [False]  # vLLM's engine core steps in this process (EngineCore.post_step was seen)


def _after_output(orig, core, *args, **kwargs):
    """``EngineCore.post_step``: the step's output is taken (the front end has it, or will as the output thread
    sends it), then, with ``ATTN_OTEL_AFTER_LAUNCH=output``, the work after the launch of every capture engine
    of this process: it then delays neither the forward nor the step's tokens, only the next step's
    scheduling, while the device runs the step just launched."""
    try:
        return orig(core, *args, **kwargs)
    finally:
        _ENGINE_CORE_HERE[0] = True
        for engine in list(_ENGINES):
            if engine.config.after_launch_at == "output":
                _run_after_launch(engine, "output")


def _run_after_launch(engine, where: str) -> None:
    """The stream's flush at half the ring and the finish batch :func:`_track` left (if any).  Never raises."""
    stream, work = engine.stream, getattr(engine, "after_launch", None)
    if work is None and (stream is None or not stream.flush_due):
        return
    engine.stats.add("after_launch_at", reason=where)
    t0 = time.perf_counter()
    try:
        if stream is not None:
            stream.after_launch()
        if work is not None:
            engine.after_launch = None
            _timed_finish_batch(engine, *work)
    except Exception:  # noqa: BLE001
        engine.stats.add("dropped", reason="capture_error")
        engine.warn_once("after-launch", "capture work after the forward's launch failed", exc=True)
    finally:
        dt = time.perf_counter() - t0
        engine.stats.step_parts["after_launch"] += dt
        engine.step_own = getattr(engine, "step_own", 0.0) + dt


def _track(runner, engine, so, t0: float) -> None:
    from .tracking import FinishedRequest

    parts = engine.stats.step_parts  # engine-loop time by part (only this thread writes it)
    if getattr(engine, "after_launch", None) is not None:  # left by a step whose forward never returned here
        _run_after_launch(engine, "next_step")

    tracker = engine.tracker
    stream = engine.stream
    side = engine.side
    steady = getattr(engine, "steady", None)
    done = []
    for req_id in so.finished_req_ids:
        if steady is not None:
            steady.leave(req_id)
        if req_id.startswith("_") and "warmup" in req_id:  # vLLM's own start-up warm-up batches
            tracker.finish(req_id)
            continue
        t = tracker.finish(req_id)
        if t is None or t.written <= 0:
            continue
        done.append((req_id, t))
    reasons = getattr(so, _REASONS, None) or {}  # see _patch_scheduler
    lengths = getattr(so, _LENGTHS, None) or {}  # speculative decoding: drafts run past the end are not the request's
    # token ids only where they are stored (ATTN_OTEL_STORE_TOKENS): no gather of them otherwise
    tokens = (_output_tokens(runner, [r for r, _ in done]) if engine.config.store_tokens
              else [(None, None)] * len(done))
    from_scheduler = getattr(so, _OUTPUTS, None) or {}  # the scheduler's own ids win (see _OUTPUTS)
    tokens = [(from_scheduler[r], None) if r in from_scheduler else tok for (r, _), tok in zip(done, tokens)]
    # token ids copied on the engine's stream (the runner reuses their rows); the rest on the side stream
    finished = [FinishedRequest(
        request_id=str(req_id), prompt_token_ids=t.prompt_token_ids, output_token_ids=outputs,
        num_tokens=min(t.written, lengths[req_id] - 1) if req_id in lengths else t.written, block_ids=t.block_ids, block_sizes=engine.block_sizes, extra_args=t.extra_args,
        vision_positions=t.vision_positions, token_ids_device=device_ids, finish_reason=reasons.get(req_id))
        for (req_id, t), (outputs, device_ids) in zip(done, tokens)]
    preempted = list(getattr(so, "preempted_req_ids", None) or ())
    maptap, shadow = engine.maptap, engine.shadow
    if steady is not None:
        for req_id in preempted:
            steady.leave(req_id)
    if stream is not None:  # before this step's forward can reuse their blocks: their rows are computed now
        stream.preempt(preempted)
    if maptap is not None:
        maptap.preempt(preempted)
    if preempted:  # their blocks go back to vLLM: a forward that writes one waits for the work reading them
        seq = side.mark()
        for req_id in preempted:
            t = tracker.get(req_id)
            if t is not None:
                side.taken_back(t.block_ids, seq)
    deferred = engine.deferred
    spilling = stream is not None and stream.spill is not None and bool(done)
    t1 = time.perf_counter()
    parts["finished_rows"] += t1 - t0
    scheduled = so.num_scheduled_tokens
    items = []
    fresh: list = []  # blocks this step's requests may write that no earlier step gave them (see deferred.py)
    # (with requests held or finishing only: the loops below run for every request of every step)
    holding = len(deferred) > 0 or bool(finished)
    for new in so.scheduled_new_reqs:
        sp = new.sampling_params
        n = scheduled.get(new.req_id, 0)
        t = tracker.add(new.req_id, new.prompt_token_ids, getattr(sp, "extra_args", None) if sp else None,
                        new.block_ids, new.num_computed_tokens, n, _vision_positions(new))
        items.append((new.req_id, t, int(new.num_computed_tokens), n))
        if holding:
            fresh.extend(b[int(new.num_computed_tokens) // bs:] for b, bs in zip(new.block_ids, engine.block_sizes))
    cached = so.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", None) or set()
    update, new_blocks, computed = tracker.update, cached.new_block_ids, cached.num_computed_tokens
    ids = cached.req_ids
    crossed_writes = None  # the blocks the step counter's members start this step (_steady_cross), to guard
    total = getattr(so, "total_num_scheduled_tokens", None)  # every token of the forward, captured or not
    if steady is not None:  # the requests that take a token into a block they hold are counted at once, below
        ones = total is not None and int(total) - sum(it[3] for it in items) == len(ids)
        picks = steady.split(ids, new_blocks, ones, scheduled)
        if steady.crossed:  # members whose token starts a block the step gives them: they stay, in one pass
            crossed_writes, back = _steady_cross(engine, steady, stream, ids, new_blocks, computed, resumed,
                                                 fresh if holding else None)
            if back:
                picks = sorted(set(picks).union(back))
        if steady.back:  # vLLM's position of each must be the one the counter reached (else: counted, never raised)
            _steady_drift(engine, tracker, steady.back, ids, computed)
    else:
        picks = range(len(ids))
    for i in picks:
        req_id = ids[i]
        n = scheduled.get(req_id, 0)
        t = update(req_id, new_blocks[i], computed[i], n, req_id in resumed)
        if t is not None:
            items.append((req_id, t, int(computed[i]), n))
        if holding and new_blocks[i] is not None:
            fresh.extend(new_blocks[i])
    empty = total is not None and not int(total)
    if empty and len(tracker):  # a step of no token while requests run (async scheduling makes a few)
        engine.stats.add("empty_steps")
    spill_s = 0.0
    if spilling:
        t3 = time.perf_counter()
        finished = _spill_or_hold(engine, done, finished, flat_blocks(fresh), empty)
        spill_s = time.perf_counter() - t3
        parts["finished_rows"] += spill_s
    deferred.add(so.finished_req_ids, finished, [t.maps for _, t in done])
    # a held maps request's rows: wanted back before this forward only where its planned tokens may need them
    short = maptap is None or not deferred.maps or maptap.short(items)
    if deferred.due(fresh, empty, short):
        engine.stats.add("finish_batch_reasons", reason=deferred.reason)
        req_ids, batch = deferred.take(deferred.limit)
        # after the launch where this forward writes none of their blocks and wants none of their map-tap rows
        # (a batch due for maps gives them back here, before maptap.schedule below takes rows for this step)
        if engine.config.after_launch and not deferred.reused and deferred.reason != "maps":
            engine.after_launch = (req_ids, batch)
        else:
            _timed_finish_batch(engine, req_ids, batch)
    t2 = time.perf_counter()
    parts["captures"] += t2 - t1 - spill_s
    if shadow is not None:  # first: the others read the requests' blocks there
        shadow.schedule(items)
    if stream is not None:  # every token of the forward takes a ring row, captured or not
        stream.schedule(items, None if total is None else int(total))
    if maptap is not None:
        maptap.schedule(items)
    side.guard_items(items, engine.block_sizes)  # where this forward writes blocks capture work still reads
    if crossed_writes:
        side.guard(crossed_writes)
    if steady is not None:
        _steady_step(steady, stream, items)
    parts["schedule"] += time.perf_counter() - t2


def _steady_cross(engine, steady, stream, ids, new_blocks, computed, resumed, fresh) -> tuple[dict, list[int]]:
    """The step counter's members whose token this step starts a block that the step gives them
    (``steady.crossed``) stay members: what the ordinary path would do for each, done in one pass.  Each one's
    counts are applied (:meth:`Steady.keep`), its tracked block table extended by the new blocks, the stream's
    writer of the block its token starts set to it, and that block of each KV-cache group returned for the
    guards (per group, as :meth:`Side.guard` takes them); the new blocks also go to ``fresh`` (the reuse rule's
    list, None where no finished request waits).  A member whose counts do not match the scheduler's position
    (drift), that was resumed, or whose stream record is not at that position goes back to the ordinary path:
    returned, and in ``steady.back`` (where its drift is counted)."""
    import numpy as np

    sizes = engine.block_sizes
    writes: dict[int, list[int]] = {}
    owners: list[int] = []
    owned: list[int] = []
    back: list[int] = []
    sg, sbs = (stream.group, stream.block_size) if stream is not None else (None, None)
    crossed = steady.crossed
    for i, m in zip(crossed, steady.keep([ids[i] for i in crossed])):
        req_id = ids[i]
        t, live = m[1], m[2]
        start = int(computed[i])
        if t.written != start or req_id in resumed or (live is not None and live.next != start):
            steady.leave(req_id)
            steady.back.append(i)
            back.append(i)
            continue
        for group, extra in zip(t.block_ids, new_blocks[i]):
            group.extend(extra)
        for g, blocks in enumerate(t.block_ids):
            writes.setdefault(g, []).append(blocks[start // sizes[g]])
        if live is not None and start % sbs == 0:
            owners.append(t.block_ids[sg][start // sbs])
            owned.append(live.idx)
        if fresh is not None:
            fresh.extend(new_blocks[i])
    if owners:
        stream._writer[np.asarray(owners, dtype=np.int64)] = np.asarray(owned, dtype=np.int64)
    return {g: [np.asarray(b, dtype=np.int64)] for g, b in writes.items()}, back


def _steady_drift(engine, tracker, back: list[int], ids, computed) -> None:
    n = sum(1 for i in back if (t := tracker.get(ids[i])) is not None and t.written != int(computed[i]))
    if n:
        engine.stats.add("steady_drift", n)


def _steady_step(steady, stream, items: list) -> None:
    """After the stream counted this step's rows: the step counter's members took a token each, and the requests
    that took one token through the ordinary path, not planned for maps, are counted by it from the next step."""
    steady.bump()
    live_of = stream._live.get if stream is not None else None
    for req_id, t, start, n in items:
        if n != 1 or t.maps:
            continue
        live = None
        if live_of is not None:
            live = live_of(req_id)
            if live is None or live.lost or live.next != start + 1:
                continue
        steady.join(req_id, t, live, start + 1)


def _spill_or_hold(engine, done: list, finished: list, fresh, empty: bool) -> list:
    """The step's finished requests, spilled (:func:`_spill_finished`) now, before this step's forward, unless
    ``ATTN_OTEL_HOLD_FINISHED`` is on and the forward writes none of their blocks (``fresh``): then they wait for
    their finish batch unspilled, their blocks held by vLLM's scheduler (attn_otel.hold), and the batch flushes
    their pending rows with the others' (after a forward's launch, where no forward writes one of their blocks
    first; the reuse rule of attn_otel.deferred takes the batch before any forward that does).  Where the step
    is empty the batch is taken now anyway, so nothing is spilled."""
    import numpy as np

    if not any(not t.maps for _, t in done):  # none to spill (_spill_finished takes none planned for maps)
        return finished
    why = "before" if not engine.config.hold_finished else "idle" if empty else "held"
    if why == "held" and fresh.size:  # (a mask, not np.isin: this runs in every step that finishes a request)
        mine = flat_blocks(b for f in finished for b in f.block_ids)
        if mine.size:
            marked = np.zeros(int(max(mine.max(), fresh.max())) + 1, dtype=bool)
            marked[mine] = True
            if marked[fresh].any():
                why = "reuse"
    engine.stats.add("spill_at", reason=why)
    if why in ("held", "idle"):
        return finished
    return _spill_finished(engine, done, finished)


def _spill_finished(engine, done: list, finished: list) -> list:
    """The step's finished requests whose capture reads only streamed rows (not planned for maps, no row
    lost): their pending rows computed now, and their last block's rows copied to a spill block that their
    records name instead (attn_otel.spill), so vLLM may reuse that block (it does, at once) before their batch
    is taken.  Returns the records, the spilled ones replaced."""
    import numpy as np

    stream, side = engine.stream, engine.side
    g, bs = stream.group, stream.block_size
    picks = [i for i, (r, t) in enumerate(done) if not t.maps and not stream.lost(r) and finished[i].num_tokens > 0
             and len(finished[i].block_ids) > g and len(finished[i].block_ids[g]) * bs >= finished[i].num_tokens]
    picks = picks[:stream.spill.free()]
    if not picks:
        return finished
    ids = [done[i][0] for i in picks]
    stream.finish(ids)  # their pending rows, while their keys are theirs
    used = [-(-finished[i].num_tokens // bs) for i in picks]
    virtual = stream.spill.copy([finished[i].block_ids[g][u - 1] for i, u in zip(picks, used)])
    stream.forget(ids)
    seq = side.mark()
    out = list(finished)
    for i, u, v in zip(picks, used, virtual):
        f = finished[i]
        blocks = list(f.block_ids[g])
        side.reading(g, np.asarray(blocks[u - 1:], dtype=np.int64), seq)  # read by the flush and the copy
        groups = [[] for _ in f.block_ids]  # a capture of streamed layers reads the stream's group only
        groups[g] = blocks[:u - 1] + [v]
        out[i] = dataclasses.replace(f, block_ids=groups, spill=(v,))
    return out


def _timed_finish_batch(engine, req_ids: list[str], finished: list) -> None:
    """:func:`_finish_batch`, its time and size in the stats (the batch's own: before the forward or after)."""
    tb = time.perf_counter()
    _finish_batch(engine, req_ids, finished)
    engine.stats.finish_batch_times.append(time.perf_counter() - tb)
    engine.stats.finish_batch_sizes.append(len(req_ids))


def _finish_batch(engine, req_ids: list[str], finished: list) -> None:
    """Finished requests' capture work (held by ``engine.deferred`` up to now), before any forward can write
    their blocks for another request: the streamed layers' pending rows of them (and of any request sharing
    their prefix) computed while their keys are still in the cache, then their captures enqueued."""
    stream, maptap, shadow, side = engine.stream, engine.maptap, engine.shadow, engine.side
    if stream is not None:
        stream.finish(req_ids)
    if shadow is not None and finished:  # a request that found no slot in attn-otel's own table is not captured
        kept = [f for f in finished if f.request_id not in shadow.lost]
        if len(kept) < len(finished):
            lost = len(finished) - len(kept)
            engine.stats.add("dropped", lost, reason="window_tap_full")
            engine.warn_once("window-tap-full", "attn-otel's own block table for windowed layers was full: %d "
                             "request(s) not captured (counted as dropped, window_tap_full; logged once)", lost)
            finished = kept
    spilled = [v for f in finished for v in f.spill]
    if finished:
        engine.on_finished_many(finished)
    if spilled:  # their gathers are enqueued: a later copy to these blocks comes after them
        stream.spill.release(spilled)
    if maptap is not None and req_ids:  # their rows, once the gathers just enqueued have read them
        maptap.release(req_ids, side.mark())
    if stream is not None:
        stream.forget(req_ids)
    if shadow is not None:  # their blocks there: after the capture work above was recorded as reading them
        shadow.release(req_ids)
