"""The map tap (attn_otel.tap.MapTap), driven as the adapter drives it: each step's ``schedule`` before the
forward, the forward's query writes by KV slot, ``complete`` / ``rows_of`` / ``gather`` at finish.

A toy paged layout (blocks handed out from a free list, prefill in chunks, decode steps, a preemption that
resumes in other blocks, speculative tokens taken back, requests not planned for maps beside the planned
ones): the queries gathered at finish must be each planned request's own, position by position, and the
slot table must point nothing else at them.  Slots are pointed a block at a time, so a decode step inside a
block uploads nothing: counted here."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from attn_otel import tap as tap_mod
from attn_otel.slots import slots_of
from attn_otel.tap import LayerSpec, MapTap

H, HKV, D, BS, NUM_BLOCKS = 2, 1, 8, 4, 64
LAYER = LayerSpec(index=3, name="l3", num_heads=H, num_kv_heads=HKV, head_dim=D, scale=D ** -0.5)


class Toy:
    def __init__(self, device: str, rows: int = 256, seed: int = 0):
        self.maptap = MapTap([LAYER], NUM_BLOCKS * BS, rows, torch.float32, device, BS, 0)
        self.device = device
        self.g = torch.Generator().manual_seed(seed)
        self.free = list(range(NUM_BLOCKS))[::-1]
        self.t: dict[str, SimpleNamespace] = {}
        self.q: dict[str, torch.Tensor] = {}  # the query each position last had written (what maps must hold)

    def new(self, rid: str, maps: bool, T: int) -> None:
        self.t[rid] = SimpleNamespace(maps=maps, block_ids=[[]])
        self.q[rid] = torch.full((T, H, D), float("nan"))

    def _blocks_for(self, rid: str, end: int) -> None:
        blocks = self.t[rid].block_ids[0]
        while len(blocks) * BS < end:
            blocks.append(self.free.pop())

    def step(self, work: list[tuple[str, int, int]]) -> None:
        """One forward of ``(request, first position, count)``: schedule, then every token's query written
        by its slot, as the attention layer's tap writes it."""
        items = []
        for rid, start, n in work:
            self._blocks_for(rid, start + n)
            items.append((rid, self.t[rid], start, n))
        self.maptap.schedule(items)
        slots, qs = [], []
        for rid, start, n in work:
            q = torch.randn((n, H, D), generator=self.g)
            self.q[rid][start:start + n] = q
            slots.append(slots_of(self.t[rid].block_ids[0], BS, start, n))
            qs.append(q)
        slot_mapping = torch.from_numpy(np.concatenate(slots)).to(self.device)
        self.maptap.write(LAYER.index, torch.cat(qs).to(self.device), slot_mapping)

    def preempt(self, rid: str) -> None:
        self.maptap.preempt([rid])
        self.free.extend(self.t[rid].block_ids[0])
        self.t[rid].block_ids = [[]]

    def finish(self, rid: str, T: int) -> torch.Tensor | None:
        """The request's queries as the finish-time gather reads them (None: not complete), then released."""
        got = None
        if self.maptap.complete(rid, T):
            got = self.maptap.gather(LAYER.index, self.maptap.rows_of(rid, T)).cpu()
        self.maptap.release([rid])
        self.free.extend(self.t[rid].block_ids[0])
        return got


@pytest.fixture
def counted(monkeypatch):
    """Counts the map tap's uploads of (slot, row) pairs: one per schedule that pointed slots."""
    calls = []
    real = tap_mod.upload

    def upload(a, device):
        calls.append(np.asarray(a).shape)
        return real(a, device)

    monkeypatch.setattr(tap_mod, "upload", upload)
    return calls


def test_planned_requests_keep_their_own_queries_and_decode_inside_a_block_uploads_nothing(device, counted):
    toy = Toy(device)
    toy.new("a", True, 40)   # planned, prefill in two chunks, then decode
    toy.new("b", False, 30)  # not planned, beside it in every step
    toy.new("c", True, 26)   # planned, a prompt that ends mid-block
    toy.step([("a", 0, 10), ("b", 0, 12)])
    toy.step([("a", 10, 7), ("b", 12, 4), ("c", 0, 9)])
    idle = []
    decode_uploads = len(counted)
    for s in range(17, 40):
        work = [("a", s, 1), ("b", s, 1) if s < 30 else None, ("c", s - 8, 1) if s - 8 < 26 else None]
        toy.step([w for w in work if w is not None])
        idle.append(toy.maptap.idle)
    decode_uploads = len(counted) - decode_uploads
    # 23 decode steps; a new block of "a" or "c" starts in at most 12 of them (every BS positions each)
    assert decode_uploads <= 12, decode_uploads
    assert not any(idle)  # a planned request's tokens are in every step: its writes must run
    for rid, T in (("a", 40), ("c", 26)):
        got = toy.finish(rid, T)
        assert got is not None, rid
        torch.testing.assert_close(got, toy.q[rid], rtol=0, atol=0)
    assert toy.finish("b", 30) is None  # never planned: no rows
    # nothing points at rows any more: every slot at the padding row
    assert bool((toy.maptap.row_of_slot == toy.maptap.rows).all())


