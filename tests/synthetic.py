"""Synthetic captures for the store, reader and CLI tests: no engine, just what a worker would hand over."""

from __future__ import annotations

import numpy as np

from attn_otel.ids import new_span_id, new_trace_id
from attn_otel.store import CaptureRecord, open_zarr_store, write_capture


def causal_maps(n_layers: int, n_heads: int, T: int, seed: int = 0) -> np.ndarray:
    """Random causal row-stochastic maps, float32 ``[n_layers, n_heads, T, T]``: row i sums to 1 over keys 0..i."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=2.0, size=(n_layers, n_heads, T, T))
    future = np.triu(np.ones((T, T), dtype=bool), k=1)
    weights = np.where(future, 0.0, np.exp(logits))
    return (weights / weights.sum(axis=-1, keepdims=True)).astype(np.float32)


def make_record(trace_id: str | None = None, request_id: str = "req-1", *, layers=(0, 3), heads: int = 2,
                T: int = 12, prompt_len: int = 8, maps: bool = True, token_ids: bool = True, seed: int = 0,
                created: float | None = None) -> tuple[CaptureRecord, np.ndarray | None]:
    """A capture record and the float32 maps it was made from (None for a metrics-only capture)."""
    expected = causal_maps(len(layers), heads, T, seed) if maps else None
    extra = {} if created is None else {"created": created}
    record = CaptureRecord(
        trace_id=trace_id or new_trace_id(),
        request_id=request_id,
        span_id=new_span_id(),
        parent_span_id=None,
        prompt_len=prompt_len,
        num_tokens=T,
        layers=tuple(layers),
        num_heads=heads,
        model="synthetic",
        mode="maps" if maps else "metrics",
        token_ids=np.arange(100, 100 + T, dtype=np.int32) if token_ids else None,
        maps=None if expected is None else expected.astype(np.float16),
        metrics={"entropy": np.full((len(layers), heads), 1.5, dtype=np.float32)},
        **extra,
    )
    return record, expected


def write(store_path, record: CaptureRecord) -> None:
    write_capture(open_zarr_store(store_path), record)
