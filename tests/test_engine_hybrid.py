"""A hybrid model (Qwen3-Next: gated DeltaNet linear-attention layers beside full attention) on vLLM's CPU
build: tests/variant_models.py's random-weight model, served through tests/variant_serve.py (prefix caching
and chunked prefill on, 8 concurrent requests), every layer asked for, every request with maps.

vLLM's hybrid KV-cache manager gives each linear layer a state group (MambaSpec) and the full-attention layer
a group of its own, at the block size they all share.  attn-otel captures the full-attention layer from its
own group's slots, exactly (maps against HF eager float32, calibrated by HF bf16's drift; maps x V against
the layer's output), refuses the linear layers by name, and the capture's ``layer_kinds`` says which is
which."""

import numpy as np
import pytest
from reference import Calibrated, check_reconstruction, hf_model
from test_engine_variants import serve
from variant_models import build_qwen3_next

import attn_otel

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def served_hybrid(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwen3next")
    model = build_qwen3_next(tmp / "model")
    store, got, stderr = serve(tmp, model)
    return model, store, got, stderr


def _hf_full_attention(model: str, ids, dtype: str) -> np.ndarray:
    """HF eager attention of the model's one full-attention layer ``[heads, T, T]`` (transformers returns
    attentions for the softmax layers only)."""
    import torch

    m = hf_model(model, "cpu", dtype)
    with torch.no_grad():
        out = m.model(torch.tensor([list(ids)]), output_attentions=True)
    (a,) = [x for x in out.attentions if x is not None]
    return a[0].float().numpy()


def test_the_full_attention_layer_is_captured_from_its_own_group_and_the_linear_layers_refused_by_name(served_hybrid):
    _, store, got, stderr = served_hybrid
    assert got["kv_groups"] == ["MambaSpec"] * 3 + ["FullAttentionSpec"]
    (layer,) = got["layers"]
    assert (layer["index"], layer["group"], layer["latent"]) == (3, 3, 0)
    assert got["captured"] == len(got["requests"]) and got["dropped"] == {}
    for i in range(3):
        assert f"model.layers.{i}.linear_attn (not softmax attention: QwenGatedDeltaNetAttention)" in stderr
    kinds = {str(i): "refused: not softmax attention (QwenGatedDeltaNetAttention)" for i in range(3)}
    kinds["3"] = "attention (KV-cache group 3)"
    assert got["layer_kinds"] == kinds
    (cap,) = attn_otel.open_trace(got["requests"][0]["trace_id"], store)
    assert cap.layers == [3] and cap.meta["layer_kinds"] == kinds


def test_hybrid_maps_match_hf_eager_and_reconstruct_the_output(served_hybrid):
    model, store, got, _ = served_hybrid
    maps, recon = Calibrated(), []
    for r in got["requests"]:
        (cap,) = attn_otel.open_trace(r["trace_id"], store)
        ids = r["prompt"] + r["output"]
        T = cap.num_tokens
        assert T == len(ids) - 1 and list(cap.token_ids) == ids[:T]
        a = cap.maps()[0]
        assert np.abs(a.sum(-1) - 1).max() <= 1e-3 and np.abs(np.triu(a, 1)).max() == 0.0
        maps.add_maps("tv", a, _hf_full_attention(model, ids[:T], "float32"),
                      _hf_full_attention(model, ids[:T], "bfloat16"))
        recon.append(check_reconstruction(cap))
    maps.check("hybrid full-attention layer against HF eager fp32")
    assert len(recon) == len(got["requests"])
