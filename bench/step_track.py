"""attn-otel's host time on the engine loop before each forward (``vllm_adapter._track``: the finished requests,
the request tracker, the captures, the stream's and map tap's schedules, the block guards), driven the way vLLM's
scheduler drives it under online load: ``--live`` requests running at once (lognormal prompt and output lengths),
each step a decode token for every running request, a new request's prompt prefilled in the step it arrives, as
many arriving as finish, 1% planned for maps.  No vLLM engine: the scheduler's outputs are built here with the
fields the adapter reads, and the capture engine is the real one (``CaptureEngine`` with a ``MetricsStream`` of a
Llama-3-8B shape on a GPU, a small one on the CPU), its finish batches and flushes after each step's "launch"
(``_run_after_launch``), timed apart.  ``--baseline CHECKOUT`` compares this checkout with another attn-otel,
each in subprocesses of its own with its package first on PYTHONPATH, ``--rounds`` alternating.

    python3 bench/step_track.py [--live 100] [--steps 1500] [--device cuda]
    python3 bench/step_track.py --baseline DIR [--rounds 3] [--out docs/benchmarks/step-track-cpu.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from checkouts import HERE, baseline, revisions, rounds

BS = 16
PARTS = ("finished_rows", "captures", "schedule")
KEYS = ("track_us_p50", "track_us_mean", "quiet_us_p50", "after_us_mean")  # compared with --baseline


def measure(live: int, steps: int, device: str, seed: int = 0, steady: bool | None = None,
            keep: bool = False, fixed: tuple[int, int] | None = None) -> dict:
    """In this process: per-step host seconds of ``_track`` and of the work after the launch.  ``steady``: the
    step counter of attn_otel.steady on or off (None: ``ATTN_OTEL_STEADY``, default on); ``keep``: the result also
    holds what was captured (``finished``: request id -> tokens and blocks) and the streamed layers' per-slot
    metric rows at the end (``metrics``), for comparing two runs.  ``fixed``: every request of (prompt, output)
    tokens and a step of up to 16,384 tokens, as the offline 512+256 workload of bench/overhead.py (requests
    arriving in waves as a wave finishes) instead of lognormal lengths and one or two prompts a step."""
    import numpy as np
    import torch

    import attn_otel
    from attn_otel import arrival, vllm_adapter
    from attn_otel.capture import CaptureEngine
    from attn_otel.config import Config, resolve_map_layers
    from attn_otel.deferred import DeferredFinish
    from attn_otel.spill import spill_slots
    from attn_otel.stream import MetricsStream
    from attn_otel.tap import LayerSpec
    from attn_otel.tracking import RequestTracker

    gpu = device == "cuda"
    H, HKV, D = (32, 8, 128) if gpu else (4, 2, 16)
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    total_blocks = 12_000 if gpu else 6_000
    if fixed:
        total_blocks = max(total_blocks, int(live * (-(-(sum(fixed) + 1) // BS) + 1) * 1.1))
    layers = [LayerSpec(index=i, name=f"l{i}", num_heads=H, num_kv_heads=HKV, head_dim=D, scale=D ** -0.5)
              for i in (0, 10, 21, 31)]
    dtype = torch.bfloat16 if gpu else torch.float32
    keys = {s.index: torch.randn(total_blocks, BS, HKV, D, dtype=dtype, device=device) for s in layers}
    store = tempfile.mkdtemp(prefix="step-track-")
    config = Config(enabled=True, store=store)
    rows = 8192 if not fixed else 4 * 16_384  # (with no direct rows here, a 16,384-token step's rows go to the ring)
    stream = MetricsStream(layers, total_blocks * BS, rows, dtype, device, BS, config.sink_tokens, keys,
                           spill_slots=spill_slots(BS))
    stream.defer_flush = config.after_launch
    if hasattr(stream, "flush_keys"):
        stream.flush_keys = config.flush_keys
    maps = resolve_map_layers(config.map_layers, tuple(s.index for s in layers))
    engine = CaptureEngine(config, layers, total_blocks * BS, dtype, device, model="bench", stream=stream,
                           map_layers=maps, map_tap_rows=4096, block_sizes=[BS])
    engine.tracker = RequestTracker()
    engine.deferred = DeferredFinish(config.finish_batch_steps)
    engine.after_launch = None
    engine.shadow = None
    engine.steady = None
    if steady is None:
        steady = os.environ.get("ATTN_OTEL_STEADY", "1") != "0"
    if steady and getattr(config, "steady", False):  # (a baseline checkout from before attn_otel.steady has none)
        from attn_otel.steady import Steady

        engine.steady = stream.steady = Steady(BS)
    runner = SimpleNamespace()  # no host request state: no token ids gathered
    kept: dict[str, tuple] = {}
    if keep:
        on_finished = engine.on_finished_many

        def recorded(finished):
            kept.update((f.request_id, (f.num_tokens, [list(b) for b in f.block_ids])) for f in finished)
            return on_finished(finished)

        engine.on_finished_many = recorded

    free = collections.deque(range(1, total_blocks))  # vLLM's free-block queue: freed blocks go to its end
    running: dict[str, dict] = {}
    serial = [0]

    def arrive() -> SimpleNamespace:
        r = f"req-{serial[0]}"
        serial[0] += 1
        if fixed:
            prompt, out = fixed
        else:
            prompt = int(np.clip(rng.lognormal(np.log(400), 0.8), 16, 1000))
            out = int(np.clip(rng.lognormal(np.log(150), 0.7), 4, 1000))
        need = -(-(prompt + 1) // BS)
        blocks = [free.popleft() for _ in range(need)]
        extra = {arrival.MAPS_KEY: bool(rng.random() < 0.01)}
        running[r] = {"pos": 0, "end": prompt + out, "blocks": blocks}
        return SimpleNamespace(req_id=r, prompt_token_ids=list(range(prompt)), mm_features=None,
                               sampling_params=SimpleNamespace(extra_args=extra), block_ids=(blocks,),
                               num_computed_tokens=0), prompt

    def forward(sched: dict) -> None:
        slots = []
        for r, n in sched.items():
            st = running[r]
            pos = np.arange(st["pos"], st["pos"] + n)
            slots.append(np.asarray(st["blocks"])[pos // BS] * BS + pos % BS)
        sm = torch.from_numpy(np.concatenate(slots)).to(device)
        q = torch.randn(len(sm), H, D, dtype=dtype, device=device)
        k = torch.randn(len(sm), HKV, D, dtype=dtype, device=device)
        for s in layers:
            stream.write(s.index, q, k, sm)
        if engine.maptap is not None:
            for s in engine.maptap.layers.values():
                engine.maptap.write(s.index, q, sm)

    # quiet: the steps in which no request finished and _track ran no flush (whose kernels a CPU computes in the
    # host time): the bookkeeping every step pays, by part (Stats.step_parts)
    track, after, quiet = [], [], []
    quiet_parts: dict[str, list[float]] = {k: [] for k in PARTS}
    finished: set[str] = set()
    warm = min(200, steps // 4)
    for step in range(steps + warm):
        new, sched = [], {}
        budget = 16_384 if fixed else 1024  # vLLM's offline step, or about what arrives a step at 80% load
        while len(running) < live and budget > 0:
            n, prompt = arrive()
            budget -= prompt
            new.append(n)
            sched[n.req_id] = prompt
        fresh = {n.req_id for n in new}
        ids, nb, comp = [], [], []
        for r, st in running.items():
            if r in fresh:
                continue
            pos = st["pos"]
            more = None
            if pos % BS == 0:
                more = ([free.popleft()],)
                st["blocks"].extend(more[0])
            ids.append(r)
            nb.append(more)
            comp.append(pos)
            sched[r] = 1
        so = SimpleNamespace(
            finished_req_ids=finished, scheduled_new_reqs=new, preempted_req_ids=set(),
            scheduled_cached_reqs=SimpleNamespace(req_ids=ids, resumed_req_ids=set(), new_block_ids=nb,
                                                  num_computed_tokens=comp),
            num_scheduled_tokens=sched, total_num_scheduled_tokens=sum(sched.values()))
        f0, p0 = stream.flushes, dict(engine.stats.step_parts)
        t0 = time.perf_counter()
        vllm_adapter._track(runner, engine, so, t0)
        t1 = time.perf_counter()
        busy = stream.flushes != f0 or bool(so.finished_req_ids)
        forward(sched)  # the forward's query writes (the ring's rows, its row counter moved on)
        t1b = time.perf_counter()
        vllm_adapter._run_after_launch(engine, "execute")
        t2 = time.perf_counter()
        if step >= warm:
            track.append(t1 - t0)
            if not busy:
                quiet.append(t1 - t0)
                for k in PARTS:
                    quiet_parts[k].append(engine.stats.step_parts[k] - p0.get(k, 0.0))
            after.append(t2 - t1b)
        finished = set()
        for r in list(running):
            st = running[r]
            st["pos"] += sched[r]
            if st["pos"] >= st["end"]:
                finished.add(r)
                free.extend(running.pop(r)["blocks"])
        if gpu and step % 64 == 0:
            torch.cuda.synchronize()
    if gpu:
        torch.cuda.synchronize()
    if keep:
        snap_keep = {"finished": kept, "metrics": stream.metrics.float().cpu().clone(),
                     "steady_drift": getattr(engine.stats, "steady_drift", 0),
                     "joins": getattr(engine.steady, "joins", 0) if getattr(engine, "steady", None) else 0,
                     "kept": getattr(engine.steady, "kept", 0) if getattr(engine, "steady", None) else 0}
    snap = {"captured": engine.stats.captured, "dropped": dict(engine.stats.dropped),
            "ring_drifts": stream.counter.drifts, "flushes": stream.flushes}
    engine.close()
    shutil.rmtree(store, ignore_errors=True)
    us = np.asarray(track) * 1e6
    au = np.asarray(after) * 1e6
    parts = {k: round(v, 4) for k, v in engine.stats.step_parts.items()}
    return {"attn_otel": str(Path(attn_otel.__file__).parent), "steps": len(track),
            "track_us_p50": round(float(np.percentile(us, 50)), 1),
            "track_us_p90": round(float(np.percentile(us, 90)), 1),
            "track_us_mean": round(float(us.mean()), 1),
            "quiet_steps": len(quiet), "quiet_us_p50": round(float(np.percentile(np.asarray(quiet) * 1e6, 50)), 1),
            "quiet_us_p90": round(float(np.percentile(np.asarray(quiet) * 1e6, 90)), 1),
            "quiet_parts_us_p50": {k: round(float(np.percentile(np.asarray(v) * 1e6, 50)), 1)
                                   for k, v in quiet_parts.items()},
            "after_us_mean": round(float(au.mean()), 1), "step_parts_s": parts, **snap,
            **(snap_keep if keep else {})}


def _fixed(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    prompt, _, out = text.partition("+")
    if not (prompt.isdigit() and out.isdigit() and int(prompt) > 0 and int(out) > 0):
        raise SystemExit(f"--fixed wants PROMPT+OUTPUT, two positive integers (e.g. 512+256), not {text!r}")
    return int(prompt), int(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", help="a checkout of another attn-otel (e.g. a git worktree of an earlier commit)")
    ap.add_argument("--live", type=int, default=100)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--fixed", help="PROMPT+OUTPUT: every request that long, 16,384-token steps (e.g. 512+256)")
    ap.add_argument("--out")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # internal: one checkout
    a = ap.parse_args()
    if a.measure or not a.baseline:
        got = measure(a.live, a.steps, a.device, fixed=_fixed(a.fixed))
        print(json.dumps(got))
        return
    checkouts = {"this": HERE, "baseline": baseline(a.baseline)}
    got = rounds(__file__, ["--measure", "--live", str(a.live), "--steps", str(a.steps), "--device", a.device]
                 + (["--fixed", a.fixed] if a.fixed else []), checkouts, a.rounds, swap=True)
    revs = revisions(checkouts)
    med = {name: {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in KEYS}
           for name, runs in got.items()}
    report = {"machine": f"{platform.machine()} {os.cpu_count()} CPUs", "device": a.device, "live": a.live,
              "steps": a.steps, "commits": revs, "rounds": got, "medians": med,
              "ratio_to_baseline": {k: round(med["this"][k] / med["baseline"][k], 3) for k in KEYS}}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "rounds"}, indent=1))


if __name__ == "__main__":
    main()
