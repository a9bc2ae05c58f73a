"""Every ``ATTN_OTEL_*`` variable, defined and documented once, parsed into a frozen :class:`Config`.

Explicit arguments to :meth:`Config.from_env` override the environment.  A bad value never raises out of
the serving path: :meth:`Config.from_env` logs one warning and falls back to the default.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Mapping, Sequence

logger = logging.getLogger("attn_otel")

ATTN_OTEL = "ATTN_OTEL"
"""``1`` turns capture on.  Unset or ``0``: the plugin returns at once, nothing is patched or allocated."""

ATTN_OTEL_STORE = "ATTN_OTEL_STORE"
"""Where captures go: a path, ``file://PATH`` or ``s3://bucket/prefix``.  Default ``./attn-otel-data``."""

ATTN_OTEL_LAYERS = "ATTN_OTEL_LAYERS"
"""Layers whose queries are kept on the device: ``all``, ``auto`` or a list such as ``0,8,16``.

``auto`` (the default) keeps at most :data:`AUTO_LAYERS` layers, evenly spaced from the first to the last.
Each captured layer costs ``(num_q_heads + num_kv_heads) * head_dim * dtype_bytes`` per KV-cache token,
taken from the KV cache budget (the KV cache shrinks so that the total stays what vLLM was given)."""

ATTN_OTEL_MAP_LAYERS = "ATTN_OTEL_MAP_LAYERS"
"""Which of the captured layers can have maps: ``auto`` (the default), ``all`` or a list such as ``0,16``.

A map layer keeps its queries and keys for the request's whole life (the Q/K tap, ``(num_q_heads +
num_kv_heads) * head_dim * dtype_bytes`` per KV-cache token) so that its full maps can be computed when the
request finishes.  Every other captured layer is *streamed*: its per-row metrics are computed while the
request runs and its queries dropped (``4 * num_q_heads * 2`` bytes per token for a text model, keys read
from vLLM's own cache; see :func:`attn_otel.stream.slot_rows`).  ``auto`` makes every captured layer a map
layer when at most :data:`AUTO_LAYERS` are captured, and
otherwise :data:`AUTO_LAYERS` of them, evenly spaced.  A maps capture covers the map layers."""

ATTN_OTEL_STREAM_ROWS = "ATTN_OTEL_STREAM_ROWS"
"""Rows of the streamed layers' query ring (see ``ATTN_OTEL_MAP_LAYERS``): queries wait there until their
metrics are computed, in batches, when the ring fills or their request finishes.  ``0`` (default): 8192.
Never fewer than one step's ring tokens: vLLM's ``max_num_seqs`` (times 1 + the speculative tokens) with
direct rows (``ATTN_OTEL_STREAM_DIRECT``), else ``max_num_batched_tokens``.  Costs ``rows * num_q_heads * head_dim *
dtype_bytes`` per streamed layer, taken from the KV cache budget."""

ATTN_OTEL_STREAM_DIRECT = "ATTN_OTEL_STREAM_DIRECT"
"""``1``: a streamed layer computes a prefill chunk's rows in the forward, right after its attention, from the
forward's own queries, so that the query ring holds decode tokens only and is sized by ``max_num_seqs``
(times 1 + the speculative tokens), not by ``max_num_batched_tokens``; ``0``: every token goes through the
ring and is computed by its flushes on the side stream.  ``auto`` (default): ``1`` where the kernels go beside
the forward (``ATTN_OTEL_DIRECT_STREAM=side``, the default: run 47 measured the default's 4 layers with them at
x0.975-0.989 of capture off on the four offline workloads, against run 45's x0.961-0.983 with the ring); with
them on vLLM's stream, ``1`` only where that shrinks the ring by at least :data:`DIRECT_AUTO_SHARE` of the KV
budget vLLM computed (:data:`DIRECT_AUTO_BYTES` where it is not known), since in the forward's order they cost
more than the ring's flushes (docs/benchmarks/history.md, run 27).  Off where vLLM runs mixed batches as full
CUDA graphs.  A chunk behind rows still pending in the ring has those flushed first."""

DIRECT_AUTO_SHARE = 0.01
DIRECT_AUTO_BYTES = 1 << 30

