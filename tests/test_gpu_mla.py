"""MLA (multi-head latent attention) on an NVIDIA GPU with the CUDA vLLM in its default serving config.

Run on the lent GPU machine: ``python3 -P -m pytest -m gpu tests/test_gpu_mla.py -s`` (one engine per pytest
process).  A small random-weight DeepSeek-V3-shaped model is built there with transformers: MLA with a query
LoRA (rank 384), a 512-wide latent and 64 rope dims, nope and v heads of 128, 16 heads, one dense layer then
three MoE layers (8 routed experts, 2 per token, one shared).  vLLM keeps its defaults: the MLA backend it picks
on the GPU (recorded), CUDA graphs, chunked prefill (max_num_batched_tokens=256, below the long prompt),
prefix caching.

attn-otel captures an MLA layer as the multi-query attention of vLLM's decode path: the absorbed query
``[q_nope W_UK^T | q_pe]`` per head against the latent cache row ``[c_kv | k_pe]`` read from vLLM's cache.
Checked: maps against HF eager float32 (calibrated against HF bf16's own drift, and the issue's absolute
bounds), per-row metrics of a metrics-only request that hits the prefix cache against NumPy on HF fp32, and
maps x c_kv x W_UV against each layer's output as the backend computed it (ATTN_OTEL_VERIFY).
"""

import json
import os

import numpy as np
import pytest
from reference import Calibrated, check_reconstruction, hf_references

from attn_otel.ids import new_span_id, new_trace_id

pytestmark = pytest.mark.gpu

