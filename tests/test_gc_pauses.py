"""attn_otel.stats.gc_pauses: the garbage collector's pauses in the engine's process, timed from gc.callbacks,
against the same collections timed around gc.collect here."""
import gc
import time

from attn_otel.stats import gc_pauses


def test_a_full_collection_is_counted_once_and_timed_within_its_call():
    g = gc_pauses()
    assert gc_pauses() is g and gc.callbacks.count(g) == 1  # one per process, registered once
    junk = [[i] for i in range(300_000)]  # tracked objects for the collector to walk
    gc.collect(2)
    counts, total = list(g.count), list(g.total_s)
    n = len(g.times)
    t0 = time.perf_counter()
    gc.collect(2)
    outside = time.perf_counter() - t0
    assert g.count == [counts[0], counts[1], counts[2] + 1]  # one full collection, nothing else
    inside = g.total_s[2] - total[2]
    assert 0 < inside <= outside and inside > 0.2 * outside, (inside, outside)  # the pause is most of the call
    assert len(g.times) == min(n + 1, g.times.maxlen) and g.times[-1] == inside
    snap = g.snapshot()
    assert snap["count"][2] == counts[2] + 1 and snap["max_s"][2] >= round(inside, 5) - 1e-5
    assert n + 1 <= snap["pauses"]["n"] <= sum(snap["count"]) and snap["pauses"]["max"] >= inside
    del junk


def test_young_collections_go_to_their_generation():
    g = gc_pauses()
    before = list(g.count)
    gc.collect(0)
    gc.collect(1)
    assert g.count[0] == before[0] + 1 and g.count[1] == before[1] + 1 and g.count[2] == before[2]
