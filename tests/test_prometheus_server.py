"""A real Prometheus scrapes a live vLLM OpenAI server (CPU build, ATTN_OTEL=1): per-layer series through
PromQL on both vLLM's ``/metrics`` and ``/attn-otel/metrics``, and an exemplar's trace id fetches the maps."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

import attn_otel
import prom
from attn_otel.ids import new_span_id, new_trace_id

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(not prom.available(), reason="Prometheus is installed by setup.sh")]

LAYERS = {"0", "10", "19", "29"}  # ATTN_OTEL_LAYERS=auto on SmolLM2's 30 layers
PROMPTS = ["The capital of France is", "Mountain goats can climb", "The old lighthouse keeper climbed the stairs"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def scraped(smollm2_path, tmp_path_factory):
    """vLLM's server with capture on and maps for every request, three requests sent, and a Prometheus that
    scrapes it (``attn-otel`` job: /attn-otel/metrics, ``vllm`` job: /metrics) until it saw them all."""
    store = tmp_path_factory.mktemp("prom-store")
    port = _free_port()
    env = {**os.environ, "ATTN_OTEL": "1", "ATTN_OTEL_STORE": str(store), "ATTN_OTEL_MAPS_SAMPLE": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "ATTN_OTEL_STATS_DIR", "ATTN_OTEL_LAYERS", "PROMETHEUS_MULTIPROC_DIR"):
        env.pop(name, None)
    log_path = tmp_path_factory.mktemp("prom-server-log") / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", smollm2_path,
                             "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    stop = None
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                assert proc.poll() is None, log_path.read_text()[-3000:]
                if time.monotonic() > deadline:
                    pytest.fail("vLLM server did not come up in 600 s")
                time.sleep(2)
        target = f"127.0.0.1:{port}"
        url, stop = prom.start([("attn-otel", target, "/attn-otel/metrics"), ("vllm", target, "/metrics")],
                               workdir=tmp_path_factory.mktemp("prometheus"))
        prom.wait_for(url, 'count(up == 1)', lambda v: v == 2, timeout=30)
        traces = []
        for i, prompt in enumerate(PROMPTS):
            trace = new_trace_id()
            body = {"model": smollm2_path, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                    "vllm_xargs": {"traceparent": f"00-{trace}-{new_span_id()}-01"}}
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                assert r.status == 200
            traces.append(trace)
            # One capture at a time, more than a second apart: the engine writes its counters file at most once
            # a second and only after a write (CaptureEngine._dump_stats), so a burst leaves them stale.
            prom.wait_for(url, 'sum(attn_otel_sink_mass_first_count{job="attn-otel"})',
                          lambda v: v >= (i + 1) * len(LAYERS), timeout=120)
            time.sleep(1.1)
        # every capture observed once per captured layer, seen by both scrape jobs
        for job in ("attn-otel", "vllm"):
            prom.wait_for(url, f'sum(attn_otel_sink_mass_first_count{{job="{job}"}})',
                          lambda v: v >= len(PROMPTS) * len(LAYERS), timeout=60)
            prom.wait_for(url, f'sum(attn_otel_captures_stored_total{{job="{job}"}})',
                          lambda v: v >= len(PROMPTS), timeout=60)
        yield url, port, store, traces
    finally:
        if stop is not None:
            stop()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
        log.close()


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
