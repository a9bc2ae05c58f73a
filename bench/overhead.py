"""Capture overhead on production-sized vLLM: throughput, latency and KV-cache capacity against capture off.

Runs on the GPU machine (vLLM 0.26 from ../shared/tools/gpu-vllm), one engine per configuration, each in
vLLM's default serving config (CUDA graphs, chunked prefill, prefix caching, multiprocess engine core):

  off       ATTN_OTEL unset
  default   ATTN_OTEL=1 and nothing else: the default 4 layers, maps for the default 1% of requests
  all       ATTN_OTEL=1 ATTN_OTEL_LAYERS=all
  eager     capture off, enforce_eager, no chunked prefill, no prefix caching (a reference, no target)

(Each configuration gets a temporary store and stats directory; that is all it is told besides the above.)
The model is Llama-3-8B-shaped with dummy weights (hidden 4096, 32 layers, 32/8 heads, head_dim 128).
Offline workloads (bench/workloads.py): 512+256, 8k+128, mixed (lognormal lengths, shared system prompts,
some long requests), kv_bound (more tokens in flight than the cache holds); each runs once to warm up, then
``--repeats`` times, the median counting.  The online workload (bench/online.py) serves the same model with
vLLM's OpenAI server under Poisson arrivals at 80% of the capacity measured with capture off.

    python3 bench/overhead.py --phase off --phase default --phase all --out DIR   # offline
    python3 bench/overhead.py --online off --online default --online all --out DIR
    python3 bench/overhead.py --report --out DIR     # DIR/overhead.json, overhead.png, overhead-table.md

Phases can run in separate calls (results go to DIR/phase-*.json and DIR/online-*.json) and are merged by
``--report``.

Where the online latency goes: ``BENCH_PYSPY=/path/to/py-spy`` samples the server's engine-core process
during the measured runs (DIR/pyspy-online-PHASE.txt; offline, DIR/pyspy-PHASE-WORKLOAD.txt with ``+`` as ``_``;
``bench/host_profile.py`` summarises it; ``BENCH_PYSPY_GIL=1``: only the thread holding the GIL;
``BENCH_PYSPY_NATIVE=1``: C frames too), and ``--capacity REQ_S`` loads at 80% of a capacity measured before
instead of measuring it again:

    BENCH_PYSPY=/tmp/pyspy/bin/py-spy python3 bench/overhead.py --online off --online default --capacity 39.47 --out DIR
    python3 bench/host_profile.py DIR/pyspy-online-default.txt --match attn_otel
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 16384, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False, "hidden_act": "silu",
    "bos_token_id": 128000, "eos_token_id": 128001,
}
# DeepSeek-V2-Lite's shape (16B parameters, 2.4B active; MLA: latent 512 + rope 64, 16 heads of nope 128 and
# v 128; 64 routed experts, 6 per token, 2 shared), the largest DeepSeek-class model one H100 holds in bf16;
# the vocabulary is DeepSeek-V3's, so that every workload's token ids are in range.
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
    "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
    "max_position_embeddings": 163840, "rope_theta": 10000, "routed_scaling_factor": 1.0, "topk_method": "greedy",
    "scoring_func": "softmax", "norm_topk_prob": False, "n_group": 1, "topk_group": 1, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 100000,
    "eos_token_id": 100001,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}
MODELS = {"llama3-8b": LLAMA3_8B, "deepseek-v2-lite": DEEPSEEK_V2_LITE}
MODEL = ["llama3-8b"]  # --model
CAPACITY = [0.0]  # --capacity
sys.path.insert(0, str(Path(__file__).resolve().parent))
import code_id  # noqa: E402
import online  # noqa: E402
import workloads  # noqa: E402

WORKLOADS = workloads.NAMES
PHASE_ENV = {"off": {}, "default": {"ATTN_OTEL": "1"}, "all": {"ATTN_OTEL": "1", "ATTN_OTEL_LAYERS": "all"},
             "eager": {},
             # diagnostics of the default's online latency: Python's own GIL switch interval (5 ms), no maps
             "default-gil5": {"ATTN_OTEL": "1", "ATTN_OTEL_GIL_SWITCH_MS": "0"},
             "default-nomaps": {"ATTN_OTEL": "1", "ATTN_OTEL_MAPS_SAMPLE": "0"},
             # finished requests' capture work in the step each finishes, not batched over 16 steps (run 21:
             # the batched default's ITL p99 was x1.40 against run 18's code's x1.26 on one machine)
             "default-finish0": {"ATTN_OTEL": "1", "ATTN_OTEL_FINISH_BATCH_STEPS": "0"},
             # a query ring twice the server's 8,192-token step: a full step then never waits for the flush of
             # the rows before it (run 22: the tail is per-step host work; the flushes' share is in the stats'
             # stream_flush_times)
             "default-rows16k": {"ATTN_OTEL": "1", "ATTN_OTEL_STREAM_ROWS": "16384"},
             # offline the engine's step is up to 16,384 tokens and the ring as many rows: twice that (session 59:
             # 103 of the mixed workload's 175 forwards that waited on the side stream waited for the ring)
             "default-rows32k": {"ATTN_OTEL": "1", "ATTN_OTEL_STREAM_ROWS": "32768"},
             # direct rows beside the forward, set explicitly: the default since 20a6963 (run 47 measured it so)
             "default-direct": {"ATTN_OTEL": "1", "ATTN_OTEL_STREAM_DIRECT": "1", "ATTN_OTEL_DIRECT_STREAM": "side"},
             # the default before 20a6963: the 4 layers' prefill rows through the ring of a step, flushed on the
             # side stream (run 45's figures)
             "default-ring": {"ATTN_OTEL": "1", "ATTN_OTEL_STREAM_DIRECT": "0"},
             # all layers with the direct rows' kernels beside the forward, set explicitly (the default since
             # 20a6963), and with them on vLLM's stream in the forward's order (run 47: the two alike)
             "all-side": {"ATTN_OTEL": "1", "ATTN_OTEL_LAYERS": "all", "ATTN_OTEL_DIRECT_STREAM": "side"},
             "all-engine": {"ATTN_OTEL": "1", "ATTN_OTEL_LAYERS": "all", "ATTN_OTEL_DIRECT_STREAM": "engine"},
             # the work after the launch after the step's sampler is enqueued, or after the engine core took the
             # step's output, against the default's as execute_model returns (run 49: x0.993 / x0.987 against
             # x0.986, within the runs' spread; ab-2026-12-03.json)
             "default-sample": {"ATTN_OTEL": "1", "ATTN_OTEL_AFTER_LAUNCH": "sample"},
             "default-output": {"ATTN_OTEL": "1", "ATTN_OTEL_AFTER_LAUNCH": "output"},
             # a finish batch due by its count (64 waiting) or for maps takes the oldest 32 (maps first), not all
             # (run 50's profile: batches of 64 held the loop past the tail's short forwards; the A/B, measured as
             # the default against default-chunk0: x0.979 against x0.982, so whole batches stay the default)
             "default-chunk32": {"ATTN_OTEL": "1", "ATTN_OTEL_FINISH_BATCH_CHUNK": "32"},
             "default-chunk0": {"ATTN_OTEL": "1", "ATTN_OTEL_FINISH_BATCH_CHUNK": "0"},
             # a finish batch due at 256 (or 32) waiting, not 64: the lock-stepped tail's captures left to the age
             # rule or the idle step, or taken in smaller batches (run 51, H100, 512+256: 256 gave x0.9956 against
             # the default's x0.9962 with 10 batches against 25, within the spread; 32 not measured)
             "default-batch256": {"ATTN_OTEL": "1", "ATTN_OTEL_FINISH_BATCH_REQUESTS": "256"},
             "default-batch32": {"ATTN_OTEL": "1", "ATTN_OTEL_FINISH_BATCH_REQUESTS": "32"},
             # the age rule at 64 steps, not 16: in run 51 (H100) kv_bound took 92 batches of about 11 requests, mostly
             # due by age; fewer, larger ones (more of them due by reuse instead) (not measured yet)
             "default-steps64": {"ATTN_OTEL": "1", "ATTN_OTEL_FINISH_BATCH_STEPS": "64"}}
EXTRA_ENV: dict[str, str] = {}  # --env: one switch on top of every phase that captures (an A/B on one machine)


def _phase_env(phase: str) -> dict[str, str]:
    """A phase's attn-otel variables: its own, then --env's (not for off, which is the reference)."""
    return {**PHASE_ENV[phase], **(EXTRA_ENV if PHASE_ENV[phase] else {})}


def _model_dir() -> str:
    d = Path(tempfile.gettempdir()) / f"attn-otel-bench-{MODEL[0]}"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(MODELS[MODEL[0]]))
    return str(d)


def _cpu_by_thread() -> dict[str, float]:
    """CPU seconds (user + system) so far of this process and its descendants (the engine core, the
    writer processes), summed by ``process name/thread name`` (Linux /proc; {} elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    procs: dict[int, tuple[int, str]] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1: stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        procs[int(d.name)] = (int(rest[1]), name)
    mine, grew = {os.getpid()}, True
    while grew:
        grew = False
        for pid, (ppid, _) in procs.items():
            if ppid in mine and pid not in mine:
                mine.add(pid)
                grew = True
    out: dict[str, float] = {}
    for pid in mine:
        for t in Path(f"/proc/{pid}/task").glob("[0-9]*"):
            try:
                stat = (t / "stat").read_text()
            except OSError:
                continue
            tname, rest = stat[stat.index("(") + 1: stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            key = f"{procs[pid][1]}/{tname}"
            out[key] = out.get(key, 0.0) + (int(rest[11]) + int(rest[12])) / tick
    return out


def _cpu_delta(before: dict[str, float], after: dict[str, float], top: int = 12) -> dict[str, float]:
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    return {k: round(v, 2) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top] if v > 0}


def _run_workload(llm, name: str, maps_fraction: float, seed: int):
    """One run of workload ``name``; ``maps_fraction`` > 0 asks maps for that share of requests explicitly
    (the profiles' "maps" runs; the default configuration's own 1% sample needs nothing)."""
    import numpy as np
    from vllm import SamplingParams

    reqs = workloads.requests(name, seed)
    every = int(round(1 / maps_fraction)) if maps_fraction else 0
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(max_tokens=olen, ignore_eos=True, temperature=0.0,
                             extra_args={"attn_otel": "maps"} if every and i % every == 0 else None)
              for i, (_, olen) in enumerate(reqs)]
    cpu0 = _cpu_by_thread()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    cpu = _cpu_delta(cpu0, _cpu_by_thread())
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = [o.metrics.first_token_latency for o in outs if o.metrics is not None]
    itl = [(o.metrics.last_token_ts - o.metrics.first_token_ts) / max(1, o.metrics.num_generation_tokens - 1)
           for o in outs if o.metrics is not None]

    def pct(v, q):
        return float(np.quantile(v, q)) if v else None

    return {"output_tokens_per_s": out_tokens / wall, "wall_s": wall, "requests": len(reqs),
            "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs),
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
            "itl_p50_s": pct(itl, 0.5), "itl_p99_s": pct(itl, 0.99),
            "cpu_s": cpu}  # CPU seconds in the run, by process/thread (the busiest)


