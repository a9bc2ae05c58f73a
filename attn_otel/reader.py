"""Reading captures back by trace id: lazy, Zarr-backed; slicing reads only the chunks it needs."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Iterator, Sequence, Union

import numpy as np

from .config import ATTN_OTEL_STORE, Config
from .ids import check_trace_id
from .store import MARKER as MARKER_NAME
from .store import ROW_METRICS_GROUP, StoreError, list_request_keys, list_trace_ids, open_zarr_store, read_summary
from .store import redact_url

if TYPE_CHECKING:
    import zarr.abc.store


class TraceNotFound(LookupError):
    pass


StoreLike = Union[str, os.PathLike, "zarr.abc.store.Store", None]


def _store_url(store: StoreLike) -> str:
    if _is_zarr_store(store):
        return str(store)
    return os.fspath(store) if store is not None else (os.environ.get(ATTN_OTEL_STORE) or Config().store)


def _is_zarr_store(store: object) -> bool:
    if store is None or isinstance(store, (str, os.PathLike)):
        return False
    from zarr.abc.store import Store

    return isinstance(store, Store)


def _open(store: StoreLike):
    """A zarr Store to read from: the one given, or one opened (read-only) from a URL or the environment."""
    return store if _is_zarr_store(store) else open_zarr_store(_store_url(store), read_only=True)


class Capture:
    """One request's capture.  ``attn`` is a lazy zarr array ``[layers, heads, T, T]`` (or None when only
    metrics were stored); index it like NumPy and only the touched chunks are read."""

    def __init__(self, store, prefix: str, meta: dict[str, Any]):
        self._store = store
        self.prefix = prefix
        self.meta = meta
        self.trace_id: str = meta["trace_id"]
        self.request_id: str = meta["request_id"]
        self.prompt_len: int = int(meta["prompt_len"])
        self.num_tokens: int = int(meta["num_tokens"])
        self.layers: list[int] = [int(x) for x in meta["layers"]]
        self.num_heads: int = int(meta["num_heads"])
        self.has_maps: bool = bool(meta.get("maps"))
        self.model: str = str(meta.get("model") or "")  # the served model name (never a local path)
        # vLLM's finish reason (stop, length, abort, error, repetition); None for captures that predate it
        reason = meta.get("finish_reason")
        self.finish_reason: str | None = reason if isinstance(reason, str) else None
        # store format (see attn_otel.store.FORMAT_VERSION): a format-1 capture's lookback_ratio left the
        # query's own key out (not Lookback Lens's value); its other metrics are the same.  Formats 1 and 2
        # keep the per-row metrics under metrics/, format 3 beside attn (and opens in xarray)
        self.format: int = int(meta["format"])
        self._group = None

    def __repr__(self) -> str:
        return (f"Capture(trace_id={self.trace_id!r}, request_id={self.request_id!r}, T={self.num_tokens}, "
                f"prompt_len={self.prompt_len}, layers={self.layers}, maps={self.has_maps})")

    @property
    def group(self):
        if self._group is None:
            import zarr

            try:
                self._group = zarr.open_group(store=self._store, path=self.prefix, mode="r")
            except Exception as e:  # noqa: BLE001 - any failure here means a foreign or corrupt object
                raise StoreError(f"{self.prefix} is not a readable attn-otel capture: {e}") from None
        return self._group

    def _array(self, name: str, shape: tuple[int, ...], kind: str):
        """The stored array ``name``, checked against the marker before anything is read: a foreign or
        damaged object is a :class:`StoreError` naming it, never zarr's own KeyError or a huge allocation."""
        where = f"{self.prefix}/{name}"
        try:
            arr = self.group[name]
        except StoreError:
            raise
        except Exception as e:  # noqa: BLE001 - missing, foreign metadata, unknown codec: one clear error
            raise StoreError(f"{where} is not a readable attn-otel array ({type(e).__name__}: {e})") from None
        if not hasattr(arr, "shape") or tuple(arr.shape) != shape or np.dtype(arr.dtype).kind not in kind:
            raise StoreError(f"{where} is not what its capture marker describes (shape "
                             f"{tuple(getattr(arr, 'shape', ()))}, dtype {getattr(arr, 'dtype', '?')}; expected "
                             f"{shape})")
        return arr

    def _read(self, name: str, arr, index=...) -> np.ndarray:
        try:
            return np.asarray(arr[index])
        except Exception as e:  # noqa: BLE001 - a damaged chunk: say which capture and array
            raise StoreError(f"{self.prefix}/{name}: cannot read ({type(e).__name__}: {e})") from None

    @property
    def attn(self):
        if not self.has_maps:
            return None
        T = self.num_tokens
        return self._array("attn", (len(self.layers), self.num_heads, T, T), "f")

    @property
    def token_ids(self) -> np.ndarray | None:
        if not self.meta.get("token_ids"):
            return None
        return self._read("token_ids", self._array("token_ids", (self.num_tokens,), "iu"))

    @property
    def vision_mask(self) -> np.ndarray | None:
        """bool [T]: positions holding image embeddings (from ``PlaceholderRange.is_embed``), or None."""
        if not self.meta.get("vision_mask"):
            return None
        return self._read("vision_mask", self._array("vision_mask", (self.num_tokens,), "b")).astype(bool)

    @property
    def metrics(self) -> dict[str, np.ndarray]:
        return self.row_metrics()

    def row_metrics(self, only: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """The per-row metrics ``{name: float32 [layers, heads, T]}`` (all stored ones, or those of ``only``
        that are stored); ``{}`` when none were stored.  Reads only the arrays asked for."""
        names = self.meta.get("metrics")
        if not names:
            return {}
        if not isinstance(names, list) or not all(isinstance(n, str) and n.isidentifier() for n in names):
            raise StoreError(f"{self.prefix}/{MARKER_NAME} lists malformed metric names")
        if only is not None:
            names = [n for n in names if n in only]
        shape = (len(self.layers), self.num_heads, self.num_tokens)
        where = {name: name if self.format >= 3 else f"{ROW_METRICS_GROUP}/{name}" for name in names}
        return {name: self._read(where[name], self._array(where[name], shape, "f")) for name in names}

    @property
    def has_row_metrics(self) -> bool:
        return bool(self.meta.get("metrics"))

    def summary(self) -> dict[str, dict[str, Any]]:
        """:func:`attn_otel.metrics.summarize` of this capture's metrics: per-(layer, head) means and
        quantiles over the prompt rows and over the generated rows.  From the per-row metrics when they
        were stored (``ATTN_OTEL_ROW_METRICS``), else from the stored summary."""
        from .metrics import SUMMARY_METRICS, summarize, summary_from_array

        if self.has_row_metrics or self.meta.get("summary_metrics") is None:
            return summarize(self.metrics, self.prompt_len)
        try:
            arr = np.asarray(self.group["summary"][...])
            # seven metrics before the learned sink mass was one (store format 3 unchanged: it only adds)
            expected = [(2, m, 4, len(self.layers), self.num_heads) for m in (len(SUMMARY_METRICS), 7)]
            if arr.shape not in expected:
                raise ValueError(f"shape {list(arr.shape)}, expected {list(expected[0])}")
        except (KeyError, ValueError) as e:
            raise StoreError(f"{self.prefix}/summary is not an attn-otel summary ({e})") from None
        return summary_from_array(arr, self.meta["summary_metrics"])

    def to_xarray(self):
        """The capture as an ``xarray.Dataset``: ``attn`` (layer, head, query, key), the per-row metrics
        (layer, head, query), ``token_ids`` and ``vision_mask`` (query), ``summary`` (part, metric, stat,
        layer, head); coordinates ``layer`` (the model's layer numbers), ``head``, ``query`` and ``key``
        (token positions).  A format-3 capture is opened lazily with ``xarray.open_zarr`` (what
        ``xr.open_zarr(STORE/PREFIX, consolidated=False)`` gives); an older one, whose arrays name no
        dimensions, is read into memory in the same shape.  Needs ``pip install 'attn-otel[xarray]'``."""
        import xarray as xr

        attrs = {"attn_otel": self.meta}
        if self.format >= 3:
            import warnings

            with warnings.catch_warnings():  # COMPLETE and parts/ are ours, not zarr's: zarr says so
                warnings.filterwarnings("ignore", message=".*not recognized as a component of a Zarr hierarchy")
                ds = xr.open_zarr(self._store, group=self.prefix, consolidated=False)
            ds.attrs = attrs  # the COMPLETE marker, as for the older formats (the group's own is a subset)
            return ds
        T = self.num_tokens
        data: dict[str, Any] = {n: (("layer", "head", "query"), v) for n, v in self.metrics.items()}
        if self.has_maps:
            data["attn"] = (("layer", "head", "query", "key"), self._read("attn", self.attn))
        for name in ("token_ids", "vision_mask"):
            value = getattr(self, name)
            if value is not None:
                data[name] = (("query",), value)
        coords: dict[str, Any] = {"layer": np.asarray(self.layers, dtype=np.int32),
                                  "head": np.arange(self.num_heads, dtype=np.int32),
                                  "query": np.arange(T, dtype=np.int32), "key": np.arange(T, dtype=np.int32)}
        if self.meta.get("summary_metrics") is not None:
            from .metrics import PARTS, SUMMARY_METRICS, SUMMARY_STATS

            summary = np.asarray(self.group["summary"][...])
            data["summary"] = (("part", "metric", "stat", "layer", "head"), summary)
            coords.update(part=list(PARTS), metric=list(SUMMARY_METRICS[: summary.shape[1]]), stat=list(SUMMARY_STATS))
        return xr.Dataset(data, coords=coords, attrs=attrs)

    def layer_index(self, layer: int) -> int:
        try:
            return self.layers.index(int(layer))
        except ValueError:
            raise KeyError(f"layer {layer} was not captured (captured: {self.layers})") from None

    def maps(self, layers: Sequence[int] | None = None, heads: Sequence[int] | None = None) -> np.ndarray:
        """float32 ``[n_layers, n_heads, T, T]`` for the given model layers and heads (default: all)."""
        if not self.has_maps:
            raise LookupError(f"request {self.request_id} of trace {self.trace_id} has metrics only, no maps")
        li = [self.layer_index(x) for x in layers] if layers is not None else list(range(len(self.layers)))
        hi = list(heads) if heads is not None else list(range(self.num_heads))
        for h in hi:
            if not 0 <= int(h) < self.num_heads:
                raise KeyError(f"head {h} does not exist (the capture has {self.num_heads})")
        arr = self.attn
        out = np.empty((len(li), len(hi), self.num_tokens, self.num_tokens), dtype=np.float32)
        # one read per run of consecutive layers and heads (all of them, by default): zarr fetches and decodes
        # that run's chunks concurrently, where one read per layer and head went chunk by chunk (a 30-layer,
        # 9-head capture: 270 reads, each an S3 round trip on a remote store)
        for a0, a1, l0 in _runs(li):
            for b0, b1, h0 in _runs(hi):
                out[a0:a1, b0:b1] = self._read("attn", arr, (slice(l0, l0 + a1 - a0), slice(h0, h0 + b1 - b0)))
        return out


def _runs(index: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """``(start, stop, first)`` for each run of consecutive values in ``index``: positions ``start:stop`` of it
    hold ``first, first + 1, ...``."""
    start = 0
    for i in range(1, len(index) + 1):
        if i == len(index) or int(index[i]) != int(index[i - 1]) + 1:
            yield start, i, int(index[start])
            start = i


def list_captures(store: StoreLike = None) -> Iterator[Capture]:
    """Every complete capture in the store, trace by trace.  ``store``: a path, ``file://`` or ``s3://`` URL,
    a zarr Store instance, or None for ``ATTN_OTEL_STORE``."""
    zstore = _open(store)
    for trace_id in list_trace_ids(zstore):
        yield from _captures(zstore, trace_id)


def _captures(zstore, trace_id: str) -> list[Capture]:
    out = []
    for key in list_request_keys(zstore, trace_id):
        meta = read_summary(zstore, trace_id, key)
        if meta is not None:
            out.append(Capture(zstore, f"traces/{trace_id}/{key}", meta))
    out.sort(key=lambda c: c.meta.get("created", 0))
    return out


def open_trace(trace_id: str, store: StoreLike = None) -> list[Capture]:
    """The complete captures of one trace (one per captured request), oldest first.

    ``store``: a path, ``file://`` or ``s3://`` URL, a zarr Store instance (e.g. a wrapper that counts or
    caches reads), or None for ``ATTN_OTEL_STORE``.

    Raises ``ValueError`` for a malformed trace id (before the store is touched) and
    :class:`TraceNotFound` when the store has no complete capture for it.
    """
    trace_id = check_trace_id(trace_id)
    zstore = _open(store)
    caps = _captures(zstore, trace_id)
    if not caps:
        raise TraceNotFound(f"no capture of trace {trace_id} in {redact_url(_store_url(store))}")
    return caps
