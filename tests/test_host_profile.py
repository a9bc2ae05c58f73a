"""bench/host_profile.py: py-spy's collapsed stacks of the server's engine core, summarised per thread (the
online profile of bench/overhead.py with BENCH_PYSPY reads through it)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import host_profile  # noqa: E402

RAW = """\
thread (0x1): MainThread;run_busy_loop (vllm/v1/engine/core.py:900);step (vllm/v1/engine/core.py:400);_before_step (attn_otel/vllm_adapter.py:1097);_track (attn_otel/vllm_adapter.py:1180);schedule (attn_otel/stream.py:320) 30
thread (0x1);run_busy_loop (vllm/v1/engine/core.py:900);step (vllm/v1/engine/core.py:401);Event.synchronize (torch/cuda/streams.py:231) 50
thread (0x1): MainThread;run_busy_loop (vllm/v1/engine/core.py:900);step (vllm/v1/engine/core.py:402);_before_step (attn_otel/vllm_adapter.py:1099);execute_model (vllm/v1/worker/gpu/model_runner.py:88) 20
thread (0x2): attn-otel-compute;_loop (attn_otel/compute.py:60);Condition.wait (threading.py:320) 100
process 7:"python3 -m vllm";thread (0x3): tiny;idle (x.py:1) 1
not a stack line
"""


def test_threads_are_merged_by_id_and_shares_are_per_thread(tmp_path):
    path = tmp_path / "pyspy.txt"
    path.write_text(RAW)
    threads = host_profile.parse(path)
    # the main thread's samples, named on some lines only, are one thread; line numbers are dropped
    assert set(threads) == {"thread (0x1): MainThread", "thread (0x2): attn-otel-compute", "thread (0x3): tiny"}
    assert sum(n for _, n in threads["thread (0x1): MainThread"]) == 100
    text = host_profile.summarise(threads, "attn_otel", top=10)
    main = text.split("## ")[1]
    assert main.startswith("thread (0x1): MainThread: 100 samples")
    assert "100.0%  run_busy_loop (vllm/v1/engine/core.py)" in main  # one entry across lines 900..902
    assert "50.0%  _before_step (attn_otel/vllm_adapter.py)" in main
    self_part = main.split("self:")[1].split("frames matching")[0]
    assert "50.0%  Event.synchronize (torch/cuda/streams.py)" in self_part
    assert "30.0%  schedule (attn_otel/stream.py)" in self_part
    matching = main.split("frames matching 'attn_otel' (inclusive):")[1]
    assert "30.0%  _track (attn_otel/vllm_adapter.py)" in matching and "core.py" not in matching
    assert "tiny" not in text  # a thread with under 1% of the samples is left out


def test_a_missing_or_empty_file_is_an_error_not_a_traceback(tmp_path, capsys):
    assert host_profile.main([str(tmp_path / "none.txt")]) == 2
    empty = tmp_path / "empty.txt"
    empty.write_text("nothing here\n")
    assert host_profile.main([str(empty)]) == 1
    assert "no stacks" in capsys.readouterr().err


OWN = """\
thread (0x1): MainThread;loop (vllm/v1/engine/core.py:1);_before_step (attn_otel/vllm_adapter.py:1);_track (attn_otel/vllm_adapter.py:2);MetricsStream.schedule (attn_otel/stream.py:3);upload (attn_otel/slots.py:4) 10
thread (0x1);loop (vllm/v1/engine/core.py:1);_before_step (attn_otel/vllm_adapter.py:1);Scheduler.schedule (vllm/v1/core/sched/scheduler.py:9) 30
thread (0x1);loop (vllm/v1/engine/core.py:1);_wrap.<locals>.patched (attn_otel/vllm_adapter.py:5);execute_model (vllm/v1/worker/gpu_worker.py:7) 20
thread (0x1);loop (vllm/v1/engine/core.py:1);_wrap.<locals>.patched (attn_otel/vllm_adapter.py:5);_tap_layer.<locals>.forward (attn_otel/vllm_adapter.py:6);MetricsStream.write (attn_otel/stream.py:8) 4
thread (0x1);loop (vllm/v1/engine/core.py:1);_wrap.<locals>.patched (attn_otel/vllm_adapter.py:5);_tap_layer.<locals>.forward (attn_otel/vllm_adapter.py:6);FlashAttentionImpl.forward (vllm/v1/attention/backends/flash_attn.py:3) 6
thread (0x1);loop (vllm/v1/engine/core.py:1);_hand_over_finish_reasons (attn_otel/vllm_adapter.py:9);_finish_batch (attn_otel/vllm_adapter.py:10);CaptureEngine.on_finished_many (attn_otel/capture.py:1);full_rows (attn_otel/stream.py:2) 5
thread (0x1);loop (vllm/v1/engine/core.py:1);_hand_over_finish_reasons (attn_otel/vllm_adapter.py:9);_finish_batch (attn_otel/vllm_adapter.py:10);MetricsStream.finish (attn_otel/stream.py:3) 3
thread (0x1);loop (vllm/v1/engine/core.py:1);_before_step (attn_otel/vllm_adapter.py:1);Side.guard_items (attn_otel/side.py:4) 2
thread (0x1);loop (vllm/v1/engine/core.py:1);Event.synchronize (torch/cuda/streams.py:231) 20
thread (0x1);loop (vllm/v1/engine/core.py:1);patched (attn_otel/vllm_adapter.py:5);_after_launch (attn_otel/vllm_adapter.py:6);decorate_context (torch/utils/_contextlib.py:1);execute_model (vllm/v1/worker/gpu/model_runner.py:2) 40
thread (0x1);loop (vllm/v1/engine/core.py:1);patched (attn_otel/vllm_adapter.py:5);_after_launch (attn_otel/vllm_adapter.py:6);_run_after_launch (attn_otel/vllm_adapter.py:7);flush (attn_otel/stream.py:8);run (triton/runtime/jit.py:9) 6
thread (0x1);loop (vllm/v1/engine/core.py:1);patched (attn_otel/vllm_adapter.py:5);_before_step (attn_otel/vllm_adapter.py:1);_track (attn_otel/vllm_adapter.py:2);update (attn_otel/tracking.py:3) 4
thread (0x1);loop (vllm/v1/engine/core.py:1);result (vllm/v1/executor/uniproc_executor.py:1);synchronize (torch/cuda/streams.py:254) 10
thread (0x2): attn-otel-writer-0;_run (attn_otel/handoff.py:1);WriterPool.write (attn_otel/writers.py:2) 500
"""


def test_own_shares_count_attn_otels_code_not_vllms_inside_its_wrappers(tmp_path, capsys):
    """``--own``: the main thread only (not the busier writer thread); vLLM's scheduler called from the step hook,
    the forward called through the patched method (through torch's decorator too, as py-spy 0.4 names the
    frames) and the attention inside the tapped forward are vLLM's time; the rest is split by part."""
    path = tmp_path / "pyspy.txt"
    path.write_text(OWN)
    own = host_profile.own_shares(host_profile.parse(path))
    assert own["thread"] == "thread (0x1): MainThread" and own["samples"] == 160
    assert own["parts"] == {"schedule": 10 / 160, "taps": 4 / 160, "captures": 5 / 160, "finish rows": 3 / 160,
                            "step bookkeeping": 4 / 160, "after the launch": 6 / 160, "rest": 2 / 160}
    assert abs(own["total"] - 34 / 160) < 1e-12 and own["gpu_wait"] == 30 / 160
    assert host_profile.main([str(path), "--own"]) == 0
    out = capsys.readouterr().out
    assert " 21.2%  total" in out and "waiting for the GPU (synchronize): 18.8%" in out


