"""Load: 200 concurrent requests, maps on for all of them, through one real engine.  Memory stays within
the hand-offs' byte bounds, no request hangs, and every capture is stored complete or counted as dropped."""

from __future__ import annotations

import numpy as np
import pytest
from rel_common import (DISK_DEVICE_QUEUE_BYTES, DISK_QUEUE_BYTES, LOAD_REQUESTS, assert_accounted, delta,
                        traceparent)
from text import prose

from attn_otel.ids import new_trace_id

pytestmark = pytest.mark.engine

N = LOAD_REQUESTS
TOKENS = 16
MiB = 1 << 20
# What the engine process may grow by beyond the same load with capture off: the two hand-off bounds, plus
# the per-capture buffers outside them (one capture being handed to a writer, allocator slack).
SLACK = 64 * MiB
# A writer process holds one capture at a time (shared memory, read in place) and zarr's encoding buffers.
WRITER_BOUND = DISK_QUEUE_BYTES + 64 * MiB


def _peak_growth(before: dict, after: dict) -> dict[str, int]:
    """Bytes each process's peak resident set (after) rose above its resident set at the reset (before)."""
    return {pid: (after[pid]["hwm_kib"] - before[pid]["rss_kib"]) * 1024 for pid in after if pid.isdigit() and pid in before}


def test_200_concurrent_map_requests_stay_in_the_memory_bound_and_none_is_lost(disk_engine):
    from attn_otel.reader import list_captures

    prompts = [prose(18 + i % 10, seed=i) for i in range(N)]
    # the writers exist and the first-call costs are paid before anything is measured
    disk_engine.generate(prompts[:4], extra_args={"attn_otel": "maps"}, max_tokens=TOKENS)
    assert disk_engine.call("flush", timeout=120)["done"]
    main = str(disk_engine.pid)

    # control: the same 200 requests with capture off, for vLLM's own memory under this load
    disk_engine.call("reset_peak")
    base = disk_engine.call("memory")
    disk_engine.generate(prompts, extra_args={"attn_otel": "off"}, max_tokens=TOKENS, timeout=600)
    control = _peak_growth(base, disk_engine.call("memory"))[main]

    before = disk_engine.stats()
    traces = [new_trace_id() for _ in range(N)]
    disk_engine.call("reset_peak")
    base = disk_engine.call("memory")
    res = disk_engine.generate(prompts, extra_args=[{"attn_otel": "maps", "traceparent": traceparent(t)}
                                                    for t in traces], max_tokens=TOKENS, timeout=600)
    served = disk_engine.stats()
    assert disk_engine.call("flush", timeout=300)["done"], "captures not written or dropped within 300 s"
    growth = _peak_growth(base, disk_engine.call("memory"))
    after = disk_engine.stats()

    # no request hangs: all 200 came back in full
    assert [o["output_tokens"] for o in res["outputs"]] == [TOKENS] * N
    d = delta(after, before)
    assert_accounted(d, N)

    # per trace: a complete capture in the store, or one of the counted drops
    caps = {c.trace_id: c for c in list_captures(disk_engine.store) if c.trace_id in set(traces)}
    drops = sum(v for k, v in d.items() if k.startswith("dropped."))
    assert len(caps) + drops == N, (len(caps), d)
    lengths = {t: o["prompt_tokens"] + o["output_tokens"] - 1 for t, o in zip(traces, res["outputs"])}
    metrics_only = 0
    for t, cap in caps.items():
        assert cap.num_tokens == lengths[t]
        if cap.has_maps:
            assert cap.attn.shape == (len(cap.layers), cap.num_heads, lengths[t], lengths[t])
            assert set(cap.meta["metrics"]) >= {"entropy_norm", "sink_mass_first"}
        else:
            metrics_only += 1
            assert cap.meta.get("metrics") or cap.meta.get("summary_metrics")  # rows or their summary
    # every request kept its queries (the tap holds MAP_TAP_TOKENS), so maps were skipped for the host
    # hand-off's bound alone, and some made it through it: the load was on the hand-offs
    assert d.get("skipped.map_rows_missing", 0) == 0, d
    assert metrics_only == d.get("skipped.maps_queue_full", 0)
    assert len(caps) - metrics_only > 0, d
    for cap in list(caps.values())[:: max(1, len(caps) // 5)]:  # a few read in full: rows sum to 1
        if cap.has_maps:
            rows = cap.maps(layers=[cap.layers[-1]])[0].sum(axis=-1)
            np.testing.assert_allclose(rows, 1.0, atol=5e-3)

    engine_growth = growth.pop(main)
    bound = DISK_QUEUE_BYTES + DISK_DEVICE_QUEUE_BYTES + max(control, 0) + SLACK
    writers = {pid: g for pid, g in growth.items()}
    print(f"\n[reliability] {N} concurrent requests, maps on: {res['elapsed_s']:.1f} s, "
          f"{N * TOKENS / res['elapsed_s']:.0f} generated tok/s; counters {d}; "
          f"peak queued right after serving {served['pending_bytes'] / MiB:.1f} MiB; engine process peak growth "
          f"{engine_growth / MiB:.1f} MiB (capture off: {control / MiB:.1f} MiB; bound {bound / MiB:.0f} MiB = "
          f"host {DISK_QUEUE_BYTES / MiB:.0f} + device {DISK_DEVICE_QUEUE_BYTES / MiB:.0f} + capture-off growth "
          f"+ {SLACK / MiB:.0f}); writer peak growth "
          f"{ {pid: round(g / MiB, 1) for pid, g in writers.items()} } MiB (bound {WRITER_BOUND / MiB:.0f} MiB); "
          f"{len(caps)} stored ({metrics_only} metrics-only), {drops} dropped")
    assert served["pending_bytes"] <= DISK_QUEUE_BYTES and served["device_bytes"] <= DISK_DEVICE_QUEUE_BYTES
    assert engine_growth <= bound, (engine_growth, bound)
    assert all(g <= WRITER_BOUND for g in writers.values()), writers
