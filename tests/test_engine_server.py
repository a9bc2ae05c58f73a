"""Online: vLLM's OpenAI server (CPU build) with ATTN_OTEL=1, per-request options through ``vllm_xargs``."""

import json
import time
import urllib.request

import pytest

import attn_otel
from attn_otel.ids import new_span_id, new_trace_id

pytestmark = pytest.mark.engine


def _post(port, body, headers=None, with_headers=False):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = r.status, json.loads(r.read())
        return (*out, dict(r.headers)) if with_headers else out


@pytest.fixture(scope="module")
def server(otel_server, smollm2_path):
    """The session's server of tests/conftest.py (``ATTN_OTEL_MAPS_SAMPLE=0``; it also exports spans, which
    tests/test_otel_server.py looks at)."""
    port, store = otel_server
    return port, store, smollm2_path


def _wait_for(trace_id, store, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return attn_otel.open_trace(trace_id, store=store)
        except attn_otel.TraceNotFound:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_vllm_xargs_select_maps_and_layers(server):
    port, store, model = server
    trace = new_trace_id()
    status, body = _post(port, {"model": model, "prompt": "The capital of France is", "max_tokens": 5,
                                "temperature": 0, "vllm_xargs": {"attn_otel": "maps", "attn_otel_layers": "0,29",
                                                                 "traceparent": f"00-{trace}-{new_span_id()}-01"}})
    assert status == 200 and body["choices"][0]["text"]
    (cap,) = _wait_for(trace, store)
    assert cap.has_maps and cap.layers == [0, 29]  # of the default (auto) tapped layers 0, 10, 19, 29 and cap.attn.shape[:2] == (2, 9)
    assert cap.num_tokens == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] - 1


def test_bad_vllm_xargs_still_serve(server):
    port, store, model = server
    for xargs in ({"attn_otel": "bogus"}, {"attn_otel_layers": "x,y"}, {"attn_otel_layers": [-3]}):
        status, body = _post(port, {"model": model, "prompt": "Hello", "max_tokens": 3, "vllm_xargs": xargs})
        assert status == 200 and body["usage"]["completion_tokens"] == 3


def test_http_traceparent_header_keys_the_capture(server):
    port, store, model = server
    trace, parent = new_trace_id(), new_span_id()
    status, body, headers = _post(port, {"model": model, "prompt": "The capital of France is", "max_tokens": 3},
                                  headers={"traceparent": f"00-{trace}-{parent}-01"}, with_headers=True)
    assert status == 200
    assert headers["traceresponse"] == f"00-{trace}-{parent}-01"
    (cap,) = _wait_for(trace, store)
    assert cap.meta["parent_span_id"] == parent
    assert cap.num_tokens == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] - 1


def test_without_traceparent_the_response_names_the_trace(server):
    port, store, model = server
    status, body, headers = _post(port, {"model": model, "prompt": "Hello there", "max_tokens": 2},
                                  with_headers=True)
    assert status == 200
    _, trace, parent, _ = headers["traceresponse"].split("-")
    (cap,) = _wait_for(trace, store)
    assert cap.meta["parent_span_id"] == parent
    # a second request is a second trace
    _, _, headers2 = _post(port, {"model": model, "prompt": "Hello there", "max_tokens": 2}, with_headers=True)
    assert headers2["traceresponse"].split("-")[1] != trace
