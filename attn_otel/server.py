"""The API-server side of attn-otel: trace context in, trace id out, metrics routes.

vLLM's OpenAI server runs in its own process; captures happen in the engine's worker process.  This module
(Starlette/FastAPI only, no vLLM import) is what attn-otel adds to the server process, installed by
:mod:`attn_otel.vllm_adapter` when ``ATTN_OTEL=1``:

- :class:`TraceContextMiddleware` (pure ASGI): reads the client's W3C ``traceparent`` (and ``tracestate``)
  headers through OpenTelemetry's own propagator (``TraceContextTextMapPropagator``), or makes a new trace
  when the client sent none or one the propagator rejects (uppercase hex, an all-zero id, version ``ff``,
  wrong lengths, ...).  The request goes on with exactly one ``traceparent`` header, as the propagator
  writes it (version ``00``, lowercase), so vLLM's own tracing, when on, uses the same trace.  It answers
  every HTTP response with that value as ``traceresponse: 00-{trace_id}-{span_id}-{flags}`` (W3C Trace
  Context level 2), so a client learns the trace id under which its request's capture is stored.  The value is kept in a context
  variable for the request's duration; the adapter copies it into the request's
  ``SamplingParams.extra_args["traceparent"]`` unless the request set one itself (``vllm_xargs``).
- :class:`EndpointPlugin`: an object of vLLM's endpoint-plugin shape that the adapter adds to the plugins
  vLLM attaches to its app (without the operator naming it in ``VLLM_PLUGINS``): it installs the middleware,
  the Prometheus routes (:func:`attn_otel.exporters.prometheus.install_api_server`) and the viewer's routes
  under ``/attn-otel/view/`` (:mod:`attn_otel.viewer_routes`), which require the server's ``--api-key``
  when it has one.
- :func:`prepare_stats_dir`: the directory through which the engine's processes hand their counters and
  histograms to this process's ``/metrics`` (``ATTN_OTEL_STATS_DIR``; a fresh temporary directory,
  removed at exit, when the operator set none).
"""

from __future__ import annotations

import atexit
import contextvars
import logging
import os
import shutil
import tempfile
from typing import Any

from .config import ATTN_OTEL_STATS_DIR
from .ids import extract_span_context, format_traceparent, new_traceparent

logger = logging.getLogger("attn_otel")

_TRACEPARENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("attn_otel_traceparent", default=None)


def current_traceparent() -> str | None:
    """The traceparent of the HTTP request being served in this context, if any."""
    return _TRACEPARENT.get()


class _AsgiHeaders:
    """OpenTelemetry's ``Getter`` over an ASGI header list (``[(name, value)]`` as bytes)."""

    @staticmethod
    def get(carrier, key: str) -> list[str] | None:
        name = key.lower().encode("latin-1")
        values = [v.decode("latin-1") for k, v in carrier if k.lower() == name]
        return values or None

    @staticmethod
    def keys(carrier) -> list[str]:
        return [k.decode("latin-1") for k, _ in carrier]


_ASGI_HEADERS = _AsgiHeaders()


class TraceContextMiddleware:
    """Pure ASGI middleware: one trace context per HTTP request, echoed as ``traceresponse``."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        headers = list(scope.get("headers") or [])
        span_context = extract_span_context(headers, _ASGI_HEADERS)
        if span_context is not None:
            traceparent = format_traceparent(span_context)
            drop = (b"traceparent",)
        else:  # none, or not valid W3C: a new trace, and the client's tracestate goes with its traceparent
            traceparent = new_traceparent()
            drop = (b"traceparent", b"tracestate")
        headers = [(k, v) for k, v in headers if k.lower() not in drop]
        headers.append((b"traceparent", traceparent.encode()))
        scope = {**scope, "headers": headers}
        response_header = (b"traceresponse", traceparent.encode())

        async def send_with_traceresponse(message):
            if message.get("type") == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), response_header]}
            await send(message)

        token = _TRACEPARENT.set(traceparent)
        try:
            await self.app(scope, receive, send_with_traceresponse)
        finally:
            _TRACEPARENT.reset(token)


def inject_traceparent(*params_objects: Any) -> None:
    """Put the current HTTP request's traceparent into each ``SamplingParams``' ``extra_args`` that does
    not carry one already (a ``vllm_xargs`` traceparent wins).  Never raises."""
    traceparent = _TRACEPARENT.get()
    if traceparent is None:
        return
    for params in params_objects:
        try:
            if params is None or not hasattr(params, "extra_args"):
                continue
            extra = params.extra_args
            if extra is None:
                params.extra_args = {"traceparent": traceparent}
            elif isinstance(extra, dict) and "traceparent" not in extra:
                extra["traceparent"] = traceparent
        except Exception:  # noqa: BLE001 - a frozen or foreign params object: that request keeps its own id
            logger.debug("attn-otel: could not attach the traceparent to %r", type(params), exc_info=True)


class EndpointPlugin:
    """vLLM's endpoint-plugin shape (``name``, ``required_tasks``, ``attach_router``, ``init_state``)."""

    name = "attn_otel"
    required_tasks = None

    def __init__(self, registry: Any = None):
        self.registry = registry
        self.viewer = None

    def attach_router(self, app: Any) -> None:
        if getattr(app.state, "attn_otel_installed", False):
            return
        app.add_middleware(TraceContextMiddleware)
        try:
            from .exporters import prometheus
        except ImportError as e:
            logger.warning("attn-otel: Prometheus routes are off (%s)", e)
        else:
            install = getattr(prometheus, "install_api_server", None)
            if install is not None:
                try:
                    install(app, self.registry)
                except Exception:  # noqa: BLE001 - metrics routes must not keep the server from starting
                    logger.exception("attn-otel: could not install the Prometheus routes")
        try:
            from . import viewer_routes

            self.viewer = viewer_routes.install(app)
            args = getattr(app.state, "args", None)  # vLLM 0.26 and 0.32 set it before attaching plugins
            if args is not None:
                self.viewer.configure(args)
            else:  # an app built otherwise: the environment until init_state brings the arguments
                self.viewer.set_api_keys(viewer_routes.api_keys())
        except Exception:  # noqa: BLE001 - the viewer must not keep the server from starting
            logger.exception("attn-otel: could not install the viewer routes")
        app.state.attn_otel_installed = True
        logger.info("attn-otel: trace context middleware installed (traceparent in, traceresponse out)")

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        viewer = self.viewer or getattr(state, "attn_otel_viewer", None)
        if viewer is not None and args is not None:
            viewer.configure(args)  # the server's API keys, tokenizer and served model name


def prepare_stats_dir() -> str:
    """``ATTN_OTEL_STATS_DIR``, creating a temporary one (removed at this process's exit) when unset.  Set
    in the environment before vLLM starts its engine processes, so they inherit it."""
    path = os.environ.get(ATTN_OTEL_STATS_DIR, "").strip()
    if path:
        return path
    path = tempfile.mkdtemp(prefix="attn-otel-stats-")
    os.environ[ATTN_OTEL_STATS_DIR] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
