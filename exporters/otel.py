"""The OpenTelemetry exporter: one ``attn_capture`` span per capture, child of the request's traceparent.

Usage
-----
Nothing to call: :func:`attn_otel.exporters.build_exporters` imports this module and calls
:func:`from_config`, which turns the exporter on when the standard ``OTEL_*`` variables ask for spans::

    ATTN_OTEL=1 OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4317 python -m vllm.entrypoints.openai.api_server ...

In code, pass your own provider (this module never reads or sets the global one)::

    provider = TracerProvider(id_generator=RecordIdGenerator())
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    exporter = OtelExporter(provider)

Configuration
-------------
Only the OpenTelemetry SDK's own variables, read when the writer builds its exporters:

- ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``: where spans go (read by the
  SDK's OTLP exporter; the generic one gets ``/v1/traces`` appended for HTTP, as the spec says).
- ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``: ``grpc`` or ``http/protobuf``.
- ``OTEL_TRACES_EXPORTER``: ``otlp`` (comma lists with ``console`` allowed), or ``none``: exporter off.
- ``OTEL_SDK_DISABLED=true``: exporter off.
- ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``: the resource; ``service.name`` defaults to
  ``attn-otel`` rather than the SDK's ``unknown_service``.
- ``OTEL_TRACES_SAMPLER`` / ``_ARG``, ``OTEL_EXPORTER_OTLP_HEADERS``, ``..._TIMEOUT``, ``..._COMPRESSION``,
  ``..._INSECURE``, ``..._CERTIFICATE``, ``OTEL_BSP_*``: honoured by the SDK as usual.

Off unless asked: with no OTLP endpoint variable set and ``OTEL_TRACES_EXPORTER`` not naming ``otlp`` or
``console``, :func:`from_config` returns None.  The SDK's fallback endpoint (``localhost:4317``) is almost
never listening on a serving box, and a default ``ATTN_OTEL=1`` install would otherwise log a connection
error per export batch.  vLLM's own ``--otlp-traces-endpoint`` sets ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
for the processes it starts after it, so with that flag attn-otel's spans go to the same collector; without
it, the variables above alone decide.

The protocol defaults to ``grpc`` when neither protocol variable is set: the OpenTelemetry specification
recommends ``http/protobuf``, but the Python SDK's own auto-configuration and vLLM's
``--otlp-traces-endpoint`` both default to gRPC, and one endpoint should serve vLLM's spans and these.

The span
--------
``attn_capture`` (kind INTERNAL), trace id and parent from the request's W3C traceparent (a root span in
the capture's generated trace when the request had none), span id = the record's ``span_id`` (through
:class:`RecordIdGenerator`), start = the request's finish (``record.created``), end = export time.
Attributes: ``attn_otel.store_uri``, ``attn_otel.request_id``, ``attn_otel.layers``,
``attn_otel.num_layers``, ``attn_otel.num_heads``, ``attn_otel.tokens.prompt``, ``attn_otel.tokens.generated``,
``attn_otel.tokens.total``, ``attn_otel.model``, ``attn_otel.engine_version``, ``attn_otel.mode``,
``attn_otel.maps_stored``, ``attn_otel.capture_latency_s``, ``attn_otel.sink_tokens``, ``attn_otel.vision``,
``attn_otel.finish_reason`` (vLLM's: ``stop``, ``length``, ``abort``, ``error``, ``repetition``; absent when the
engine did not say), ``attn_otel.fetch_command``, and for a stored capture ``attn_otel.view_url``: the
capture's page in the viewer (``ATTN_OTEL_VIEW_URL`` + ``/attn-otel/view/{trace_id}?request={request_id}``,
or that path alone when the variable is unset).  ``attn_otel.model`` is the served model name, never a local
path (:func:`attn_otel.tracking.model_name`).  One event ``attn_otel.layer`` per captured layer with ``attn_otel.layer``
(the layer index) and ``{part}.{metric}`` = the layer mean (over heads) of the metric over the part's rows
(:func:`attn_otel.metrics.summarize`'s ``layer_mean``), for part ``prompt`` and ``generated``; undefined
values (NaN, a metric the request lacks) are left out.

Reference, don't embed: spans carry numbers, ids, names and a URI; never prompt text or token ids.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shlex
import threading
import time
from typing import Any, Iterator

from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator

from ..ids import check_trace_id
from ..viewer import view_path
from ._base import ExportItem

logger = logging.getLogger("attn_otel")

__all__ = ["EVENT_NAME", "SPAN_NAME", "OtelExporter", "RecordIdGenerator", "from_config"]

SPAN_NAME = "attn_capture"
EVENT_NAME = "attn_otel.layer"
DEFAULT_SERVICE_NAME = "attn-otel"
DEFAULT_PROTOCOL = "grpc"

OTEL_SDK_DISABLED = "OTEL_SDK_DISABLED"
"""``true`` turns every OpenTelemetry signal off, these spans included (the SDK's own variable)."""

OTEL_TRACES_EXPORTER = "OTEL_TRACES_EXPORTER"
"""``otlp`` (the default once an endpoint is set), ``console`` (spans printed on stderr: the writer
process's stdout carries its answers to the engine), a comma list of those, or ``none`` (exporter off)."""

OTEL_EXPORTER_OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
"""Base URL of an OTLP receiver, every signal (HTTP: ``/v1/traces`` is appended)."""

OTEL_EXPORTER_OTLP_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
"""Traces-only OTLP URL, used as given (HTTP: the full ``.../v1/traces`` URL); wins over the base URL."""

OTEL_EXPORTER_OTLP_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
"""``grpc`` or ``http/protobuf``; attn-otel's default is ``grpc`` (see the module docstring)."""

OTEL_EXPORTER_OTLP_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
"""Traces-only protocol; wins over ``OTEL_EXPORTER_OTLP_PROTOCOL``."""

OTEL_SERVICE_NAME = "OTEL_SERVICE_NAME"
"""``service.name`` of the spans' resource; default ``attn-otel``."""


class RecordIdGenerator(IdGenerator):
    """Lets the SDK give a span the ids its capture already has.

    The SDK asks its provider's id generator for a new span's id (and for a root span's trace id); inside
    :meth:`use` this answers with the capture's own ids, so the span id in the trace is the ``span_id``
    stored with the capture.  Outside :meth:`use` (other tracers sharing the provider) it is random.
    Per thread, so concurrent exports on one provider do not mix their ids.
    """

    def __init__(self) -> None:
        self._random = RandomIdGenerator()
        self._local = threading.local()

    @contextlib.contextmanager
    def use(self, trace_id: int, span_id: int) -> Iterator[None]:
        previous = getattr(self._local, "ids", None)
        self._local.ids = (trace_id, span_id)
        try:
            yield
        finally:
            self._local.ids = previous

    def generate_span_id(self) -> int:
        ids = getattr(self._local, "ids", None)
        return ids[1] if ids else self._random.generate_span_id()

    def generate_trace_id(self) -> int:
        ids = getattr(self._local, "ids", None)
        return ids[0] if ids else self._random.generate_trace_id()

    def is_trace_id_random(self) -> bool:
        # A client's trace id carries no promise of randomness (W3C level 2 random flag): do not claim it.
        return False


class OtelExporter:
    """Sends one ``attn_capture`` span per capture through ``tracer_provider``.

    With a provider whose id generator is a :class:`RecordIdGenerator` the span's id is the capture's
    ``span_id``; with any other provider the SDK picks one (the trace and parent still come from the
    capture).  :meth:`shutdown` flushes the provider's processors, and shuts the provider down only when
    ``owns_provider`` (as :func:`from_config` builds it).
    """

    name = "otel"

    def __init__(self, tracer_provider: TracerProvider, *, store_url: str | None = None,
                 owns_provider: bool = False, view_url: str | None = None):
        self.tracer_provider = tracer_provider
        self.store_url = store_url
        self.view_url = view_url  # ATTN_OTEL_VIEW_URL: the API server that serves the viewer
        self.owns_provider = owns_provider
        self._tracer = tracer_provider.get_tracer("attn_otel")
        generator = getattr(tracer_provider, "id_generator", None)
        self._ids = generator if isinstance(generator, RecordIdGenerator) else None

    def export(self, item: ExportItem) -> None:
        record = item.record
        trace_id = int(check_trace_id(record.trace_id), 16)
        span_id = int(record.span_id, 16)
        context = Context()  # never the ambient context: the capture's traceparent alone is the parent
        if record.parent_span_id:
            # The client's sampled flag: with the SDK's default parent-based sampler, a request sent with a
            # ``-00`` traceparent gets no capture span (its capture is stored all the same).
            flags = trace_api.TraceFlags.SAMPLED if record.sampled else trace_api.TraceFlags.DEFAULT
            parent = trace_api.SpanContext(trace_id, int(record.parent_span_id, 16), is_remote=True,
                                           trace_flags=trace_api.TraceFlags(flags))
            context = trace_api.set_span_in_context(trace_api.NonRecordingSpan(parent), context)
        start_ns = int(record.created * 1e9)
        end_ns = max(time.time_ns(), start_ns)
        with self._ids.use(trace_id, span_id) if self._ids is not None else contextlib.nullcontext():
            span = self._tracer.start_span(SPAN_NAME, context=context, kind=trace_api.SpanKind.INTERNAL,
                                           attributes=self.attributes(item), start_time=start_ns)
        for attributes in layer_events(item):
            span.add_event(EVENT_NAME, attributes=attributes, timestamp=start_ns)
        span.end(end_time=end_ns)

    def attributes(self, item: ExportItem) -> dict[str, Any]:
        record = item.record
        layers = [int(x) for x in record.layers]
        maps_stored = (record.maps is not None if item.maps_stored is None else item.maps_stored) \
            and item.uri is not None
        prompt, total = int(record.prompt_len), int(record.num_tokens)
        attrs: dict[str, Any] = {
            "attn_otel.request_id": str(record.request_id),
            "attn_otel.layers": layers,
            "attn_otel.num_layers": len(layers),
            "attn_otel.num_heads": int(record.num_heads),
            "attn_otel.tokens.prompt": prompt,
            "attn_otel.tokens.generated": total - prompt,
            "attn_otel.tokens.total": total,
            "attn_otel.model": str(record.model),
            "attn_otel.engine_version": str(record.engine_version),
            "attn_otel.mode": str(record.mode),
            "attn_otel.maps_stored": maps_stored,
            "attn_otel.capture_latency_s": float(item.latency_s),
            "attn_otel.fetch_command": self.fetch_command(item, maps_stored),
        }
        if item.uri is not None:
            attrs["attn_otel.store_uri"] = str(item.uri)
            attrs["attn_otel.view_url"] = (self.view_url or "") + view_path(record.trace_id, str(record.request_id))
        for key, kind in (("sink_tokens", int), ("vision", bool), ("finish_reason", str)):
            if key in record.attrs:
                attrs[f"attn_otel.{key}"] = kind(record.attrs[key])
        return attrs

    def fetch_command(self, item: ExportItem, maps_stored: bool) -> str:
        """What the on-call engineer pastes: ``show`` the first layer's map, or ``metrics`` without maps."""
        record = item.record
        if maps_stored and record.layers:
            cmd = ["attn-otel", "show", record.trace_id, "--layer", str(int(record.layers[0]))]
        else:
            cmd = ["attn-otel", "metrics", record.trace_id]
        cmd += ["--request", str(record.request_id)]
        if self.store_url:
            cmd += ["--store", str(self.store_url)]
        return " ".join(shlex.quote(c) for c in cmd)

    def shutdown(self) -> None:
        self.tracer_provider.force_flush()
        if self.owns_provider:
            self.tracer_provider.shutdown()


def layer_events(item: ExportItem) -> list[dict[str, Any]]:
    """One attribute dict per captured layer: its index and every defined ``{part}.{metric}`` layer mean,
    as Python floats (the SDK would turn NumPy scalars into strings)."""
    summary = item.summary
    events = []
    for i, layer in enumerate(item.record.layers):
        attrs: dict[str, Any] = {"attn_otel.layer": int(layer)}
        for part, metrics in summary.items():
            for name, stats in metrics.items():
                if stats is None:
                    continue
                value = float(stats["layer_mean"][i])
                if math.isfinite(value):
                    attrs[f"{part}.{name}"] = value
        events.append(attrs)
    return events


def from_config(config=None) -> OtelExporter | None:
    """The exporter the ``OTEL_*`` variables ask for, on a provider of its own; None when spans are off."""
    env = os.environ
    if env.get(OTEL_SDK_DISABLED, "").strip().lower() == "true":
        return None
    names = [n.strip().lower() for n in env.get(OTEL_TRACES_EXPORTER, "").split(",") if n.strip()]
    if names == ["none"]:
        return None
    names = [n for n in names if n != "none"]
    if not names:
        if not (env.get(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) or env.get(OTEL_EXPORTER_OTLP_ENDPOINT)):
            logger.info("attn-otel: no OTLP endpoint set (OTEL_EXPORTER_OTLP_ENDPOINT); capture spans are off")
            return None
        names = ["otlp"]
    span_exporters = []
    for exporter_name in dict.fromkeys(names):
        if exporter_name == "otlp":
            span_exporters.append(_otlp_exporter())
        elif exporter_name == "console":
            import sys

            # stdout belongs to the writer process's protocol with the engine.
            span_exporters.append(ConsoleSpanExporter(out=sys.stderr))
        else:
            logger.warning("attn-otel: %s=%s is not supported here (otlp, console, none); ignoring it",
                           OTEL_TRACES_EXPORTER, exporter_name)
    if not span_exporters:
        return None
    provider = TracerProvider(resource=_resource(), id_generator=RecordIdGenerator())
    for span_exporter in span_exporters:
        provider.add_span_processor(BatchSpanProcessor(span_exporter))
    store_url = getattr(config, "store", None)
    return OtelExporter(provider, store_url=None if store_url is None else str(store_url), owns_provider=True,
                        view_url=getattr(config, "view_url", None))


def _otlp_exporter() -> SpanExporter:
    protocol = (os.environ.get(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL) or os.environ.get(OTEL_EXPORTER_OTLP_PROTOCOL)
                or DEFAULT_PROTOCOL).strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ValueError(f"unsupported OTLP protocol {protocol!r} (use grpc or http/protobuf)")
    return OTLPSpanExporter()  # endpoint, headers, TLS, timeout and compression from the OTEL_* variables


def _resource() -> Resource:
    # Resource.create lets explicit attributes win over the environment; default the name only when the
    # operator named no service (OTEL_SERVICE_NAME or service.name in OTEL_RESOURCE_ATTRIBUTES).
    named = SERVICE_NAME in OTELResourceDetector().detect().attributes  # reads both variables
    return Resource.create({} if named else {SERVICE_NAME: DEFAULT_SERVICE_NAME})
