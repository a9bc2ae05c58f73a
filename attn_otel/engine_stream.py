"""vLLM's own CUDA stream at a higher priority than attn-otel's capture work (``ATTN_OTEL_ENGINE_PRIORITY``).

attn-otel's flushes and finish kernels run on a side stream (:class:`attn_otel.stream.Side`) so that the engine's
next forward runs beside them instead of after them.  Both streams were made at CUDA's default priority, which
is also its lowest, so where a forward's kernels and a flush's wait for SMs at once the GPU's block scheduler
takes them as they come: a flush enqueued just before a decode step's CUDA graph can hold SMs that step's
kernels wait for.  A stream of higher priority has its pending blocks scheduled first.

vLLM makes each worker's stream itself, the first time something asks for ``vllm.utils.torch_utils.
current_stream()`` (a fresh ``torch.cuda.Stream()``, kept per thread; its CUDA graphs are captured and
replayed on it, and a graph replays at the priority of the stream it is launched into).  :func:`install` makes
that stream first, at priority -1, as the GPU worker sets up its device: just before
``init_worker_distributed_environment``, after the worker has chosen its device and before NCCL or anything
else asks for the stream.  Nothing else changes: the same kernels run in the same order on that stream.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("attn_otel")

PRIORITY = -1  # one step above CUDA's default (0, the lowest), which attn-otel's side stream keeps

_STATE: dict[str, Any] = {}  # this process's outcome: {"priority": int | None, "raised": bool}


def state() -> dict[str, Any]:
    """What :func:`raise_priority` did in this process (``{}`` if it never ran)."""
    return dict(_STATE)


def install(worker_module, torch_utils) -> None:
    """Wrap ``worker_module.init_worker_distributed_environment`` (vLLM's ``gpu_worker``, whose
    ``Worker.init_device`` calls it by its module-level name once the device is set) so that the worker's
    stream is made at :data:`PRIORITY` first (``torch_utils``: ``vllm.utils.torch_utils``, which keeps it;
    both passed by the adapter, the one module that imports vLLM).  Idempotent."""
    orig = worker_module.init_worker_distributed_environment
    if getattr(orig, "_attn_otel", False):
        return

    def init_worker_distributed_environment(*args, **kwargs):
        raise_priority(torch_utils)
        return orig(*args, **kwargs)

    init_worker_distributed_environment._attn_otel = True  # type: ignore[attr-defined]
    worker_module.init_worker_distributed_environment = init_worker_distributed_environment


def raise_priority(torch_utils) -> None:
    """Make this thread's vLLM stream now, at :data:`PRIORITY`, unless vLLM has one already (then it is left
    as it is, and said so).  Never raises: the engine serves either way."""
    try:
        import torch

        tls = torch_utils._current_stream_tls
        current = getattr(tls, "value", None)
        if current is not None:
            _STATE.update(priority=getattr(current, "priority", None), raised=False)
            logger.warning("attn-otel: vLLM's stream was made before the worker set up its device; left at "
                           "priority %s (ATTN_OTEL_ENGINE_PRIORITY=high has no effect here)", _STATE["priority"])
            return
        if not torch.cuda.is_available():
            return
        stream = torch.cuda.Stream(priority=PRIORITY)  # on the device the worker has just set
        torch.cuda.set_stream(stream)  # vLLM's own set_stream (torch_utils patches it): keeps it per thread
        tls.value = stream  # (what that patch does, in case a vLLM does not patch it)
        _STATE.update(priority=int(stream.priority), raised=True)
        logger.info("attn-otel: vLLM's stream at CUDA priority %d, above capture work's 0 "
                    "(ATTN_OTEL_ENGINE_PRIORITY=high)", stream.priority)
    except Exception:  # noqa: BLE001 - the engine serves at vLLM's own priority
        _STATE.update(priority=None, raised=False)
        logger.warning("attn-otel: could not raise vLLM's stream priority; left as vLLM makes it", exc_info=True)
