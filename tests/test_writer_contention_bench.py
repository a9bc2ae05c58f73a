"""bench/writer_contention.py: the real hand-off (writer threads and processes, a local store) beside a stand-in
engine loop, every capture stored, the figures it reports computed from the loop's own steps."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_bench_stores_every_capture_and_reports_the_loops_steps(tmp_path):
    out = tmp_path / "wc.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "writer_contention.py"), "--batch", "6", "--repeats",
                           "2", "--writers", "1", "--alone-s", "0.5", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    # both phases' batches and the warm-up's 4 a writer
    assert res["stored"] == 2 * 6 * 2 + 4 and res["dropped"] == {}, res
    for phase in ("alone", "batch", "one_by_one"):
        q = res[phase]
        assert q["n"] > 0 and 0 < q["p50_ms"] <= q["p99_ms"] <= q["max_ms"], q
    assert res["alone"]["p50_ms"] < 50  # steps of about --step-us (0.5 ms) of work, on any machine
    for phase in ("batch", "one_by_one"):
        assert res[phase]["feed_cpu_ms_per_capture"] > 0 and res[phase]["batch_wall_ms"] > 0
        assert res[phase]["ratios"]["p50_ms"] == res[phase]["p50_ms"] / res["alone"]["p50_ms"]


def test_bad_arguments_are_refused():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "writer_contention.py"), "--batch", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "must be positive" in proc.stderr
