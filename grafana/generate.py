"""Grafana dashboards for attn-otel, generated from code.

Usage
-----
::

    python -m grafana.generate            # (re)write grafana/dashboards/*.json
    python -m grafana.generate --check    # exit 1 when a committed dashboard is stale or queries an unknown metric

(``python grafana/generate.py`` works as well.)  CI runs ``--check`` (``tests/test_grafana.py``).

Dashboards
----------
``attention-health.json`` (uid ``attn-otel-health``)
    per-layer heatmaps over time of each attention-health histogram's mean (layer on the y axis), the
    per-layer means over the time range (bar gauges and one table), and "outlier" panels: per-layer
    quantiles of each histogram with exemplars on, so a dot links to its trace (the Prometheus datasource's
    ``exemplarTraceIdDestinations`` maps the exemplar label ``trace_id`` to the trace datasource).
``capture-pipeline.json`` (uid ``attn-otel-pipeline``)
    captures per second (and the share of vLLM's finished requests captured), drops and skips by reason,
    export errors, bytes written, capture latency percentiles, hand-off queue depth and tap memory, next to
    vLLM's own throughput, TTFT, inter-token and end-to-end latency, running/waiting requests and KV-cache
    use, so capture overhead shows on one screen.

Template variables: ``datasource`` (Prometheus), ``job`` (the scrape job: pick the one that scrapes
``/attn-otel/metrics`` for exemplars), ``instance``, ``model``, and ``layer`` on the health dashboard.

The check
---------
Every ``attn_otel_*`` name in a panel query or a variable query must be a series the exporter emits: the
names come from running :class:`attn_otel.exporters.prometheus.AttnOtelCollector` itself on a synthetic
stats directory (one observation of every histogram it defines, one engine stats file), not from a second
list kept here.  Every ``vllm:*`` name must be in :data:`VLLM_METRICS`, the names the dashboards rely on;
``tests/test_grafana_live.py`` checks that list against a live vLLM server's ``/metrics``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DASHBOARDS = HERE / "dashboards"

# uids shared with grafana/provisioning/datasources/attn-otel.yaml
PROMETHEUS_UID = "attn-otel-prometheus"
TEMPO_UID = "attn-otel-tempo"
HEALTH_UID = "attn-otel-health"
PIPELINE_UID = "attn-otel-pipeline"

# vLLM's own series the pipeline dashboard reads (checked on vLLM 0.32's /metrics by tests/test_grafana_live.py;
# label model_name).  vLLM 0.32 has vllm:inter_token_latency_seconds, not the older time_per_output_token.
VLLM_METRICS: tuple[str, ...] = (
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:prompt_tokens_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket",
)

# the per-layer histograms, in panel order: (metric suffix, title, what an outlier is)
HEALTH_METRICS: tuple[tuple[str, str, str], ...] = (
    ("entropy_norm", "Normalised entropy (prompt rows)", "low"),
    ("sink_mass_first", "Sink mass on token 0 (prompt rows)", "high"),
    ("sink_mass_k", "Sink mass on the first k tokens (prompt rows)", "high"),
    ("vision_share", "Vision-token share (prompt rows, image requests)", "low"),
    ("lookback_ratio", "Lookback ratio (generated rows)", "low"),
)

RATE = "$__rate_interval"
SEL = 'job=~"$job",instance=~"$instance"'  # every series carries these
SEL_MODEL = SEL + ',model=~"$model"'  # attn-otel histograms
SEL_LAYER = SEL_MODEL + ',layer=~"$layer"'
# vLLM's own metrics name the model model_name: its served model name, which vLLM sets to the model path when
# the operator gave no --served-model-name; attn-otel's model label cuts a local path to its last component
# (attn_otel.tracking.model_name), so vLLM's series match $model with or without the folders before it.
SEL_VLLM = SEL + ',model_name=~"(.*/)?$model"'
DS = {"type": "prometheus", "uid": "${datasource}"}


# ----------------------------------------------------------------------------------------------- pieces
def target(expr: str, legend: str = "", ref: str = "A", **extra: Any) -> dict[str, Any]:
    t = {"datasource": DS, "expr": expr, "legendFormat": legend or "__auto", "refId": ref, "range": True,
         "instant": False, "editorMode": "code"}
    t.update(extra)
    return t


def instant(expr: str, legend: str = "", ref: str = "A", fmt: str = "time_series") -> dict[str, Any]:
    return target(expr, legend, ref, range=False, instant=True, format=fmt)


def panel(kind: str, title: str, targets: list[dict], x: int, y: int, w: int = 12, h: int = 8,
          description: str = "", unit: str | None = None, options: dict | None = None,
          field_defaults: dict | None = None, **extra: Any) -> dict[str, Any]:
    defaults: dict[str, Any] = {}
    if unit:
        defaults["unit"] = unit
    defaults.update(field_defaults or {})
    p = {"type": kind, "title": title, "description": description, "datasource": DS,
         "gridPos": {"x": x, "y": y, "w": w, "h": h}, "targets": targets,
         "fieldConfig": {"defaults": defaults, "overrides": []}, "options": options or {}}
    p.update(extra)
    return p


def row(title: str, y: int) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "gridPos": {"x": 0, "y": y, "w": 24, "h": 1},
            "panels": []}


def timeseries(title: str, targets: list[dict], x: int, y: int, w: int = 12, h: int = 8, unit: str | None = None,
               description: str = "", stack: bool = False, points: bool = False, **extra: Any) -> dict[str, Any]:
    custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if stack else 0, "showPoints":
              "always" if points else "auto", "spanNulls": False,
              "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
    return panel("timeseries", title, targets, x, y, w, h, description, unit,
                 options={"legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull", "max"],
                                     "showLegend": True},
                          "tooltip": {"mode": "multi", "sort": "desc"}},
                 field_defaults={"custom": custom}, **extra)


def ratio_mean(name: str, window: str, sel: str = SEL_LAYER) -> str:
    """Per-layer mean of a histogram over ``window``: the sum's increase over the count's."""
    return (f"sum by (layer) (rate(attn_otel_{name}_sum{{{sel}}}[{window}]))\n"
            f"/ sum by (layer) (rate(attn_otel_{name}_count{{{sel}}}[{window}]))")


def quantile(q: float, name: str, by: str, sel: str, window: str = RATE) -> str:
    return f"histogram_quantile({q}, sum by (le{', ' + by if by else ''}) (rate({name}{{{sel}}}[{window}])))"


def variable_query(name: str, label: str, metric: str, selector: str, hide_all: bool = False,
                   multi: bool = True) -> dict[str, Any]:
    query = f"label_values({metric}{{{selector}}}, {label})" if selector else f"label_values({metric}, {label})"
    v = {"name": name, "label": label, "type": "query", "datasource": DS, "definition": query,
         "query": {"query": query, "refId": f"{name}-values", "qryType": 1}, "refresh": 2, "sort": 3 if
         label == "layer" else 1, "multi": multi, "includeAll": not hide_all, "current": {}, "options": [],
         "regex": "", "hide": 0}
    if not hide_all:
        v["allValue"] = ".*"
    return v


def datasource_variable() -> dict[str, Any]:
    return {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
            "current": {}, "options": [], "refresh": 1, "regex": "", "hide": 0, "includeAll": False, "multi": False}


def job_variable() -> dict[str, Any]:
    # Single-valued: scraping both /metrics and /attn-otel/metrics of one server would otherwise count twice.
    v = variable_query("job", "job", "attn_otel_captures_total", "", hide_all=True, multi=False)
    v["description"] = ("The scrape job: the one scraping /attn-otel/metrics carries exemplars (trace ids); "
                        "/metrics has the same series without them.")
    return v


def dashboard(uid: str, title: str, description: str, panels: list[dict], variables: list[dict],
              links: list[dict]) -> dict[str, Any]:
    for i, p in enumerate(panels, start=1):
        p["id"] = i
    return {
        "uid": uid, "title": title, "description": description, "tags": ["attn-otel", "vllm"],
        "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1, "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"}, "timepicker": {}, "timezone": "browser", "fiscalYearStartMonth": 0,
        "liveNow": False, "weekStart": "", "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"}]},
        "links": links, "panels": panels, "templating": {"list": variables},
        "__generated_by": "grafana/generate.py (python -m grafana.generate); do not edit by hand",
    }


def link(title: str, uid: str) -> dict[str, Any]:
    return {"title": title, "type": "link", "url": f"/d/{uid}", "icon": "dashboard", "keepTime": True,
            "includeVars": True, "asDropdown": False, "targetBlank": False, "tags": [], "tooltip": ""}


# ------------------------------------------------------------------------------------ attention health
def health_dashboard() -> dict[str, Any]:
    panels: list[dict] = []
    y = 0
    panels.append(row("Per-layer heatmaps over time (mean per layer; y = layer)", y))
    y += 1
    for i, (name, title, _) in enumerate(HEALTH_METRICS):
        x, w = (0, 12) if i % 2 == 0 else (12, 12)
        if i == len(HEALTH_METRICS) - 1:
            w = 24
        panels.append(panel(
            "heatmap", title, [target(ratio_mean(name, RATE), "{{layer}}")], x, y, w, 9,
            description=f"attn_otel_{name}: mean over the captures finished in each interval, per captured layer "
                        "(one row per layer). Empty cells: no capture in that interval.",
            options={"calculate": False, "cellGap": 1, "cellValues": {"decimals": 3},
                     "color": {"mode": "scheme", "scheme": "Viridis", "fill": "dark-orange", "scale": "linear",
                               "exponent": 0.5, "steps": 64, "reverse": False, "min": 0, "max": 1},
                     "exemplars": {"color": "rgba(255,0,255,0.7)"}, "filterValues": {"le": 1e-09},
                     "legend": {"show": True}, "rowsFrame": {"layout": "unknown", "value": "layer"},
                     "showValue": "never", "tooltip": {"mode": "single", "yHistogram": False, "showColorScale": True},
                     "yAxis": {"axisPlacement": "left", "axisLabel": "layer", "reverse": False}},
            field_defaults={"custom": {"hideFrom": {"legend": False, "tooltip": False, "viz": False},
                                       "scaleDistribution": {"type": "linear"}}}))
        if x == 12 or w == 24:
            y += 9
    panels.append(row("Per-layer values over the time range", y))
    y += 1
    x = 0
    for i, (name, title, _) in enumerate(HEALTH_METRICS):
        w = 24 // len(HEALTH_METRICS) + (1 if i < 24 % len(HEALTH_METRICS) else 0)
        panels.append(panel(
            "bargauge", title.split(" (")[0], [instant(ratio_mean(name, "$__range"), "layer {{layer}}")],
            x=x, y=y, w=w, h=10,
            description=f"attn_otel_{name}: per-layer mean over every capture in the dashboard's time range.",
            unit="percentunit" if name != "entropy_norm" else "none",
            options={"displayMode": "gradient", "orientation": "horizontal", "showUnfilled": True, "valueMode":
                     "color", "minVizHeight": 10, "minVizWidth": 0, "namePlacement": "left", "sizing": "auto",
                     "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
            field_defaults={"min": 0, "max": 1, "decimals": 3, "color": {"mode": "continuous-BlYlRd"}}))
        x += w
    y += 10
    table_targets = [instant(ratio_mean(name, "$__range"), "", ref=chr(ord("A") + i), fmt="table")
                     for i, (name, _, _) in enumerate(HEALTH_METRICS)]
    renames = {f"Value #{chr(ord('A') + i)}": name for i, (name, _, _) in enumerate(HEALTH_METRICS)}
    panels.append(panel(
        "table", "Per-layer means over the time range", table_targets, 0, y, 24, 8,
        description="One row per captured layer; columns are the means of each health histogram over the range.",
        options={"showHeader": True, "cellHeight": "sm", "sortBy": [{"displayName": "layer", "desc": False}]},
        field_defaults={"decimals": 3},
        transformations=[{"id": "merge", "options": {}},
                         {"id": "organize", "options": {"excludeByName": {"Time": True}, "renameByName": renames,
                                                        "indexByName": {}}},
                         {"id": "convertFieldType", "options": {"conversions": [
                             {"targetField": "layer", "destinationType": "number"}], "fields": {}}},
                         {"id": "sortBy", "options": {"sort": [{"field": "layer"}]}}]))
    y += 8
    panels.append(row("Outliers: per-layer quantiles with exemplars (click a dot: its trace; the span's "
                      "attn_otel.fetch_command gets the maps)", y))
    y += 1
    for i, (name, title, tail) in enumerate(HEALTH_METRICS):
        q = 0.99 if tail == "high" else 0.01
        bucket = f"attn_otel_{name}_bucket"
        ts = timeseries(
            f"{title}: p50 and p{int(q * 100):02d} per layer, exemplars", [
                target(quantile(0.5, bucket, "layer", SEL_LAYER), "p50 layer {{layer}}", "A", exemplar=True),
                target(quantile(q, bucket, "layer", SEL_LAYER), f"p{int(q * 100):02d} layer {{{{layer}}}}", "B",
                       exemplar=True),
            ], x=0 if i % 2 == 0 else 12, y=y, w=24 if i == len(HEALTH_METRICS) - 1 else 12, h=9, unit="none",
            description=f"Each exemplar is the latest capture that fell into a bucket of attn_otel_{name} "
                        f"(its value: that request's layer mean); an outlier sits far {tail}. Its trace_id opens "
                        "the attn_capture span, whose attribute attn_otel.fetch_command fetches the maps "
                        "(attn-otel show TRACE_ID --layer L).")
        ts["fieldConfig"]["defaults"].update({"min": 0, "max": 1})
        panels.append(ts)
        if i % 2 == 1 or i == len(HEALTH_METRICS) - 1:
            y += 9
    variables = [datasource_variable(), job_variable(),
                 variable_query("instance", "instance", "attn_otel_captures_total", 'job=~"$job"'),
                 variable_query("model", "model", "attn_otel_capture_latency_seconds_count",
                                'job=~"$job",instance=~"$instance"'),
                 variable_query("layer", "layer", "attn_otel_entropy_norm_count",
                                'job=~"$job",instance=~"$instance",model=~"$model"')]
    return dashboard(HEALTH_UID, "attn-otel: attention health",
                     "Per-layer attention health of the requests vLLM served (attn-otel histograms), with exemplars "
                     "linking outliers to their traces.", panels, variables,
                     [link("Capture pipeline", PIPELINE_UID)])


# ------------------------------------------------------------------------------------- capture pipeline
def pipeline_dashboard() -> dict[str, Any]:
    p: list[dict] = []
    y = 0
    p.append(row("Captures", y))
    y += 1
    p.append(timeseries("Captures per second", [
        target(f"sum(rate(attn_otel_captures_total{{{SEL}}}[{RATE}]))", "captured", "A"),
        target(f"sum(rate(attn_otel_captures_stored_total{{{SEL}}}[{RATE}]))", "stored", "B"),
        target(f"sum(rate(attn_otel_maps_stored_total{{{SEL}}}[{RATE}]))", "stored with maps", "C"),
        target(f"sum(rate(vllm:request_success_total{{{SEL_VLLM}}}[{RATE}]))", "vLLM finished requests", "D"),
    ], 0, y, 8, 8, unit="reqps", description="Requests captured (metrics computed), stored, and stored with full "
                                                 "maps, beside vLLM's finished requests."))
    p.append(timeseries("Drops by reason (captures lost)", [
        target(f"sum by (reason) (rate(attn_otel_captures_dropped_total{{{SEL}}}[{RATE}]))\n"
               f'or on() label_replace(vector(0), "reason", "none", "", "")', "{{reason}}", "A"),
    ], 8, y, 8, 8, unit="reqps", stack=True,
        description="attn_otel_captures_dropped_total by reason (queue_full, device_queue_full, capture_error, "
                    "store_error, shutdown, stream_lost): the engine never waits, so a full hand-off drops. A flat 'none' "
                    "series means no drop at all yet."))
    p.append(timeseries("Skips by reason (not captured by design)", [
        target(f"sum by (reason) (rate(attn_otel_skips_total{{{SEL}}}[{RATE}]))\n"
               f'or on() label_replace(vector(0), "reason", "none", "", "")', "{{reason}}", "A"),
        target(f"sum by (exporter) (rate(attn_otel_export_errors_total{{{SEL}}}[{RATE}]))\n"
               f'or on() label_replace(vector(0), "exporter", "none", "", "")', "export errors: {{exporter}}", "B"),
    ], 16, y, 8, 8, unit="reqps", stack=False,
        description="attn_otel_skips_total by reason (request_off, no_tokens, no_layers, map_too_long, "
                    "maps_queue_full, no_map_layers) and export errors by exporter."))
    y += 8
    p.append(timeseries("Captured share of finished requests", [
        target(f"sum(rate(attn_otel_captures_total{{{SEL}}}[{RATE}]))\n"
               f"/ sum(rate(vllm:request_success_total{{{SEL_VLLM}}}[{RATE}]))", "captured / finished", "A"),
    ], 0, y, 8, 8, unit="percentunit", description="Below 1: requests turned off, skipped or dropped."))
    p.append(timeseries("Bytes written to the store", [
        target(f"sum(rate(attn_otel_written_bytes_total{{{SEL}}}[{RATE}]))", "written", "A"),
    ], 8, y, 8, 8, unit="Bps"))
    p.append(timeseries("Capture latency (request finish to metrics on the host)", [
        target(quantile(q, "attn_otel_capture_latency_seconds_bucket", "", SEL_MODEL), f"p{int(q * 100)}", ref)
        for q, ref in ((0.5, "A"), (0.9, "B"), (0.99, "C"))
    ], 16, y, 8, 8, unit="s"))
    y += 8
    p.append(timeseries("Hand-off queue depth", [
        target(f"sum by (queue) (attn_otel_queue_pending_bytes{{{SEL}}})", "{{queue}} queue", "A"),
    ], 0, y, 8, 8, unit="bytes", description="Bytes of captures waiting: device (for the compute thread) and host "
                                             "(for the writer). A queue that stays high precedes drops."))
    p.append(timeseries("Device memory of the Q/K taps", [
        target(f"sum by (instance) (attn_otel_tap_bytes{{{SEL}}})", "{{instance}}", "A"),
    ], 8, y, 8, 8, unit="bytes", description="Memory the taps hold beside the KV cache (fixed after start-up)."))
    # A reason's counter appears only once it is non-zero, so rate() never sees its first increment: the
    # totals show it.
    p.append(panel("bargauge", "Dropped and skipped so far, by reason", [
        instant(f"sum by (reason) (attn_otel_captures_dropped_total{{{SEL}}})\n"
                f'or on() label_replace(vector(0), "reason", "none", "", "")', "dropped: {{reason}}", "A"),
        instant(f"sum by (reason) (attn_otel_skips_total{{{SEL}}})\n"
                f'or on() label_replace(vector(0), "reason", "none", "", "")', "skipped: {{reason}}", "B"),
    ], 16, y, 8, 8, description="Counter totals since the server started (the first event of a new reason is "
                                "invisible to rate(): its series starts at 1).", unit="short",
        options={"displayMode": "basic", "orientation": "horizontal", "showUnfilled": True, "valueMode": "color",
                 "namePlacement": "left", "sizing": "auto",
                 "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
        field_defaults={"min": 0, "decimals": 0}))
    y += 8
    p.append(row("vLLM (overhead shows here)", y))
    y += 1
    p.append(timeseries("vLLM token throughput", [
        target(f"sum(rate(vllm:generation_tokens_total{{{SEL_VLLM}}}[{RATE}]))", "generated tokens/s", "A"),
        target(f"sum(rate(vllm:prompt_tokens_total{{{SEL_VLLM}}}[{RATE}]))", "prompt tokens/s", "B"),
    ], 0, y, 8, 8, unit="short"))
    p.append(timeseries("vLLM time to first token", [
        target(quantile(q, "vllm:time_to_first_token_seconds_bucket", "", SEL_VLLM), f"p{int(q * 100)}", ref)
        for q, ref in ((0.5, "A"), (0.99, "B"))
    ], 8, y, 8, 8, unit="s"))
    p.append(timeseries("vLLM inter-token latency", [
        target(quantile(q, "vllm:inter_token_latency_seconds_bucket", "", SEL_VLLM), f"p{int(q * 100)}", ref)
        for q, ref in ((0.5, "A"), (0.99, "B"))
    ], 16, y, 8, 8, unit="s"))
    y += 8
    p.append(timeseries("vLLM end-to-end request latency", [
        target(quantile(q, "vllm:e2e_request_latency_seconds_bucket", "", SEL_VLLM), f"p{int(q * 100)}", ref)
        for q, ref in ((0.5, "A"), (0.99, "B"))
    ], 0, y, 8, 8, unit="s"))
    p.append(timeseries("vLLM requests", [
        target(f"sum(vllm:num_requests_running{{{SEL_VLLM}}})", "running", "A"),
        target(f"sum(vllm:num_requests_waiting{{{SEL_VLLM}}})", "waiting", "B"),
    ], 8, y, 8, 8, unit="short"))
    p.append(timeseries("vLLM KV-cache use", [
        target(f"max(vllm:kv_cache_usage_perc{{{SEL_VLLM}}})", "KV cache used", "A"),
    ], 16, y, 8, 8, unit="percentunit"))
    variables = [datasource_variable(), job_variable(),
                 variable_query("instance", "instance", "attn_otel_captures_total", 'job=~"$job"'),
                 variable_query("model", "model", "attn_otel_capture_latency_seconds_count",
                                'job=~"$job",instance=~"$instance"')]
    return dashboard(PIPELINE_UID, "attn-otel: capture pipeline",
                     "attn-otel's capture throughput, drops, bytes, latency and queues beside vLLM's own throughput "
                     "and latency.", p, variables, [link("Attention health", HEALTH_UID)])


def build() -> dict[str, dict[str, Any]]:
    """File name -> dashboard JSON model."""
    return {"attention-health.json": health_dashboard(), "capture-pipeline.json": pipeline_dashboard()}


def render(model: dict[str, Any]) -> str:
    return json.dumps(model, indent=2, sort_keys=True) + "\n"


# ------------------------------------------------------------------------------------------------ check
def iter_targets(model: dict[str, Any]) -> Iterator[tuple[dict, dict]]:
    """``(panel, target)`` for every query target of a dashboard (rows' nested panels included)."""
    for p in model.get("panels", []):
        for q in [p, *p.get("panels", [])]:
            for t in q.get("targets", []):
                yield q, t


def queries(model: dict[str, Any]) -> list[str]:
    """Every PromQL text the dashboard holds: panel targets and variable queries."""
    out = [t["expr"] for _, t in iter_targets(model)]
    for v in model.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            out.append(v["query"]["query"] if isinstance(v["query"], dict) else v["query"])
    return out


def regex_value(values: Iterable[str]) -> str:
    """How Grafana's Prometheus datasource writes a multi-value variable inside ``=~"..."``: each value
    regex-escaped, joined as ``(a|b)``; backslashes doubled for the PromQL string literal."""
    escaped = [re.sub(r"([\\^$*+?.()|{}\[\]/])", r"\\\1", v) for v in values]
    text = escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"
    return text.replace("\\", "\\\\")


def interpolate(expr: str, variables: dict[str, str], rate_interval: str = "30s", range_: str = "1h",
                interval: str = "15s") -> str:
    """``expr`` with Grafana's built-ins and the dashboard variables substituted, the way Grafana sends it
    to Prometheus (``variables`` maps a name to its already formatted text, see :func:`regex_value`)."""
    builtins = {"__rate_interval": rate_interval, "__range": range_, "__interval": interval}
    names = sorted({**builtins, **variables}, key=len, reverse=True)
    out = re.sub(r"\$\{(\w+)\}|\$(" + "|".join(map(re.escape, names)) + r")\b",
                 lambda m: {**builtins, **variables}.get(m.group(1) or m.group(2), m.group(0)), expr)
    if "$" in out:
        raise ValueError(f"unsubstituted variable in {out!r}")
    return out


METRIC_NAME = re.compile(r"(?<![\w:\"])(attn_otel_\w+|vllm:[\w:]+)")


def metric_names(promql: str) -> set[str]:
    return set(METRIC_NAME.findall(promql))


def exported_attn_otel_names() -> set[str]:
    """The series names attn-otel's Prometheus exporter emits, found by running its collector on a stats
    directory with one observation of every histogram the module defines and one full engine stats file."""
    sys.path.insert(0, str(ROOT))
    from attn_otel.exporters import prometheus as exporter

    with tempfile.TemporaryDirectory() as stats_dir:
        writer = exporter.PrometheusExporter(stats_dir)
        for name in exporter.LAYER_METRICS:
            writer.observe(name, {"model": "m", "layer": "0"}, 0.5, "0" * 32)
        writer.observe(exporter.LATENCY, {"model": "m"}, 0.01, "0" * 32)
        writer.write()
        stats = {"captured": 1, "stored": 1, "maps_stored": 1, "bytes_written": 1, "dropped": {"queue_full": 1},
                 "skipped": {"request_off": 1}, "export_errors": {"otel": 1}, "tap_bytes": 1,
                 "queue_pending_bytes": 0, "device_queue_pending_bytes": 0}
        with open(os.path.join(stats_dir, f"attn-otel-stats-{os.getpid()}.json"), "w") as f:
            json.dump(stats, f)
        families = exporter.AttnOtelCollector(stats_dir).collect()
        return {s.name for fam in families for s in fam.samples}


def problems(models: dict[str, dict[str, Any]], committed_dir: Path = DASHBOARDS,
             attn_names: Iterable[str] | None = None) -> list[str]:
    """What ``--check`` reports: stale or missing files, unknown metric names, duplicate panel ids/refIds."""
    found: list[str] = []
    known = set(attn_names) if attn_names is not None else exported_attn_otel_names()
    for file, model in models.items():
        path = committed_dir / file
        if not path.is_file():
            found.append(f"{path}: missing (run python -m grafana.generate)")
        elif path.read_text() != render(model):
            found.append(f"{path}: stale (run python -m grafana.generate)")
        for expr in queries(model):
            for name in sorted(metric_names(expr)):
                if name.startswith("attn_otel_") and name not in known:
                    found.append(f"{file}: {name} is not exported by attn-otel (in: {expr!r})")
                elif name.startswith("vllm:") and name not in VLLM_METRICS:
                    found.append(f"{file}: {name} is not in VLLM_METRICS (in: {expr!r})")
        ids = [p["id"] for p in model["panels"]]
        if len(ids) != len(set(ids)):
            found.append(f"{file}: duplicate panel ids")
        for p in model["panels"]:
            refs = [t["refId"] for t in p.get("targets", [])]
            if len(refs) != len(set(refs)):
                found.append(f"{file}: panel {p['title']!r} repeats a refId")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grafana.generate", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when the committed dashboards "
                                                             "are stale or query a metric attn-otel does not export")
    parser.add_argument("--out", type=Path, default=DASHBOARDS, help="dashboards directory (default: %(default)s)")
    args = parser.parse_args(argv)
    models = build()
    if args.check:
        found = problems(models, args.out)
        for line in found:
            print(line, file=sys.stderr)
        if not found:
            print(f"{len(models)} dashboards up to date, every metric exported")
        return 1 if found else 0
    bad = problems(models, args.out)
    bad = [b for b in bad if not b.endswith("(run python -m grafana.generate)")]
    if bad:
        for line in bad:
            print(line, file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    for file, model in models.items():
        (args.out / file).write_text(render(model))
        print(f"wrote {args.out / file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
