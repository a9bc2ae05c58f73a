"""Type-check the generated dashboards against Grafana's published schema.

Grafana publishes its dashboard schema as TypeScript types (npm ``@grafana/schema``, generated from the
CUE kinds Grafana itself validates against): the dashboard, panels, field config, variables, and per plugin
the panel options and field config (``raw/composable/<plugin>/panelcfg``) and the Prometheus query
(``raw/composable/prometheus/dataquery``).  This module writes every dashboard, and every panel's options,
``fieldConfig.defaults.custom`` and queries, as typed object literals into a TypeScript file and runs
``tsc --strict --noEmit`` on it.  Object literals get TypeScript's excess-property check, so a key that the
schema does not define is an error, as is a wrong type or a value outside an enum.

Usage::

    python -m grafana.schema_check      # exit 1 and print tsc's errors when a dashboard does not conform

The compiler and the schema (versions pinned in ``grafana/schema-check/package-lock.json``) are installed
by ``setup.sh`` (``npm ci`` into ``grafana/schema-check/node_modules``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROJECT = HERE / "schema-check"  # package.json, package-lock.json, node_modules/
TSC = PROJECT / "node_modules" / "typescript" / "bin" / "tsc"
SCHEMA = PROJECT / "node_modules" / "@grafana" / "schema"
COMPOSABLE = "@grafana/schema/dist/esm/raw/composable"

# panel type -> (module under COMPOSABLE, options type, field-config type or None)
PANEL_TYPES: dict[str, tuple[str, str, str | None]] = {
    "timeseries": ("timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen", "Options", "FieldConfig"),
    "heatmap": ("heatmap/panelcfg/x/HeatmapPanelCfg_types.gen", "Options", "FieldConfig"),
    "bargauge": ("bargauge/panelcfg/x/BarGaugePanelCfg_types.gen", "Options", None),
    "table": ("table/panelcfg/x/TablePanelCfg_types.gen", "Options", "FieldConfig"),
}
PROMETHEUS_QUERY = ("prometheus/dataquery/x/PrometheusDataQuery_types.gen", "PrometheusDataQuery")

# The generated types declare string enums (``HeatmapColorMode.Scheme = 'scheme'``); a JSON file holds the
# strings.  Lit<T> is T with every string enum replaced by the union of its values, so "scheme" type-checks
# and "schemee" does not.  Object types stay object types (optional keys and the excess-property check kept).
PRELUDE = """\
type Lit<T> = T extends string ? `${T}`
  : T extends readonly (infer U)[] ? Lit<U>[]
  : T extends object ? { [K in keyof T]: Lit<T[K]> }
  : T;
"""


class SchemaToolsMissing(RuntimeError):
    """node or the npm packages are not installed (setup.sh installs them)."""


def _ident(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text)


def typescript_source(models: dict[str, dict[str, Any]]) -> str:
    """A TypeScript module holding each dashboard, and each panel's parts, as constants of Grafana's types."""
    imports = ["import type { Dashboard } from '@grafana/schema';"]
    for kind, (module, options, field) in PANEL_TYPES.items():
        names = [f"{options} as {kind}_{options}"] + ([f"{field} as {kind}_{field}"] if field else [])
        imports.append(f"import type {{ {', '.join(names)} }} from '{COMPOSABLE}/{module}';")
    imports.append(f"import type {{ {PROMETHEUS_QUERY[1]} }} from '{COMPOSABLE}/{PROMETHEUS_QUERY[0]}';")
    lines = [*imports, "", PRELUDE]
    for file, model in models.items():
        name = _ident(file.removesuffix(".json"))
        lines.append(f"// {file}")
        lines.append(f"export const {name}: Lit<Dashboard> = {json.dumps(model, indent=1)};")
        for p in model.get("panels", []):
            for q in [p, *p.get("panels", [])]:
                if q["type"] == "row":
                    continue
                if q["type"] not in PANEL_TYPES:
                    raise ValueError(f"{file}: panel {q['title']!r} is a {q['type']}: add its types to PANEL_TYPES")
                _, options, field = PANEL_TYPES[q["type"]]
                base = f"{name}_panel{q['id']}"
                lines.append(f"// panel {q['id']}: {q['title']}")
                lines.append(f"export const {base}_options: Lit<{q['type']}_{options}> = "
                             f"{json.dumps(q.get('options', {}))};")
                custom = q.get("fieldConfig", {}).get("defaults", {}).get("custom")
                if custom is not None:
                    if field is None:
                        raise ValueError(f"{file}: panel {q['title']!r} ({q['type']}) has no custom field config")
                    lines.append(f"export const {base}_custom: Lit<{q['type']}_{field}> = {json.dumps(custom)};")
                for t in q.get("targets", []):
                    lines.append(f"export const {base}_{_ident(t['refId'])}: Lit<{PROMETHEUS_QUERY[1]}> = "
                                 f"{json.dumps(t)};")
        lines.append("")
    return "\n".join(lines)


def check(models: dict[str, dict[str, Any]]) -> list[str]:
    """tsc's error lines for these dashboards (empty: every one conforms to Grafana's schema)."""
    if not TSC.is_file() or not SCHEMA.is_dir():
        raise SchemaToolsMissing(f"{PROJECT}/node_modules lacks typescript or @grafana/schema: run setup.sh "
                                 f"(npm ci --prefix {PROJECT})")
    with tempfile.TemporaryDirectory(dir=PROJECT, prefix=".check-") as tmp:
        src = Path(tmp) / "dashboards.ts"
        src.write_text(typescript_source(models))
        config = {"compilerOptions": {"strict": True, "noEmit": True, "skipLibCheck": True, "target": "ES2020",
                                      "module": "commonjs", "moduleResolution": "node", "types": []},
                  "files": [src.name]}
        (Path(tmp) / "tsconfig.json").write_text(json.dumps(config))
        try:
            done = subprocess.run(["node", str(TSC), "-p", str(Path(tmp) / "tsconfig.json"), "--pretty", "false"],
                                  cwd=tmp, capture_output=True, text=True, timeout=600)
        except FileNotFoundError:
            raise SchemaToolsMissing("node is not installed (setup.sh installs Debian's nodejs and npm)") from None
    out = (done.stdout + done.stderr).strip()
    if done.returncode == 0:
        return []
    return out.splitlines() or [f"tsc exited {done.returncode}"]


def schema_version() -> str:
    return json.loads((SCHEMA / "package.json").read_text())["version"]


def main() -> int:
    from grafana import generate

    try:
        errors = check(generate.build())
    except SchemaToolsMissing as e:
        print(e, file=sys.stderr)
        return 2
    for line in errors:
        print(line, file=sys.stderr)
    if not errors:
        print(f"dashboards conform to @grafana/schema {schema_version()}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    sys.exit(main())
