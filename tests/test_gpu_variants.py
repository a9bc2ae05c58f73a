"""Windows, soft-caps and sinks with an fp8 KV cache on an NVIDIA GPU: the maps are what the served model
computed from its fp8 cache.

Run on the lent GPU machine: ``python3 -P -m pytest -m gpu tests/test_gpu_variants.py`` (``TEST_KV_DTYPE``:
fp8 by default, or fp8_e4m3 / fp8_e5m2; ``TEST_ATTENTION_BACKEND``: the backend, else vLLM's pick).  The
tiny Gemma 2 and gpt-oss of tests/variant_models.py, served as tests/test_engine_variants.py serves them.
Where attn-otel keeps a layer's keys itself (the map layers' Q/K tap; since 2026-11-26 also the K-only tap of
windowed layers streamed by a full-attention group's slots) it rounds them to the cache's fp8 format as vLLM's
cache write does, so that each maps capture's check (``ATTN_OTEL_VERIFY``: maps times the values, rounded the
same way, against the layer's own output) holds within fp8's precision.  Every layer is streamed, so
test_fp8_streamed_metrics_match_the_backends_own_maps checks the stream kernel's per-row metrics under fp8
against NumPy's on the maps that passed that check (docs/support.md has the H100 figures; vLLM 0.26 does not
serve fp8_e5m2 on FLASH_ATTN or TRITON_ATTN at all).
The distance to HF eager float32 is reported beside it: there fp8's rounding is the model's own numerics."""

import json
import os

import numpy as np
import pytest
from reference import METRIC_FLOOR, METRIC_FLOOR_DEFAULT, check_reconstruction, hf_attention, row_tv
from test_engine_variants import BUILD, bf16_attention, serve, stats
from variant_models import WINDOW

import attn_otel

pytestmark = pytest.mark.gpu
KV_DTYPE = os.environ.get("TEST_KV_DTYPE", "fp8")  # passed to variant_serve.py, never set in os.environ


@pytest.fixture(scope="module", params=["gemma2", "gptoss"])
def served(request, tmp_path_factory):
    which = request.param
    tmp = tmp_path_factory.mktemp(which)
    model = BUILD[which](tmp / "model")
    store, got, _ = serve(tmp, model, "--twins", env={"TEST_KV_DTYPE": KV_DTYPE})
    return which, model, store, got


def test_fp8_variant_maps_reconstruct_the_backends_output(served):
    which, model, store, got = served
    assert got["captured"] == len(got["requests"]) + len(got["twins"]) and not got["dropped"]
    assert sorted(s["index"] for s in got["layers"]) == list(range(4 if which == "gemma2" else 2))
    recon, tv = [], {}
    for r in got["requests"]:
        (cap,) = attn_otel.open_trace(r["trace_id"], store=store)
        recon.append(check_reconstruction(cap, kv_dtype=KV_DTYPE))
        ids = r["prompt"] + r["output"]
        T = cap.num_tokens
        maps, ref = cap.maps(), hf_attention(model, ids[:T])
        i, j = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
        for li in range(maps.shape[0]):
            if li % 2 == 0:  # windowed: nothing outside keys i-W+1 .. i
                assert np.abs(maps[li][:, (i - j >= WINDOW) | (j > i)]).max() == 0.0
            tv.setdefault(li, []).append(row_tv(maps[li], ref[li]).ravel())
    report = {"attention_impl": got["attention_impl"], "kv_cache_dtype": KV_DTYPE,
              "reconstruction_worst": {k: max(x[k] for x in recon) for k in ("median", "p99", "max")},
              "reconstruction_bound": recon[0]["bound"],
              "against_hf_fp32": {li: stats(np.concatenate(v)) for li, v in tv.items()}}
    print(f"\n{which} fp8:", json.dumps(report))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"gpu_variants-{which}-{KV_DTYPE}.json"), "w") as f:
            json.dump(report, f, indent=1)


