"""A capture opens in ``xarray.open_zarr`` as one Dataset with named dimensions (layer, head, query, key) and
coordinates (the model's layer numbers, head indices, token positions, the summary's labels), whose values
are the reader's; also when tensor/pipeline-parallel ranks wrote it in parts.  ``Capture.to_xarray()`` gives
the same Dataset, and the same shape for format-2 captures, whose arrays name no dimensions.  The example in
docs/xarray.md runs as written."""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from synthetic import make_record, part_of
from test_parallel import HEADS, LAYERS, _parts
from test_store import FORMAT2_MAPS_TRACE, FORMAT2_METRICS_TRACE, FORMAT2_STORE

import attn_otel
from attn_otel.metrics import PARTS, SUMMARY_METRICS, SUMMARY_STATS, summarize
from attn_otel.store import MARKER, capture_prefix, open_zarr_store, write_capture, write_capture_part


ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "xarray.md"


def _open(store: Path, record) -> "xr.Dataset":
    with warnings.catch_warnings():
        # zarr notes the COMPLETE marker (and parts/) beside the arrays: objects of ours, not of its hierarchy
        warnings.filterwarnings("ignore", message=".*not recognized as a component of a Zarr hierarchy")
        return xr.open_zarr(store / capture_prefix(record.trace_id, record.request_id), consolidated=False)


def _vision(T: int) -> np.ndarray:
    mask = np.zeros(T, dtype=bool)
    mask[2:5] = True
    return mask


def _write(store: Path, **kwargs):
    record, _ = make_record(**kwargs)
    if kwargs.get("vision") is not None:
        record.vision_mask = kwargs["vision"]
    write_capture(open_zarr_store(store), record, summary=summarize(record.metrics, record.prompt_len),
                  rows=record.maps is not None)
    (cap,) = attn_otel.open_trace(record.trace_id, store=store)
    return record, cap


def _assert_matches_the_reader(ds, cap):
    """Dims, coordinates and every value of ``ds`` against what attn_otel's reader returns for ``cap``."""
    L, H, T = len(cap.layers), cap.num_heads, cap.num_tokens
    assert ds.sizes["layer"] == L and ds.sizes["head"] == H and ds.sizes["query"] == ds.sizes["key"] == T
    np.testing.assert_array_equal(ds["layer"].values, cap.layers)  # the model's layer numbers, not 0..L-1
    np.testing.assert_array_equal(ds["head"].values, np.arange(H))
    np.testing.assert_array_equal(ds["query"].values, np.arange(T))
    np.testing.assert_array_equal(ds["key"].values, np.arange(T))
    if cap.has_maps:
        assert ds["attn"].dims == ("layer", "head", "query", "key") and ds["attn"].dtype == np.float16
        np.testing.assert_array_equal(ds["attn"].values, cap.attn[...])
        np.testing.assert_array_equal(ds["attn"].values.astype(np.float32), cap.maps())
    else:
        assert "attn" not in ds
    for name, value in cap.metrics.items():
        assert ds[name].dims == ("layer", "head", "query")
        np.testing.assert_array_equal(ds[name].values, value)
    for name in ("token_ids", "vision_mask"):
        value = getattr(cap, name)
        if value is None:
            assert name not in ds
        else:
            assert ds[name].dims == ("query",)
            np.testing.assert_array_equal(ds[name].values, value)
    assert ds["summary"].dims == ("part", "metric", "stat", "layer", "head")
    assert [str(x) for x in ds["part"].values] == list(PARTS)
    # a capture stored before the learned sink mass was a metric has the first seven
    width = len(SUMMARY_METRICS) if cap.format >= 3 else 7
    assert [str(x) for x in ds["metric"].values] == list(SUMMARY_METRICS[:width])
    assert [str(x) for x in ds["stat"].values] == list(SUMMARY_STATS)
    summary = cap.summary()
    for part in PARTS:
        for metric in SUMMARY_METRICS[:width]:
            stats = summary[part].get(metric)
            got = ds["summary"].sel(part=part, metric=metric, stat="p50").values
            if stats is None:
                assert np.isnan(got).all()
            else:
                np.testing.assert_allclose(got, stats["p50"], rtol=1e-6)