STATS_WAIT_S = 1.5  # the engine core rewrites its stats file every second (attn_otel.capture)
DRAIN_TIMEOUT_S = 60.0  # the longest wait for a warm-up's captures to be written (bench.overhead.drain)
DEVICE_PARTS = ("stream_device_s", "stream_direct_device_s", "finish_device_s")
# The online report: each configuration's medians over its runs (and capture off's), and the ratios to off's
ONLINE_MEDIANS = ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "tpot_p50_s",
                  "tpot_p99_s", "goodput_req_s", "slo_met", "complete")
ONLINE_RATIOS = ("ttft_p99_s", "itl_p99_s", "goodput_req_s", "ttft_p50_s", "itl_p50_s", "tpot_p50_s", "tpot_p99_s")


def _latest_stats(stats_dir: Path) -> dict:
    """The engine core's capture stats as last written (``{}`` before the first)."""
    files = sorted(stats_dir.glob("attn-otel-stats-*.json"))
    try:
        return json.loads(files[-1].read_text()) if files else {}
    except (OSError, ValueError):  # replaced atomically, so only a file gone since the glob
        return {}


def drain(stats_dir: Path, capturing: bool, timeout_s: float = DRAIN_TIMEOUT_S) -> float | None:
    """Wait until the engine's captures so far are written or dropped (its stats file's ``stored`` and
    ``dropped`` reach ``captured``), at least :data:`STATS_WAIT_S` (the file is rewritten every second; capture
    off: that pause alone, so that every phase pauses alike).  Returns the seconds waited, or None where the
    backlog was still there after ``timeout_s`` (the measurement then goes on; the figure says so)."""
    t0 = time.perf_counter()
    time.sleep(STATS_WAIT_S)
    if not capturing:
        return round(time.perf_counter() - t0, 2)
    while True:
        snap = _latest_stats(stats_dir)
        done = int(snap.get("stored", 0)) + sum(int(v) for v in (snap.get("dropped") or {}).values())
        if snap and done >= int(snap.get("captured", 0)):
            return round(time.perf_counter() - t0, 2)
        if time.perf_counter() - t0 > timeout_s:
            return None
        time.sleep(0.5)


