"""The forward's per-layer writes alone (GPU, vLLM installed): vLLM's KV-cache write and attn-otel's query
write as two launches (``ATTN_OTEL_KV_WRITE=vllm``) against one fused launch (``fused``, the default).

Llama-3-8B's shapes (32 query heads, 8 KV heads, head_dim 128, bfloat16, 16-token blocks), 32 layers per
replay as one forward has them, captured in a CUDA graph as vLLM's decode steps are.  Token counts: a
decode step of 256 requests, a 2,048-token chunk.  Both variants are checked to write the same cache and
ring; their time per forward (32 layers) is measured with CUDA events over many graph replays.

    python3 bench/kv_write.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from cuda_time import device_ms  # bench/, the script's folder

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

H, HKV, D, BS, LAYERS, BLOCKS, ROWS = 32, 8, 128, 16, 32, 4096, 8192


def _setup(n: int):
    g = torch.Generator(device="cuda").manual_seed(n)
    S = BLOCKS * BS
    qkv = torch.randn(n, (H + 2 * HKV) * D, device="cuda", generator=g).bfloat16()
    q = qkv[:, :H * D].view(-1, H, D)
    k = qkv[:, H * D:(H + HKV) * D].view(-1, HKV, D)
    v = qkv[:, (H + HKV) * D:].view(-1, HKV, D)
    slots = torch.randperm(S, device="cuda", generator=g)[:n]
    caches = [torch.zeros(BLOCKS, HKV, BS, 2 * D, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    ring = torch.zeros(LAYERS, ROWS + 1, H, D, device="cuda", dtype=torch.bfloat16)
    table = torch.full((S + 1,), ROWS, dtype=torch.int64, device="cuda")
    table[slots] = torch.randperm(ROWS, device="cuda", generator=g)[:n]
    return q, k, v, slots, caches, ring, table, S


def _forward(fused: bool, q, k, v, slots, caches, ring, table, S):
    from vllm import _custom_ops as ops

    from attn_otel import triton_metrics

    one = torch.ones((), device="cuda")
    for layer in range(LAYERS):
        t = caches[layer].transpose(1, 2)
        kc, vc = t[..., :D], t[..., D:]
        if fused:
            assert triton_metrics.scatter_rows(ring[layer], q, slots, S, table=table, kv=(k, v, kc, vc))
        else:
            ops.reshape_and_cache_flash(k, v, kc, vc, slots, "auto", one, one)
            assert triton_metrics.scatter_rows(ring[layer], q, slots, S, table=table)


def measure(n: int, fused: bool, reps: int = 200) -> tuple[float, list[torch.Tensor]]:
    args = _setup(n)
    _forward(fused, *args)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _forward(fused, *args)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        _forward(fused, *args)
    return device_ms(graph.replay, reps, warmups=10), [args[4][0], args[4][-1], args[5]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in (256, 2048):
        two, got_two = measure(n, False)
        one, got_one = measure(n, True)
        same = all(torch.equal(x, y) for x, y in zip(got_two, got_one))
        rows.append({"tokens": n, "layers": LAYERS, "two_launches_ms": round(two, 4), "fused_ms": round(one, 4),
                     "saved_ms": round(two - one, 4), "same_cache_and_ring": same})
        print(f"{n:5d} tokens, {LAYERS} layers: vLLM's write + Q write {two:.3f} ms, fused {one:.3f} ms "
              f"(same result: {same})", flush=True)
    result = {"device": torch.cuda.get_device_name(0), "rows": rows}
    (a.out / "kv_write.json").write_text(json.dumps(result, indent=1))
    if not all(r["same_cache_and_ring"] for r in rows):
        sys.exit("the fused launch wrote something else than vLLM's write and the Q write")


if __name__ == "__main__":
    main()
