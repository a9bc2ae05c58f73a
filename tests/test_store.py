"""The store contract: every backend (a local folder, ``s3://`` on a real S3 HTTP endpoint) passes the same
tests, as zarr's own ``StoreTests`` do.  Each test gets a fresh store (a new folder, a new bucket)."""

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import synthetic
from synthetic import CountingStore, OpsStore, big_record, make_record, write

from attn_otel.ids import InvalidTraceId, new_trace_id
from attn_otel.metrics import summarize, summary_to_array
from attn_otel.reader import TraceNotFound, list_captures, open_trace
from attn_otel.store import (FORMAT_VERSION, MARKER, ROWS_PER_CHUNK, StoreError, capture_prefix, list_trace_ids,
                             open_zarr_store, write_capture)

FP16_ATOL = 5e-4  # weights are in [0, 1]: float16 keeps 11 significant bits
# Captures the format-2 store wrote (attn_otel.store at FORMAT_VERSION 2), kept to prove they stay readable:
# a maps capture with per-row metrics, token ids and a vision mask, and a summary-only capture.
FORMAT2_STORE = Path(__file__).resolve().parent / "data" / "format2-store"
FORMAT2_MAPS_TRACE = "0af7651916cd43dd8448eb211c80319c"
FORMAT2_METRICS_TRACE = "b7ad6b7169203331a3a2d4e1f0c9e8d7"


def _marker(record) -> str:
    return f"{capture_prefix(record.trace_id, record.request_id)}/{MARKER}"


