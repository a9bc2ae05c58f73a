"""bench/trace_gaps.py: the GPU's busy time and idle gaps in a chrome trace, and the host function blamed
for the idle time (the engine-core profile of bench/overhead.py --engine-profile reads through it)."""

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import trace_gaps  # noqa: E402


def _x(cat, name, ts, dur, tid=0):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}


def test_busy_time_is_the_union_and_gaps_are_blamed_on_the_innermost_function(tmp_path):
    events = [
        _x("kernel", "gemm", 0, 1000), _x("kernel", "overlapping", 500, 1000),  # union 0..1500: busy 2.8 of 6 ms
        _x("gpu_memcpy", "Memcpy HtoD", 4500, 500),  # gap 1500..4500 (3 ms)
        _x("kernel", "attn", 5200, 800),  # gap 5000..5200 (0.2 ms)
        _x("python_function", "engine_step", 0, 7000, tid=7),
        _x("python_function", "MetricsStream._flush", 2000, 2000, tid=7),  # holds the middle of the 3 ms gap
        _x("cpu_op", "aten::copy_", 5050, 100, tid=7),
        _x("ac2g", "flow", 0, 0),  # not a duration event of interest
    ]
    path = tmp_path / "t.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    text = trace_gaps.analyse(trace_gaps.load(str(path)))
    assert text.startswith("GPU busy 0.003 s of 0.006 s (46.7%); idle 0.003 s in 2 gaps")
    lines = text.splitlines()
    assert "3.00 ms after 'Memcpy HtoD'" not in text and "3.00 ms after 'overlapping' before 'Memcpy HtoD'" in text
    blamed = [line for line in lines if "tid 7" in line]
    assert "MetricsStream._flush" in blamed[0] and "3000.0 ms" not in blamed[0] and "3.0 ms" in blamed[0]
    assert any("aten::copy_" in line and "0.2 ms" in line for line in blamed)
    assert not any("engine_step" in line for line in blamed)  # an outer frame is not the innermost


def test_a_trace_without_gpu_events_says_so():
    assert trace_gaps.analyse([_x("cpu_op", "aten::mm", 0, 10)]) == "no GPU events\n"


def test_idle_time_is_split_by_gap_size_and_by_the_ops_around_each_gap():
    events = [_x("kernel", "gemm", 0, 100), _x("kernel", "_scatter_rows", 110, 5), _x("kernel", "attn", 125, 100),
              _x("kernel", "_scatter_rows", 235, 5), _x("kernel", "attn", 1240, 10)]
    text = trace_gaps.analyse(events)
    lines = text.splitlines()
    assert "idle 0.001 s in 4 gaps" in lines[0]
    assert any(line.strip().startswith("5-20 us:") and " 3 gaps" in line and "0.0 ms" in line for line in lines)
    assert any(line.strip().startswith(">= 0.5 ms:") and " 1 gaps" in line and "1.0 ms" in line for line in lines)
    i = lines.index("idle time (all gaps) by the device op that ends the gap:")
    assert "1.0 ms in      2 gaps before 'attn'" in lines[i + 1]
    assert "0.0 ms in      2 gaps before '_scatter_rows'" in lines[i + 2]
    j = lines.index("idle time (all gaps) by the device op that starts the gap:")
    assert "1.0 ms in      2 gaps after '_scatter_rows'" in lines[j + 1]


def test_cuda_runtime_calls_are_listed_per_thread_and_can_take_the_blame():
    """A host thread stuck in a CUDA call (cudaHostAlloc holding the driver lock, run 11) shows up both in
    the per-thread list of runtime calls and as the innermost function at an idle gap's middle."""
    events = [_x("kernel", "gemm", 0, 100), _x("kernel", "attn", 2100, 100),  # a 2 ms gap: 100..2100
              _x("cuda_runtime", "cudaHostAlloc", 50, 1500, tid=9), _x("cuda_runtime", "cudaHostAlloc", 3000, 500, tid=9),
              _x("python_function", "step", 0, 3000, tid=7),
              _x("cuda_runtime", "cudaPointerGetAttributes", 900, 400, tid=7),
              _x("cuda_driver", "cuLaunchKernel", 2050, 10, tid=7)]
    text = trace_gaps.analyse(events)
    lines = text.splitlines()
    i = lines.index("host time in CUDA runtime/driver calls, per thread (the longest):")
    assert "2.0 ms in       2 calls (max    1.50 ms)  tid 9  cudaHostAlloc" in lines[i + 1]
    assert "cudaPointerGetAttributes" in lines[i + 2] and "tid 7" in lines[i + 2]
    blamed = lines[lines.index("idle time (gaps >= 0.2 ms) by the innermost host function at the gap's middle, "
                               "per thread:") + 1:]
    assert any("tid 9  cudaHostAlloc" in line and "2.0 ms" in line for line in blamed)
    assert any("tid 7  cudaPointerGetAttributes" in line for line in blamed)  # 900..1300 holds the middle, 1100


