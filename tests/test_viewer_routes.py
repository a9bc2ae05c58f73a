"""The viewer's routes (attn_otel.viewer_routes) on a FastAPI app, on vLLM's own app with ``--api-key``, and
where the Grafana dashboards link; no engine, no browser (tests/test_viewer_browser.py has one)."""

import argparse
import base64
import html
import json
import re
import zlib

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from synthetic import make_record, write
from test_viewer import CountingStore
from zarr.storage import LocalStore

from attn_otel import server, viewer, viewer_routes
from attn_otel.reader import open_trace

KEY = "sekret-key"


@pytest.fixture
def store(tmp_path):
    return tmp_path / "store"


@pytest.fixture
def captured(store):
    """Layers 0, 3, 7; 3 heads; 300 tokens (two bands of chunk rows), 200 of them prompt."""
    record, _ = make_record(layers=(0, 3, 7), heads=3, T=300, prompt_len=200)
    write(store, record)
    return record


def _client(store, **kw):
    app = FastAPI()
    viewer_routes.install(app, viewer_routes.Viewer(store, **kw))
    return TestClient(app)


def _page_data(text: str) -> dict:
    return json.loads(re.search(r'id="attn-otel-data">(.*?)</script>', text, re.S)[1])


# --- the routes -----------------------------------------------------------------------------------------

def test_the_page_carries_the_capture_and_fetches_its_maps(store, captured):
    r = _client(store).get(f"/attn-otel/view/{captured.trace_id}")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    data = _page_data(r.text)
    assert (data["trace_id"], data["num_tokens"], data["maps"]) == (captured.trace_id, 300, {"source": "served"})
    assert 'type="application/octet-stream"' not in r.text  # no map in the page: each is fetched when shown
    assert "connect-src 'self'" in r.headers["content-security-policy"]


def test_the_capture_route_is_the_pages_data_as_json(store, captured):
    c = _client(store)
    data = c.get(f"/attn-otel/view/{captured.trace_id}/capture").json()
    assert data == _page_data(c.get(f"/attn-otel/view/{captured.trace_id}").text)


@pytest.mark.parametrize("head, heads, mean", [("mean", [], True), ("1", [1], False)])
def test_a_map_is_its_codes(store, captured, head, heads, mean):
    r = _client(store).get(f"/attn-otel/view/{captured.trace_id}/map", params={"layer": 3, "head": head})
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    (cap,) = open_trace(captured.trace_id, store)
    expected = viewer.layer_codes(cap, 1, heads, mean)[viewer.map_id(1, None if mean else 1)]
    np.testing.assert_array_equal(np.frombuffer(zlib.decompress(r.content), dtype=np.uint8), expected)


def test_a_map_reads_only_the_chunks_it_shows_and_once(tmp_path, captured, store):
    counting = CountingStore(LocalStore(str(store), read_only=True))
    c = _client(counting)
    c.get(f"/attn-otel/view/{captured.trace_id}")
    assert not [k for k in counting.reads if "/attn/c/" in k]  # the page reads no map
    for _ in range(2):  # the second time from the server's cache
        assert c.get(f"/attn-otel/view/{captured.trace_id}/map", params={"layer": 7, "head": 2}).status_code == 200
    assert sorted(k.split("/attn/")[1] for k in counting.reads if "/attn/c/" in k) == ["c/2/2/0/0", "c/2/2/1/0"]
    assert all(counting.reads[k] == 1 for k in counting.reads if "/attn/c/" in k)


@pytest.mark.parametrize("path, params, status, message", [
    ("/attn-otel/view/not-a-trace", {}, 400, "not a trace id"),
    ("/attn-otel/view/not-a-trace/map", {"layer": 0}, 400, "not a trace id"),
    ("/attn-otel/view/{unknown}", {}, 404, "no capture of trace"),
    ("/attn-otel/view/{unknown}/capture", {}, 404, "no capture of trace"),
    ("/attn-otel/view/{trace}", {"request": "nope"}, 404, "has no request 'nope'"),
    ("/attn-otel/view/{trace}/map", {"layer": 5, "head": "mean"}, 404, "layer 5 was not captured"),
    ("/attn-otel/view/{trace}/map", {"layer": "x", "head": "mean"}, 400, "layer must be"),
    ("/attn-otel/view/{trace}/map", {"head": "mean"}, 400, "layer must be"),
    ("/attn-otel/view/{trace}/map", {"layer": 0, "head": "3"}, 404, "head 3 does not exist"),
    ("/attn-otel/view/{trace}/map", {"layer": 0, "head": "-1"}, 400, "head must be"),
])
def test_bad_and_unknown_requests_are_clear_errors(store, captured, path, params, status, message):
    path = path.format(trace=captured.trace_id, unknown="0" * 31 + "1")
    r = _client(store).get(path, params=params)
    assert r.status_code == status
    body = r.json()["error"] if path.endswith(("/map", "/capture")) else html.unescape(r.text)  # the page: HTML
    assert message in body


def test_before_any_capture_is_stored_a_trace_is_404(tmp_path):
    r = _client(tmp_path / "not-yet").get(f"/attn-otel/view/{'0' * 31}1")
    assert r.status_code == 404 and "no capture is stored yet" in r.text