def capture_delta(before: dict, after: dict, serving_s: float) -> dict:
    """What the capture did between two stats snapshots of one engine over ``serving_s`` seconds of serving:
    attn-otel's GPU time (its kernels, timed with CUDA events) by part and in all, as a share of the serving
    time, its host time on the engine loop, the captures stored and dropped, and the garbage collector's pauses in
    the engine core by generation (``gc``: how many and their seconds; a full collection stops the engine loop)."""
    def num(d: dict, k: str) -> float:
        return float(d.get(k) or 0.0)

    parts = {k: num(after, k) - num(before, k) for k in DEVICE_PARTS}
    gpu = sum(parts.values())
    h0, h1 = before.get("step_host_s") or {}, after.get("step_host_s") or {}
    host_parts = {k: round(v - h0.get(k, 0.0), 4) for k, v in h1.items()}
    host = sum(host_parts.values())
    was = before.get("dropped") or {}
    dropped = {r: n - was.get(r, 0) for r, n in (after.get("dropped") or {}).items() if n - was.get(r, 0)}
    g0, g1 = before.get("gc_pauses") or {}, after.get("gc_pauses") or {}
    gc_d = {k: [round(y - x, 4) for x, y in zip(g0.get(k) or [0, 0, 0], g1.get(k) or [0, 0, 0])]
            for k in ("count", "total_s")}
    return {"serving_s": serving_s, **parts, "gpu_s": gpu, "gpu_share": gpu / serving_s if serving_s > 0 else None,
            "gc": gc_d,
            "host_s": host, "host_share": host / serving_s if serving_s > 0 else None, "host_parts": host_parts,
            "finish_batches": int(num(after.get("finish_batch_times") or {}, "n")
                                  - num(before.get("finish_batch_times") or {}, "n")),
            "stored": int(num(after, "stored") - num(before, "stored")), "dropped": dropped}


