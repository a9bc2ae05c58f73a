"""The Prometheus exporter (writer side) and collector (API-server side), without vLLM: fresh registries, exact
exposition text, the OpenMetrics route on a bare FastAPI app, and ``promtool check metrics``."""

import json
import os
import shutil
import subprocess
import time

import numpy as np
import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, make_asgi_app
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from starlette.routing import Mount

from attn_otel.capture import CaptureEngine
from attn_otel.stats import Stats
from attn_otel.tap import LayerSpec
from attn_otel.tracking import FinishedRequest
from attn_otel.config import Config
from attn_otel.exporters import ExportItem, build_exporters
from attn_otel.exporters.prometheus import (
    ROUTE, AttnOtelCollector, PrometheusExporter, from_config, install_api_server,
)
from attn_otel.ids import new_span_id, new_trace_id
from attn_otel.store import CaptureRecord

T0 = 1_700_000_000.0
TRACE_A = "a" * 32
TRACE_B = "b" * 32


def _record(trace_id=TRACE_A, layers=(0, 10), prompt=(0.12, 0.52), generated=(0.83, 0.875), prompt_len=4, T=6,
            lookback=True, vision=False):
    """Per-row metrics whose prompt rows hold ``prompt[layer]`` and generated rows ``generated[layer]``."""
    L = len(layers)
    rows = np.empty((L, 3, T), np.float64)
    for li in range(L):
        rows[li, :, :prompt_len] = prompt[li]
        rows[li, :, prompt_len:] = generated[li]
    names = ["entropy", "entropy_norm", "sink_mass_first", "sink_mass_k"] + (["lookback_ratio"] if lookback else [])
    if vision:
        names += ["vision_share", "vision_share_norm"]
    metrics = {n: rows.copy() for n in names}
    if lookback:
        metrics["lookback_ratio"][..., :prompt_len] = np.nan  # defined on generated rows only
    return CaptureRecord(trace_id=trace_id, request_id="r1", span_id=new_span_id(), parent_span_id=None,
                         prompt_len=prompt_len, num_tokens=T, layers=tuple(layers), num_heads=3, model="smol",
                         metrics=metrics)


class Clock:
    def __init__(self, t=T0):
        self.t = t

    def __call__(self):
        return self.t


def _registry(stats_dir, **kw):
    registry = CollectorRegistry()
    registry.register(AttnOtelCollector(stats_dir, **kw))
    return registry


def _family(text: str, name: str) -> str:
    """The lines of one metric family (HELP/TYPE/UNIT and samples) of an exposition."""
    out = [line for line in text.splitlines()
           if line.split(" ")[0].split("{")[0] in {name, name + "_bucket", name + "_count", name + "_sum",
                                                     name + "_total"} or line.startswith(f"# HELP {name} ")
           or line.startswith(f"# TYPE {name} ") or line.startswith(f"# UNIT {name} ")]
    return "\n".join(out) + "\n"


def _export(stats_dir, *items, interval=0.5, clock=None):
    exp = PrometheusExporter(stats_dir, interval=interval, clock=clock or Clock())
    for item in items:
        exp.export(item)
    exp.shutdown()
    return exp


def _le(values):
    bounds = [f"{0.05 * i:.2f}".rstrip("0") if i % 2 else f"{0.05 * i:.1f}" for i in range(1, 21)] + ["+Inf"]
    return list(zip(bounds, values))


def test_layer_histogram_text_format(tmp_path):
    _export(tmp_path, ExportItem(_record(), latency_s=0.03))
    text = generate_latest(_registry(tmp_path)).decode()
    layer0 = "".join(f'attn_otel_sink_mass_first_bucket{{layer="0",le="{le}",model="smol"}} {v}\n'
                     for le, v in _le([0.0] * 2 + [1.0] * 19))
    layer10 = "".join(f'attn_otel_sink_mass_first_bucket{{layer="10",le="{le}",model="smol"}} {v}\n'
                      for le, v in _le([0.0] * 10 + [1.0] * 11))
    assert _family(text, "attn_otel_sink_mass_first") == (
        "# HELP attn_otel_sink_mass_first Attention on token 0 of a captured request's prompt rows, mean over rows "
        "and heads, per layer.\n"
        "# TYPE attn_otel_sink_mass_first histogram\n"
        + layer0 + 'attn_otel_sink_mass_first_count{layer="0",model="smol"} 1.0\n'
        'attn_otel_sink_mass_first_sum{layer="0",model="smol"} 0.12\n'
        + layer10 + 'attn_otel_sink_mass_first_count{layer="10",model="smol"} 1.0\n'
        'attn_otel_sink_mass_first_sum{layer="10",model="smol"} 0.52\n')
    assert "# {" not in text  # the 0.0.4 text format that vLLM's /metrics serves carries no exemplars


