"""grafana/: the generated dashboards are current and query only exported metrics (``--check``, as CI runs it),
the check catches staleness and unknown names, and the provisioning files parse and reference real uids."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grafana import generate

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "grafana"


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("how", [["-m", "grafana.generate"], [str(GRAFANA / "generate.py")]])
def test_check_passes_on_the_committed_dashboards(how):
    done = _run(*how, "--check")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "up to date" in done.stdout


def test_check_fails_when_a_dashboard_is_stale_or_missing(tmp_path):
    assert _run("-m", "grafana.generate", "--out", str(tmp_path)).returncode == 0
    assert _run("-m", "grafana.generate", "--check", "--out", str(tmp_path)).returncode == 0
    health = tmp_path / "attention-health.json"
    model = json.loads(health.read_text())
    model["title"] = "edited by hand"
    health.write_text(json.dumps(model, indent=2, sort_keys=True) + "\n")
    (tmp_path / "capture-pipeline.json").unlink()
    done = _run("-m", "grafana.generate", "--check", "--out", str(tmp_path))
    assert done.returncode == 1
    assert "attention-health.json: stale" in done.stderr and "capture-pipeline.json: missing" in done.stderr


def test_check_names_a_metric_attn_otel_does_not_export(tmp_path):
    models = generate.build()
    for file, model in models.items():
        (tmp_path / file).write_text(generate.render(model))
    panel = models["capture-pipeline.json"]["panels"][1]
    panel["targets"][0]["expr"] = 'sum(rate(attn_otel_captures_lost_total{job=~"$job"}[$__rate_interval]))'
    panel["targets"].append(generate.to_json(generate.target("rate(vllm:made_up_total[5m])", ref="Z")))
    found = generate.problems(models, tmp_path)
    assert any("attn_otel_captures_lost_total is not exported" in f for f in found), found
    assert any("vllm:made_up_total is not in VLLM_METRICS" in f for f in found), found
    # the dashboards as generated have no such problem
    assert not generate.problems(generate.build(), tmp_path)


def test_exported_names_come_from_the_exporter_module():
    from attn_otel.exporters import prometheus as exporter

    names = generate.exported_attn_otel_names()
    for name in (*exporter.LAYER_METRICS, exporter.LATENCY):
        assert {f"attn_otel_{name}_{s}" for s in ("bucket", "sum", "count")} <= names
    assert {"attn_otel_captures_total", "attn_otel_captures_dropped_total", "attn_otel_skips_total",
            "attn_otel_written_bytes_total", "attn_otel_queue_pending_bytes", "attn_otel_tap_bytes"} <= names
    assert all(n.startswith("attn_otel_") for n in names)


def test_metric_names_in_promql():
    expr = ('sum by (layer) (rate(attn_otel_sink_mass_k_sum{model=~"$model"}[5m])) / '
            'rate(vllm:generation_tokens_total[1m]) or label_replace(vector(0), "reason", "attn_otel_x", "", "")')
    assert generate.metric_names(expr) == {"attn_otel_sink_mass_k_sum", "vllm:generation_tokens_total"}


def test_interpolate_writes_variables_the_way_grafana_does():
    model = "/root/.cache/attn-otel/models/SmolLM2-135M-Instruct"
    text = generate.regex_value([model])
    assert re.fullmatch(text.replace("\\\\", "\\"), model)  # a PromQL string literal that unescapes to the regex
    assert generate.regex_value(["0", "10"]) == "(0|10)"
    out = generate.interpolate('rate(x{model=~"$model",layer=~"${layer}"}[$__rate_interval]) [$__range]',
                               {"model": text, "layer": "(0|10)"}, rate_interval="30s", range_="7m")
    assert out == f'rate(x{{model=~"{text}",layer=~"(0|10)"}}[30s]) [7m]'
    with pytest.raises(ValueError, match="unsubstituted"):
        generate.interpolate('x{instance=~"$instance"}', {})


def test_health_dashboard_has_what_the_issue_asks():
    model = generate.build()["attention-health.json"]
    variables = {v["name"]: v for v in model["templating"]["list"]}
    assert {"datasource", "model", "instance", "layer"} <= set(variables)
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for p in model["panels"] if p["type"] != "row"]
    heatmaps = {p["title"] for p in panels if p["type"] == "heatmap"}
    for word in ("entropy", "Sink mass", "Vision", "Lookback"):
        assert any(word in t for t in heatmaps), (word, heatmaps)
    assert sum(p["type"] == "bargauge" for p in panels) == len(generate.HEALTH_METRICS)
    outliers = [p for p in panels if p["type"] == "timeseries"]
    assert len(outliers) == len(generate.HEALTH_METRICS)
    assert all(t.get("exemplar") is True for p in outliers for t in p["targets"])
    for p in panels:  # every panel and query on the chosen Prometheus, filtered by the variables
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"]
            assert all(f"{v}=~\"${v}\"" in t["expr"] for v in ("job", "instance", "model", "layer")), t["expr"]


def test_pipeline_dashboard_has_what_the_issue_asks():
    model = generate.build()["capture-pipeline.json"]
    exprs = " ".join(generate.queries(model))
    for name in ("attn_otel_captures_total", "attn_otel_captures_dropped_total", "attn_otel_written_bytes_total",
                 "attn_otel_capture_latency_seconds_bucket", "attn_otel_queue_pending_bytes",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket"):
        assert name in exprs, name
    assert "sum by (reason) (rate(attn_otel_captures_dropped_total" in exprs
    assert {v["name"] for v in model["templating"]["list"]} >= {"datasource", "instance", "model"}
    grid = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in model["panels"]]
    assert len(grid) == len(set(grid))  # no two panels in one place


def test_provisioning_files_parse_and_reference_existing_uids():
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "attn-otel.yaml").read_text())
    assert ds["apiVersion"] == 1
    by_uid = {d["uid"]: d for d in ds["datasources"]}
    assert by_uid[generate.PROMETHEUS_UID]["type"] == "prometheus"
    dest, viewer = by_uid[generate.PROMETHEUS_UID]["jsonData"]["exemplarTraceIdDestinations"]
    assert dest["name"] == viewer["name"] == "trace_id"  # the exemplar label the exporter writes
    assert dest["datasourceUid"] == generate.TEMPO_UID and by_uid[dest["datasourceUid"]]["type"] == "tempo"
    # the second: the capture's maps in the viewer, as Grafana reads the value after its environment expansion
    assert _grafana_provisioned(viewer["url"]) == ("http://localhost:8000" + generate.VIEWER_PATH
                                                   + "${__value.raw}")
    dash = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "attn-otel.yaml").read_text())
    (provider,) = dash["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
    # the dashboards link to each other by the uids they carry
    models = generate.build()
    uids = {m["uid"] for m in models.values()}
    assert uids == {generate.HEALTH_UID, generate.PIPELINE_UID}
    assert {link["url"].removeprefix("/d/") for m in models.values() for link in m["links"]} == uids


def _grafana_provisioned(value: str) -> str:
    """A provisioning file's string as Grafana uses it: Grafana runs os.ExpandEnv on the parts between
    ``$$`` (its escape for a literal ``$``); a lone ``$`` here would be an environment variable, so none may be left."""
    parts = value.split("$$")
    assert not any("$" in part for part in parts), f"{value!r}: Grafana would expand an environment variable"
    return "$".join(parts)


def test_outlier_panels_link_each_trace_id_to_the_viewer():
    model = generate.build()["attention-health.json"]
    variables = {v["name"]: v for v in model["templating"]["list"]}
    url = variables[generate.VIEWER_VARIABLE]
    assert url["type"] == "textbox" and url["query"] == url["current"]["value"] == "http://localhost:8000"
    outliers = [p for p in model["panels"] if p["type"] == "timeseries"]
    assert len(outliers) == len(generate.HEALTH_METRICS)
    for p in outliers:
        # an override on the exemplar field trace_id (not a default: that would link every series value too)
        (override,) = p["fieldConfig"]["overrides"]
        assert override["matcher"] == {"id": "byName", "options": "trace_id"}
        (prop,) = override["properties"]
        assert prop["id"] == "links"
        (data_link,) = prop["value"]
        assert data_link["url"] == "${attn_otel_url:raw}/attn-otel/view/${__value.raw}" and data_link["targetBlank"]
        assert "links" not in p["fieldConfig"]["defaults"]
    # the link, as Grafana fills it in for an exemplar, is the viewer's route for that trace id
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    filled = generate.VIEWER_LINK.replace("${attn_otel_url:raw}", "http://vllm-host:8000").replace(
        "${__value.raw}", trace_id)
    assert filled == f"http://vllm-host:8000/attn-otel/view/{trace_id}"
    # and no other panel carries one
    assert all(not p["fieldConfig"].get("overrides") for p in model["panels"]
               if p["type"] != "timeseries" and "fieldConfig" in p)


def test_exemplar_label_is_the_one_the_exporter_writes(tmp_path):
    from attn_otel.exporters import prometheus as exporter

    writer = exporter.PrometheusExporter(tmp_path)
    writer.observe("sink_mass_first", {"model": "m", "layer": "3"}, 0.7, "ab" * 16)
    writer.write()
    (fam,) = [f for f in exporter.AttnOtelCollector(tmp_path).collect() if f.name == "attn_otel_sink_mass_first"]
    labels = {k for s in fam.samples if s.exemplar for k in s.exemplar.labels}
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "attn-otel.yaml").read_text())
    names = {d["name"] for x in ds["datasources"] for d in x.get("jsonData", {}).get("exemplarTraceIdDestinations", [])}
    assert labels == names == {"trace_id"}