def run_phase(phase: str, out: Path, repeats: int, wls: list[str], warm_runs: int = 1, per_run: bool = False) -> dict:
    """One engine of ``phase`` over the workloads ``wls``: ``warm_runs`` warm-up runs of each (other seeds), then
    ``repeats`` measured runs, seeds 0, 1, ...; DIR/phase-PHASE.json after each workload.  ``per_run``: a pause of
    STATS_WAIT_S before each measured run and after the last (in every phase, capture off's too, so that the runs
    see the same idle gaps) and, with capture on, each run's own capture delta (``run_deltas``, the warm-up's
    first), to tell which run pays what."""
    warm_runs = max(1, warm_runs)
    stats_dir = Path(tempfile.mkdtemp(prefix=f"attn-otel-stats-{phase}-"))
    store = Path(tempfile.mkdtemp(prefix=f"attn-otel-store-{phase}-"))
    env = {"ATTN_OTEL_STORE": str(store), "ATTN_OTEL_STATS_DIR": str(stats_dir), **_phase_env(phase)}
    for k in [k for k in os.environ if k.startswith("ATTN_OTEL")]:
        os.environ.pop(k, None)
    kwargs = dict(model=_model_dir(), load_format="dummy", skip_tokenizer_init=True, max_model_len=8704,
                  gpu_memory_utilization=0.9, seed=0, disable_log_stats=False)
    if phase == "eager":
        kwargs.update(enforce_eager=True, enable_prefix_caching=False, enable_chunked_prefill=False)
    os.environ.update(env)
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - t0
    cache = llm.llm_engine.vllm_config.cache_config
    import torch
    import vllm

    kv_write = None  # as the capture engine reads it (a bad value: its default)
    if phase in ("default", "all"):
        from attn_otel.config import Config

        kv_write = Config.from_env().kv_write
    gpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip()
    result = {"phase": phase, "model": MODEL[0], "device": torch.cuda.get_device_name(0), "gpu": gpu,
              "vllm_version": vllm.__version__, "date": datetime.date.today().isoformat(),
              "code_digest": _code_digest(), "env": dict(EXTRA_ENV), "engine_start_s": start_s,
              "kv_cache_blocks": cache.num_gpu_blocks, "block_size": cache.block_size,
              "kv_cache_tokens": (cache.num_gpu_blocks or 0) * cache.block_size, "runs": {},
              "kv_write": kv_write, "warm_runs": warm_runs}
    if PHASE_ENV[phase]:  # a stats file written after vLLM's start-up collections (gc.freeze), not before them
        time.sleep(STATS_WAIT_S)
    before = _latest_stats(stats_dir)
    for wl in wls:
        warms = [_run_workload(llm, wl, 0.0, seed=99 - i) for i in range(warm_runs)]  # warm-up (prefix
        warm = {"wall_s": sum(w["wall_s"] for w in warms)}  # cache stays cold: other seeds below)
        runs, marks = [], []  # marks: the stats before each measured run and after the last (per_run)

        def mark():  # the same pause in every phase, capture off's too: the stats file is rewritten every second
            time.sleep(STATS_WAIT_S)
            marks.append(_latest_stats(stats_dir) if PHASE_ENV[phase] else {})

        with online.HostProfile(os.getpid(), out / f"pyspy-{phase}-{wl.replace('+', '_')}.txt"):  # BENCH_PYSPY set
            # ("+" out of the name: the device tool brings back no file whose name has one)
            for s in range(repeats):
                if per_run:
                    mark()
                runs.append(_run_workload(llm, wl, 0.0, seed=s))
            if per_run:
                mark()
        best = sorted(runs, key=lambda r: r["output_tokens_per_s"])[len(runs) // 2]
        result["runs"][wl] = best | {"all_tokens_per_s": [r["output_tokens_per_s"] for r in runs]}
        if per_run and PHASE_ENV[phase]:  # the warm-up's delta first, then each measured run's
            result["runs"][wl]["run_deltas"] = [capture_delta(x, y, r["wall_s"])
                                                for x, y, r in zip([before] + marks, marks, [warm] + runs)]
        print(f"[{phase}] {wl}: {best['output_tokens_per_s']:.0f} tok/s "
              f"(runs {[round(r['output_tokens_per_s']) for r in runs]})", flush=True)
        if PHASE_ENV[phase]:  # this workload's share of the capture stats (the warm-up's included)
            time.sleep(STATS_WAIT_S)
            after = _latest_stats(stats_dir)
            delta = capture_delta(before, after, warm["wall_s"] + sum(r["wall_s"] for r in runs))
            result["runs"][wl]["capture_delta"] = delta
            result["capture"] = after  # so far: the end of the phase replaces it
            before = after
            print(f"[{phase}] {wl}: attn-otel GPU time {delta['gpu_s']:.2f} s, {delta['gpu_share'] or 0:.1%} of "
                  f"{delta['serving_s']:.0f} s serving; the engine core's collections by generation "
                  f"{delta['gc']['count']} ({delta['gc']['total_s']} s)", flush=True)
        (out / f"phase-{phase}.json").write_text(json.dumps(result, indent=1))  # kept if a later workload dies
    del llm
    gc.collect()
    time.sleep(5)  # the engine core process writes its last stats at exit
    files = sorted(stats_dir.glob("attn-otel-stats-*.json"))
    if files:
        result["capture"] = json.loads(files[-1].read_text())
    (out / f"phase-{phase}.json").write_text(json.dumps(result, indent=1))
    return result


def _profile_llm(phase: str, **kwargs):
    """The engine of ``phase`` for a profile (capture settings as in :func:`run_phase`, no stats dir)."""
    store = Path(tempfile.mkdtemp(prefix=f"attn-otel-store-{phase}-"))
    for k in [k for k in os.environ if k.startswith("ATTN_OTEL")]:
        os.environ.pop(k, None)
    os.environ.update({"ATTN_OTEL_STORE": str(store), **_phase_env(phase)})
    from vllm import LLM

    return LLM(model=_model_dir(), load_format="dummy", skip_tokenizer_init=True, max_model_len=8704,
               gpu_memory_utilization=0.9, seed=0, **kwargs)


def profile_phase(phase: str, out: Path, workload: str, stacks: bool = False) -> None:
    """One warm workload run of ``phase`` under torch.profiler, the engine in this process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0): where the GPU and the host spend their time (profile-PHASE.txt).
    ``stacks``: Python frames too, so that the GPU's idle time is put on the attn-otel function that launched
    the op it waited for, and on what the host was in meanwhile (bench/trace_gaps.py)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import trace_gaps

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = _profile_llm(phase)
    _run_workload(llm, workload, 0.0, seed=99)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, with_stack=stacks) as prof:
        res = _run_workload(llm, workload, 0.0, seed=1)
    ka = prof.key_averages()
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        idle = trace_gaps.analyse(trace_gaps.load(trace))
    text = (f"# {phase} {workload}: {res['output_tokens_per_s']:.0f} tok/s under the profiler\n\n"
            "## GPU idle\n" + idle + "\n"
            "## by device time\n" + ka.table(sort_by="self_cuda_time_total", row_limit=45) +
            "\n## by host time\n" + ka.table(sort_by="self_cpu_time_total", row_limit=45))
    (out / f"profile-{phase}.txt").write_text(text)
    print(text[:6000], flush=True)


def engine_profile(phase: str, out: Path, workload: str, stacks: bool = False, maps_fraction: float = 0.0,
                   steps: int = 0, delay: int = 0, warm_runs: int = 2) -> None:
    """One warm workload run of ``phase`` with vLLM's own torch profiler in the engine core process (the
    multiprocess engine, as measured): its trace and table go to DIR/vllm-profile-PHASE/, and where the GPU
    waits (bench/trace_gaps.py) to DIR/vllm-profile-PHASE.txt.  ``stacks`` records Python functions too
    (the idle time is then blamed on them, not only on torch ops), but an 8 s run's trace then takes more
    than 5 minutes to write.  ``steps`` > 0 keeps the trace to that many engine steps from the run's start,
    or with ``delay`` from that many steps into the run; the trace's summary by step (``trace_gaps.summary``)
    goes to DIR/vllm-profile-PHASE.json, for ``trace_gaps.py --compare`` against another phase's.
    ``warm_runs``: the workload runs before the one profiled (1: one metrics run, no maps warm-up).
    The trace is written plain (no gzip) and vLLM's own CUDA-time table is skipped: on a 512+256 run (about
    330 steps) the two took the profile past 100 s on an H100 (run 28)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import trace_gaps

    tag = f"{phase}-maps" if maps_fraction else phase
    prof_dir = out / f"vllm-profile-{tag}"
    prof_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    llm = _profile_llm(phase, profiler_config={"profiler": "torch", "torch_profiler_dir": str(prof_dir),
                                               "torch_profiler_with_stack": stacks,
                                               "torch_profiler_use_gzip": False,
                                               "torch_profiler_dump_cuda_time_total": False,
                                               "max_iterations": steps, "delay_iterations": delay})
    print(f"[profile {tag}] engine up in {time.perf_counter() - t0:.0f} s", flush=True)
    _run_workload(llm, workload, 0.0, seed=99)  # with --maps as in run_phase: metrics runs, a maps warm-up,
    if warm_runs > 1:
        _run_workload(llm, workload, maps_fraction, seed=98)  # then the run profiled
    llm.start_profile()
    res = _run_workload(llm, workload, maps_fraction, seed=1)
    llm.stop_profile()
    time.sleep(10)
    traces = sorted(prof_dir.rglob("*.pt.trace.json*"), key=lambda p: p.stat().st_size)
    print(f"[profile {tag}] run and trace done at {time.perf_counter() - t0:.0f} s: "
          f"{[(t.name, t.stat().st_size) for t in traces]}", flush=True)
    text = f"# {tag} {workload}: {res['output_tokens_per_s']:.0f} tok/s under vLLM's profiler\n\n"
    if traces:
        events = trace_gaps.load(str(traces[-1]))
        text += trace_gaps.analyse(events)
        (out / f"vllm-profile-{tag}.json").write_text(json.dumps(trace_gaps.summary(events), indent=1))
        del events
    text += "\nCPU seconds in the run by process/thread: " + json.dumps(res["cpu_s"]) + "\n"
    (out / f"vllm-profile-{tag}.txt").write_text(text)
    print(text, flush=True)
    for t in traces:  # large; the text above is what is kept
        t.unlink()


