"""Serve SmolLM2 with vLLM's CPU build, ngram speculative decoding and attn-otel, and write what
tests/test_engine_spec.py compares: ``python spec_serve.py MODEL_DIR STORE OUT_JSON [ngram|eagle|eagle3]``
(EAGLE heads built for the model by tests/spec_heads.py).

Prompts repeat a 20-token phrase four times, so that the ngram proposer drafts (3 tokens a step) and some of
its drafts are rejected; prefix caching on, chunked prefill at 64 tokens a step, 6 requests at once."""

import json
import os
import sys


def main(model: str, store: str, out_json: str, method: str = "ngram") -> None:
    os.environ.update({"ATTN_OTEL": "1", "ATTN_OTEL_STORE": store, "ATTN_OTEL_LAYERS": "all",
                       "ATTN_OTEL_MAPS_SAMPLE": "0", "ATTN_OTEL_ROW_METRICS": "all",
                       "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "ATTN_OTEL_STORE_TOKENS": "1", "ATTN_OTEL_VERIFY": "1",
                       "VLLM_CPU_KVCACHE_SPACE": "1"})
    # prefill chunks' rows in the forward, as an all-layers capture of a large model runs them (auto would leave
    # these small models' rings alone); ATTN_OTEL_STREAM_DIRECT=0 runs the ring path
    os.environ.setdefault("ATTN_OTEL_STREAM_DIRECT", "1")
    import numpy as np
    from vllm import LLM, SamplingParams

    from attn_otel import vllm_adapter
    from attn_otel.ids import new_span_id, new_trace_id

    if method == "ngram":
        proposer = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    else:  # a one-layer head with its own attention layer (numbered after the target's) and KV cache
        import spec_heads

        build = {"eagle": spec_heads.build_eagle_head, "eagle3": spec_heads.build_eagle3_head}[method]
        proposer = {"method": method, "model": build(model, os.path.abspath(f"head-{method}")),
                    "num_speculative_tokens": 3}
    # float32 and no dynamo trace, as tests/reliability/driver.py: what these serves check is where drafts' rows
    # land (positions, token ids, the sequence's end), which neither the dtype nor the trace changes, and the CPU
    # build's bf16 GEMMs run about 10x slower than float32 on the CI machine (no AVX-512 BF16).  Generating the
    # ngram serve's six requests took 31.6 s in bf16 under dynamo, 7.5 s so.  The custom ops stay those of the
    # traced build ("none"; enforce_eager would turn the CPU build's own kernels on).  The bf16 path under dynamo
    # is the session engine's (tests/test_engine_exact.py and the modules on it) and test_engine_stream's.
    llm = LLM(model=model, max_model_len=1024, max_num_batched_tokens=64, seed=0, enable_prefix_caching=True,
              disable_log_stats=False, speculative_config=proposer, dtype="float32",
              compilation_config={"mode": 0, "custom_ops": ["none"]})
    rng = np.random.default_rng(0)
    phrase = rng.integers(100, 5000, 20).tolist()
    prompts = [phrase * 4 + rng.integers(100, 5000, 10 + 7 * i).tolist() for i in range(6)]
    traces = [new_trace_id() for _ in prompts]
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                             extra_args={"attn_otel": "maps", "traceparent": f"00-{t}-{new_span_id()}-01"})
              for t in traces]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.step()
    (engine,) = vllm_adapter.engines()
    assert engine.flush(120), "captures not written within 120 s"
    spec = {m.name: getattr(m, "value", None) for m in llm.llm_engine.get_metrics() if "spec_decode" in m.name}
    with open(out_json, "w") as f:
        json.dump({"stats": engine.stats_snapshot(), "spec": spec, "layer_kinds": engine.attrs.get("layer_kinds"),
                   "requests": [{"trace_id": t, "prompt": list(o.prompt_token_ids),
                                 "output": list(o.outputs[0].token_ids)} for o, t in zip(outs, traces)]}, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/spec_heads.py
    main(*sys.argv[1:5])
