"""Trace ids, W3C traceparent parsing, and the names captures are stored under."""

from __future__ import annotations

import hashlib
import re
import secrets

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
_TRACE_ID = re.compile(r"^[0-9a-f]{32}$")
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


class InvalidTraceId(ValueError):
    pass


def parse_traceparent(value: str) -> tuple[str, str] | None:
    """``(trace_id, parent_span_id)`` from a W3C traceparent, or None when it is not one."""
    if not isinstance(value, str):
        return None
    m = _TRACEPARENT.match(value.strip().lower())
    if not m or m.group(1) == "ff" or set(m.group(2)) == {"0"} or set(m.group(3)) == {"0"}:
        return None
    return m.group(2), m.group(3)


def traceparent_sampled(value: str) -> bool:
    """The W3C ``sampled`` flag of a traceparent (True when it is not a valid one: nothing says otherwise)."""
    m = _TRACEPARENT.match(value.strip().lower()) if isinstance(value, str) else None
    return True if m is None else bool(int(m.group(4), 16) & 1)


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