def _attn_otel_origin(env: dict) -> str:
    """Where the server's attn-otel comes from (its package directory), as the server's interpreter finds it: an
    A/B of two builds on one machine puts one of them first on PYTHONPATH."""
    try:
        return subprocess.run([sys.executable, "-P", "-c", "import attn_otel, os; print(os.path.dirname("
                               "attn_otel.__file__))"], capture_output=True, text=True, env=env,
                              timeout=60).stdout.strip()
    except Exception as e:  # noqa: BLE001
        return f"unknown ({e})"


def _code_digest(package_dir: str | None = None) -> str | None:
    """bench/code_id.py's digest of the attn-otel measured (``package_dir``, else the one this process finds):
    ``python3 bench/code_id.py --find DIGEST`` names the commits with that code.  None where it cannot be read."""
    try:
        return code_id.digest_package(Path(package_dir)) if package_dir else code_id.digest_installed()
    except Exception:  # noqa: BLE001 - a measurement is not lost for want of its label
        return None


def run_online(phase: str, out: Path, repeats: int, warm_runs: int = 1, per_run: bool = False) -> dict:
    """The online workload for ``phase``: its own OpenAI server; the capacity from DIR/online-off.json (the
    off phase measures it, so run it first).  After a light load, ``warm_runs`` whole runs at the measured rate
    (other seeds) warm it up; then, with capture on, the measurement waits until the warm-up's captures are
    written (:func:`drain`): run 48's first measured run after a quarter-length warm-up was far out (TTFT p99
    x1.96, ITL p99 x1.74, the later runs within 4%), a backlog the warm-up left.  ``per_run``: the same wait
    (capture off: the same pause) before each measured run too."""
    model = _model_dir()
    online.add_tokenizer(model, MODELS[MODEL[0]]["vocab_size"])
    stats_dir = Path(tempfile.mkdtemp(prefix=f"attn-otel-stats-online-{phase}-"))
    store = Path(tempfile.mkdtemp(prefix=f"attn-otel-store-online-{phase}-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTN_OTEL")}
    env.update({"ATTN_OTEL_STORE": str(store), "ATTN_OTEL_STATS_DIR": str(stats_dir), **_phase_env(phase)})
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    t0 = time.perf_counter()
    proc = online.start_server(model, {}, out / f"online-{phase}.log")
    start_s = time.perf_counter() - t0
    from importlib.metadata import version  # not `import vllm`: this process leaves the GPU to the server

    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,uuid", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip()
    result = {"phase": phase, "engine_start_s": start_s, "runs": [], "device": gpu,
              "vllm_version": version("vllm"), "date": datetime.date.today().isoformat(),
              "attn_otel": _attn_otel_origin(env), "env": dict(EXTRA_ENV)}
    result["code_digest"] = _code_digest(result["attn_otel"])
    try:
        online.run_load(4.0, seed=98, n=16)  # warm-up: a light load (small batches)
        if CAPACITY[0]:
            result["capacity_req_s"] = CAPACITY[0]
        elif phase == "off":
            result["capacity_req_s"] = online.capacity()
        else:
            result["capacity_req_s"] = json.loads((out / "online-off.json").read_text())["capacity_req_s"]
        rate = online.LOAD * result["capacity_req_s"]
        result["warm_runs"] = max(1, warm_runs)
        for i in range(result["warm_runs"]):  # warm-up at the measured rate
            online.run_load(rate, seed=97 - i)
        capturing = bool(PHASE_ENV[phase])
        result["drain_s"] = [drain(stats_dir, capturing)]
        with online.HostProfile(proc.pid, out / f"pyspy-online-{phase}.txt"):  # with BENCH_PYSPY set
            for s in range(repeats):
                if per_run and s:
                    result["drain_s"].append(drain(stats_dir, capturing))
                result["runs"].append(online.run_load(rate, seed=s))
        for r in result["runs"]:
            print(f"[online {phase}] {r['output_tokens_per_s']:.0f} tok/s, TTFT p99 {r['ttft_p99_s']:.3f} s, "
                  f"ITL p99 {r['itl_p99_s'] * 1000:.1f} ms, goodput {r['goodput_req_s']:.2f} req/s", flush=True)
    finally:
        online.stop_server(proc)
        os.environ.clear()
        os.environ.update(saved)
    files = sorted(stats_dir.glob("attn-otel-stats-*.json"))
    if files:
        result["capture"] = json.loads(files[-1].read_text())
    (out / f"online-{phase}.json").write_text(json.dumps(result, indent=1))
    return result


