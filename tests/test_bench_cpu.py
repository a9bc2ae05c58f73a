"""bench/overhead.py's per-run CPU accounting: seconds by process/thread name, attn-otel's threads named
in the OS (attn_otel.writer_proc.os_thread_name)."""

import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import overhead  # noqa: E402

from attn_otel.writer_proc import os_thread_name as _os_thread_name  # noqa: E402

# the report's inputs as run 28 (offline) and run 29a (online) left them: fixtures, not the current report's files
RUN28 = Path(__file__).resolve().parent / "data" / "bench" / "run28-29a"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_named_threads_cpu_time_is_counted_under_its_name():
    stop = threading.Event()

    def spin():
        _os_thread_name("attn-otel-comp")
        t0 = time.process_time()
        while time.process_time() - t0 < 0.6:  # about 0.6 s of CPU (shared clock, so at least 0.3 s of ours)
            sum(range(10_000))
        stop.wait(10)

    before = overhead._cpu_by_thread()
    t = threading.Thread(target=spin)
    t.start()
    deadline = time.monotonic() + 30
    delta = {}
    while time.monotonic() < deadline:
        time.sleep(0.2)
        delta = overhead._cpu_delta(before, overhead._cpu_by_thread())
        if any(k.endswith("/attn-otel-comp") and v >= 0.2 for k, v in delta.items()):
            break
    stop.set()
    t.join()
    mine = {k: v for k, v in delta.items() if k.endswith("/attn-otel-comp")}
    assert len(mine) == 1 and 0.2 <= next(iter(mine.values())) <= 5, delta
    assert all(v > 0 for v in delta.values()) and len(delta) <= 12


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_thread_name_longer_than_the_os_allows_is_cut_not_refused():
    names = {}

    def run():
        _os_thread_name("attn-otel-a-very-long-name")
        names["comm"] = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert names["comm"] == "attn-otel-a-ver"  # 15 bytes


def test_a_workloads_capture_delta_is_the_difference_of_two_engine_snapshots(tmp_path):
    import json

    from attn_otel.stats import write_stats_file

    # run 28's all-layers phase: the engine core's last snapshot, as its stats file held it
    final = json.loads((RUN28 / "phase-all.json").read_text())["capture"]
    assert overhead._latest_stats(tmp_path) == {}
    write_stats_file(str(tmp_path), final)
    assert overhead._latest_stats(tmp_path) == final

    whole = overhead.capture_delta({}, final, 271.0)
    gpu = final["stream_device_s"] + final["stream_direct_device_s"] + final["finish_device_s"]
    assert whole["gpu_s"] == pytest.approx(gpu) and whole["gpu_share"] == pytest.approx(gpu / 271.0)
    assert 0.05 < whole["gpu_share"] < 0.12  # the 8.2% run 28 reported (docs/benchmarks/history.md)
    assert whole["host_s"] == pytest.approx(sum(final["step_host_s"].values()))
    assert whole["stored"] == final["stored"] and whole["dropped"] == {}

    half = {**final, "stream_device_s": final["stream_device_s"] / 2, "finish_device_s": 0.0,
            "stream_direct_device_s": final["stream_direct_device_s"] - 1.0, "stored": final["stored"] - 100,
            "step_host_s": {k: v / 2 for k, v in final["step_host_s"].items()}, "dropped": {"queue_full": 1}}
    after = {**final, "dropped": {"queue_full": 3, "shutdown": 1}}
    d = overhead.capture_delta(half, after, 100.0)
    want = final["stream_device_s"] / 2 + final["finish_device_s"] + 1.0
    assert d["gpu_s"] == pytest.approx(want) and d["gpu_share"] == pytest.approx(want / 100.0)
    assert d["finish_device_s"] == pytest.approx(final["finish_device_s"]) and d["stream_direct_device_s"] == pytest.approx(1.0)
    assert d["host_s"] == pytest.approx(sum(final["step_host_s"].values()) / 2)
    assert d["host_parts"] == {k: pytest.approx(v / 2, abs=1e-4) for k, v in final["step_host_s"].items()}
    batches = {"finish_batch_times": {"n": 40}}
    assert overhead.capture_delta(batches, {"finish_batch_times": {"n": 52}}, 1.0)["finish_batches"] == 12
    assert d["stored"] == 100 and d["dropped"] == {"queue_full": 2, "shutdown": 1}
    gc_before = {"count": [300, 20, 3], "total_s": [0.1, 0.05, 1.5], "max_s": [0.004, 0.03, 0.6]}
    gc_after = {"count": [340, 23, 4], "total_s": [0.12, 0.06, 1.62], "max_s": [0.004, 0.03, 0.6]}
    d = overhead.capture_delta({**half, "gc_pauses": gc_before}, {**after, "gc_pauses": gc_after}, 100.0)
    assert d["gc"] == {"count": [40, 3, 1], "total_s": [0.02, 0.01, 0.12]}  # one full collection while it served
    assert whole["gc"] == {"count": [0, 0, 0], "total_s": [0, 0, 0]}  # run 28's stats had no gc_pauses yet
    assert overhead.capture_delta(final, final, 0.0)["gpu_share"] is None