LAYERS, HEADS = 4, 16
# The bounds on per-row TV against HF eager fp32 (those of the plain-attention test).
ABSOLUTE = {"median": 0.02, "p99": 0.05, "max": 0.35}


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=4096, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
                           num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                           q_lora_rank=384, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                           v_head_dim=128, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                           first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=4096,
                           rope_scaling=None, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                           tie_word_embeddings=False)
    cfg.topk_method, cfg.scoring_func = "noaux_tc", "sigmoid"
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # attention far from uniform, so that the comparison means something
        for layer in model.model.layers:
            layer.self_attn.q_b_proj.weight.mul_(2.0)
            layer.self_attn.kv_b_proj.weight.mul_(2.0)
    path = tmp_path_factory.mktemp("mla-model")
    model.to(torch.bfloat16).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def mla_engine(mla_model, tmp_path_factory):
    store = tmp_path_factory.mktemp("store-mla")
    os.environ.update({"ATTN_OTEL": "1", "ATTN_OTEL_STORE": str(store), "ATTN_OTEL_LAYERS": "all",
                       "ATTN_OTEL_ROW_METRICS": "all", "ATTN_OTEL_VERIFY": "1", "ATTN_OTEL_MAPS_SAMPLE": "0",
                       "ATTN_OTEL_STORE_TOKENS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    os.environ.setdefault("ATTN_OTEL_STREAM_DIRECT", "1")  # prefill rows in the forward (auto: off this small)
    # on vLLM's stream: every step here (at most 256 tokens) is replayed as CUDA graphs (vLLM caps its largest
    # at 256), where beside the forward (ATTN_OTEL_DIRECT_STREAM=side, the default) makes no direct plan
    os.environ.setdefault("ATTN_OTEL_DIRECT_STREAM", "engine")
    from vllm import LLM

    llm = LLM(model=mla_model, skip_tokenizer_init=True, max_model_len=2048, max_num_batched_tokens=256,
              gpu_memory_utilization=0.3, seed=0)
    return llm, store


def test_gpu_mla_maps_and_metrics_are_the_served_models(mla_engine, mla_model):
    from vllm import SamplingParams

    import attn_otel
    from attn_otel import vllm_adapter

    llm, store = mla_engine
    (engine,) = vllm_adapter.engines()
    assert [s.latent for s in engine.layers] == [512] * LAYERS and {s.head_dim for s in engine.layers} == {576}
    assert not engine.stream.k_tap, "MLA keys should be read from vLLM's latent cache"
    rng = np.random.default_rng(5)
    shared = rng.integers(10, 4000, 320).tolist()
    waves = [  # (prompts, maps?)
        ([shared + rng.integers(10, 4000, 300).tolist()], True),  # chunked prefill: 620 tokens at 256 a step
        ([shared + rng.integers(10, 4000, 60).tolist()], False),  # a prefix-cache hit (metrics only)
        ([rng.integers(10, 4000, 30 + 37 * i).tolist() for i in range(8)], True),  # a concurrent batch
    ]
    runs = []
    for prompts, maps in waves:
        traces = [new_trace_id() for _ in prompts]
        params = [SamplingParams(max_tokens=12 + i, temperature=0.0, ignore_eos=True,
                                 extra_args={"attn_otel": "maps" if maps else "metrics",
                                             "traceparent": f"00-{t}-{new_span_id()}-01"})
                  for i, t in enumerate(traces)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        llm.llm_engine.step()
        runs += [(o, t, maps) for o, t in zip(outs, traces)]
    assert engine.flush(120)
    stats = engine.stats.snapshot()
    results = {"attention_impl": engine.attrs["attention_impl"],
               "cudagraph_mode": str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode),
               "block_size": int(llm.llm_engine.vllm_config.cache_config.block_size),
               "prefix_cached_tokens": max(o.num_cached_tokens or 0 for o, _, _ in runs), "stats": stats,
               "stream": None if engine.stream is None else {
                   "rows": engine.stream.rows, "direct_rows": engine.stream.direct.computed,
                   "direct_replayed": engine.stream.direct.replayed, "flushed_rows": engine.stream.flushed_rows}}
    maps_cal, rows_cal, recon, pooled = Calibrated(), Calibrated(), [], []
    for out, t, maps in runs:
        (cap,) = attn_otel.open_trace(t, store)
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        T = cap.num_tokens
        assert T == len(ids) - 1 and cap.layers == list(range(LAYERS)) and cap.num_heads == HEADS
        # every id, generated ones included: the V1 runner (not vLLM's default for DeepSeek) keeps -1 placeholders
        # for them under async scheduling; attn-otel takes them from the scheduler (vllm_adapter._OUTPUTS)
        assert list(cap.token_ids) == ids[:T]
        fp32, bf16 = hf_references(mla_model, ids[:T], device="cuda")
        if maps:
            got = cap.maps()
            assert np.abs(got.sum(-1) - 1).max() <= 1e-3 and np.abs(np.triu(got, 1)).max() == 0.0
            maps_cal.add_maps("tv", got, fp32, bf16)
            pooled.append((got, fp32))
            recon.append(check_reconstruction(cap))  # FlashAttnMLA on an H100: within the bf16 bound (p99 2u)
        for li in range(LAYERS):
            rows_cal.add_metrics(f"{'maps' if maps else 'metrics'} request ", {n: v[li] for n, v in cap.metrics.items()},
                                 fp32[li], bf16[li], cap.prompt_len)
    results["maps_against_hf"] = maps_cal.report()
    results["maps_tv_absolute"] = _pooled_tv(pooled)
    results["rows_against_hf"] = rows_cal.report()
    results["reconstruction_worst"] = {k: max(r[k] for r in recon) for k in ("median", "p99", "max")}
    results["reconstruction_bound"] = recon[0]["bound"]
    print("GPU MLA:", json.dumps(results, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_mla.json"), "w") as f:
            json.dump(results, f, indent=1)
    assert stats["captured"] == len(runs) and stats["dropped"] == {}, stats
    assert results["prefix_cached_tokens"] >= 256
    assert "MLA" in results["attention_impl"].upper()
    maps_cal.check("GPU MLA maps")
    rows_cal.check("GPU MLA per-row metrics")
    for stat, bound in ABSOLUTE.items():
        assert results["maps_tv_absolute"][stat] <= bound, (stat, results["maps_tv_absolute"])


def _pooled_tv(pairs) -> dict:
    """Per-row TV against HF fp32 over every row of every maps request, every layer and head."""
    from reference import row_tv

    tv = np.concatenate([row_tv(g, r).ravel() for g, r in pairs])
    return {"median": float(np.median(tv)), "p99": float(np.quantile(tv, 0.99)), "max": float(tv.max()),
            "rows": int(tv.size)}
