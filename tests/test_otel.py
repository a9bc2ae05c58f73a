"""exporters/otel.py: spans through the real OTLP wire (HTTP/protobuf and gRPC) to a loopback receiver."""

import io
import json
import math
import os
import time

import numpy as np
import pytest
from synthetic import make_record

from attn_otel.config import Config
from attn_otel.exporters import ExportItem, build_exporters
from attn_otel.exporters import otel
from attn_otel.ids import new_span_id
from attn_otel.metrics import summarize

PROMPT_TEXT = "the launch code is swordfish-4711"


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch):
    """Each test states the OTEL_* variables it wants; nothing leaks in from the shell or other tests."""
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)


def _use(monkeypatch, receiver, protocol="http/protobuf"):
    endpoint = receiver.http_endpoint if protocol == "http/protobuf" else receiver.grpc_endpoint
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)


def _item(parent=True, maps=True, prompt_len=8, T=12, uri="file:///tmp/store/traces/x/req-1", **kw):
    record, _ = make_record(maps=maps, prompt_len=prompt_len, T=T, created=time.time() - 0.25, **kw)
    record.parent_span_id = new_span_id() if parent else None
    record.engine_version = "0.32.0"
    return ExportItem(record, latency_s=0.125, uri=uri)


def _export(item, store="/tmp/store"):
    exporter = otel.from_config(Config(store=store))
    assert exporter is not None
    exporter.export(item)
    exporter.shutdown()  # flushes: the span is on the wire when this returns


def _received(receiver, item):
    (span,) = receiver.wait_for(lambda s: s.trace_id == item.record.trace_id, timeout=10)
    return span


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_span_is_child_of_traceparent_with_record_ids(otlp_receiver, monkeypatch, protocol):
    _use(monkeypatch, otlp_receiver, protocol)
    item = _item()
    _export(item)
    span = _received(otlp_receiver, item)
    rec = item.record
    assert span.transport == protocol.split("/")[0]
    assert span.name == "attn_capture"
    assert (span.trace_id, span.parent_span_id, span.span_id) == (rec.trace_id, rec.parent_span_id, rec.span_id)
    assert span.proto.start_time_unix_nano == int(rec.created * 1e9)
    assert span.proto.start_time_unix_nano < span.proto.end_time_unix_nano <= time.time_ns()
    assert span.resource["service.name"] == "attn-otel"


def test_span_attributes(otlp_receiver, monkeypatch):
    _use(monkeypatch, otlp_receiver)
    item = _item(layers=(3, 7, 11))
    _export(item, store="s3://bucket/attn")
    rec = item.record
    assert _received(otlp_receiver, item).attributes == {
        "attn_otel.store_uri": item.uri,
        "attn_otel.request_id": "req-1",
        "attn_otel.layers": [3, 7, 11],
        "attn_otel.num_layers": 3,
        "attn_otel.num_heads": 2,
        "attn_otel.tokens.prompt": 8,
        "attn_otel.tokens.generated": 4,
        "attn_otel.tokens.total": 12,
        "attn_otel.model": "synthetic",
        "attn_otel.engine_version": "0.32.0",
        "attn_otel.mode": "maps",
        "attn_otel.maps_stored": True,
        "attn_otel.capture_latency_s": 0.125,
        "attn_otel.sink_tokens": 4,
        "attn_otel.vision": False,
        "attn_otel.fetch_command": f"attn-otel show {rec.trace_id} --layer 3 --request req-1 --store s3://bucket/attn",
        "attn_otel.view_url": f"/attn-otel/view/{rec.trace_id}?request=req-1",
    }


def test_the_view_url_sits_beside_the_fetch_command(otlp_receiver, monkeypatch):
    """ATTN_OTEL_VIEW_URL: the capture's page in the viewer that vLLM's API server serves (docs/viewer.md)."""
    _use(monkeypatch, otlp_receiver)
    item = _item(request_id="req 1/ä")
    exporter = otel.from_config(Config(store="/tmp/store", view_url="http://vllm-host:8000"))
    exporter.export(item)
    exporter.shutdown()
    attrs = _received(otlp_receiver, item).attributes
    assert attrs["attn_otel.view_url"] == \
        f"http://vllm-host:8000/attn-otel/view/{item.record.trace_id}?request=req%201%2F%C3%A4"
    assert "attn_otel.fetch_command" in attrs


def test_a_capture_the_store_did_not_keep_has_no_view_url(otlp_receiver, monkeypatch):
    _use(monkeypatch, otlp_receiver)
    item = _item(uri=None)
    _export(item)
    assert "attn_otel.view_url" not in _received(otlp_receiver, item).attributes


@pytest.mark.parametrize("reason", ["stop", "length", "abort"])
def test_the_finish_reason_is_a_span_attribute(otlp_receiver, monkeypatch, reason):
    _use(monkeypatch, otlp_receiver)
    item = _item()
    item.record.attrs["finish_reason"] = reason
    _export(item)
    assert _received(otlp_receiver, item).attributes["attn_otel.finish_reason"] == reason


