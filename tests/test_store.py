import json

import numpy as np
import pytest
from synthetic import make_record, write

from attn_otel.ids import InvalidTraceId, new_trace_id
from attn_otel.reader import TraceNotFound, list_captures, open_trace
from attn_otel.store import MARKER, StoreError, capture_prefix, list_trace_ids, open_zarr_store

FP16_ATOL = 5e-4  # weights are in [0, 1]: float16 keeps 11 significant bits


@pytest.fixture
def store(tmp_path):
    return tmp_path / "store"


def _marker(store, record):
    return store / capture_prefix(record.trace_id, record.request_id) / MARKER


def test_maps_read_back_equal_within_float16(store):
    record, expected = make_record()
    write(store, record)
    (cap,) = open_trace(record.trace_id, store)
    np.testing.assert_allclose(cap.maps(), expected, atol=FP16_ATOL, rtol=0)


def test_maps_read_back_are_causal_and_row_stochastic(store):
    record, _ = make_record(T=20)
    write(store, record)
    maps = open_trace(record.trace_id, store)[0].maps()
    future = np.triu(np.ones((20, 20), dtype=bool), k=1)
    assert np.all(maps[..., future] == 0)
    np.testing.assert_allclose(maps.sum(axis=-1), 1.0, atol=20 * FP16_ATOL)


def test_metadata_reads_back(store):
    record, _ = make_record(layers=(2, 5, 9), heads=3, T=10, prompt_len=7)
    write(store, record)
    (cap,) = open_trace(record.trace_id, store)
    assert (cap.layers, cap.num_heads, cap.num_tokens, cap.prompt_len) == ([2, 5, 9], 3, 10, 7)
    assert cap.request_id == record.request_id
    np.testing.assert_array_equal(cap.token_ids, record.token_ids)


def test_maps_select_model_layers_and_heads(store):
    record, expected = make_record(layers=(2, 5, 9), heads=3)
    write(store, record)
    (cap,) = open_trace(record.trace_id, store)
    np.testing.assert_allclose(cap.maps(layers=[9, 2], heads=[1]), expected[[2, 0]][:, [1]], atol=FP16_ATOL, rtol=0)


def test_lazy_attn_slices_a_band_of_rows(store):
    record, expected = make_record(T=16)
    write(store, record)
    band = open_trace(record.trace_id, store)[0].attn[1, 0, 4:9]
    np.testing.assert_allclose(band, expected[1, 0, 4:9], atol=FP16_ATOL, rtol=0)


def test_capture_without_marker_is_invisible(store):
    record, _ = make_record()
    write(store, record)
    _marker(store, record).unlink()
    with pytest.raises(TraceNotFound):
        open_trace(record.trace_id, store)


def test_incomplete_capture_is_left_out_of_the_listing(store):
    done, _ = make_record(request_id="done")
    half, _ = make_record(request_id="half")
    write(store, done)
    write(store, half)
    _marker(store, half).unlink()
    assert [c.request_id for c in list_captures(store)] == ["done"]


def test_unreadable_marker_is_a_store_error_naming_the_object(store):
    record, _ = make_record()
    write(store, record)
    _marker(store, record).write_bytes(b"{not json")
    with pytest.raises(StoreError, match=f"{capture_prefix(record.trace_id, record.request_id)}/{MARKER}"):
        open_trace(record.trace_id, store)


def test_marker_missing_fields_is_a_store_error(store):
    record, _ = make_record()
    write(store, record)
    _marker(store, record).write_text(json.dumps({"format": 1, "trace_id": record.trace_id}))
    with pytest.raises(StoreError, match="request_id"):
        open_trace(record.trace_id, store)


def test_metrics_only_capture_has_no_attn(store):
    record, _ = make_record(maps=False)
    write(store, record)
    (cap,) = open_trace(record.trace_id, store)
    assert cap.attn is None
    np.testing.assert_array_equal(cap.metrics["entropy"], record.metrics["entropy"])


def test_metrics_only_capture_refuses_maps(store):
    record, _ = make_record(maps=False)
    write(store, record)
    with pytest.raises(LookupError, match="metrics only"):
        open_trace(record.trace_id, store)[0].maps()


def test_captures_of_a_trace_come_oldest_first(store):
    trace_id = new_trace_id()
    write(store, make_record(trace_id, "later", created=2_000_000_000.0)[0])
    write(store, make_record(trace_id, "earlier", created=1_000_000_000.0)[0])
    assert [c.request_id for c in open_trace(trace_id, store)] == ["earlier", "later"]


def test_hostile_request_id_stays_inside_its_trace(store):
    record, _ = make_record(request_id="../../../escaped")
    write(store, record)
    assert not (store.parent / "escaped").exists()
    markers = list(store.rglob(MARKER))
    assert len(markers) == 1 and markers[0].parent.parent == store / "traces" / record.trace_id
    assert open_trace(record.trace_id, store)[0].request_id == "../../../escaped"


def test_malformed_trace_id_is_refused_before_the_store_is_touched(tmp_path):
    missing = tmp_path / "no-such-store"
    with pytest.raises(InvalidTraceId):
        open_trace("../../etc", missing)
    assert not missing.exists()


def test_missing_store_is_a_store_error(tmp_path):
    with pytest.raises(StoreError, match="does not exist"):
        open_trace(new_trace_id(), tmp_path / "no-such-store")


def test_foreign_names_under_traces_are_not_listed(store):
    record, _ = make_record()
    write(store, record)
    (store / "traces" / "not-a-trace").mkdir()
    assert list_trace_ids(open_zarr_store(store, read_only=True)) == [record.trace_id]


def test_unsupported_store_url_is_a_store_error():
    with pytest.raises(StoreError, match="unsupported store URL"):
        open_zarr_store("ftp://example.com/x")