def test_fp8_streamed_metrics_match_the_backends_own_maps(served):
    """Every layer's per-row metrics come from the stream's kernels (windowed layers' keys from the K-only tap,
    rounded to fp8; full layers' from the fp8 cache), not from maps.  Their reference is what the backend
    computed: NumPy's per-row metrics on the maps that passed the maps x V check.

    * A maps capture's own metrics, against its own maps: the same queries and keys through the two paths, so
      they must agree within HF bf16's own drift from HF fp32 on those rows (FACTOR, floors: tests/reference.py),
      with room to spare: a key left in bf16, a window off by one or a sink left out moves rows by far more.
    * The metrics-only captures of the same prompts (the path 99% of requests take: no query kept), against
      those maps over the rows whose tokens agree.  They ran in other batches, partly from the prefix cache, and
      with fp8 queries and keys a bf16 difference of the forward can flip a rounding, so the yardstick there is
      fp8's own distance: the maps' metrics from HF fp32's.  A row of another request or a stale key is off by
      far more."""
    from numpy_metrics import per_row_metrics
    from reference import Calibrated

    which, model, store, got = served
    window = {s["index"]: s["window"] for s in got["layers"]}
    assert sorted(got["streamed"]) == sorted(window), "every layer streamed"
    maps_of = {tuple(r["prompt"]): r for r in got["requests"]}
    own, twin, rows = Calibrated(), Calibrated(), {"own": 0, "twins": 0}

    def compare(cal, group, cap, T, li, ref_m, drift_of, ref_share, drift_share):
        for name, o in ref_m.items():
            g = np.asarray(cap.metrics[name][li][:, :T], np.float64)
            assert np.array_equal(np.isnan(g), np.isnan(o)), (group, name, "NaN where the maps have a value")
            ok = ~np.isnan(o) & ~np.isnan(drift_of[name])
            cal.add(group + name, np.abs(g[ok] - o[ok]), drift_of[name][ok],
                    floor=METRIC_FLOOR.get(name, METRIC_FLOOR_DEFAULT))
        if which == "gptoss":  # the sink's share: 1 - the row sum of the backend's own maps
            share = np.asarray(cap.metrics["learned_sink_mass"][li][:, :T], np.float64)
            cal.add(group + "learned_sink_mass", np.abs(share - ref_share), drift_share)
        else:
            assert "learned_sink_mass" not in cap.metrics

    for t in got["twins"]:
        r = maps_of[tuple(t["prompt"])]
        a, b = r["prompt"] + r["output"], t["prompt"] + t["output"]
        agree = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        (mcap,) = attn_otel.open_trace(r["trace_id"], store=store)
        (tcap,) = attn_otel.open_trace(t["trace_id"], store=store)
        assert mcap.has_maps and not tcap.has_maps and tcap.layers == mcap.layers == sorted(window)
        T = mcap.num_tokens
        Tt = min(agree, T, tcap.num_tokens)  # row i reads tokens 0..i only
        maps = mcap.maps()
        ref, bf = hf_attention(model, a[:T]), bf16_attention(model, a[:T])
        for li in mcap.layers:
            kind = f"{which} {KV_DTYPE} {'windowed' if window[li] else 'full'} "
            m = per_row_metrics(maps[li], mcap.prompt_len, window=window[li])
            hf32 = per_row_metrics(ref[li], mcap.prompt_len, window=window[li])
            hf16 = per_row_metrics(bf[li], mcap.prompt_len, window=window[li])
            sums = 1 - maps[li].sum(-1)
            compare(own, kind, mcap, T, li, m, {k: np.abs(hf16[k] - v) for k, v in hf32.items()}, sums,
                    np.abs(bf[li].sum(-1) - ref[li].sum(-1)))
            cut = {k: v[:, :Tt] for k, v in m.items()}
            compare(twin, kind + "twins ", tcap, Tt, li, cut, {k: np.abs(v[:, :Tt] - hf32[k][:, :Tt]) for k, v in m.items()},
                    sums[:, :Tt], np.abs(sums[:, :Tt] - (1 - ref[li].sum(-1))[:, :Tt]))
        rows["own"] += T
        rows["twins"] += Tt
    assert rows["twins"] >= 8 * 50, f"only {rows} rows compared"
    report = {"own": own.report(), "twins": twin.report()}
    print(f"\n{which} {KV_DTYPE} streamed metrics against the backend's maps:", json.dumps(report))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"gpu_variants-streamed-{which}-{KV_DTYPE}.json"), "w") as f:
            json.dump({"attention_impl": got["attention_impl"], "kv_cache_dtype": KV_DTYPE, "rows": rows,
                       "metrics": report}, f, indent=1)
    own.check(f"{which} {KV_DTYPE} maps captures")
    twin.check(f"{which} {KV_DTYPE} metrics-only captures")