def test_metrics_only_capture_points_at_metrics_command(otlp_receiver, monkeypatch):
    _use(monkeypatch, otlp_receiver)
    item = _item(maps=False)
    _export(item)
    attrs = _received(otlp_receiver, item).attributes
    assert attrs["attn_otel.mode"] == "metrics" and attrs["attn_otel.maps_stored"] is False
    assert attrs["attn_otel.fetch_command"] == f"attn-otel metrics {item.record.trace_id} --request req-1 --store /tmp/store"


def test_store_failure_means_no_uri_and_no_maps_stored(otlp_receiver, monkeypatch):
    _use(monkeypatch, otlp_receiver)
    item = _item(uri=None)  # the Zarr exporter failed before this one ran
    _export(item)
    attrs = _received(otlp_receiver, item).attributes
    assert "attn_otel.store_uri" not in attrs and attrs["attn_otel.maps_stored"] is False


def test_one_event_per_layer_equal_to_summarize(otlp_receiver, monkeypatch):
    _use(monkeypatch, otlp_receiver)
    item = _item(layers=(0, 5, 9), T=16, prompt_len=10)
    _export(item)
    span = _received(otlp_receiver, item)
    expected = summarize(item.record.metrics, item.record.prompt_len)
    assert [(name, attrs["attn_otel.layer"]) for name, _, attrs in span.events] == [
        ("attn_otel.layer", 0), ("attn_otel.layer", 5), ("attn_otel.layer", 9)]
    for i, (_, when, attrs) in enumerate(span.events):
        assert when == span.proto.start_time_unix_nano
        want = {f"{part}.{name}": float(stats["layer_mean"][i]) for part, metrics in expected.items()
                for name, stats in metrics.items() if stats is not None}
        assert want.keys() >= {"prompt.entropy_norm", "generated.entropy_norm", "generated.lookback_ratio"}
        assert {k: v for k, v in attrs.items() if k != "attn_otel.layer"} == want
        assert all(isinstance(v, float) and math.isfinite(v) for k, v in attrs.items() if k != "attn_otel.layer")


def test_undefined_values_are_left_out(otlp_receiver, monkeypatch):
    _use(monkeypatch, otlp_receiver)
    item = _item(T=10, prompt_len=10)  # no generated rows: every generated.* mean is NaN
    item.record.metrics["entropy"][1] = np.nan  # and layer 3's prompt entropy is undefined too
    _export(item)
    events = [attrs for _, _, attrs in _received(otlp_receiver, item).events]
    assert len(events) == 2 and "prompt.entropy" in events[0] and "prompt.entropy" not in events[1]
    assert all(not k.startswith("generated.") for attrs in events for k in attrs)
    assert all("vision" not in k for attrs in events for k in attrs)  # a text request has no vision metrics
    assert events[1]["prompt.entropy_norm"] == pytest.approx(
        float(np.mean(np.nanmean(item.record.metrics["entropy_norm"][1].astype(np.float64), axis=-1))))


def test_root_span_in_the_captures_trace_without_traceparent(otlp_receiver, monkeypatch):
    _use(monkeypatch, otlp_receiver)
    item = _item(parent=False)
    _export(item)
    span = _received(otlp_receiver, item)
    assert (span.trace_id, span.span_id, span.parent_span_id) == (item.record.trace_id, item.record.span_id, "")


def test_a_client_that_did_not_sample_its_trace_gets_no_capture_span(otlp_receiver, monkeypatch):
    """W3C ``-00``: the SDK's parent-based sampler drops the capture span; a sampled sibling still goes."""
    _use(monkeypatch, otlp_receiver)
    unsampled, sampled = _item(), _item()
    unsampled.record.sampled = False
    exporter = otel.from_config(Config(store="/tmp/store"))
    exporter.export(unsampled)
    exporter.export(sampled)
    exporter.shutdown()
    _received(otlp_receiver, sampled)
    assert otlp_receiver.find(lambda s: s.trace_id == unsampled.record.trace_id) == []


def test_no_prompt_text_on_the_wire(otlp_receiver, monkeypatch):
    _use(monkeypatch, otlp_receiver)
    item = _item()
    item.record.attrs["prompt"] = PROMPT_TEXT  # whatever the capture carries, only listed fields leave
    _export(item)
    _received(otlp_receiver, item)
    wire = otlp_receiver.raw_bytes()
    assert item.record.trace_id.encode() in wire  # the attributes are in these bytes as plain text ...
    assert PROMPT_TEXT.encode() not in wire and b"swordfish" not in wire  # ... and the prompt is not


def test_service_name_from_the_environment(otlp_receiver, monkeypatch):
    _use(monkeypatch, otlp_receiver)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "inference-eu")
    item = _item()
    _export(item)
    assert _received(otlp_receiver, item).resource["service.name"] == "inference-eu"