ATTN_OTEL_DIRECT_STREAM = "ATTN_OTEL_DIRECT_STREAM"
"""Where direct rows' kernels run (``ATTN_OTEL_STREAM_DIRECT``).  ``side`` (default): on attn-otel's side stream,
launched after each streamed layer's attention and waiting only for it, so that the rest of the forward (the
later layers, the next forward) runs beside them; a forward waits for them only where it would write a block
they read (a preempted or finished request's, as for any capture work).  Only in a forward with no CUDA graph:
a step of no more tokens than vLLM's largest graph (replayed as PIECEWISE graphs, whose queries are in the
graphs' own memory pool, which the next piece's replay writes over) makes no direct plan, and its chunks go
through the ring as with direct rows off.  ``engine``: on vLLM's stream, in the forward's own order, in every
forward with a plan (run 27's design: each layer's rows delay the layers after it).  With ``side`` the streamed
rows matched HF eager on the real engine (tests/test_gpu_stream.py, run 47) and the kernels match the torch
reference far behind the forwards (tests/test_stream.py -m gpu)."""

ATTN_OTEL_MAPS_SAMPLE = "ATTN_OTEL_MAPS_SAMPLE"
"""Fraction in [0, 1] of traces whose full maps are stored (decided per trace id, so every request of a
trace agrees).  Metrics are computed for every captured request.  Default 0.01."""

ATTN_OTEL_MAP_TAP_TOKENS = "ATTN_OTEL_MAP_TAP_TOKENS"
"""Rows of the map tap: how many tokens of the requests planned for maps (all of them at once) keep their
queries on the device, on every streamed map layer.  ``0`` (default): ``ATTN_OTEL_MAX_MAP_TOKENS`` (one request of the longest length maps allow).
A fixed size, taken from the KV-cache budget at start (``rows * num_q_heads * head_dim * dtype_bytes`` per
map layer); a planned request that finds no free rows is captured without maps and counted
(``skipped{reason="map_rows_missing"}``)."""

ATTN_OTEL_VERIFY = "ATTN_OTEL_VERIFY"
"""``1``: every maps capture checks itself against what the backend computed.  The map layers also keep the
planned requests' attention output rows (beside their queries); at finish each map layer's maps times its
values (read back from vLLM's cache, dequantised, where attn-otel reads it: FLASH_ATTN; else the forward's
values) must give that output back.  The relative error per row and head, ``|A V - O| / |O|``, is stored
as the capture's ``reconstruction`` attribute (median, p99, max).  ``0`` (default): off."""

ATTN_OTEL_MAX_MAP_TOKENS = "ATTN_OTEL_MAX_MAP_TOKENS"
"""Requests longer than this many tokens get metrics but no maps (a counted ``map_too_long`` skip): a map
is ``layers * heads * T * T * 2`` bytes.  Default 8192.  Requests whose capture with maps could never fit the
hand-off's share for maps (``ATTN_OTEL_QUEUE_BYTES``) are declined the same way
(:func:`attn_otel.plan.map_token_limit`)."""

ATTN_OTEL_QUEUE_BYTES = "ATTN_OTEL_QUEUE_BYTES"
"""Bound, in bytes, on captures waiting for the writer.  A capture that would exceed it is dropped and
counted (``queue_full``): the engine never waits for storage.  Captures with maps leave an eighth of it free
(beyond that their maps are skipped, ``maps_queue_full``), so that maps waiting on a slow store do not crowd
out the captures without maps.  Default 1 GiB."""

ATTN_OTEL_DEVICE_QUEUE_BYTES = "ATTN_OTEL_DEVICE_QUEUE_BYTES"
"""Bound, in bytes, on finished requests' Q/K copies waiting on the device for the compute thread (the
engine loop only copies them out of the tap; the math runs beside it).  Beyond it captures are dropped and
counted (``device_queue_full``).  Default 2 GiB."""

ATTN_OTEL_WRITER = "ATTN_OTEL_WRITER"
"""``process`` (default): captures are written by a child process (arrays through shared memory, metadata
as JSON), so storage work never competes with the engine loop for the GIL.  ``thread``: written by a
thread of the engine process."""

ATTN_OTEL_WRITERS = "ATTN_OTEL_WRITERS"
"""How many writers run the exporters side by side (each a process with ``ATTN_OTEL_WRITER=process``).
``0`` (default): one per 4 CPUs, at least 1 and at most 4.  Captures of one request never split across
writers; more writers keep up with more finishing requests per second."""

