"""Security: nothing is unpickled across processes or from the store; no prompt text in spans, attn-otel's
logs or metric labels; token ids only in the store, and only when ATTN_OTEL_STORE_TOKENS allows; the AWS
secret key never in a log, a span or the metrics, error paths included."""

from __future__ import annotations

import ast
import io
import json
import re
import time
from pathlib import Path

import pytest
from rel_common import traceparent

import attn_otel
from attn_otel.ids import new_trace_id

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted([*(ROOT / "attn_otel").rglob("*.py"), *(ROOT / "exporters").rglob("*.py")])
PROMPT = "Zanzibar quokka marmalade lighthouse 7319 xylophone recipe, step one:"
PROMPT_MARKER = "quokka marmalade"  # what must never appear outside the store (and the client's own answer)

UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve", "joblib",
                  "copyreg"}
# multiprocessing's queues, pipes, pools and managers pickle what they carry; so does a process pool
UNSAFE_NAMES = {"Queue", "SimpleQueue", "JoinableQueue", "Pipe", "Pool", "Manager", "ProcessPoolExecutor",
                "Listener", "Client"}


def _unsafe_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if mod.split(".")[0] in UNSAFE_MODULES:
                found.append(f"{where} from {mod}")
            if mod.startswith(("multiprocessing", "concurrent.futures")):
                found += [f"{where} from {mod} import {a.name}" for a in node.names if a.name in UNSAFE_NAMES]
        elif isinstance(node, ast.Attribute):
            if node.attr in UNSAFE_NAMES and isinstance(node.value, ast.Name) and node.value.id in (
                    "multiprocessing", "mp", "futures"):
                found.append(f"{where} {node.value.id}.{node.attr}")
            if node.attr in ("loads", "load") and isinstance(node.value, ast.Name) and node.value.id in UNSAFE_MODULES:
                found.append(f"{where} {node.value.id}.{node.attr}")
        elif isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            if func in ("torch.load", "torch.serialization.load"):
                weights_only = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value
                                   for k in node.keywords)
                if not weights_only:
                    found.append(f"{where} {func} without weights_only=True")
            for k in node.keywords:
                if k.arg == "allow_pickle" and not (isinstance(k.value, ast.Constant) and k.value.value is False):
                    found.append(f"{where} {func}(allow_pickle={ast.unparse(k.value)})")
    return found


def test_the_package_never_unpickles():
    assert len(SOURCES) > 10
    found = [hit for path in SOURCES for hit in _unsafe_uses(path)]
    assert found == []


def test_the_checker_would_see_unpickling(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import pickle\nfrom multiprocessing import Queue\nimport torch, numpy as np\n"
                     "torch.load('x')\nnp.load('x', allow_pickle=True)\npickle.loads(b'')\n")
    assert len(_unsafe_uses(probe)) == 5, _unsafe_uses(probe)


def test_the_writer_protocol_refuses_anything_but_json(tmp_path):
    """A pickle (or any non-JSON line) on the writer's stdin is an error answer, never loaded."""
    import pickle

    from attn_otel import writer_proc

    sentinel = tmp_path / "ran"

    class Boom:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {sentinel}",))

    payload = pickle.dumps(Boom(), protocol=0).decode("latin-1").replace("\n", " ")
    lines = [payload, json.dumps({"id": 1, "shm": "/../../etc/passwd", "record": {}, "arrays": {}}),
             json.dumps({"id": 2, "shm": "psm_no_such_segment", "record": {"__class__": "x"}, "arrays": {}}),
             json.dumps([1, 2, 3])]
    out = io.StringIO()
    writer_proc.serve(str(tmp_path / "store"), stdin=io.StringIO("\n".join(lines) + "\n"), stdout=out)
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(replies) == len(lines) and not any(r["ok"] for r in replies)
    assert "JSONDecodeError" in replies[0]["error"]
    assert not sentinel.exists()


# --- what leaves the engine: spans, logs, metrics ---------------------------------------------------------

def _strings(value) -> list:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [value] + [x for v in value for x in _strings(v)]
    return [value]


def _contains_run(values: list, ids: list[int], run: int = 4) -> bool:
    """Whether ``values`` (ints) hold ``run`` consecutive token ids of ``ids``."""
    if len(values) < run or not all(isinstance(v, int) for v in values):
        return False
    grams = {tuple(ids[i:i + run]) for i in range(len(ids) - run + 1)}
    return any(tuple(values[i:i + run]) in grams for i in range(len(values) - run + 1))


def _id_texts(ids: list[int]) -> list[str]:
    """How a run of token ids would look in a log line or a label."""
    run = ids[1:5]
    return [", ".join(map(str, run)), ",".join(map(str, run)), " ".join(map(str, run))]


