"""Synthetic captures for the store, reader and CLI tests: no engine, just what a worker would hand over."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
from numpy_metrics import per_row_metrics

from attn_otel.ids import new_span_id, new_trace_id
from zarr.storage import WrapperStore

from attn_otel.store import CaptureRecord, open_zarr_store, write_capture


def causal_maps(n_layers: int, n_heads: int, T: int, seed: int = 0) -> np.ndarray:
    """Random causal row-stochastic maps, float32 ``[n_layers, n_heads, T, T]``: row i sums to 1 over keys 0..i."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=2.0, size=(n_layers, n_heads, T, T))
    future = np.triu(np.ones((T, T), dtype=bool), k=1)
    weights = np.where(future, 0.0, np.exp(logits))
    return (weights / weights.sum(axis=-1, keepdims=True)).astype(np.float32)


def stored_metrics(maps: np.ndarray, prompt_len: int, sink_tokens: int = 4,
                   vision: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """What a worker stores for these maps ``[L, H, T, T]``: ``{name: float32 [L, H, T]}``, computed by the
    NumPy reference (vision metrics only with a ``vision`` mask, as for a request with an image)."""
    per_layer = [per_row_metrics(layer, prompt_len, sink_tokens, vision) for layer in maps]
    return {name: np.stack([m[name] for m in per_layer]).astype(np.float32) for name in per_layer[0]}


def make_record(trace_id: str | None = None, request_id: str = "req-1", *, layers=(0, 3), heads: int = 2,
                T: int = 12, prompt_len: int = 8, maps: bool = True, token_ids: bool = True, seed: int = 0,
                created: float | None = None, sink_tokens: int = 4,
                vision: np.ndarray | None = None) -> tuple[CaptureRecord, np.ndarray | None]:
    """A capture record and the float32 maps it was made from (None for a metrics-only capture).

    Its metrics are the per-row metrics of those maps (also for a metrics-only capture), with the vision
    metrics when a ``vision`` mask (bool, over token positions) is given.
    """
    full = causal_maps(len(layers), heads, T, seed)
    expected = full if maps else None
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
        metrics=stored_metrics(full, prompt_len, sink_tokens, vision),
        attrs={"vision": vision is not None, "sink_tokens": sink_tokens},
        **extra,
    )
    return record, expected


def write(store_path, record: CaptureRecord) -> None:
    write_capture(open_zarr_store(store_path), record)


class LocalBackend:
    """A store in a local folder, inspected with pathlib (not through attn_otel)."""

    name = "local"

    def __init__(self, root: Path):
        self.root = Path(root)
        self.url = str(self.root)
        self.missing_url = str(self.root.parent / "no-such-store")
        self.missing_name = self.missing_url
        self.env: dict[str, str] = {}

    def keys(self, prefix: str = "") -> dict[str, int]:
        """``{key: size}`` of the files under ``prefix``, keys relative to the store root."""
        if not self.root.is_dir():
            return {}
        found = {}
        for p in self.root.rglob("*"):
            if not (k := p.relative_to(self.root).as_posix()).startswith(prefix):
                continue
            try:  # a live writer renames its ``.partial`` files into place: one listed can be gone by the stat
                if p.is_file():
                    found[k] = p.stat().st_size
            except FileNotFoundError:
                continue
        return found

    def outside_keys(self) -> list[str]:
        """Files next to the store (in its parent folder) that are not inside it."""
        parent = self.root.parent
        return [p.relative_to(parent).as_posix() for p in parent.rglob("*")
                if p.is_file() and self.root not in p.parents]

    def put(self, key: str, data: bytes) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def delete(self, key: str) -> None:
        (self.root / key).unlink()


def part_of(record: CaptureRecord, part) -> CaptureRecord:
    """The record a tensor/pipeline-parallel rank holding ``part`` (a :class:`attn_otel.store.CapturePart`) would hand
    to its writer: its heads of its stage's layers; the token ids on the last stage's first rank only."""
    import dataclasses

    li = [list(record.layers).index(x) for x in part.layers]
    h0, h1 = part.heads
    return dataclasses.replace(
        record, part=part, maps=None if record.maps is None else record.maps[li][:, h0:h1],
        metrics={k: v[li][:, h0:h1] for k, v in record.metrics.items()},
        token_ids=record.token_ids if part.index == part.count - part.tp else None)


def big_record(trace_id: str, request_id: str, layers: int, heads: int, T: int) -> CaptureRecord:
    """A maps capture of random float16 weights (no metrics): big enough that writing it takes a while."""
    rng = np.random.default_rng(1)
    maps = np.tril(rng.random((layers, heads, T, T), dtype=np.float32)).astype(np.float16)
    return CaptureRecord(trace_id=trace_id, request_id=request_id, span_id=new_span_id(), parent_span_id=None,
                         prompt_len=T - 1, num_tokens=T, layers=tuple(range(layers)), num_heads=heads,
                         model="synthetic", mode="maps", maps=maps)


class CountingStore(WrapperStore):
    """Counts reads by key: what a reader really fetches from the store."""

    def __init__(self, store, reads: Counter | None = None):
        super().__init__(store)
        self.reads = Counter() if reads is None else reads

    def _with_store(self, store):
        return type(self)(store, self.reads)

    async def get(self, key, prototype, byte_range=None):
        self.reads[key] += 1
        return await self._store.get(key, prototype, byte_range)

    async def get_partial_values(self, prototype, key_ranges):
        key_ranges = list(key_ranges)
        for key, _ in key_ranges:
            self.reads[key] += 1
        return await self._store.get_partial_values(prototype, key_ranges)


class OpsStore(WrapperStore):
    """Records every call a writer makes on the store, ``(method, key)`` in order: what reaches S3 as requests."""

    def __init__(self, store, ops: list | None = None):
        super().__init__(store)
        self.ops = [] if ops is None else ops

    def _with_store(self, store):
        return type(self)(store, self.ops)

    async def get(self, key, prototype, byte_range=None):
        self.ops.append(("get", key))
        return await self._store.get(key, prototype, byte_range)

    async def exists(self, key):
        self.ops.append(("exists", key))
        return await self._store.exists(key)

    async def set(self, key, value):
        self.ops.append(("set", key))
        return await self._store.set(key, value)

    async def set_if_not_exists(self, key, value):
        self.ops.append(("set_if_not_exists", key))
        return await self._store.set_if_not_exists(key, value)

    def list_dir(self, prefix):
        self.ops.append(("list_dir", prefix))
        return self._store.list_dir(prefix)

    def list_prefix(self, prefix):
        self.ops.append(("list_prefix", prefix))
        return self._store.list_prefix(prefix)

    async def delete(self, key):
        self.ops.append(("delete", key))
        return await self._store.delete(key)


if __name__ == "__main__":
    # python synthetic.py STORE_URL TRACE_ID REQUEST_ID [LAYERS HEADS T]: a writer in a process of its own
    # (the kill -9 test, and a store written behind a long-lived reader's back).
    import sys

    url, trace, req = sys.argv[1:4]
    if len(sys.argv) > 4:
        shape = [int(x) for x in sys.argv[4:7]]
        print("writing", flush=True)
        write(url, big_record(trace, req, *shape))
    else:
        write(url, make_record(trace, req)[0])
    print("done", flush=True)
