"""Tensor and pipeline parallel vLLM on two NVIDIA GPUs: each rank captures its heads/layers into one capture.

Run on the lent 2-GPU machine (``nvidia-h200-x2``, see the README, "GPU"):
``python3 -P -m pytest -m gpu tests/test_gpu_parallel.py -s``.  A small random-weight Llama (8 query / 2 KV
heads, 4 layers) is built there with transformers and served three times with vLLM's defaults (CUDA
graphs, chunked prefill, prefix caching), each engine in a process of its own: ``tensor_parallel_size=2``,
``pipeline_parallel_size=2`` and, as the reference, one GPU.  The same prompts (one longer than the
chunked-prefill budget, one hitting the prefix cache, a concurrent batch) are captured by each; the
parallel engines' maps must equal the single GPU's (per-row total variation, median <= 0.02) and HF
eager fp32's (within FACTOR x HF bf16's own drift on the same rows + a floor, tests/reference.py), and their
merged metrics the single GPU's.  Figures go to ``$OUT/gpu_parallel.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

LAYERS, HEADS, KV_HEADS = 4, 8, 2
CONFIGS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}
MEDIAN_TV = 0.02
# vLLM's defaults but one: its allreduce+RMSNorm fusion pass (FlashInfer's fused all-reduce) faults on the
# lent machines, where NVLink multicast and symmetric memory are off (KINDS.md), with or without attn-otel
# (cublasCreate fails after an illegal memory access at engine start).  CUDA graphs, chunked prefill, prefix
# caching and vLLM's custom all-reduce stay on.
LLM_KWARGS = json.loads(os.environ.get("ATTN_OTEL_GPU_LLM_KWARGS") or
                        '{"compilation_config": {"pass_config": {"fuse_allreduce_rms": false}}}')

ENGINE = textwrap.dedent("""
    import json, os, sys, time
    args = json.loads(sys.argv[1])
    t0 = time.time()
    from vllm import LLM, SamplingParams
    import attn_otel
    llm = LLM(model=args["model"], skip_tokenizer_init=True, max_model_len=2048, max_num_batched_tokens=256,
              max_num_seqs=16, gpu_memory_utilization=0.4, seed=0, tensor_parallel_size=args["tp"],
              pipeline_parallel_size=args["pp"], **args["llm_kwargs"])
    started = time.time() - t0
    outputs, t1 = {}, time.time()
    for batch in args["batches"]:  # in order: the prefix-cache hit comes after the prompt it shares
        params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True,
                                 extra_args={"attn_otel": r["mode"], "traceparent": f"00-{r['trace']}-{'1' * 16}-01"})
                  for r in batch]
        outs = llm.generate([{"prompt_token_ids": r["prompt"]} for r in batch], params, use_tqdm=False)
        for r, o in zip(batch, outs):
            outputs[r["trace"]] = {"ids": list(o.prompt_token_ids) + list(o.outputs[0].token_ids),
                                   "cached": int(o.num_cached_tokens or 0)}
    generate_s = time.time() - t1
    deadline, missing = time.time() + (180 if os.environ.get("ATTN_OTEL") == "1" else 0), set(outputs)
    while missing and time.time() < deadline:
        llm.llm_engine.step()  # delivers finished_req_ids to the workers
        for t in list(missing):
            try:
                attn_otel.open_trace(t, store=args["store"])
                missing.discard(t)
            except attn_otel.TraceNotFound:
                pass
        time.sleep(0.2)
    json.dump({"outputs": outputs, "missing": sorted(missing), "engine_start_s": started,
               "generate_s": generate_s, "complete_s": time.time() - t1 - generate_s}, open(args["out"], "w"))
    del llm
