"""Prometheus: per-layer attention-health histograms and capture counters, on vLLM's own ``/metrics``.

Captures happen in vLLM's engine process and this exporter runs in its writer (a child process by
default), while ``/metrics`` is served by the API-server process.  So the numbers cross processes as
files in ``ATTN_OTEL_STATS_DIR`` (set by the plugin to a fresh temporary directory when unset)::

    writer process   PrometheusExporter  -> {stats_dir}/attn-otel-hist-{pid}.json   (histograms, exemplars)
    engine process   CaptureEngine       -> {stats_dir}/attn-otel-stats-{pid}.json  (counters, gauges)
    API server       AttnOtelCollector   <- reads both at scrape time, on vLLM's registry

Usage
-----
Nothing to call: with ``ATTN_OTEL=1`` the plugin runs :func:`install_api_server` on vLLM's FastAPI app.
Scrape ``/metrics`` (text format 0.0.4: every ``attn_otel_*`` series, no exemplars) or
``/attn-otel/metrics`` (OpenMetrics 1.0: the same registry, vLLM's metrics included, with each histogram
bucket carrying the trace id of the latest capture that fell into it as an exemplar ``{trace_id="..."}``).
``attn-otel fetch TRACE_ID`` then gets that capture's maps (when it was sampled for maps).

Metrics (label ``model`` is the served model name, ``layer`` the model's layer number; nothing per request)
----------------------------------------------------------------------------------------------------------
``attn_otel_entropy_norm``, ``attn_otel_sink_mass_first``, ``attn_otel_sink_mass_k``,
``attn_otel_vision_share``, ``attn_otel_learned_sink_mass`` (prompt rows) and ``attn_otel_lookback_ratio``
(generated rows)
    histograms {model, layer}: one observation per captured request and layer, the layer's mean over the
    part's rows (:func:`attn_otel.metrics.summarize`, ``layer_mean``).  A request without a defined value
    (no image; no generated row; a layer without learned sinks) adds no observation.  Buckets: 0.05 .. 1 in steps of 0.05.
``attn_otel_capture_latency_seconds``
    histogram {model}: request finish -> metrics on the host.
``attn_otel_captures_total``, ``attn_otel_captures_stored_total``, ``attn_otel_maps_stored_total``,
``attn_otel_captures_dropped_total{reason}``, ``attn_otel_skips_total{reason}``,
``attn_otel_export_errors_total{exporter}``, ``attn_otel_written_bytes_total``
    counters from the engine's :class:`attn_otel.capture.Stats`.
``attn_otel_tap_bytes``, ``attn_otel_queue_pending_bytes{queue="host"|"device"}``
    gauges: device memory held by capture (taps, streamed layers), and bytes waiting in the hand-offs (only when the
    engine's stats file carries them).

Degradation
-----------
Counters and histograms sum the files of every process that wrote one, dead or alive (like
prometheus_client's multiprocess mode), so they never go backwards when a writer is restarted; gauges count
live processes only.  A directory you set yourself must be emptied between server runs.  The collector
never raises: an unreadable file is skipped (and logged once), a failing scrape yields no attn-otel
series.  Engine counters are as fresh as the engine's last stats dump (at most one a second, after a
write); histograms as the writer's last snapshot (at most every :data:`SNAPSHOT_INTERVAL_S`).
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import os
import re
import threading
import time
import weakref
from typing import Any, Iterable

from ._base import ExportItem

logger = logging.getLogger("attn_otel")

PREFIX = "attn_otel_"
ROUTE = "/attn-otel/metrics"
SNAPSHOT_INTERVAL_S = 0.5
FORMAT_VERSION = 1

RATIO_BUCKETS: tuple[float, ...] = tuple(round(0.05 * i, 2) for i in range(1, 21))  # 0.05 .. 1.0
LATENCY_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0)

# per-layer histograms: metric name (attn_otel.metrics) -> (part summarised, help text)
LAYER_METRICS: dict[str, tuple[str, str]] = {
    "entropy_norm": ("prompt", "Normalised attention entropy H/ln(n) of a captured request's prompt rows, "
                               "mean over rows and heads, per layer."),
    "sink_mass_first": ("prompt", "Attention on token 0 of a captured request's prompt rows, mean over rows "
                                  "and heads, per layer."),
    "sink_mass_k": ("prompt", "Attention on the first k tokens (ATTN_OTEL_SINK_TOKENS) of a captured request's "
                              "prompt rows, mean over rows and heads, per layer."),
    "vision_share": ("prompt", "Attention on image-embedding tokens of a captured request's prompt rows, mean "
                               "over rows and heads, per layer (requests with an image only)."),
    "lookback_ratio": ("generated", "Lookback ratio (context / (context + generated) attention) of a captured "
                                    "request's generated rows, mean over rows and heads, per layer."),
    "learned_sink_mass": ("prompt", "Share of the softmax that a layer's learned sink logits take (gpt-oss), of "
                                    "a captured request's prompt rows, mean over rows and heads, per layer "
                                    "(layers with learned sinks only)."),
}
LATENCY = "capture_latency_seconds"
LATENCY_HELP = "Time from a request's finish to its attention metrics being on the host."

HIST_FILE = re.compile(r"^attn-otel-hist-(\d+)(?:-\d+)?\.json$")
STATS_FILE = re.compile(r"^attn-otel-stats-(\d+)\.json$")


def _buckets(name: str) -> tuple[float, ...]:
    return LATENCY_BUCKETS if name == LATENCY else RATIO_BUCKETS


# ------------------------------------------------------------------------------------------ writer side
class _Hist:
    __slots__ = ("counts", "sum", "exemplars")

    def __init__(self, n_bounds: int):
        self.counts = [0] * (n_bounds + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0
        self.exemplars: list[list[Any] | None] = [None] * (n_bounds + 1)  # [trace_id, value, unix time]


class PrometheusExporter:
    """Writer side: keeps bucket counts, sums and each bucket's latest exemplar, and snapshots them to
    ``{stats_dir}/attn-otel-hist-{pid}.json`` (tmp file + ``os.replace``: readers never see half a file)
    at most every ``interval`` seconds, and at shutdown.  The file stays after shutdown: its counts are
    part of the counters' history (see the module docstring)."""

    name = "prometheus"
    _instances = 0

    def __init__(self, stats_dir: str | os.PathLike, interval: float = SNAPSHOT_INTERVAL_S, clock=time.time):
        self.stats_dir = os.fspath(stats_dir)
        self.interval = float(interval)
        self._clock = clock  # wall time of exemplars
        PrometheusExporter._instances += 1
        suffix = "" if PrometheusExporter._instances == 1 else f"-{PrometheusExporter._instances}"
        self.path = os.path.join(self.stats_dir, f"attn-otel-hist-{os.getpid()}{suffix}.json")
        self._hists: dict[tuple[str, tuple[tuple[str, str], ...]], _Hist] = {}
        self._lock = threading.Lock()
        self._last_write = 0.0
        self._timer: threading.Timer | None = None
        self._closed = False

    def observe(self, name: str, labels: dict[str, str], value: float, trace_id: str | None,
                when: float | None = None) -> None:
        value = float(value)
        if not math.isfinite(value):
            return
        bounds = _buckets(name)
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            h = self._hists.get(key)
            if h is None:
                h = self._hists[key] = _Hist(len(bounds))
            i = bisect.bisect_left(bounds, value)  # first bound >= value: Prometheus's `le`
            h.counts[i] += 1
            h.sum += value
            if trace_id:
                h.exemplars[i] = [str(trace_id), value, self._clock() if when is None else float(when)]

    def export(self, item: ExportItem) -> None:
        rec = item.record
        now = self._clock()
        model = str(rec.model or "")
        summary = item.summary
        for name, (part, _) in LAYER_METRICS.items():
            stats = summary[part].get(name)
            if stats is None:
                continue
            for layer, value in zip(rec.layers, stats["layer_mean"]):
                self.observe(name, {"model": model, "layer": str(int(layer))}, value, rec.trace_id, now)
        self.observe(LATENCY, {"model": model}, item.latency_s, rec.trace_id, now)
        self._schedule()

    def _schedule(self) -> None:
        with self._lock:
            if self._closed or self._timer is not None:
                return
            wait = self._last_write + self.interval - time.monotonic()
            if wait > 0:
                self._timer = threading.Timer(wait, self._timed_write)
                self._timer.daemon = True
                self._timer.start()
                return
        self.write()

    def _timed_write(self) -> None:
        with self._lock:
            self._timer = None
        try:
            self.write()
        except Exception as e:  # noqa: BLE001 - no fan-out to count it here; the next export retries
            if not getattr(self, "_warned", False):
                self._warned = True
                logger.warning("attn-otel: could not write %s: %s (logged once)", self.path, e)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            hists = [{"name": name, "labels": dict(labels), "le": list(_buckets(name)), "counts": list(h.counts),
                      "sum": h.sum, "exemplars": [list(e) if e else None for e in h.exemplars]}
                     for (name, labels), h in sorted(self._hists.items())]
        return {"format": FORMAT_VERSION, "pid": os.getpid(), "time": time.time(), "histograms": hists}

    def write(self) -> None:
        """Write the snapshot now.  A failure raises (the fan-out counts it as an export error)."""
        snap = self.snapshot()
        with self._lock:
            self._last_write = time.monotonic()
        os.makedirs(self.stats_dir, exist_ok=True)
        tmp = f"{self.path}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as f:
            json.dump(snap, f, allow_nan=False)
        os.replace(tmp, self.path)

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        if self._hists:
            self.write()


