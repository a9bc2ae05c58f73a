"""attn_otel.hold on vLLM's own block pool (the CPU build's ``BlockPool``): a finished request's uncached blocks stay
out of the free queue through its ``steps`` scheduler steps, its cached ones go back at once in vLLM's order,
nothing is held without room or past an empty step, the oldest go back early where room runs out, and every
block comes back."""

from __future__ import annotations

import pytest

from attn_otel.hold import BlockHold, margin_blocks

BlockPool = pytest.importorskip("vllm.v1.core.block_pool").BlockPool


def _pool(n: int = 64, caching: bool = True):
    return BlockPool(num_gpu_blocks=n, enable_caching=caching, hash_block_size=16)


def _request(pool, n: int, hashed: int = 0):
    """A request's blocks in allocation order, its first ``hashed`` full and cached."""
    blocks = pool.get_new_blocks(n)
    for i, b in enumerate(blocks[:hashed]):
        b.set_block_hash(bytes([i + 1]) * 8 + b.block_id.to_bytes(4, "little"))
    return blocks


def _free_ids(pool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_uncached_blocks_are_held_through_one_step_then_reused_first():
    pool = _pool()
    total = pool.get_num_free_blocks()
    req = _request(pool, 5, hashed=3)
    hold = BlockHold(margin=8)
    hold.free(pool, req)
    cached, last = req[:3], req[3:]
    # cached blocks back at once, at the tail (vLLM's LRU order); the two uncached ones held
    assert pool.get_num_free_blocks() == total - 2 and hold.held == 2 and hold.holds == 1
    assert _free_ids(pool)[-3:] == [b.block_id for b in reversed(cached)]
    assert not {b.block_id for b in last} & set(_free_ids(pool))
    hold.before_schedule(pool)  # the step that hands the finished id to the worker: still held
    got = pool.get_new_blocks(4)
    assert not {b.block_id for b in got} & {b.block_id for b in last}
    pool.free_blocks(reversed(got))
    hold.before_schedule(pool)  # the step after: back, at the head of the free queue as vLLM puts them
    assert hold.held == 0 and pool.get_num_free_blocks() == total
    assert {b.block_id for b in pool.get_new_blocks(2)} == {b.block_id for b in last}


def test_without_prefix_caching_every_block_is_held():
    pool = _pool(caching=False)
    total = pool.get_num_free_blocks()
    hold = BlockHold(margin=4)
    hold.free(pool, _request(pool, 6))
    assert hold.held == 6 and pool.get_num_free_blocks() == total - 6
    hold.before_schedule(pool)
    hold.before_schedule(pool)
    assert hold.held == 0 and pool.get_num_free_blocks() == total


def test_an_empty_step_gives_them_back_at_once():
    pool = _pool()
    total = pool.get_num_free_blocks()
    hold = BlockHold(margin=4)
    hold.free(pool, _request(pool, 3))
    hold.before_schedule(pool)
    hold.after_schedule(pool, scheduled_tokens=5)  # a step with tokens keeps them
    assert hold.held == 3
    hold.free(pool, _request(pool, 2))  # freed during that step: held through the next
    hold.before_schedule(pool)
    hold.after_schedule(pool, scheduled_tokens=0)  # an empty one: the engine may go idle, nothing kept
    assert hold.held == 0 and pool.get_num_free_blocks() == total


def test_nothing_is_held_without_room():
    pool = _pool(n=32)
    total = pool.get_num_free_blocks()
    hold = BlockHold(margin=30)
    hold.free(pool, _request(pool, 4))
    assert hold.held == 0 and hold.skipped == 1 and pool.get_num_free_blocks() == total
    # room for some: held ones count against it
    hold = BlockHold(margin=10)
    hold.free(pool, _request(pool, 8))  # 23 free after it, 8 + 10 needed: held
    hold.free(pool, _request(pool, 8))  # 15 free, 8 held + 8 + 10 needed: freed
    assert hold.held == 8 and hold.holds == 1 and hold.skipped == 1
    hold.release_all(pool)
    assert hold.held == 0 and pool.get_num_free_blocks() == total


def test_blocks_are_held_for_their_steps_counted_from_the_step_that_hands_the_ids_over():
    pool = _pool()
    total = pool.get_num_free_blocks()
    hold = BlockHold(margin=4, steps=3)
    first = _request(pool, 2)
    hold.free(pool, first)
    hold.before_schedule(pool)  # step 1: the finished id goes to the worker
    second = _request(pool, 1)
    hold.free(pool, second)  # finishes during step 1: held from step 2 on
    hold.before_schedule(pool)  # step 2
    hold.before_schedule(pool)  # step 3: both still held
    assert hold.held == 3 and pool.get_num_free_blocks() == total - 3
    hold.before_schedule(pool)  # step 4: the first request's steps are up, not the second's
    assert hold.held == 1 and {b.block_id for b in pool.get_new_blocks(2)} == {b.block_id for b in first}
    hold.before_schedule(pool)
    assert hold.held == 0 and hold.early == 0


def test_the_oldest_go_back_early_when_room_runs_out():
    pool = _pool(n=64)
    hold = BlockHold(margin=20, steps=10)
    old, new = _request(pool, 3), _request(pool, 3)
    hold.free(pool, old)
    hold.before_schedule(pool)
    hold.free(pool, new)
    hold.before_schedule(pool)
    assert hold.held == 6
    taken = pool.get_new_blocks(pool.get_num_free_blocks() - 24)  # 24 free: under 6 held + 20, over 3 + 20
    hold.before_schedule(pool)
    assert hold.held == 3 and hold.early == 3  # the older request's blocks only
    assert {b.block_id for b in pool.get_new_blocks(3)} == {b.block_id for b in old}
    pool.free_blocks(reversed(taken))
    hold.release_all(pool)
    assert hold.held == 0


def test_margin_covers_a_sequence_a_step_and_the_running_requests_per_group():
    # Llama-3-8B online: max_model_len 8192, 8192 tokens a step, 256 sequences, blocks of 16, one group
    assert margin_blocks(8192, 8192, 256, 16, 1) == 512 + 512 + 256
    assert margin_blocks(100, 10, 2, 16, 2, watermark_blocks=5) == 2 * (7 + 1 + 2) + 5
