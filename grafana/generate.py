"""Grafana dashboards for attn-otel, generated from code with Grafana's own dashboards-as-code SDK.

Usage
-----
::

    python -m grafana.generate            # (re)write grafana/dashboards/*.json
    python -m grafana.generate --check    # exit 1 when a committed dashboard is stale or queries an unknown metric

(``python grafana/generate.py`` works as well.)  CI runs ``--check`` (``tests/test_grafana.py``).

The JSON is what the builders and models of ``grafana-foundation-sdk`` (Grafana Labs' SDK, the build of its
types for Grafana 10.4, pinned in constraints.txt) serialise: dashboard, panels (timeseries, heatmap,
bargauge, table), Prometheus queries and variables are the SDK's types, not dictionaries written here.
``tests/test_grafana_schema.py`` then type-checks every dashboard, panel options, field config and query
against Grafana's published TypeScript schema (``@grafana/schema`` 10.4.2, see :mod:`grafana.schema_check`).

Dashboards
----------
``attention-health.json`` (uid ``attn-otel-health``)
    per-layer heatmaps over time of each attention-health histogram's mean (layer on the y axis), the
    per-layer means over the time range (bar gauges and one table), and "outlier" panels: per-layer
    quantiles of each histogram with exemplars on, so a dot links to its trace (the Prometheus datasource's
    ``exemplarTraceIdDestinations`` maps the exemplar label ``trace_id`` to the trace datasource) and, through
    a data link on the ``trace_id`` field, to the capture's maps in the attn-otel viewer
    (``$attn_otel_url/attn-otel/view/TRACE_ID``).
``capture-pipeline.json`` (uid ``attn-otel-pipeline``)
    captures per second (and the share of vLLM's finished requests captured), drops and skips by reason,
    export errors, bytes written, capture latency percentiles, hand-off queue depth and tap memory, next to
    vLLM's own throughput, TTFT, inter-token and end-to-end latency, running/waiting requests and KV-cache
    use, so capture overhead shows on one screen.

Template variables: ``datasource`` (Prometheus), ``job`` (the scrape job: pick the one that scrapes
``/attn-otel/metrics`` for exemplars), ``instance``, ``model``, and on the health dashboard ``layer`` and
``attn_otel_url`` (the vLLM API server that serves the viewer; default ``http://localhost:8000``).

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

from grafana_foundation_sdk.builders import bargauge, common as cb, dashboard as db, heatmap, prometheus
from grafana_foundation_sdk.builders import table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm, dashboard as dm, heatmap as hm
from grafana_foundation_sdk.models.prometheus import PromQueryFormat, QueryEditorMode

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DASHBOARDS = HERE / "dashboards"

# uids shared with grafana/provisioning/datasources/attn-otel.yaml
PROMETHEUS_UID = "attn-otel-prometheus"
TEMPO_UID = "attn-otel-tempo"
HEALTH_UID = "attn-otel-health"
PIPELINE_UID = "attn-otel-pipeline"
SCHEMA_VERSION = 39  # Grafana 10.4's dashboard schema, the version the SDK's types are built for

# The attn-otel viewer, served by the vLLM API server (ATTN_OTEL=1): one capture's maps by trace id.  The
# base URL is the dashboard variable; ``:raw`` keeps Grafana from URL-encoding it inside the link.
VIEWER_VARIABLE = "attn_otel_url"
VIEWER_DEFAULT = "http://localhost:8000"
VIEWER_PATH = "/attn-otel/view/"
VIEWER_LINK = f"${{{VIEWER_VARIABLE}:raw}}{VIEWER_PATH}${{__value.raw}}"
TRACE_FIELD = "trace_id"  # the exemplar label the exporter writes (and the datasource maps to traces)

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
    ("learned_sink_mass", "Learned sink mass (prompt rows, models with learned sinks)", "high"),
)

RATE = "$__rate_interval"
SEL = 'job=~"$job",instance=~"$instance"'  # every series carries these
SEL_MODEL = SEL + ',model=~"$model"'  # attn-otel histograms
SEL_LAYER = SEL_MODEL + ',layer=~"$layer"'
# vLLM's own metrics name the model model_name: its served model name, which vLLM sets to the model path when
# the operator gave no --served-model-name; attn-otel's model label cuts a local path to its last component
# (attn_otel.tracking.model_name), so vLLM's series match $model with or without the folders before it.
SEL_VLLM = SEL + ',model_name=~"(.*/)?$model"'
DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")


# ----------------------------------------------------------------------------------------------- pieces
def target(expr: str, legend: str = "", ref: str = "A", exemplar: bool | None = None) -> prometheus.Dataquery:
    q = (prometheus.Dataquery().datasource(DS).expr(expr).legend_format(legend or "__auto").ref_id(ref).range()
         .editor_mode(QueryEditorMode.CODE))
    return q if exemplar is None else q.exemplar(exemplar)


def instant(expr: str, legend: str = "", ref: str = "A",
            fmt: PromQueryFormat = PromQueryFormat.TIME_SERIES) -> prometheus.Dataquery:
    return target(expr, legend, ref).instant().format(fmt)


def place(p, title: str, targets: list[prometheus.Dataquery], x: int, y: int, w: int, h: int,
          description: str = "", unit: str | None = None):
    """Title, queries, datasource and grid position: what every panel builder is given."""
    p = p.title(title).description(description).datasource(DS).grid_pos(dm.GridPos(h=h, w=w, x=x, y=y))
    p = p.targets(targets)
    return p.unit(unit) if unit else p


def row(title: str, y: int) -> db.Row:
    return db.Row(title).collapsed(False).grid_pos(dm.GridPos(h=1, w=24, x=0, y=y))


def timeseries_panel(title: str, targets: list[prometheus.Dataquery], x: int, y: int, w: int = 12, h: int = 8,
                     unit: str | None = None, description: str = "", stack: bool = False,
                     points: bool = False) -> timeseries.Panel:
    return (place(timeseries.Panel(), title, targets, x, y, w, h, description, unit)
            .legend(cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.TABLE)
                    .placement(cm.LegendPlacement.RIGHT).calcs(["lastNotNull", "max"]).show_legend(True))
            .tooltip(cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING))
            .draw_style(cm.GraphDrawStyle.LINE).line_width(1).fill_opacity(10 if stack else 0)
            .show_points(cm.VisibilityMode.ALWAYS if points else cm.VisibilityMode.AUTO).span_nulls(False)
            .stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL if stack else cm.StackingMode.NONE)
                      .group("A")))


def bargauge_panel(title: str, targets: list[prometheus.Dataquery], x: int, y: int, w: int, h: int,
                   description: str, unit: str, mode: cm.BarGaugeDisplayMode) -> bargauge.Panel:
    return (place(bargauge.Panel(), title, targets, x, y, w, h, description, unit)
            .display_mode(mode).orientation(cm.VizOrientation.HORIZONTAL).show_unfilled(True)
            .value_mode(cm.BarGaugeValueMode.COLOR).name_placement(cm.BarGaugeNamePlacement.LEFT)
            .sizing(cm.BarGaugeSizing.AUTO)
            .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False)))


def ratio_mean(name: str, window: str, sel: str = SEL_LAYER) -> str:
    """Per-layer mean of a histogram over ``window``: the sum's increase over the count's."""
    return (f"sum by (layer) (rate(attn_otel_{name}_sum{{{sel}}}[{window}]))\n"
            f"/ sum by (layer) (rate(attn_otel_{name}_count{{{sel}}}[{window}]))")


def quantile(q: float, name: str, by: str, sel: str, window: str = RATE) -> str:
    return f"histogram_quantile({q}, sum by (le{', ' + by if by else ''}) (rate({name}{{{sel}}}[{window}])))"


def variable_query(name: str, label: str, metric: str, selector: str, hide_all: bool = False,
                   multi: bool = True) -> db.QueryVariable:
    query = f"label_values({metric}{{{selector}}}, {label})" if selector else f"label_values({metric}, {label})"
    v = (db.QueryVariable(name).label(label).datasource(DS)
         .query({"query": query, "refId": f"{name}-values", "qryType": 1})
         .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
         .sort(dm.VariableSort.NUMERICAL_ASC if label == "layer" else dm.VariableSort.ALPHABETICAL_ASC)
         .multi(multi).include_all(not hide_all).regex("").hide(dm.VariableHide.DONT_HIDE))
    return v if hide_all else v.all_value(".*")


def datasource_variable() -> db.DatasourceVariable:
    return (db.DatasourceVariable("datasource").label("Prometheus").type("prometheus").regex("")
            .hide(dm.VariableHide.DONT_HIDE).include_all(False).multi(False))


def job_variable() -> db.QueryVariable:
    # Single-valued: scraping both /metrics and /attn-otel/metrics of one server would otherwise count twice.
    return variable_query("job", "job", "attn_otel_captures_total", "", hide_all=True, multi=False).description(
        "The scrape job: the one scraping /attn-otel/metrics carries exemplars (trace ids); /metrics has the "
        "same series without them.")


def viewer_variable() -> db.TextBoxVariable:
    return (db.TextBoxVariable(VIEWER_VARIABLE).label("attn-otel viewer")
            .description("Base URL of the vLLM API server running with ATTN_OTEL=1: the trace_id of an exemplar "
                         f"links to {{this}}{VIEWER_PATH}TRACE_ID, the capture's attention maps.")
            .default_value(VIEWER_DEFAULT)
            .current(dm.VariableOption(text=VIEWER_DEFAULT, value=VIEWER_DEFAULT))
            .hide(dm.VariableHide.DONT_HIDE))


def viewer_link() -> dict[str, Any]:
    """A data link (Grafana's ``DataLink``: title, url, targetBlank) from a trace id to its maps."""
    return {"title": "Attention maps of this capture (attn-otel viewer)", "url": VIEWER_LINK, "targetBlank": True}


def dashboard(uid: str, title: str, description: str, panels: list, variables: list,
              links: list[db.DashboardLink]) -> dict[str, Any]:
    d = (db.Dashboard(title).uid(uid).description(description).tags(["attn-otel", "vllm"]).editable()
         .tooltip(dm.DashboardCursorSync.CROSSHAIR).version(1).refresh("30s").time("now-1h", "now")
         .timepicker(db.TimePicker()).timezone(cm.TimeZoneBrowser).fiscal_year_start_month(0).live_now(False)
         .week_start("").links(links).variables(variables)
         .annotation(db.AnnotationQuery().built_in(1).datasource(dm.DataSourceRef(type_val="grafana",
                                                                                  uid="-- Grafana --"))
                     .enable(True).hide(True).icon_color("rgba(0, 211, 255, 1)").name("Annotations & Alerts")
                     .type("dashboard")))
    for p in panels:
        d = d.with_row(p) if isinstance(p, db.Row) else d.with_panel(p)
    model = d.build()
    model.schema_version = SCHEMA_VERSION
    for v in model.templating.list_val or []:
        # The SDK's variable model carries the interval variable's auto/auto_min/auto_count on every variable;
        # Grafana 10.4's schema has them on none (tests/test_grafana_schema.py), and they mean nothing here.
        v.auto = v.auto_min = v.auto_count = None
    for i, p in enumerate(model.panels or [], start=1):
        p.id_val = i
    return to_json(model)


def to_json(obj: Any) -> Any:
    """The JSON the SDK serialises for a model or a builder (built first)."""
    return json.loads(JSONEncoder().encode(obj.build() if hasattr(obj, "build") else obj))


def link(title: str, uid: str) -> db.DashboardLink:
    return (db.DashboardLink(title).type(dm.DashboardLinkType.LINK).url(f"/d/{uid}").icon("dashboard")
            .keep_time(True).include_vars(True).as_dropdown(False).target_blank(False).tags([]).tooltip(""))


# ------------------------------------------------------------------------------------ attention health
def health_dashboard() -> dict[str, Any]:
    panels: list = []
    y = 0
    panels.append(row("Per-layer heatmaps over time (mean per layer; y = layer)", y))
    y += 1
    for i, (name, title, _) in enumerate(HEALTH_METRICS):
        x, w = (0, 12) if i % 2 == 0 else (12, 12)
        if i == len(HEALTH_METRICS) - 1:
            w = 24
        panels.append(
            place(heatmap.Panel(), title, [target(ratio_mean(name, RATE), "{{layer}}")], x, y, w, 9,
                  description=f"attn_otel_{name}: mean over the captures finished in each interval, per captured "
                              "layer (one row per layer). Empty cells: no capture in that interval.")
            .calculate(False).cell_gap(1).cell_values(heatmap.CellValues().decimals(3))
            .color(heatmap.HeatmapColorOptions().mode(hm.HeatmapColorMode.SCHEME).scheme("Viridis")
                   .fill("dark-orange").scale(hm.HeatmapColorScale.LINEAR).exponent(0.5).steps(64).reverse(False)
                   .min(0).max(1))
            .exemplars_color("rgba(255,0,255,0.7)").filter_values(heatmap.FilterValueRange().le(1e-09))
            .show_legend().rows_frame(heatmap.RowsHeatmapOptions().layout(cm.HeatmapCellLayout.UNKNOWN)
                                      .value("layer"))
            .show_value(cm.VisibilityMode.NEVER).mode(cm.TooltipDisplayMode.SINGLE).hide_y_histogram()
            .show_color_scale(True)
            .y_axis(heatmap.YAxisConfig().axis_placement(cm.AxisPlacement.LEFT).axis_label("layer").reverse(False))
            .hide_from(cb.HideSeriesConfig().legend(False).tooltip(False).viz(False))
            .scale_distribution(cb.ScaleDistributionConfig().type(cm.ScaleDistribution.LINEAR)))
        if x == 12 or w == 24:
            y += 9
    panels.append(row("Per-layer values over the time range", y))
    y += 1
    x = 0
    for i, (name, title, _) in enumerate(HEALTH_METRICS):
        w = 24 // len(HEALTH_METRICS) + (1 if i < 24 % len(HEALTH_METRICS) else 0)
        panels.append(
            bargauge_panel(title.split(" (")[0], [instant(ratio_mean(name, "$__range"), "layer {{layer}}")],
                           x, y, w, 10,
                           description=f"attn_otel_{name}: per-layer mean over every capture in the dashboard's "
                                       "time range.",
                           unit="percentunit" if name != "entropy_norm" else "none",
                           mode=cm.BarGaugeDisplayMode.GRADIENT)
            .min_viz_height(10).min_viz_width(0).min(0).max(1).decimals(3)
            .color_scheme(db.FieldColor().mode(dm.FieldColorModeId.CONTINUOUS_BL_YL_RD)))
        x += w
    y += 10
    table_targets = [instant(ratio_mean(name, "$__range"), "", ref=chr(ord("A") + i), fmt=PromQueryFormat.TABLE)
                     for i, (name, _, _) in enumerate(HEALTH_METRICS)]
    renames = {f"Value #{chr(ord('A') + i)}": name for i, (name, _, _) in enumerate(HEALTH_METRICS)}
    panels.append(
        place(table.Panel(), "Per-layer means over the time range", table_targets, 0, y, 24, 8,
              description="One row per captured layer; columns are the means of each health histogram over the "
                          "range.")
        .show_header(True).cell_height(cm.TableCellHeight.SM)
        .sort_by([cb.TableSortByFieldState().display_name("layer").desc(False)]).decimals(3)
        .transformations([
            dm.DataTransformerConfig(id_val="merge", options={}),
            dm.DataTransformerConfig(id_val="organize", options={
                "excludeByName": {"Time": True}, "renameByName": renames, "indexByName": {}}),
            dm.DataTransformerConfig(id_val="convertFieldType", options={
                "conversions": [{"targetField": "layer", "destinationType": "number"}], "fields": {}}),
            dm.DataTransformerConfig(id_val="sortBy", options={"sort": [{"field": "layer"}]})]))
    y += 8
    panels.append(row("Outliers: per-layer quantiles with exemplars (click a dot: its trace, or its maps in the "
                      "attn-otel viewer)", y))
    y += 1
    for i, (name, title, tail) in enumerate(HEALTH_METRICS):
        q = 0.99 if tail == "high" else 0.01
        bucket = f"attn_otel_{name}_bucket"
        panels.append(timeseries_panel(
            f"{title}: p50 and p{int(q * 100):02d} per layer, exemplars", [
                target(quantile(0.5, bucket, "layer", SEL_LAYER), "p50 layer {{layer}}", "A", exemplar=True),
                target(quantile(q, bucket, "layer", SEL_LAYER), f"p{int(q * 100):02d} layer {{{{layer}}}}", "B",
                       exemplar=True),
            ], x=0 if i % 2 == 0 else 12, y=y, w=24 if i == len(HEALTH_METRICS) - 1 else 12, h=9, unit="none",
            description=f"Each exemplar is the latest capture that fell into a bucket of attn_otel_{name} "
                        f"(its value: that request's layer mean); an outlier sits far {tail}. Its trace_id opens "
                        "the attn_capture span (whose attribute attn_otel.fetch_command fetches the maps: "
                        "attn-otel show TRACE_ID --layer L) and links to the capture's maps in the attn-otel "
                        f"viewer at $attn_otel_url{VIEWER_PATH}TRACE_ID.")
            .min(0).max(1)
            .override_by_name(TRACE_FIELD, [dm.DynamicConfigValue(id_val="links", value=[viewer_link()])]))
        if i % 2 == 1 or i == len(HEALTH_METRICS) - 1:
            y += 9
    variables = [datasource_variable(), job_variable(),
                 variable_query("instance", "instance", "attn_otel_captures_total", 'job=~"$job"'),
                 variable_query("model", "model", "attn_otel_capture_latency_seconds_count",
                                'job=~"$job",instance=~"$instance"'),
                 variable_query("layer", "layer", "attn_otel_entropy_norm_count",
                                'job=~"$job",instance=~"$instance",model=~"$model"'),
                 viewer_variable()]
    return dashboard(HEALTH_UID, "attn-otel: attention health",
                     "Per-layer attention health of the requests vLLM served (attn-otel histograms), with exemplars "
                     "linking outliers to their traces and to their maps in the attn-otel viewer.", panels, variables,
                     [link("Capture pipeline", PIPELINE_UID)])


# ------------------------------------------------------------------------------------- capture pipeline
def pipeline_dashboard() -> dict[str, Any]:
    p: list = []
    ts = timeseries_panel
    y = 0
    p.append(row("Captures", y))
    y += 1
    p.append(ts("Captures per second", [
        target(f"sum(rate(attn_otel_captures_total{{{SEL}}}[{RATE}]))", "captured", "A"),
        target(f"sum(rate(attn_otel_captures_stored_total{{{SEL}}}[{RATE}]))", "stored", "B"),
        target(f"sum(rate(attn_otel_maps_stored_total{{{SEL}}}[{RATE}]))", "stored with maps", "C"),
        target(f"sum(rate(vllm:request_success_total{{{SEL_VLLM}}}[{RATE}]))", "vLLM finished requests", "D"),
    ], 0, y, 8, 8, unit="reqps", description="Requests captured (metrics computed), stored, and stored with full "
                                                 "maps, beside vLLM's finished requests."))
    p.append(ts("Drops by reason (captures lost)", [
        target(f"sum by (reason) (rate(attn_otel_captures_dropped_total{{{SEL}}}[{RATE}]))\n"
               f'or on() label_replace(vector(0), "reason", "none", "", "")', "{{reason}}", "A"),
    ], 8, y, 8, 8, unit="reqps", stack=True,
        description="attn_otel_captures_dropped_total by reason (queue_full, device_queue_full, capture_error, "
                    "store_error, shutdown, stream_lost): the engine never waits, so a full hand-off drops. A flat 'none' "
                    "series means no drop at all yet."))
    p.append(ts("Skips by reason (not captured by design)", [
        target(f"sum by (reason) (rate(attn_otel_skips_total{{{SEL}}}[{RATE}]))\n"
               f'or on() label_replace(vector(0), "reason", "none", "", "")', "{{reason}}", "A"),
        target(f"sum by (exporter) (rate(attn_otel_export_errors_total{{{SEL}}}[{RATE}]))\n"
               f'or on() label_replace(vector(0), "exporter", "none", "", "")', "export errors: {{exporter}}", "B"),
    ], 16, y, 8, 8, unit="reqps", stack=False,
        description="attn_otel_skips_total by reason (request_off, no_tokens, no_layers, map_too_long, "
                    "maps_queue_full, no_map_layers) and export errors by exporter."))
    y += 8
    p.append(ts("Captured share of finished requests", [
        target(f"sum(rate(attn_otel_captures_total{{{SEL}}}[{RATE}]))\n"
               f"/ sum(rate(vllm:request_success_total{{{SEL_VLLM}}}[{RATE}]))", "captured / finished", "A"),
    ], 0, y, 8, 8, unit="percentunit", description="Below 1: requests turned off, skipped or dropped."))
    p.append(ts("Bytes written to the store", [
        target(f"sum(rate(attn_otel_written_bytes_total{{{SEL}}}[{RATE}]))", "written", "A"),
    ], 8, y, 8, 8, unit="Bps"))
    p.append(ts("Capture latency (request finish to metrics on the host)", [
        target(quantile(q, "attn_otel_capture_latency_seconds_bucket", "", SEL_MODEL), f"p{int(q * 100)}", ref)
        for q, ref in ((0.5, "A"), (0.9, "B"), (0.99, "C"))
    ], 16, y, 8, 8, unit="s"))
    y += 8
    p.append(ts("Hand-off queue depth", [
        target(f"sum by (queue) (attn_otel_queue_pending_bytes{{{SEL}}})", "{{queue}} queue", "A"),
    ], 0, y, 8, 8, unit="bytes", description="Bytes of captures waiting: device (for the compute thread) and host "
                                             "(for the writer). A queue that stays high precedes drops."))
    p.append(ts("Device memory of the Q/K taps", [
        target(f"sum by (instance) (attn_otel_tap_bytes{{{SEL}}})", "{{instance}}", "A"),
    ], 8, y, 8, 8, unit="bytes", description="Memory the taps hold beside the KV cache (fixed after start-up)."))
    # A reason's counter appears only once it is non-zero, so rate() never sees its first increment: the
    # totals show it.
    p.append(bargauge_panel("Dropped and skipped so far, by reason", [
        instant(f"sum by (reason) (attn_otel_captures_dropped_total{{{SEL}}})\n"
                f'or on() label_replace(vector(0), "reason", "none", "", "")', "dropped: {{reason}}", "A"),
        instant(f"sum by (reason) (attn_otel_skips_total{{{SEL}}})\n"
                f'or on() label_replace(vector(0), "reason", "none", "", "")', "skipped: {{reason}}", "B"),
    ], 16, y, 8, 8, description="Counter totals since the server started (the first event of a new reason is "
                                "invisible to rate(): its series starts at 1).", unit="short",
        mode=cm.BarGaugeDisplayMode.BASIC).min(0).decimals(0))
    y += 8
    p.append(row("vLLM (overhead shows here)", y))
    y += 1
    p.append(ts("vLLM token throughput", [
        target(f"sum(rate(vllm:generation_tokens_total{{{SEL_VLLM}}}[{RATE}]))", "generated tokens/s", "A"),
        target(f"sum(rate(vllm:prompt_tokens_total{{{SEL_VLLM}}}[{RATE}]))", "prompt tokens/s", "B"),
    ], 0, y, 8, 8, unit="short"))
    p.append(ts("vLLM time to first token", [
        target(quantile(q, "vllm:time_to_first_token_seconds_bucket", "", SEL_VLLM), f"p{int(q * 100)}", ref)
        for q, ref in ((0.5, "A"), (0.99, "B"))
    ], 8, y, 8, 8, unit="s"))
    p.append(ts("vLLM inter-token latency", [
        target(quantile(q, "vllm:inter_token_latency_seconds_bucket", "", SEL_VLLM), f"p{int(q * 100)}", ref)
        for q, ref in ((0.5, "A"), (0.99, "B"))
    ], 16, y, 8, 8, unit="s"))
    y += 8
    p.append(ts("vLLM end-to-end request latency", [
        target(quantile(q, "vllm:e2e_request_latency_seconds_bucket", "", SEL_VLLM), f"p{int(q * 100)}", ref)
        for q, ref in ((0.5, "A"), (0.99, "B"))
    ], 0, y, 8, 8, unit="s"))
    p.append(ts("vLLM requests", [
        target(f"sum(vllm:num_requests_running{{{SEL_VLLM}}})", "running", "A"),
        target(f"sum(vllm:num_requests_waiting{{{SEL_VLLM}}})", "waiting", "B"),
    ], 8, y, 8, 8, unit="short"))
    p.append(ts("vLLM KV-cache use", [
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