def test_traces_endpoint_variable_is_used_as_given(otlp_receiver, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", otlp_receiver.http_endpoint + "/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    item = _item()
    _export(item)
    assert _received(otlp_receiver, item).transport == "http"


def test_grpc_is_the_default_protocol(otlp_receiver, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp_receiver.grpc_endpoint)
    item = _item()
    _export(item)
    assert _received(otlp_receiver, item).transport == "grpc"


def test_provider_passed_in(otlp_receiver):
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider(id_generator=otel.RecordIdGenerator())
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(otlp_receiver.http_endpoint + "/v1/traces")))
    item = _item()
    exporter = otel.OtelExporter(provider)
    exporter.export(item)
    span = _received(otlp_receiver, item)
    assert span.span_id == item.record.span_id and "--store" not in span.attributes["attn_otel.fetch_command"]
    exporter.shutdown()
    # The caller owns the provider: the exporter flushed it but did not shut it down.
    other = provider.get_tracer("t").start_span("after")
    other.end()
    assert otlp_receiver.wait_for(lambda s: s.name == "after" and s.trace_id == other.get_span_context()
                                  .trace_id.to_bytes(16, "big").hex(), timeout=10)


@pytest.mark.parametrize("env", [
    {},  # no endpoint: off, so a default install does not log connection errors
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_TRACES_EXPORTER": "none"},
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_SDK_DISABLED": "true"},
    {"OTEL_TRACES_EXPORTER": "zipkin"},
], ids=["no-endpoint", "exporter-none", "sdk-disabled", "unsupported-exporter"])
def test_off(monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert otel.from_config(Config()) is None
    assert [e.name for e in build_exporters(Config()).exporters] in (["zarr"], ["zarr", "prometheus"])


@pytest.mark.parametrize("env", [{"OTEL_TRACES_EXPORTER": "otlp"}, {"OTEL_TRACES_EXPORTER": "console"},
                                 {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9/v1/traces"}])
def test_on(monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    exporters = build_exporters(Config()).exporters
    try:
        assert "otel" in [e.name for e in exporters]
    finally:
        for e in exporters:
            if e.name == "otel":
                e.tracer_provider.shutdown()  # nothing exported: nothing to send to the closed port


def test_bad_protocol_turns_the_exporter_off_not_the_store(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json"):
        otel.from_config(Config())
    assert [e.name for e in build_exporters(Config()).exporters][0] == "zarr"


def test_writer_process_loop_sends_the_span_and_flushes_at_eof(otlp_receiver, monkeypatch, tmp_path):
    """attn_otel.writer_proc.serve, fed as the engine feeds it (shared memory + one JSON line), then EOF."""
    from multiprocessing import shared_memory

    from attn_otel.writer_proc import serve

    _use(monkeypatch, otlp_receiver)
    record, _ = make_record(maps=False, layers=(2, 4))
    record.parent_span_id = new_span_id()
    names = sorted(record.metrics)
    per_row = np.stack([record.metrics[n] for n in names]).astype(np.float32)
    shm = shared_memory.SharedMemory(create=True, size=per_row.nbytes)
    try:
        np.ndarray(per_row.shape, per_row.dtype, buffer=shm.buf)[...] = per_row
        meta = {k: getattr(record, k) for k in ("trace_id", "request_id", "span_id", "parent_span_id",
                                                "prompt_len", "num_tokens", "num_heads", "model",
                                                "engine_version", "mode", "created", "attrs")}
        meta["layers"] = list(record.layers)
        msg = {"id": 1, "shm": shm.name, "record": meta, "arrays": {"per_row": [0, list(per_row.shape), "float32"]},
               "metrics": {n: i for i, n in enumerate(names)}, "latency_s": 0.5}
        out = io.StringIO()
        serve(str(tmp_path / "store"), stdin=io.StringIO(json.dumps(msg) + "\n"), stdout=out)
    finally:
        shm.close()
        shm.unlink()
    reply = json.loads(out.getvalue())
    assert reply["ok"] and reply["errors"] == {}
    (span,) = otlp_receiver.find(lambda s: s.trace_id == record.trace_id)  # no wait: EOF flushed it
    assert span.parent_span_id == record.parent_span_id and len(span.events) == 2
    assert span.attributes["attn_otel.capture_latency_s"] == 0.5
    assert span.attributes["attn_otel.store_uri"].startswith(str(tmp_path / "store"))
    assert span.attributes["attn_otel.store_uri"].endswith(f"traces/{record.trace_id}/req-1")


def test_concurrent_exports_keep_their_own_ids(otlp_receiver, monkeypatch):
    """Exports on one provider from several threads at once: each span gets its own capture's ids."""
    import threading

    _use(monkeypatch, otlp_receiver)
    exporter = otel.from_config(Config())
    items = [_item(parent=bool(i % 2)) for i in range(8)]
    threads = [threading.Thread(target=exporter.export, args=(it,)) for it in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    exporter.shutdown()
    for it in items:
        span = _received(otlp_receiver, it)
        assert (span.span_id, span.parent_span_id) == (it.record.span_id, it.record.parent_span_id or "")