def _median(runs: list[dict], key: str) -> float | None:
    """The median of the runs' ``key`` (the mean of the middle two for an even count: the upper one alone,
    which this took until session 40, biased 6-run references high)."""
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _machine(device: str | None, date: str | None) -> str:
    """``H200 GPU-1ce076fd, 2026-12-01`` from a phase file's ``gpu`` (nvidia-smi -L) or ``device`` line."""
    import re

    if not device:
        return "-"
    model = next((m for m in ("H200", "H100", "A100", "L40S") if m in device), device.split(",")[0].strip())
    uuid = re.search(r"GPU-[0-9a-f]{8}", device)
    return ", ".join(x for x in (f"{model} {uuid.group(0)}" if uuid else model, date) if x)


def report(out: Path, device: str | None = None, vllm_version: str | None = None) -> dict:
    """Merge DIR/phase-*.json and DIR/online-*.json into overhead.json, overhead-table.md and overhead.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = {p["phase"]: p for p in (json.loads(f.read_text()) for f in sorted(out.glob("phase-*.json")))}
    onl = {p["phase"]: p for p in (json.loads(f.read_text()) for f in sorted(out.glob("online-*.json")))
           if "phase" in p}  # (not the A/B collections, online-ab-*.json)
    off = phases.get("off", {})
    configs = {"default": "default", "all_layers": "all"}

    def ratio(phase, wl):  # against the capture-off run of the same call where a merged phase file keeps one
        a = phases.get(phase, {}).get("runs", {}).get(wl)
        b = (a or {}).get("off") or off.get("runs", {}).get(wl)
        return a["output_tokens_per_s"] / b["output_tokens_per_s"] if a and b else None

    def where(phase, wl):  # the machine and date of one cell: its own (a merged phase file) or its phase's
        p = phases.get(phase, {})
        r = p.get("runs", {}).get(wl) or {}
        return _machine(r.get("gpu") or p.get("gpu") or p.get("device"), r.get("date") or p.get("date"))

    wls: dict[str, dict] = {}
    for wl in WORKLOADS:
        wls[wl] = {"ratios": {c: ratio(p, wl) for c, p in configs.items()},
                   "off_tokens_per_s": off.get("runs", {}).get(wl, {}).get("output_tokens_per_s"),
                   "shape": workloads.summary(wl)}
        shares = {c: phases.get(p, {}).get("runs", {}).get(wl, {}).get("capture_delta", {}).get("gpu_share")
                  for c, p in configs.items()}
        if any(v is not None for v in shares.values()):  # phases since run 28: attn-otel's GPU time per workload
            wls[wl]["gpu_share"] = shares
    if "off" in onl:
        o = onl["off"]["runs"]

        def medians(runs):  # tpot: runs since the usage-counted client (2026-11-25)
            return {k: _median(runs, k) for k in ONLINE_MEDIANS if all(k in r for r in runs)}

        entry = {"ratios": {}, "rate_req_s": online.LOAD * onl["off"]["capacity_req_s"],
                 "capacity_req_s": onl["off"]["capacity_req_s"], "slo": {"ttft_s": online.SLO_TTFT_S,
                                                                         "itl_s": online.SLO_ITL_S}}
        for c, p in configs.items():
            runs = onl.get(p, {}).get("runs")
            if not runs:
                entry["ratios"][c] = None
                continue
            entry["ratios"][c] = _median(runs, "output_tokens_per_s") / _median(o, "output_tokens_per_s")
            for k in ONLINE_RATIOS:
                if all(k in r for r in (*runs, *o)):
                    entry.setdefault(f"{k[:-2]}_ratio", {})[c] = _median(runs, k) / _median(o, k)
            entry.setdefault("by_config", {})[c] = medians(runs)
        entry["ttft_p99_ratio"] = entry.get("ttft_p99_ratio", {}).get("default")
        entry["itl_p99_ratio"] = entry.get("itl_p99_ratio", {}).get("default")
        entry["device"] = onl["off"].get("device", device)
        entry["date"] = onl["off"].get("date")
        entry["off"] = medians(o)
        wls["online"] = entry
    kv = {c: (phases[p]["kv_cache_tokens"] / off["kv_cache_tokens"]) if p in phases and off else None
          for c, p in configs.items()}
    doc = {
        "device": off.get("device", device), "vllm_version": off.get("vllm_version", vllm_version),
        "date": off.get("date") or datetime.date.today().isoformat(),  # the measurement's, where the phase has it
        "code": off.get("code"), "code_digest": off.get("code_digest"),
        "model": "Llama-3-8B-shaped, load_format=dummy, bf16",
        "command": "python3 bench/overhead.py --phase off --phase default --phase all --out DIR; "
                   "python3 bench/overhead.py --online off --online default --online all --out DIR; "
                   "python3 bench/overhead.py --report --out DIR",
        "workloads": wls, "kv_capacity": kv,
        "kv_cache_tokens": {p: phases[p]["kv_cache_tokens"] for p in phases},
        "phases": phases, "online": onl,
    }
    (out / "overhead.json").write_text(json.dumps(doc, indent=1))
    names = list(wls)
    offline = _machine(off.get("gpu") or off.get("device"), off.get("date"))
    measured = {}
    for wl in names:  # one machine, or each configuration's where a merged file's cells come from several
        cells = {c: where(p, wl) for c, p in configs.items() if wls[wl]["ratios"].get(c) is not None}
        seen = list(dict.fromkeys(cells.values())) or [offline]
        measured[wl] = seen[0] if len(seen) == 1 else "; ".join(f"{c.replace('_', ' ')}: {m}" for c, m in cells.items())
    if "online" in wls:
        measured["online"] = _machine(wls["online"]["device"], wls["online"].get("date"))
    lines = ["| workload | default | all layers | measured on |", "| --- | --- | --- | --- |"]
    for wl in names:
        r = wls[wl]["ratios"]
        # (4 places: a ratio of 0.9896 is a miss of the 0.99 target, which 3 places would print as 0.990)
        lines.append(f"| {wl} | " + " | ".join("-" if r.get(c) is None else f"{r[c]:.4f}" for c in configs)
                     + f" | {measured[wl]} |")
    kv_at = list(dict.fromkeys(_machine(phases[p].get("gpu") or phases[p].get("device"), phases[p].get("date"))
                               for p in ("off", *configs.values()) if p in phases)) or [offline]
    lines.append("| KV-cache capacity | " + " | ".join("-" if kv[c] is None else f"{kv[c]:.4f}" for c in configs)
                 + f" | {'; '.join(kv_at)} |")
    (out / "overhead-table.md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(11, 4.8))
    width = 0.38
    for k, (c, color) in enumerate(zip(configs, ["#4c72b0", "#dd8452"])):
        vals = [wls[wl]["ratios"].get(c) for wl in names] + [kv[c]]
        xs = [i + (k - 0.5) * width for i in range(len(vals))]
        bars = ax.bar(xs, [v or 0 for v in vals], width, color=color, label=c.replace("_", " "))
        for b_, v in zip(bars, vals):
            ax.text(b_.get_x() + b_.get_width() / 2, 0.61 if v is None else v + 0.01, "-" if v is None else f"{v:.4f}",
                    ha="center", fontsize=6.5)
    ax.axhline(1.0, color="k", lw=0.8)
    import re

    def short(m):  # a tick's note: the GPUs, one line each
        return "\n".join(re.sub(r"H[0-9]+ (GPU-[0-9a-f]{8})(, [0-9-]+)?", r"\1", part) for part in m.split("; "))

    ticks = [wl if measured[wl] == offline else f"{wl}\n({short(measured[wl])})" for wl in names]
    ax.set_xticks(range(len(names) + 1), [*ticks, "KV-cache\ncapacity"], fontsize=8)
    ax.set_ylim(0.6, 1.1)
    ax.set_ylabel("ratio to capture off")
    ax.legend(loc="lower right")
    ax.axhline(0.99, color="#4c72b0", lw=0.8, ls="--")  # the default's throughput target
    ax.set_title(f"attn-otel overhead: throughput (online: at 80% load) and KV capacity against capture off\n"
                 f"{offline}, vLLM {doc['vllm_version']}, Llama-3-8B shape; dashed: the default's 0.99 target",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "overhead.png", dpi=120)
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", action="append", choices=list(PHASE_ENV), default=[])
    ap.add_argument("--online", action="append", choices=[p for p in PHASE_ENV if p != "eager"], default=[],
                    help="the online workload for this configuration (run off first)")
    ap.add_argument("--workload", action="append", choices=list(WORKLOADS), default=[])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--env", action="append", default=[], metavar="ATTN_OTEL_X=V",
                    help="an attn-otel variable on top of each phase's own (an A/B of one switch; the phases "
                         "clear any other ATTN_OTEL variable)")
    ap.add_argument("--model", choices=list(MODELS), default="llama3-8b",
                    help="the model shape, dummy weights (give each model its own --out)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    ap.add_argument("--capacity", type=float, default=0.0,
                    help="online: the capacity (req/s) to load at 80%%, instead of online-off.json's (diagnostics)")
    ap.add_argument("--report", action="store_true", help="merge the phase files in --out")
    ap.add_argument("--device", help="device name for phase files that lack it")
    ap.add_argument("--vllm-version", help="vLLM version for phase files that lack it")
    ap.add_argument("--profile", choices=["off", "default", "all"],
                    help="profile one warm run of this phase (first --workload) instead of measuring")
    ap.add_argument("--engine-profile", choices=["off", "default", "all"],
                    help="the same through vLLM's profiler, in the multiprocess engine core")
    ap.add_argument("--stacks", action="store_true",
                    help="with --engine-profile or --profile: record Python stacks (slow)")
    ap.add_argument("--maps", action="store_true", help="with --engine-profile: profile the maps-for-1%% run")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="with --engine-profile: trace only this many engine steps (0: the whole run)")
    ap.add_argument("--profile-delay", type=int, default=0,
                    help="with --engine-profile: start the trace this many engine steps into the run")
    ap.add_argument("--per-run", action="store_true",
                    help="pause before each measured run and after the last (every phase) and keep each run's own "
                         "capture delta (run_deltas: the warm-up's first); online: wait before each measured run "
                         "until the captures so far are written (drain_s)")
    ap.add_argument("--warm-runs", type=int, default=1,
                    help="warm-up runs of each workload before the measured ones (2: whether the first measured run "
                         "pays a one-time cost, such as the writer processes starting on the first captures); online: "
                         "whole runs at the measured rate, then a wait until their captures are written")
    ap.add_argument("--profile-warm-runs", type=int, choices=[1, 2], default=2,
                    help="with --engine-profile: workload runs before the one profiled")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    MODEL[0] = args.model
    CAPACITY[0] = args.capacity
    for kv in args.env:
        key, sep, value = kv.partition("=")
        if not sep or not key.startswith("ATTN_OTEL_"):
            ap.error(f"--env takes ATTN_OTEL_NAME=VALUE, not {kv!r}")
        EXTRA_ENV[key] = value
    if args.engine_profile:
        if args.profile_steps < 0 or args.profile_delay < 0:
            ap.error("--profile-steps and --profile-delay take 0 or a number of steps")
        engine_profile(args.engine_profile, args.out, (args.workload or ["512+256"])[0], args.stacks,
                       0.01 if args.maps else 0.0, args.profile_steps, args.profile_delay, args.profile_warm_runs)
        return 0
    if args.profile:
        profile_phase(args.profile, args.out, (args.workload or ["512+256"])[0], args.stacks)
        return 0
    for phase in args.phase:
        run_phase(phase, args.out, args.repeats, args.workload or list(WORKLOADS), args.warm_runs, args.per_run)
    for phase in args.online:
        run_online(phase, args.out, args.repeats, args.warm_runs, args.per_run)
    if args.report:
        doc = report(args.out, args.device, args.vllm_version)
        print(json.dumps({"workloads": {k: v["ratios"] for k, v in doc["workloads"].items()},
                          "kv_capacity": doc["kv_capacity"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
