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
    assert on["joins"] > 30 and off["joins"] == 0  # it was used
    assert on["kept"] > 100 and off["kept"] == 0  # and kept its members across block boundaries
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


def test_a_member_given_the_block_its_token_starts_stays_counted():
    s = Steady(BS)
    t, lv = rec(5)
    s.bump()
    s.join("a", t, lv, 5)  # positions 5, 6, 7, then 8 starts a block
    for _ in range(3):
        assert s.split(["a"], [None], True, {"a": 1}) == []
        s.bump()
    assert s.split(["a"], [([7],)], True, {"a": 1}) == [] and s.crossed == [0] and "a" in s
    (m,) = s.keep(["a"])
    assert (t.written, lv.count, lv.next) == (8, 4, 8) and m[3] == s.epoch + 1 + BS and s.kept == 1
    s.bump()
    for _ in range(BS - 1):  # positions 9, 10, 11 inside the new block
        assert s.split(["a"], [None], True, {"a": 1}) == [] and s.crossed == []
        s.bump()
    assert s.split(["a"], [None], True, {"a": 1}) == [0] and "a" not in s  # 12 starts a block it is not given
    assert (t.written, lv.next) == (12, 12)


def test_a_crossing_member_given_more_than_its_one_token_goes_back():
    s = Steady(BS)
    t, lv = rec(7)
    s.bump()
    s.join("a", t, lv, 7)
    s.bump()
    assert s.split(["a"], [([7],)], False, {"a": 2}) == [0] and s.crossed == [] and "a" not in s


def test_the_crossing_members_blocks_writers_and_guards_in_one_pass():
    """vllm_adapter._steady_cross does for the step counter's crossing members what the ordinary path does for each:
    the block table extended, the stream's writer of the block the token starts, the guards' blocks and the reuse
    rule's fresh blocks; a member that drifted goes back to the ordinary path, counted there."""
    import numpy as np

    from attn_otel import vllm_adapter

    s = Steady(BS)
    recs = {}
    s.bump()
    for k, r in enumerate("abc"):
        t = SimpleNamespace(written=5, block_ids=[[30 + k, 10 + k]])  # positions 0-3, 4-7
        lv = SimpleNamespace(count=1, next=5, lo=0, idx=k)
        recs[r] = (t, lv)
        s.join(r, t, lv, 5)
    for _ in range(3):
        s.split(list("abc"), [None] * 3, True, {})
        s.bump()
    recs["c"][0].written = 6  # c's tracked count drifted from the scheduler's position
    stream = SimpleNamespace(group=0, block_size=BS, _writer=np.full(64, -1, dtype=np.int64))
    engine = SimpleNamespace(block_sizes=[BS])
    new = [([20],), ([21],), ([22],)]
    assert s.split(list("abc"), new, True, {}) == [] and s.crossed == [0, 1, 2]
    fresh = []
    writes, back = vllm_adapter._steady_cross(engine, s, stream, list("abc"), new, [8, 8, 8], set(), fresh)
    assert back == [2] and s.back == [2] and "c" not in s and "a" in s and "b" in s
    assert recs["a"][0].block_ids == [[30, 10, 20]] and recs["b"][0].block_ids == [[31, 11, 21]]
    assert recs["c"][0].block_ids == [[32, 12]]  # left to the ordinary path, which extends it
    assert stream._writer[20] == 0 and stream._writer[21] == 1 and stream._writer[22] == -1
    assert [w.tolist() for w in writes[0]] == [[20, 21]] and fresh == [[20], [21]]


def test_requests_of_one_length_cross_their_blocks_together_and_capture_as_one_by_one():
    """The offline 512+256 shape in small: every request of one length, so every member crosses a block in the same
    step, and the step counter keeps them all: the same captures, blocks and streamed rows as counting them one by
    one."""
    off, on = (step_track.measure(12, 90, "cpu", seed=5, steady=x, keep=True, fixed=(40, 30)) for x in (False, True))
    assert on["kept"] > 50 and on["steady_drift"] == 0
    assert on["finished"] and on["finished"] == off["finished"] and on["captured"] == off["captured"] > 0
    a, b = off["metrics"], on["metrics"]
    assert torch.equal(a.isnan(), b.isnan()) and (~a.isnan()).sum() > 1000
    torch.testing.assert_close(a.nan_to_num(), b.nan_to_num(), rtol=1e-3, atol=1e-3)
