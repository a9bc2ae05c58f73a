"""The API-server side (attn_otel.server): trace context in, ``traceresponse`` out, no vLLM needed."""

import asyncio
import re

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


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID = "00f067aa0ba902b7"
TRACERESPONSE = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")

# (what the client sends, the traceparent the request goes on with; None: a new trace)
TRACEPARENTS = [
    (f"00-{TRACE_ID}-{SPAN_ID}-01", f"00-{TRACE_ID}-{SPAN_ID}-01"),
    (f"00-{TRACE_ID}-{SPAN_ID}-00", f"00-{TRACE_ID}-{SPAN_ID}-00"),  # not sampled: kept as the client said
    (f"00-{TRACE_ID}-{SPAN_ID}-03", f"00-{TRACE_ID}-{SPAN_ID}-03"),
    (f" 00-{TRACE_ID}-{SPAN_ID}-01\t", f"00-{TRACE_ID}-{SPAN_ID}-01"),  # optional whitespace around it
    (f"cc-{TRACE_ID}-{SPAN_ID}-01-future", f"00-{TRACE_ID}-{SPAN_ID}-01"),  # a later version: read as 00
    ("garbage", None),
    ("00-abc/../x-1-01", None),
    ("", None),
    (f"00-{TRACE_ID.upper()}-{SPAN_ID}-01", None),  # uppercase hex
    (f"00-{TRACE_ID}-{SPAN_ID.upper()}-01", None),
    (f"00-{TRACE_ID}-{SPAN_ID}-0F", None),
    (f"00-{'0' * 32}-{SPAN_ID}-01", None),  # all-zero trace id
    (f"00-{TRACE_ID}-{'0' * 16}-01", None),  # all-zero span id
    (f"ff-{TRACE_ID}-{SPAN_ID}-01", None),  # the forbidden version
    (f"00-{TRACE_ID}-{SPAN_ID}-01-extra", None),  # version 00 has four fields
    (f"00-{TRACE_ID[:-1]}-{SPAN_ID}-01", None),  # wrong lengths
    (f"00-{TRACE_ID}0-{SPAN_ID}-01", None),
    (f"00-{TRACE_ID}-{SPAN_ID[:-1]}-01", None),
    (f"00-{TRACE_ID}-{SPAN_ID}-1", None),
    (f"0-{TRACE_ID}-{SPAN_ID}-01", None),
    (f"00-{TRACE_ID}-{SPAN_ID}-01" + "-x" * 300, None),  # longer than 512 characters
]


@pytest.mark.parametrize("sent, kept", TRACEPARENTS)
def test_traceparents_through_the_middleware(client, sent, kept):
    c, seen = client
    r = c.get("/echo", headers={"traceparent": sent, "tracestate": "vendor=1"})
    made = r.headers["traceresponse"]
    assert TRACERESPONSE.match(made), made
    assert seen == {"header": made, "context": made}  # vLLM's own tracing sees the same, valid trace
    if kept is not None:
        assert made == kept and parse_traceparent(made) == (TRACE_ID, SPAN_ID)
    else:
        assert made.split("-")[1] != TRACE_ID and parse_traceparent(made) is not None


def test_the_tracestate_stays_with_a_kept_traceparent_only(client):
    c, _ = client
    app_headers = {}

    @c.app.get("/state")
    async def state(request: __import__("fastapi").Request):
        app_headers.update(traceparent=request.headers.getlist("traceparent"),
                           tracestate=request.headers.get("tracestate"))
        return {}

    c.get("/state", headers={"traceparent": f"00-{TRACE_ID}-{SPAN_ID}-01", "tracestate": "vendor=1"})
    assert app_headers == {"traceparent": [f"00-{TRACE_ID}-{SPAN_ID}-01"], "tracestate": "vendor=1"}
    c.get("/state", headers={"traceparent": f"00-{TRACE_ID.upper()}-{SPAN_ID}-01", "tracestate": "vendor=1"})
    assert len(app_headers["traceparent"]) == 1 and app_headers["tracestate"] is None


def test_of_several_traceparent_headers_the_first_counts_and_one_goes_on(client):
    c, seen = client
    first, second = f"00-{TRACE_ID}-{SPAN_ID}-01", f"00-{new_trace_id()}-{new_span_id()}-01"
    r = c.get("/echo", headers=[("traceparent", first), ("traceparent", second)])
    assert r.headers["traceresponse"] == first == seen["header"]


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
