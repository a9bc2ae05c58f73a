"""Trace ids, W3C trace context (through OpenTelemetry's own propagator), and the names captures are
stored under."""

from __future__ import annotations

import hashlib
import re
import secrets
from typing import Any

_TRACE_ID = re.compile(r"^[0-9a-f]{32}$")
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


class InvalidTraceId(ValueError):
    pass


_PROPAGATOR = None


def _propagator():
    # Imported when first needed: reading captures (the CLI, open_trace) never parses a traceparent.
    global _PROPAGATOR
    if _PROPAGATOR is None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        _PROPAGATOR = TraceContextTextMapPropagator()
    return _PROPAGATOR


def extract_span_context(carrier: Any, getter: Any = None):
    """The remote parent ``SpanContext`` that OpenTelemetry's W3C propagator
    (``TraceContextTextMapPropagator``) extracts from ``carrier`` (a mapping of header names to values, or
    any carrier with a matching ``getter``), or None where it finds no valid ``traceparent``: uppercase hex,
    an all-zero trace or span id, version ``ff``, version ``00`` with trailing fields, wrong lengths, more
    than 512 characters.  Its ``tracestate`` comes along where the carrier has one."""
    from opentelemetry import trace

    kwargs = {} if getter is None else {"getter": getter}
    try:
        context = _propagator().extract(carrier, **kwargs)
    except Exception:  # noqa: BLE001 - a foreign carrier or value: not a traceparent
        return None
    span_context = trace.get_current_span(context).get_span_context()
    return span_context if span_context.is_valid else None


def _from_value(value: object):
    if not isinstance(value, str):
        return None
    return extract_span_context({"traceparent": value})


def format_traceparent(span_context) -> str:
    """The W3C ``traceparent`` of a span context as OpenTelemetry's propagator writes it: always version
    ``00``, lowercase hex (``00-{trace_id}-{span_id}-{flags}``)."""
    from opentelemetry import trace

    carrier: dict[str, str] = {}
    _propagator().inject(carrier, context=trace.set_span_in_context(trace.NonRecordingSpan(span_context)))
    return carrier["traceparent"]


def canonical_traceparent(value: object) -> str | None:
    """``value`` rewritten by OpenTelemetry's propagator (version ``00``, lowercase), or None when the
    propagator rejects it."""
    span_context = _from_value(value)
    return None if span_context is None else format_traceparent(span_context)


def new_traceparent(sampled: bool = True) -> str:
    """A traceparent for a new trace (a fresh trace id and span id)."""
    return f"00-{new_trace_id()}-{new_span_id()}-{'01' if sampled else '00'}"


def parse_traceparent(value: object) -> tuple[str, str] | None:
    """``(trace_id, parent_span_id)`` from a W3C traceparent, or None when OpenTelemetry's propagator does
    not accept it (see :func:`extract_span_context`)."""
    span_context = _from_value(value)
    if span_context is None:
        return None
    return f"{span_context.trace_id:032x}", f"{span_context.span_id:016x}"


def traceparent_sampled(value: object) -> bool:
    """The W3C ``sampled`` flag of a traceparent (True when it is not a valid one: nothing says otherwise)."""
    span_context = _from_value(value)
    return True if span_context is None else bool(span_context.trace_flags.sampled)


def new_trace_id() -> str:
    return secrets.token_hex(16)


def new_span_id() -> str:
    return secrets.token_hex(8)


def derived_trace_id(seed: str, request_id: str) -> str:
    """The trace id of a request that came without one, the same on every rank of a parallel engine
    (``seed`` is the engine's instance id, so ids do not repeat across engines or restarts)."""
    return hashlib.sha256(f"attn-otel\0{seed}\0{request_id}".encode()).hexdigest()[:32]


def derived_span_id(trace_id: str, request_id: str) -> str:
    """The capture span's id, the same on every rank that writes a part of the capture."""
    return hashlib.sha256(f"attn-otel-span\0{trace_id}\0{request_id}".encode()).hexdigest()[:16]


def check_trace_id(trace_id: object) -> str:
    """Return the normalised trace id, or raise :class:`InvalidTraceId` before any store is touched."""
    if not isinstance(trace_id, str) or not _TRACE_ID.match(trace_id.strip().lower()):
        shown = repr(trace_id)[:80]
        raise InvalidTraceId(f"not a trace id: {shown} (expected 32 lowercase hex digits)")
    return trace_id.strip().lower()


def request_key(request_id: str) -> str:
    """A path-safe name for a request id: unchanged when already safe, else escaped plus a short hash."""
    # "zarr.json" is the trace group's own metadata object, a sibling of the request keys
    if (request_id and not _SAFE.search(request_id) and request_id not in (".", "..", "zarr.json")
            and len(request_id) <= 128):
        return request_id
    digest = hashlib.sha256(request_id.encode()).hexdigest()[:12]
    return _SAFE.sub("_", request_id)[:100].strip(".") + "-" + digest


def maps_sampled(trace_id: str, fraction: float) -> bool:
    """Deterministic per trace id, so every request (and every rank) of a trace decides alike."""
    if fraction >= 1.0:
        return True
    if fraction <= 0.0:
        return False
    return int(trace_id[-8:], 16) / 0x1_0000_0000 < fraction
