"""How long the engine loop waits on attn-otel's stats while the stats file is written: every engine process
writes its stats file once a second (attn_otel.capture ``_dump_loop``), computing the quantiles of its timing
deques (70,000 values when full), while the engine loop calls ``Stats.add`` in its steps.  Up to session 47 the
quantiles were computed under the lock that ``add`` takes, so a step that counted something during the
snapshot waited for all of it: a stall of the engine loop once a second, in about 2% of the steps at an online
load of ~50 steps a second, which is where an ITL p99 is read.

One call, one process per phase, the same loop: a thread stands in for the engine loop (``Stats.add`` twice
and the deque appends of a step that finishes a request, every ``--step-ms``), another for the stats dumper
(``snapshot(percentiles=True)`` every ``--dump-s``, the deques full), at the engine's GIL switch interval
(attn-otel's default, 0.2 ms).  Phases: no dumper (the reference); this checkout's stats; and with
``--old COMMIT`` that commit's ``attn_otel/stats.py`` (read from git).  Reported per phase: the loop's own time
per step (p50 / p99 / p99.9 / max, and the steps over 1 ms), each as a ratio to the reference's.

    python3 bench/stats_stall.py [--old ffbbdc2] [--seconds 20] [--out docs/benchmarks/stats-stall-cpu.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from attn_otel.stats import QUANTILE_FIELDS  # noqa: E402  (the deques filled, in the old stats.py too)


def load_stats(path: str):
    spec = importlib.util.spec_from_file_location("stats_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def phase(stats_py: str, dump: bool, seconds: float, step_ms: float, dump_s: float, switch_ms: float) -> dict:
    """One phase, in this process: the loop's own time per step, and the dumper's time per snapshot."""
    import numpy as np

    sys.setswitchinterval(switch_ms / 1000)
    stats = load_stats(stats_py).Stats()
    rng = np.random.default_rng(0)
    for name in QUANTILE_FIELDS:
        getattr(stats, name).extend(rng.random(10_000).tolist())
    stats.step_intervals.extend(zip(rng.random(10_000).tolist(), rng.random(10_000).tolist()))
    stop = threading.Event()
    dumps: list[float] = []

    def dumper() -> None:
        while not stop.wait(dump_s):
            t0 = time.perf_counter()
            json.dumps(stats.snapshot(percentiles=True))
            dumps.append(time.perf_counter() - t0)

    own: list[float] = []
    th = threading.Thread(target=dumper, daemon=True)
    if dump:
        th.start()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        stats.add("spill_at", reason="held")  # what a step that finishes a request counts
        stats.add("finish_batch_reasons", reason="steps")
        stats.step_times.append(1e-4)
        stats.step_intervals.append((0.02, 1e-4))
        own.append(time.perf_counter() - t0)
        time.sleep(step_ms / 1000)  # the forward: the GIL let go, as vLLM's loop does waiting for the device
    stop.set()
    a = np.asarray(own)
    return {"steps": int(a.size), "own_p50_us": float(np.quantile(a, 0.5) * 1e6),
            "own_p99_us": float(np.quantile(a, 0.99) * 1e6), "own_p999_us": float(np.quantile(a, 0.999) * 1e6),
            "own_max_us": float(a.max() * 1e6), "steps_over_1ms": int((a > 1e-3).sum()),
            "dumps": len(dumps), "dump_p50_ms": float(np.median(dumps) * 1e3) if dumps else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", help="a commit whose attn_otel/stats.py is the old phase")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--step-ms", type=float, default=2.0, help="the loop's wait per step (the forward)")
    ap.add_argument("--dump-s", type=float, default=1.0, help="the dumper's period (the engine's: 1 s)")
    ap.add_argument("--switch-ms", type=float, default=0.2, help="the GIL switch interval (attn-otel's default)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--phase", nargs=2, metavar=("STATS_PY", "DUMP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        print(json.dumps(phase(args.phase[0], args.phase[1] == "1", args.seconds, args.step_ms, args.dump_s,
                               args.switch_ms)))
        return
    tmp = tempfile.mkdtemp(prefix="stats-stall-")
    phases = {"no dumper": (str(ROOT / "attn_otel/stats.py"), "0"), "new": (str(ROOT / "attn_otel/stats.py"), "1")}
    if args.old:
        old = os.path.join(tmp, "stats_old.py")
        Path(old).write_bytes(subprocess.run(["git", "-C", str(ROOT), "show", f"{args.old}:attn_otel/stats.py"],
                                             check=True, capture_output=True).stdout)
        phases["old"] = (old, "1")
    out: dict = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                 "python": platform.python_version(), "old": args.old, "seconds": args.seconds,
                 "step_ms": args.step_ms, "dump_s": args.dump_s, "switch_ms": args.switch_ms, "phases": {}}
    for i, (name, (path, dump)) in enumerate(phases.items(), 1):
        print(f"[stats-stall] phase {i}/{len(phases)}: {name} ({args.seconds:.0f} s)", file=sys.stderr, flush=True)
        r = subprocess.run([sys.executable, __file__, "--phase", path, dump, "--seconds", str(args.seconds),
                            "--step-ms", str(args.step_ms), "--dump-s", str(args.dump_s),
                            "--switch-ms", str(args.switch_ms)], check=True, capture_output=True, text=True)
        out["phases"][name] = json.loads(r.stdout.strip().splitlines()[-1])
    ref = out["phases"]["no dumper"]
    for name, p in out["phases"].items():
        p["ratios"] = {k: round(p[k] / ref[k], 2) for k in ("own_p99_us", "own_p999_us", "own_max_us")}
        print(f"{name:>10}: own p50 {p['own_p50_us']:7.1f} us  p99 {p['own_p99_us']:8.1f} us "
              f"(x{p['ratios']['own_p99_us']})  p99.9 {p['own_p999_us']:8.1f} us  max {p['own_max_us'] / 1e3:6.2f} ms  "
              f"steps > 1 ms: {p['steps_over_1ms']} of {p['steps']}"
              + (f"  snapshot p50 {p['dump_p50_ms']:.1f} ms" if p["dump_p50_ms"] else ""))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
