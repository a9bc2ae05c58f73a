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
