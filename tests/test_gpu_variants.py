"""Windows, soft-caps and sinks with an fp8 KV cache on an NVIDIA GPU: the maps are what the served model
computed from its fp8 cache.

Run on the lent GPU machine: ``python3 -P -m pytest -m gpu tests/test_gpu_variants.py`` (``TEST_KV_DTYPE``:
fp8 by default, or fp8_e4m3 / fp8_e5m2; ``TEST_ATTENTION_BACKEND``: the backend, else vLLM's pick).  The
tiny Gemma 2 and gpt-oss of tests/variant_models.py, served as tests/test_engine_variants.py serves them.
Where attn-otel keeps a layer's keys itself (the map layers' Q/K tap; since 2026-11-26 also the K-only tap of
windowed layers streamed by a full-attention group's slots) it rounds them to the cache's fp8 format as vLLM's
cache write does, so that each maps capture's check (``ATTN_OTEL_VERIFY``: maps times the values, rounded the
same way, against the layer's own output) holds within fp8's precision.  Not run on an H100 since the windowed
layers moved to the stream (their per-row metrics under fp8 are then the stream kernel's).
The distance to HF eager float32 is reported beside it: there fp8's rounding is the model's own numerics."""

import json
import os

import numpy as np
import pytest
from reference import check_reconstruction, hf_attention, row_tv
from test_engine_variants import serve, stats
from variant_models import WINDOW, build_gemma2, build_gptoss

import attn_otel

pytestmark = pytest.mark.gpu
KV_DTYPE = os.environ.get("TEST_KV_DTYPE", "fp8")  # passed to variant_serve.py, never set in os.environ


@pytest.mark.parametrize("which", ["gemma2", "gptoss"])
def test_fp8_variant_maps_reconstruct_the_backends_output(which, tmp_path):
    model = (build_gemma2 if which == "gemma2" else build_gptoss)(tmp_path / "model")
    store, got, _ = serve(tmp_path, model, env={"TEST_KV_DTYPE": KV_DTYPE})
    assert got["captured"] == len(got["requests"]) and not got["dropped"]
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
