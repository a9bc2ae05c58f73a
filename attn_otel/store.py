"""Captures as Zarr v3 groups, one per request, keyed by trace id.

Layout (``{store}`` is ``ATTN_OTEL_STORE``)::

    {store}/traces/{trace_id}/{request_key}/zarr.json        group; attributes hold the token metadata
    {store}/traces/{trace_id}/{request_key}/attn/...          float16 [layers, heads, T, T], fill 0,
                                                              chunks (1, 1, ROWS, T): one layer+head is
                                                              ceil(T/ROWS) reads, a band of rows one read
    {store}/traces/{trace_id}/{request_key}/token_ids/...    int32 [T] (only with ATTN_OTEL_STORE_TOKENS=1)
    {store}/traces/{trace_id}/{request_key}/metrics/{name}   float32 [layers, heads, T], per query row
    {store}/traces/{trace_id}/{request_key}/vision_mask      bool [T], image-embedding positions (multimodal)
    {store}/traces/{trace_id}/{request_key}/COMPLETE         JSON summary, written last

A capture is visible to readers only once ``COMPLETE`` exists, so a writer killed mid-capture leaves
nothing that ``ls``, ``fetch`` or :func:`attn_otel.open_trace` report.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np

from .ids import check_trace_id, request_key

FORMAT_VERSION = 1
MARKER = "COMPLETE"
ROWS_PER_CHUNK = 256


class StoreError(RuntimeError):
    """A store that cannot be opened, or an object in it that is not an attn-otel capture."""


@dataclasses.dataclass
class CaptureRecord:
    """Everything one finished request's capture stores: built on the worker, written off the engine loop."""

    trace_id: str
    request_id: str
    span_id: str
    parent_span_id: str | None
    prompt_len: int
    num_tokens: int
    layers: tuple[int, ...]
    num_heads: int
    model: str = ""
    engine_version: str = ""
    mode: str = "metrics"
    created: float = dataclasses.field(default_factory=time.time)
    token_ids: np.ndarray | None = None
    maps: np.ndarray | None = None  # float16 [layers, heads, T, T]
    metrics: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    attrs: dict[str, Any] = dataclasses.field(default_factory=dict)
    vision_mask: np.ndarray | None = None  # bool [T]: image-embedding positions (multimodal requests)

    def nbytes(self) -> int:
        n = 0 if self.maps is None else self.maps.nbytes
        n += 0 if self.token_ids is None else self.token_ids.nbytes
        return n + sum(v.nbytes for v in self.metrics.values())


def open_zarr_store(url: str | os.PathLike, *, read_only: bool = False):
    """A zarr Store for a path, ``file://`` URL or ``s3://bucket/prefix``."""
    from zarr.storage import LocalStore

    text = os.fspath(url)
    parsed = urlparse(text)
    if parsed.scheme in ("", "file"):
        path = Path(parsed.path if parsed.scheme == "file" else text).expanduser()
        if read_only and not path.is_dir():
            raise StoreError(f"store {text!r} does not exist")
        if not read_only:
            path.mkdir(parents=True, exist_ok=True)
        return LocalStore(str(path), read_only=read_only)
    if parsed.scheme == "s3":
        from zarr.storage import FsspecStore

        try:
            return FsspecStore.from_url(text, read_only=read_only, storage_options=_s3_options())
        except ImportError as e:
            raise StoreError(f"s3 stores need the 's3' extra (pip install 'attn-otel[s3]'): {e}") from None
    raise StoreError(f"unsupported store URL {text!r}: use a path, file://PATH or s3://bucket/prefix")


def _s3_options() -> dict[str, Any]:
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return {"asynchronous": True, **({"endpoint_url": endpoint} if endpoint else {})}


def capture_prefix(trace_id: str, request_id: str) -> str:
    return f"traces/{check_trace_id(trace_id)}/{request_key(request_id)}"


def _sync(coro):
    from zarr.core.sync import sync

    return sync(coro)


def _put_bytes(store, key: str, data: bytes) -> None:
    from zarr.core.buffer import default_buffer_prototype

    _sync(store.set(key, default_buffer_prototype().buffer.from_bytes(data)))