ATTN_OTEL_GIL_SWITCH_MS = "ATTN_OTEL_GIL_SWITCH_MS"
"""Milliseconds the engine process's Python threads may hold the GIL before one waiting takes it over
(``sys.setswitchinterval``), set when capture starts if below the process's own (Python's default is 5 ms).
attn-otel's compute and writer-feeding threads run beside vLLM's engine loop in its process; when the GPU
finishes a step while one of them holds the GIL, the loop waits up to this long before it can launch the
next step (measured on an H100: 0.6 s of 23.8 s idle on the mixed workload at Python's 5 ms).  ``0``: leave
the process's interval alone.  Default ``0.2``."""

ATTN_OTEL_EVENT_WAIT = "ATTN_OTEL_EVENT_WAIT"
"""How attn-otel's threads wait for device work (a writer thread for a finish batch's results, a maps
capture's copies): ``sleep`` (default), on blocking-sync CUDA events, the thread asleep in the driver until
the device reaches the event; ``spin``, on plain events, whose wait polls the driver, a CPU core busy and the
driver's lock taken over and over while it waits (as up to 2026-11-29; see :func:`attn_otel.timing.wait_event`).
On an H200 (run 43) ``sleep`` cut the writer threads' CPU x0.15 and left throughput where it was."""

ATTN_OTEL_AFTER_LAUNCH = "ATTN_OTEL_AFTER_LAUNCH"
"""``1``: capture work that no forward is waiting for (a batch of finished requests' captures none of whose
blocks the step's forward writes; the streamed layers' flush at half the query ring) runs after the step's
forward is launched, while the device runs it, not before.  ``0``: before the forward, as up to 2026-11-26.
Default ``1``."""

ATTN_OTEL_HOLD_FINISHED = "ATTN_OTEL_HOLD_FINISHED"
"""``1``: vLLM's scheduler holds a finished request's uncached KV-cache blocks (its last, partly filled one)
until the request's finish batch is due (:mod:`attn_otel.hold`; only while the pool has room for a step and a
whole sequence beside them), so that its pending rows of the streamed layers are flushed with that batch,
after a forward's launch, instead of flushed and spilled (:mod:`attn_otel.spill`) before the next step's
forward on their own (on an H100, run 31: attn-otel's host time on the engine loop 2.7-2.9 s a server life
against 3.9-4.1 s, ITL p50 x1.05 of capture off against x1.16).  ``0``: the flush and spill come before the
next forward, as up to 2026-11-27.  Needs ``ATTN_OTEL_FINISH_BATCH_STEPS`` above 0.  Default ``1``."""

ATTN_OTEL_STEADY = "ATTN_OTEL_STEADY"
"""``1``: running requests that decode one token a step into a block they already hold are counted by one step
counter, not one by one (:mod:`attn_otel.steady`): the host's work before a forward no longer grows with every
running request, only with those that arrive, finish, cross a block or are planned for maps.  ``0``: every
scheduled request goes through the tracker, the stream's schedule and the block guards each step, as up to
2026-11-29.  Default ``1``."""

ATTN_OTEL_FINISH_BATCH_STEPS = "ATTN_OTEL_FINISH_BATCH_STEPS"
"""Engine steps a finished request's capture work may wait, to be done with other finished requests' in one
batch (:mod:`attn_otel.deferred`): it is done sooner where vLLM gives one of the request's blocks to another
request, where the engine goes idle, for a request planned for maps, or at ``ATTN_OTEL_FINISH_BATCH_REQUESTS``
waiting.  ``0``: in the step the request finishes.  Default ``16``."""

ATTN_OTEL_FINISH_BATCH_REQUESTS = "ATTN_OTEL_FINISH_BATCH_REQUESTS"
"""Finished requests waiting that make their finish batch due (:mod:`attn_otel.deferred`, the count rule): a bound
on the capture work one step takes on, and on the blocks held for it.  Lock-stepped requests (a fixed-length
workload, a burst) finish in groups as the batch empties, where the forwards are short: run 50's profile of
512+256 found the GPU idle 5-12 ms before and in each tail step that took a batch of 64.  A larger count leaves
such a tail's captures to the age rule or the step that goes idle; whether that is faster is for the benchmark
(``bench/overhead.py``'s phases ``default-batch256`` and ``default-batch32``) to say.  Default ``64``."""

ATTN_OTEL_FINISH_BATCH_CHUNK = "ATTN_OTEL_FINISH_BATCH_CHUNK"
"""Requests a finish batch takes where their count (``ATTN_OTEL_FINISH_BATCH_REQUESTS``) or a request planned for
maps makes it due: every one planned for maps and the oldest others, this many in all, the rest in a later step
(:mod:`attn_otel.deferred`), so that requests finishing together as the batch empties, where the forwards are
short, do not hold the engine loop past a forward.  The other reasons (a block given out again, the engine going
idle, age) take them all.  ``0`` (default): all of them.  Run 50 (H200, 512+256, one call) measured ``32`` at
x0.979 of capture off against ``0``'s x0.982, with more batches (35 against 27) and more of attn-otel's host
time (1.42 s against 1.24): the tail's idle GPU time is not the batches' size alone."""

