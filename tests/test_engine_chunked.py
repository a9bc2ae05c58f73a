"""Chunked local attention (Llama 4) on vLLM's CPU build: tests/variant_models.py's random-weight Llama-4-shaped
text model (chunks of 32 with RoPE and QK-norm on layers 0-2, a global NoPE layer 3 with Llama 4's attention
temperature tuning), served through tests/variant_serve.py: prefix caching on, chunked prefill at 32 tokens a
step, 8 concurrent requests of 50-164 tokens (several chunks each) in a 64-block cache.

vLLM gives the chunked layers KV-cache groups of their own (ChunkedLocalAttentionSpec) whose manager frees
blocks that fall out of the current chunk while the request runs; attn-otel taps them by the global layer's
slots (its group keeps every position) and applies the chunk mask: row i sees keys 32 * floor(i / 32) .. i.
Checked against HF eager float32 on the same weights and tokens, layer by layer, within FACTOR x HF bf16's own
drift + floor, and the global layer's maps x V against its output (ATTN_OTEL_VERIFY)."""

import numpy as np
import pytest
from reference import Calibrated, check_reconstruction, hf_references
from test_engine_variants import serve
from variant_models import CHUNK, build_llama4

import attn_otel

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def served_llama4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama4")
    model = build_llama4(tmp / "model")
    store, got, stderr = serve(tmp, model)
    return model, store, got, stderr


def test_chunked_layers_are_captured_by_the_global_layers_slots(served_llama4):
    _, _, got, stderr = served_llama4
    assert got["kv_groups"] == ["ChunkedLocalAttentionSpec"] * 3 + ["FullAttentionSpec"]
    by_index = {s["index"]: s for s in got["layers"]}
    assert sorted(by_index) == [0, 1, 2, 3]
    for i in range(3):
        assert (by_index[i]["chunk"], by_index[i]["group"]) == (CHUNK, 3)
        assert by_index[i]["slots_from"] == "model.layers.3.self_attn.attn"
    assert (by_index[3]["chunk"], by_index[3]["slots_from"]) == (0, "")
    assert got["layer_kinds"] == {**{str(i): f"attention (chunk {CHUNK}, KV-cache group 3)" for i in range(3)},
                                  "3": "attention (KV-cache group 3)"}
    assert got["captured"] == len(got["requests"]) and got["dropped"] == {}
    assert "not capturing" not in stderr


def test_chunked_maps_match_hf_eager_layer_by_layer(served_llama4):
    model, store, got, _ = served_llama4
    cal, recon = Calibrated(), []
    for r in got["requests"]:
        (cap,) = attn_otel.open_trace(r["trace_id"], store)
        ids = r["prompt"] + r["output"]
        T = cap.num_tokens
        assert T == len(ids) - 1 > CHUNK and list(cap.token_ids) == ids[:T]  # two chunks at least
        a = cap.maps()
        rows = np.arange(T)
        before_chunk = rows[None, :] < (rows // CHUNK * CHUNK)[:, None]  # [query, key]: keys of earlier chunks
        for li in range(3):
            assert np.abs(a[li][:, before_chunk]).max() == 0.0  # nothing of an earlier chunk is seen
            assert np.abs(a[li].sum(-1) - 1).max() <= 1e-3
        assert np.abs(np.triu(a, 1)).max() == 0.0 and a[3][:, before_chunk].max() > 0  # the global layer sees all
        fp32, bf16 = hf_references(model, ids[:T])
        for li in range(4):
            cal.add_maps(f"layer {li}", a[li], fp32[li], bf16[li])
        recon.append(check_reconstruction(cap))  # the global layer (streamed, with the map pool)
    cal.check("Llama 4 chunked local attention against HF eager fp32")
    assert all(r["rows"] > 0 for r in recon)