def _k(name, ts, dur, corr, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr, "stream": stream}}


def _launch(ts, corr, tid=7):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts, "dur": 5, "tid": tid,
            "args": {"correlation": corr}}


def _step(ts, dur, ctx, ctx_tok, gen, gen_tok):
    return _x("user_annotation", f"execute_context_{ctx}({ctx_tok})_generation_{gen}({gen_tok})", ts, dur, tid=7)


def test_the_summary_puts_each_kernel_in_the_step_that_launched_it():
    """Kernels go to the step whose host range holds their launch (a graph's kernels share its correlation id),
    attn-otel's by name, the rest as vLLM's; a launch outside every step, or on another thread inside one (a
    capture thread's), is counted by
    stream; idle before a step runs from the previous step's last kernel to its first."""
    events = [
        _step(0, 50, 2, 900, 0, 0), _launch(10, 1), _k("gemm", 100, 400, 1), _k("_scatter_rows_0d1", 500, 20, 1),
        _step(60, 40, 0, 0, 3, 3), _launch(70, 2), _k("gemm", 600, 100, 2), _k("flash_fwd", 700, 50, 2),
        _step(110, 40, 0, 0, 3, 3), _launch(120, 3), _k("gemm", 800, 100, 3),
        _launch(130, 4, tid=9), _k("_row_metrics", 905, 30, 4, stream=13),  # the stream's flush, from its thread
        _launch(200, 5), _k("memcpy-ish", 1000, 10, 5),  # after the last step's range: outside
        _launch(210, 6), _k("sampler", 760, 20, 6),  # outside too, in the GPU's gap before step 3: not idle
    ]
    s = trace_gaps.summary(events)
    assert s["steps"] == 3
    pre, dec = s["kinds"]["prefill"], s["kinds"]["decode 1-8"]
    assert (pre["steps"], pre["tokens"], pre["vllm_us"], pre["own_us"], pre["span_us"]) == (1, 900, 400, 20, 420)
    assert (dec["steps"], dec["tokens"], dec["vllm_us"], dec["own_us"], dec["span_us"]) == (2, 6, 250, 0, 250)
    assert dec["idle_before_us"] == 80 + 30  # 520 -> 600; 750 -> 800 but for the sampler's 760 -> 780
    assert pre["idle_in_us"] == 0 and dec["idle_in_us"] == 0
    assert (pre["attention_us"], dec["attention_us"]) == (0, 50)  # flash_fwd: vLLM's attention, by name
    assert s["outside_us"] == {"stream 13 attn-otel": 30, "stream 7 other": 30}
    assert s["by_name_us"] == {"own in steps": {"_scatter_rows_0d1": 20},
                               "outside steps": {"_row_metrics": 30, "sampler": 20, "memcpy-ish": 10}}
    assert (s["span_us"], s["busy_us"], s["idle_us"]) == (910, 730, 180)
    assert trace_gaps.step_kind(0, 0, 200) == "decode 193-256" and trace_gaps.step_kind(0, 0, 600) == "decode > 512"


