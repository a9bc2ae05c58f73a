"""attn-otel: exact attention maps and attention-health metrics from production vLLM, by trace id.

Usage
-----
Serve as usual with ``ATTN_OTEL=1`` (the ``vllm.general_plugins`` entry point does the rest)::

    ATTN_OTEL=1 ATTN_OTEL_STORE=./attn-otel-data vllm serve MODEL

Ask for full maps on one request with ``vllm_xargs={"attn_otel": "maps"}`` (OpenAI API) or
``SamplingParams(extra_args={"attn_otel": "maps", "traceparent": "00-<trace>-<span>-01"})`` offline,
then read them back::

    import attn_otel
    (cap,) = attn_otel.open_trace(trace_id)
    cap.attn[12, 3, 100:200]        # lazy: reads only the chunks of layer 12, head 3, rows 100..199

or ``attn-otel ls``, ``attn-otel fetch TRACE_ID -o out.npz``, ``attn-otel show TRACE_ID --layer 12``.

Configuration
-------------
Every variable is documented in :mod:`attn_otel.config` and the README.

API
---
:func:`open_trace`, :func:`list_captures`, :class:`Capture`, :class:`Config`.
"""

from .config import Config
from .reader import Capture, TraceNotFound, list_captures, open_trace

__all__ = ["Capture", "Config", "TraceNotFound", "list_captures", "open_trace"]
__version__ = "0.1.0"
