"""attn-otel's time on vLLM's engine loop with finished requests' capture work batched over engine steps
(``ATTN_OTEL_FINISH_BATCH_STEPS``: 16, the default) against done in the step each request finishes (0).

Both phases in one call, one engine each (a subprocess), the same requests: SmolLM2 on vLLM's CPU build (or the
CUDA vLLM where one is installed), ``ATTN_OTEL=1`` with its defaults, 160 requests with lognormal prompt and
output lengths, half behind a shared 64-token system prompt (prefix-cache hits), 32 running at once, so that
requests finish in most steps.  Reported per phase: attn-otel's host time before the forwards (``step_host_s``
by part, ``step_times`` p50 / p99), the finish batches taken (their sizes, and the rule that took each one:
attn_otel.deferred), the last blocks spilled (attn_otel.spill), the stream's flushes, captures and drops; and
whether the greedy outputs are identical.  ``--baseline CHECKOUT`` adds a third phase: another attn-otel's
batched finish (a git worktree of an earlier commit), its package first on PYTHONPATH.  A phase with
``ATTN_OTEL_AFTER_LAUNCH=0`` (the batches and the half-ring flushes before the forward, as up to 2026-11-26)
shows how much of that time now waits for no forward: ``before_launch_s`` is what is left before the launches.  On the CPU build the
forwards are slow and the stream's flushes run on the torch path, so the figures are host seconds of
attn-otel's own work, not the GPU's online latency (``bench/overhead.py --online`` measures that).

    python3 bench/finish_batch.py [--out docs/benchmarks/finish-batch-cpu.json] [--requests 160] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def phase(steps: int, n: int, out: Path) -> None:
    """One engine (run in its own process): serve the requests, write the figures to ``out``."""
    store = tempfile.mkdtemp(prefix="attn-otel-fb-")
    os.environ.update({"ATTN_OTEL": "1", "ATTN_OTEL_STORE": store, "ATTN_OTEL_FINISH_BATCH_STEPS": str(steps),
                       "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2"})
    import numpy as np
    from vllm import LLM, SamplingParams

    from attn_otel import vllm_adapter
    from attn_otel.smollm2 import ensure_smollm2

    llm = LLM(model=str(ensure_smollm2()), skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=32,
              max_num_batched_tokens=256, enable_prefix_caching=True, seed=0)
    rng = np.random.default_rng(0)
    system = rng.integers(100, 5000, 64).tolist()
    prompts, params = [], []
    for i in range(n):
        own = rng.integers(100, 5000, int(np.clip(rng.lognormal(3.5, 0.6), 8, 300))).tolist()
        prompts.append({"prompt_token_ids": (system + own) if i % 2 else own})
        params.append(SamplingParams(max_tokens=int(np.clip(rng.lognormal(2.8, 0.7), 2, 96)), temperature=0.0,
                                     ignore_eos=True, detokenize=False))
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.step()
    (engine,) = vllm_adapter.engines()
    assert engine.flush(300), "captures not written within 300 s"
    snap = engine.stats.snapshot(percentiles=True)
    result = {"finish_batch_steps": steps, "requests": n, "steps": snap["step_times"]["n"],
              "step_host_s": snap["step_host_s"], "step_host_s_total": round(sum(snap["step_host_s"].values()), 4),
              "before_launch_s": round(sum(v for k, v in snap["step_host_s"].items() if k != "after_launch"), 4),
              "step_times_ms": {q: round(snap["step_times"][q] * 1e3, 3) for q in ("p50", "p90", "p99")},
              "finish_batches": engine.deferred.batches,
              "finish_batch_sizes": {q: snap["finish_batch_sizes"][q] for q in ("p50", "p90", "max")},
              "finish_batch_reasons": snap.get("finish_batch_reasons"), "empty_steps": snap.get("empty_steps"),
              "spill_at": snap.get("spill_at"),
              "spilled_blocks": getattr(getattr(engine.stream, "spill", None), "spilled", None),
              "finish_batch_ms": {q: round(snap["finish_batch_times"][q] * 1e3, 3)
                                  for q in ("p50", "p90", "p99", "max")},
              "stream_flushes": engine.stream.flushes if engine.stream is not None else None,
              "captured": snap["captured"], "dropped": snap["dropped"],
              "outputs": [list(o.outputs[0].token_ids) for o in outs]}
    out.write_text(json.dumps(result))


def _ratio(a: float, b: float) -> float:
    return round(a / max(b, 1e-9), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/benchmarks/finish-batch-cpu.json")
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--baseline", help="a checkout of another attn-otel whose batched finish runs as a third "
                    "phase (its package first on PYTHONPATH), e.g. a git worktree of an earlier commit")
    ap.add_argument("--phase", type=int, help=argparse.SUPPRESS)  # internal: one engine, in a subprocess
    ap.add_argument("--phase-out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.phase is not None:
        phase(a.phase, a.requests, Path(a.phase_out))
        return
    phases = [("immediate (0)", 0, None, "1"), ("batched (16)", 16, None, "1"),
              ("batched (16), all before the launch", 16, None, "0")]
    if a.baseline:
        phases.append(("batched (16), baseline", 16, str(Path(a.baseline).resolve()), "1"))
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, steps, path, after) in enumerate(phases):
            out = Path(tmp) / f"{i}.json"
            print(f"phase {name} ...", file=sys.stderr, flush=True)
            env = {**os.environ, "ATTN_OTEL_AFTER_LAUNCH": after}
            if path:
                env["PYTHONPATH"] = os.pathsep.join([path, *filter(None, [env.get("PYTHONPATH")])])
            subprocess.run([sys.executable, __file__, "--phase", str(steps), "--phase-out", str(out),
                            "--requests", str(a.requests)], check=True, stdout=subprocess.DEVNULL, env=env)
            got[name] = json.loads(out.read_text())
            if path:
                rev = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip()
                got[name]["attn_otel"] = f"{path} ({rev or 'not a git checkout'})"
    import platform

    import vllm

    outputs = [r.pop("outputs") for r in got.values()]
    first, batched = got["immediate (0)"], got["batched (16)"]
    report = {"machine": f"{platform.machine()} {os.cpu_count()} CPUs", "vllm_version": vllm.__version__,
              "outputs_identical": all(o == outputs[0] for o in outputs), "phases": got,
              "ratio_step_host_s": _ratio(batched["step_host_s_total"], first["step_host_s_total"]),
              "ratio_captures_part": _ratio(batched["step_host_s"]["captures"], first["step_host_s"]["captures"]),
              "ratio_before_launch_to_all_before": _ratio(batched["before_launch_s"],
                                                          got["batched (16), all before the launch"]["before_launch_s"]),
              "ratio_step_p50_to_all_before": _ratio(batched["step_times_ms"]["p50"],
                                                     got["batched (16), all before the launch"]["step_times_ms"]["p50"]),
              "ratio_step_p99_to_all_before": _ratio(batched["step_times_ms"]["p99"],
                                                     got["batched (16), all before the launch"]["step_times_ms"]["p99"])}
    if a.baseline:
        base = got["batched (16), baseline"]
        report["ratio_step_host_s_to_baseline"] = _ratio(batched["step_host_s_total"], base["step_host_s_total"])
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "phases"}, indent=1))
    for name, r in report["phases"].items():
        print(f"{name}: host {r['step_host_s_total']} s over {r['steps']} steps {r['step_host_s']}, step p50/p99 "
              f"{r['step_times_ms']['p50']}/{r['step_times_ms']['p99']} ms, {r['finish_batches']} finish batches "
              f"(sizes {r['finish_batch_sizes']}, taken for {r['finish_batch_reasons']}), "
              f"{r['stream_flushes']} flushes, {r['captured']} captured, dropped {r['dropped']}")


if __name__ == "__main__":
    main()
