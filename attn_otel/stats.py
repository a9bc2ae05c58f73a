"""Capture counters (read by the exporters and the API server's ``/metrics``), the stats file engine
processes leave in ``ATTN_OTEL_STATS_DIR``, and warnings logged once per kind."""

from __future__ import annotations

import collections
import gc
import itertools
import json
import logging
import os
import threading
import time
from typing import Any

import numpy as np

logger = logging.getLogger("attn_otel")


# the parts of the engine loop's time in attn-otel (Stats.step_parts), before a forward: finished requests' token
# ids and preempted requests' rows; finished requests' capture work, batched over steps (attn_otel.deferred: the
# streamed layers' rows of them, then their captures); the step's tokens given rows; and after the forward's
# launch, the work it does not wait for (ATTN_OTEL_AFTER_LAUNCH: finish batches, the flush at half the ring; as
# execute_model returns, after the sampler's launch, or after the step's output, counted in after_launch_at)
STEP_PARTS = ("finished_rows", "captures", "schedule", "after_launch")


class Stats:
    """Capture counters, read by the exporters (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.captured = 0
        self.stored = 0
        self.maps_stored = 0
        self.dropped: collections.Counter[str] = collections.Counter()
        self.skipped: collections.Counter[str] = collections.Counter()
        self.export_errors: collections.Counter[str] = collections.Counter()  # by exporter, store excluded
        self.bytes_written = 0
        # seconds, per capture: request finish -> metrics on the host, ready for the exporters
        self.latencies: collections.deque[float] = collections.deque(maxlen=10_000)
        # seconds, per capture: request finish -> stored
        self.write_latencies: collections.deque[float] = collections.deque(maxlen=10_000)
        # seconds the engine loop spent in a capture (enqueueing device work; no I/O, no sync)
        self.loop_times: collections.deque[float] = collections.deque(maxlen=10_000)
        # seconds the engine loop spent in attn-otel before each forward (following the step's requests,
        # flushes, finished requests' captures), and its total split by part
        self.step_times: collections.deque[float] = collections.deque(maxlen=10_000)
        self.step_parts: collections.Counter[str] = collections.Counter(dict.fromkeys(STEP_PARTS, 0.0))
        # the engine loop's step intervals (one step's start to the next's, where requests ran between: no idle
        # wait) and attn-otel's own host time inside each (its step hook and its work after the launch): whether
        # the slowest steps, the ones an ITL p99 is made of, are slow because of attn-otel or of something else
        self.step_intervals: collections.deque[tuple[float, float]] = collections.deque(maxlen=10_000)
        # seconds each batch of finished requests' capture work took on the engine loop (attn_otel.deferred), and
        # the requests in it: the batch lands in one step, so its time is that step's extra latency
        self.finish_batch_times: collections.deque[float] = collections.deque(maxlen=10_000)
        self.finish_batch_sizes: collections.deque[float] = collections.deque(maxlen=10_000)
        # why each batch was taken then (attn_otel.deferred.DeferredFinish.due), and the steps that scheduled no
        # token while requests were still running (each takes the held batch as if the engine went idle)
        self.finish_batch_reasons: collections.Counter[str] = collections.Counter()
        self.empty_steps = 0
        self.steady_drift = 0  # requests back from the step counter whose position vLLM's scheduler disagreed with
        # where work after the launch ran, a count a time (ATTN_OTEL_AFTER_LAUNCH): "execute", "sample", "output",
        # or "next_step" (left by a step whose hook did not come back: run before the next step's forward)
        self.after_launch_at: collections.Counter[str] = collections.Counter()
        # steps that finished requests with streamed rows to keep, by what became of them: flushed and their last
        # blocks spilled (attn_otel.spill) before the step's forward, as ATTN_OTEL_HOLD_FINISHED=0 does it
        # ("before") or because the forward writes one of their blocks ("reuse"); or left unspilled for their
        # finish batch, their blocks held by vLLM's scheduler ("held", the default), or taken at once by an empty
        # step ("idle")
        self.spill_at: collections.Counter[str] = collections.Counter()

    def add(self, field: str, n: int = 1, reason: str | None = None) -> None:
        with self._lock:
            if reason is None:
                setattr(self, field, getattr(self, field) + n)
            else:
                getattr(self, field)[reason] += n

    def snapshot(self, percentiles: bool = False) -> dict[str, Any]:
        """The counters, and with ``percentiles`` the timing deques' quantiles.  Only the counters are read under
        the lock that :meth:`add` takes: the engine loop calls ``add`` in its steps, and the quantiles (sorting
        the deques' 70,000 values, 15 ms on a slow CPU) are computed after the lock is let go, from copies, so
        that no step waits for them (as every step that called ``add`` during the stats file's once-a-second
        snapshot did up to session 47)."""
        with self._lock:
            snap: dict[str, Any] = {"captured": self.captured, "stored": self.stored,
                                    "maps_stored": self.maps_stored, "dropped": dict(self.dropped),
                                    "skipped": dict(self.skipped), "export_errors": dict(self.export_errors),
                                    "bytes_written": self.bytes_written,
                                    "finish_batch_reasons": dict(self.finish_batch_reasons),
                                    "empty_steps": self.empty_steps, "steady_drift": self.steady_drift,
                                    "after_launch_at": dict(self.after_launch_at),
                                    "spill_at": dict(self.spill_at),
                                    # a copy first, in one step under the GIL: the engine loop adds parts
                                    # without the lock (only it writes there)
                                    "step_host_s": {k: round(v, 4) for k, v in dict(self.step_parts).items()}}
        if percentiles:  # appends to the deques take no lock: each is copied in one step under the GIL
            for name in QUANTILE_FIELDS:
                snap[name] = quantiles(getattr(self, name))
            snap["step_intervals"] = interval_split(self.step_intervals)
        return snap


# the Stats deques whose quantiles the stats file keeps
QUANTILE_FIELDS = ("latencies", "write_latencies", "loop_times", "step_times", "finish_batch_times",
                   "finish_batch_sizes")


def interval_split(pairs) -> dict[str, Any]:
    """Step intervals ``(interval, attn-otel's time in it)``: their quantiles, attn-otel's share of them all,
    and the mean interval and attn-otel time of the slowest 1% (at least one) against the rest."""
    flat = list(pairs)  # one step under the GIL; then a float iterator, a third of np.asarray's time on tuples
    a = np.fromiter(itertools.chain.from_iterable(flat), np.float64, 2 * len(flat)).reshape(-1, 2)
    if not a.shape[0]:
        return {"n": 0}
    iv, own = a[:, 0], a[:, 1]
    out = quantiles(iv)
    order = np.argsort(iv, kind="stable")
    k = max(1, int(round(0.01 * iv.size)))
    slow, rest = order[iv.size - k:], order[:iv.size - k]
    out.update(attn_share=float(own.sum() / iv.sum()) if iv.sum() > 0 else None,
               slowest_1pct={"n": int(k), "interval_mean": float(iv[slow].mean()), "attn_mean": float(own[slow].mean())},
               rest={"n": int(rest.size), "interval_mean": float(iv[rest].mean()) if rest.size else None,
                     "attn_mean": float(own[rest].mean()) if rest.size else None})
    return out


class GcPauses:
    """The garbage collector's pauses in this process (``gc.callbacks``), by generation: how many, their total
    and longest, and the last 10,000 of them.  A collection stops every thread of the process, the engine loop's
    included; vLLM freezes its start-up heap (``gc.freeze``) so that these stay short, and objects made after
    that, attn-otel's among them, are what a full collection walks.  One per process (:func:`gc_pauses`)."""

    def __init__(self) -> None:
        self._t0 = 0.0
        self.count = [0, 0, 0]
        self.total_s = [0.0, 0.0, 0.0]
        self.max_s = [0.0, 0.0, 0.0]
        self.times: collections.deque[float] = collections.deque(maxlen=10_000)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        g = min(int(info.get("generation", 0)), 2)
        dt = time.perf_counter() - self._t0
        self.count[g] += 1
        self.total_s[g] += dt
        self.max_s[g] = max(self.max_s[g], dt)
        self.times.append(dt)

    def snapshot(self) -> dict[str, Any]:
        pauses = quantiles(self.times)  # first: a collection it causes is in the counts below too
        return {"count": list(self.count), "total_s": [round(x, 4) for x in self.total_s],
                "max_s": [round(x, 5) for x in self.max_s], "pauses": pauses}


_GC: list[GcPauses] = []


def gc_pauses() -> GcPauses:
    """This process's :class:`GcPauses`, registered with the garbage collector the first time."""
    if not _GC:
        g = GcPauses()
        gc.callbacks.append(g)
        _GC.append(g)
    return _GC[0]


def quantiles(values) -> dict[str, float]:
    """``{"p50", "p90", "p99", "n", "max"}`` of a sequence another thread may append to (copied first, in one
    step under the GIL); ``{"n": 0}`` when empty."""
    vals = np.asarray(list(values), dtype=np.float64)
    if not vals.size:
        return {"n": 0}
    qs = np.quantile(vals, (0.5, 0.9, 0.99))  # one sort for the three
    return {"p50": float(qs[0]), "p90": float(qs[1]), "p99": float(qs[2]), "n": int(vals.size),
            "max": float(vals.max())}


def write_stats_file(stats_dir: str, snap: dict[str, Any]) -> None:
    """``snap`` as ``attn-otel-stats-PID.json`` in ``stats_dir``, replaced atomically (the API server's
    ``/metrics`` reads every engine process's file)."""
    os.makedirs(stats_dir, exist_ok=True)
    path = os.path.join(stats_dir, f"attn-otel-stats-{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(snap, f)
    os.replace(path + ".tmp", path)


class WarnOnce:
    """Warnings logged once per key (per engine): a failure that repeats every step must not flood the log."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def __call__(self, key: str, msg: str, *args: Any, exc: bool = False) -> None:
        if key in self._seen:
            return
        self._seen.add(key)
        (logger.exception if exc else logger.warning)("attn-otel: " + msg, *args)

    def reset(self) -> None:
        """Log every kind again (tests)."""
        self._seen.clear()