class StoreContract:
    """Subclasses provide a ``backend`` fixture: ``url``, ``missing_url``, ``keys()``, ``put()``, ``delete()``."""

    def test_maps_read_back_equal_within_float16(self, backend):
        record, expected = make_record()
        write(backend.url, record)
        (cap,) = open_trace(record.trace_id, backend.url)
        np.testing.assert_allclose(cap.maps(), expected, atol=FP16_ATOL, rtol=0)

    def test_maps_read_back_are_causal_and_row_stochastic(self, backend):
        record, _ = make_record(T=20)
        write(backend.url, record)
        maps = open_trace(record.trace_id, backend.url)[0].maps()
        future = np.triu(np.ones((20, 20), dtype=bool), k=1)
        assert np.all(maps[..., future] == 0)
        np.testing.assert_allclose(maps.sum(axis=-1), 1.0, atol=20 * FP16_ATOL)

    def test_metadata_reads_back(self, backend):
        record, _ = make_record(layers=(2, 5, 9), heads=3, T=10, prompt_len=7)
        write(backend.url, record)
        (cap,) = open_trace(record.trace_id, backend.url)
        assert (cap.layers, cap.num_heads, cap.num_tokens, cap.prompt_len) == ([2, 5, 9], 3, 10, 7)
        assert cap.request_id == record.request_id
        np.testing.assert_array_equal(cap.token_ids, record.token_ids)

    def test_maps_select_model_layers_and_heads(self, backend):
        record, expected = make_record(layers=(2, 5, 9), heads=3)
        write(backend.url, record)
        (cap,) = open_trace(record.trace_id, backend.url)
        np.testing.assert_allclose(cap.maps(layers=[9, 2], heads=[1]), expected[[2, 0]][:, [1]], atol=FP16_ATOL,
                                   rtol=0)
        # runs of consecutive layers and heads are read at once: runs, breaks, a repeat and a reversal
        for layers, heads in (([2, 5], [0, 1, 2]), ([5, 9, 2], [2, 0, 1]), ([9, 9], [1, 2, 2, 1, 0]), (None, None)):
            li = [(2, 5, 9).index(x) for x in layers] if layers else [0, 1, 2]
            hi = heads if heads else [0, 1, 2]
            np.testing.assert_allclose(cap.maps(layers=layers, heads=heads), expected[li][:, hi], atol=FP16_ATOL,
                                       rtol=0)

    def test_lazy_attn_slices_a_band_of_rows(self, backend):
        record, expected = make_record(T=16)
        write(backend.url, record)
        band = open_trace(record.trace_id, backend.url)[0].attn[1, 0, 4:9]
        np.testing.assert_allclose(band, expected[1, 0, 4:9], atol=FP16_ATOL, rtol=0)

    def test_capture_without_marker_is_invisible(self, backend):
        record, _ = make_record()
        write(backend.url, record)
        backend.delete(_marker(record))
        with pytest.raises(TraceNotFound):
            open_trace(record.trace_id, backend.url)

    def test_incomplete_capture_is_left_out_of_the_listing(self, backend):
        done, _ = make_record(request_id="done")
        half, _ = make_record(request_id="half")
        write(backend.url, done)
        write(backend.url, half)
        backend.delete(_marker(half))
        assert [c.request_id for c in list_captures(backend.url)] == ["done"]

    def test_unreadable_marker_is_a_store_error_naming_the_object(self, backend):
        record, _ = make_record()
        write(backend.url, record)
        backend.put(_marker(record), b"{not json")
        with pytest.raises(StoreError, match=_marker(record)):
            open_trace(record.trace_id, backend.url)

    def test_marker_missing_fields_is_a_store_error(self, backend):
        record, _ = make_record()
        write(backend.url, record)
        backend.put(_marker(record), json.dumps({"format": 1, "trace_id": record.trace_id}).encode())
        with pytest.raises(StoreError, match="request_id"):
            open_trace(record.trace_id, backend.url)

    def test_format_1_and_2_captures_stay_readable_and_say_so(self, backend):
        """Captures written by the format-2 store (tests/data/format2-store, from before format 3 moved the
        per-row metrics beside attn) read back as written; format 1 is format 2's layout whose lookback
        ratio had another definition: read as stored, and it says its format.  The store writes format 3;
        a format this reader does not know is refused."""
        for path in sorted(FORMAT2_STORE.rglob("*")):
            if path.is_file():
                backend.put(path.relative_to(FORMAT2_STORE).as_posix(), path.read_bytes())
        expected = np.load(FORMAT2_STORE.parent / "format2-expected.npz")
        (maps,) = open_trace(FORMAT2_MAPS_TRACE, backend.url)
        assert (maps.format, maps.layers, maps.num_heads, maps.num_tokens, maps.prompt_len) == (2, [0, 3], 2, 12, 8)
        np.testing.assert_array_equal(maps.maps(), expected["a_maps"].astype(np.float32))
        np.testing.assert_array_equal(maps.token_ids, expected["a_token_ids"])
        np.testing.assert_array_equal(maps.vision_mask, expected["a_vision"])
        assert sorted(maps.metrics) == sorted(k.removeprefix("a_metric_") for k in expected
                                              if k.startswith("a_metric_"))
        for name, value in maps.metrics.items():
            np.testing.assert_array_equal(value, expected[f"a_metric_{name}"])
        (summary_only,) = open_trace(FORMAT2_METRICS_TRACE, backend.url)
        assert (summary_only.format, summary_only.has_maps, summary_only.has_row_metrics) == (2, False, False)
        b_metrics = {k.removeprefix("b_metric_"): expected[k] for k in expected if k.startswith("b_metric_")}
        np.testing.assert_allclose(summary_to_array(summary_only.summary(), 3, 3),
                                   summary_to_array(summarize(b_metrics, 6), 3, 3), rtol=1e-6)
        marker = f"traces/{FORMAT2_MAPS_TRACE}/req-maps/{MARKER}"
        backend.put(marker, json.dumps({**maps.meta, "format": 1}).encode())
        (old,) = open_trace(FORMAT2_MAPS_TRACE, backend.url)
        assert old.format == 1
        np.testing.assert_array_equal(old.metrics["lookback_ratio"], expected["a_metric_lookback_ratio"])
        record, _ = make_record()
        write(backend.url, record)
        (cap,) = open_trace(record.trace_id, backend.url)
        assert cap.format == FORMAT_VERSION == 3
        backend.put(_marker(record), json.dumps({**cap.meta, "format": 4}).encode())
        with pytest.raises(StoreError, match="unknown format"):
            open_trace(record.trace_id, backend.url)

    def test_metrics_only_capture_has_no_attn(self, backend):
        record, _ = make_record(maps=False)
        write(backend.url, record)
        (cap,) = open_trace(record.trace_id, backend.url)
        assert cap.attn is None
        np.testing.assert_array_equal(cap.metrics["entropy"], record.metrics["entropy"])

    def test_metrics_only_capture_refuses_maps(self, backend):
        record, _ = make_record(maps=False)
        write(backend.url, record)
        with pytest.raises(LookupError, match="metrics only"):
            open_trace(record.trace_id, backend.url)[0].maps()

    def test_captures_of_a_trace_come_oldest_first(self, backend):
        trace_id = new_trace_id()
        write(backend.url, make_record(trace_id, "later", created=2_000_000_000.0)[0])
        write(backend.url, make_record(trace_id, "earlier", created=1_000_000_000.0)[0])
        assert [c.request_id for c in open_trace(trace_id, backend.url)] == ["earlier", "later"]

    def test_hostile_request_id_stays_inside_its_trace(self, backend):
        record, _ = make_record(request_id="../../../escaped")
        write(backend.url, record)
        assert backend.outside_keys() == []
        markers = [k for k in backend.keys() if k.endswith(f"/{MARKER}")]
        assert len(markers) == 1 and markers[0].startswith(f"traces/{record.trace_id}/")
        assert markers[0].count("/") == 3  # traces/{trace}/{key}/COMPLETE: the key is one path segment
        assert open_trace(record.trace_id, backend.url)[0].request_id == "../../../escaped"

    def test_malformed_trace_id_is_refused_before_the_store_is_touched(self, backend):
        # The store is missing: touching it first would raise StoreError instead.
        with pytest.raises(InvalidTraceId):
            open_trace("../../etc", backend.missing_url)

    def test_missing_store_is_a_store_error_naming_it(self, backend):
        with pytest.raises(StoreError, match="does not exist") as err:
            open_trace(new_trace_id(), backend.missing_url)
        assert backend.missing_name in str(err.value)

    def test_missing_store_is_an_error_for_listing_too(self, backend):
        with pytest.raises(StoreError, match="does not exist"):
            list(list_captures(backend.missing_url))

    def test_foreign_names_under_traces_are_not_listed(self, backend):
        record, _ = make_record()
        write(backend.url, record)
        backend.put("traces/not-a-trace/zarr.json", b"{}")
        assert list_trace_ids(open_zarr_store(backend.url, read_only=True)) == [record.trace_id]

    def test_trace_group_metadata_is_not_a_request(self, backend):
        record, _ = make_record()
        write(backend.url, record)
        assert f"traces/{record.trace_id}/zarr.json" in backend.keys()  # zarr writes the parent group
        assert [c.request_id for c in open_trace(record.trace_id, backend.url)] == [record.request_id]

    def test_a_capture_written_by_another_process_shows_up_for_a_long_lived_reader(self, backend):
        first, _ = make_record()
        write(backend.url, first)
        assert len(list(list_captures(backend.url))) == 1
        trace_id = new_trace_id()
        subprocess.run([sys.executable, synthetic.__file__, backend.url, trace_id, "req-other"], check=True,
                       capture_output=True, timeout=120)
        assert sorted(c.trace_id for c in list_captures(backend.url)) == sorted([first.trace_id, trace_id])
        assert open_trace(trace_id, backend.url)[0].request_id == "req-other"

    def test_open_trace_takes_a_store_instance(self, backend):
        record, expected = make_record()
        write(backend.url, record)
        store = CountingStore(open_zarr_store(backend.url, read_only=True))
        (cap,) = open_trace(record.trace_id, store)
        np.testing.assert_allclose(cap.attn[1, 1], expected[1, 1], atol=FP16_ATOL, rtol=0)
        assert [c.trace_id for c in list_captures(store)] == [record.trace_id]
        assert store.reads  # the reads went through the instance given

    def test_a_capture_is_put_object_by_object_without_reading_the_store(self, backend):
        """A writer's requests are its objects' puts, each once, the marker last: zarr's create calls look
        before they write (on S3 a metrics capture cost 101 HEAD and 62 GET requests beside its 25 PUTs).  The
        parents' group documents are created only where missing, and looked at once a process per store."""
        store = OpsStore(open_zarr_store(backend.url))
        first, _ = make_record(request_id="req-1")
        write_capture(store, first)
        looked = [op for op in store.ops if op[0] != "set"]
        assert looked and all(op[0] == "set_if_not_exists" for op in looked), looked  # the parents, and only so
        for maps in (True, False):  # the same trace, the same store: nothing but puts
            store.ops.clear()
            record, expected = make_record(first.trace_id, f"req-maps-{maps}", maps=maps, seed=3)
            write_capture(store, record)
            prefix = capture_prefix(record.trace_id, record.request_id)
            assert {op for op, _ in store.ops} == {"set"}, store.ops
            keys = [k for _, k in store.ops]
            assert len(keys) == len(set(keys)) and keys[-1] == f"{prefix}/{MARKER}"  # each object once, marker last
            assert sorted(backend.keys(prefix + "/")) == sorted(keys)
            (cap,) = [c for c in open_trace(record.trace_id, backend.url) if c.request_id == record.request_id]
            assert cap.has_maps == maps
            if maps:
                np.testing.assert_allclose(cap.attn[1, 1], expected[1, 1], atol=FP16_ATOL, rtol=0)
            np.testing.assert_array_equal(cap.metrics["entropy"], record.metrics["entropy"])
        assert len(open_trace(first.trace_id, backend.url)) == 3

    # --- chunking: a reader fetches one layer+head, or one band of query rows, and nothing else ----------

    T_LONG = 1500

    @pytest.fixture
    def long_capture(self, backend):
        record = big_record(new_trace_id(), "long", layers=2, heads=2, T=self.T_LONG)
        write(backend.url, record)
        store = CountingStore(open_zarr_store(backend.url, read_only=True))
        (cap,) = open_trace(record.trace_id, store)
        assert cap.attn.shape == (2, 2, self.T_LONG, self.T_LONG)
        store.reads.clear()
        return cap, store, record

    @staticmethod
    def _chunk_reads(store, cap) -> Counter:
        return Counter({k: n for k, n in store.reads.items() if k.startswith(f"{cap.prefix}/attn/c/")})

    def test_one_layer_and_head_reads_one_chunk_per_band_of_rows(self, long_capture):
        cap, store, record = long_capture
        head = cap.attn[1, 0]
        chunks = self._chunk_reads(store, cap)
        assert len(chunks) == math.ceil(self.T_LONG / ROWS_PER_CHUNK) == 6
        assert set(chunks) == {f"{cap.prefix}/attn/c/1/0/{band}/0" for band in range(6)}
        assert all(n == 1 for n in chunks.values())
        assert set(store.reads) - set(chunks) <= {f"{cap.prefix}/attn/zarr.json"}  # metadata, nothing else
        np.testing.assert_array_equal(head, record.maps[1, 0])

    def test_a_band_of_rows_reads_one_chunk(self, long_capture):
        cap, store, record = long_capture
        band = cap.attn[0, 1, 300:400]
        assert self._chunk_reads(store, cap) == Counter({f"{cap.prefix}/attn/c/0/1/1/0": 1})  # rows 256..511
        assert set(store.reads) - {f"{cap.prefix}/attn/c/0/1/1/0"} <= {f"{cap.prefix}/attn/zarr.json"}
        np.testing.assert_array_equal(band, record.maps[0, 1, 300:400])


class TestLocalStore(StoreContract):
    @pytest.fixture
    def backend(self, local_backend):
        return local_backend


class TestS3Store(StoreContract):
    @pytest.fixture
    def backend(self, s3_backend):
        return s3_backend


def test_unsupported_store_url_is_a_store_error():
    with pytest.raises(StoreError, match="unsupported store URL"):
        open_zarr_store("ftp://example.com/x")
