"""fp8 KV cache on an NVIDIA GPU: the maps are what the served model computed from its fp8 cache.

Run on the lent GPU machine: ``python3 -P -m pytest -m gpu tests/test_gpu_fp8.py``; ``TEST_ATTENTION_BACKEND``
(FLASH_ATTN, TRITON_ATTN, ...) and ``TEST_KV_DTYPE`` (fp8, fp8_e4m3, fp8_e5m2) pick another backend or format.
The small random-weight Llama of tests/test_gpu.py, served with ``kv_cache_dtype="fp8"`` in vLLM's default config (FLASH_ATTN with
FlashAttention 3 quantises the queries too).  With ``ATTN_OTEL_VERIFY=1`` each maps capture checks itself:
maps times the values read back from vLLM's fp8 cache (dequantised with the layer's v_scale) must give the
layer's attention output as FA3 computed it, within what FA3's fp8 path allows (it rounds P to e4m3 for the
P.V product: tests/reference.py, ``reconstruction_bound``).  The distance to HF eager float32 is reported
beside it: there the fp8 rounding of K, V and Q is the model's own numerics, not a capture error.
"""

import json
import os

import numpy as np
import pytest
from reference import Calibrated, check_reconstruction, hf_references
from test_gpu import HEADS, LAYERS, gpu_model  # noqa: F401 - the same model fixture

import attn_otel
from attn_otel.ids import new_span_id, new_trace_id

pytestmark = pytest.mark.gpu
BACKEND = os.environ.get("TEST_ATTENTION_BACKEND") or None  # None: the one vLLM picks (FLASH_ATTN on an H100)
KV_DTYPE = os.environ.get("TEST_KV_DTYPE", "fp8")


@pytest.fixture(scope="module")
def fp8_engine(gpu_model, tmp_path_factory):  # noqa: F811
    store = tmp_path_factory.mktemp("store-fp8")
    os.environ.update({"ATTN_OTEL": "1", "ATTN_OTEL_STORE": str(store), "ATTN_OTEL_LAYERS": "all",
                       "ATTN_OTEL_ROW_METRICS": "all", "ATTN_OTEL_VERIFY": "1",
                       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    from vllm import LLM

    llm = LLM(model=gpu_model, skip_tokenizer_init=True, max_model_len=4096, max_num_batched_tokens=256,
              gpu_memory_utilization=0.3, seed=0, kv_cache_dtype=KV_DTYPE,
              attention_backend=BACKEND)
    return llm, store


def test_fp8_maps_reconstruct_the_backends_output(fp8_engine, gpu_model):  # noqa: F811
    from vllm import SamplingParams

    from attn_otel import vllm_adapter

    llm, store = fp8_engine
    (engine,) = vllm_adapter.engines()
    rng = np.random.default_rng(3)
    shared = rng.integers(10, 4000, 300).tolist()
    prompts = [shared + rng.integers(10, 4000, 350).tolist()]  # chunked at 256
    prompts += [rng.integers(10, 4000, 40 + 60 * i).tolist() for i in range(8)]  # a concurrent batch
    traces = [new_trace_id() for _ in prompts]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                             extra_args={"attn_otel": "maps", "traceparent": f"00-{t}-{new_span_id()}-01"})
              for t in traces]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.step()
    assert engine.flush(120)
    results = {"attention_impl": engine.attrs["attention_impl"], "kv_cache_dtype": KV_DTYPE,
               "cudagraph_mode": str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)}
    recon, cal = [], Calibrated()
    for out, t in zip(outs, traces):
        (cap,) = attn_otel.open_trace(t, store)
        assert cap.has_maps and cap.layers == list(range(LAYERS)) and cap.num_heads == HEADS
        recon.append(check_reconstruction(cap, kv_dtype=KV_DTYPE))
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        fp32, bf16 = hf_references(gpu_model, ids[: cap.num_tokens], device="cuda")
        cal.add_maps("tv", cap.maps(), fp32, bf16)
    results["reconstruction_worst"] = {k: max(r[k] for r in recon) for k in ("median", "p99", "max")}
    results["reconstruction_bound"] = recon[0]["bound"]
    results["against_hf_fp32"] = cal.report()  # reported, not bounded: fp8 is the served model's numerics
    results["stats"] = engine.stats.snapshot()
    print("GPU fp8:", json.dumps(results))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"gpu_fp8-{BACKEND or 'default'}-{KV_DTYPE}.json"), "w") as f:
            json.dump(results, f, indent=1)
    assert results["attention_impl"].startswith({"TRITON_ATTN": "Triton", "FLASHINFER": "FlashInfer"}.get(
        BACKEND, "FlashAttention"))
    assert not results["stats"]["dropped"]
