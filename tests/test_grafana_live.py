"""Every panel query of the generated dashboards, run the way Grafana runs it (variables substituted, range
queries over the traffic, instant queries for bar gauges and tables) against a real Prometheus that scraped a
live vLLM server with capture on (conftest's ``scraped_server``): each returns data.  Also: the variable
queries find the live values, the exemplar panels find trace ids that fetch maps, the ``vllm:*`` names the
dashboards use exist on vLLM's /metrics, and grafana/render_preview.py draws the outlier walk."""

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import attn_otel
import prom
from attn_otel.exporters.prometheus import DROP_REASONS, SKIP_REASONS
from grafana import generate
from scraped import SCRAPED_LAYERS

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(not prom.available(), reason="Prometheus is installed by setup.sh")]

ROOT = Path(__file__).resolve().parent.parent
JOBS = ("attn-otel", "vllm")  # /attn-otel/metrics (OpenMetrics, exemplars) and /metrics (text format)


def _targets():
    for file, model in generate.build().items():
        for panel, target in generate.iter_targets(model):
            yield pytest.param(file, panel, target, id=f"{file.split('.')[0]}:{panel['title'][:48]}:{target['refId']}")


TARGETS = list(_targets())


def _not_on_this_model(target) -> bool:
    # SmolLM2 is a text model: no request has image positions, so attn_otel_vision_share has no observation
    # (the exporter adds none without an image; docs/metrics.md); nor has it learned sinks, so
    # attn_otel_learned_sink_mass has none either.
    return any(m in target["expr"] for m in ("attn_otel_vision_share", "attn_otel_learned_sink_mass"))


@pytest.fixture(scope="module")
def live(scraped_server):
    s = scraped_server
    time.sleep(3)  # a few more scrapes after the last request: rate windows ending now see the traffic's end
    start, end = s.started - 5, time.time()
    return {"server": s, "start": start, "end": end, "step": 2, "rate": "10s", "range": f"{int(end - start) + 30}s"}


def _variables(live, job):
    s = live["server"]
    return {"job": generate.regex_value([job]), "instance": generate.regex_value([s.target]),
            "model": generate.regex_value([s.model]), "layer": generate.regex_value(sorted(SCRAPED_LAYERS))}


def _run(live, job, target):
    expr = generate.interpolate(target["expr"], _variables(live, job), rate_interval=live["rate"],
                                range_=live["range"], interval=f"{live['step']}s")
    if target.get("instant"):
        result = prom.api(live["server"].url, "query", query=expr, time=live["end"])["result"]
        values = [[s["value"]] for s in result]
    else:
        result = prom.api(live["server"].url, "query_range", query=expr, start=live["start"], end=live["end"],
                          step=live["step"])["result"]
        values = [s["values"] for s in result]
    finite = [float(v) for vs in values for _, v in vs if v not in ("NaN", "+Inf", "-Inf")]
    return expr, result, finite


@pytest.mark.parametrize("job", JOBS)
@pytest.mark.parametrize("file,panel,target", TARGETS)
def test_every_panel_query_returns_data(live, job, file, panel, target):
    expr, result, finite = _run(live, job, target)
    if _not_on_this_model(target):
        assert result == [], (expr, result)  # valid PromQL, nothing to show on a text model
        return
    assert result, f"{panel['title']} {target['refId']}: no series for {expr}"
    assert finite, f"{panel['title']} {target['refId']}: only NaN for {expr}: {result}"
    if "by (layer)" in target["expr"]:
        assert {s["metric"]["layer"] for s in result} == SCRAPED_LAYERS, expr
    if "attn_otel_" in target["expr"] and "rate(" in target["expr"] and "vector(0)" not in target["expr"]:
        assert any(v > 0 for v in finite), (expr, result)  # the traffic shows as a rate, not only zeros


def test_the_skips_panel_shows_the_request_turned_off(live):
    panel = next(p for p, _ in generate.iter_targets(generate.build()["capture-pipeline.json"])
                 if p["title"].startswith("Skips"))
    _, result, _ = _run(live, "attn-otel", panel["targets"][0])
    assert "request_off" in {s["metric"].get("reason") for s in result}, result
    totals = next(p for p, _ in generate.iter_targets(generate.build()["capture-pipeline.json"])
                  if p["title"].startswith("Dropped and skipped"))
    _, result, _ = _run(live, "attn-otel", totals["targets"][1])
    # every known reason is exported from the first scrape (at 0), so the panel lists them all
    assert {s["metric"]["reason"]: float(s["value"][1]) for s in result} == {
        **dict.fromkeys(SKIP_REASONS, 0.0), "request_off": 1.0}, result
    _, result, _ = _run(live, "attn-otel", totals["targets"][0])
    assert {s["metric"]["reason"]: float(s["value"][1]) for s in result} == dict.fromkeys(DROP_REASONS, 0.0), result