ATTN_OTEL_WRITER_TIMEOUT_S = "ATTN_OTEL_WRITER_TIMEOUT_S"
"""Seconds a writer process may take to answer for one capture before it is killed (the capture counted
as ``store_error``) and a fresh one started for the next capture.  ``0`` (default): 12 S3 timeouts plus a
minute (180 s with the default ``ATTN_OTEL_S3_TIMEOUT_S``), far above any healthy write."""

ATTN_OTEL_ROW_METRICS = "ATTN_OTEL_ROW_METRICS"
"""Which captures store their per-row metrics (``{name}`` ``(layer, head, query)`` beside ``attn``): ``maps`` (default)
only the captures whose maps are stored; ``all`` every capture.  Every capture stores its summary (means
and quantiles per layer and head, a few kB).  At production rates rows for every request are the bulk of
the store's traffic (about 2.8 MB per 768-token request on four 32-head layers)."""

ATTN_OTEL_KV_WRITE = "ATTN_OTEL_KV_WRITE"
"""``fused`` (default): on a captured layer with vLLM's FLASH_ATTN backend and an unquantised KV cache,
attn-otel writes the layer's keys and values to vLLM's paged cache in the same GPU launch that keeps its
queries, and vLLM's own KV-cache write for that layer is skipped (one launch per layer and step instead of
two; where the launch cannot be made, vLLM's write runs as before).  ``vllm``: vLLM writes its cache and
attn-otel keeps the queries in a launch of its own."""

ATTN_OTEL_LAUNCH = "ATTN_OTEL_LAUNCH"
"""How the taps' launches in every eager forward (the queries and keys kept, the ring's row counter moved on)
reach the GPU.  ``bound`` (default): the first launch of each argument specialisation goes through Triton's
JIT call, which compiles or finds the kernel; later ones launch that kernel through its own launcher, without
Triton's per-call binding and cache lookup (on an H100 about 10 us of the engine loop's host time a launch
against 28, ``bench/launch_cost.py``).  ``jit``: Triton's JIT call every time, as up to 2026-11-28."""

ATTN_OTEL_FLUSH_KEYS = "ATTN_OTEL_FLUSH_KEYS"
"""How a flush of the streamed layers' pending rows gives the metric kernel each request's keys.  ``blocks``
(default since 2026-11-28): the request's block ids only, one a block (a sixteenth of the positions), the kernel
finding each position's slot itself.  ``slots``: every key position's KV-cache slot, built on the engine loop
from the request's blocks and uploaded (about 93,000 for 100 live requests of 900 tokens).  Measured on H200s
(docs/benchmarks/history.md): a flush's launches alone x0.33-x0.37 of the slots' host time and x0.52-x0.64 of
their device time (``bench/flush_layout.py``, run 38); online, the two A/B'd on one machine in both orders (run
39, the same code, 2 servers each), the block-id servers' ITL p50 / p99 x0.93 / x0.87 and TTFT p50 / p99 x0.88 /
x0.87 the slots' (run 37, which had put block ids behind, compared two commits across a change).  A flush of a
model with images gives slots either way (its vision mask is per key); so does the CPU build (no Triton)."""

ATTN_OTEL_ENGINE_PRIORITY = "ATTN_OTEL_ENGINE_PRIORITY"
"""The CUDA stream priority of vLLM's own stream (the forwards, their CUDA graphs, the sampler) against
attn-otel's capture work (the flushes and finish kernels on its side stream, at the default priority, the
lowest).  ``vllm`` (default): vLLM's stream as vLLM makes it, at that same priority.  ``high``: each GPU worker's
stream is made at a higher priority before vLLM first asks for it (as the worker sets up its device, before
NCCL), so that where a forward's kernels and a flush's both wait for the GPU's SMs, the forward's go first.  The
same kernels run in the same order either way: the model's outputs do not change.  On an H200 (2026-11-28,
docs/benchmarks/history.md, run 38) ``high`` left the online latency where it was (ITL p50 x1.19 of capture
off against x1.18, TTFT p50 x1.21 against x1.19, the p99s within one server's noise), so contention for SMs
between the forwards and capture work is not what the online cost is made of, and the default stays vLLM's.
Where vLLM already has its stream when the worker sets up, ``high`` leaves it as it is and the log says so."""

