"""``ATTN_OTEL_STORE=s3://bucket/prefix`` against a real S3 HTTP endpoint (moto's server on loopback): the
real engine captures into it, and ``attn-otel ls``/``fetch`` and :func:`attn_otel.open_trace` read it back.
The store contract itself (the same tests as a local folder) is in tests/test_store.py and tests/test_gc.py."""

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from s3 import SECRET_KEY
from synthetic import make_record, write

import attn_otel
from attn_otel import cli
from attn_otel.exporters import ExportItem
from attn_otel.exporters.zarr_store import ZarrExporter
from attn_otel.ids import new_span_id, new_trace_id
from attn_otel.metrics import SUMMARY_METRICS
from attn_otel.store import StoreError, open_zarr_store, redact_url

ENGINE_SCRIPT = """
import json, os, sys, time
t0 = time.monotonic()
os.environ.update(ATTN_OTEL="1", ATTN_OTEL_LAYERS="all", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                  VLLM_CPU_KVCACHE_SPACE="1", ATTN_OTEL_STORE_TOKENS="1",  # the test reads token ids back
                  ATTN_OTEL_MAP_LAYERS="all")  # maps of all 30 layers (the default maps 4, streams the rest)

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from attn_otel import vllm_adapter

    model, requests = sys.argv[1], json.loads(sys.argv[2])
    # eager: what this tests is the store, not how the model runs (no dynamo trace, ~10 s of CI)
    llm = LLM(model=model, max_model_len=256, max_num_batched_tokens=256, max_num_seqs=4, seed=0, enforce_eager=True)
    params = [SamplingParams(max_tokens=4, temperature=0.0,
                             extra_args={"attn_otel": "maps", "traceparent": r["traceparent"]}) for r in requests]
    outs = llm.generate([r["prompt"] for r in requests], params, use_tqdm=False)
    llm.llm_engine.step()  # finished requests reach the worker in the next step
    (capture,) = vllm_adapter.engines()
    assert capture.flush(120), "captures not written within 120 s"
    print("TIMES", time.monotonic() - t0, file=sys.stderr)
    print("RESULT " + json.dumps([[list(o.prompt_token_ids), list(o.outputs[0].token_ids)] for o in outs]))
"""