def _exposition(stats_dir) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    from attn_otel.exporters.prometheus import register_collector

    registry = CollectorRegistry()
    register_collector(registry, stats_dir)
    return generate_latest(registry).decode()


ALLOWED_LABELS = {"model", "layer", "reason", "exporter", "queue", "le", "quantile"}


@pytest.mark.engine
def test_prompt_text_and_token_ids_stay_in_the_store(s3_engine, s3_env, otlp_receiver):
    proxy = s3_engine.proxy
    proxy.mode = "up"
    trace = new_trace_id()
    log_at = len(s3_engine.attn_logs())
    res = s3_engine.generate([PROMPT], extra_args={"attn_otel": "maps", "traceparent": traceparent(trace)},
                             max_tokens=12)
    assert s3_engine.call("flush", timeout=120)["done"]
    out = res["outputs"][0]
    ids = out["prompt_ids"] + out["output_ids"]

    # the store has them (this engine asks for them: ATTN_OTEL_STORE_TOKENS=1; the default stores none) ...
    (cap,) = attn_otel.open_trace(trace, store=s3_engine.backend.url)
    assert list(cap.token_ids) == ids[:cap.num_tokens]
    # ... and nothing else does: the span (attributes, events, raw bytes on the wire)
    (span,) = otlp_receiver.wait_for(lambda s: s.name == "attn_capture" and s.trace_id == trace, timeout=60)
    values = _strings(span.attributes) + [x for e in span.events for x in _strings(e[2])]
    assert not [v for v in values if isinstance(v, str) and (PROMPT_MARKER in v or "quokka" in v)]
    assert not [v for v in values if isinstance(v, list) and _contains_run(v, ids)]
    raw = otlp_receiver.raw_bytes()
    assert b"quokka" not in raw
    assert not any(t.encode() in raw for t in _id_texts(ids))
    # attn_otel's own log records (engine process) and the writer processes' output
    logged = s3_engine.attn_logs()[log_at:] + s3_engine.stderr_path.read_text(errors="replace")
    assert "quokka" not in logged and not any(t in logged for t in _id_texts(ids))
    # metric names and labels
    time.sleep(1.5)  # the stats files are refreshed every second
    text = _exposition(s3_engine.stats_dir)
    assert "attn_otel_captures_total" in text
    assert "quokka" not in text and not any(t in text for t in _id_texts(ids))
    labels = set(re.findall(r'[{,]([a-zA-Z_][a-zA-Z0-9_]*)="', text))
    assert labels <= ALLOWED_LABELS, labels - ALLOWED_LABELS
    assert trace not in text  # exemplars only on the OpenMetrics route; the classic text has no trace ids


@pytest.mark.engine
def test_store_tokens_0_stores_no_token_ids(disk_engine):
    trace = new_trace_id()
    disk_engine.generate([PROMPT], extra_args={"attn_otel": "maps", "traceparent": traceparent(trace)})
    assert disk_engine.call("flush", timeout=120)["done"]
    (cap,) = attn_otel.open_trace(trace, store=disk_engine.store)
    assert cap.token_ids is None and cap.meta["token_ids"] is False
    files = [p.relative_to(disk_engine.store).as_posix() for p in (disk_engine.store / "traces").rglob("*")]
    assert files and not [f for f in files if "token_ids" in f]
    assert "quokka" not in disk_engine.attn_logs() + disk_engine.stderr_path.read_text(errors="replace")


@pytest.mark.engine
def test_the_aws_secret_key_is_never_logged_even_on_errors(s3_engine, otlp_receiver):
    from s3 import SECRET_KEY

    proxy = s3_engine.proxy
    before = s3_engine.stats()["dropped"].get("store_error", 0)
    proxy.mode = "refuse"  # an error path: the writer's S3 calls fail and are logged
    try:
        s3_engine.generate(["Hello there"] * 2, extra_args={"attn_otel": "maps"})
        deadline = time.monotonic() + 90
        while s3_engine.stats()["dropped"].get("store_error", 0) == before:
            assert time.monotonic() < deadline
            time.sleep(0.5)
    finally:
        proxy.mode = "up"
    assert s3_engine.call("flush", timeout=120)["done"]
    s3_engine.generate(["Hello again"], extra_args={"attn_otel": "maps"})
    assert s3_engine.call("flush", timeout=120)["done"]
    logged = s3_engine.logs() + s3_engine.attn_logs()
    assert "writing capture of request" in logged or "exporter zarr failed" in logged  # the error was logged
    assert SECRET_KEY not in logged
    assert SECRET_KEY.encode() not in otlp_receiver.raw_bytes()
    time.sleep(1.5)
    assert SECRET_KEY not in _exposition(s3_engine.stats_dir)
    for path in Path(s3_engine.stats_dir).iterdir():
        assert SECRET_KEY not in path.read_text(errors="replace")