def test_openmetrics_buckets_carry_the_trace_id_as_exemplar(tmp_path):
    _export(tmp_path, ExportItem(_record(), latency_s=0.03))
    text = generate_openmetrics(_registry(tmp_path)).decode()
    assert _family(text, "attn_otel_capture_latency_seconds") == (
        "# HELP attn_otel_capture_latency_seconds Time from a request's finish to its attention metrics being on "
        "the host.\n"
        "# TYPE attn_otel_capture_latency_seconds histogram\n"
        "# UNIT attn_otel_capture_latency_seconds seconds\n"
        'attn_otel_capture_latency_seconds_bucket{le="0.005",model="smol"} 0.0\n'
        'attn_otel_capture_latency_seconds_bucket{le="0.01",model="smol"} 0.0\n'
        'attn_otel_capture_latency_seconds_bucket{le="0.025",model="smol"} 0.0\n'
        f'attn_otel_capture_latency_seconds_bucket{{le="0.05",model="smol"}} 1.0 # {{trace_id="{TRACE_A}"}} 0.03 '
        f'{T0}\n'
        + "".join(f'attn_otel_capture_latency_seconds_bucket{{le="{le}",model="smol"}} 1.0\n'
                  for le in ("0.1", "0.25", "0.5", "1.0", "2.5", "5.0", "10.0", "25.0", "60.0", "+Inf"))
        + 'attn_otel_capture_latency_seconds_count{model="smol"} 1.0\n'
        'attn_otel_capture_latency_seconds_sum{model="smol"} 0.03\n')
    assert (f'attn_otel_lookback_ratio_bucket{{layer="10",le="0.9",model="smol"}} 1.0 # {{trace_id="{TRACE_A}"}} '
            f'0.875 {T0}\n') in text
    assert text.endswith("# EOF\n")


def test_prompt_rows_for_entropy_sink_vision_and_generated_rows_for_lookback(tmp_path):
    _export(tmp_path, ExportItem(_record(vision=True)))
    text = generate_latest(_registry(tmp_path)).decode()
    for name in ("entropy_norm", "sink_mass_first", "sink_mass_k", "vision_share"):
        assert f'attn_otel_{name}_sum{{layer="0",model="smol"}} 0.12\n' in text
        assert f'attn_otel_{name}_sum{{layer="10",model="smol"}} 0.52\n' in text
    assert 'attn_otel_lookback_ratio_sum{layer="0",model="smol"} 0.83\n' in text
    assert 'attn_otel_lookback_ratio_sum{layer="10",model="smol"} 0.875\n' in text


def test_layer_mean_averages_the_heads_row_means(tmp_path):
    rec = _record(layers=(3,), prompt=(0.0,), generated=(0.0,))
    rec.metrics["sink_mass_first"][0, :, :4] = np.array([[0.1], [0.2], [0.6]])  # head means 0.1, 0.2, 0.6
    rec.metrics["sink_mass_first"][0, 2, 0] = np.nan  # an undefined row is left out of its head's mean
    _export(tmp_path, ExportItem(rec))
    text = generate_latest(_registry(tmp_path)).decode()
    (line,) = [x for x in text.splitlines() if x.startswith('attn_otel_sink_mass_first_sum{layer="3"')]
    assert float(line.split()[-1]) == pytest.approx(0.3)


def test_undefined_values_add_no_observation(tmp_path):
    # no image (no vision metrics) and a prompt-only request (no generated row): no vision/lookback series
    _export(tmp_path, ExportItem(_record(prompt_len=6, T=6)))
    text = generate_latest(_registry(tmp_path)).decode()
    assert "attn_otel_vision_share" not in text and "attn_otel_lookback_ratio" not in text
    assert 'attn_otel_entropy_norm_count{layer="10",model="smol"} 1.0\n' in text


