"""attn_otel.steady: running requests counted by one step counter give the counts, the captures and the streamed
rows that counting them one by one gives."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from attn_otel.steady import Steady

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import step_track  # noqa: E402

BS = 4


def rec(written: int, nxt: int | None = None):
    return SimpleNamespace(written=written), SimpleNamespace(count=1, next=written if nxt is None else nxt, lo=0)


def test_a_member_is_counted_by_the_step_counter_until_it_crosses_a_block():
    s = Steady(BS)
    t, lv = rec(5)
    s.bump()
    s.join("a", t, lv, 5)  # next token at position 5: positions 5, 6, 7 in its block, 8 starts the next
    for _ in range(3):
        assert s.split(["a"], [None], True, {"a": 1}) == [] and "a" in s
        s.bump()
    assert t.written == 5 and lv.count == 1  # not applied yet
    assert s.split(["a"], [None], True, {"a": 1}) == [0] and "a" not in s  # its token at 8 starts a block
    assert (t.written, lv.count, lv.next) == (8, 4, 8)


def test_a_member_leaves_with_its_counts_when_not_scheduled_given_blocks_or_more_tokens():
    s = Steady(BS)
    recs = {r: rec(1) for r in "abcd"}
    s.bump()
    for r, (t, lv) in recs.items():
        s.join(r, t, lv, 1)
    s.bump()  # each took position 1
    ids = ["d", "b", "c"]  # a waits this step
    picks = s.split(ids, [None, ([9],), None], False, {"d": 1, "b": 1, "c": 2})
    assert [ids[i] for i in picks] == ["b", "c"]  # b given a block, c two tokens
    assert len(s) == 1 and "d" in s
    for r in "abc":  # applied: position 1 taken, not this step's
        assert (recs[r][0].written, recs[r][1].count, recs[r][1].next) == (2, 2, 2), r
    s.bump()
    s.settle_all()
    assert (recs["d"][0].written, recs["d"][1].next) == (3, 3)


def test_a_request_whose_next_token_starts_a_block_does_not_join():
    s = Steady(BS)
    t, lv = rec(8)
    s.join("a", t, lv, 8)
    assert "a" not in s and s.split(["a"], [None], True, {"a": 1}) == [0]


@pytest.fixture(scope="module")
def both():
    return {on: step_track.measure(24, 160, "cpu", seed=3, steady=on, keep=True) for on in (False, True)}


def test_the_step_counter_captures_what_one_by_one_counting_captures(both):
    off, on = both[False], both[True]
    assert on["joins"] > 100 and off["joins"] == 0  # it was used
    assert on["steady_drift"] == 0  # each member came back at the position the scheduler gave it
    assert on["finished"] and on["finished"] == off["finished"]  # every request, its tokens and blocks
    assert on["captured"] == off["captured"] > 0 and on["dropped"] == off["dropped"] == {}


def test_the_step_counter_leaves_the_streamed_rows_as_they_were(both):
    a, b = both[False]["metrics"], both[True]["metrics"]
    assert torch.equal(a.isnan(), b.isnan()) and (~a.isnan()).sum() > 1000
    torch.testing.assert_close(a.nan_to_num(), b.nan_to_num(), rtol=1e-3, atol=1e-3)


def test_a_step_whose_bookkeeping_fails_still_counts_the_members_token():
    from attn_otel import vllm_adapter

    s = Steady(BS)
    t, lv = rec(1)
    s.bump()
    s.join("a", t, lv, 1)
    so = SimpleNamespace(scheduled_cached_reqs=SimpleNamespace(req_ids=["a"], new_block_ids=[None]))

    def failing(runner, engine, so_, t0):  # the split made, then the step's bookkeeping raises
        s.split(["a"], [None], True, {"a": 1})
        raise RuntimeError("after the split")

    engine = SimpleNamespace(steady=s, stats=SimpleNamespace(add=lambda *a, **k: None, step_times=[]), step_own=0.0,
                             warn_once=lambda *a, **k: None)
    orig, vllm_adapter._track = vllm_adapter._track, failing
    try:
        runner = SimpleNamespace(_attn_otel=engine)
        vllm_adapter._before_step(lambda r, so_: "forward", runner, so)
    finally:
        vllm_adapter._track = orig
    s.settle_all()
    assert not s.due and (t.written, lv.next) == (2, 2)


def test_the_stats_threads_count_of_pending_rows_settles_nothing():
    """MetricsStream.pending, which the stats thread calls once a second while the engine loop runs: the rows the
    step counter's members took count as settling them would count them, and no member is settled (run 44: the
    stats thread's settle_all raced the engine loop's own settling, which could apply a member's steps twice, and
    its walk of the members failed the stats file with "dictionary changed size during iteration")."""
    from attn_otel.stream import MetricsStream

    s = Steady(BS)
    recs = {r: rec(1) for r in "abc"}
    s.bump()
    for r, (t, lv) in recs.items():
        s.join(r, t, lv, 1)
    for _ in range(2):  # each member takes positions 1 and 2
        assert s.split(list("abc"), [None] * 3, True, {}) == []
        s.bump()
    stream = SimpleNamespace(_live={r: lv for r, (_, lv) in recs.items()}, steady=s)
    before = [(t.written, lv.count, lv.next) for t, lv in recs.values()]
    assert MetricsStream.pending(stream) == 3 * (1 + 2)
    assert [(t.written, lv.count, lv.next) for t, lv in recs.values()] == before  # nothing applied
    assert s.unsettled() == 6 and len(s) == 3
    s.settle_all()  # the engine loop's settling gives the same count
    assert sum(lv.count for _, lv in recs.values()) == 9 and s.unsettled() == 0
    assert MetricsStream.pending(stream) == 9
