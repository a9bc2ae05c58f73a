"""bench/flush_host.py on this machine's CPU: the stream it drives flushes real rows with the ring's row
counter kept to the host's count, every part is timed, and a baseline that is no checkout is refused."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "flush_host.py"


def test_the_bench_times_every_part_of_a_stream_that_really_flushes(tmp_path):
    out = tmp_path / "fh.json"
    subprocess.run([sys.executable, str(BENCH), "--live", "2", "--calls", "12", "--rows", "4096", "--device", "cpu",
                    "--out", str(out)], check=True, capture_output=True, text=True, timeout=600)
    r = json.loads(out.read_text())
    assert r["ring_drifts"] == 0  # the bench's forwards and the host's count agree, so no capture was lost
    assert r["flushes"] >= 12 and r["flushed_rows"] >= 12  # a finish flush a call, each with pending rows
    assert set(r["us"]) == {"finish_flush", "spill_copy", "eager_write_4_layers", "schedule_decode", "all_live_flush"}
    for part, q in r["us"].items():
        assert 0 < q["50"] <= q["90"] <= q["99"], (part, q)


def test_a_baseline_without_attn_otel_is_refused_by_name(tmp_path):
    p = subprocess.run([sys.executable, str(BENCH), "--baseline", str(tmp_path), "--device", "cpu"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "no attn_otel package there" in p.stderr