ATTN_OTEL_STORE_TOKENS = "ATTN_OTEL_STORE_TOKENS"
"""Whether the request's token ids are stored with its capture (``attn-otel show`` then labels axes with
them).  Token ids are content: by default (unset) they are stored only where OpenTelemetry's GenAI
content-capture variable :data:`OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT` asks for content;
otherwise not.  ``1`` stores them, ``0`` never does; either wins over the OpenTelemetry variable.  A value
that is neither is a logged warning and counts as unset.  Token ids never leave the store."""

OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
"""OpenTelemetry's GenAI instrumentations' opt-in to capturing message content (prompts, completions):
``true`` (the original boolean form), or with ``OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental``
one of ``NO_CONTENT``, ``SPAN_ONLY``, ``EVENT_ONLY``, ``SPAN_AND_EVENT`` (opentelemetry-util-genai).
attn-otel reads it, case-insensitively, as its default for :data:`ATTN_OTEL_STORE_TOKENS`: ``true``,
``1``, ``SPAN_ONLY``, ``EVENT_ONLY``, ``SPAN_AND_EVENT`` (and ``span``, ``event``) store token ids;
``false``, ``0``, ``NO_CONTENT`` do not; anything else is a logged warning and stores none."""

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_GENAI_CONTENT = _TRUE + ("span_only", "event_only", "span_and_event", "span", "event")
_GENAI_NO_CONTENT = _FALSE + ("no_content", "")


def store_tokens_from_env(env: Mapping[str, str]) -> bool:
    """:data:`ATTN_OTEL_STORE_TOKENS` when it says ``1`` or ``0``; else whether
    :data:`OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT` asks for content; else False."""
    raw = env.get(ATTN_OTEL_STORE_TOKENS)
    if raw is not None:
        value = raw.strip().lower()
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        _warn(ATTN_OTEL_STORE_TOKENS, raw, "expected 0 or 1",
              f"{OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT}'s choice, else 0")
    raw = env.get(OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT)
    if raw is None:
        return False
    value = raw.strip().lower()
    if value in _GENAI_CONTENT:
        return True
    if value not in _GENAI_NO_CONTENT:
        _warn(OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT, raw,
              "expected true, false or NO_CONTENT/SPAN_ONLY/EVENT_ONLY/SPAN_AND_EVENT", "no token ids")
    return False


ATTN_OTEL_SINK_TOKENS = "ATTN_OTEL_SINK_TOKENS"
"""k for the sink-mass metric: attention on the first k tokens (StreamingLLM).  Default 4."""

ATTN_OTEL_STATS_DIR = "ATTN_OTEL_STATS_DIR"
"""Where the engine's processes leave their counters (``attn-otel-stats-{pid}.json``, every second and at
exit) and the writers their histograms, for the API server's ``/metrics`` to read.  ``vllm serve`` with
``ATTN_OTEL=1`` makes a temporary one when unset (removed at exit); set it yourself only to keep the files
(empty it between runs).  Offline, unset: nothing is written."""

ATTN_OTEL_S3_TIMEOUT_S = "ATTN_OTEL_S3_TIMEOUT_S"
"""Seconds an S3 request may wait to connect, and then between bytes of the answer, before it is abandoned
(each attempt; botocore's standard retry mode makes 3 attempts, ``AWS_MAX_ATTEMPTS`` overrides).  Bounds how
long an S3 endpoint that stops answering can hold a writer: a capture is then dropped and counted
(``store_error``) and the next one tries again.  Default 10."""

ATTN_OTEL_VIEW_URL = "ATTN_OTEL_VIEW_URL"
"""Base URL of the vLLM API server that serves the viewer to the people who read the traces, such as
``http://vllm-host:8000`` (with the server's ``--root-path`` when it has one).  Each capture's span then
carries ``attn_otel.view_url`` = this + ``/attn-otel/view/{trace_id}?request={request_id}``.  Unset, the
attribute is that path alone.  Only ``http``/``https`` URLs without credentials; anything else is a logged
warning and counts as unset."""

S3_TIMEOUT_S = 10.0
S3_MAX_ATTEMPTS = 3
AUTO_LAYERS = 4
MODES = ("off", "metrics", "maps")


def _warn(name: str, value: object, why: str, default: object) -> None:
    logger.warning("attn-otel: ignoring %s=%r (%s); using %r", name, value, why, default)