def from_config(config) -> PrometheusExporter | None:
    """The exporter when ``ATTN_OTEL_STATS_DIR`` is set (the plugin sets it in ``vllm serve``), else None."""
    if not getattr(config, "stats_dir", None):
        return None
    return PrometheusExporter(config.stats_dir)


# ------------------------------------------------------------------------------------- API-server side
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def _read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


class AttnOtelCollector:
    """A prometheus_client collector that reads ``stats_dir`` at each scrape (see the module docstring)."""

    def __init__(self, stats_dir: str | os.PathLike, pid_alive=_pid_alive):
        self.stats_dir = os.fspath(stats_dir)
        self._pid_alive = pid_alive
        self._warned: set[str] = set()

    def describe(self) -> list:
        return []  # names vary with what has been captured; registering must not read files

    def collect(self) -> Iterable[Any]:
        try:
            families = self._families()
        except Exception as e:  # noqa: BLE001 - a scrape of vLLM's own metrics must never fail because of us
            self._warn("collect", "attn-otel: no metrics this scrape (%s: %s)", type(e).__name__, e)
            families = []
        return iter(families)

    def _warn(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg + " (logged once)", *args)

    def _files(self, pattern: re.Pattern) -> list[tuple[int, Any]]:
        out = []
        try:
            names = sorted(os.listdir(self.stats_dir))
        except FileNotFoundError:
            return out
        for name in names:
            m = pattern.match(name)
            if not m:
                continue
            try:
                out.append((int(m.group(1)), _read_json(os.path.join(self.stats_dir, name))))
            except FileNotFoundError:  # removed between listing and reading
                continue
            except (OSError, ValueError) as e:
                self._warn(f"file:{name}", "attn-otel: skipping unreadable %s: %s", name, e)
        return out

    def _families(self) -> list:
        from prometheus_client.core import (
            CounterMetricFamily, Exemplar, GaugeMetricFamily, HistogramMetricFamily,
        )
        from prometheus_client.utils import floatToGoString

        families: list = []
        # histograms: merged over writer processes
        merged: dict[tuple[str, tuple[tuple[str, str], ...]], dict[str, Any]] = {}
        for _, snap in self._files(HIST_FILE):
            if not isinstance(snap, dict) or snap.get("format") != FORMAT_VERSION:
                continue
            for h in snap.get("histograms", ()):
                name = h.get("name")
                if name not in LAYER_METRICS and name != LATENCY:
                    continue
                bounds = list(_buckets(name))
                counts, exemplars = h.get("counts"), h.get("exemplars")
                if h.get("le") != bounds or len(counts) != len(bounds) + 1 or len(exemplars) != len(counts):
                    continue  # another version's buckets: not mergeable
                key = (name, tuple(sorted((str(k), str(v)) for k, v in h["labels"].items())))
                m = merged.setdefault(key, {"counts": [0] * len(counts), "sum": 0.0, "exemplars": [None] * len(counts)})
                m["counts"] = [a + int(b) for a, b in zip(m["counts"], counts)]
                m["sum"] += float(h.get("sum", 0.0))
                for i, e in enumerate(exemplars):
                    if e and (m["exemplars"][i] is None or e[2] > m["exemplars"][i][2]):
                        m["exemplars"][i] = e
        for name in (*LAYER_METRICS, LATENCY):
            keys = sorted(k for k in merged if k[0] == name)
            if not keys:
                continue
            labelnames = [k for k, _ in keys[0][1]]
            if name == LATENCY:
                fam = HistogramMetricFamily(PREFIX + name, LATENCY_HELP, labels=labelnames, unit="seconds")
            else:
                fam = HistogramMetricFamily(PREFIX + name, LAYER_METRICS[name][1], labels=labelnames)
            for key in sorted(keys, key=_label_order):
                m = merged[key]
                if [k for k, _ in key[1]] != labelnames:
                    continue
                buckets, total = [], 0
                for le, count, e in zip([*map(floatToGoString, _buckets(name)), "+Inf"], m["counts"], m["exemplars"]):
                    total += count
                    if e is not None:
                        buckets.append((le, total, Exemplar({"trace_id": str(e[0])}, float(e[1]), float(e[2]))))
                    else:
                        buckets.append((le, total))
                fam.add_metric([v for _, v in key[1]], buckets, m["sum"])
            families.append(fam)

        # counters and gauges: the engine processes' stats files
        stats = self._files(STATS_FILE)
        totals = {"captured": 0, "stored": 0, "maps_stored": 0, "bytes_written": 0}
        # Every known reason is there from the first scrape (at 0), so that rate() and increase() see a
        # reason's first event instead of a series that starts at 1.
        by_label: dict[str, dict[str, int]] = {"dropped": dict.fromkeys(DROP_REASONS, 0) if stats else {},
                                               "skipped": dict.fromkeys(SKIP_REASONS, 0) if stats else {},
                                               "export_errors": dict.fromkeys(EXPORTERS, 0) if stats else {}}
        gauges: dict[str, dict[str, float]] = {"tap": {}, "queue": {}}
        for pid, snap in stats:
            if not isinstance(snap, dict):
                continue
            for k in totals:
                totals[k] += int(snap.get(k) or 0)
            for k, acc in by_label.items():
                for reason, n in (snap.get(k) or {}).items():
                    acc[str(reason)] = acc.get(str(reason), 0) + int(n)
            if not self._pid_alive(pid):
                continue
            if "tap_bytes" in snap:
                gauges["tap"][""] = gauges["tap"].get("", 0) + float(snap["tap_bytes"])
            for queue, key in (("host", "queue_pending_bytes"), ("device", "device_queue_pending_bytes")):
                if key in snap:
                    gauges["queue"][queue] = gauges["queue"].get(queue, 0) + float(snap[key])
        for name, field, help_ in (
                ("captures", "captured", "Requests whose attention was captured (metrics computed)."),
                ("captures_stored", "stored", "Captures written to the store."),
                ("maps_stored", "maps_stored", "Captures stored with their full attention maps."),
        ):
            families.append(CounterMetricFamily(PREFIX + name, help_, value=totals[field]))
        for name, field, label, help_ in (
                ("captures_dropped", "dropped", "reason", f"Captures lost, by reason ({', '.join(DROP_REASONS)})."),
                ("skips", "skipped", "reason", "Requests or maps not captured by design, by reason "
                 f"({', '.join(SKIP_REASONS)})."),
                ("export_errors", "export_errors", "exporter", "Exporter failures other than the store's, by "
                 "exporter."),
        ):
            fam = CounterMetricFamily(PREFIX + name, help_, labels=[label])
            for value, n in sorted(by_label[field].items()):
                fam.add_metric([value], n)
            families.append(fam)
        families.append(CounterMetricFamily(PREFIX + "written_bytes", "Bytes written to the store.",
                                            value=totals["bytes_written"], unit="bytes"))
        if gauges["tap"]:
            families.append(GaugeMetricFamily(PREFIX + "tap_bytes", "Device memory held by capture in live engine "
                                              "processes (Q/K taps, streamed layers' query ring and "
                                              "metrics buffer).", value=gauges["tap"][""], unit="bytes"))
        if gauges["queue"]:
            fam = GaugeMetricFamily(PREFIX + "queue_pending_bytes", "Bytes of captures waiting in the hand-offs "
                                    "(host: for the writer; device: for the compute thread).", labels=["queue"],
                                    unit="bytes")
            for queue, v in sorted(gauges["queue"].items()):
                fam.add_metric([queue], v)
            families.append(fam)
        return families


