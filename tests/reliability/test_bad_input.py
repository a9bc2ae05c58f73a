"""Hostile input: per-request extra args, over-long requests, trace ids with path tricks, and corrupt or
foreign objects in the store.  None crashes the engine (it serves normally afterwards) or prints a
traceback to a user; the store is not touched for a malformed trace id."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rel_common import MAX_MAP_TOKENS, traceparent
from synthetic import make_record, write
from text import prose

import attn_otel
from attn_otel import cli
from attn_otel.config import parse_request_options
from attn_otel.ids import InvalidTraceId, new_trace_id
from attn_otel.store import StoreError, capture_prefix

HOSTILE_EXTRA_ARGS = [
    {"attn_otel": 5}, {"attn_otel": ["maps"]}, {"attn_otel": None}, {"attn_otel": True}, {"attn_otel": ""},
    {"attn_otel": {"nested": {"deeper": [1, {"x": [2, 3]}]}}},
    {"attn_otel_layers": {"0": 1}}, {"attn_otel_layers": [1.5]}, {"attn_otel_layers": [True, False]},
    {"attn_otel_layers": [-1]}, {"attn_otel_layers": "999"}, {"attn_otel_layers": [2 ** 70]},
    {"attn_otel_layers": "1e309"}, {"attn_otel_layers": "0,,,,x"}, {"attn_otel_layers": [[0], [1]]},
    {"attn_otel_layers": ""}, {"attn_otel_layers": "nan"},
    {"traceparent": 12}, {"traceparent": ["00-" + "1" * 32 + "-" + "2" * 16 + "-01"]},
    {"traceparent": "00-../../../../etc/passwd-0000000000000001-01"},
    {"traceparent": "00-" + "0" * 32 + "-" + "1" * 16 + "-01"},  # all-zero trace id is invalid in W3C
    {"traceparent": "ff-" + "1" * 32 + "-" + "2" * 16 + "-01"},
    {"attn_otel": "maps", "attn_otel_layers": "all", "traceparent": None, "unknown_key": object.__name__},
]

HOSTILE_TRACE_IDS = [
    "../../../etc/passwd", "..", ".", "/", "a/b", "0" * 32 + "/../x", "0" * 16 + "/" + "0" * 15,
    "0" * 31, "0" * 33, "g" * 32, "\x00" * 32, "%2e%2e%2f", "\uff10" * 32, "\u0660" * 32, "*", "0" * 31 + "*",
    "0" * 32 + "\n..", "", " ", "traces", "0" * 32 + "\\x",
]


@pytest.mark.parametrize("extra", HOSTILE_EXTRA_ARGS, ids=lambda e: json.dumps(e)[:40])
def test_parse_request_options_never_raises(extra):
    opts = parse_request_options(extra)
    assert all(len(w) < 400 for w in opts.warnings)


@pytest.mark.engine
def test_hostile_extra_args_are_warnings_and_the_engine_keeps_serving(disk_engine):
    before = disk_engine.stats()
    log_before = len(disk_engine.attn_logs())
    res = disk_engine.generate(["Hello there"] * len(HOSTILE_EXTRA_ARGS), extra_args=HOSTILE_EXTRA_ARGS,
                               max_tokens=4)
    # vLLM itself refuses integers beyond 64 bits in extra args, before attn-otel sees them
    assert len(res["rejected_by_vllm"]) <= 1, res["rejected_by_vllm"]
    served = len(HOSTILE_EXTRA_ARGS) - len(res["rejected_by_vllm"])
    assert [o["output_tokens"] for o in res["outputs"]] == [4] * served
    for huge in ("layers_1e6", "string_10mb"):  # built in the engine process: a 10 MB command line is no test
        res = disk_engine.generate(["Hello there"], extra_args={"attn_otel": "maps"}, huge=huge, max_tokens=4)
        assert res["rejected_by_vllm"] or res["outputs"][0]["output_tokens"] == 4, res["rejected_by_vllm"]
    assert disk_engine.call("flush", timeout=120)["done"]

    # it still serves, and captures, normally
    trace = new_trace_id()
    res = disk_engine.generate(["The capital of France is"], extra_args={"attn_otel": "maps",
                                                                        "traceparent": traceparent(trace)})
    assert res["outputs"][0]["output_tokens"] == 8
    assert disk_engine.call("flush", timeout=120)["done"]
    (cap,) = attn_otel.open_trace(trace, store=disk_engine.store)
    assert cap.has_maps

    after = disk_engine.stats()
    assert after["dropped"].get("capture_error", 0) == before["dropped"].get("capture_error", 0)
    logged = disk_engine.attn_logs()[log_before:]
    assert "Traceback" not in logged
    assert len(logged) < 64 << 10, len(logged)  # warnings once per kind, values shortened: no 10 MB log line
    assert "attn_otel_layers=" in logged and "traceparent=" in logged
    print(f"\n[reliability] {served + 2} hostile extra args served ({res['rejected_by_vllm']} refused by vLLM); {len(logged)} bytes of "
          f"attn_otel log; counters {after['skipped']} {after['dropped']}")


@pytest.mark.engine
def test_a_request_longer_than_the_map_cap_gets_metrics_and_a_counted_skip(disk_engine):
    before = disk_engine.stats()
    trace = new_trace_id()
    res = disk_engine.generate([prose(120, seed=3)], extra_args={"attn_otel": "maps",
                                                                 "traceparent": traceparent(trace)})
    assert disk_engine.call("flush", timeout=120)["done"]
    out = res["outputs"][0]
    T = out["prompt_tokens"] + out["output_tokens"] - 1
    assert T > MAX_MAP_TOKENS
    after = disk_engine.stats()
    assert after["skipped"].get("map_too_long", 0) == before["skipped"].get("map_too_long", 0) + 1
    assert after["stored"] == before["stored"] + 1
    (cap,) = attn_otel.open_trace(trace, store=disk_engine.store)
    assert not cap.has_maps and cap.attn is None and cap.num_tokens == T
    summary = cap.summary()  # the metrics were computed (per row, or summarised: ATTN_OTEL_ROW_METRICS)
    assert np.isfinite(np.asarray(summary["prompt"]["entropy_norm"]["layer_mean"])).all()
    assert np.isfinite(np.asarray(summary["generated"]["lookback_ratio"]["layer_mean"])).all()


# --- trace ids -------------------------------------------------------------------------------------------

class CountingStore:
    """Wraps a zarr store and counts every call into it (reads, listings, writes)."""

    def __new__(cls, inner):
        from zarr.storage import WrapperStore

        class Counting(WrapperStore):
            calls = 0

            def __getattribute__(self, name):
                if name in ("get", "get_partial_values", "exists", "list", "list_dir", "list_prefix", "set",
                            "delete", "getsize"):
                    type(self).calls += 1
                return super().__getattribute__(name)

        return Counting(inner)


@pytest.mark.parametrize("trace_id", HOSTILE_TRACE_IDS, ids=repr)
def test_open_trace_refuses_a_malformed_trace_id_before_touching_the_store(tmp_path, trace_id):
    from attn_otel.store import open_zarr_store

    record, _ = make_record()
    write(tmp_path / "s", record)
    store = CountingStore(open_zarr_store(tmp_path / "s", read_only=True))
    with pytest.raises(InvalidTraceId):
        attn_otel.open_trace(trace_id, store=store)
    assert type(store).calls == 0
    # the same wrapper does count: a real lookup goes through it
    attn_otel.open_trace(record.trace_id, store=store)
    assert type(store).calls > 0


def test_the_cli_refuses_malformed_trace_ids_without_a_request_to_s3(s3_proxy, moto_s3, s3_env, monkeypatch,
                                                                     capsys, tmp_path):
    bucket = moto_s3.new_bucket()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_proxy.endpoint)  # every S3 request goes through the proxy
    url = f"s3://{bucket}/captures"
    seen = s3_proxy.accepted
    for trace_id in HOSTILE_TRACE_IDS:
        if trace_id.startswith("-"):
            continue
        for argv in (["fetch", trace_id, "-o", str(tmp_path / "x.npz")], ["show", trace_id, "--layer", "0"],
                     ["metrics", trace_id]):
            code = cli.main([*argv, "--store", url])
            err = capsys.readouterr().err
            assert code == 1, (argv, err)
            assert err.startswith("attn-otel: error: not a trace id") and err.count("\n") == 1, err
    assert s3_proxy.accepted == seen  # not one connection to S3
    assert not (tmp_path / "x.npz").exists()
    assert cli.main(["ls", "--store", url]) == 0  # and the proxy does see real requests
    assert s3_proxy.accepted > seen


# --- corrupt and foreign objects -------------------------------------------------------------------------

PICKLE_SENTINEL = "attn-otel-pickle-ran"


def _malicious_pickle(path: Path) -> bytes:
    import pickle

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {path}",))

    return pickle.dumps(Boom())


def _corrupt(kind: str, root: Path, prefix: str, tmp_path: Path) -> str:
    """Damage one capture; returns the object the error must name."""
    cap = root / prefix
    if kind == "marker-not-json":
        (cap / "COMPLETE").write_bytes(b"\x80\x04not json")
        return f"{prefix}/COMPLETE"
    if kind == "marker-foreign-json":
        (cap / "COMPLETE").write_text(json.dumps({"format": 1, "trace_id": 7}))
        return f"{prefix}/COMPLETE"
    if kind == "group-metadata-garbage":
        (cap / "zarr.json").write_bytes(os.urandom(64))
        return prefix
    if kind == "array-metadata-foreign":
        (cap / "attn" / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "array"}))
        return prefix
    if kind == "array-shape-lies":
        meta = json.loads((cap / "attn" / "zarr.json").read_text())
        meta["shape"] = [1, 1, 10 ** 9, 10 ** 9]
        meta["chunk_grid"]["configuration"]["chunk_shape"] = [1, 1, 256, 10 ** 9]
        (cap / "attn" / "zarr.json").write_text(json.dumps(meta))
        return prefix
    if kind == "array-missing":
        import shutil

        shutil.rmtree(cap / "attn")
        return prefix
    if kind == "chunk-truncated":
        for chunk in (p for p in (cap / "attn" / "c").rglob("*") if p.is_file()):
            chunk.write_bytes(chunk.read_bytes()[:5])
        return prefix
    if kind == "pickle-codec":
        meta = json.loads((cap / "attn" / "zarr.json").read_text())
        meta["data_type"] = "float16"
        meta["codecs"] = [{"name": "numcodecs.pickle", "configuration": {"protocol": 4}}]
        (cap / "attn" / "zarr.json").write_text(json.dumps(meta))
        for chunk in (p for p in (cap / "attn" / "c").rglob("*") if p.is_file()):
            chunk.write_bytes(_malicious_pickle(tmp_path / PICKLE_SENTINEL))
        return prefix
    raise AssertionError(kind)


CORRUPTIONS = ["marker-not-json", "marker-foreign-json", "group-metadata-garbage", "array-metadata-foreign",
               "array-shape-lies", "array-missing", "chunk-truncated", "pickle-codec"]


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_a_corrupt_or_foreign_object_is_one_line_naming_it(kind, tmp_path, capsys):
    store = tmp_path / "store"
    record, _ = make_record(layers=(0, 3), heads=2, T=12)
    write(store, record)
    prefix = capture_prefix(record.trace_id, record.request_id)
    named = _corrupt(kind, store, prefix, tmp_path)
    for argv in (["fetch", record.trace_id, "-o", str(tmp_path / "out.npz")],
                 ["show", record.trace_id, "--layer", "3", "-o", str(tmp_path / "out.png")]):
        code = cli.main([*argv, "--store", str(store)])
        err = capsys.readouterr().err
        assert code == 1, (argv, err)
        assert err.startswith("attn-otel: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
        assert named in err, err
    with pytest.raises(StoreError, match=named.replace("/", "/")):
        caps = attn_otel.open_trace(record.trace_id, store=store)
        caps[0].maps()
    assert not (tmp_path / PICKLE_SENTINEL).exists()
    assert not (tmp_path / "out.npz").exists()


def test_the_real_executable_prints_no_traceback_for_corrupt_objects(tmp_path):
    store = tmp_path / "store"
    records = []
    for kind in ("chunk-truncated", "array-shape-lies", "pickle-codec"):
        record, _ = make_record(request_id=f"req-{kind}")
        write(store, record)
        _corrupt(kind, store, capture_prefix(record.trace_id, record.request_id), tmp_path)
        records.append(record)
    foreign = store / "traces" / "not-a-trace" / "zarr.json"  # foreign objects beside ours are ignored by ls
    foreign.parent.mkdir(parents=True)
    foreign.write_text("{}")
    exe = Path(sys.executable).with_name("attn-otel")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTN_OTEL")}
    for argv in [["ls"]] + [["fetch", r.trace_id, "-o", str(tmp_path / "o.npz")] for r in records] + \
            [["metrics", records[0].trace_id], ["fetch", "../../etc/passwd"]]:
        res = subprocess.run([str(exe), *argv, "--store", str(store)], capture_output=True, text=True, timeout=120,
                             env=env)
        assert "Traceback" not in res.stderr + res.stdout, (argv, res.stderr)
        if argv[0] == "ls":
            assert res.returncode == 0 and len(res.stdout.strip().splitlines()) == 1 + len(records), res.stdout
        elif argv[0] == "metrics":
            assert res.returncode == 0, res.stderr  # the metrics of a capture with a damaged map still read
        else:
            assert res.returncode == 1 and res.stderr.count("\n") == 1, (argv, res.stderr)
    assert not (tmp_path / PICKLE_SENTINEL).exists()