@pytest.mark.engine
def test_engine_captures_to_s3_and_ls_fetch_open_trace_read_it_back(s3_backend, smollm2_path, tmp_path, capsys):
    requests = [{"prompt": "The capital of France is", "trace": new_trace_id()},
                {"prompt": "Water boils at a temperature of", "trace": new_trace_id()}]
    for r in requests:
        r["traceparent"] = f"00-{r['trace']}-{new_span_id()}-01"
    env = {**os.environ, "ATTN_OTEL_STORE": s3_backend.url}
    res = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, smollm2_path, json.dumps(requests)], env=env,
                         capture_output=True, text=True, timeout=480)
    result = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and result, res.stderr[-4000:]
    tokens = json.loads(result[0][len("RESULT "):])
    # everything went under the bucket's prefix: the root group's metadata and the captures
    assert s3_backend.outside_keys() == [] and all(k.startswith("traces/") or k == "zarr.json" for k in s3_backend.keys())

    # attn-otel ls, as a user runs it: the real executable, the store from ATTN_OTEL_STORE.
    exe = Path(sys.executable).with_name("attn-otel")
    ls = subprocess.run([str(exe), "ls", "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert ls.returncode == 0, ls.stderr
    rows = json.loads(ls.stdout)
    assert sorted(row["trace_id"] for row in rows) == sorted(r["trace"] for r in requests)
    assert all(row["maps"] and row["layers"] == list(range(30)) and row["num_heads"] == 9 for row in rows)

    for r, (prompt_ids, out_ids) in zip(requests, tokens):
        T = len(prompt_ids) + len(out_ids) - 1
        (cap,) = attn_otel.open_trace(r["trace"], store=s3_backend.url)
        assert (cap.num_tokens, cap.prompt_len) == (T, len(prompt_ids))
        assert cap.meta["parent_span_id"] == r["traceparent"].split("-")[2]
        np.testing.assert_array_equal(cap.token_ids, (prompt_ids + out_ids)[:T])
        head = np.asarray(cap.attn[29, 4], dtype=np.float32)
        np.testing.assert_allclose(head.sum(axis=-1), 1.0, atol=5e-3)  # row-stochastic softmax rows
        assert np.all(np.triu(head, k=1) == 0)  # causal

        npz = tmp_path / f"{r['trace']}.npz"
        assert cli.main(["fetch", r["trace"], "--layers", "0,29", "--heads", "4", "-o", str(npz),
                         "--store", s3_backend.url]) == 0
        data = np.load(npz)
        assert data["attn"].shape == (2, 1, T, T)
        np.testing.assert_allclose(data["attn"][1, 0], head, rtol=0, atol=0)
        assert list(data["token_ids"]) == (prompt_ids + out_ids)[:T]


def test_a_missing_bucket_is_a_store_error_naming_it_for_readers_and_writers(s3_backend, capsys):
    url = f"s3://{s3_backend.bucket}-missing/prefix"
    for read_only in (True, False):
        with pytest.raises(StoreError, match=f"S3 bucket '{s3_backend.bucket}-missing' does not exist at "
                                             f"{s3_backend.s3.endpoint}"):
            open_zarr_store(url, read_only=read_only)
    assert cli.main(["ls", "--store", url]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"'{s3_backend.bucket}-missing' does not exist" in err


def test_the_exporter_writes_to_s3_and_names_the_object(s3_backend):
    record, expected = make_record()
    exporter = ZarrExporter(s3_backend.url)
    item = ExportItem(record)
    exporter.export(item)
    exporter.shutdown()
    assert item.uri == f"{s3_backend.url}/traces/{record.trace_id}/{record.request_id}"
    summary_bytes = 2 * len(SUMMARY_METRICS) * 4 * len(record.layers) * record.num_heads * 4  # [part, metric, stat, L, H]
    assert item.bytes_written == record.nbytes() + summary_bytes
    assert f"traces/{record.trace_id}/{record.request_id}/COMPLETE" in s3_backend.keys()
    np.testing.assert_allclose(attn_otel.open_trace(record.trace_id, s3_backend.url)[0].maps(), expected,
                               atol=5e-4, rtol=0)


def test_the_exporter_to_a_missing_bucket_fails_with_a_store_error(s3_backend):
    exporter = ZarrExporter(f"s3://{s3_backend.bucket}-missing/p")
    with pytest.raises(StoreError, match="does not exist"):
        exporter.export(ExportItem(make_record()[0]))


def test_credentials_in_the_url_are_refused_and_never_repeated(s3_backend, capsys):
    url = f"s3://{'AKIAINURL'}:{SECRET_KEY}@{s3_backend.bucket}/p"
    with pytest.raises(StoreError, match="carries credentials") as err:
        open_zarr_store(url)
    assert SECRET_KEY not in str(err.value) and "***@" in str(err.value)
    assert cli.main(["ls", "--store", url]) == 1
    out = capsys.readouterr()
    assert SECRET_KEY not in out.out + out.err and "carries credentials" in out.err
    assert redact_url(url) == f"s3://***@{s3_backend.bucket}/p"


def test_the_secret_key_is_never_logged(s3_backend, caplog, capsys):
    caplog.set_level(logging.DEBUG)  # botocore, s3fs, aiobotocore and attn_otel at their most verbose
    write(s3_backend.url, make_record()[0])
    assert cli.main(["ls", "--store", s3_backend.url]) == 0
    assert cli.main(["ls", "--store", f"s3://{s3_backend.bucket}-missing/p"]) == 1
    assert cli.main(["gc", "--store", s3_backend.url, "--grace", "0"]) == 0
    out = capsys.readouterr()
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "PutObject" in logged or "put_object" in logged.lower()  # the log did see the requests
    assert SECRET_KEY not in logged and SECRET_KEY not in out.out + out.err


def test_an_unreachable_endpoint_is_one_line_naming_bucket_and_endpoint(s3_backend, monkeypatch, capsys):
    import socket

    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    assert cli.main(["ls", "--store", s3_backend.url]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot reach S3 bucket '{s3_backend.bucket}' at http://127.0.0.1:{port}" in err