def test_the_report_merges_the_phase_files_in_the_issues_schema(tmp_path):
    import json
    import shutil
    import statistics

    for name in ("phase-off.json", "phase-default.json", "phase-all.json", "online-off.json", "online-default.json"):
        shutil.copy(RUN28 / name, tmp_path / name)  # run 28's phases (totals only) and run 29a's servers
    phases = {p: json.loads((tmp_path / f"phase-{p}.json").read_text()) for p in ("off", "default", "all")}
    d = phases["default"]  # a workload measured since run 28 carries its share of the capture stats
    d["runs"]["mixed"]["capture_delta"] = overhead.capture_delta({}, d["capture"], 100.0)
    (tmp_path / "phase-default.json").write_text(json.dumps(d))
    doc = overhead.report(tmp_path)
    for wl in ("512+256", "8k+128", "mixed", "kv_bound"):
        for config, phase in (("default", "default"), ("all_layers", "all")):
            want = phases[phase]["runs"][wl]["output_tokens_per_s"] / phases["off"]["runs"][wl]["output_tokens_per_s"]
            assert doc["workloads"][wl]["ratios"][config] == pytest.approx(want)
    assert doc["kv_capacity"]["all_layers"] == pytest.approx(
        phases["all"]["kv_cache_tokens"] / phases["off"]["kv_cache_tokens"])
    assert doc["workloads"]["mixed"]["gpu_share"] == {"default": pytest.approx(d["runs"]["mixed"]["capture_delta"]["gpu_share"]),
                                                     "all_layers": None}
    assert "gpu_share" not in doc["workloads"]["512+256"]
    online = doc["workloads"]["online"]
    assert online["ttft_p99_ratio"] > 0 and online["itl_p99_ratio"] > 0 and online["ratios"]["all_layers"] is None
    runs = {p: json.loads((tmp_path / f"online-{p}.json").read_text())["runs"] for p in ("off", "default")}
    med = {p: statistics.median(r["tpot_p50_s"] for r in runs[p]) for p in runs}  # TPOT: the tokens' pace a request sees
    assert online["tpot_p50_ratio"]["default"] == pytest.approx(med["default"] / med["off"])
    assert json.loads((tmp_path / "overhead.json").read_text())["workloads"]["mixed"]["ratios"] == doc["workloads"]["mixed"]["ratios"]
    assert (tmp_path / "overhead.png").stat().st_size > 10_000 and "| mixed |" in (tmp_path / "overhead-table.md").read_text()


def test_a_merged_phase_file_pairs_each_cell_with_the_capture_off_run_of_its_own_call(tmp_path):
    """Cells merged from two calls (two machines): each ratio against its own call's capture off, and the table
    names each cell's machine."""
    import json
    import shutil

    for name in ("phase-off.json", "phase-default.json", "phase-all.json"):
        shutil.copy(RUN28 / name, tmp_path / name)
    phases = {p: json.loads((tmp_path / f"phase-{p}.json").read_text()) for p in ("off", "default", "all")}
    a = phases["all"]
    own_off = {"output_tokens_per_s": 2 * phases["off"]["runs"]["mixed"]["output_tokens_per_s"]}
    a["runs"]["mixed"] |= {"off": own_off, "gpu": "GPU 0: NVIDIA H200 (UUID: GPU-2db2aa07-65b0)", "date": "2026-12-02"}
    (tmp_path / "phase-all.json").write_text(json.dumps(a))
    doc = overhead.report(tmp_path)
    mixed = doc["workloads"]["mixed"]["ratios"]
    assert mixed["all_layers"] == pytest.approx(a["runs"]["mixed"]["output_tokens_per_s"] / own_off["output_tokens_per_s"])
    assert mixed["default"] == pytest.approx(phases["default"]["runs"]["mixed"]["output_tokens_per_s"]
                                             / phases["off"]["runs"]["mixed"]["output_tokens_per_s"])
    rows = {line.split(" | ")[0].strip("| "): line for line in (tmp_path / "overhead-table.md").read_text().splitlines()}
    assert "all layers: H200 GPU-2db2aa07, 2026-12-02" in rows["mixed"] and "default: " in rows["mixed"]
    assert "GPU-2db2aa07" not in rows["8k+128"] and "; " not in rows["8k+128"]


def _stats_file(stats_dir: Path, **snap) -> None:
    import json
    import os

    tmp = stats_dir / "attn-otel-stats-1.json.tmp"
    tmp.write_text(json.dumps(snap))
    os.replace(tmp, stats_dir / "attn-otel-stats-1.json")  # as the engine writes it: replaced whole


def test_the_online_measurement_waits_until_the_warm_ups_captures_are_written(tmp_path, monkeypatch):
    monkeypatch.setattr(overhead, "STATS_WAIT_S", 0.05)
    _stats_file(tmp_path, captured=10, stored=6, dropped={"queue_full": 1})  # 3 still on their way
    timer = threading.Timer(0.6, _stats_file, (tmp_path,), dict(captured=10, stored=9, dropped={"queue_full": 1}))
    timer.start()
    try:
        waited = overhead.drain(tmp_path, capturing=True, timeout_s=20)
    finally:
        timer.cancel()
    assert waited is not None and 0.6 <= waited < 20


def test_a_backlog_that_outlasts_the_timeout_is_reported_not_waited_for(tmp_path, monkeypatch):
    monkeypatch.setattr(overhead, "STATS_WAIT_S", 0.05)
    _stats_file(tmp_path, captured=10, stored=2, dropped={})
    assert overhead.drain(tmp_path, capturing=True, timeout_s=0.3) is None
    assert overhead.drain(tmp_path, capturing=False, timeout_s=0.3) == pytest.approx(0.05, abs=0.2)  # capture off