def test_the_map_of_a_metrics_only_capture_is_404(store):
    record, _ = make_record(maps=False)
    write(store, record)
    c = _client(store)
    assert c.get(f"/attn-otel/view/{record.trace_id}").status_code == 200  # the page shows its metrics
    r = c.get(f"/attn-otel/view/{record.trace_id}/map", params={"layer": 0, "head": "mean"})
    assert r.status_code == 404 and "metrics only" in r.json()["error"]


def test_a_damaged_capture_is_a_500_that_names_no_path(store, captured):
    for chunk in (store / "traces" / captured.trace_id).rglob("attn/c/0/0/*/0"):
        chunk.write_bytes(b"garbage")
    r = _client(store).get(f"/attn-otel/view/{captured.trace_id}/map", params={"layer": 0, "head": "0"})
    assert r.status_code == 500 and str(store) not in r.text


def test_labels_are_decoded_for_the_servers_own_model_only(store, captured):
    class Tokenizer:
        def batch_decode(self, ids):
            return [f"<{i[0]}>" for i in ids]

    assert _client(store, tokenizer=Tokenizer(), model="synthetic").get(
        f"/attn-otel/view/{captured.trace_id}/capture").json()["labels"][0] == "<100>"
    data = _client(store, tokenizer=Tokenizer(), model="another-model").get(
        f"/attn-otel/view/{captured.trace_id}/capture").json()
    assert (data["label_kind"], data["labels"][0]) == ("ids", "100")


# --- the API key ------------------------------------------------------------------------------------------

def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.mark.parametrize("route", ["", "/capture", "/map?layer=0&head=mean"])
def test_with_an_api_key_every_route_needs_it(store, captured, route):
    c = _client(store, api_keys=[KEY])
    url = f"/attn-otel/view/{captured.trace_id}{route}"
    r = c.get(url)
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic ")
    for header in (f"Bearer {KEY}x", _basic("me", "wrong"), KEY, "Basic !!!"):
        assert c.get(url, headers={"Authorization": header}).status_code == 401, header
    assert c.get(url, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert c.get(url, headers={"Authorization": _basic("anyone", KEY)}).status_code == 200


def test_without_an_api_key_the_routes_are_open(store, captured):
    assert _client(store).get(f"/attn-otel/view/{captured.trace_id}").status_code == 200


@pytest.mark.parametrize("api_key, env, keys", [
    (["a", "b"], "e", ["a", "b"]),  # --api-key wins over VLLM_API_KEY (vLLM's own rule)
    ("a", "e", ["a"]),  # a lone string: one key
    (None, "e", ["e"]),
    (None, "", []),
    ([""], None, []),
])
def test_the_keys_are_vllms(api_key, env, keys):
    args = argparse.Namespace(api_key=api_key)
    assert viewer_routes.api_keys(args, {} if env is None else {"VLLM_API_KEY": env}) == keys


def test_the_endpoint_plugin_installs_the_viewer_with_the_servers_key(store, captured, monkeypatch):
    monkeypatch.setenv("ATTN_OTEL_STORE", str(store))
    app = FastAPI()
    app.state.args = argparse.Namespace(api_key=[KEY], model="/models/synthetic", served_model_name=None,
                                        tokenizer=None)
    plugin = server.EndpointPlugin()
    plugin.attach_router(app)
    plugin.attach_router(app)  # vLLM may load plugins twice: one set of routes
    assert sum(getattr(r, "path", "") == "/attn-otel/view/{trace_id}" for r in app.router.routes) == 1
    c = TestClient(app)
    url = f"/attn-otel/view/{captured.trace_id}"
    assert c.get(url).status_code == 401
    assert c.get(url, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert app.state.attn_otel_viewer.model == "synthetic"  # a local path is cut to its folder's name


def test_grafanas_exemplar_link_reaches_the_viewer(store, captured):
    """grafana/generate.py links each exemplar's trace_id to $attn_otel_url + VIEWER_PATH + TRACE_ID."""
    generate = pytest.importorskip("grafana.generate")
    assert generate.VIEWER_PATH == viewer.VIEW_ROUTE + "/"
    link = generate.VIEWER_LINK.replace("${attn_otel_url:raw}", "").replace("${__value.raw}", captured.trace_id)
    assert _client(store).get(link).status_code == 200


def test_vllms_own_app_guards_the_viewer_with_its_api_key(store, captured, monkeypatch):
    """vLLM's ``build_app`` (no engine needed) with ``--api-key``: its middleware guards only /v1 and the like;
    the viewer's routes check the key themselves."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.openai.api_server import build_app
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from attn_otel import vllm_adapter

    for name, value in {"ATTN_OTEL": "1", "ATTN_OTEL_STORE": str(store), "ATTN_OTEL_STATS_DIR": str(store.parent)}.items():
        monkeypatch.setenv(name, value)
    vllm_adapter._patch_api_server()
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "synthetic", "--api-key", KEY])
    c = TestClient(build_app(args, ("generate",)))  # no lifespan: no engine
    url = f"/attn-otel/view/{captured.trace_id}"
    assert c.get("/v1/models").status_code == 401  # vLLM's own guard, for comparison
    assert c.get(url).status_code == 401
    assert c.get(url, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert c.get(url + "/map?layer=0&head=mean", headers={"Authorization": _basic("me", KEY)}).status_code == 200
