"""The package reads as the flow it implements (issue 20): no import circles, no class past about 300
lines, exporters a real subpackage in the checkout as in the wheel, vLLM touched by the adapter alone."""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_CLASS_LINES = 300


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, folder in (("attn_otel", ROOT / "attn_otel"), ("attn_otel.exporters", ROOT / "exporters")):
        for path in sorted(folder.glob("*.py")):
            mods[pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"] = path
    return mods


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules ``name`` imports, at module level or inside functions alike."""
    pkg = name if path.stem == "__init__" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in known else base)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in known and m != name}


def test_the_import_graph_has_no_circles():
    mods = _modules()
    graph = {name: _imports(name, path, set(mods)) for name, path in mods.items()}
    graph = {n: {m for m in deps if m != "attn_otel"} for n, deps in graph.items()}  # the package's own API
    state: dict[str, int] = {}
    cycles = []

    def visit(n, stack):
        state[n] = 1
        for m in graph[n]:
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m, stack + [m])
        state[n] = 2

    for n in graph:
        if n not in state:
            visit(n, [n])
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_class_is_much_over_300_lines():
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, long


def test_only_the_adapter_imports_vllm():
    users = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                    else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if any(m == "vllm" or m.startswith("vllm.") for m in mods):
                users.append(name)
    assert set(users) <= {"attn_otel.vllm_adapter", "attn_otel.demo", "attn_otel.server"}, sorted(set(users))


def test_exporters_is_the_top_level_folder_as_a_real_subpackage():
    exporters = importlib.import_module("attn_otel.exporters")
    assert Path(exporters.__file__).resolve() == ROOT / "exporters" / "__init__.py"
    import attn_otel

    assert len(attn_otel.__path__) == 1  # no path extension: the mapping in pyproject.toml does it
    assert callable(exporters.build_exporters)


@pytest.mark.parametrize("module", ["otel", "prometheus", "zarr_store"])
def test_each_exporter_module_imports_as_part_of_the_subpackage(module):
    mod = importlib.import_module(f"attn_otel.exporters.{module}")
    assert mod.__name__ == f"attn_otel.exporters.{module}"


def test_every_variable_is_documented_in_the_configuration_page():
    from attn_otel import config

    names = {v for k, v in vars(config).items() if k.startswith("ATTN_OTEL") and isinstance(v, str)}
    page = (ROOT / "docs" / "configuration.md").read_text()
    missing = sorted(n for n in names if f"`{n}`" not in page)
    assert names and not missing, missing


def test_every_relative_link_of_the_readme_and_docs_resolves():
    import re

    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "grafana").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken
