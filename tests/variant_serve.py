"""Serve one of tests/variant_models.py's models with vLLM's CPU build and attn-otel, and write what the
test compares:
``python variant_serve.py MODEL_DIR STORE OUT_JSON [NUM_BLOCKS] [--own-slots] [--spec[=mtp]] [--eager[=OPS]]
[--twins]`` (``--eager``: ``enforce_eager``, with ``OPS`` as ``compilation_config.custom_ops`` where given;
``--twins``: the second wave's prompts once more, metrics only, as ``twins``: their per-row metrics come from
the stream and the finish-time kernels, not from maps).

Serving as in production: prefix caching on (the second wave shares a long prefix with the first
request), chunked prefill with a small step (max_num_batched_tokens=32, prompts of 50-200 tokens), and
concurrent requests in a KV cache of few blocks, so that blocks the window layers' group frees are given
to other requests while the first ones still run."""

import json
import logging
import os
import sys
from pathlib import Path


def main(model: str, store: str, out_json: str, num_blocks: int, spec: str = "", eager: str | None = None,
         twins: bool = False) -> None:
    os.environ.update({"ATTN_OTEL": "1", "ATTN_OTEL_STORE": store, "ATTN_OTEL_LAYERS": "all",
                       "ATTN_OTEL_MAP_LAYERS": "all", "ATTN_OTEL_MAPS_SAMPLE": "0",
                       "ATTN_OTEL_ROW_METRICS": "all", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                       "ATTN_OTEL_VERIFY": "1",  # maps x V against each layer's own output
                       "ATTN_OTEL_STORE_TOKENS": "1",  # stored ids are checked against vLLM's
                       "VLLM_CPU_KVCACHE_SPACE": "1",
                       # GPU: vLLM 0.26's warm-up JIT-builds FlashInfer's sampling module with ninja on a fresh
                       # machine (minutes, seen with speculative decoding); these tests sample greedily anyway
                       "VLLM_USE_FLASHINFER_SAMPLER": "0"})
    # prefill chunks' rows in the forward, as an all-layers capture of a large model runs them (auto would leave
    # these small models' rings alone); ATTN_OTEL_STREAM_DIRECT=0 runs the ring path
    os.environ.setdefault("ATTN_OTEL_STREAM_DIRECT", "1")
    logging.basicConfig()
    logging.getLogger("attn_otel").setLevel(logging.INFO)
    import numpy as np
    from vllm import LLM, SamplingParams

    from attn_otel import vllm_adapter
    from attn_otel.ids import new_span_id, new_trace_id

    import torch

    config = json.loads((Path(model) / "config.json").read_text())
    # the CPU build's chunked local attention (Llama 4) wants blocks of 32, which divide the chunk
    chunked = config.get("attention_chunk_size")
    # on the GPU machine TEST_ATTENTION_BACKEND picks vLLM's attention backend (FLASH_ATTN, TRITON_ATTN, FLASHINFER)
    # and TEST_KV_DTYPE the KV cache's format (auto, fp8, fp8_e4m3, fp8_e5m2)
    backend = os.environ.get("TEST_ATTENTION_BACKEND") or None
    if backend is None and config.get("kv_lora_rank") and not torch.cuda.is_available():
        # MLA on the CPU build: its reference backend (CPUMLAImpl, blocks of 16) on every host.  Where the CPU has
        # AMX tiles vLLM would pick AMX_MLA, which takes blocks of 32 only, and these tests' block size of 16 would
        # not start (seen on a Sapphire Rapids CI host, 2026-11-27).
        backend = "CPU_MLA"
    kv_dtype = os.environ.get("TEST_KV_DTYPE", "auto")
    # --spec: ngram speculative decoding (3 draft tokens a step).  A random model's next token depends mostly on
    # the last one, so matching a single earlier token (prompt_lookup_min=1) drafts often and is sometimes right.
    # --spec=mtp: the model's own multi-token-prediction layer drafts (variant_models.build_deepseek_mtp)
    proposer = ({"method": "mtp", "num_speculative_tokens": 2} if spec == "mtp" else
                {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    if spec == "mtp" and backend == "CPU_MLA":  # the draft picks its own backend unless told (vLLM 0.32)
        proposer["attention_backend"] = backend
    extra = {"speculative_config": proposer, "disable_log_stats": False} if spec else {}
    # The CPU build turns chunked prefill off for MLA after the speculative config capped the step at 32 tokens:
    # a longer prompt would then never be scheduled (vLLM hangs, with or without attn-otel), so MTP gets 512
    step = 512 if spec == "mtp" else 32
    # With MTP the garbage collector is off while the engine starts: compiling the draft on the CPU build sometimes
    # aborted the process (a CPU GEMM handler's __del__ calls .item() when the collector runs it inside
    # torch.compile's fake-tensor tracing, and recurses until the stack overflows: seen once in CI, logged as a
    # RecursionError in runs that survive).  Not enforce_eager: it turns on the CPU build's rotary-embedding kernel,
    # which rotates MLA's 3-D query views wrongly, so vLLM's DeepSeek then differs from HF's (docs/known-limits.md).
    import gc

    if spec == "mtp":
        gc.disable()
    # The KV-cache budget that attn-otel's start-up sizing divides (tap.kv_budget) is 1 GiB on both machines: the
    # CPU build's VLLM_CPU_KVCACHE_SPACE above, the GPU's kv_cache_memory_bytes (else most of an H100, on which
    # every choice the sizing makes comes out otherwise).  num_blocks still fixes the blocks vLLM allocates.
    budget = {"kv_cache_memory_bytes": 1 << 30} if torch.cuda.is_available() else {}
    llm = LLM(model=model, skip_tokenizer_init=True, max_model_len=512, max_num_batched_tokens=step,
              max_num_seqs=8, enable_prefix_caching=True, seed=0, block_size=32 if chunked else 16,
              num_gpu_blocks_override=num_blocks, attention_backend=backend,
              kv_cache_dtype=kv_dtype, **budget, **extra, **_eager(eager))
    gc.enable()
    rng = np.random.default_rng(0)

    def ids(n):
        return [int(x) for x in rng.integers(3, 500, size=n)]

    def params(trace, n):
        return SamplingParams(max_tokens=n, temperature=0.0, detokenize=False,
                              extra_args={"attn_otel": "maps", "traceparent": f"00-{trace}-{new_span_id()}-01"})

    shared = ids(96)
    waves = [[shared + ids(16)], [shared + ids(8 + 5 * i) if i % 2 else ids(50 + 19 * i) for i in range(8)]]
    if spec:  # longer prompts (more earlier tokens to match) and outputs, drafts past the window
        waves = [[ids(90 + 15 * i) for i in range(6)]]
    results = []
    for prompts in waves:
        traces = [new_trace_id() for _ in prompts]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [params(t, 24 + 3 * i if spec else 3 + i % 4) for i, t in enumerate(traces)],
                            use_tqdm=False)
        for t, o in zip(traces, outs):
            results.append({"trace_id": t, "prompt": list(o.prompt_token_ids),
                            "output": list(o.outputs[0].token_ids), "cached": int(o.num_cached_tokens or 0)})
    twin_results = []
    if twins:  # metrics only (read from the prefix cache: not planned for maps at arrival), longer outputs
        prompts = waves[-1]
        traces = [new_trace_id() for _ in prompts]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(max_tokens=12, temperature=0.0, detokenize=False,
                                            extra_args={"attn_otel": "metrics",
                                                        "traceparent": f"00-{t}-{new_span_id()}-01"})
                             for t in traces], use_tqdm=False)
        for t, o in zip(traces, outs):
            twin_results.append({"trace_id": t, "prompt": list(o.prompt_token_ids),
                                 "output": list(o.outputs[0].token_ids), "cached": int(o.num_cached_tokens or 0)})
    llm.llm_engine.step()
    kvm = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
    groups = [type(g.kv_cache_spec).__name__ for g in kvm.kv_cache_config.kv_cache_groups]
    if not vllm_adapter.engines():  # every layer refused: capture is off, the model still served
        with open(out_json, "w") as f:
            json.dump({"requests": results, "kv_groups": groups, "captured": 0}, f)
        return
    (engine,) = vllm_adapter.engines()
    assert engine.flush(120), "captures not written within 120 s"
    specs = [{"index": s.index, "window": s.window, "soft_cap": s.soft_cap, "sinks": s.sinks,
              "scale": s.scale, "group": s.group, "slots_from": s.slots_from, "own_group": s.own_group, "latent": s.latent, "chunk": s.chunk,
              "head_dim": s.head_dim, "num_kv_heads": s.num_kv_heads} for s in engine.layers]
    kv = llm.llm_engine.vllm_config.cache_config
    stats = engine.stats_snapshot()
    drafts = ({m.name: getattr(m, "value", None) for m in llm.llm_engine.get_metrics() if "spec_decode" in m.name}
              if spec else {})
    with open(out_json, "w") as f:
        json.dump({"requests": results, "twins": twin_results, "layers": specs,
                   "streamed": sorted(engine.streamed), "map_layers": list(engine.map_layers), "kv_groups": groups,
                   "num_blocks": kv.num_gpu_blocks,
                   "attention_impl": engine.attrs.get("attention_impl"), "layer_kinds": engine.attrs.get("layer_kinds"),
                   "prefix_caching": bool(kv.enable_prefix_caching),
                   "chunked_prefill": bool(llm.llm_engine.vllm_config.scheduler_config.enable_chunked_prefill),
                   "captured": stats["captured"], "dropped": stats["dropped"], "spec": drafts,
                   "after_launch_at": stats["after_launch_at"], "step_host_s": stats["step_host_s"],
                   "direct_rows": stats.get("stream_direct_rows"),
                   "direct_replayed": stats.get("stream_direct_replayed")}, f)


def _eager(ops: str | None) -> dict:
    """LLM arguments for ``--eager[=OPS]`` (None: compiled, vLLM's default)."""
    if ops is None:
        return {}
    return {"enforce_eager": True, **({"compilation_config": {"custom_ops": ops.split(",")}} if ops else {})}


if __name__ == "__main__":
    if "--own-slots" in sys.argv:  # the control: windowed layers tapped by their own group's (freed) slots
        sys.argv.remove("--own-slots")
        from attn_otel import vllm_adapter

        vllm_adapter._window_groups = lambda specs, kv_cache_config: (specs, [])
    spec = ""
    for arg in [a for a in sys.argv if a.startswith("--spec")]:  # --spec (ngram) or --spec=METHOD
        sys.argv.remove(arg)
        spec = arg.partition("=")[2] or "ngram"
    eager = None
    for arg in [a for a in sys.argv if a.startswith("--eager")]:
        sys.argv.remove(arg)
        eager = arg.partition("=")[2]
    twins = "--twins" in sys.argv
    if twins:
        sys.argv.remove("--twins")
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 64, spec, eager, twins)