def parse_layers(value: object, num_layers: int | None = None) -> str | tuple[int, ...]:
    """Parse a layer selection: ``"all"``, ``"auto"``, ``"0,8,16"`` or a list of ints.

    Returns ``"all"``/``"auto"`` or a sorted tuple of distinct non-negative ints.  Raises ``ValueError``
    with a message a user can act on.  With ``num_layers``, indices must be below it.
    """
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("all", "auto"):
            return text
        if len(text) > 10_000:
            raise ValueError("layer list is too long")
        parts = [p.strip() for p in text.split(",") if p.strip()]
    elif isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        if len(value) > 10_000:
            raise ValueError("layer list is too long")
        parts = list(value)
    else:
        raise ValueError(f"expected 'all', 'auto' or a list like '0,8,16', got {type(value).__name__}")
    layers = []
    for p in parts:
        if isinstance(p, bool):
            raise ValueError(f"layer {p!r} is not an integer")
        try:
            i = int(p)
        except (TypeError, ValueError):
            raise ValueError(f"layer {p!r} is not an integer") from None
        if isinstance(p, float) and p != i:
            raise ValueError(f"layer {p!r} is not an integer")
        if i < 0:
            raise ValueError(f"layer {i} is negative")
        if num_layers is not None and i >= num_layers:
            raise ValueError(f"layer {i} does not exist (the model has {num_layers})")
        layers.append(i)
    if not layers:
        raise ValueError("empty layer list")
    return tuple(sorted(set(layers)))