""")


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.fail(f"tests/test_gpu_parallel.py needs 2 CUDA devices, found {torch.cuda.device_count()}")
    return build_model(tmp_path_factory.mktemp("model"))


def build_model(path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=64, vocab_size=4096,
                      max_position_embeddings=4096, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper attention than random init gives, so equality means something
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(3.0)
            layer.self_attn.k_proj.weight.mul_(3.0)
    model.to(torch.bfloat16).save_pretrained(path)
    return str(path)


def _requests():
    from attn_otel.ids import new_trace_id

    rng = np.random.default_rng(0)
    shared = rng.integers(10, 4000, 220).tolist()
    long = {"prompt": shared + rng.integers(10, 4000, 180).tolist(), "max_tokens": 16, "mode": "maps"}
    hit = {"prompt": shared + rng.integers(10, 4000, 40).tolist(), "max_tokens": 12, "mode": "maps"}
    batch = [{"prompt": rng.integers(10, 4000, 30 + 41 * i).tolist(), "max_tokens": 6 + 2 * i,
              "mode": "maps" if i % 2 == 0 else "metrics"} for i in range(8)]
    batches = [[long], [hit], batch]
    for b in batches:
        for r in b:
            r["trace"] = new_trace_id()
    return batches


def run_engine(name: str, model: str, store, batches) -> dict:
    """One engine (``CONFIGS[name]``) in a process of its own, capturing ``batches`` into ``store``."""
    from pathlib import Path

    tp, pp = CONFIGS[name]
    store = Path(store)
    out = store.parent / f"{name}.json"
    # NVLink multicast stays off on the lent machines (KINDS.md), so vLLM's symmetric-memory all-reduce too.
    env = {**os.environ, "ATTN_OTEL": "1", "ATTN_OTEL_STORE": str(store), "ATTN_OTEL_LAYERS": "all",
           "ATTN_OTEL_ROW_METRICS": "all", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_ALLREDUCE_USE_SYMM_MEM": "0", "ATTN_OTEL_STORE_TOKENS": "1"}  # the sampling stage's ids are checked
    env.update(json.loads(os.environ.get("ATTN_OTEL_GPU_ENV", "{}")))  # for a look at the engine alone
    args = {"model": model, "store": str(store), "tp": tp, "pp": pp, "batches": batches, "out": str(out),
            "llm_kwargs": LLM_KWARGS}
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", ENGINE, json.dumps(args)], env=env, capture_output=True,
                          text=True, timeout=540)
    log = proc.stdout + proc.stderr
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"{name}.log"), "w") as f:
            f.write(log)
    lines = log.splitlines()
    errors = [ln for ln in lines if "Error" in ln or "Traceback" in ln or "attn-otel" in ln][:60]
    assert proc.returncode == 0, (name, out.exists(), "\n".join(errors), log[-3000:])
    res = json.loads(out.read_text())
    res.update(store=str(store), wall_s=time.time() - t0, log=[ln for ln in lines if "attn-otel" in ln][-40:])
    print(f"{name}: engine start {res['engine_start_s']:.0f} s, generate {res['generate_s']:.1f} s, "
          f"all captures complete {res['complete_s']:.1f} s later; {len(res['missing'])} missing")
    assert not res["missing"], (name, res["missing"], res["log"])
    return res


@pytest.fixture(scope="module")
def runs(gpu_model, tmp_path_factory):
    batches = _requests()
    results = {name: run_engine(name, gpu_model, tmp_path_factory.mktemp(f"store-{name}"), batches)
               for name in CONFIGS}
    return batches, results


def _agreeing_rows(a: list[int], b: list[int], T: int) -> int:
    """Rows 0..n-1 see the same tokens in both runs (greedy decoding can part ways on near-ties)."""
    n = 0
    while n < T and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("name", ["tp2", "pp2"])
def test_parallel_maps_equal_single_gpu_maps_and_hf_eager(runs, gpu_model, name):
    import attn_otel
    from reference import Calibrated, hf_references, row_tv

    batches, results = runs
    ref_run, run = results["tp1"], results[name]
    tvs, report = [], {}
    hf = Calibrated()  # per-row TV against HF eager fp32, next to HF bf16's on the same rows
    for r in [r for b in batches for r in b]:
        (want,) = attn_otel.open_trace(r["trace"], store=ref_run["store"])
        (got,) = attn_otel.open_trace(r["trace"], store=run["store"])
        assert got.layers == want.layers == list(range(LAYERS)) and got.num_heads == want.num_heads == HEADS
        assert got.meta["parts"] == 2 and got.meta["parallel"] == dict(zip(("tp", "pp"), CONFIGS[name]))
        assert got.num_tokens == want.num_tokens and got.prompt_len == want.prompt_len
        T = got.num_tokens
        assert list(got.token_ids) == run["outputs"][r["trace"]]["ids"][:T]  # written by the sampling stage
        n = _agreeing_rows(list(got.token_ids), list(want.token_ids), T)
        assert n >= got.prompt_len  # prompts are identical: at least every prompt row compares
        if r["mode"] == "maps":
            a, b = got.maps(), want.maps()
            tv = row_tv(a[:, :, :n], b[:, :, :n]).ravel()
            tvs.append(tv)
            ids = run["outputs"][r["trace"]]["ids"]
            fp32, bf16 = hf_references(gpu_model, ids[:T], device="cuda")
            hf.add_maps("tv", a, fp32, bf16)
        else:
            assert not got.has_maps
        for metric, value in want.metrics.items():  # rows merged from both ranks, per head
            diff = np.abs(got.metrics[metric][:, :, :n] - value[:, :, :n])
            report.setdefault(f"metrics_{metric}_median_abs_diff", []).append(float(np.nanmedian(diff)))
    tv = np.concatenate(tvs)
    figures = {"rows": int(tv.size), "tv_vs_tp1": {"median": float(np.median(tv)), "p99": float(np.quantile(tv, 0.99)),
                                                  "max": float(tv.max())},
               "tv_vs_hf_eager": hf.report()["tv"],
               "prefix_cached_tokens": max(o["cached"] for o in run["outputs"].values()),
               "engine_start_s": run["engine_start_s"], "generate_s": run["generate_s"],
               "capture_complete_s": run["complete_s"],
               **{k: max(v) for k, v in report.items()}}
    print(f"GPU parallel {name}:", json.dumps(figures))
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "gpu_parallel.json")
        data = json.load(open(path)) if os.path.exists(path) else {}
        data[name] = figures
        data["tp1_log"] = results["tp1"]["log"][-10:]
        data[f"{name}_log"] = run["log"][-20:]
        json.dump(data, open(path, "w"), indent=1)
    assert figures["prefix_cached_tokens"] >= 200
    assert figures["tv_vs_tp1"]["median"] <= MEDIAN_TV, figures
    hf.check(f"GPU parallel {name}")  # within FACTOR x HF bf16's own drift + a floor (tests/reference.py)
    for key, value in figures.items():
        if key.startswith("metrics_"):
            assert value <= 0.02, (key, value)


if __name__ == "__main__":  # one engine alone, for a look at its log: python3 tests/test_gpu_parallel.py tp2
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    root = Path(tempfile.mkdtemp())
    (root / "model").mkdir()
    res = run_engine(sys.argv[1], build_model(root / "model"), root / "store", _requests())
    print(json.dumps({k: v for k, v in res.items() if k != "outputs"}, indent=1))
