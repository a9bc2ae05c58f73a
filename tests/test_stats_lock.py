"""The stats file's quantiles are computed outside the lock the engine loop's ``Stats.add`` takes: a step that
counts something while the stats file is written (once a second) does not wait for the sorting."""

from __future__ import annotations

import threading
import time

import numpy as np

from attn_otel import stats as stats_mod
from attn_otel.stats import QUANTILE_FIELDS, Stats, interval_split, quantiles


def test_quantiles_are_computed_with_the_lock_free(monkeypatch):
    s = Stats()
    rng = np.random.default_rng(1)
    for name in QUANTILE_FIELDS:
        getattr(s, name).extend(rng.random(500).tolist())
    s.step_intervals.extend(zip(rng.random(500).tolist(), rng.random(500).tolist()))
    held = []
    real_q, real_split = stats_mod.quantiles, stats_mod.interval_split
    monkeypatch.setattr(stats_mod, "quantiles", lambda v: held.append(s._lock.locked()) or real_q(v))
    monkeypatch.setattr(stats_mod, "interval_split", lambda p: held.append(s._lock.locked()) or real_split(p))
    s.add("spill_at", reason="held")
    snap = s.snapshot(percentiles=True)
    assert len(held) >= len(QUANTILE_FIELDS) + 1 and not any(held)  # each field's, the intervals'
    assert snap["spill_at"] == {"held": 1}
    for name in QUANTILE_FIELDS:  # the figures themselves, against NumPy
        vals = np.asarray(getattr(s, name))
        assert np.isclose(snap[name]["p99"], np.quantile(vals, 0.99))
        assert np.isclose(snap[name]["p50"], np.median(vals))
        assert snap[name]["n"] == vals.size and snap[name]["max"] == vals.max()
    pairs = np.asarray(s.step_intervals)
    assert np.isclose(snap["step_intervals"]["p90"], np.quantile(pairs[:, 0], 0.9))


def test_add_does_not_wait_for_a_snapshot():
    """A snapshot of full deques in one thread while another counts: no add waits anywhere near a snapshot's
    time (up to session 47 every add during one waited for all of it)."""
    s = Stats()
    for name in QUANTILE_FIELDS:
        getattr(s, name).extend(np.random.default_rng(2).random(10_000).tolist())
    s.step_intervals.extend((0.02, 1e-4) for _ in range(10_000))
    started, done = threading.Event(), threading.Event()
    snap_s = []

    def snap() -> None:
        started.set()
        t0 = time.perf_counter()
        for _ in range(5):
            s.snapshot(percentiles=True)
        snap_s.append((time.perf_counter() - t0) / 5)
        done.set()

    threading.Thread(target=snap).start()
    started.wait()
    waits = []
    while not done.is_set():
        t0 = time.perf_counter()
        s.add("empty_steps")
        waits.append(time.perf_counter() - t0)
        time.sleep(0.0005)
    # with the default 5 ms GIL switch interval an add may wait a switch for the GIL, never a whole snapshot
    assert max(waits) < snap_s[0] or max(waits) < 0.006, (max(waits), snap_s)
    assert s.empty_steps == len(waits)


def test_quantiles_match_numpy_and_empty():
    v = np.random.default_rng(3).random(1001)
    q = quantiles(v.tolist())
    assert [q["p50"], q["p90"], q["p99"]] == [float(np.quantile(v, x)) for x in (0.5, 0.9, 0.99)]
    assert quantiles([]) == {"n": 0} and interval_split([]) == {"n": 0}


def test_a_snapshot_copes_with_the_engine_loop_adding_a_step_part():
    """The engine loop adds to ``step_parts`` without the lock (only it writes there): a part seen for the first
    time while the stats thread's snapshot reads them must not fail the snapshot (run 43: "could not write
    stats ...: dictionary changed size during iteration")."""
    import sys

    s = Stats()
    for i in range(20_000):  # a long read, so that the other thread gets in during it
        s.step_parts[f"part{i}"] += 1e-3
    stop = threading.Event()

    def engine_loop():
        for i in range(100_000):
            if stop.is_set():
                return
            s.step_parts[f"new{i}"] += 1e-3

    was = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    th = threading.Thread(target=engine_loop)
    th.start()
    try:
        for _ in range(20):
            snap = s.snapshot()
            assert len(snap["step_host_s"]) >= 20_000
    finally:
        stop.set()
        th.join()
        sys.setswitchinterval(was)
