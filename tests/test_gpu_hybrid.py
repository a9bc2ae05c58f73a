"""A hybrid model on an NVIDIA GPU with the CUDA vLLM in its default serving config.

Run on the lent GPU machine: ``python3 -P -m pytest -m gpu tests/test_gpu_hybrid.py -s`` (one engine per
process).  A small random-weight Qwen3-Next is built there with transformers: 8 layers, gated DeltaNet linear
attention on six, full (gated) attention on layers 3 and 7, a small MoE.  vLLM's hybrid KV-cache manager puts
the attention layers in a group of their own at a block size raised to match the linear layers' state pages
(recorded).  Every full-attention layer must be captured exactly (maps against HF eager float32, calibrated;
maps x V against the layer's output), the linear layers refused by name, and the capture's ``layer_kinds``
must say which layer is which.
"""

import json
import os

import numpy as np
import pytest
from reference import Calibrated, check_reconstruction, hf_model

from attn_otel.ids import new_span_id, new_trace_id

pytestmark = pytest.mark.gpu

FULL = (3, 7)


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3NextConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_num_value_heads=8,
                          linear_num_key_heads=4, linear_key_head_dim=128, linear_value_head_dim=128,
                          num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                          shared_expert_intermediate_size=256, max_position_embeddings=4096,
                          initializer_range=0.05, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.layer_types = ["full_attention" if i in FULL else "linear_attention" for i in range(8)]
    model = Qwen3NextForCausalLM(cfg)
    with torch.no_grad():  # attention far from uniform
        for i in FULL:
            model.model.layers[i].self_attn.q_proj.weight.mul_(3.0)
            model.model.layers[i].self_attn.k_proj.weight.mul_(3.0)
    path = tmp_path_factory.mktemp("hybrid-model")
    model.to(torch.bfloat16).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hybrid_engine(hybrid_model, tmp_path_factory):
    store = tmp_path_factory.mktemp("store-hybrid")
    os.environ.update({"ATTN_OTEL": "1", "ATTN_OTEL_STORE": str(store), "ATTN_OTEL_LAYERS": "all",
                       "ATTN_OTEL_ROW_METRICS": "all", "ATTN_OTEL_VERIFY": "1", "ATTN_OTEL_MAPS_SAMPLE": "0",
                       "ATTN_OTEL_STORE_TOKENS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    from vllm import LLM

    # gdn_prefill_backend="triton": the linear layers' prefill kernel vLLM ships (flashinfer's SM90 one is not in
    # the GPU machine's vLLM bundle); the attention layers, the ones captured, are vLLM's default either way
    llm = LLM(model=hybrid_model, skip_tokenizer_init=True, max_model_len=2048, max_num_batched_tokens=256,
              gpu_memory_utilization=0.3, seed=0, gdn_prefill_backend="triton")
    return llm, store


def _hf(model: str, ids, dtype: str) -> np.ndarray:
    import torch

    m = hf_model(model, "cuda", dtype)
    with torch.no_grad():
        out = m.model(torch.tensor([list(ids)], device="cuda"), output_attentions=True)
    return np.stack([a[0].float().cpu().numpy() for a in out.attentions if a is not None])


def test_gpu_hybrid_full_attention_layers_are_exact(hybrid_engine, hybrid_model):
    from vllm import SamplingParams

    import attn_otel
    from attn_otel import vllm_adapter

    llm, store = hybrid_engine
    (engine,) = vllm_adapter.engines()
    assert [s.index for s in engine.layers] == list(FULL)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(10, 4000, 600).tolist()]  # chunked prefill at 256 a step
    prompts += [rng.integers(10, 4000, 30 + 41 * i).tolist() for i in range(8)]  # a concurrent batch
    traces = [new_trace_id() for _ in prompts]
    params = [SamplingParams(max_tokens=12 + i, temperature=0.0, ignore_eos=True,
                             extra_args={"attn_otel": "maps", "traceparent": f"00-{t}-{new_span_id()}-01"})
              for i, t in enumerate(traces)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.step()
    assert engine.flush(120)
    kvc = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.kv_cache_config
    results = {"attention_impl": engine.attrs["attention_impl"], "layer_kinds": engine.attrs["layer_kinds"],
               "kv_groups": [[type(g.kv_cache_spec).__name__, int(g.kv_cache_spec.block_size), list(g.layer_names)]
                             for g in kvc.kv_cache_groups],
               "cudagraph_mode": str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode),
               "stats": engine.stats.snapshot()}
    maps, recon = Calibrated(), []
    for out, t in zip(outs, traces):
        (cap,) = attn_otel.open_trace(t, store)
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        T = cap.num_tokens
        assert T == len(ids) - 1 and cap.layers == list(FULL) and list(cap.token_ids) == ids[:T]
        got = cap.maps()
        assert np.abs(got.sum(-1) - 1).max() <= 1e-3 and np.abs(np.triu(got, 1)).max() == 0.0
        maps.add_maps("tv", got, _hf(hybrid_model, ids[:T], "float32"), _hf(hybrid_model, ids[:T], "bfloat16"))
        recon.append(check_reconstruction(cap))
    results["maps_against_hf"] = maps.report()
    results["reconstruction_worst"] = {k: max(r[k] for r in recon) for k in ("median", "p99", "max")}
    print("GPU hybrid:", json.dumps(results, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_hybrid.json"), "w") as f:
            json.dump(results, f, indent=1)
    assert results["stats"]["captured"] == len(outs) and results["stats"]["dropped"] == {}
    for i in range(8):
        kind = results["layer_kinds"][str(i)]
        assert kind.startswith("attention (") if i in FULL else kind.startswith("refused: not softmax attention")
    maps.check("GPU hybrid full-attention layers")
