"""Streamed layers on an NVIDIA GPU with the CUDA vLLM in its default serving config (FLASH_ATTN,
FULL_AND_PIECEWISE CUDA graphs, chunked prefill, prefix caching): layer 0 is the map layer (Q/K tap), layers
1-3 are streamed, their keys read from vLLM's own KV cache, their decode queries through a 256-row ring written
inside the CUDA graphs, their prefill chunks' rows computed in the forward (ATTN_OTEL_STREAM_DIRECT=0: every
query through the ring).  Through chunked prefill, a prefix-cache hit and preemptions (a 96-block KV cache
for 16 concurrent requests), every layer's metrics equal NumPy's on HF eager fp32 attention, within FACTOR x
HF bf16's own drift on the same values + a floor (tests/reference.py): per row (ATTN_OTEL_GPU_ROWS=all, rows
stored for every capture) or, by default, as the summary computed on the device at finish (the production path: ATTN_OTEL_ROW_METRICS=maps stores no rows for metrics captures).

Run on the lent GPU machine: ``python3 -P -m pytest -m gpu tests/test_gpu_stream.py -s`` (one engine per
process: run it in a pytest process of its own).
"""

import json
import os

import numpy as np
import pytest
from test_gpu import HEADS, LAYERS, gpu_model  # noqa: F401 - the module's model fixture

from attn_otel.ids import new_span_id, new_trace_id

pytestmark = pytest.mark.gpu


def _blocks() -> int:
    """The KV cache's blocks: 96 by default, too few for the 16 requests at once (preemptions, blocks reused at
    once, no room for attn_otel.hold); ``ATTN_OTEL_GPU_BLOCKS=1024`` leaves room to hold finished requests'
    blocks for their batches (ATTN_OTEL_HOLD_FINISHED, the default) and preempts nothing."""
    return int(os.environ.get("ATTN_OTEL_GPU_BLOCKS", "96"))


