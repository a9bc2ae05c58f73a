"""The overhead benchmark's request sets (bench/overhead.py): random token ids, ``ignore_eos``, seeded.

- ``512+256``: 256 x (512 prompt + 256 output), no shared prefix.
- ``8k+128``: 32 x (8192 + 128): long prefills, chunked.
- ``mixed``: 384 requests as production traffic looks: prompt and output lengths lognormal (medians 600 and
  200 tokens), half of the requests behind one of four 1,000-token system prompts (prefix-cache hits), and
  one request in 32 long (a 6,000-7,000-token prompt).
- ``kv_bound``: 256 x (2048 + 256): 590k tokens in flight against a KV cache of about 445k on an H100 (the
  8B model), so the scheduler queues and preempts and the KV capacity capture takes shows as throughput.
"""

from __future__ import annotations

import numpy as np

VOCAB = (1000, 120000)
FIXED = {"512+256": (256, 512, 256), "8k+128": (32, 8192, 128), "kv_bound": (256, 2048, 256)}
NAMES = ("512+256", "8k+128", "mixed", "kv_bound")


def requests(name: str, seed: int) -> list[tuple[list[int], int]]:
    """``(prompt token ids, output tokens)`` per request of workload ``name``."""
    rng = np.random.default_rng(seed)
    if name in FIXED:
        n, plen, olen = FIXED[name]
        return [(rng.integers(*VOCAB, plen).tolist(), olen) for _ in range(n)]
    if name != "mixed":
        raise ValueError(f"unknown workload {name!r}")
    system = system_prompts()
    out = []
    for i in range(384):
        if i % 32 == 31:
            plen = int(rng.integers(6000, 7000))
        else:
            plen = int(np.clip(rng.lognormal(np.log(600), 0.9), 16, 5000))
        olen = int(np.clip(rng.lognormal(np.log(200), 0.8), 8, 800))
        prompt = rng.integers(*VOCAB, plen).tolist()
        if i % 2 == 0:
            prompt = system[int(rng.integers(4))] + prompt
        out.append((prompt, olen))
    return out


def system_prompts() -> list[list[int]]:
    """The mixed workload's four 1,000-token system prompts: the same in every run."""
    return [np.random.default_rng(7 + i).integers(*VOCAB, 1000).tolist() for i in range(4)]


def summary(name: str) -> dict:
    reqs = requests(name, 0)
    p = np.array([len(r[0]) for r in reqs])
    o = np.array([r[1] for r in reqs])
    return {"requests": len(reqs), "prompt_tokens_p50": int(np.median(p)), "prompt_tokens_max": int(p.max()),
            "output_tokens_p50": int(np.median(o)), "output_tokens_max": int(o.max()),
            "tokens": int(p.sum() + o.sum())}
