"""The dashboards conform to Grafana's published schema: every dashboard, panel options, field config and
Prometheus query type-checks against ``@grafana/schema`` with the TypeScript compiler (grafana/schema_check.py),
the committed files as well as what the generator builds; and the check does catch a key, a type or an enum
value the schema does not have.  The compiler and schema are installed by setup.sh (``npm ci``): missing,
these tests fail, they do not skip."""

import copy
import json

import pytest

from grafana import generate, schema_check


@pytest.fixture(scope="module")
def tools():
    assert schema_check.TSC.is_file() and schema_check.SCHEMA.is_dir(), (
        f"{schema_check.PROJECT}/node_modules is not installed: run ./setup.sh (npm ci there)")
    lock = json.loads((schema_check.PROJECT / "package-lock.json").read_text())
    assert schema_check.schema_version() == lock["packages"]["node_modules/@grafana/schema"]["version"]


def test_generated_dashboards_conform_to_grafanas_schema(tools):
    assert schema_check.check(generate.build()) == []


def test_committed_dashboards_conform_to_grafanas_schema(tools):
    models = {f: json.loads((generate.DASHBOARDS / f).read_text()) for f in generate.build()}
    assert schema_check.check(models) == []


def test_every_panel_and_query_is_checked_against_its_own_type():
    src = schema_check.typescript_source(generate.build())
    for file, model in generate.build().items():
        name = file.removesuffix(".json").replace("-", "_")
        panels = [p for p in model["panels"] if p["type"] != "row"]
        assert panels
        for p in panels:
            assert f"export const {name}_panel{p['id']}_options: Lit<{p['type']}_Options> = " in src
            for t in p["targets"]:
                assert f"export const {name}_panel{p['id']}_{t['refId']}: Lit<PrometheusDataQuery> = " in src


@pytest.mark.parametrize("mutate,complaint", [
    (lambda m: m["panels"][1]["options"].update(bogus=1), "'\"bogus\"' does not exist"),
    (lambda m: m["panels"][1]["options"]["color"].update(mode="schemee"), '"schemee"'),
    (lambda m: m["panels"][1]["fieldConfig"]["defaults"]["custom"].update(lineWidth=1), "lineWidth"),
    (lambda m: next(p for p in m["panels"] if p["type"] == "timeseries")["targets"][0].update(exemplar="yes"),
     "not assignable to type 'boolean"),
    (lambda m: m["templating"]["list"][1].update(definition="label_values(x, y)"), "definition"),
    (lambda m: m.update(graphTooltip="crosshair"), "DashboardCursorSync"),
    (lambda m: m["panels"][0]["gridPos"].pop("w"), "'w' is missing"),
], ids=["unknown option", "enum value", "custom of another panel", "query field type", "variable key",
        "dashboard field", "grid position"])
def test_the_check_catches_what_the_schema_does_not_allow(tools, mutate, complaint):
    models = copy.deepcopy(generate.build())
    health = models["attention-health.json"]
    assert health["panels"][1]["type"] == "heatmap"
    mutate(health)
    errors = schema_check.check(models)
    assert errors and any(complaint in e for e in errors), errors


def test_the_command_line_reports_conformance(tools):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "grafana.schema_check"], cwd=generate.ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"conform to @grafana/schema {schema_check.schema_version()}" in done.stdout
