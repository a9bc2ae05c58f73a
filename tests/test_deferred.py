"""attn_otel.deferred: when finished requests' capture work, held over a few engine steps, must be taken."""

from types import SimpleNamespace

import numpy as np
import pytest

from attn_otel.deferred import DeferredFinish, flat_blocks


def fin(*groups):
    return SimpleNamespace(block_ids=[list(g) for g in groups])


def none():
    return np.zeros(0, dtype=np.int64)


def test_nothing_held_is_never_due():
    d = DeferredFinish(max_steps=4)
    assert not d.due(np.array([1, 2, 3]), idle=True) and len(d) == 0


def test_held_until_one_of_their_blocks_is_given_out_again():
    d = DeferredFinish(max_steps=16)
    d.add(["a", "b"], [fin([3, 4], [9]), fin([7])])
    assert not d.due(none(), idle=False)
    assert not d.due(np.array([1, 2, 5, 8, 100_000]), idle=False)  # others' blocks, one past the mark table
    assert d.due(np.array([2, 9]), idle=False) and d.reason == "reuse"  # a block of a's second KV-cache group
    ids, finished = d.take()
    assert ids == ["a", "b"] and [f.block_ids for f in finished] == [[[3, 4], [9]], [[7]]]
    assert len(d) == 0 and d.batches == 1
    d.add(["c"], [fin([1])])
    assert not d.due(np.array([3, 4, 7, 9]), idle=False)  # a's and b's blocks are no longer marked


def test_the_finished_ids_without_a_capture_are_kept_for_the_cleanups():
    d = DeferredFinish()
    d.add(["warm", "a"], [fin([1])])
    assert d.take()[0] == ["warm", "a"]


@pytest.mark.parametrize("why", ["idle", "maps", "age", "count"])
def test_taken_when_the_engine_goes_idle_for_maps_when_old_or_when_many(why):
    d = DeferredFinish(max_steps=3, max_requests=5)
    d.add(["a"], [fin([1])], maps=why == "maps")
    if why == "count":
        d.add([f"r{i}" for i in range(4)], [fin([10 + i]) for i in range(4)])
    due = [d.due(none(), idle=why == "idle") for _ in range(4)]
    want = {"idle": [True] * 4, "maps": [True] * 4, "count": [True] * 4, "age": [False, False, False, True]}[why]
    assert due == want
    assert d.reason == why  # the stats' finish_batch_reasons


def test_a_maps_request_waits_like_the_others_while_no_row_of_it_is_wanted():
    """``rows_short`` False (the map tap has rows for every planned token of the step): a held maps request
    is taken by the other rules only; the first step that may want its rows takes the batch, for maps."""
    d = DeferredFinish(max_steps=5, max_requests=8)
    d.add(["m", "a"], [fin([1]), fin([2])], maps=[True, False])
    assert [d.due(none(), False, rows_short=False) for _ in range(3)] == [False] * 3
    assert d.due(none(), False, rows_short=True) and d.reason == "maps"
    d.take()
    d.add(["m2"], [fin([3])], maps=True)
    assert not any(d.due(none(), False, rows_short=False) for _ in range(5))
    assert d.due(none(), False, rows_short=False) and d.reason == "age"  # the age rule still bounds the wait
    d.take()
    d.add(["m3"], [fin([4])], maps=True)
    assert d.due(np.array([4]), False, rows_short=False) and d.reason == "reuse"  # and the reuse rule
    d.take()
    d.add(["m4"], [fin([5])], maps=True)
    assert d.due(none(), True, rows_short=False) and d.reason == "idle"


def test_age_counts_from_the_oldest_held_request():
    d = DeferredFinish(max_steps=2)
    d.add(["a"], [fin([1])])
    assert not d.due(none(), False)
    d.add(["b"], [fin([2])])  # a later finish does not restart the clock
    assert not d.due(none(), False)
    assert d.due(none(), False)
    d.take()
    d.add(["c"], [fin([3])])  # a new batch does
    assert not d.due(none(), False)


def test_zero_steps_means_in_the_step_it_finishes():
    d = DeferredFinish(max_steps=0)
    d.add(["a"], [fin([1])])
    assert d.due(none(), idle=False)


def test_block_ids_beyond_the_mark_table_grow_it():
    d = DeferredFinish()
    d.add(["a"], [fin([5000])])
    assert d.due(np.array([5000]), idle=False)


def test_flat_blocks():
    assert flat_blocks([[1, 2], [], [3]]).tolist() == [1, 2, 3] and flat_blocks([]).dtype == np.int64