def test_compare_sets_two_summaries_side_by_side_by_step_kind(tmp_path):
    off = trace_gaps.summary([_step(0, 50, 0, 0, 3, 3), _launch(10, 1), _k("gemm", 100, 400, 1)])
    on = trace_gaps.summary([_step(0, 50, 0, 0, 3, 3), _launch(10, 1), _k("gemm", 100, 440, 1),
                             _k("_ring_advance", 545, 10, 1), _step(60, 50, 1, 64, 0, 0)])
    text = trace_gaps.compare(off, on)
    assert "| decode 1-8 | 0 / 0 | - |" in text  # no attention kernel in these steps
    assert "| decode 1-8 | 1 / 1 | 3 / 3 | 400 / 440 | x1.100 | 10 | 400 / 455 | x1.137 | 0 / 0 | 0 / 5 |" in text
    assert "| prefill | None / None |" not in text and "steps 1 / 2" in text
    assert "        0 /        10  _ring_advance" in text.split("own in steps, the longest by kernel, us (off / on):")[1]
    changes = text.split("the largest changes (time us, launches; on - off):")[1].splitlines()
    assert changes[1].split() == ["+40", "us", "+0", "gemm"] and changes[2].split() == ["+10", "us", "+1", "_ring_advance"]
    (tmp_path / "a.json").write_text(json.dumps(off))
    (tmp_path / "b.json").write_text(json.dumps(on))
    assert trace_gaps.main(["--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0


def test_compare_sets_attn_otels_kernels_against_vllms_attention_per_step_kind():
    """vLLM's attention kernels are found by name (FlashAttention-3's, its combine, the Triton backend's), not its
    KV-cache write; the compare prints them per step and attn-otel's kernels as a share of them (run 52 had to
    estimate the prefill's attention time from a whole-run total)."""
    def trace(own):
        ev = [_step(0, 50, 1, 4096, 0, 0), _launch(10, 1), _k("gemm", 100, 400, 1),
              _k("void cutlass::device_kernel<flash::enable_sm90_or_later<flas", 500, 300, 1),
              _k("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16", 800, 10, 1),
              _step(60, 50, 0, 0, 3, 3), _launch(70, 2), _k("kernel_unified_attention_2d", 900, 40, 2)]
        return ev + ([_k("_row_metrics", 810, 75, 1)] if own else [])
    off, on = trace_gaps.summary(trace(False)), trace_gaps.summary(trace(True))
    assert on["kinds"]["prefill"]["attention_us"] == 300 and on["kinds"]["decode 1-8"]["attention_us"] == 40
    text = trace_gaps.compare(off, on)
    assert "| prefill | 300 / 300 | 0.250 |" in text and "| decode 1-8 | 40 / 40 | 0.000 |" in text
    old = {**off, "kinds": {k: {n: v for n, v in d.items() if n != "attention_us"} for k, d in off["kinds"].items()}}
    assert "vLLM's attention kernels a step" not in trace_gaps.compare(old, on)  # a summary from before run 52


def test_idle_time_is_put_on_the_host_code_that_launched_the_op_the_gpu_waited_for():
    """With correlation ids (every torch trace has them) the op that ends a gap is traced back to its launch: the
    innermost attn-otel frame holding it (a trace with stacks), else the innermost CPU op; vLLM's own code
    keeps its innermost frame."""
    events = [
        _k("gemm", 0, 100, 1), _k("gather", 1100, 10, 2), _k("attn", 1300, 10, 3), _k("fill", 1500, 10, 4),
        _x("python_function", "vllm/v1/worker/gpu_model_runner.py(100): execute_model", 0, 2000, tid=7),
        _x("python_function", "attn_otel/finish.py(208): _chunk", 900, 300, tid=7),
        _x("cpu_op", "aten::index_select", 1000, 50, tid=7),  # inside attn-otel's frame: the frame is named
        _launch(1010, 2),
        _x("cpu_op", "aten::mm", 1200, 50, tid=7), _launch(1210, 3),  # vLLM's: its innermost op
        _launch(1400, 4, tid=8),  # a thread with no frames: the runtime call itself
        _launch(-10, 1),
    ]
    text = trace_gaps.analyse(events)
    lines = text.splitlines()
    i = lines.index("idle time (gaps >= 5 us) by the host code that launched the op ending the gap:")
    rows = lines[i + 1:i + 4]
    assert "1.0 ms in      1 gaps  attn_otel/finish.py(208): _chunk" in rows[0]
    assert any("0.2 ms in      1 gaps  cudaGraphLaunch" in r for r in rows)  # tid 8
    assert any("aten::mm" in r and "0.2 ms" in r for r in rows)
    assert "aten::index_select" not in text.split("by the host code that launched")[1].split("\n\n")[0]