@pytest.fixture(scope="module")
def stream_engine(gpu_model, tmp_path_factory):  # noqa: F811
    store = tmp_path_factory.mktemp("store")
    os.environ.update({"ATTN_OTEL": "1", "ATTN_OTEL_STORE": str(store), "ATTN_OTEL_LAYERS": "all",
                       "ATTN_OTEL_MAP_LAYERS": "0", "ATTN_OTEL_STREAM_ROWS": "256", "ATTN_OTEL_MAPS_SAMPLE": "0",
                       "ATTN_OTEL_ROW_METRICS": os.environ.get("ATTN_OTEL_GPU_ROWS", "maps"),
                       "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                       "ATTN_OTEL_ENGINE_PRIORITY": "high"})  # (the metrics below must hold under it too)
    os.environ.setdefault("ATTN_OTEL_STREAM_DIRECT", "1")  # (auto would leave this small model's ring alone)
    from preemptions import count_preemptions
    from vllm import LLM
    from vllm.utils import torch_utils

    # An in-process engine of an earlier test in this pytest (tests/test_stream.py -m gpu) left this thread's
    # vLLM stream made; the worker below then keeps it (and says so), and the priority test would see that,
    # not what a fresh server process gets.  Forget it, as a fresh process has none.
    torch_utils._current_stream_tls.value = None
    preempted = count_preemptions()
    llm = LLM(model=gpu_model, skip_tokenizer_init=True, max_model_len=1024, max_num_batched_tokens=256,
              max_num_seqs=32, gpu_memory_utilization=0.3, num_gpu_blocks_override=_blocks(), seed=0)
    return llm, store, preempted


def test_gpu_streamed_layers_match_hf_eager(stream_engine, gpu_model):  # noqa: F811
    from numpy_metrics import per_row_metrics
    from reference import METRIC_FLOOR, METRIC_FLOOR_DEFAULT, Calibrated, hf_references
    from vllm import SamplingParams

    import attn_otel
    from attn_otel import vllm_adapter

    llm, store, preempted = stream_engine
    (engine,) = vllm_adapter.engines()
    assert engine.map_layers == (0,) and sorted(engine.streamed) == [0, 1, 2, 3] and list(engine.maptap.layers) == [0]
    assert not engine.stream.k_tap, "keys should be read from FLASH_ATTN's cache"
    rng = np.random.default_rng(2)
    shared = rng.integers(10, 4000, 320).tolist()
    batches = [[shared + rng.integers(10, 4000, 400).tolist()], [shared + rng.integers(10, 4000, 50).tolist()],
               [rng.integers(10, 4000, 20 + 23 * i).tolist() for i in range(16)]]
    runs = []
    for bi, prompts in enumerate(batches):
        traces = [new_trace_id() for _ in prompts]
        params = [SamplingParams(max_tokens=(16 if bi < 2 else 40 + 2 * i), temperature=0.0, ignore_eos=True,
                                 extra_args={"attn_otel": "metrics", "traceparent": f"00-{t}-{new_span_id()}-01"})
                  for i, t in enumerate(traces)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        llm.llm_engine.step()
        runs += list(zip(outs, traces))
    assert engine.flush(120)
    stats = engine.stats.snapshot()
    results = {"cudagraph_mode": str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode),
               "attention_impl": engine.attrs["attention_impl"], "preemptions": len(preempted),
               "prefix_cached_tokens": max(o.num_cached_tokens or 0 for o, _ in runs),
               "stream_flushes": engine.stream.flushes, "stream_flushed_rows": engine.stream.flushed_rows,
               "stream_direct_rows": engine.stream.direct.computed, "stream_direct_replayed": engine.stream.direct.replayed,
               "stream_direct_side_steps": engine.stream.direct.side_steps,
               "blocks": _blocks(), "stats": stats,
               "steady_joins": None if engine.steady is None else engine.steady.joins,
               "steady_kept": None if engine.steady is None else engine.steady.kept}
    snap = engine.stats_snapshot()  # CUDA-event device times (attn_otel.timing.DeviceTimer), read once completed
    results["device_s"] = {k: snap[k] for k in ("stream_device_s", "stream_direct_device_s", "finish_device_s")}
    rows = Calibrated()  # per-row metrics (ATTN_OTEL_GPU_ROWS=all)
    summaries = Calibrated()  # the device's summaries (the default)
    for out, t in runs:
        (cap,) = attn_otel.open_trace(t, store)
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        T = cap.num_tokens
        assert T == len(ids) - 1 and cap.layers == list(range(LAYERS)) and cap.num_heads == HEADS
        fp32, bf16 = hf_references(gpu_model, ids[:T], device="cuda")
        if not cap.has_row_metrics:  # summarised on the device: compare with NumPy's summary of HF's rows
            from attn_otel.metrics import summarize

            def summary(A):
                per_layer = [per_row_metrics(A[li], cap.prompt_len, 4) for li in range(LAYERS)]
                return summarize({n: np.stack([m[n] for m in per_layer]) for n in per_layer[0]}, cap.prompt_len)

            want, alt = summary(fp32), summary(bf16)
            got = cap.summary()
            for part, metrics in want.items():
                for name, ref_stats in metrics.items():
                    if ref_stats is None or got[part].get(name) is None:
                        continue
                    for stat in ("mean", "p10", "p50", "p90"):
                        w, g = np.asarray(ref_stats[stat]), np.asarray(got[part][name][stat])
                        b = np.asarray(alt[part][name][stat])
                        assert np.array_equal(np.isnan(w), np.isnan(g)), (part, name, stat)
                        for li in range(LAYERS):  # each value summarises one layer and head over rows
                            ok = ~np.isnan(w[li])
                            key = f"{'map' if li == 0 else 'streamed'} {part} {name} {stat}"
                            summaries.add(key, np.abs(g[li][ok] - w[li][ok]), np.abs(b[li][ok] - w[li][ok]),
                                          floor=METRIC_FLOOR.get(name, METRIC_FLOOR_DEFAULT))
            continue
        for li in range(LAYERS):
            rows.add_metrics("map " if li == 0 else "streamed ", {n: v[li] for n, v in cap.metrics.items()},
                             fp32[li], bf16[li], cap.prompt_len)
    results["rows_against_hf"] = rows.report()
    results["summaries_against_hf"] = summaries.report()
    print("GPU streamed layers:", json.dumps(results, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_stream.json"), "w") as f:
            json.dump(results, f, indent=1)
    assert "FULL_AND_PIECEWISE" in results["cudagraph_mode"]
    assert results["attention_impl"].startswith("FlashAttention")
    assert stats["captured"] == len(runs) and stats["dropped"] == {}, stats
    assert stats["steady_drift"] == 0  # requests back from the step counter (attn_otel.steady) where vLLM had them
    assert os.environ.get("ATTN_OTEL_STEADY", "1") == "0" or engine.steady.joins > 0  # the counter did count
    assert os.environ.get("ATTN_OTEL_STEADY", "1") == "0" or engine.steady.kept > 0  # and kept members across blocks
    # vLLM's execute_model returned to attn-otel with work left for after the forward's launch (finish batches)
    assert stats["step_host_s"]["after_launch"] > 0, stats["step_host_s"]
    assert results["prefix_cached_tokens"] >= 200
    spill_at = stats.get("spill_at", {})
    if _blocks() <= 96:
        assert results["preemptions"] > 0, "the 96-block cache was meant to force preemptions"
        assert spill_at.get("reuse", 0) > 0, spill_at  # finishing requests' blocks were handed out at once
    else:  # room to hold: no finishing step spilled, their rows were flushed with their batches
        assert spill_at.get("held", 0) > 0 and set(spill_at) <= {"held", "idle"}, spill_at
        assert snap["stream_spilled_blocks"] == 0 and results["preemptions"] == 0, snap
    assert results["stream_flushes"] > 10
    assert results["device_s"]["stream_device_s"] > 0, results["device_s"]  # the flushes' kernels were timed
    if os.environ.get("ATTN_OTEL_STREAM_DIRECT", "1") == "1":  # prefill chunks' rows in the forward, after each
        # streamed layer's attention (PIECEWISE: eager there), decode rows through the ring written in the graphs
        assert engine.stream.direct.computed > 0 and engine.stream.direct.replayed == 0
        assert results["device_s"]["stream_direct_device_s"] > 0, results["device_s"]
        # beside the forward (ATTN_OTEL_DIRECT_STREAM=side) in the forwards with no CUDA graph: the prefill steps
        # here are larger than vLLM's largest graph (2 x max_num_seqs = 64 tokens), so some ran with none
        beside = engine.stream.direct.beside  # (ATTN_OTEL_DIRECT_STREAM's value)
        assert (engine.stream.direct.side_steps > 0) == beside, (beside, engine.stream.direct.side_steps)
    else:
        assert engine.stream.direct.computed == 0
    assert rows.err or summaries.err
    if rows.err:
        rows.check("GPU streamed layers, per-row metrics")
    if summaries.err:
        summaries.check("GPU streamed layers, device summaries")


def test_gpu_map_tap_maps_match_hf_eager(stream_engine, gpu_model):  # noqa: F811
    """The map tap on the device: the streamed map layer keeps only the planned requests' queries, written
    inside the CUDA graphs by slot, their slots pointed a block at a time (attn_otel.tap.MapTap).  Twelve
    requests of many lengths at once, two of every three planned for maps, in the module's 96-block cache, where
    they need more blocks than it has (the preemptions, whose planned requests' slots are unpointed and pointed
    again in new blocks when they resume, are counted in the output): each maps capture of layer 0 is HF eager
    fp32's attention within the calibrated bound, and no planned request lost a query."""
    from preemptions import count_preemptions
    from reference import Calibrated, hf_references
    from vllm import SamplingParams

    import attn_otel
    from attn_otel import vllm_adapter

    llm, store, _ = stream_engine
    (engine,) = vllm_adapter.engines()
    lost = engine.maptap.lost
    preempted = count_preemptions()
    rng = np.random.default_rng(5)
    prompts = [rng.integers(10, 4000, 13 + 29 * i).tolist() for i in range(12)]  # none a whole number of blocks
    traces = [new_trace_id() for _ in prompts]
    modes = ["metrics" if i % 3 == 1 else "maps" for i in range(len(prompts))]
    params = [SamplingParams(max_tokens=21 + 3 * i, temperature=0.0, ignore_eos=True,
                             extra_args={"attn_otel": m, "traceparent": f"00-{t}-{new_span_id()}-01"})
              for i, (t, m) in enumerate(zip(traces, modes))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.step()
    assert engine.flush(120)
    assert engine.maptap.lost == lost
    cal = Calibrated()
    maps = 0
    for out, t, mode in zip(outs, traces, modes):
        (cap,) = attn_otel.open_trace(t, store)
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        T = len(ids) - 1
        assert cap.num_tokens == T
        if mode != "maps":
            assert not cap.has_maps
            continue
        assert cap.has_maps and cap.layers == [0], (cap.layers, cap.has_maps)
        got = cap.maps()
        assert got.shape == (1, HEADS, T, T)
        assert np.abs(got.sum(-1) - 1).max() <= 1e-3  # every stored row sums to 1
        assert np.abs(np.triu(got, 1)).max() == 0.0  # causal
        fp32, bf16 = hf_references(gpu_model, ids[:T], device="cuda")
        cal.add_maps("tv", got, fp32[:1], bf16[:1])
        maps += 1
    assert maps == 8
    results = {"preemptions": len(preempted), "tv": cal.report(), "map_tap_lost": engine.maptap.lost - lost}
    print("GPU map tap:", json.dumps(results, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_map_tap.json"), "w") as f:
            json.dump(results, f, indent=1)
    cal.check("GPU map tap, layer 0 maps")


def test_gpu_engine_stream_runs_above_capture_work(stream_engine):
    """ATTN_OTEL_ENGINE_PRIORITY=high (set by the fixture): the stream vLLM's forwards run on (and its CUDA graphs
    replay into) is the one attn-otel made as the worker set up, at a higher CUDA priority than the side stream
    its flushes and finish kernels run on; the metrics tests above ran under it."""
    from vllm.utils.torch_utils import current_stream

    from attn_otel import engine_stream, vllm_adapter

    (engine,) = vllm_adapter.engines()
    st = engine_stream.state()
    assert st == {"priority": engine_stream.PRIORITY, "raised": True}
    vllm_stream = current_stream()  # this process's engine thread: the in-process engine ran here
    assert vllm_stream.priority == engine_stream.PRIORITY
    assert engine.side.stream.priority == 0 > vllm_stream.priority  # lower number, higher priority