def test_the_drops_panel_shows_none_in_a_healthy_run(live):
    panel = next(p for p, _ in generate.iter_targets(generate.build()["capture-pipeline.json"])
                 if p["title"].startswith("Drops"))
    _, result, finite = _run(live, "attn-otel", panel["targets"][0])
    reasons = {s["metric"].get("reason") for s in result}
    # every known reason at 0 (the panel's "none" fallback only before the first scrape of the range)
    assert set(DROP_REASONS) <= reasons <= {*DROP_REASONS, "none"} and set(finite) == {0.0}, result


@pytest.mark.parametrize("file", ["attention-health.json", "capture-pipeline.json"])
def test_variable_queries_find_the_live_values(live, file):
    s = live["server"]
    expected = {"job": set(JOBS), "instance": {s.target}, "model": {s.model}, "layer": SCRAPED_LAYERS}
    variables = [v for v in generate.build()[file]["templating"]["list"] if v["type"] == "query"]
    assert variables
    for v in variables:
        # label_values(metric{selector}, label): Grafana asks /api/v1/series?match[]=... (or /label/../values)
        metric, label = v["query"]["query"].removeprefix("label_values(").removesuffix(")").rsplit(", ", 1)
        match = generate.interpolate(metric, {"job": generate.regex_value(["attn-otel"]), "instance": ".*",
                                              "model": ".*"})
        series = prom.api(s.url, "series", **{"match[]": match, "start": live["start"], "end": live["end"]})
        assert {x[label] for x in series if label in x} == expected[v["name"]], (v["name"], match)


def test_outlier_panels_exemplars_are_trace_ids_with_maps(live):
    s = live["server"]
    model = generate.build()["attention-health.json"]
    checked = 0
    for panel, target in generate.iter_targets(model):
        if not target.get("exemplar") or _not_on_this_model(target):
            continue
        for job, want in (("attn-otel", True), ("vllm", False)):  # only the OpenMetrics scrape carries them
            expr = generate.interpolate(target["expr"], _variables(live, job), rate_interval=live["rate"])
            found = prom.query_exemplars(s.url, expr, live["start"], live["end"] + 60)
            traces = {e["labels"]["trace_id"] for series in found for e in series["exemplars"]}
            if not want:
                assert not traces, (panel["title"], found)
                continue
            assert traces and traces <= set(s.traces), (panel["title"], traces)
            layers = {series["seriesLabels"]["layer"] for series in found}
            assert layers == SCRAPED_LAYERS, (panel["title"], layers)
            checked += 1
    assert checked == 2 * (len(generate.HEALTH_METRICS) - 2)  # all but vision share and learned sink mass
    (cap,) = attn_otel.open_trace(s.traces[0], store=s.store)
    assert cap.has_maps


def test_vllm_metric_names_exist_on_the_live_server(live):
    s = live["server"]
    with urllib.request.urlopen(f"http://127.0.0.1:{s.port}/metrics", timeout=30) as r:
        text = r.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            samples.setdefault(name, line)
    for name in generate.VLLM_METRICS:
        assert name in samples, f"{name} not on vLLM's /metrics"
        assert f'model_name="{s.vllm_model_name}"' in samples[name], samples[name]


def test_render_preview_draws_the_outlier_walk(live, tmp_path):
    s = live["server"]
    done = subprocess.run([sys.executable, str(ROOT / "grafana" / "render_preview.py"), "--prometheus", s.url,
                           "--store", str(s.store), "--start", str(live["start"]), "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    outlier = json.loads(done.stdout.strip().splitlines()[-1])
    assert outlier["trace_id"] in s.traces and outlier["layer"] in SCRAPED_LAYERS
    # the outlier is the largest token-0 sink mass any exemplar carries, and its capture has the layer's maps
    exemplars = prom.query_exemplars(s.url, 'attn_otel_sink_mass_first_bucket{job="attn-otel"}',
                                     live["start"], live["end"] + 60)
    assert outlier["value"] == pytest.approx(max(float(e["value"]) for x in exemplars for e in x["exemplars"]))
    (cap,) = attn_otel.open_trace(outlier["trace_id"], store=s.store)
    assert int(outlier["layer"]) in cap.layers
    for name in ("dashboard-outlier.png", "outlier-map.png"):
        png = (tmp_path / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000, name
