"""The floor the arithmetic sets under attn-otel's metric kernel on each offline workload (issue 22, item 4: "why it
is the floor: the metric kernel's FLOPs against the attention's own"), beside what the current report measured.

No GPU and no vLLM: the requests of ``bench/workloads.py`` (seed 0) on the Llama-3-8B shape the benchmark serves
(32 layers, 32 query and 8 KV heads, head_dim 128), counted exactly.  Per captured layer and run:

* ``evaluations``: (query row, visible key, query head) triples, the metric kernel's unit of work: every prompt row
  the model computed (a prefix-cache hit's rows were scored by the request that computed them: the mixed
  workload's four system prompts count once) and every generated row but the last sampled token;
* the metric kernel's FLOPs, ``2 * head_dim`` an evaluation (Q.K; no P.V), and one exponential each, against the
  model's attention, ``4 * head_dim`` an evaluation (Q.K and P.V), and the whole model's FLOPs (its linear layers
  on every token computed, the LM head on every sampled one, the attention);
* the decode rows' key reads: the query ring (``ATTN_OTEL_STREAM_ROWS``, 8192) is flushed at half, so a request
  running beside ``c - 1`` others has its keys read once every ``4096 / c`` of its generated rows (the prompt rows'
  reads are left out: 64 rows share each key tile, read from L2).

Three floors follow, as the throughput ratio to capture off that the metric kernel alone would leave:

* ``at_model_efficiency``: the kernel's FLOPs done as efficiently as the model does its own, i.e.
  ``1 / (1 + metric FLOPs / model FLOPs)``: what a kernel as good as the served model's would cost;
* ``at_peak``: the kernel at the device's peak (the slowest of its tensor work at ``--tflops``, its exponentials
  at 16 a clock a SM, its decode key reads at ``--tbps``), against the run's measured time with capture off
  (``phase-off.json``);
* ``measured``: the ratio and attn-otel's GPU share the current report has (``overhead.json``).

    python3 bench/floor.py [--bench docs/benchmarks] [--out docs/benchmarks/floor.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import workloads
from overhead import LLAMA3_8B

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's attn_otel (as kv_capacity.py)
from attn_otel.config import AUTO_LAYERS  # noqa: E402

# the shape bench/overhead.py serves (its config.json, dummy weights)
LAYERS, HQ, HKV, D, HIDDEN, FFN, VOCAB = (LLAMA3_8B[k] for k in (
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
    "intermediate_size", "vocab_size"))
LINEAR_PER_TOKEN = 2 * LAYERS * (HIDDEN * (HQ + 2 * HKV) * D + HQ * D * HIDDEN + 3 * HIDDEN * FFN)
LM_HEAD_PER_TOKEN = 2 * HIDDEN * VOCAB
DEFAULT_LAYERS = AUTO_LAYERS  # ATTN_OTEL_LAYERS=auto
# the stream's flush at half the query ring of attn_otel.stream.DEFAULT_ROWS rows (not imported: that module needs
# torch, this script does not; tests/test_floor_bench.py checks the two agree)
RING_HALF = 8192 // 2
# H200 SXM: 132 SMs at 1.98 GHz, 16 exponentials (MUFU.EX2) a clock a SM; dense bf16 989 TFLOP/s by the data sheet,
# about 790 measured (the device tool's KINDS notes); HBM3e 4.8 TB/s
SMS, CLOCK_HZ, EXP_PER_CLOCK = 132, 1.98e9, 16


def count(name: str) -> dict:
    """One run of workload ``name`` (seed 0): evaluations a layer (prompt and generated rows), tokens computed,
    tokens sampled, and the decode rows' key-read bytes a layer."""
    reqs = workloads.requests(name, 0)
    c = len(reqs)  # every request of these workloads runs at once (vLLM's 1,024 sequences; the KV cache holds them)
    systems = workloads.system_prompts() if name == "mixed" else []
    cached: set[int] = set()  # the system prompts some request already computed
    per_flush = max(1, RING_HALF // c)  # a request's generated rows between two reads of its keys
    prompt_evals = decode_evals = computed = sampled = key_bytes = 0
    for prompt, out in reqs:
        n = len(prompt)
        hit = 0
        for i, system in enumerate(systems):
            if prompt[:len(system)] == system:
                if i in cached:  # its full blocks are in the prefix cache (vLLM caches whole blocks)
                    hit = len(system) - len(system) % 16
                cached.add(i)
        rows = range(hit, n)  # row i sees keys 0..i
        prompt_evals += sum(i + 1 for i in rows) * HQ
        gen = out - 1  # rows of generated tokens that go through the model (the last sampled one does not)
        decode_evals += sum(n + j + 1 for j in range(gen)) * HQ
        computed += len(rows) + gen
        sampled += out
        flushes = -(-gen // per_flush)
        key_bytes += sum(n + min(gen, (f + 1) * per_flush) for f in range(flushes)) * HKV * D * 2
    return {"requests": len(reqs), "prompt_evaluations": prompt_evals, "decode_evaluations": decode_evals,
            "tokens_computed": computed, "tokens_sampled": sampled, "decode_key_bytes": key_bytes}


def floors(name: str, off_wall_s: float | None, tflops: float, tbps: float) -> dict:
    n = count(name)
    evals = n["prompt_evaluations"] + n["decode_evaluations"]
    metric_flops = 2 * D * evals  # a captured layer's
    attention_flops = 4 * D * evals  # a layer's
    model_flops = (n["tokens_computed"] * LINEAR_PER_TOKEN + n["tokens_sampled"] * LM_HEAD_PER_TOKEN
                   + LAYERS * attention_flops)
    peak_s = max(metric_flops / (tflops * 1e12), evals / (SMS * CLOCK_HZ * EXP_PER_CLOCK),
                 n["decode_key_bytes"] / (tbps * 1e12))  # a captured layer's, at the device's peak
    out = {**n, "evaluations": evals, "metric_flops_per_layer": metric_flops,
           "attention_flops_per_layer": attention_flops, "model_flops": model_flops,
           "attention_share_of_model_flops": round(LAYERS * attention_flops / model_flops, 4),
           "peak_s_per_layer": round(peak_s, 6), "off_wall_s": off_wall_s}
    for key, layers in (("default", DEFAULT_LAYERS), ("all_layers", LAYERS)):
        share = layers * metric_flops / model_flops
        out[key] = {"metric_share_of_model_flops": round(share, 4),
                    "at_model_efficiency": round(1 / (1 + share), 4),
                    "at_peak": round(1 / (1 + layers * peak_s / off_wall_s), 4) if off_wall_s else None}
    return out


def _read(path: Path) -> dict:
    """A measured run's JSON, or ``{}`` where there is none."""
    return json.loads(path.read_text()) if path.exists() else {}


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", type=Path, default=Path("docs/benchmarks"),
                    help="the folder with phase-off.json and overhead.json (the measured runs)")
    ap.add_argument("--out", type=Path, help="write the figures here as JSON")
    ap.add_argument("--tflops", type=float, default=790.0, help="the device's dense bf16 TFLOP/s")
    ap.add_argument("--tbps", type=float, default=4.8, help="the device's memory TB/s")
    args = ap.parse_args(argv)
    off, report = _read(args.bench / "phase-off.json"), _read(args.bench / "overhead.json")
    result = {"model": "Llama-3-8B shape", "device_peaks": {"tflops": args.tflops, "tbps": args.tbps, "sms": SMS,
                                                            "clock_hz": CLOCK_HZ, "exp_per_clock_sm": EXP_PER_CLOCK},
              "workloads": {}}
    rows = ["| workload | metric FLOPs / model FLOPs, all layers | floor at the model's efficiency: default / all "
            "layers | floor at peak: default / all layers | measured: default / all layers (GPU share) |",
            "| --- | --- | --- | --- | --- |"]
    for name in workloads.NAMES:
        run = (off.get("runs") or {}).get(name) or {}
        f = floors(name, run.get("wall_s"), args.tflops, args.tbps)
        got = (report.get("workloads") or {}).get(name) or {}
        f["measured"] = {"ratios": got.get("ratios"), "gpu_share": got.get("gpu_share")}
        result["workloads"][name] = f
        r, g = got.get("ratios") or {}, got.get("gpu_share") or {}
        rows.append(f"| {name} | {f['all_layers']['metric_share_of_model_flops']:.1%} | "
                    f"{_fmt(f['default']['at_model_efficiency'])} / {_fmt(f['all_layers']['at_model_efficiency'])} | "
                    f"{_fmt(f['default']['at_peak'])} / {_fmt(f['all_layers']['at_peak'])} | "
                    f"{_fmt(r.get('default'))} / {_fmt(r.get('all_layers'))} "
                    f"({_fmt(g.get('default'))} / {_fmt(g.get('all_layers'))}) |")
    print("\n".join(rows))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