def test_each_bucket_keeps_its_latest_exemplar(tmp_path):
    clock = Clock()
    exp = PrometheusExporter(tmp_path, clock=clock)
    exp.export(ExportItem(_record(TRACE_A, layers=(0,), prompt=(0.12,)), latency_s=0.03))
    clock.t = T0 + 5
    exp.export(ExportItem(_record(TRACE_B, layers=(0,), prompt=(0.14,)), latency_s=2.0))
    exp.shutdown()
    text = generate_openmetrics(_registry(tmp_path)).decode()
    # same bucket (le 0.15): the later trace replaces the earlier one
    assert (f'attn_otel_sink_mass_first_bucket{{layer="0",le="0.15",model="smol"}} 2.0 # {{trace_id="{TRACE_B}"}} '
            f'0.14 {T0 + 5}\n') in text
    assert TRACE_A not in _family(text, "attn_otel_sink_mass_first")
    # different buckets keep their own
    assert f'le="0.05",model="smol"}} 1.0 # {{trace_id="{TRACE_A}"}} 0.03 {T0}\n' in text
    assert f'le="2.5",model="smol"}} 2.0 # {{trace_id="{TRACE_B}"}} 2.0 {T0 + 5}\n' in text


def test_snapshot_is_throttled_then_written_by_a_timer_and_at_shutdown(tmp_path):
    exp = PrometheusExporter(tmp_path, interval=1.0)
    exp.export(ExportItem(_record()))
    (path,) = tmp_path.glob("attn-otel-hist-*.json")
    assert path.name == os.path.basename(exp.path)

    def count():
        snap = json.loads(path.read_text())
        return sum(sum(h["counts"]) for h in snap["histograms"] if h["name"] == "sink_mass_first")

    assert count() == 2  # the first export writes at once (one observation per layer)
    exp.export(ExportItem(_record()))
    assert count() == 2  # within the interval: not yet
    deadline = time.monotonic() + 5
    while count() != 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert count() == 4  # written by the timer, with no further export
    exp.export(ExportItem(_record()))
    exp.shutdown()
    assert count() == 6  # shutdown writes what the interval held back
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary file left, file kept


def test_collector_sums_processes_and_takes_the_latest_exemplar(tmp_path):
    _export(tmp_path, ExportItem(_record(TRACE_A, layers=(0,), prompt=(0.12,))), clock=Clock(T0))
    _export(tmp_path, ExportItem(_record(TRACE_B, layers=(0,), prompt=(0.13,))), clock=Clock(T0 + 1))
    assert len(list(tmp_path.glob("attn-otel-hist-*.json"))) == 2
    text = generate_openmetrics(_registry(tmp_path)).decode()
    assert (f'attn_otel_sink_mass_first_bucket{{layer="0",le="0.15",model="smol"}} 2.0 # {{trace_id="{TRACE_B}"}} '
            f'0.13 {T0 + 1}\n') in text
    assert 'attn_otel_sink_mass_first_sum{layer="0",model="smol"} 0.25\n' in text


def _stats_file(stats_dir, pid, **extra):
    s = Stats()
    s.add("captured", 5)
    s.add("stored", 4)
    s.add("maps_stored", 2)
    s.add("bytes_written", 1000)
    s.add("dropped", reason="queue_full")
    s.add("skipped", 2, reason="map_too_long")
    s.add("export_errors", reason="otel")
    snap = s.snapshot(percentiles=True)
    snap.update(tap_bytes=4096, **extra)
    (stats_dir / f"attn-otel-stats-{pid}.json").write_text(json.dumps(snap))