def resolve_layers(selection: str | tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """Turn a parsed selection into concrete layer indices for a model with ``num_layers`` layers."""
    if selection == "all":
        return tuple(range(num_layers))
    if selection == "auto":
        n = min(AUTO_LAYERS, num_layers)
        if n == 1:
            return (0,)
        return tuple(sorted({round(i * (num_layers - 1) / (n - 1)) for i in range(n)}))
    return tuple(i for i in selection if i < num_layers)


def resolve_map_layers(selection: str | tuple[int, ...], captured: Sequence[int]) -> tuple[int, ...]:
    """The map layers among the ``captured`` ones (see :data:`ATTN_OTEL_MAP_LAYERS`)."""
    captured = tuple(sorted(captured))
    if selection == "all" or (selection == "auto" and len(captured) <= AUTO_LAYERS):
        return captured
    if selection == "auto":
        n = AUTO_LAYERS
        return tuple(sorted({captured[round(i * (len(captured) - 1) / (n - 1))] for i in range(n)}))
    return tuple(i for i in selection if i in captured)


@dataclasses.dataclass(frozen=True)
class Config:
    enabled: bool = False
    store: str = "./attn-otel-data"
    layers: str | tuple[int, ...] = "auto"
    map_layers: str | tuple[int, ...] = "auto"
    stream_rows: int = 0
    stream_direct: str = "auto"
    direct_stream: str = "side"
    maps_sample: float = 0.01
    max_map_tokens: int = 8192
    map_tap_tokens: int = 0
    verify: bool = False
    queue_bytes: int = 1 << 30
    device_queue_bytes: int = 2 << 30
    store_tokens: bool = False
    sink_tokens: int = 4
    stats_dir: str | None = None
    writer: str = "process"
    writers: int = 0
    row_metrics: str = "maps"
    writer_timeout_s: float = 0.0
    gil_switch_ms: float = 0.2
    event_wait: str = "sleep"
    finish_batch_steps: int = 16
    finish_batch_chunk: int = 0
    finish_batch_requests: int = 64
    after_launch: bool = True
    # where work after the launch runs (ATTN_OTEL_AFTER_LAUNCH): "execute", as vLLM's execute_model returns (the
    # forward enqueued); "sample", after the step's sample_tokens (the sampler enqueued too); "output", after the
    # engine core has taken the step's output (EngineCore.post_step), where that runs in this process
    after_launch_at: str = "execute"
    hold_finished: bool = True
    steady: bool = True
    kv_write: str = "fused"
    launch: str = "bound"
    flush_keys: str = "blocks"
    engine_priority: str = "vllm"
    view_url: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> "Config":
        env = os.environ if env is None else env
        d = cls()
        values: dict[str, object] = {}
        values["enabled"] = env.get(ATTN_OTEL, "0").strip().lower() in ("1", "true", "yes", "on")
        values["store"] = env.get(ATTN_OTEL_STORE, "").strip() or d.store
        for field, name in (("layers", ATTN_OTEL_LAYERS), ("map_layers", ATTN_OTEL_MAP_LAYERS)):
            raw = env.get(name)
            if raw is not None:
                try:
                    values[field] = parse_layers(raw)
                except ValueError as e:
                    _warn(name, raw, str(e), getattr(d, field))
        values["stream_rows"] = _number(env, ATTN_OTEL_STREAM_ROWS, d.stream_rows, int, 0, 1 << 24)
        values["stream_direct"] = _choice(env, ATTN_OTEL_STREAM_DIRECT, ("auto", "0", "1"), d.stream_direct)
        values["direct_stream"] = _choice(env, ATTN_OTEL_DIRECT_STREAM, ("side", "engine"), d.direct_stream)
        values["maps_sample"] = _number(env, ATTN_OTEL_MAPS_SAMPLE, d.maps_sample, float, 0.0, 1.0)
        values["max_map_tokens"] = _number(env, ATTN_OTEL_MAX_MAP_TOKENS, d.max_map_tokens, int, 1, None)
        values["map_tap_tokens"] = _number(env, ATTN_OTEL_MAP_TAP_TOKENS, d.map_tap_tokens, int, 0, None)
        values["verify"] = _choice(env, ATTN_OTEL_VERIFY, ("0", "1"), "0") == "1"
        values["queue_bytes"] = _number(env, ATTN_OTEL_QUEUE_BYTES, d.queue_bytes, int, 1, None)
        values["device_queue_bytes"] = _number(env, ATTN_OTEL_DEVICE_QUEUE_BYTES, d.device_queue_bytes, int, 1,
                                               None)
        values["sink_tokens"] = _number(env, ATTN_OTEL_SINK_TOKENS, d.sink_tokens, int, 1, None)
        values["store_tokens"] = store_tokens_from_env(env)
        values["stats_dir"] = env.get(ATTN_OTEL_STATS_DIR, "").strip() or None
        values["writers"] = _number(env, ATTN_OTEL_WRITERS, d.writers, int, 0, 64)
        values["writer_timeout_s"] = _number(env, ATTN_OTEL_WRITER_TIMEOUT_S, d.writer_timeout_s, float, 0.0,
                                             86400.0)
        values["gil_switch_ms"] = _number(env, ATTN_OTEL_GIL_SWITCH_MS, d.gil_switch_ms, float, 0.0, 100.0)
        values["event_wait"] = _choice(env, ATTN_OTEL_EVENT_WAIT, ("sleep", "spin"), d.event_wait)
        values["finish_batch_steps"] = _number(env, ATTN_OTEL_FINISH_BATCH_STEPS, d.finish_batch_steps, int, 0,
                                               1024)
        values["finish_batch_chunk"] = _number(env, ATTN_OTEL_FINISH_BATCH_CHUNK, d.finish_batch_chunk, int, 0,
                                               1 << 20)
        values["finish_batch_requests"] = _number(env, ATTN_OTEL_FINISH_BATCH_REQUESTS, d.finish_batch_requests,
                                                  int, 1, 1 << 20)
        at = _choice(env, ATTN_OTEL_AFTER_LAUNCH, ("0", "1", "sample", "output"), "1")
        values["after_launch"] = at != "0"
        values["after_launch_at"] = at if at in ("sample", "output") else "execute"
        values["hold_finished"] = (_choice(env, ATTN_OTEL_HOLD_FINISHED, ("0", "1"), "1") == "1"
                                   and values["finish_batch_steps"] > 0)
        values["steady"] = _choice(env, ATTN_OTEL_STEADY, ("0", "1"), "1") == "1"
        values["row_metrics"] = _choice(env, ATTN_OTEL_ROW_METRICS, ("maps", "all"), d.row_metrics)
        values["writer"] = _choice(env, ATTN_OTEL_WRITER, ("process", "thread"), d.writer)
        values["kv_write"] = _choice(env, ATTN_OTEL_KV_WRITE, ("fused", "vllm"), d.kv_write)
        values["launch"] = _choice(env, ATTN_OTEL_LAUNCH, ("bound", "jit"), d.launch)
        values["flush_keys"] = _choice(env, ATTN_OTEL_FLUSH_KEYS, ("slots", "blocks"), d.flush_keys)
        values["engine_priority"] = _choice(env, ATTN_OTEL_ENGINE_PRIORITY, ("high", "vllm"), d.engine_priority)
        values["view_url"] = _view_url(env.get(ATTN_OTEL_VIEW_URL))
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    raw = env.get(name)
    if raw is None:
        return default
    if raw.strip().lower() in choices:
        return raw.strip().lower()
    _warn(name, raw, f"expected {' or '.join(choices)}", default)
    return default


def _number(env: Mapping[str, str], name: str, default, kind, lo, hi):
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        v = kind(raw)
    except ValueError:
        _warn(name, raw, f"not a{'n integer' if kind is int else ' number'}", default)
        return default
    if v != v or (lo is not None and v < lo) or (hi is not None and v > hi):
        _warn(name, raw, f"outside [{lo}, {hi if hi is not None else 'inf'}]", default)
        return default
    return v


def _view_url(raw: str | None) -> str | None:
    """:data:`ATTN_OTEL_VIEW_URL` without its trailing slash, or None (unset, or not a plain http(s) URL)."""
    from urllib.parse import urlparse

    if raw is None or not raw.strip():
        return None
    url = raw.strip().rstrip("/")
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc or "@" in parsed.netloc or parsed.query \
            or parsed.fragment:
        _warn(ATTN_OTEL_VIEW_URL, raw, "expected a base URL like http://host:8000 (no credentials, query or "
              "fragment)", "unset")
        return None
    return url


def s3_timeout_s(env: Mapping[str, str] | None = None) -> float:
    """:data:`ATTN_OTEL_S3_TIMEOUT_S` (a bad value: a logged warning and the default)."""
    env = os.environ if env is None else env
    return float(_number(env, ATTN_OTEL_S3_TIMEOUT_S, S3_TIMEOUT_S, float, 0.1, 3600.0))


def writer_timeout_s(config: "Config") -> float:
    """:data:`ATTN_OTEL_WRITER_TIMEOUT_S`, or its default from the S3 timeout."""
    return config.writer_timeout_s if config.writer_timeout_s > 0 else 12 * s3_timeout_s() + 60.0


def writer_count(config: "Config", ranks: int = 1) -> int:
    """``ATTN_OTEL_WRITERS``, or one per 4 CPUs (1 to 4), shared among the ``ranks`` worker processes of a
    tensor/pipeline-parallel engine on one host."""
    if config.writers > 0:
        return config.writers
    return max(1, min(4, (os.cpu_count() or 1) // 4 // max(1, ranks)))


@dataclasses.dataclass(frozen=True)
class RequestOptions:
    """What one request asked for through ``SamplingParams.extra_args`` / ``vllm_xargs``."""

    mode: str | None = None  # None: the server default (metrics, maps for a sampled fraction)
    layers: tuple[int, ...] | None = None
    traceparent: str | None = None  # valid W3C, as OpenTelemetry's propagator writes it
    warnings: tuple[str, ...] = ()


def parse_request_options(extra_args: Mapping[str, object] | None) -> RequestOptions:
    """Read ``attn_otel``, ``attn_otel_layers`` and ``traceparent`` from a request's extra args.

    Never raises: each bad value becomes a warning (returned, for the caller to log) and is ignored.
    """
    if not extra_args or not isinstance(extra_args, Mapping):
        return RequestOptions()
    warnings: list[str] = []
    mode = extra_args.get("attn_otel")
    if mode is not None:
        if not isinstance(mode, str) or mode.strip().lower() not in MODES:
            warnings.append(f"attn_otel={_short(mode)} is not one of {'|'.join(MODES)}; using the default")
            mode = None
        else:
            mode = mode.strip().lower()
    layers = None
    raw = extra_args.get("attn_otel_layers")
    if raw is not None:
        try:
            parsed = parse_layers(raw)
            layers = None if parsed in ("all", "auto") else parsed
        except ValueError as e:
            warnings.append(f"attn_otel_layers={_short(raw)}: {e}; capturing the default layers")
    tp = extra_args.get("traceparent")
    traceparent = None
    if tp is not None:
        from .ids import canonical_traceparent

        traceparent = canonical_traceparent(tp)  # OpenTelemetry's W3C propagator, rewritten as it writes it
        if traceparent is None:
            warnings.append(f"traceparent={_short(tp)} is not a W3C traceparent; a new trace id is made")
    return RequestOptions(mode=mode, layers=layers, traceparent=traceparent, warnings=tuple(warnings))


def _short(v: object) -> str:
    import reprlib

    short = reprlib.Repr()  # a hostile 10 MB string or a million-item list is never repr'd in full
    short.maxstring = short.maxother = 60
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = 6
    short.maxlevel = 2
    s = short.repr(v)
    return s if len(s) <= 60 else s[:57] + "..."