def test_a_capture_opens_in_open_zarr_with_named_dims_and_coords(tmp_path):
    record, cap = _write(tmp_path, layers=(2, 5, 9), heads=3, T=14, prompt_len=9, vision=_vision(14))
    assert cap.format == 3
    ds = _open(tmp_path, record)
    assert set(ds.dims) == {"layer", "head", "query", "key", "part", "metric", "stat"}
    assert set(ds.coords) == set(ds.dims)  # every dimension has its coordinate
    _assert_matches_the_reader(ds, cap)
    # labels select: model layer 9, head 2, the rows of the generated tokens
    band = ds["attn"].sel(layer=9, head=2).sel(query=slice(cap.prompt_len, None))
    np.testing.assert_array_equal(band.values, cap.attn[2, 2, cap.prompt_len:])
    assert ds.attrs["attn_otel"]["trace_id"] == record.trace_id  # the group's attributes


def test_a_metrics_only_capture_opens_with_its_summary(tmp_path):
    record, cap = _write(tmp_path, layers=(0, 4), heads=2, T=10, prompt_len=6, maps=False, token_ids=False)
    assert not cap.has_maps and not cap.has_row_metrics
    ds = _open(tmp_path, record)
    assert set(ds.data_vars) == {"summary"}
    _assert_matches_the_reader(ds, cap)


@pytest.mark.parametrize("layout", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2-pp2"])
def test_a_capture_written_in_parts_opens_as_the_whole(tmp_path, layout):
    whole, _ = make_record(layers=LAYERS, heads=HEADS, T=20, prompt_len=15, seed=7, created=1.0e9)
    store = open_zarr_store(tmp_path)
    markers = [write_capture_part(store, part_record, summary=summarize(part_record.metrics, 15))[1]
               for part_record in (part_of(whole, p) for p in _parts(*layout))]
    assert sum(m is not None for m in markers) == 1
    (cap,) = attn_otel.open_trace(whole.trace_id, store=tmp_path)
    ds = _open(tmp_path, whole)
    _assert_matches_the_reader(ds, cap)
    np.testing.assert_array_equal(ds["attn"].values, whole.maps)


def test_to_xarray_is_open_zarr_of_the_capture(tmp_path):
    record, cap = _write(tmp_path, vision=_vision(12))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # to_xarray keeps zarr's note on COMPLETE to itself
        ds = cap.to_xarray()
    assert ds.attrs["attn_otel"] == cap.meta
    xr.testing.assert_identical(ds.drop_attrs(), _open(tmp_path, record).drop_attrs())


@pytest.mark.parametrize("trace", [FORMAT2_MAPS_TRACE, FORMAT2_METRICS_TRACE])
def test_to_xarray_reads_a_format_2_capture_into_the_same_shape(trace):
    (cap,) = attn_otel.open_trace(trace, store=FORMAT2_STORE)
    assert cap.format == 2
    ds = cap.to_xarray()
    _assert_matches_the_reader(ds, cap)
    with pytest.raises(KeyError, match="dimension_names"):  # why open_zarr itself needs format 3
        xr.open_zarr(FORMAT2_STORE / cap.prefix, consolidated=False)


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_docs_example_runs(tmp_path):
    """Every ```python block of docs/xarray.md, in order, in one interpreter, against a store at
    ./attn-otel-data holding the capture the page names (written by the real store)."""
    blocks = _code_blocks(DOC.read_text())
    assert len(blocks) >= 4
    trace_id = re.search(r'open_trace\("([0-9a-f]{32})"', blocks[0]).group(1)
    _write(tmp_path / "attn-otel-data", trace_id=trace_id, request_id="cmpl-1", layers=(0, 8, 16, 24), heads=4,
           T=24, prompt_len=16)
    script = tmp_path / "example.py"
    script.write_text("\n\n".join(blocks))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    pictures = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pictures, done.stdout
    for name in pictures:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_storage_page_and_readme_link_the_example():
    assert "(xarray.md)" in (ROOT / "docs" / "storage.md").read_text()
    assert "(docs/xarray.md)" in (ROOT / "README.md").read_text()
    assert MARKER in DOC.read_text()  # the page explains zarr's note about the marker
