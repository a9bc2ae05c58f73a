"""A real Prometheus scrapes a live vLLM OpenAI server (CPU build, ATTN_OTEL=1): per-layer series through
PromQL on both vLLM's ``/metrics`` and ``/attn-otel/metrics``, and an exemplar's trace id fetches the maps."""

import subprocess
import sys
import urllib.request

import numpy as np
import pytest

import attn_otel
import prom
from scraped import SCRAPED_LAYERS, SCRAPED_PROMPTS

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(not prom.available(), reason="Prometheus is installed by setup.sh")]

LAYERS = {"0", "10", "19", "29"}  # ATTN_OTEL_LAYERS=auto on SmolLM2's 30 layers
PROMPTS = SCRAPED_PROMPTS


@pytest.fixture(scope="module")
def scraped(scraped_server):
    """conftest's session-wide server (capture on, maps for every request) after its three traced requests
    and one ``attn_otel: off`` request, scraped by a real Prometheus (``attn-otel`` job: /attn-otel/metrics,
    ``vllm`` job: /metrics) until it saw them all."""
    s = scraped_server
    assert len(s.traces) == len(PROMPTS) and set(LAYERS) == SCRAPED_LAYERS
    return s.url, s.port, s.store, s.traces


def _layers(result):
    return {s["metric"]["layer"] for s in result}


@pytest.mark.parametrize("job", ["attn-otel", "vllm"])
def test_per_layer_histograms_through_promql(scraped, job):
    url, *_ = scraped
    for name in ("entropy_norm", "sink_mass_first", "sink_mass_k", "lookback_ratio"):
        counts = prom.query(url, f'attn_otel_{name}_bucket{{job="{job}",le="+Inf"}}')
        assert _layers(counts) == LAYERS, name
        assert all(float(s["value"][1]) == len(PROMPTS) for s in counts), counts  # one observation per request
        medians = prom.query(url, f'histogram_quantile(0.5, sum by (le, layer) (attn_otel_{name}_bucket{{job="{job}"}}))')
        assert _layers(medians) == LAYERS
        assert all(0.0 <= float(s["value"][1]) <= 1.0 for s in medians), (name, medians)
    # nothing per request in the labels
    labels = {k for s in prom.query(url, f'{{__name__=~"attn_otel_.*",job="{job}"}}') for k in s["metric"]}
    assert labels <= {"__name__", "job", "instance", "model", "layer", "le", "reason", "exporter", "queue"}, labels


def test_sink_mass_grows_into_later_layers(scraped):
    """SmolLM2 has real attention sinks in its later layers (see the README's sink table)."""
    url, *_ = scraped
    mean = {s["metric"]["layer"]: float(s["value"][1]) for s in prom.query(
        url, 'attn_otel_sink_mass_first_sum{job="attn-otel"} / attn_otel_sink_mass_first_count{job="attn-otel"}')}
    assert mean["29"] > mean["0"], mean


def test_pipeline_counters_and_gauges(scraped):
    url, *_ = scraped
    for job in ("attn-otel", "vllm"):
        assert prom.value(url, f'attn_otel_captures_total{{job="{job}"}}') == len(PROMPTS)
        assert prom.value(url, f'attn_otel_maps_stored_total{{job="{job}"}}') == len(PROMPTS)
        assert prom.value(url, f'attn_otel_written_bytes_total{{job="{job}"}}') > 0
        assert prom.value(url, f'attn_otel_tap_bytes{{job="{job}"}}') > 0
        assert prom.value(url, f'sum(attn_otel_captures_dropped_total{{job="{job}"}}) or vector(0)') == 0
        assert prom.value(url, f'attn_otel_capture_latency_seconds_count{{job="{job}"}}') == len(PROMPTS)
    # vLLM's own metrics come along on the OpenMetrics endpoint
    assert prom.query(url, 'vllm:num_requests_running{job="attn-otel"}')


def test_exemplar_trace_id_fetches_the_maps(scraped):
    url, port, store, traces = scraped
    found = prom.query_exemplars(url, 'attn_otel_sink_mass_first_bucket{job="attn-otel"}')
    exemplars = [(series["seriesLabels"], e) for series in found for e in series["exemplars"]]
    assert exemplars, found
    assert {labels["layer"] for labels, _ in exemplars} == LAYERS
    for labels, e in exemplars:
        assert set(e["labels"]) == {"trace_id"} and e["labels"]["trace_id"] in traces, e
        assert float(labels["le"]) >= float(e["value"])  # the exemplar sits in its own bucket
    labels, e = max(exemplars, key=lambda x: float(x[1]["value"]))
    (cap,) = attn_otel.open_trace(e["labels"]["trace_id"], store=store)
    assert cap.has_maps and int(labels["layer"]) in cap.layers
    li = cap.layer_index(int(labels["layer"]))
    # the exemplar is the layer's mean over heads and prompt rows of the stored per-row sink mass
    rows = np.asarray(cap.metrics["sink_mass_first"][li][:, : cap.prompt_len], dtype=np.float64)
    assert float(e["value"]) == pytest.approx(float(np.nanmean(np.nanmean(rows, axis=-1))), rel=1e-5)
    attn = np.asarray(cap.attn[li], dtype=np.float64)
    k = 4  # sink_mass_first is defined on rows i >= k (ATTN_OTEL_SINK_TOKENS, default 4)
    assert cap.prompt_len > k
    assert float(e["value"]) == pytest.approx(float(attn[:, k: cap.prompt_len, 0].mean()), abs=2e-3)  # float16 maps
    # and the CLI fetches the same trace
    out = store / "fetched.npz"
    done = subprocess.run([sys.executable, "-m", "attn_otel.cli", "fetch", e["labels"]["trace_id"], "--store",
                           str(store), "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    with np.load(out) as z:
        assert z["attn"].shape[:2] == (len(LAYERS), cap.attn.shape[1])


def test_openmetrics_endpoint_of_the_live_server(scraped):
    url, port, *_ = scraped
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/attn-otel/metrics", timeout=30) as r:
        assert r.headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
        text = r.read().decode()
    assert text.endswith("# EOF\n") and '# {trace_id="' in text
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        plain = r.read().decode()
    assert "attn_otel_sink_mass_first_bucket" in plain and "trace_id" not in plain
    ours = "".join(line + "\n" for line in plain.splitlines() if "attn_otel_" in line)
    lint = subprocess.run(["promtool", "check", "metrics"], input=ours, capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0 and not (lint.stdout + lint.stderr).strip(), lint.stdout + lint.stderr
    health = {t["labels"]["job"]: (t["health"], t["lastError"]) for t in prom.targets(url)}
    assert health == {"attn-otel": ("up", ""), "vllm": ("up", "")}, health