def _get_bytes(store, key: str) -> bytes | None:
    from zarr.core.buffer import default_buffer_prototype

    buf = _sync(store.get(key, prototype=default_buffer_prototype()))
    return None if buf is None else buf.to_bytes()


def summary(record: CaptureRecord) -> dict[str, Any]:
    return {
        "format": FORMAT_VERSION,
        "trace_id": record.trace_id,
        "request_id": record.request_id,
        "span_id": record.span_id,
        "parent_span_id": record.parent_span_id,
        "prompt_len": int(record.prompt_len),
        "num_tokens": int(record.num_tokens),
        "layers": [int(x) for x in record.layers],
        "num_heads": int(record.num_heads),
        "model": record.model,
        "engine_version": record.engine_version,
        "mode": record.mode,
        "maps": record.maps is not None,
        "token_ids": record.token_ids is not None,
        "vision_mask": record.vision_mask is not None,
        "created": record.created,
        "metrics": sorted(record.metrics),
        **record.attrs,
    }


def write_capture(store, record: CaptureRecord) -> int:
    """Write one capture, marker last.  Returns the bytes handed to the store (before compression)."""
    import zarr

    prefix = capture_prefix(record.trace_id, record.request_id)
    meta = summary(record)
    group = zarr.open_group(store=store, path=prefix, mode="w", attributes={"attn_otel": meta})
    written = 0
    if record.maps is not None:
        L, H, T, T2 = record.maps.shape
        assert T == T2 == record.num_tokens, (record.maps.shape, record.num_tokens)
        arr = group.create_array(
            "attn",
            shape=(L, H, T, T),
            dtype="float16",
            chunks=(1, 1, min(T, ROWS_PER_CHUNK), T),
            fill_value=0.0,
            dimension_names=("layer", "head", "query", "key"),
        )
        arr[...] = record.maps
        written += record.maps.nbytes
    group.create_array("layers", data=np.asarray(record.layers, dtype=np.int32))
    if record.token_ids is not None:
        group.create_array("token_ids", data=np.asarray(record.token_ids, dtype=np.int32))
        written += record.token_ids.nbytes
    if record.vision_mask is not None:
        group.create_array("vision_mask", data=np.asarray(record.vision_mask, dtype=bool))
    if record.metrics:
        mg = group.create_group("metrics")
        for name, value in record.metrics.items():
            mg.create_array(name, data=np.ascontiguousarray(value, dtype=np.float32))
            written += value.nbytes
    _put_bytes(store, f"{prefix}/{MARKER}", json.dumps(meta).encode())
    return written


def list_trace_ids(store) -> list[str]:
    async def collect():
        return [x async for x in store.list_dir("traces/")]

    try:
        names = _sync(collect())
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        n = n.rstrip("/")
        try:
            out.append(check_trace_id(n))
        except ValueError:
            continue  # foreign objects under traces/ are not ours to report
    return sorted(out)


def list_request_keys(store, trace_id: str) -> list[str]:
    async def collect():
        return [x async for x in store.list_dir(f"traces/{check_trace_id(trace_id)}/")]

    try:
        return sorted(n.rstrip("/") for n in _sync(collect()))
    except FileNotFoundError:
        return []


# What readers index without a check; a marker lacking one is corrupt, not a KeyError later on.
_SUMMARY_FIELDS = {"trace_id": str, "request_id": str, "prompt_len": int, "num_tokens": int, "layers": list,
                   "num_heads": int}


def read_summary(store, trace_id: str, key: str) -> dict[str, Any] | None:
    """The COMPLETE marker of one capture, or None when the capture is not complete."""
    raw = _get_bytes(store, f"traces/{trace_id}/{key}/{MARKER}")
    if raw is None:
        return None
    try:
        meta = json.loads(raw)
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
            raise ValueError("unknown format")
        bad = [k for k, kind in _SUMMARY_FIELDS.items() if not isinstance(meta.get(k), kind)]
        if not bad and not all(isinstance(x, int) for x in meta["layers"]):
            bad = ["layers"]
        if bad:
            raise ValueError(f"missing or malformed {', '.join(bad)}")
    except ValueError as e:
        raise StoreError(f"traces/{trace_id}/{key}/{MARKER} is not an attn-otel capture marker ({e})") from None
    return meta