OFF = """\
thread (0x1): MainThread;loop (vllm/v1/engine/core.py:1);Scheduler.schedule (vllm/v1/core/sched/scheduler.py:9) 30
thread (0x1);loop (vllm/v1/engine/core.py:1);execute_model (vllm/v1/worker/gpu/model_runner.py:2) 40
thread (0x1);loop (vllm/v1/engine/core.py:1);Event.synchronize (torch/cuda/streams.py:231) 20
thread (0x1);loop (vllm/v1/engine/core.py:1);_process_input_queue (vllm/v1/engine/core.py:5);get (queue.py:1) 10
"""


def test_against_capture_off_splits_the_main_thread_four_ways(tmp_path, capsys):
    """``--against``: the main thread's split (GPU wait, request wait, attn-otel's, vLLM's) beside capture off's;
    a stray byte in a frame name (py-spy wrote one in run 33) is read, not a UnicodeDecodeError."""
    on, off = tmp_path / "on.txt", tmp_path / "off.txt"
    on.write_bytes(OWN.encode() + b"thread (0x1);loop (vllm/v1/engine/core.py:1);_process_input_queue (vllm/v1/"
                   b"engine/core.py:5);get (qu\xffeue.py:1) 40\n")
    off.write_text(OFF)
    split = host_profile.main_split(host_profile.parse(on))
    assert split["samples"] == 200 and split["gpu_wait"] == 30 / 200 and split["request_wait"] == 40 / 200
    assert abs(split["attn_otel"] - 34 / 200) < 1e-12 and abs(split["vllm"] - 96 / 200) < 1e-12
    assert host_profile.main([str(on), "--against", str(off)]) == 0
    out = capsys.readouterr().out
    assert "capture off 100" in out
    row = next(line for line in out.splitlines() if line.startswith("waiting for the GPU"))
    assert row.split()[-3:] == ["15.0%", "20.0%", "-5.0"]
    row = next(line for line in out.splitlines() if line.startswith("attn-otel's own code"))
    assert row.split()[-3:] == ["17.0%", "0.0%", "+17.0"]
    assert host_profile.main([str(on), "--against", str(tmp_path / "none.txt")]) == 2


def test_the_samplers_blocked_gemm_launch_is_a_wait_of_its_own_not_vllms_code(tmp_path, capsys):
    """The lm_head GEMM's launch as a sample's own frame (run 49: 0.5% of one capture-off engine's loop, 10.4% of
    the next's, its synchronize shorter by as much) is its own row, out of vLLM's code; the GEMM's frame under
    anything else (a forward's) stays vLLM's."""
    gemm = ("thread (0x1): MainThread;loop (vllm/v1/engine/core.py:1);sample_tokens (vllm/v1/worker/gpu/model_runner."
            "py:2);LlamaForCausalLM.compute_logits (vllm/model_executor/models/llama.py:3);default_unquantized_gemm "
            "(vllm/model_executor/layers/utils.py:98) 25\n"
            "thread (0x1);loop (vllm/v1/engine/core.py:1);forward (vllm/model_executor/models/llama.py:9);"
            "default_unquantized_gemm (vllm/model_executor/layers/utils.py:98) 5\n")
    on, off = tmp_path / "on.txt", tmp_path / "off.txt"
    on.write_text(OFF + gemm)
    off.write_text(OFF)
    split = host_profile.main_split(host_profile.parse(on))
    assert split["samples"] == 130 and split["launch_wait"] == 25 / 130 and split["gpu_wait"] == 20 / 130
    assert abs(split["vllm"] - 75 / 130) < 1e-12 and split["attn_otel"] == 0.0
    assert host_profile.main([str(on), "--against", str(off)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "lm_head GEMM" in line)
    assert row.split()[-3:] == ["19.2%", "0.0%", "+19.2"]