def test_engine_counters_and_gauges(tmp_path):
    _stats_file(tmp_path, 11, queue_pending_bytes=300, device_queue_pending_bytes=7)
    _stats_file(tmp_path, 12)
    text = generate_latest(_registry(tmp_path, pid_alive=lambda pid: pid == 11)).decode()
    assert text == (
        "# HELP attn_otel_captures_total Requests whose attention was captured (metrics computed).\n"
        "# TYPE attn_otel_captures_total counter\n"
        "attn_otel_captures_total 10.0\n"
        "# HELP attn_otel_captures_stored_total Captures written to the store.\n"
        "# TYPE attn_otel_captures_stored_total counter\n"
        "attn_otel_captures_stored_total 8.0\n"
        "# HELP attn_otel_maps_stored_total Captures stored with their full attention maps.\n"
        "# TYPE attn_otel_maps_stored_total counter\n"
        "attn_otel_maps_stored_total 4.0\n"
        "# HELP attn_otel_captures_dropped_total Captures lost, by reason (queue_full, device_queue_full, "
        "capture_error, store_error, shutdown, stream_lost).\n"
        "# TYPE attn_otel_captures_dropped_total counter\n"
        'attn_otel_captures_dropped_total{reason="capture_error"} 0.0\n'
        'attn_otel_captures_dropped_total{reason="device_queue_full"} 0.0\n'
        'attn_otel_captures_dropped_total{reason="queue_full"} 2.0\n'
        'attn_otel_captures_dropped_total{reason="shutdown"} 0.0\n'
        'attn_otel_captures_dropped_total{reason="store_error"} 0.0\n'
        'attn_otel_captures_dropped_total{reason="stream_lost"} 0.0\n'
        "# HELP attn_otel_skips_total Requests or maps not captured by design, by reason (request_off, no_tokens, "
        "no_layers, map_too_long, maps_queue_full, no_map_layers).\n"
        "# TYPE attn_otel_skips_total counter\n"
        'attn_otel_skips_total{reason="map_too_long"} 4.0\n'
        'attn_otel_skips_total{reason="maps_queue_full"} 0.0\n'
        'attn_otel_skips_total{reason="no_layers"} 0.0\n'
        'attn_otel_skips_total{reason="no_map_layers"} 0.0\n'
        'attn_otel_skips_total{reason="no_tokens"} 0.0\n'
        'attn_otel_skips_total{reason="request_off"} 0.0\n'
        "# HELP attn_otel_export_errors_total Exporter failures other than the store's, by exporter.\n"
        "# TYPE attn_otel_export_errors_total counter\n"
        'attn_otel_export_errors_total{exporter="otel"} 2.0\n'
        'attn_otel_export_errors_total{exporter="prometheus"} 0.0\n'
        "# HELP attn_otel_written_bytes_total Bytes written to the store.\n"
        "# TYPE attn_otel_written_bytes_total counter\n"
        "attn_otel_written_bytes_total 2000.0\n"
        "# HELP attn_otel_tap_bytes Device memory held by capture in live engine processes (Q/K taps, streamed "
        "layers' query ring and metrics buffer).\n"
        "# TYPE attn_otel_tap_bytes gauge\n"
        "attn_otel_tap_bytes 4096.0\n"  # pid 12 is dead: its tap is gone, its counts stay
        "# HELP attn_otel_queue_pending_bytes Bytes of captures waiting in the hand-offs (host: for the writer; "
        "device: for the compute thread).\n"
        "# TYPE attn_otel_queue_pending_bytes gauge\n"
        'attn_otel_queue_pending_bytes{queue="device"} 7.0\n'
        'attn_otel_queue_pending_bytes{queue="host"} 300.0\n')


def test_no_stats_dir_yet_gives_zero_counters_and_no_gauges(tmp_path):
    text = generate_latest(_registry(tmp_path / "missing")).decode()
    assert "attn_otel_captures_total 0.0\n" in text
    assert "attn_otel_tap_bytes" not in text and "_bucket" not in text


def test_collect_never_raises_and_skips_bad_files(tmp_path):
    _export(tmp_path, ExportItem(_record()))
    (tmp_path / "attn-otel-hist-999.json").write_text("{not json")
    (tmp_path / "attn-otel-stats-998.json").write_text("[1, 2]")
    (tmp_path / "attn-otel-hist-997.json").write_text(json.dumps(
        {"format": 1, "histograms": [{"name": "sink_mass_first", "labels": {"model": "smol", "layer": "0"},
                                      "le": [0.5, 1.0], "counts": [1, 0, 0], "sum": 0.1,
                                      "exemplars": [None] * 3}]}))  # other buckets: not merged
    text = generate_latest(_registry(tmp_path)).decode()
    assert 'attn_otel_sink_mass_first_count{layer="0",model="smol"} 1.0\n' in text

    class Broken(AttnOtelCollector):
        def _files(self, pattern):
            raise RuntimeError("disk on fire")

    registry = CollectorRegistry()
    registry.register(Broken(tmp_path))
    Counter("vllm_requests", "a metric of vLLM's own", registry=registry).inc()
    assert generate_latest(registry).decode().count("attn_otel_") == 0
    assert "vllm_requests_total 1.0" in generate_latest(registry).decode()


def test_from_config_needs_a_stats_dir(tmp_path):
    assert from_config(Config()) is None
    assert isinstance(from_config(Config(stats_dir=str(tmp_path))), PrometheusExporter)
    names = [e.name for e in build_exporters(Config(store=str(tmp_path / "store"), stats_dir=str(tmp_path))).exporters]
    assert "prometheus" in names
    assert "prometheus" not in [e.name for e in build_exporters(Config(store=str(tmp_path / "store"))).exporters]


