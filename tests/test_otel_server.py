"""Online: vLLM's OpenAI server (CPU build) with ATTN_OTEL=1 sends attn_capture spans to a real OTLP receiver.

Two servers, one after the other: configured by the standard ``OTEL_*`` variables alone (OTLP/HTTP), and
configured only by vLLM's own ``--otlp-traces-endpoint`` (gRPC, vLLM's default), whose endpoint attn-otel
then shares.
"""

import json
import os
import shlex
import subprocess
import sys
import urllib.request

import pytest
import vllm_server

import attn_otel
from attn_otel.ids import new_span_id, new_trace_id

pytestmark = pytest.mark.engine
SHARES = ("otel_server",)  # reached through getfixturevalue below (tests/conftest.py: one xdist unit with its users)

PROMPT = "Zanzibar quokka lighthouse recipe, step one:"


def _post(port, body, headers=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status, json.loads(r.read()), dict(r.headers)


@pytest.fixture(scope="module", params=["otel-env", "vllm-flag"])
def server(request, smollm2_path, tmp_path_factory, otlp_receiver):
    if request.param == "otel-env":  # the session's server (tests/conftest.py), shared with test_engine_server.py
        port, store = request.getfixturevalue("otel_server")
        yield request.param, port, store, smollm2_path
        return
    store = tmp_path_factory.mktemp("otel-server-store")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update({"ATTN_OTEL": "1", "ATTN_OTEL_STORE": str(store), "ATTN_OTEL_MAPS_SAMPLE": "0",
                "VLLM_CPU_KVCACHE_SPACE": "1", "OTEL_BSP_SCHEDULE_DELAY": "200"})
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    # no OTEL_* variable: vLLM exports its flag as OTEL_EXPORTER_OTLP_TRACES_ENDPOINT to its engine
    args = ["--otlp-traces-endpoint", otlp_receiver.grpc_endpoint]
    with vllm_server.running(smollm2_path, env, tmp_path_factory.mktemp("otel-server-log") / "server.log",
                             args) as port:
        yield request.param, port, store, smollm2_path


def _capture_span(receiver, trace_id, timeout=90):
    (span,) = receiver.wait_for(lambda s: s.name == "attn_capture" and s.trace_id == trace_id, timeout=timeout)
    return span


def test_span_is_child_of_the_client_traceparent(server, otlp_receiver):
    variant, port, store, model = server
    trace, parent = new_trace_id(), new_span_id()
    status, body, headers = _post(port, {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0},
                                  headers={"traceparent": f"00-{trace}-{parent}-01"})
    assert status == 200
    span = _capture_span(otlp_receiver, trace)
    assert span.parent_span_id == parent
    assert span.transport == ("http" if variant == "otel-env" else "grpc")
    assert span.resource["service.name"] == "attn-otel"
    usage = body["usage"]
    attrs = span.attributes
    assert attrs["attn_otel.tokens.prompt"] == usage["prompt_tokens"]
    assert attrs["attn_otel.tokens.total"] == usage["prompt_tokens"] + usage["completion_tokens"] - 1
    assert attrs["attn_otel.mode"] == "metrics" and attrs["attn_otel.maps_stored"] is False
    assert attrs["attn_otel.store_uri"].startswith(str(store)) and attrs["attn_otel.engine_version"]
    layers = attrs["attn_otel.layers"]
    assert [e[2]["attn_otel.layer"] for e in span.events] == layers and len(layers) >= 1
    assert all(0.0 <= e[2]["prompt.entropy_norm"] <= 1.0 and 0.0 <= e[2]["generated.lookback_ratio"] <= 1.0
               for e in span.events)
    if variant == "vllm-flag":  # vLLM's own request span is in the same trace, under the same parent
        (vllm_span,) = otlp_receiver.wait_for(lambda s: s.trace_id == trace and s.name != "attn_capture")
        assert vllm_span.parent_span_id == parent


def test_without_traceparent_the_traceresponse_names_the_spans_trace(server, otlp_receiver):
    _, port, store, model = server
    status, _, headers = _post(port, {"model": model, "prompt": PROMPT, "max_tokens": 2})
    assert status == 200
    _, trace, parent, _ = headers["traceresponse"].split("-")
    span = _capture_span(otlp_receiver, trace)
    assert (span.trace_id, span.parent_span_id) == (trace, parent)


def test_fetch_command_on_the_span_shows_the_map(server, otlp_receiver, tmp_path):
    _, port, store, model = server
    trace = new_trace_id()
    status, _, _ = _post(port, {"model": model, "prompt": PROMPT, "max_tokens": 3,
                                "vllm_xargs": {"attn_otel": "maps", "attn_otel_layers": "0,29"}},
                         headers={"traceparent": f"00-{trace}-{new_span_id()}-01"})
    assert status == 200
    attrs = _capture_span(otlp_receiver, trace).attributes
    assert attrs["attn_otel.maps_stored"] is True and attrs["attn_otel.layers"] == [0, 29]
    argv = shlex.split(attrs["attn_otel.fetch_command"])
    assert argv[:5] == ["attn-otel", "show", trace, "--layer", "0"]
    png = tmp_path / "map.png"
    out = subprocess.run([sys.executable, "-m", "attn_otel.cli", *argv[1:], "-o", str(png)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_prompt_text_in_what_the_receiver_got(server, otlp_receiver):
    _, port, _, model = server
    trace = new_trace_id()
    _post(port, {"model": model, "prompt": PROMPT, "max_tokens": 2},
          headers={"traceparent": f"00-{trace}-{new_span_id()}-01"})
    _capture_span(otlp_receiver, trace)
    ours = b"".join(raw for raw in otlp_receiver.raw if b"attn_capture" in raw)
    assert trace.encode() in ours
    for needle in (PROMPT, "Zanzibar", "quokka", "lighthouse"):
        assert needle.encode() not in ours
        assert needle.encode("utf-16-le") not in ours


def test_the_spans_view_url_opens_the_capture_in_the_servers_viewer(server, otlp_receiver):
    """ATTN_OTEL_VIEW_URL is unset here: the attribute is the path on the server that made the capture."""
    import zlib

    _, port, store, model = server
    trace = new_trace_id()
    status, _, _ = _post(port, {"model": model, "prompt": PROMPT, "max_tokens": 3,
                                "vllm_xargs": {"attn_otel": "maps", "attn_otel_layers": "0,29"}},
                         headers={"traceparent": f"00-{trace}-{new_span_id()}-01"})
    assert status == 200
    attrs = _capture_span(otlp_receiver, trace).attributes
    path = attrs["attn_otel.view_url"]
    assert path.startswith(f"/attn-otel/view/{trace}?request=") and "attn_otel.fetch_command" in attrs
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60) as r:
        assert r.status == 200 and trace in r.read().decode()
    request = path.split("?", 1)[1]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/attn-otel/view/{trace}/capture?{request}", timeout=60) as r:
        data = json.loads(r.read())
    T = attrs["attn_otel.tokens.total"]
    (cap,) = attn_otel.open_trace(trace, store)  # labels: token ids where the server stores them, else positions
    labels = "positions" if cap.token_ids is None else "tokens"
    assert (data["num_tokens"], data["layers"], data["label_kind"]) == (T, [0, 29], labels)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/attn-otel/view/{trace}/map?layer=29&head=mean&{request}",
                                timeout=60) as r:
        assert len(zlib.decompress(r.read())) == T * (T + 1) // 2
