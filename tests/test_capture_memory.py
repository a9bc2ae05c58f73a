"""Metrics-only capture never holds a T x T map: its peak extra memory grows linearly in T.

Measured on the CPU build's device (the CPU) around the finish-time capture path of CaptureEngine,
in a fresh process per length, as the peak resident set (VmHWM, reset just before) above the baseline.
"""

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from attn_otel.capture import CaptureEngine
    from attn_otel.tap import LayerSpec
    from attn_otel.tracking import FinishedRequest
    from attn_otel.config import Config
    torch.manual_seed(0)
    T = int(sys.argv[1]); H, KV, D = 9, 3, 64
    spec = LayerSpec(index=0, name="l0", num_heads=H, num_kv_heads=KV, head_dim=D, scale=D ** -0.5)
    eng = CaptureEngine(Config(store=sys.argv[2], maps_sample=0.0), [spec], T + 16, torch.bfloat16, "cpu")
    slots = torch.arange(T)
    eng.tap.write(0, torch.randn(T, H * D).bfloat16(), torch.randn(T, KV * D).bfloat16(), slots)
    req = FinishedRequest("r", list(range(T - 8)), list(range(8)), T, [list(range(T // 16 + 1))], [16],
                          {"attn_otel": "metrics"})
    warm = FinishedRequest("w", list(range(8)), [1], 9, [list(range(1))], [16], {"attn_otel": "metrics"})
    eng.on_finished(warm)  # first-call costs (kernels, lazy imports) are not per-token memory
    eng.flush(60)
    def kib(field):
        return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident set (VmHWM) to the current one
    base = kib("VmRSS:")
    eng.on_finished(req)
    eng.flush(60)  # the math runs on the compute thread
    peak = kib("VmHWM:")
    eng.flush(60)
    print(json.dumps({"T": T, "extra_kib": peak - base, "stored": eng.stats.snapshot()["stored"] - 1}))
""")


def _extra_kib(T, tmp_path):
    # Large blocks through mmap, one arena: the resident set then follows what is really allocated.
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "PYTHONPATH", "TMPDIR")}
    env.update({"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1"})
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(T), str(tmp_path / f"s{T}")], capture_output=True,
                         text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["stored"] == 1
    return out["extra_kib"]


def test_metrics_only_peak_memory_is_linear_in_tokens(tmp_path):
    small, large = _extra_kib(1024, tmp_path), _extra_kib(4096, tmp_path)
    full_map_kib = 9 * 4096 * 4096 * 4 // 1024  # one float32 map of one layer at T = 4096: 589,824 KiB
    print(f"peak extra memory: T=1024 {small} KiB, T=4096 {large} KiB (one full map would be {full_map_kib} KiB)")
    assert large < full_map_kib / 8
    assert large < 6 * small  # 4x the tokens: linear gives ~4x, quadratic ~16x