def _vllm_like_app(registry):
    app = FastAPI()

    @app.get("/health")
    def health():
        return {}

    app.routes.append(Mount("/metrics", make_asgi_app(registry=registry)))  # as vLLM's attach_router does
    return app


def test_openmetrics_route_serves_the_registry_with_exemplars(tmp_path):
    registry = CollectorRegistry()
    Counter("vllm_requests", "a metric of vLLM's own", registry=registry).inc()
    Gauge("vllm:num_requests_running", "vLLM names its metrics with a colon", ["engine"], registry=registry).labels(
        "0").set(2)
    app = _vllm_like_app(registry)
    install_api_server(app, registry, stats_dir=tmp_path)
    install_api_server(app, registry, stats_dir=tmp_path)  # the plugin may load twice
    assert [getattr(r, "path", None) for r in app.router.routes].count(ROUTE) == 1
    _export(tmp_path, ExportItem(_record(), latency_s=0.03))
    client = TestClient(app)
    r = client.get(ROUTE)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert f'# {{trace_id="{TRACE_A}"}} 0.12 ' in r.text and r.text.endswith("# EOF\n")
    assert "vllm_requests_total 1.0" in r.text
    assert '\nvllm:num_requests_running{engine="0"} 2.0\n' in r.text  # not renamed vllm_num_requests_running
    assert r.text.count("# TYPE attn_otel_sink_mass_first histogram") == 1  # the collector is registered once
    plain = client.get("/metrics")
    assert plain.status_code == 200 and plain.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert 'attn_otel_sink_mass_first_count{layer="10",model="smol"} 1.0' in plain.text and "trace_id" not in plain.text


def test_openmetrics_route_is_matched_before_vllms_metrics_mount(tmp_path):
    registry = CollectorRegistry()
    app = _vllm_like_app(registry)
    install_api_server(app, registry, stats_dir=tmp_path)
    paths = [getattr(r, "path", None) for r in app.router.routes]
    assert paths.index(ROUTE) < paths.index("/metrics")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is installed by setup.sh")
def test_promtool_accepts_the_exposition(tmp_path):
    _export(tmp_path, ExportItem(_record(vision=True), latency_s=0.03))
    _stats_file(tmp_path, os.getpid(), queue_pending_bytes=1, device_queue_pending_bytes=2)
    text = generate_latest(_registry(tmp_path)).decode()
    assert "attn_otel_vision_share_bucket" in text and "attn_otel_tap_bytes" in text
    out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out.stdout + out.stderr


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_capture_engine_to_collector(tmp_path, monkeypatch, writer):
    """A real capture through the engine's writer (thread or child process) reaches the collector."""
    stats_dir = tmp_path / "stats"
    monkeypatch.setenv("ATTN_OTEL_STATS_DIR", str(stats_dir))  # the writer process reads its config from env
    spec = [LayerSpec(index=i, name=f"l{i}", num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25) for i in (0, 5)]
    eng = CaptureEngine(Config(store=str(tmp_path / "store"), stats_dir=str(stats_dir), writer=writer), spec, 256,
                        torch.float32, "cpu", model="tiny")
    for layer in (0, 5):
        eng.tap.write(layer, torch.randn(40, 64), torch.randn(40, 32), torch.arange(40))
    trace = new_trace_id()
    eng.on_finished(FinishedRequest("r", list(range(30)), [1, 2, 3], 32, [list(range(16))], [16],
                                    {"attn_otel": "metrics", "traceparent": f"00-{trace}-{new_span_id()}-01"}))
    assert eng.flush(60)
    eng.close()
    text = generate_openmetrics(_registry(stats_dir)).decode()
    assert "attn_otel_captures_total 1.0\n" in text and "attn_otel_captures_stored_total 1.0\n" in text
    for layer in ("0", "5"):
        for name in ("entropy_norm", "sink_mass_first", "sink_mass_k", "lookback_ratio"):
            assert f'attn_otel_{name}_count{{layer="{layer}",model="tiny"}} 1.0\n' in text
    assert text.count(f'# {{trace_id="{trace}"}}') == 2 * 4 + 1  # each layer histogram, and the latency


def test_a_snapshot_that_cannot_be_written_is_an_export_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    exp = PrometheusExporter(tmp_path / "file" / "stats")
    fanout = build_exporters(Config(store=str(tmp_path / "store")))
    fanout.exporters.append(exp)
    assert set(fanout.export(ExportItem(_record()))) == {"prometheus"}  # counted as export_errors{prometheus}
