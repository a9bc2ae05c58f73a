"""Streamed layers in the real vLLM engine (CPU build, SmolLM2 in float32: see ``_run``): per-row metrics of
all 30 layers, 26 of them streamed (computed while the requests run, their queries dropped), equal NumPy's on HF
eager fp32.

The engine runs in its own process (``ATTN_OTEL_MAP_LAYERS`` is read when it starts, and the session's
engine keeps maps of every layer).  Its settings make every path of attn_otel.stream run: chunked prefill
in 64-token steps, a 64-row query ring (it fills every step of a prefill, and every 8 decode steps of 8
requests), the work after the launch run after each step's output (ATTN_OTEL_AFTER_LAUNCH=output), a
prefix-cache hit, and a KV cache of 20 blocks of 32 tokens, too small for the 8 concurrent requests, so
vLLM preempts and recomputes some of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prefetch import Prefetch, params_of, selected

pytestmark = pytest.mark.engine

SCRIPT = r'''
import json, os, sys
import numpy as np
from vllm import LLM, SamplingParams
from attn_otel import vllm_adapter
from attn_otel.ids import new_span_id, new_trace_id
from preemptions import count_preemptions

preempted = count_preemptions()

model = sys.argv[1]
llm = LLM(model=model, max_model_len=512, max_num_batched_tokens=64, max_num_seqs=8, enable_prefix_caching=True,
          block_size=32, num_gpu_blocks_override=int(os.environ["BLOCKS"]) or None, seed=0,
          dtype="float32", compilation_config={"mode": 0, "custom_ops": ["none"]})  # see _run
if os.environ.get("ATTN_OTEL_FINISH_BATCH_REQUESTS"):  # the count the engine's batches are due at (a config)
    (eng0,) = vllm_adapter.engines()
    assert eng0.deferred.max_requests == int(os.environ["ATTN_OTEL_FINISH_BATCH_REQUESTS"])
rng = np.random.default_rng(0)
shared = rng.integers(100, 40000, 150).tolist()
batches = [
    [shared + rng.integers(100, 40000, 40).tolist()],                      # chunked prefill (190 tokens)
    [shared + rng.integers(100, 40000, 20).tolist()],                      # a prefix-cache hit on it
    [rng.integers(100, 40000, 30 + 9 * i).tolist() for i in range(8)],     # 8 at once: the cache overflows
    [rng.integers(100, 40000, 60).tolist()],                               # a maps capture
]
runs = []


def generate(prompts, mode, max_tokens, more=0, idle_step=True):
    """The prompts traced, capture ``mode``, ``max_tokens + more * i`` tokens for the i-th, recorded in ``runs``;
    ``idle_step``: the step after them, which finds the engine idle (and takes their finish batch)."""
    traces = [new_trace_id() for _ in prompts]
    params = [SamplingParams(max_tokens=max_tokens + more * i, temperature=0.0, ignore_eos=True,
                             extra_args={"attn_otel": mode, "traceparent": f"00-{t}-{new_span_id()}-01"})
              for i, t in enumerate(traces)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if idle_step:
        llm.llm_engine.step()
    for o, t in zip(outs, traces):
        runs.append({"trace": t, "ids": list(o.prompt_token_ids) + list(o.outputs[0].token_ids),
                     "prompt_len": len(o.prompt_token_ids), "cached": o.num_cached_tokens or 0, "mode": mode})


for bi, prompts in enumerate(batches):
    generate(prompts, "maps" if bi == 3 else "metrics", 24, more=3)
# a maps request left held (no idle step after it), then one that wants map-tap rows it has: with the held engine's
# 128 rows (_EXTRA) the second one's first step is short of rows, so the batch is due for maps then, and taken
# before that step's rows are given (not after the launch, which would be too late: the second one lost maps)
for _ in range(2):
    generate([rng.integers(100, 40000, 60).tolist()], "maps", 8, idle_step=False)
llm.llm_engine.step()
(engine,) = vllm_adapter.engines()
# one more batch, its finished requests' blocks still held (no idle step after it), then a prefix-cache reset,
# which fails while any block is in use
outs = llm.generate([{"prompt_token_ids": rng.integers(100, 40000, 40).tolist()} for _ in range(2)],
                    [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True) for _ in range(2)], use_tqdm=False)
sched = llm.llm_engine.engine_core.engine_core.scheduler  # (in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0)
hold = sched.__dict__.get("_attn_otel_hold")
held_at_reset = None if hold is None else hold.held
reset = llm.reset_prefix_cache()
llm.llm_engine.step()
assert engine.flush(120)
snap = engine.stats_snapshot()  # the stats file's contents: the counters, percentiles and the engine's gauges
st = engine.stream
pool = sched.kv_cache_manager.block_pool
json.dump({"reset": reset, "held_at_reset": held_at_reset, "hold": None if hold is None else {"held": hold.held, "holds": hold.holds, "skipped": hold.skipped, "early": hold.early},
           "free_blocks": pool.get_num_free_blocks(), "num_blocks": pool.num_gpu_blocks, "runs": runs, "preempted": len(preempted), "stats": snap, "streamed": sorted(engine.streamed),
           "map_layers": list(engine.map_layers), "flushes": st.flushes, "flushed_rows": st.flushed_rows,
           "pending": st.pending(), "ring_rows": st.rows, "keys_tapped": sorted(st.k_tap),
           "finish_batches": engine.deferred.batches},
          open(os.environ["RESULT"], "w"))
'''


def _run(smollm2_path, d: Path, blocks: int, extra: dict | None = None):
    """One engine of SCRIPT in a process of its own, in float32 and with no dynamo trace (compilation mode 0,
    with the traced build's custom ops).  What this module checks is which rows the stream computes, when, and
    from which keys (ring fills, preemptions, reused blocks, held finishes); the dtype and the trace change none
    of it.  In bf16 the CI machine's CPU (no AVX-512 BF16) spent 62% of each engine's requests in bf16 GEMMs
    (py-spy) and the module took 156-162 s.  Streamed rows in bf16 are checked against HF by
    tests/test_engine_variants.py (its models' every layer streamed) and on the GPU by tests/test_gpu_stream.py;
    the dynamo trace by the session engine (tests/conftest.py)."""
    env = {**os.environ, "ATTN_OTEL": "1", "ATTN_OTEL_STORE": str(d / "store"), "ATTN_OTEL_LAYERS": "all",
           "ATTN_OTEL_AFTER_LAUNCH": "output", "ATTN_OTEL_STREAM_DIRECT": "1", "BLOCKS": str(blocks),
           "ATTN_OTEL_HOLD_FINISHED": "1",
           "ATTN_OTEL_ROW_METRICS": "all", "ATTN_OTEL_STREAM_ROWS": "64", "ATTN_OTEL_MAPS_SAMPLE": "0",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "RESULT": str(d / "result.json"),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), str(Path(__file__).parent)])}
    for name in ("ATTN_OTEL_MAP_LAYERS", "ATTN_OTEL_STATS_DIR"):
        env.pop(name, None)
    env.update(extra or {})
    proc = subprocess.run([sys.executable, "-c", SCRIPT, smollm2_path], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads((d / "result.json").read_text()), d / "store"


# the two engines' KV caches (blocks of 32 tokens; 0: vLLM's own, about 1,400)
_BLOCKS = {"streamed_run": 20, "held_run": 0}
# the held engine's finish batches are due at 3 waiting, and such a batch takes the oldest 2 (attn_otel.deferred)
# and its map tap has 128 rows (a maps request of 60 + 8 tokens takes 96: two such do not fit at once)
_EXTRA = {"held_run": {"ATTN_OTEL_FINISH_BATCH_REQUESTS": "3", "ATTN_OTEL_FINISH_BATCH_CHUNK": "2",
                       "ATTN_OTEL_MAP_TAP_TOKENS": "128"}}


@pytest.fixture(scope="module")
def _runs(request, smollm2_path, tmp_path_factory):
    """The engines the selected tests need, both at once (tests/prefetch.py; one after the other they took 85 s
    of CI, together 53 s)."""
    def key_of(item):  # the fixture a test names, or takes by its parameter
        return [k for k in _BLOCKS if k in item.fixturenames or params_of(item).get("which") == k]

    runs = Prefetch()
    for key in selected(request, key_of):
        runs.start(key, _run, smollm2_path, tmp_path_factory.mktemp(key), _BLOCKS[key], _EXTRA.get(key))
    yield runs
    runs.close()


@pytest.fixture(scope="module")
def streamed_run(_runs):
    """A 20-block KV cache: preemptions, and blocks reused in the step after they are freed."""
    return _runs["streamed_run"]


@pytest.fixture(scope="module")
def held_run(_runs):
    """vLLM's own KV cache (about 1,400 blocks of 32 tokens): room for attn_otel.hold."""
    return _runs["held_run"]


def test_streamed_engine_ran_every_path(streamed_run):
    res, _ = streamed_run
    assert res["map_layers"] == [0, 10, 19, 29]
    assert res["streamed"] == list(range(30))  # every plain layer; the map layers also keep a map tap
    assert res["keys_tapped"] == res["streamed"]  # the CPU backend's cache layout is not read; keys are tapped
    assert res["ring_rows"] == 64
    assert res["preempted"] > 0, "the 20-block cache was meant to force preemptions"
    assert any(r["cached"] >= 128 for r in res["runs"]), "the second prompt was meant to hit the prefix cache"
    assert res["flushes"] > 10 and res["pending"] == 0
    stats = res["stats"]
    # prefill chunks' rows computed in the forward (ATTN_OTEL_STREAM_DIRECT=1), decode rows through
    # the ring; on the CPU build every forward is eager, so no plan was left to a CUDA graph
    assert stats["stream_direct_rows"] > 0 and stats["stream_direct_steps"] > 0, stats
    assert stats["stream_direct_replayed"] == 0
    assert stats["captured"] == len(res["runs"]) + 2 and stats["dropped"] == {}, stats
    assert stats["stream_ring_drifts"] == 0  # the device's ring-row counter kept to the host's count
    assert stats["steady_drift"] == 0  # requests back from the step counter (attn_otel.steady) where vLLM had them
    assert stats["steady_joins"] > 0 and stats["steady_kept"] > 0  # and kept across blocks vLLM gave them
    # work no forward waited for ran after the forwards' launches, and (ATTN_OTEL_AFTER_LAUNCH=output) after the
    # engine core took each step's output: elsewhere only before the first step's output was taken
    assert stats["step_host_s"]["after_launch"] > 0, stats["step_host_s"]
    at = stats["after_launch_at"]
    assert at.get("output", 0) > 0 and at.get("sample", 0) + at.get("execute", 0) <= 1, at
    # finished requests' rows flushed and last blocks spilled before the forward where it writes one of their
    # blocks (the 20-block cache reuses blocks at once), left for their batch where it does not
    # (ATTN_OTEL_HOLD_FINISHED=1); the scheduler held no block: it had no room for a whole sequence beside them
    spill_at = stats["spill_at"]
    assert spill_at.get("reuse", 0) > 0 and set(spill_at) <= {"held", "reuse", "idle"}, spill_at
    assert res["hold"]["held"] == res["hold"]["holds"] == 0 and res["hold"]["skipped"] > 0, res["hold"]
    # every batch of finished requests' work is timed (each generate() ends idle, which takes one at least)
    assert res["finish_batches"] >= len(res["runs"]) // 8 + 3, res["finish_batches"]
    assert stats["finish_batch_times"]["n"] == stats["finish_batch_sizes"]["n"] == res["finish_batches"]
    assert stats["finish_batch_times"]["max"] > 0 and stats["finish_batch_sizes"]["max"] >= 1
    # each with the rule that took it (each generate() ends idle: one batch for that at least)
    reasons = stats["finish_batch_reasons"]
    assert sum(reasons.values()) == res["finish_batches"] and reasons.get("idle", 0) >= 1, reasons
    assert set(reasons) <= {"idle", "maps", "count", "age", "reuse"}, reasons
    # the engine's stream waited for capture work only for a named cause, and every wait is counted once
    assert sum(stats["side_stream_wait_causes"].values()) == stats["side_stream_waits"], stats
    assert stats["upload_ring_waits"] == 0  # a CPU build uploads nothing through the pinned ring
    # and every flush of the stream (each one's host time on the engine loop)
    assert stats["stream_flushes"] == res["flushes"] == stats["stream_flush_times"]["n"], stats
    assert 0 < stats["stream_flush_times"]["p50"] <= stats["stream_flush_times"]["max"] <= stats["stream_host_s"]


def test_held_blocks_leave_finished_rows_to_their_batch(held_run):
    """With room in the cache, vLLM's scheduler holds finished requests' uncached blocks until their finish batch
    is due (attn_otel.hold): no step's forward writes one, so no finishing step flushed or spilled on its own;
    their rows were flushed with their batches, several requests a batch, and every held block went back to
    vLLM (the engine ended idle)."""
    res, _ = held_run
    stats = res["stats"]
    assert stats["captured"] == len(res["runs"]) + 2 and stats["dropped"] == {}, stats
    # a prefix-cache reset with blocks held: they went back first, and the reset (which fails while any block is
    # in use) went through
    assert res["held_at_reset"] > 0 and res["reset"] is True, res
    spill_at = stats["spill_at"]
    assert spill_at.get("held", 0) >= 5 and set(spill_at) <= {"held", "idle"}, spill_at
    assert stats["stream_spilled_blocks"] == 0, stats
    assert res["hold"]["holds"] > 0 and res["hold"]["skipped"] == 0 and res["hold"]["held"] == 0, res["hold"]
    assert res["hold"]["early"] == 0, res["hold"]  # nothing given back for want of room
    assert stats["block_hold"] == res["hold"], stats  # the scheduler's hold in the stats (vLLM steps it here)
    iv = stats["step_intervals"]  # the loop's steps that followed a step with tokens, attn-otel's time in each
    assert 0 < iv["n"] < stats["step_times"]["n"] and 0 < iv["attn_share"] < 1, iv
    assert iv["slowest_1pct"]["interval_mean"] >= iv["rest"]["interval_mean"] > iv["rest"]["attn_mean"] >= 0, iv
    gcp = stats["gc_pauses"]  # the collector ran in the engine's process while it served, and was timed
    assert sum(gcp["count"]) >= gcp["pauses"]["n"] > 0 and 0 < gcp["pauses"]["max"] <= max(gcp["max_s"]) + 1e-5, gcp
    # the 8 requests at once finish over 21 steps: their batches took several of them each, and where only the
    # count (3 here) made one due it took the oldest 2 and left the rest held (_EXTRA), none of them lost
    assert stats["finish_batch_sizes"]["max"] >= 2 and res["finish_batches"] < len(res["runs"]) + 2, stats
    assert stats["finish_batch_reasons"].get("count", 0) >= 1, stats["finish_batch_reasons"]
    # a finished maps request waited while no step wanted its map-tap rows, and its batch was due for maps in the
    # step that did: the request after it kept every query (test_streamed_and_map_layers_equal_hf_eager opens its
    # maps), none was skipped for want of rows
    assert stats["finish_batch_reasons"].get("maps", 0) >= 1, stats["finish_batch_reasons"]
    assert "map_rows_missing" not in stats["skipped"] and stats["maps_stored"] == 3, stats
    assert res["free_blocks"] == res["num_blocks"] - 1, res  # all but vLLM's null block
    assert res["preempted"] == 0 and res["pending"] == 0


@pytest.mark.parametrize("which", ["streamed_run", "held_run"])
def test_streamed_and_map_layers_equal_hf_eager(which, request, smollm2_path):
    """Every layer's per-row metrics against NumPy's on HF eager fp32, within FACTOR x HF bf16's own drift on
    the same rows (+ a floor), p50 and p99 pooled over the runs, per metric, for the map and the streamed layers
    apart (tests/reference.py); in the small cache and with held blocks (their rows flushed with their batches)."""
    import attn_otel
    from reference import Calibrated, hf_references

    res, store = request.getfixturevalue(which)
    cal = Calibrated()
    for run in res["runs"]:
        (cap,) = attn_otel.open_trace(run["trace"], store)
        T = len(run["ids"]) - 1
        assert cap.num_tokens == T and cap.prompt_len == run["prompt_len"]
        if run["mode"] == "maps":  # a maps capture covers the map layers
            assert cap.has_maps and cap.layers == res["map_layers"]
        else:
            assert not cap.has_maps and cap.layers == list(range(30))
        fp32, bf16 = hf_references(smollm2_path, run["ids"][:T])
        for li, layer in enumerate(cap.layers):
            group = "streamed " if layer in res["streamed"] else "map "
            cal.add_metrics(group, {name: rows[li] for name, rows in cap.metrics.items()}, fp32[layer], bf16[layer],
                            run["prompt_len"])
    print("per-row metrics against HF eager fp32:", json.dumps(cal.report(), indent=1))
    cal.check("streamed engine")
