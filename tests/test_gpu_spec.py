"""Speculative decoding on an NVIDIA GPU (issue 21 item 5): EAGLE, or ngram, in vLLM's default serving config.

Run on the lent GPU machine: ``TEST_SPEC_METHOD=eagle python3 -P -m pytest -m gpu tests/test_gpu_spec.py`` (or
``eagle3``: an EAGLE-3 head fed the target's hidden states after layers 1, 2 and 4, tests/spec_heads.py; or
``ngram``).  The target is tests/test_gpu.py's random-weight Llama.  The EAGLE draft is an EAGLE-1 head built here
for it: one Llama layer whose ``fc`` passes the target's hidden state through (``[0 | I]``) and whose attention and
MLP outputs are zero, so the head proposes what the target's own logits at the last position propose: the last
token again.  A random model repeats itself often enough that some drafts are accepted and others rejected, which
is what the capture has to get right.  The draft's attention layer is a real vLLM attention layer (numbered after
the target's: layer 4 of 4), with its own KV cache, run by the proposer between the target's forwards.

Checked: vLLM drafted, accepted some drafts and rejected others; every request was captured and none dropped; each
capture holds exactly the sequence's positions and token ids (no rejected draft, nothing past the end); only the
target's layers are captured and the draft's layer is listed as not captured; the maps match HF eager float32
within the calibrated bf16 drift, and maps x V (values from vLLM's cache) reproduce each layer's output.
"""

import json
import os

import numpy as np
import pytest
from reference import Calibrated, check_reconstruction, hf_references
from spec_heads import build_eagle3_head, build_eagle_head
from test_gpu import HEADS, LAYERS, gpu_model  # noqa: F401 - the same target model

import attn_otel
from attn_otel.ids import new_span_id, new_trace_id

pytestmark = pytest.mark.gpu
METHOD = os.environ.get("TEST_SPEC_METHOD", "eagle")
DRAFTS = 3


@pytest.fixture(scope="module")
def spec_engine(gpu_model, tmp_path_factory):  # noqa: F811
    store = tmp_path_factory.mktemp("store-spec")
    os.environ.update({"ATTN_OTEL": "1", "ATTN_OTEL_STORE": str(store), "ATTN_OTEL_LAYERS": "all",
                       "ATTN_OTEL_MAPS_SAMPLE": "0", "ATTN_OTEL_ROW_METRICS": "all", "ATTN_OTEL_VERIFY": "1",
                       "ATTN_OTEL_STORE_TOKENS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                       # greedy anyway; FlashInfer's sampler is JIT-built by vLLM's warm-up on a fresh machine (minutes)
                       "VLLM_USE_FLASHINFER_SAMPLER": "0"})
    os.environ.setdefault("ATTN_OTEL_STREAM_DIRECT", "1")  # prefill rows in the forward (auto: off this small)
    # on vLLM's stream: every step here (at most 256 tokens) is replayed as CUDA graphs (vLLM caps its largest
    # at 256), where beside the forward (ATTN_OTEL_DIRECT_STREAM=side, the default) makes no direct plan
    os.environ.setdefault("ATTN_OTEL_DIRECT_STREAM", "engine")
    from vllm import LLM

    if METHOD in ("eagle", "eagle3"):
        build = build_eagle_head if METHOD == "eagle" else build_eagle3_head
        spec = {"method": METHOD, "model": build(gpu_model, tmp_path_factory.mktemp(METHOD)),
                "num_speculative_tokens": DRAFTS}
    else:
        spec = {"method": "ngram", "num_speculative_tokens": DRAFTS, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    llm = LLM(model=gpu_model, skip_tokenizer_init=True, max_model_len=4096, max_num_batched_tokens=256,
              gpu_memory_utilization=0.3, seed=0, enable_prefix_caching=True, disable_log_stats=False,
              speculative_config=spec)
    return llm, store


def test_speculative_captures_are_exact_and_hold_accepted_rows_only(spec_engine, gpu_model):  # noqa: F811
    from vllm import SamplingParams

    from attn_otel import vllm_adapter

    llm, store = spec_engine
    (engine,) = vllm_adapter.engines()
    rng = np.random.default_rng(5)
    phrase = rng.integers(10, 4000, 20).tolist()  # repeated: the ngram proposer finds drafts in it
    prompts = [phrase * 4 + rng.integers(10, 4000, 10 + 23 * i).tolist() for i in range(8)]
    prompts.append(rng.integers(10, 4000, 300).tolist() + phrase * 3)  # longer than a 256-token step
    traces = [new_trace_id() for _ in prompts]
    params = [SamplingParams(max_tokens=24 + 3 * i, temperature=0.0, ignore_eos=True,
                             extra_args={"attn_otel": "maps", "traceparent": f"00-{t}-{new_span_id()}-01"})
              for i, t in enumerate(traces)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.step()
    assert engine.flush(120)
    spec = {m.name: getattr(m, "value", None) for m in llm.llm_engine.get_metrics() if "spec_decode" in m.name}
    stats = engine.stats.snapshot()
    cal = Calibrated()
    recon = []
    kinds = None
    for out, t in zip(outs, traces):
        (cap,) = attn_otel.open_trace(t, store)
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        T = cap.num_tokens
        assert T == len(ids) - 1 and [int(x) for x in cap.token_ids] == ids[:T]  # accepted rows, nothing past
        assert list(cap.layers) == list(range(LAYERS))  # the target's layers, not the draft's
        kinds = cap.meta.get("layer_kinds") or kinds
        fp32, bf16 = hf_references(gpu_model, ids[:T], device="cuda")
        cal.add_maps("tv", cap.maps(), fp32[list(cap.layers)], bf16[list(cap.layers)])
        recon.append(check_reconstruction(cap))
    st = engine.stream
    kept = ("captured", "dropped", "skipped", "steady_drift")
    report = {"method": METHOD, "spec": spec, "stats": {k: stats[k] for k in kept},
              "stream": None if st is None else {"rows": st.rows, "direct_rows": st.direct.computed,
                                                 "direct_replayed": st.direct.replayed, "flushed_rows": st.flushed_rows},
              "layer_kinds": kinds, "calibrated": cal.report(),
              "reconstruction_worst": {k: max(r[k] for r in recon) for k in ("median", "p99", "max")},
              "attention_impl": engine.attrs["attention_impl"],
              "steady_joins": None if engine.steady is None else engine.steady.joins}
    print("GPU speculative decoding:", json.dumps(report))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"gpu_spec-{METHOD}.json"), "w") as f:
            json.dump(report, f, indent=1)
    drafted = spec.get("vllm:spec_decode_num_draft_tokens") or 0
    accepted = spec.get("vllm:spec_decode_num_accepted_tokens") or 0
    assert 0 < accepted < drafted, spec  # both paths: accepted drafts and rejected ones
    assert stats["captured"] == len(prompts) and stats["dropped"] == {}
    assert stats["steady_drift"] == 0  # members back from the step counter between drafts, where vLLM had them
    if METHOD != "ngram":  # the draft's attention layer exists, and is named as not captured
        assert kinds and kinds.get(str(LAYERS), "").startswith("not captured: the speculative decoding draft"), kinds
    cal.check(f"GPU {METHOD} speculative decoding")
