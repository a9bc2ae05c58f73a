"""bench/step_track.py on this machine's CPU: the capture engine it drives really captures the requests its
synthetic scheduler finishes (none dropped, the ring's row counter kept to the host's count), every part of a
quiet step is timed, and a baseline that is no checkout is refused."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "step_track.py"


def test_the_bench_drives_a_capture_engine_that_captures_what_finishes():
    p = subprocess.run([sys.executable, str(BENCH), "--live", "8", "--steps", "120", "--device", "cpu"],
                       check=True, capture_output=True, text=True, timeout=600)
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["steps"] == 120 and r["captured"] > 0 and r["dropped"] == {}
    assert r["ring_drifts"] == 0 and r["flushes"] > 0
    assert 0 < r["quiet_steps"] < r["steps"]  # some steps finish requests, some do not
    assert 0 < r["quiet_us_p50"] <= r["quiet_us_p90"]
    assert all(v > 0 for v in r["quiet_parts_us_p50"].values()), r["quiet_parts_us_p50"]


def test_a_baseline_without_attn_otel_is_refused_by_name(tmp_path):
    p = subprocess.run([sys.executable, str(BENCH), "--baseline", str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode != 0 and "no attn_otel package there" in p.stderr