DROP_REASONS = ("queue_full", "device_queue_full", "capture_error", "store_error", "shutdown", "stream_lost")
SKIP_REASONS = ("request_off", "no_tokens", "no_layers", "map_too_long", "maps_queue_full", "no_map_layers")
EXPORTERS = ("otel", "prometheus")  # the exporters after the store whose failures are counted


def _label_order(key: tuple[str, tuple[tuple[str, str], ...]]) -> tuple:
    """Layers in numeric order (``2`` before ``10``)."""
    return tuple((k, (0, int(v), "") if k == "layer" and v.isdigit() else (1, 0, v)) for k, v in key[1])


# ----------------------------------------------------------------------------------- vLLM's FastAPI app
_collectors: "weakref.WeakKeyDictionary[Any, AttnOtelCollector]" = weakref.WeakKeyDictionary()


def register_collector(registry, stats_dir: str | os.PathLike) -> AttnOtelCollector:
    """Register one :class:`AttnOtelCollector` on ``registry`` (idempotent: a second call returns the first)."""
    existing = _collectors.get(registry)
    if existing is not None:
        return existing
    collector = AttnOtelCollector(stats_dir)
    registry.register(collector)
    _collectors[registry] = collector
    return collector


def openmetrics_route(registry):
    """A Starlette route serving ``registry`` as OpenMetrics 1.0 (exemplars included) at :data:`ROUTE`."""
    import inspect

    from prometheus_client.openmetrics import exposition
    from starlette.responses import Response
    from starlette.routing import Route

    # prometheus_client 0.26's default escaping (underscores) rewrites ':' in *sample* names while keeping it
    # in the family's TYPE line, so vLLM's ``vllm:*`` samples would reach Prometheus renamed (``vllm_*``).
    # allow-utf-8 leaves legacy names (':' is legal in them) exactly as they are.
    kwargs = {}
    if "escaping" in inspect.signature(exposition.generate_latest).parameters:
        kwargs["escaping"] = exposition.ALLOWUTF8

    def endpoint(request):  # sync: Starlette runs it in its thread pool (it reads small files)
        try:
            body = exposition.generate_latest(registry, **kwargs)
        except Exception as e:  # noqa: BLE001
            logger.warning("attn-otel: OpenMetrics exposition failed: %s: %s", type(e).__name__, e)
            return Response(f"# exposition failed: {type(e).__name__}\n", status_code=500, media_type="text/plain")
        return Response(body, media_type=exposition.CONTENT_TYPE_LATEST)

    return Route(ROUTE, endpoint, methods=["GET"], name="attn_otel_metrics")


def install_api_server(app, registry=None, stats_dir: str | os.PathLike | None = None) -> None:
    """In vLLM's API-server process: put attn-otel's metrics on ``registry`` (the one ``/metrics`` serves;
    prometheus_client's default registry when None) and serve ``registry`` as OpenMetrics at
    ``GET /attn-otel/metrics`` on ``app``.  ``stats_dir`` defaults to ``ATTN_OTEL_STATS_DIR``; without one
    only the route is added.  Idempotent."""
    if registry is None:
        from prometheus_client import REGISTRY as registry  # noqa: N811
    if stats_dir is None:
        from ..config import Config

        stats_dir = Config.from_env().stats_dir
    if stats_dir:
        register_collector(registry, stats_dir)
    else:
        logger.warning("attn-otel: ATTN_OTEL_STATS_DIR is not set in the API server; %s serves vLLM's metrics "
                       "only", ROUTE)
    routes = app.router.routes
    if any(getattr(r, "path", None) == ROUTE for r in routes):
        return
    at = next((i for i, r in enumerate(routes) if getattr(r, "path", None) == "/metrics"), len(routes))
    routes.insert(at, openmetrics_route(registry))
