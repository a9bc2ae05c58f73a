"""The engine loop's host time of the streamed layers' work, by call, on the device (no vLLM needed): a
finishing request's flush (``MetricsStream.finish``), the half-ring flush of every live request, the spill
copy, and a piecewise (eager) step's query writes (``MetricsStream.write`` per layer), for a Llama-3-8B-shaped
stream (4 streamed layers, 32 query heads, 8 KV heads, head_dim 128, block size 16) with ``--live`` requests
of lognormal lengths in flight.  Each figure is host seconds a call (the device is synchronised between calls,
outside the timing, so that no launch waits for a full queue); ``--profile`` adds cProfile's top functions
over the finishing flushes, which says which Python lines the time is in.  ``--baseline CHECKOUT`` compares
this checkout with another attn-otel (a git worktree or archive of an earlier commit), each in subprocesses
of its own with its package first on PYTHONPATH, ``--rounds`` alternating: a lent machine's host speed drifts
by up to 2x between runs a minute apart, so only alternated rounds compare, and the parts whose code neither
changed (the eager writes, say) show how far the host drifted in each round.

    python3 bench/flush_host.py [--live 100] [--calls 300] [--profile] [--out FILE]
    python3 bench/flush_host.py --baseline DIR [--rounds 4] [--flush-keys blocks] [--out docs/benchmarks/flush-host-h100.json]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import numpy as np
import torch

from checkouts import HERE, baseline, rounds

from attn_otel.spill import spill_slots
from attn_otel.stream import MetricsStream
from attn_otel.tap import LayerSpec

BS, H, HKV, D = 16, 32, 8, 128


class Tracked:
    def __init__(self, blocks: list[int], prompt: int) -> None:
        self.block_ids, self.prompt_token_ids, self.vision_positions = [blocks], [0] * prompt, None
        self.written = 0


def build(live: int, rows: int, device: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    lens = np.clip(rng.lognormal(np.log(600), 0.9, live).astype(int), 32, 6000)
    per = [int(n) // BS + 8 for n in lens]
    blocks = sum(per) + 64
    layers = [LayerSpec(index=i, name=f"l{i}", num_heads=H, num_kv_heads=HKV, head_dim=D, scale=D ** -0.5)
              for i in (0, 10, 21, 31)]
    keys = {s.index: torch.randn(blocks, BS, HKV, D, dtype=torch.bfloat16, device=device) for s in layers}
    st = MetricsStream(layers, blocks * BS, rows, torch.bfloat16, device, BS, 4, keys, spill_slots=spill_slots(BS))
    reqs, b = [], 0
    for i, (n, p) in enumerate(zip(lens, per)):
        reqs.append([f"r{i}", Tracked(list(range(b, b + p)), int(n) // 2), int(n)])
        b += p
    return st, layers, reqs


def step(st: MetricsStream, layers, items) -> tuple[float, float]:
    """One forward's stream work as the engine does it: schedule on the host, then the layers' writes; returns
    the host seconds of each."""
    t0 = time.perf_counter()
    st.schedule(items)
    sched = time.perf_counter() - t0
    slots = []
    for _, t, start, n in items:
        pos = np.arange(start, start + n)
        slots.append(np.asarray(t.block_ids[0])[pos // BS] * BS + pos % BS)
    sm = torch.from_numpy(np.concatenate(slots)).to(st.device)
    q = torch.randn(len(sm), H, D, dtype=torch.bfloat16, device=st.device)
    k = torch.randn(len(sm), HKV, D, dtype=torch.bfloat16, device=st.device)
    t0 = time.perf_counter()
    for s in layers:
        st.write(s.index, q, k, sm)
    return sched, time.perf_counter() - t0


def prefill(st: MetricsStream, layers, r) -> None:
    """Request ``r``'s first ``length - 8`` tokens, in forwards of at most 2048 tokens."""
    n = r[2] - 8
    for s in range(0, n, 2048):
        step(st, layers, [(r[0], r[1], s, min(2048, n - s))])
        r[1].written = min(n, s + 2048)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--live", type=int, default=100)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--baseline", help="a checkout of another attn-otel to compare with, rounds alternating")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--flush-keys", choices=("slots", "blocks"), default="slots",
                    help="this checkout's ATTN_OTEL_FLUSH_KEYS (a baseline without the switch gives slots)")
    a = ap.parse_args()
    if a.baseline:
        compare(a)
        return
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    st, layers, reqs = build(a.live, a.rows, a.device)
    st.flush_keys = a.flush_keys  # (an attribute an earlier checkout's stream does not read)
    st.warm_up()
    for r in reqs:  # each request's prompt but its last 8 tokens, then decode steps
        prefill(st, layers, r)
    sync()
    got: dict[str, list[float]] = {"finish_flush": [], "spill_copy": [], "eager_write_4_layers": [],
                                   "schedule_decode": []}
    prof = cProfile.Profile()
    rng = np.random.default_rng(1)
    pos = {r[0]: r[2] - 8 for r in reqs}
    for c in range(a.calls):
        items = [(r[0], r[1], pos[r[0]], 1) for r in reqs]
        sched, w = step(st, layers, items)
        got["schedule_decode"].append(sched)
        got["eager_write_4_layers"].append(w)
        for r in reqs:
            pos[r[0]] += 1
            r[1].written = pos[r[0]]
        sync()
        # one or two requests finish (and any at the end of its blocks): their pending rows, then their last
        # block's rows to a spill block
        done = [reqs[i] for i in rng.choice(len(reqs), size=int(rng.integers(1, 3)), replace=False)]
        done += [r for r in reqs if pos[r[0]] >= r[2] + 6 * BS and r not in done]
        t0 = time.perf_counter()
        if a.profile:
            prof.enable()
        st.finish([r[0] for r in done])
        if a.profile:
            prof.disable()
        got["finish_flush"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        virt = st.spill.copy([r[1].block_ids[0][(pos[r[0]] - 1) // BS] for r in done])
        got["spill_copy"].append(time.perf_counter() - t0)
        sync()
        st.spill.release(virt)
        for r in done:  # the same request comes back as a new one (its rows computed again by a prefill)
            st.forget([r[0]])
            r[0] = r[0].split("+")[0] + f"+{c}"
            pos[r[0]] = r[2] - 8
            prefill(st, layers, r)
        sync()
    half = []
    for c in range(max(3, a.calls // 30)):  # every live request's pending rows at once
        sync()
        t0 = time.perf_counter()
        st.flush(list(st._live.values()))
        half.append(time.perf_counter() - t0)
        sync()
        step(st, layers, [(r[0], r[1], pos[r[0]], 1) for r in reqs])
        for r in reqs:
            pos[r[0]] += 1
        sync()
    got["all_live_flush"] = half
    dev = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    res = {"device": dev, "torch": torch.__version__, "live": a.live, "calls": a.calls, "flushes": st.flushes,
           "flushed_rows": st.flushed_rows, "ring_drifts": st.counter.drifts,
           "us": {k: {q: round(float(np.percentile(v, q)) * 1e6, 1) for q in (50, 90, 99)} for k, v in got.items()}}
    if a.profile:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        res["profile_finish_flush"] = s.getvalue()
    print(json.dumps({k: v for k, v in res.items() if k != "profile_finish_flush"}, indent=1))
    if a.profile:
        print(res["profile_finish_flush"])
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


def compare(a) -> None:
    """This checkout against ``a.baseline``, ``a.rounds`` alternating rounds, each a subprocess; the report has
    every round, each part's median over the rounds per checkout, and their ratio (this / baseline)."""
    checkouts = {"baseline": baseline(a.baseline, "stream.py", "a checkout's root is wanted"), "this": HERE}
    got = rounds(__file__, ["--live", str(a.live), "--calls", str(a.calls), "--rows", str(a.rows), "--device",
                            a.device, "--flush-keys", a.flush_keys], checkouts, a.rounds)
    write_report(got, a.out)


def write_report(rounds: dict[str, list], out: str | None) -> dict:
    """Per part, each checkout's median over the rounds of its p50 (microseconds), and this / baseline."""
    parts = list(rounds["this"][0]["us"])
    med = {name: {p: float(np.median([r["us"][p]["50"] for r in runs])) for p in parts} for name, runs in rounds.items()}
    first = rounds["this"][0]
    report = {"device": first["device"], "torch": first["torch"], "live": first["live"], "calls": first["calls"],
              "us_p50_median": med, "ratio_this_to_baseline": {p: round(med["this"][p] / med["baseline"][p], 3)
                                                              for p in parts},
              "rounds": {name: [r["us"] for r in runs] for name, runs in rounds.items()}}
    print(json.dumps({k: v for k, v in report.items() if k != "rounds"}, indent=1))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
