"""The online workload of bench/overhead.py: vLLM's OpenAI server under Poisson arrivals.

One server per configuration (``python3 -m vllm.entrypoints.openai.api_server``, the model of overhead.py
with a word-level tokenizer made here so that streamed completions carry one chunk per token).  Requests
are 512 random prompt tokens + 128 output tokens, streamed.  The capacity is measured once, on the
configuration measured first (capture off): every request sent at once, completed requests per second.  Each
configuration then gets the same Poisson arrivals at ``LOAD`` (80%) of that capacity.  Measured client-side:
the time to first token per request, every inter-token gap (ITL p50/p99 are over all of them, as vLLM's own
serving benchmark counts them), the mean gap per request (TPOT), tokens from the server's usage count; goodput
counts the requests that got all their tokens and met the SLO (TTFT <= ``SLO_TTFT_S``, TPOT <= ``SLO_ITL_S``)
per second of the run.
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
    # -P: the server's sys.path does not start with the caller's cwd, where a checkout's attn_otel/ would hide the
    # build being measured (site-packages, or one put first on PYTHONPATH to compare two builds on one machine)
    cmd = [sys.executable, "-P", "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--load-format",
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


def engine_core_pid(root: int) -> int | None:
    """The pid of the engine-core process (vLLM titles it ``VLLM::EngineCore``) below process ``root`` (the
    server's, or an offline ``LLM``'s own)."""
    import psutil

    for child in psutil.Process(root).children(recursive=True):
        try:
            if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                return child.pid
        except psutil.Error:
            continue
    return None


class HostProfile:
    """py-spy sampling the engine-core process below process ``root`` (a server's, or this one) while a block runs,
    when ``BENCH_PYSPY`` names a py-spy binary: every thread, idle included, or with ``BENCH_PYSPY_GIL=1`` only
    the thread holding the GIL at each sample (so each thread's samples are its share of the GIL).  The
    collapsed stacks go to ``path`` (bench/host_profile.py reads them).  A py-spy that cannot attach (no ptrace
    rights) is reported and the run goes on unprofiled."""

    def __init__(self, root: int, path: Path, rate: int = 200) -> None:
        self.root, self.path, self.rate, self.spy = root, path, rate, None

    def __enter__(self):
        exe = os.environ.get("BENCH_PYSPY")
        pid = engine_core_pid(self.root) if exe else None
        if exe and pid is None:
            print("[host profile] no engine-core process found; not profiled", flush=True)
        if pid is not None:
            which = "--gil" if os.environ.get("BENCH_PYSPY_GIL") == "1" else "--idle"
            # BENCH_PYSPY_NATIVE=1: C/C++ frames too (py-spy then pauses the process at each sample: 50 Hz)
            native = os.environ.get("BENCH_PYSPY_NATIVE") == "1"
            how = ["--native", "--rate", "50"] if native else ["--nonblocking", "--rate", str(self.rate)]
            self.spy = subprocess.Popen([exe, "record", "--pid", str(pid), "--threads", which, *how,
                                         "--format", "raw", "--output", str(self.path)],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            time.sleep(1.0)
            if self.spy.poll() is not None:
                print(f"[host profile] py-spy could not attach: {self.spy.stdout.read()[-2000:]}", flush=True)
                self.spy = None
        return self

    def __exit__(self, *exc) -> None:
        if self.spy is None:
            return
        import signal

        self.spy.send_signal(signal.SIGINT)
        try:
            out, _ = self.spy.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.spy.kill()
            out, _ = self.spy.communicate()
        print(f"[host profile] {out.strip().splitlines()[-2:] if out else ''}", flush=True)


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


async def _one(session, prompt: list[int], t_send: float) -> dict:
    """One streamed completion.  Tokens are counted from the server's own usage on every chunk
    (``continuous_usage_stats``), not from chunks with text: a chunk may carry several tokens, or a token no text
    yet (a detokenizer holding back an incomplete character).  TTFT is the arrival of the first token; every
    later chunk of k new tokens adds k inter-token gaps of (its gap) / k; TPOT is the request's mean gap."""
    import aiohttp  # noqa: F401 - vLLM's own dependency

    body = {"model": "bench", "prompt": prompt, "max_tokens": OUTPUT, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    first = last = None
    tokens = 0
    gaps: list[float] = []
    async with session.post(f"http://127.0.0.1:{PORT}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[5:])
            n = int((chunk.get("usage") or {}).get("completion_tokens") or 0)
            if n <= tokens:
                continue
            if first is None:
                first = now
            else:
                gaps.extend([(now - last) / (n - tokens)] * (n - tokens))
            last, tokens = now, n
    ttft = first - t_send if first is not None else float("nan")
    tpot = (last - first) / (tokens - 1) if tokens > 1 else float("nan")
    return {"ttft": ttft, "tpot": tpot, "gaps": gaps, "tokens": tokens, "end": last if last is not None else float("nan")}


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


# vLLM's own per-request histograms (its /metrics): where a request's time went on the server's side.  The queue,
# prefill and decode times come from the engine core's timestamps; TTFT and the inter-token latency from the
# front end's, so that their difference to the client's figures is the HTTP path.
SERVER_HISTOGRAMS = ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                     "time_to_first_token_seconds", "inter_token_latency_seconds", "request_inference_time_seconds")


_SCRAPED = {f"{h}_{x}" for h in SERVER_HISTOGRAMS for x in ("sum", "count")} | {"num_preemptions_total",
                                                                                 "num_preemptions"}


def scrape() -> dict[str, float]:
    """The server's counters now: ``{name_sum, name_count}`` of :data:`SERVER_HISTOGRAMS` (every label set
    added up) and ``num_preemptions``; ``{}`` where /metrics does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=10) as r:
            text = r.read().decode()
    except Exception:  # noqa: BLE001 - a diagnostic: the run's own figures stand without it
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, value = line.partition(" ")
        base = name.split("{")[0][len("vllm:"):]
        if base in _SCRAPED:
            try:
                out[base] = out.get(base, 0.0) + float(value.split()[0])
            except ValueError:
                pass
    return out


def server_means(before: dict, after: dict) -> dict[str, float | None]:
    """Per request (per token for the inter-token latency) means of the histograms over one run, from two
    scrapes; and the run's preemptions."""
    out: dict[str, float | None] = {}
    for h in SERVER_HISTOGRAMS:
        n = after.get(f"{h}_count", 0.0) - before.get(f"{h}_count", 0.0)
        sm = after.get(f"{h}_sum", 0.0) - before.get(f"{h}_sum", 0.0)
        out[h.replace("_seconds", "_mean_s")] = sm / n if n > 0 else None
    pre = next((k for k in ("num_preemptions_total", "num_preemptions") if k in after), None)
    out["preemptions"] = after[pre] - before.get(pre, 0.0) if pre else None
    return out


def run_load(rate: float, seed: int, n: int = REQUESTS) -> dict:
    """``n`` Poisson arrivals at ``rate`` requests/s: TTFT and ITL p50/p99 (seconds), goodput, throughput; and
    the server's own means over the run (``server``: queue, prefill, decode, TTFT, inter-token)."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n).tolist()
    before = scrape()
    res, wall = asyncio.run(_run(_prompts(seed, n), gaps))
    after = scrape()
    ttft = np.array([r["ttft"] for r in res])
    itl = np.array([g for r in res for g in r["gaps"]])  # every inter-token gap of every request
    tpot = np.array([r["tpot"] for r in res])
    good = sum(1 for r in res if r["ttft"] <= SLO_TTFT_S and r["tpot"] <= SLO_ITL_S and r["tokens"] == OUTPUT)

    def q(v, p):
        v = v[~np.isnan(v)]
        return float(np.quantile(v, p)) if v.size else None

    return {"rate_req_s": rate, "wall_s": wall, "requests": len(res),
            "output_tokens_per_s": sum(r["tokens"] for r in res) / wall,
            "ttft_p50_s": q(ttft, 0.5), "ttft_p99_s": q(ttft, 0.99), "itl_p50_s": q(itl, 0.5),
            "itl_p99_s": q(itl, 0.99), "tpot_p50_s": q(tpot, 0.5), "tpot_p99_s": q(tpot, 0.99),
            "complete": sum(1 for r in res if r["tokens"] == OUTPUT), "goodput_req_s": good / wall,
            "slo_met": good / len(res), "server": server_means(before, after) if before and after else None}