def test_only_unplanned_tokens_leave_the_tap_idle(device, counted):
    toy = Toy(device)
    toy.new("a", True, 8)
    toy.new("b", False, 8)
    toy.step([("b", 0, 5)])
    assert toy.maptap.idle and not counted
    toy.step([("a", 0, 5), ("b", 5, 1)])
    assert not toy.maptap.idle


def test_preempted_request_resumes_in_other_blocks_and_taken_back_tokens_are_written_again(device, counted):
    toy = Toy(device)
    toy.new("a", True, 24)
    toy.new("x", False, 8)
    toy.step([("a", 0, 6)])
    toy.step([("a", 6, 3)])        # speculative: positions 6..8
    toy.step([("a", 7, 2)])        # 8 taken back: 7 and 8 written again
    old = list(toy.t["a"].block_ids[0])
    toy.preempt("a")               # its blocks go to another request, which writes them
    toy.step([("x", 0, 8)])
    assert set(toy.t["x"].block_ids[0]) & set(old)  # x writes slots that were a's
    assert toy.maptap.idle
    toy.step([("a", 0, 12)])       # resumed: recomputed from the start, in new blocks
    for s in range(12, 24):
        toy.step([("a", s, 1)])
    got = toy.finish("a", 24)
    assert got is not None
    torch.testing.assert_close(got, toy.q["a"], rtol=0, atol=0)
    # the other request's tokens never went to a's rows: its slots point at nothing
    x_slots = torch.from_numpy(slots_of(toy.t["x"].block_ids[0], BS, 0, 8)).to(toy.maptap.row_of_slot.device)
    assert bool((toy.maptap.row_of_slot[x_slots] == toy.maptap.rows).all())


def test_a_tap_too_small_for_whole_blocks_still_gives_every_position_a_row(device):
    """Rows for the rest of a block are a convenience: with exactly as many rows as positions the request
    is still complete (the block's remainder is left unpointed), and one more request is counted lost."""
    toy = Toy(device, rows=10)
    toy.new("a", True, 10)
    toy.step([("a", 0, 9)])  # 9 positions: 12 with the block's remainder would not fit, so 9
    toy.step([("a", 9, 1)])
    got = toy.finish("a", 10)
    assert got is not None
    torch.testing.assert_close(got, toy.q["a"], rtol=0, atol=0)
    toy.new("b", True, 12)
    toy.new("c", True, 12)
    toy.step([("b", 0, 8), ("c", 0, 8)])  # 16 positions, 10 rows: one of them is lost
    assert toy.maptap.lost == 1
    assert sum(toy.finish(r, 8) is not None for r in ("b", "c")) == 1


def test_short_says_when_the_planned_tokens_may_want_more_rows_than_are_free(device):
    """``short`` (the deferred finish's maps rule) bounds what ``schedule`` will take from above: each planned
    request's positions from where its slots are pointed to its last token's block end.  Unplanned requests
    and a decode step inside a pointed block want nothing; rows a finished request gave back count as free."""
    toy = Toy(device, rows=24)
    toy.new("a", True, 40)
    toy.new("x", False, 40)
    items = lambda work: [(rid, toy.t[rid], s, n) for rid, s, n in work]  # noqa: E731
    assert not toy.maptap.short(items([("x", 0, 40)]))  # unplanned: no row
    assert not toy.maptap.short(items([("a", 0, 21)]))  # 24 with the block's remainder: all of the free rows
    assert toy.maptap.short(items([("a", 0, 25)]))  # 28
    toy.step([("a", 0, 10)])  # rows for 0..11 (the block's remainder): 12 free
    assert len(toy.maptap._free) == 12
    assert not toy.maptap.short(items([("a", 10, 1)]))  # inside the pointed block: nothing more
    assert not toy.maptap.short(items([("a", 10, 12)]))  # 12..23: 12 rows, 12 free
    assert toy.maptap.short(items([("a", 10, 15)]))  # 12..27: 16
    toy.new("b", True, 16)
    assert toy.maptap.short(items([("a", 12, 1), ("b", 0, 9)]))  # 4 + 12 of 12 free: as schedule would ask
    assert not toy.maptap.short(items([("a", 12, 1), ("b", 0, 8)]))  # 4 + 8
    assert toy.finish("a", 10) is not None  # its rows back
    assert not toy.maptap.short(items([("b", 0, 24)]))
    # and what short() says is enough: schedule then gives every position a row
    toy.step([("b", 0, 16)])
    assert toy.maptap.lost == 0 and toy.finish("b", 16) is not None
