"""How much a finish batch's hand-off to the writers slows vLLM's engine loop in the same process (CPU).

A finished request's capture reaches the store through attn-otel's writer-feeding threads in the engine's
process (attn_otel.handoff, attn_otel.writers): each waits for the job's device work, copies its arrays into a
shared-memory segment and sends the writer process one JSON line, then waits for its answer.  Those threads
hold the GIL for part of that, beside the engine loop, which needs it for every step it schedules and launches.
Run 50's profile of 512+256 on an H200 (docs/benchmarks/overhead.md) found the GPU idle 5-12 ms before and in
each of the run's last steps, where finish batches of 32-64 requests are handed off at once.

One process, the real hand-off (``Handoff`` with its writer threads, ``WriterPool`` with its writer processes,
a local store), summary-only captures of the Llama-3-8B default's shape (4 layers, 32 heads, 767 tokens), at
attn-otel's GIL switch interval (0.2 ms).  A thread stands in for the engine loop: steps of ``--step-us`` of
pure-Python work, back to back.  Phases, each timed by the loop's own steps:

* ``alone``: the loop with idle writers (the reference);
* ``batch``: the loop while a batch of ``--batch`` captures is handed off at once, from the hand-off until
  every one is written (repeated ``--repeats`` times), as a finish batch does: ``Handoff.put_many`` (a part a
  writer thread, each part one message to its writer process);
* ``one_by_one``: the same batches put one capture at a time (``Handoff.put``: a message each, as every finish
  batch did up to 2026-12-03).

Reported: the loop's step time (p50, p99, max) in each phase and as a ratio to ``alone``, the loop time lost
per capture (the batch's steps' excess over ``alone``'s p50, divided by the captures), and the writer-feeding
threads' CPU per capture (the process's CPU less the loop's, over the captures).  On a machine of few cores the
writer processes also take the loop's core, so ``--writers 1`` sets one writer apart from the GIL's share.

    python3 bench/writer_contention.py [--batch 64] [--repeats 5] [--writers 4] [--out FILE]

(docs/benchmarks/writer-contention.json keeps two machines' runs.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

L, H, T, PROMPT = 4, 32, 767, 512  # the 512+256 default's captures: layers 0, 10, 21, 31 of a Llama-3-8B shape


def _work(n: int) -> int:
    """Pure-Python work of about ``n`` loop iterations (dict and list traffic, as a scheduler's bookkeeping)."""
    d: dict[int, int] = {}
    acc = 0
    for i in range(n):
        d[i & 63] = i
        acc += d.get((i * 7) & 63, 0) & 1
    return acc


def _calibrate(step_us: float) -> int:
    n = 2000
    while True:
        t0 = time.perf_counter()
        _work(n)
        dt = time.perf_counter() - t0
        if dt > 0.02:
            return max(1, int(n * step_us * 1e-6 / dt))
        n *= 2


def _quantiles(xs: list[float]) -> dict[str, float]:
    import numpy as np

    a = np.asarray(xs, dtype=float) * 1e3
    return {"n": int(a.size), "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "max_ms": float(a.max())}


class Loop:
    """The engine loop's stand-in: steps of fixed pure-Python work, each step's wall time kept while ``record``."""

    def __init__(self, iters: int):
        self.iters = iters
        self.steps: list[float] = []
        self.record = False
        self.stop = False
        self.cpu = 0.0
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def _run(self) -> None:
        while not self.stop:
            t0 = time.perf_counter()
            _work(self.iters)
            if self.record:
                self.steps.append(time.perf_counter() - t0)
            self.cpu = time.thread_time()  # its own CPU so far, at most a step old when read


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64, help="captures handed off at once")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--writers", type=int, default=4, help="writer threads and processes (ATTN_OTEL_WRITERS)")
    ap.add_argument("--step-us", type=float, default=500.0, help="the loop's work per step")
    ap.add_argument("--alone-s", type=float, default=2.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.batch < 1 or args.repeats < 1 or args.writers < 1 or args.step_us <= 0:
        ap.error("--batch, --repeats, --writers and --step-us must be positive")

    import torch

    from attn_otel.config import Config
    from attn_otel.handoff import Handoff, Job
    from attn_otel.hostmem import SegmentPool
    from attn_otel.ids import new_span_id, new_trace_id
    from attn_otel.metrics import SUMMARY_METRICS
    from attn_otel.stats import Stats, WarnOnce
    from attn_otel.store import CaptureRecord
    from attn_otel.writers import WriterPool

    store = tempfile.mkdtemp(prefix="attn-otel-wc-")
    config = Config.from_env({"ATTN_OTEL": "1", "ATTN_OTEL_STORE": store, "ATTN_OTEL_WRITERS": str(args.writers)})
    sys.setswitchinterval(config.gil_switch_ms / 1000)  # as attn_otel.capture sets it in the engine's process
    stats = Stats()
    writers = WriterPool(config, stats, WarnOnce())
    pool = SegmentPool(1 << 30)
    handoff = Handoff(config, stats, writers, pool)
    g = torch.Generator().manual_seed(0)

    def job() -> Job:
        rec = CaptureRecord(trace_id=new_trace_id(), request_id=new_span_id(), span_id=new_span_id(),
                            parent_span_id=None, prompt_len=PROMPT, num_tokens=T, layers=(0, 10, 21, 31),
                            num_heads=H, model="llama3-8b-shape", engine_version="bench")
        summary = torch.rand((2, len(SUMMARY_METRICS), 4, L, H), generator=g)
        summary[:, 7:] = float("nan")  # no learned sinks
        nbytes = summary.numel() * 4
        assert handoff.reserve(nbytes)
        return Job(rec, None, None, None, nbytes, time.perf_counter(), summary=summary)

    def hand_off(n: int, together: bool = True) -> None:
        jobs = [job() for _ in range(n)]
        if together:
            handoff.put_many(jobs)
        else:
            for j in jobs:
                handoff.put(j)
        if not handoff.flush(120):
            raise RuntimeError("the writers did not finish within 120 s")

    hand_off(4 * args.writers)  # start the writer processes and their exporters
    loop = Loop(_calibrate(args.step_us))
    loop.thread.start()
    time.sleep(0.2)
    loop.record = True
    time.sleep(args.alone_s)
    loop.record = False
    alone = list(loop.steps)
    ref = _quantiles(alone)
    captures = args.batch * args.repeats
    phases = {}
    for name, together in (("batch", True), ("one_by_one", False)):
        steps: list[float] = []
        wall = cpu_other = 0.0
        for _ in range(args.repeats):
            time.sleep(0.2)
            loop.steps = []
            p0, lc0 = time.process_time(), loop.cpu
            t0 = time.perf_counter()
            loop.record = True
            hand_off(args.batch, together)
            loop.record = False
            wall += time.perf_counter() - t0
            cpu_other += (time.process_time() - p0) - (loop.cpu - lc0)
            steps += loop.steps
        got = _quantiles(steps)
        excess = sum(steps) - len(steps) * ref["p50_ms"] / 1e3
        phases[name] = {**got, "ratios": {k: got[k] / ref[k] for k in ("p50_ms", "p99_ms", "max_ms")},
                        "batch_wall_ms": wall / args.repeats * 1e3,
                        "loop_lost_ms_per_capture": excess / captures * 1e3,
                        "feed_cpu_ms_per_capture": cpu_other / captures * 1e3}
    loop.stop = True
    loop.thread.join(10)
    handoff.begin_closing(0)
    writers.close(time.monotonic() + 30)
    snap = stats.snapshot()
    res = {
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs", "python": platform.python_version(),
        "gil_switch_ms": config.gil_switch_ms, "writers": args.writers, "batch": args.batch,
        "repeats": args.repeats, "step_us": args.step_us, "stored": snap.get("stored"), "dropped": snap.get("dropped"),
        "alone": ref, **phases,
    }
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0 if snap.get("stored") == 2 * captures + 4 * args.writers else 1


if __name__ == "__main__":
    sys.exit(main())