def test_a_held_block_given_out_again_is_seen_whatever_rule_takes_the_batch():
    """``reused`` says whether the step's forward writes one of the held blocks even where an earlier rule (the
    age here) takes the batch: such a batch must run before the forward, not after its launch."""
    d = DeferredFinish(max_steps=0)
    d.add(["a"], [SimpleNamespace(block_ids=[[3, 4]])])
    assert d.due(np.asarray([4, 9]), idle=False) and d.reason == "age" and d.reused
    d.take()
    d.add(["b"], [SimpleNamespace(block_ids=[[5]])])
    assert d.due(np.asarray([4, 9]), idle=False) and d.reason == "age" and not d.reused
    d.take()
    assert not d.due(np.asarray([5]), idle=False) and not d.reused  # nothing held: nothing reused


def rec(rid, *groups):
    return SimpleNamespace(request_id=rid, block_ids=[list(g) for g in groups])


def test_a_batch_due_by_count_alone_takes_the_oldest_chunk_and_keeps_the_rest_marked():
    d = DeferredFinish(max_steps=16, max_requests=4, chunk=2)
    d.add(["a", "warm", "b"], [rec("a", [1]), rec("b", [2, 3])])
    assert not d.due(none(), idle=False)
    d.add(["c", "d", "e"], [rec("c", [4]), rec("d", [5]), rec("e", [6])])
    assert d.due(none(), idle=False) and d.reason == "count" and d.limit == 2
    ids, taken = d.take(d.limit)
    assert ids == ["a", "warm", "b"] and [f.request_id for f in taken] == ["a", "b"]  # ids without a record go first
    assert len(d) == 3 and d.batches == 1
    assert not d.due(np.array([1, 2, 3]), idle=False)  # a's and b's blocks are free to reuse
    assert d.due(np.array([5]), idle=False) and d.reason == "reuse" and d.limit is None  # d's still marked
    ids, taken = d.take(d.limit)
    assert ids == ["c", "d", "e"] and len(taken) == 3 and len(d) == 0


def test_a_batch_due_for_maps_takes_every_maps_request_and_the_oldest_others_up_to_the_chunk():
    d = DeferredFinish(max_steps=16, max_requests=64, chunk=3)
    d.add(["a", "b", "c", "d"], [rec(r, [i]) for i, r in enumerate("abcd")])
    assert not d.due(none(), idle=False)
    d.add(["e", "f"], [rec("e", [10]), rec("f", [11])], maps=[False, True])
    assert d.due(none(), idle=False) and d.reason == "maps" and d.limit == 3
    ids, taken = d.take(d.limit)
    assert ids == ["a", "b", "f"] and [f.request_id for f in taken] == ["a", "b", "f"]
    assert not d.maps and len(d) == 3 and not d.due(none(), idle=False)  # no maps request left: held again
    d.add(["g", "h"], [rec("g", [12]), rec("h", [13])], maps=[True, True])
    d.add(["i"], [rec("i", [14])], maps=True)
    assert d.due(none(), idle=False) and d.limit == 3 and [f.request_id for f in d.take(d.limit)[1]] == ["g", "h", "i"]
    with pytest.raises(ValueError):
        d.add(["j"], [rec("j", [15])], maps=[True, False])


@pytest.mark.parametrize("why", ["idle", "maps", "age", "reuse"])
def test_every_other_reason_takes_the_whole_batch(why):
    """(Maps here: all three planned for maps, more than the chunk.)"""
    d = DeferredFinish(max_steps=0 if why == "age" else 16, max_requests=2 if why != "age" else 100, chunk=1)
    d.add(["a", "b", "c"], [rec("a", [1]), rec("b", [2]), rec("c", [3])], maps=why == "maps")
    assert d.due(np.array([2]) if why == "reuse" else none(), idle=why == "idle")
    assert d.limit is None and len(d.take(d.limit)[1]) == 3


def test_a_count_batch_with_a_reused_block_takes_everything_before_the_forward():
    d = DeferredFinish(max_requests=2, chunk=1)
    d.add(["a", "b"], [rec("a", [1]), rec("b", [2])])
    assert d.due(np.array([2]), idle=False) and d.reason == "count" and d.reused and d.limit is None


def test_chunk_zero_takes_all_at_the_count():
    d = DeferredFinish(max_requests=2)
    d.add(["a", "b", "c"], [rec("a", [1]), rec("b", [2]), rec("c", [3])])
    assert d.due(none(), idle=False) and d.limit is None and len(d.take(d.limit)[1]) == 3
