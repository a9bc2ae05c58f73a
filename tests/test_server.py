"""The API-server side (attn_otel.server): trace context in, ``traceresponse`` out, no vLLM needed."""

import asyncio

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from attn_otel import server
from attn_otel.ids import new_span_id, new_trace_id, parse_traceparent


@pytest.fixture
def client():
    app = FastAPI()
    seen = {}

    @app.get("/echo")
    async def echo(request: __import__("fastapi").Request):
        seen["header"] = request.headers.get("traceparent")
        seen["context"] = server.current_traceparent()
        return {"ok": True}

    app.add_middleware(server.TraceContextMiddleware)
    with TestClient(app) as c:
        yield c, seen


def test_client_traceparent_is_kept_and_echoed(client):
    c, seen = client
    tp = f"00-{new_trace_id()}-{new_span_id()}-01"
    r = c.get("/echo", headers={"traceparent": tp})
    assert r.status_code == 200
    assert r.headers["traceresponse"] == tp
    assert seen == {"header": tp, "context": tp}


def test_missing_traceparent_gets_a_new_trace_in_header_context_and_response(client):
    c, seen = client
    r = c.get("/echo")
    made = r.headers["traceresponse"]
    assert parse_traceparent(made) is not None
    assert seen == {"header": made, "context": made}
    assert c.get("/echo").headers["traceresponse"].split("-")[1] != made.split("-")[1]  # one trace per request


@pytest.mark.parametrize("bad", ["garbage", "00-" + "0" * 32 + "-" + "1" * 16 + "-01", "00-abc/../x-1-01"])
def test_invalid_traceparent_is_replaced_not_trusted(client, bad):
    c, seen = client
    r = c.get("/echo", headers={"traceparent": bad})
    made = r.headers["traceresponse"]
    assert made != bad and parse_traceparent(made) is not None
    assert seen["header"] == made  # vLLM's own tracing sees the same, valid trace


def test_context_is_empty_outside_a_request():
    assert server.current_traceparent() is None


class _Params:
    def __init__(self, extra_args=None):
        self.extra_args = extra_args


def test_inject_fills_missing_traceparent_only():
    tp = f"00-{new_trace_id()}-{new_span_id()}-01"
    own = f"00-{new_trace_id()}-{new_span_id()}-01"
    empty, other, mine = _Params(), _Params({"attn_otel": "maps"}), _Params({"traceparent": own})

    async def in_request():
        token = server._TRACEPARENT.set(tp)
        try:
            server.inject_traceparent(empty, other, mine, None, object())
        finally:
            server._TRACEPARENT.reset(token)

    asyncio.run(in_request())
    assert empty.extra_args == {"traceparent": tp}
    assert other.extra_args == {"attn_otel": "maps", "traceparent": tp}
    assert mine.extra_args == {"traceparent": own}  # the request's own (vllm_xargs) traceparent wins


def test_inject_outside_a_request_changes_nothing():
    p = _Params()
    server.inject_traceparent(p)
    assert p.extra_args is None


def test_prepare_stats_dir_makes_one_and_keeps_an_operator_choice(monkeypatch, tmp_path):
    monkeypatch.delenv("ATTN_OTEL_STATS_DIR", raising=False)
    made = server.prepare_stats_dir()
    try:
        assert made and __import__("os").path.isdir(made)
        assert server.prepare_stats_dir() == made  # the engine processes inherit the same one
    finally:
        __import__("shutil").rmtree(made, ignore_errors=True)
    monkeypatch.setenv("ATTN_OTEL_STATS_DIR", str(tmp_path))
    assert server.prepare_stats_dir() == str(tmp_path)
