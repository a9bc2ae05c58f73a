"""The online workload of bench/overhead.py: vLLM's OpenAI server under Poisson arrivals.

One server per configuration (``python3 -m vllm.entrypoints.openai.api_server``, the model of overhead.py
with a word-level tokenizer made here so that streamed completions carry one chunk per token).  Requests
are 512 random prompt tokens + 128 output tokens, streamed.  The capacity is measured once, on the
configuration measured first (capture off): every request sent at once, completed requests per second.  Each
configuration then gets the same Poisson arrivals at ``LOAD`` (80%) of that capacity; per request the time to
first token and the mean inter-token latency are measured client-side, and goodput counts the requests that
met the SLO (TTFT <= ``SLO_TTFT_S``, mean ITL <= ``SLO_ITL_S``) per second of the run.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

LOAD = 0.8
REQUESTS = 400
PROMPT, OUTPUT = 512, 128
SLO_TTFT_S, SLO_ITL_S = 1.0, 0.05
PORT = 8123


def add_tokenizer(model_dir: str, vocab: int) -> None:
    """A word-level tokenizer ``t0 .. t{vocab-1}`` beside the dummy model's config (no hub access there)."""
    if (Path(model_dir) / "tokenizer.json").exists():
        return
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t128000", eos_token="t128001",
                            unk_token="t0").save_pretrained(model_dir)


def start_server(model_dir: str, env: dict, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--load-format",
           "dummy", "--max-model-len", "8704", "--gpu-memory-utilization", "0.9", "--port", str(PORT),
           "--seed", "0", "--served-model-name", "bench"]
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(2)
    proc.kill()
    raise RuntimeError("the server did not come up in 10 minutes")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


async def _one(session, prompt: list[int], t_send: float) -> dict:
    import aiohttp  # noqa: F401 - vLLM's own dependency

    body = {"model": "bench", "prompt": prompt, "max_tokens": OUTPUT, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    times = []
    async with session.post(f"http://127.0.0.1:{PORT}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
    ttft = times[0] - t_send if times else float("nan")
    itl = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")
    return {"ttft": ttft, "itl": itl, "tokens": len(times), "end": times[-1] if times else float("nan")}


async def _run(prompts: list[list[int]], gaps: list[float] | None) -> tuple[list[dict], float]:
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=1800)) as s:
        tasks = []
        t0 = time.perf_counter()
        due = np.concatenate([[0.0], np.cumsum(gaps)]) if gaps is not None else None  # request i at sum(gaps[:i])
        for i, p in enumerate(prompts):
            if due is not None and i:
                await asyncio.sleep(max(0.0, t0 + due[i] - time.perf_counter()))
            tasks.append(asyncio.create_task(_one(s, p, time.perf_counter())))
        res = await asyncio.gather(*tasks)
    return res, time.perf_counter() - t0


def _prompts(seed: int, n: int = REQUESTS) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1000, 120000, PROMPT).tolist() for _ in range(n)]


def capacity() -> float:
    """Completed requests per second with every request sent at once (the server already warm)."""
    res, wall = asyncio.run(_run(_prompts(1234, 256), None))
    return len(res) / wall


def run_load(rate: float, seed: int, n: int = REQUESTS) -> dict:
    """``n`` Poisson arrivals at ``rate`` requests/s: TTFT and ITL p50/p99 (seconds), goodput, throughput."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n).tolist()
    res, wall = asyncio.run(_run(_prompts(seed, n), gaps))
    ttft = np.array([r["ttft"] for r in res])
    itl = np.array([r["itl"] for r in res])
    good = sum(1 for r in res if r["ttft"] <= SLO_TTFT_S and r["itl"] <= SLO_ITL_S and r["tokens"] == OUTPUT)

    def q(v, p):
        v = v[~np.isnan(v)]
        return float(np.quantile(v, p)) if v.size else None

    return {"rate_req_s": rate, "wall_s": wall, "requests": len(res),
            "output_tokens_per_s": sum(r["tokens"] for r in res) / wall,
            "ttft_p50_s": q(ttft, 0.5), "ttft_p99_s": q(ttft, 0.99), "itl_p50_s": q(itl, 0.5),
            "itl_p99_s": q(itl, 0.99), "goodput_req_s": good / wall, "slo_met": good / len(res)}
