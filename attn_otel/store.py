"""Captures as Zarr v3 groups, one per request, keyed by trace id.

Layout (``{store}`` is ``ATTN_OTEL_STORE``; ``(dims)`` are each array's zarr ``dimension_names``)::

    {store}/traces/{trace_id}/{request_key}/zarr.json        group; attributes hold the token metadata
    {store}/traces/{trace_id}/{request_key}/attn/...          float16 (layer, head, query, key), fill 0,
                                                              chunks (1, 1, ROWS, T): one layer+head is
                                                              ceil(T/ROWS) reads, a band of rows one read
    {store}/traces/{trace_id}/{request_key}/{metric}          float32 (layer, head, query), per query row
    {store}/traces/{trace_id}/{request_key}/token_ids        int32 (query) (only where asked: ATTN_OTEL_STORE_TOKENS,
                                                              else OTel's GenAI content-capture variable)
    {store}/traces/{trace_id}/{request_key}/vision_mask      bool (query), image-embedding positions (multimodal)
    {store}/traces/{trace_id}/{request_key}/summary          float32 (part, metric, stat, layer, head)
    {store}/traces/{trace_id}/{request_key}/layer, head      int32 coordinates: the model's layer numbers, 0..H-1
    {store}/traces/{trace_id}/{request_key}/query, key       int32 coordinates: token positions 0..T-1
    {store}/traces/{trace_id}/{request_key}/part, metric, stat   string coordinates of ``summary``
    {store}/traces/{trace_id}/{request_key}/parts/{i}        tensor/pipeline parallel only: part i's marker
    {store}/traces/{trace_id}/{request_key}/COMPLETE         JSON summary, written last

Every array names its dimensions and every dimension has a coordinate array of its name, so a capture's
group opens as one ``xarray.Dataset`` (``xr.open_zarr(path, consolidated=False)``, docs/xarray.md).

Tensor- and pipeline-parallel engines write one capture from several ranks, each its own slice (a
:class:`CapturePart`: a contiguous range of heads, the layers its pipeline stage holds) into the same
arrays.  Every array is chunked so that no chunk spans two parts (maps one head per chunk; summary and
per-row metrics ``heads/tp`` heads and, under pipeline parallelism, one layer per chunk), so the parts
never read-modify-write each other's chunks.  Each part writes its arrays, then ``parts/{i}``; the part
that finds all ``parts/*`` present claims ``COMPLETE`` with a conditional create (``O_EXCL`` on disk,
``If-None-Match: *`` on S3), so exactly one rank completes the capture and runs the exporters after the
store (one span, one set of histogram observations) on the merged summary it reads back.

A capture is visible to readers only once ``COMPLETE`` exists, so a writer killed mid-capture leaves
nothing that ``ls``, ``fetch`` or :func:`attn_otel.open_trace` report.  What such a writer leaves behind
(a *partial* capture) is found by :func:`list_stored` and removed by :func:`delete_capture`
(``attn-otel gc``).

S3 (``s3://bucket/prefix``) goes through s3fs with the standard AWS credential chain; the endpoint is
``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` when set.  Credentials in the URL itself are refused (they
would end up in logs, span attributes and process listings).  The bucket must exist: opening the store
checks it once and names it in the error.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import functools
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlunparse

import numpy as np

from .ids import check_trace_id, request_key

# The capture format written (the COMPLETE marker's and the group's ``format``), and those read.  3: the
# layout xarray opens: every array has dimension_names, the coordinates layer/head/query/key (and
# part/metric/stat for summary) are arrays of their own, and the per-row metrics sit beside ``attn``
# instead of in a ``metrics`` subgroup (a group opens as one Dataset; its subgroups do not); the old
# ``layers`` array is the coordinate ``layer``.  2: the lookback ratio is Lookback Lens's (the new tokens
# include the query's own, defined from the first generated row on; see attn_otel.attention); per-row
# metrics under ``metrics/``.  1: format 2's layout, but its ``lookback_ratio`` (per-row metrics and summary)
# left the query's own key out and began a row later; still read, its lookback values as stored.
FORMAT_VERSION = 3
READ_FORMATS = (1, 2, 3)
ROW_METRICS_GROUP = "metrics"  # where formats 1 and 2 keep the per-row metrics
# dimension names (zarr v3 ``dimension_names``; xarray's dims)
MAP_DIMS = ("layer", "head", "query", "key")
ROW_DIMS = ("layer", "head", "query")
SUMMARY_DIMS = ("part", "metric", "stat", "layer", "head")
MARKER = "COMPLETE"
PARTS_DIR = "parts"
# names a per-row metric must not take: the capture's other arrays and objects
RESERVED_NAMES = frozenset({"attn", "token_ids", "vision_mask", "summary", "layers", *MAP_DIMS, *SUMMARY_DIMS,
                            ROW_METRICS_GROUP, PARTS_DIR, MARKER, "zarr.json"})
ROWS_PER_CHUNK = 256


class StoreError(RuntimeError):
    """A store that cannot be opened, or an object in it that is not an attn-otel capture."""


@dataclasses.dataclass(frozen=True)
class CapturePart:
    """The slice of a capture that one rank of a tensor/pipeline-parallel engine holds and writes.

    ``index`` is the stage's position among the stages holding the capture's layers times ``tp`` plus the
    tensor-parallel rank; ``count`` is how many parts the capture has.  ``heads`` is ``[start, stop)`` of
    the capture's heads; ``layers`` the model layers this part holds (a subset of the record's layers).
    """

    index: int
    count: int
    heads: tuple[int, int]
    layers: tuple[int, ...]
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "heads", tuple(int(h) for h in self.heads))
        object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        if not (0 <= self.index < self.count and len(self.heads) == 2 and 0 <= self.heads[0] < self.heads[1]
                and self.tp >= 1 and self.pp >= 1 and self.count <= self.tp * self.pp):
            raise ValueError(f"inconsistent capture part {self}")

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "count": self.count, "heads": list(self.heads), "layers": list(self.layers),
                "tp": self.tp, "pp": self.pp}


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
    # Tensor/pipeline parallel: this record is one rank's part.  ``layers`` and ``num_heads`` still describe
    # the whole capture; ``maps`` is [len(part.layers), part heads, T, T] and each metric [.., .., T].
    part: CapturePart | None = None
    sampled: bool = True  # the client's W3C sampled flag (a ``-00`` traceparent: the span is not sampled)

    def __post_init__(self) -> None:
        if isinstance(self.part, dict):  # from the writer process's JSON
            self.part = CapturePart(**self.part)

    def nbytes(self) -> int:
        n = 0 if self.maps is None else self.maps.nbytes
        n += 0 if self.token_ids is None else self.token_ids.nbytes
        return n + sum(v.nbytes for v in self.metrics.values())


def redact_url(url: str | os.PathLike) -> str:
    """The store URL as it may appear in messages: any ``user:password@`` part replaced by ``***@``."""
    text = os.fspath(url)
    parsed = urlparse(text)
    if parsed.scheme and "@" in parsed.netloc:
        return urlunparse(parsed._replace(netloc="***@" + parsed.netloc.rsplit("@", 1)[1]))
    return text


def open_zarr_store(url: str | os.PathLike, *, read_only: bool = False):
    """A zarr Store for a path, ``file://`` URL or ``s3://bucket/prefix``.

    Raises :class:`StoreError` for an unsupported URL, a local store that does not exist (read-only), and
    for S3: a missing bucket, denied access or an unreachable endpoint, each naming the bucket.
    """
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
        if "@" in parsed.netloc:
            raise StoreError(f"store URL {redact_url(text)!r} carries credentials: use the AWS credential chain "
                             "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a profile or an instance role)")
        if not parsed.netloc:
            raise StoreError(f"store URL {text!r} names no bucket: use s3://bucket/prefix")
        try:
            from zarr.storage import FsspecStore

            store = FsspecStore.from_url(text.rstrip("/"), read_only=read_only, storage_options=_s3_options())
        except ImportError as e:
            raise StoreError(f"s3 stores need the 's3' extra (pip install 'attn-otel[s3]'): {e}") from None
        # botocore's standard mode already retries transient errors with backoff; s3fs's own loop on top
        # (5 tries by default) would multiply every timeout by five.
        store.fs.retries = 1
        _check_bucket(store, parsed.netloc)
        return store
    raise StoreError(f"unsupported store URL {redact_url(text)!r}: use a path, file://PATH or s3://bucket/prefix")


def _s3_options() -> dict[str, Any]:
    from .config import S3_MAX_ATTEMPTS, s3_timeout_s

    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    # Bounded waits: botocore's defaults (60 s to connect, 60 s per read, 5 legacy attempts) under s3fs's own
    # 5 retries would let an endpoint that stops answering hold a writer for many minutes per request.
    timeout = s3_timeout_s()
    config: dict[str, Any] = {"connect_timeout": timeout, "read_timeout": timeout}
    if not (os.environ.get("AWS_MAX_ATTEMPTS") or os.environ.get("AWS_RETRY_MODE")):
        config["retries"] = {"max_attempts": S3_MAX_ATTEMPTS, "mode": "standard"}  # the standard env wins
    # No listings cache: s3fs would otherwise answer a long-lived reader's listings from memory and never
    # show it the captures other processes wrote since.
    return {"asynchronous": True, "use_listings_cache": False, "config_kwargs": config,
            **({"endpoint_url": endpoint} if endpoint else {})}


def _check_bucket(store, bucket: str) -> None:
    """One HEAD on the bucket, so that a typo is an error now and not a silently empty listing later."""
    endpoint = getattr(store.fs, "endpoint_url", None)
    where = f" at {endpoint}" if endpoint else ""
    try:
        _sync(store.fs._call_s3("head_bucket", Bucket=bucket))
    except FileNotFoundError:
        raise StoreError(f"S3 bucket {bucket!r} does not exist{where}") from None
    except PermissionError:
        raise StoreError(f"access to S3 bucket {bucket!r}{where} denied: check the AWS credentials") from None
    except Exception as e:  # noqa: BLE001 - endpoint down, DNS, TLS: say which bucket and why, in one line
        raise StoreError(f"cannot reach S3 bucket {bucket!r}{where}: {type(e).__name__}: {e}") from None


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


def write_capture(store, record: CaptureRecord, *, rows: bool = True,
                  summary: dict[str, Any] | None = None) -> int:
    """Write one capture, marker last (see :func:`write_capture_part` for a record that is one rank's part).
    Returns the bytes handed to the store (before compression)."""
    return write_capture_part(store, record, rows=rows, summary=summary)[0]


def write_capture_part(store, record: CaptureRecord, *, rows: bool = True,
                       summary: dict[str, Any] | None = None) -> tuple[int, dict[str, Any] | None]:
    """Write one rank's part of a capture (its heads of its layers), then its part marker; or, for a record
    that is no part, the whole capture.  Returns ``(bytes, marker)``: ``marker`` is the capture's ``COMPLETE``
    marker when this call completed the capture (always for a whole capture; for a part, when every part's
    marker was present and this rank won the conditional create), else None."""
    if record.part is None:
        return _sync(_write_capture(store, record, rows, summary))
    return _sync(_write_part(store, record, rows, summary))


async def _write_capture(store, record: CaptureRecord, rows: bool = True,
                         summary_stats: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    """Write one capture by one writer, marker last.  Returns the bytes handed to the store (before
    compression) and the marker.

    ``rows=False`` leaves the per-row metrics out; ``summary_stats`` (:func:`attn_otel.metrics.summarize`
    of them) is then stored as one small ``summary`` array ``[part, metric, stat, layer, head]``.

    The capture is built in memory first (a ``MemoryStore``: its groups, arrays and their small chunks), then
    every object is put to the store concurrently, the maps' chunks straight from the encoder; the
    ``COMPLETE`` marker goes only after all of them have landed.  zarr's own create calls look before they
    write (``exists``, parents' metadata): on S3 a metrics capture cost 101 HEAD, 62 GET and 25 PUT requests,
    where its objects are 25 PUTs (:func:`_put_parents` makes the parents once a process)."""
    import asyncio

    from zarr.api.asynchronous import open_group
    from zarr.core.array import AsyncArray
    from zarr.storage import MemoryStore, StorePath

    prefix = capture_prefix(record.trace_id, record.request_id)
    meta = summary(record)
    if not rows:
        meta["metrics"] = []
    if summary_stats is not None:
        meta["summary_metrics"] = sorted(n for n in record.metrics)
    store = _bounded(store)
    staged = MemoryStore()
    group = await open_group(store=staged, path=prefix, mode="w", attributes={"attn_otel": meta})
    written = 0
    jobs = []
    if record.maps is not None:
        L, H, T, T2 = record.maps.shape
        assert T == T2 == record.num_tokens, (record.maps.shape, record.num_tokens)

        async def maps():  # its metadata staged, its chunks (most of the capture's bytes) put where they go
            made = await group.create_array(
                "attn", shape=(L, H, T, T), dtype="float16", chunks=(1, 1, min(T, ROWS_PER_CHUNK), T),
                fill_value=0.0, dimension_names=MAP_DIMS)
            arr = AsyncArray(metadata=made.metadata, store_path=StorePath(store, f"{prefix}/attn"),
                             config=made.config)
            await arr.setitem(slice(None), record.maps)

        jobs.append(maps())
        written += record.maps.nbytes
    jobs.extend(_coordinates(group, record, summary_stats is not None, _create_and_write))
    if record.token_ids is not None:
        jobs.append(_create_and_write(group, "token_ids", np.asarray(record.token_ids, dtype=np.int32), ("query",)))
        written += record.token_ids.nbytes
    if record.vision_mask is not None:
        jobs.append(_create_and_write(group, "vision_mask", np.asarray(record.vision_mask, dtype=bool), ("query",)))
    if summary_stats is not None:
        from .metrics import summary_to_array

        arr = summary_to_array(summary_stats, len(record.layers), int(record.num_heads))
        jobs.append(group.create_array("summary", data=arr, attributes=_summary_attributes(),
                                       dimension_names=SUMMARY_DIMS))
        written += arr.nbytes
    if record.metrics and rows:
        _check_metrics(record.metrics, (len(record.layers), int(record.num_heads), int(record.num_tokens)))
        jobs.extend(group.create_array(name, data=np.ascontiguousarray(value, dtype=np.float32),
                                       dimension_names=ROW_DIMS)
                    for name, value in record.metrics.items())
        written += sum(v.nbytes for v in record.metrics.values())
    await asyncio.gather(*jobs)
    from zarr.core.buffer import default_buffer_prototype

    proto = default_buffer_prototype()
    keys = [k async for k in staged.list()]
    mine = [k for k in keys if k.startswith(prefix + "/")]
    await _put_parents(store, staged, [k for k in keys if not k.startswith(prefix + "/")])
    gate = asyncio.Semaphore(_PUT_CONCURRENCY)

    async def put(key: str) -> None:
        async with gate:
            await store.set(key, await staged.get(key, prototype=proto))

    await asyncio.gather(*(put(k) for k in mine))
    await store.set(f"{prefix}/{MARKER}", proto.buffer.from_bytes(json.dumps(meta).encode()))
    return written, meta


def _bounded(store):
    """An S3 store whose every call ends within :func:`op_timeout_s`, else raises ``TimeoutError`` (a local store
    as it is).  botocore's timeouts do not cover every wait: a PUT sent with ``Expect: 100-continue`` to an
    endpoint that accepts connections and never answers waits for the ``100 Continue`` with no timeout at all
    (aiohttp), and held the writer until its watchdog replaced it (ATTN_OTEL_WRITER_TIMEOUT_S, 84 s in
    tests/reliability/test_faults.py's hung endpoint; the endpoint back, its dead connections still hung)."""
    if getattr(_unwrap(store), "fs", None) is None:
        return store
    return _bounded_class()(store, op_timeout_s())


@functools.cache
def _bounded_class():
    """The store class of :func:`_bounded`, made once (zarr is imported on first use in this module)."""
    import asyncio

    from zarr.storage import WrapperStore

    class _Bounded(WrapperStore):
        def __init__(self, store, limit: float):
            super().__init__(store)
            self.limit = limit

        def _with_store(self, inner):
            return type(self)(inner, self.limit)

        async def _within(self, what: str, key: str, call):
            try:
                return await asyncio.wait_for(call, self.limit)
            except asyncio.TimeoutError:
                raise TimeoutError(f"S3 {what} of {key!r} took over {self.limit:g} s (ATTN_OTEL_S3_TIMEOUT_S x "
                                   "attempts)") from None

        async def get(self, key, prototype, byte_range=None):
            return await self._within("get", key, self._store.get(key, prototype, byte_range))

        async def exists(self, key):
            return await self._within("exists", key, self._store.exists(key))

        async def set(self, key, value):
            return await self._within("put", key, self._store.set(key, value))

        async def set_if_not_exists(self, key, value):
            return await self._within("put", key, self._store.set_if_not_exists(key, value))

    return _Bounded


def op_timeout_s(env=None) -> float:
    """How long one store call may take on S3: every attempt at the S3 timeout (ATTN_OTEL_S3_TIMEOUT_S, for the
    connection and for each read), twice over, and botocore's backoff between them."""
    from .config import S3_MAX_ATTEMPTS, s3_timeout_s

    return S3_MAX_ATTEMPTS * 2 * s3_timeout_s(env) + 2.0 ** S3_MAX_ATTEMPTS


_PUT_CONCURRENCY = 16  # a capture's objects put at once (about 25 for metrics, more with maps)
_PARENTS_SEEN: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
_PARENTS_SEEN_MAX = 4096  # (store, key) pairs remembered: the root, "traces" and recent traces' groups


async def _put_parents(store, staged, keys: list[str]) -> None:
    """The capture's parent groups' metadata (the root, ``traces``, its trace), each created only where it is
    missing, as zarr creates them, and looked at once a process for each store (the capture's own objects are
    new, and put without looking): rewriting a document a reader may be opening is never done."""
    import asyncio

    from zarr.core.buffer import default_buffer_prototype

    proto = default_buffer_prototype()

    async def one(key: str) -> None:
        # the store's location under any wrapper (_bounded makes one a call), not its id: a later store object
        # at the same address, for another location, would skip its parents
        seen = (str(_unwrap(store)), key)
        if seen in _PARENTS_SEEN:
            _PARENTS_SEEN.move_to_end(seen)
            return
        await store.set_if_not_exists(key, await staged.get(key, prototype=proto))
        _PARENTS_SEEN[seen] = None
        while len(_PARENTS_SEEN) > _PARENTS_SEEN_MAX:
            _PARENTS_SEEN.popitem(last=False)

    await asyncio.gather(*(one(k) for k in keys))


def _check_metrics(metrics: dict[str, Any], shape: tuple[int, ...]) -> None:
    """Per-row metrics are ``(layer, head, query)`` arrays (a part's own layers and heads), named unlike the
    capture's other arrays: they sit beside them."""
    clash = sorted(set(metrics) & RESERVED_NAMES)
    if clash:
        raise StoreError(f"per-row metric names {clash} are names of the capture's own arrays")
    bad = {name: np.shape(v) for name, v in metrics.items() if np.shape(v) != shape}
    if bad:
        raise StoreError(f"per-row metrics {bad} are not of shape {shape} (layer, head, query)")


def _coordinates(group, record: CaptureRecord, with_summary: bool, write) -> list:
    """Jobs writing the coordinate arrays: ``layer`` (the model's layer numbers), ``head``, ``query`` and
    ``key`` (token positions), and with a summary its labels ``part``, ``metric`` and ``stat``.  ``write``
    is :func:`_create_and_write` (one writer) or :func:`_ensure_and_write` (a part of a parallel capture)."""
    from .metrics import PARTS, SUMMARY_METRICS, SUMMARY_STATS

    positions = np.arange(int(record.num_tokens), dtype=np.int32)
    jobs = [write(group, "layer", np.asarray(record.layers, dtype=np.int32), ("layer",)),
            write(group, "head", np.arange(int(record.num_heads), dtype=np.int32), ("head",)),
            write(group, "query", positions, ("query",)), write(group, "key", positions, ("key",))]
    if with_summary:
        jobs += [_write_labels(group, name, labels, write)
                 for name, labels in (("part", PARTS), ("metric", SUMMARY_METRICS), ("stat", SUMMARY_STATS))]
    return jobs


async def _write_labels(group, name: str, labels, write) -> None:
    """A string coordinate (zarr's variable-length UTF-8 ``string`` type, which xarray reads as str)."""
    await write(group, name, np.array(list(labels), dtype=np.dtypes.StringDType()), (name,))


async def _create_and_write(group, name: str, data: np.ndarray, dims: tuple[str, ...]) -> None:
    dtype = str if data.dtype.kind == "T" else data.dtype
    arr = await group.create_array(name, shape=data.shape, dtype=dtype, chunks=data.shape or (1,),
                                   dimension_names=dims)
    await arr.setitem(slice(None), data)


def _summary_attributes() -> dict[str, Any]:
    """The ``summary`` array's attributes: the names along its first three axes."""
    from .metrics import PARTS, SUMMARY_METRICS, SUMMARY_STATS

    return {"axes": ["part", "metric", "stat", "layer", "head"], "parts": list(PARTS),
            "metrics": list(SUMMARY_METRICS), "stats": list(SUMMARY_STATS)}


async def _ensure_array(group, name: str, **kwargs):
    """Create an array, or open it when another part created it first.  Every part creates it from the
    same arguments, so the metadata documents are identical and a race between two creators is harmless."""
    import asyncio

    from zarr.errors import ContainsArrayError, ContainsGroupError

    try:
        return await group.create_array(name, overwrite=False, **kwargs)
    except (ContainsArrayError, ContainsGroupError, FileExistsError):
        for attempt in range(5):  # the other part may be writing the metadata document at this very moment
            try:
                arr = await group.getitem(name)
                break
            except Exception:  # noqa: BLE001 - half-written JSON, or not listed yet
                if attempt == 4:
                    raise
                await asyncio.sleep(0.05 * (attempt + 1))
        if tuple(arr.shape) != tuple(kwargs["shape"]):
            raise StoreError(f"{group.path}/{name} has shape {tuple(arr.shape)}, this part expects "
                             f"{tuple(kwargs['shape'])}: two engines wrote the same request id") from None
        return arr


async def _ensure_group(store, path: str, attributes: dict[str, Any]):
    from zarr.api.asynchronous import open_group
    from zarr.errors import ContainsGroupError

    try:
        return await open_group(store=store, path=path, mode="a", attributes=attributes)
    except (ContainsGroupError, FileExistsError):  # another part created it between our look and our write
        return await open_group(store=store, path=path, mode="r+")


async def _claim(store, key: str, data: bytes) -> bool:
    """Create ``key`` only if it does not exist; True when this call created it.  Atomic on local disk
    (``O_EXCL``) and on S3 (``If-None-Match: *``); other stores fall back to look-then-write."""
    from zarr.core.buffer import default_buffer_prototype

    inner = _unwrap(store)
    buf = default_buffer_prototype().buffer.from_bytes(data)
    if hasattr(inner, "root"):  # LocalStore
        try:
            await inner._set(key, buf, exclusive=True)
            return True
        except FileExistsError:
            return False
    fs = getattr(inner, "fs", None)
    if fs is not None and hasattr(fs, "_call_s3"):
        bucket, _, prefix = str(inner.path).partition("/")
        full = f"{prefix.rstrip('/')}/{key}" if prefix else key
        try:
            await fs._call_s3("put_object", Bucket=bucket, Key=full, Body=data, IfNoneMatch="*")
            return True
        except Exception as e:  # noqa: BLE001 - 412: another part completed it
            text = f"{type(e).__name__} {e}"
            if "412" in text or "PreconditionFailed" in text or isinstance(e, FileExistsError):
                return False
            raise
    if await store.exists(key):
        return False
    await store.set(key, buf)
    return True


async def _write_part(store, record: CaptureRecord, rows: bool, summary_stats: dict[str, Any] | None):
    import asyncio

    from zarr.core.buffer import default_buffer_prototype

    part = record.part
    assert part is not None
    store = _bounded(store)
    prefix = capture_prefix(record.trace_id, record.request_id)
    L, H, T = len(record.layers), int(record.num_heads), int(record.num_tokens)
    missing = [x for x in part.layers if x not in record.layers]
    if missing or part.heads[1] > H:
        raise StoreError(f"capture part {part.index} holds layers {list(part.layers)} and heads "
                         f"{list(part.heads)}; the capture has layers {list(record.layers)} and {H} heads")
    pos = [list(record.layers).index(x) for x in part.layers]
    h0, h1 = part.heads
    hp = h1 - h0
    whole_layers = pos == list(range(L))
    lchunk = L if part.pp == 1 else 1  # pipeline stages hold different layers: one layer per chunk
    group = await _ensure_group(store, prefix, {"attn_otel": {k: v for k, v in summary(record).items()
                                                              if k in _SUMMARY_FIELDS or k == "format"}})

    async def region(arr, data, axis: int) -> None:
        """This part's heads of its layers; ``axis`` is the array's layer axis (heads follow it)."""
        lead = (slice(None),) * axis
        if whole_layers:
            await arr.setitem(lead + (slice(None), slice(h0, h1)), data)
        else:
            await asyncio.gather(*(arr.setitem(lead + (li, slice(h0, h1)), np.take(data, j, axis=axis))
                                   for j, li in enumerate(pos)))

    written = 0
    jobs = []
    if record.maps is not None:
        if record.maps.shape != (len(pos), hp, T, T):
            raise StoreError(f"part maps have shape {record.maps.shape}, expected {(len(pos), hp, T, T)}")

        async def maps():
            arr = await _ensure_array(group, "attn", shape=(L, H, T, T), dtype="float16",
                                      chunks=(1, 1, min(T, ROWS_PER_CHUNK), T), fill_value=0.0,
                                      dimension_names=MAP_DIMS)
            await region(arr, record.maps, 0)

        jobs.append(maps())
        written += record.maps.nbytes
    if part.index == 0:  # the same for every part: one writer
        jobs.extend(_coordinates(group, record, summary_stats is not None, _ensure_and_write))
        if record.vision_mask is not None:
            jobs.append(_ensure_and_write(group, "vision_mask", np.asarray(record.vision_mask, dtype=bool),
                                          ("query",)))
    if record.token_ids is not None:  # only the rank that samples passes token ids (see the engine)
        jobs.append(_ensure_and_write(group, "token_ids", np.asarray(record.token_ids, dtype=np.int32), ("query",)))
        written += record.token_ids.nbytes
    if summary_stats is not None:
        from .metrics import summary_to_array

        data = summary_to_array(summary_stats, len(pos), hp)

        async def summary_part():
            arr = await _ensure_array(group, "summary", shape=data.shape[:3] + (L, H), dtype="float32",
                                      chunks=data.shape[:3] + (lchunk, hp), fill_value=float("nan"),
                                      attributes=_summary_attributes(), dimension_names=SUMMARY_DIMS)
            await region(arr, data, 3)

        jobs.append(summary_part())
        written += data.nbytes
    if record.metrics and rows:
        _check_metrics(record.metrics, (len(pos), hp, T))

        async def row_metric(name, value):
            arr = await _ensure_array(group, name, shape=(L, H, T), dtype="float32", chunks=(lchunk, hp, T),
                                      fill_value=float("nan"), dimension_names=ROW_DIMS)
            await region(arr, np.ascontiguousarray(value, dtype=np.float32), 0)

        jobs.extend(row_metric(n, v) for n, v in record.metrics.items())
        written += sum(v.nbytes for v in record.metrics.values())
    await asyncio.gather(*jobs)
    mine = {**part.to_json(), "maps": record.maps is not None, "rows": bool(record.metrics and rows),
            "metrics": sorted(record.metrics), "summary": summary_stats is not None,
            "token_ids": record.token_ids is not None, "vision_mask": record.vision_mask is not None,
            "created": record.created, "span_id": record.span_id}
    proto = default_buffer_prototype()
    await store.set(f"{prefix}/{PARTS_DIR}/{part.index}", proto.buffer.from_bytes(json.dumps(mine).encode()))
    names = [x async for x in store.list_dir(f"{prefix}/{PARTS_DIR}/")]
    if len({n.rstrip("/") for n in names} & {str(i) for i in range(part.count)}) < part.count:
        return written, None
    parts = []
    for i in range(part.count):
        buf = await store.get(f"{prefix}/{PARTS_DIR}/{i}", prototype=proto)
        parts.append(json.loads(buf.to_bytes()))
    meta = summary(record)
    meta.update(
        created=min(float(p["created"]) for p in parts), maps=all(p["maps"] for p in parts),
        metrics=sorted(record.metrics) if all(p["rows"] for p in parts) else [],
        token_ids=any(p["token_ids"] for p in parts), vision_mask=any(p["vision_mask"] for p in parts),
        parts=part.count, parallel={"tp": part.tp, "pp": part.pp})
    written_layers = {int(x) for p in parts for x in p["layers"]}
    empty = [int(x) for x in record.layers if int(x) not in written_layers]
    if empty:  # a stage's layer it could not capture (e.g. sliding window): fill values, and said so
        meta["empty_layers"] = empty
    if all(p["summary"] for p in parts):
        meta["summary_metrics"] = sorted(record.metrics)
    if not await _claim(store, f"{prefix}/{MARKER}", json.dumps(meta).encode()):
        return written, None
    return written, meta


async def _ensure_and_write(group, name: str, data: np.ndarray, dims: tuple[str, ...]) -> None:
    dtype = str if data.dtype.kind == "T" else data.dtype
    arr = await _ensure_array(group, name, shape=data.shape, dtype=dtype, chunks=data.shape or (1,),
                              dimension_names=dims)
    await arr.setitem(slice(None), data)


def read_stored_summary(store, trace_id: str, request_id: str, meta: dict[str, Any]) -> dict[str, Any]:
    """The summary of a complete capture as stored (all parts merged), for the exporters after the store."""
    from .metrics import summary_from_array

    import zarr

    arr = zarr.open_array(store=store, path=f"{capture_prefix(trace_id, request_id)}/summary", mode="r")
    return summary_from_array(np.asarray(arr[...]), meta.get("summary_metrics") or [])


def list_trace_ids(store) -> list[str]:
    out = []
    for n in _list_dir(store, "traces/"):
        n = n.rstrip("/")
        try:
            out.append(check_trace_id(n))
        except ValueError:
            continue  # foreign objects under traces/ are not ours to report
    return sorted(out)


def list_request_keys(store, trace_id: str) -> list[str]:
    """The request keys under one trace (the trace group's own ``zarr.json`` is not one)."""
    names = (n.rstrip("/") for n in _list_dir(store, f"traces/{check_trace_id(trace_id)}/"))
    return sorted(n for n in names if n and n != "zarr.json")


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
        if not isinstance(meta, dict) or meta.get("format") not in READ_FORMATS:
            raise ValueError("unknown format")
        bad = [k for k, kind in _SUMMARY_FIELDS.items() if not isinstance(meta.get(k), kind)]
        if not bad and not all(isinstance(x, int) for x in meta["layers"]):
            bad = ["layers"]
        if bad:
            raise ValueError(f"missing or malformed {', '.join(bad)}")
    except ValueError as e:
        raise StoreError(f"traces/{trace_id}/{key}/{MARKER} is not an attn-otel capture marker ({e})") from None
    return meta


# --- what is stored, complete or not, and removing it (``attn-otel gc``) --------------------------------

@dataclasses.dataclass
class StoredCapture:
    """One capture's objects as the store lists them: complete (marker present) or partial."""

    trace_id: str
    key: str  # the request key: :func:`attn_otel.ids.request_key` of the request id
    complete: bool
    nbytes: int  # stored bytes of all its objects (after compression)
    objects: int
    modified: float  # newest object's modification time, unix seconds
    age_s: float | None = None  # set by collect_garbage: see capture_age

    @property
    def prefix(self) -> str:
        return f"traces/{self.trace_id}/{self.key}"


def _unwrap(store):
    while hasattr(store, "_store") and not hasattr(store, "root") and not hasattr(store, "fs"):
        store = store._store  # a zarr WrapperStore
    return store


def _timestamp(info: dict[str, Any]) -> float:
    for name in ("LastModified", "mtime", "last_modified", "created"):
        value = info.get(name)
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
    return time.time()  # unknown: treat as new, so that nothing is collected on a guess


def _objects(store, prefix: str) -> list[tuple[str, int, float]]:
    """``(key, size, mtime)`` of every object under ``prefix`` (zarr's Store API has sizes but no times)."""
    base = _unwrap(store)
    prefix = prefix.strip("/")
    if hasattr(base, "root"):  # LocalStore
        root = Path(base.root)
        out = []
        for dirpath, _dirs, files in os.walk(root / prefix):
            for name in files:
                path = Path(dirpath, name)
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue  # removed while we walked
                out.append((path.relative_to(root).as_posix(), st.st_size, st.st_mtime))
        return out
    if hasattr(base, "fs"):  # FsspecStore
        top = f"{base.path}/{prefix}" if base.path else prefix

        async def find():
            try:
                return await base.fs._find(top, detail=True)
            except FileNotFoundError:
                return {}

        out = []
        for path, info in _sync(find()).items():
            if info.get("type") == "directory":
                continue
            key = path[len(base.path) + 1:] if base.path else path
            out.append((key, int(info.get("size") or 0), _timestamp(info)))
        return out
    raise StoreError(f"cannot list object times in a {type(base).__name__}: garbage collection needs a local or "
                     "fsspec (S3) store")


def list_stored(store) -> list[StoredCapture]:
    """Every capture in the store, complete or partial, with its size and newest modification time."""
    found: dict[tuple[str, str], StoredCapture] = {}
    for key, size, mtime in _objects(store, "traces"):
        parts = key.split("/")
        if len(parts) < 4 or parts[0] != "traces":
            continue  # group metadata of traces/ and traces/{trace_id}/, not part of a capture
        try:
            trace_id = check_trace_id(parts[1])
        except ValueError:
            continue  # foreign objects are not ours to report or delete
        cap = found.setdefault((trace_id, parts[2]), StoredCapture(trace_id, parts[2], False, 0, 0, 0.0))
        cap.nbytes += size
        cap.objects += 1
        cap.modified = max(cap.modified, mtime)
        if len(parts) == 4 and parts[3] == MARKER:
            cap.complete = True
    return sorted(found.values(), key=lambda c: (c.trace_id, c.key))


def list_partial(store, *, older_than_s: float = 0.0, now: float | None = None) -> list[StoredCapture]:
    """Captures without a marker whose newest object is older than ``older_than_s``: what a killed writer
    left.  A capture still being written has a fresh object, so a grace period of minutes keeps it."""
    now = time.time() if now is None else now
    return [c for c in list_stored(store) if not c.complete and now - c.modified > older_than_s]


def capture_age(store, cap: StoredCapture, now: float | None = None) -> float:
    """Seconds since a capture was made: its marker's ``created``, else (partial or unreadable marker) since
    its newest object was written."""
    now = time.time() if now is None else now
    if cap.complete:
        try:
            meta = json.loads(_get_bytes(store, f"{cap.prefix}/{MARKER}") or b"null")
            return now - float(meta["created"])
        except (ValueError, TypeError, KeyError):
            pass
    return now - cap.modified


def delete_capture(store, trace_id: str, key: str) -> int:
    """Delete one capture (complete or partial) and return the bytes freed.

    The marker goes first, so a reader never sees a complete capture with some of its chunks gone (S3 has
    no atomic delete of a prefix).  The trace's own group metadata goes too once no capture is left in it.
    """
    trace_id = check_trace_id(trace_id)
    if not key or "/" in key or key in (".", ".."):
        raise ValueError(f"not a request key: {key!r}")
    prefix = f"traces/{trace_id}/{key}"
    objects = _objects(store, prefix)
    if not objects:
        return 0
    base = _unwrap(store)
    marker = f"{prefix}/{MARKER}"
    if any(k == marker for k, _, _ in objects):
        _sync(store.delete(marker))
    rest = [k for k, _, _ in objects if k != marker]
    if hasattr(base, "root"):
        shutil.rmtree(Path(base.root) / prefix, ignore_errors=True)
    elif hasattr(base, "fs") and rest:
        _sync(base.fs._rm([f"{base.path}/{k}" if base.path else k for k in rest]))
    else:
        for k in rest:
            _sync(store.delete(k))
    _drop_empty_trace(store, trace_id)
    return sum(size for _, size, _ in objects)


def _drop_empty_trace(store, trace_id: str) -> None:
    names = [n.rstrip("/") for n in _list_dir(store, f"traces/{trace_id}/")]
    if any(n != "zarr.json" for n in names):
        return
    if "zarr.json" in names:
        _sync(store.delete(f"traces/{trace_id}/zarr.json"))
    base = _unwrap(store)
    if hasattr(base, "root"):
        try:
            (Path(base.root) / "traces" / trace_id).rmdir()
        except OSError:
            pass  # a writer started a new capture of this trace meanwhile


def _list_dir(store, prefix: str) -> list[str]:
    async def collect():
        return [x async for x in store.list_dir(prefix)]

    try:
        return _sync(collect())
    except FileNotFoundError:
        return []


def collect_garbage(store, *, grace_s: float = 600.0, older_than_s: float | None = None, dry_run: bool = False,
                    now: float | None = None) -> list[StoredCapture]:
    """Delete partial captures idle for longer than ``grace_s`` and, with ``older_than_s``, complete captures
    made longer ago than that.  Returns what was deleted (or, with ``dry_run``, what would be)."""
    now = time.time() if now is None else now
    doomed = []
    for cap in list_stored(store):
        if cap.complete:
            if older_than_s is not None:
                cap.age_s = capture_age(store, cap, now)
                if cap.age_s > older_than_s:
                    doomed.append(cap)
        else:
            cap.age_s = now - cap.modified
            if cap.age_s > grace_s:
                doomed.append(cap)
    if not dry_run:
        for cap in doomed:
            cap.nbytes = delete_capture(store, cap.trace_id, cap.key)
    return doomed
