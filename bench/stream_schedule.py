"""The streamed layers' host bookkeeping before each forward (``MetricsStream.schedule``), this checkout against
another attn-otel (``--baseline CHECKOUT``), in one call on one machine.

A decode step of R requests, each one token at a position past a 512-token prompt, repeated: the stream as the
engine drives it on vLLM's engine loop, with no engine around it and no flush in the measured steps (a ring of
2**17 rows: the steps' tokens stay under half of it), so the figure is the per-step cost the design puts on the
loop, nothing else.  On the CPU the uploads and table writes of a design that has them are host copies; on a GPU
(``--device cuda``) they are the asynchronous copies and launches the engine loop pays.  Each checkout runs in a
subprocess of its own with its package first on PYTHONPATH; ``--rounds`` alternate them.

    python3 bench/stream_schedule.py --baseline DIR [--requests 128] [--steps 400] [--rounds 3]
                                     [--out docs/benchmarks/stream-schedule-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from checkouts import HERE, revisions, rounds

PROMPT, BS, ROWS = 512, 16, 1 << 17


def measure(requests: int, steps: int, device: str) -> dict:
    """In this process: the step times (microseconds) of ``steps`` decode steps of ``requests`` requests."""
    import numpy as np
    import torch

    import attn_otel
    from attn_otel.stream import MetricsStream
    from attn_otel.tap import LayerSpec

    if requests * steps + 8 * PROMPT >= ROWS // 2:
        raise SystemExit(f"{requests} x {steps} tokens would flush: keep requests x steps under {ROWS // 2 - 8 * PROMPT}")
    layers = [LayerSpec(index=0, name="l0", num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25)]
    per = (PROMPT + steps) // BS + 1  # blocks a request
    slots = requests * per * BS
    keys = {0: torch.zeros(slots // BS, BS, 2, 16, dtype=torch.bfloat16, device=device)}
    st = MetricsStream(layers, slots, ROWS, torch.bfloat16, device, BS, 4, keys)

    class Tracked:
        def __init__(self, blocks):
            self.block_ids, self.prompt_token_ids, self.vision_positions, self.written = [blocks], [0] * PROMPT, None, 0

    reqs = [(f"r{i}", Tracked(list(range(i * per, (i + 1) * per)))) for i in range(requests)]
    st.schedule([(r, t, 0, PROMPT) for r, t in reqs[:8]])  # a few prefills first, as a server has them
    times = []
    for s in range(steps):
        items = [(r, t, PROMPT + s, 1) for r, t in reqs]
        t0 = time.perf_counter()
        st.schedule(items)
        times.append(time.perf_counter() - t0)
    if device == "cuda":
        torch.cuda.synchronize()
    us = np.asarray(times) * 1e6
    return {"attn_otel": str(Path(attn_otel.__file__).parent), "flushes": st.flushes,
            "us_p50": round(float(np.percentile(us, 50)), 1), "us_p90": round(float(np.percentile(us, 90)), 1),
            "us_mean": round(float(us.mean()), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", help="a checkout of another attn-otel (e.g. a git worktree of an earlier commit)")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="docs/benchmarks/stream-schedule-cpu.json")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # internal: one checkout
    a = ap.parse_args()
    if a.measure:
        print(json.dumps(measure(a.requests, a.steps, a.device)))
        return
    checkouts = {"this": HERE, **({"baseline": str(Path(a.baseline).resolve())} if a.baseline else {})}
    got = rounds(__file__, ["--measure", "--requests", str(a.requests), "--steps", str(a.steps), "--device",
                            a.device], checkouts, a.rounds)
    revs = revisions(checkouts)
    med = {name: sorted(r["us_p50"] for r in runs)[len(runs) // 2] for name, runs in got.items()}
    report = {"machine": f"{platform.machine()} {os.cpu_count()} CPUs", "device": a.device,
              "requests": a.requests, "steps": a.steps, "commits": revs, "rounds": got,
              "us_p50_median": med}
    if "baseline" in med:
        report["ratio_to_baseline"] = round(med["this"] / med["baseline"], 3)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "rounds"}, indent=1))


if __name__ == "__main__":
    main()
