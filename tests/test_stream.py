"""The streamed layers' bookkeeping (attn_otel.stream), driven as the adapter drives it, on CPU.

A toy paged KV cache and scheduler: requests get blocks, tokens are scheduled in chunks and decode steps,
the "forward" writes each token's query through :meth:`MetricsStream.write` (by KV slot, as vLLM's
slot_mapping gives it) and its key into the paged cache.  Whatever the ring size, prefix sharing or
preemption, the per-row metrics gathered at finish must equal the torch reference on the request's whole
Q and K.  On CPU the flush is the torch reference; with ``-m gpu`` on a CUDA device the same tests run the
Triton kernel, reading keys from a cache laid out as vLLM 0.26's FLASH_ATTN lays it out."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from attn_otel.attention import KERNEL_METRICS, attention_metrics
from attn_otel.tap import LayerSpec
from attn_otel.slots import slots_of
from attn_otel.stream import MetricsStream, gather
from attn_otel.vllm_adapter import _key_cache_view

H, HKV, D, BS = 4, 2, 16, 4
LAYERS = [LayerSpec(index=i, name=f"l{i}", num_heads=H, num_kv_heads=HKV, head_dim=D, scale=D ** -0.5)
          for i in (1, 2, 5)]


class Tracked:
    def __init__(self, prompt, blocks, vision=None):
        self.prompt_token_ids = prompt
        self.block_ids = [blocks]
        self.vision_positions = vision
        self.written = 0


class Toy:
    """Random Q/K per request and layer, a paged K cache per layer (a ``[blocks, BS, Hkv, D]`` view of
    FLASH_ATTN's ``(blocks, Hkv, BS, K|V)`` tensor, as vllm_adapter._key_cache_view takes it), and a stream."""

    def __init__(self, rows: int, num_blocks: int = 64, keys_in_cache: bool = True, seed: int = 0,
                 device: str = "cpu", slow: bool = False, spill: int = 0, defer_flush: bool = False,
                 direct: bool = False, flush_keys: str = "slots", beside: bool = False):
        self.g = torch.Generator().manual_seed(seed)
        self.num_blocks = num_blocks
        self.device = device
        self.cache, self.values = {}, {}
        for s in LAYERS:  # what vLLM binds to the layer: logical (blocks, Hkv, BS, 2D), physical (blocks, BS, Hkv, 2D)
            bound = torch.zeros(num_blocks, BS, HKV, 2 * D, dtype=torch.bfloat16, device=device).transpose(1, 2)
            self.cache[s.index] = _key_cache_view(SimpleNamespace(kv_cache=bound), s, torch.bfloat16)
            self.values[s.index] = bound.transpose(1, 2)[..., D:]
            assert self.cache[s.index].shape == (num_blocks, BS, HKV, D)
        keys = {i: c for i, c in self.cache.items()} if keys_in_cache else None
        self.keys_in_cache = keys_in_cache
        self.stream = MetricsStream(LAYERS, num_blocks * BS, rows, torch.bfloat16, device, BS, 4, keys,
                                    spill_slots=spill)
        self.q, self.k, self.t = {}, {}, {}
        self.free = list(range(num_blocks))[::-1]
        self.slow = slow  # GPU: every step's capture work starts behind a sleep, far behind the forwards
        self.stream.defer_flush = defer_flush  # the flush at half the ring after the forward, as the adapter does
        self.stream.direct.min = 1 if direct else None  # prefill chunks' rows in the forward (vllm_adapter)
        self.stream.direct.beside = beside  # their kernels on the side stream (ATTN_OTEL_DIRECT_STREAM=side)
        self.stream.flush_keys = flush_keys  # slots or block ids to the flush kernel (ATTN_OTEL_FLUSH_KEYS)
        self.flushed_before = self.flushed_after = 0  # half-ring flushes in schedule / after the forward

    def new(self, rid, T, prompt_len, share=None, vision=None):
        """A request of T tokens; ``share=(other, n_blocks)`` reuses the other's first blocks (a prefix hit):
        its tokens there are the other's."""
        blocks = []
        if share is not None:
            other, nb = share
            blocks = list(self.t[other].block_ids[0][:nb])
        n_new = -(-T // BS) - len(blocks)
        blocks += [self.free.pop() for _ in range(n_new)]
        self.t[rid] = Tracked(list(range(prompt_len)), blocks, vision)
        q = {s.index: (torch.randn(T, H, D, generator=self.g) * 2).bfloat16().to(self.device) for s in LAYERS}
        k = {s.index: (torch.randn(T, HKV, D, generator=self.g) * 2).bfloat16().to(self.device) for s in LAYERS}
        if share is not None:
            n = share[1] * BS
            for s in LAYERS:
                q[s.index][:n] = self.q[share[0]][s.index][:n]
                k[s.index][:n] = self.k[share[0]][s.index][:n]
        self.q[rid], self.k[rid] = q, k
        return self.t[rid]

    def step(self, chunks, finished=(), preempted=(), uncaptured=(), uncounted=(), replay=False):
        """One engine step as the adapter runs it: preempted and finished first, then this step's tokens
        (``(rid, start, n)``) scheduled and "forwarded"; ``uncaptured`` chunks are forwarded too (first), but
        only counted in the step's total, as a request attn-otel does not follow; ``uncounted`` chunks are
        forwarded and not even counted (tokens no scheduler output announced).  ``replay``: the forward runs as
        a CUDA graph would, its taps as captured, never seeing the step's direct plan."""
        side = self.stream.side
        if self.slow and side.stream is not None:
            with side.context():
                torch.cuda._sleep(20_000_000)  # about 10 ms: far longer than a toy step's host work
        self.stream.preempt(preempted)
        self.stream.finish(finished)
        seq = side.mark()
        for r in [*preempted, *finished]:  # their blocks go back (the toy scheduler may hand them out now)
            side.taken_back(self.t[r].block_ids, seq)
        side.begin()  # as the engine's finish path does before its gather on the side stream
        with side.context():
            got = {r: gather(self.stream, torch.from_numpy(slots_of(self.t[r].block_ids[0], BS, 0,
                                                                   self.t[r].written)).to(self.device),
                                         torch.arange(self.t[r].written, device=self.device))
                   for r in finished}
        if got and side.stream is not None:
            torch.cuda.current_stream().wait_stream(side.stream)  # check() reads them on this stream
        self.stream.forget(finished)
        items = []
        for rid, start, n in chunks:
            self.t[rid].written = start + n
            items.append((rid, self.t[rid], start, n))
        n0 = self.stream.flushes
        self.stream.schedule(items, sum(n for _, _, n in [*chunks, *uncaptured]))
        self.flushed_before += self.stream.flushes - n0
        side.guard_items(items, [BS])
        chunks = [*uncaptured, *uncounted, *chunks]
        # the forward: one flattened batch, padded with slot -1 as CUDA graphs pad
        slot_list, qs, ks = [], {s.index: [] for s in LAYERS}, {s.index: [] for s in LAYERS}
        for rid, start, n in chunks:
            slot_list.append(slots_of(self.t[rid].block_ids[0], BS, start, n))
            for s in LAYERS:
                qs[s.index].append(self.q[rid][s.index][start:start + n])
                ks[s.index].append(self.k[rid][s.index][start:start + n])
        plan = self.stream.direct.plan
        if replay:
            self.stream.direct.plan = None
        if chunks:
            slots = torch.from_numpy(np.concatenate(slot_list + [np.full(3, -1)])).to(self.device)
            for s in LAYERS:
                q = torch.cat(qs[s.index] + [torch.full((3, H, D), 7.0, dtype=torch.bfloat16, device=self.device)])
                k = torch.cat(ks[s.index] + [torch.full((3, HKV, D), 7.0, dtype=torch.bfloat16, device=self.device)])
                k2 = k.reshape(len(k), HKV * D)
                # the keys go to the cache in the query's launch where it can (CUDA: ATTN_OTEL_KV_WRITE=fused),
                # else as vLLM writes them
                kv = (k2, -k2, self.cache[s.index], self.values[s.index]) if self.keys_in_cache else None
                if self.stream.write(s.index, q.reshape(len(q), H * D), k2, slots, kv=kv):
                    real = slots >= 0
                    assert torch.equal(self.values[s.index][slots[real] // BS, slots[real] % BS], -k[real])
                else:
                    assert self.device == "cpu" or not self.keys_in_cache or self.stream.direct.plan is not None
                    real = slots >= 0
                    c = self.cache[s.index]
                    c[slots[real] // BS, slots[real] % BS] = k[real]
                self.stream.direct.run(s.index)  # after the layer's attention, as the adapter's forward calls it
        if replay:
            self.stream.direct.plan = plan
        n0 = self.stream.flushes
        self.stream.after_launch()  # the forward is enqueued: what it did not wait for (vllm_adapter._after_launch)
        self.flushed_after += self.stream.flushes - n0
        return got

    def check(self, rid, got, vision=None):
        t = self.t[rid]
        T = t.written
        for s in LAYERS:
            ref = attention_metrics(self.q[rid][s.index][:T], self.k[rid][s.index][:T], s.scale,
                                    len(t.prompt_token_ids), 4, vision)[: len(KERNEL_METRICS)]
            g = got[self.stream.pos[s.index]].permute(1, 2, 0).float()  # [7, H, T]: no learned sink row
            if vision is None:
                ref[4:6] = float("nan")
            assert torch.equal(torch.isnan(g), torch.isnan(ref)), (rid, s.index)
            ok = ~torch.isnan(ref)
            err = (g[ok] - ref[ok]).abs().max().item()
            assert err < 2e-2, (rid, s.index, err)  # float16 storage of values up to log(T)


def _run_decode(toy, reqs, decode_steps):
    """Prefill every request in chunks of 8, then decode them all together; finish them at the end."""
    for rid, T0 in reqs:
        for start in range(0, T0, 8):
            toy.step([(rid, start, min(8, T0 - start))])
    pos = dict(reqs)
    for _ in range(decode_steps):
        toy.step([(rid, pos[rid] + 0, 1) for rid, _ in reqs])
        pos = {rid: p + 1 for rid, p in pos.items()}
    return toy.step([], finished=[rid for rid, _ in reqs])


def _three_requests(toy):
    """Three requests (13, 7 and 21 prompt tokens, 9 generated) through prefill chunks and decode steps;
    every row right at finish."""
    reqs = [("a", 13), ("b", 7), ("c", 21)]
    for rid, T0 in reqs:
        toy.new(rid, T0 + 9, prompt_len=T0)
    got = _run_decode(toy, reqs, 9)
    for rid, _ in reqs:
        toy.check(rid, got[rid])


# ATTN_OTEL_FLUSH_KEYS: block ids change what the Triton flush reads, so that layout runs with -m gpu only (on
# a CPU the flush is the torch reference either way)
FLUSH_KEYS = ["slots", pytest.param("blocks", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("flush_keys", FLUSH_KEYS)
@pytest.mark.parametrize("rows, keys_in_cache", [(16, True), (64, True), (1000, True), (16, False)])
def test_streamed_rows_equal_the_reference_whatever_the_ring(rows, keys_in_cache, device, flush_keys):
    toy = Toy(rows, keys_in_cache=keys_in_cache, device=device, flush_keys=flush_keys)
    _three_requests(toy)
    assert toy.stream.pending() == 0
    if rows == 16:
        assert toy.stream.flushes >= 4  # 68 rows through a 16-row ring: it filled again and again
    # every token took one ring row, in order: the device counter and the host's count agree
    assert toy.stream._head == 3 * 9 + 13 + 7 + 21 and int(toy.stream.head) == toy.stream._head % rows
    assert toy.stream.counter.drifts == 0


@pytest.mark.parametrize("flush_keys", FLUSH_KEYS)
@pytest.mark.parametrize("rows, keys_in_cache", [(16, True), (1000, True), (16, False)])
def test_direct_rows_equal_the_reference_and_take_no_ring_rows(rows, keys_in_cache, device, flush_keys):
    """ATTN_OTEL_STREAM_DIRECT: every prefill chunk (more than one token, nothing pending) is computed in the
    forward after each layer's attention, from the forward's queries; only decode tokens take ring rows."""
    toy = Toy(rows, keys_in_cache=keys_in_cache, device=device, direct=True, flush_keys=flush_keys)
    _three_requests(toy)
    st = toy.stream
    assert st.pending() == 0 and st.counter.drifts == 0
    assert st.direct.computed == 13 + 7 + 21 and st.direct.steps == 6 and st.direct.replayed == 0
    assert st._head == 3 * 9 and int(st.head) == st._head % rows  # the decode tokens alone
    assert st.flushed_rows == 3 * 9
    if device == "cuda":  # the kernels in the forwards, timed by events read once done
        torch.cuda.synchronize()
        assert st.direct.device_s > 0
    else:
        assert st.direct.device_s == 0


@pytest.mark.gpu
@pytest.mark.parametrize("flush_keys", ["slots", "blocks"])
def test_direct_rows_on_the_side_stream_far_behind_the_forwards(flush_keys):
    """ATTN_OTEL_DIRECT_STREAM=side: each layer's direct rows run on the side stream, which every step starts
    behind a sleep of about 10 ms, so the forwards (whose queries torch frees and hands out again at once) are
    steps ahead of the kernels reading them; with preemption and finished requests' blocks going back to the toy
    scheduler, every row must still equal the reference."""
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")
    toy = Toy(16, device="cuda", direct=True, flush_keys=flush_keys, beside=True, slow=True)
    _three_requests(toy)
    st = toy.stream
    assert st.pending() == 0 and st.counter.drifts == 0
    assert st.direct.computed == 13 + 7 + 21 and st.direct.steps == 6 and st.direct.replayed == 0
    torch.cuda.synchronize()
    assert st.direct.device_s > 0
    # a preempted request whose blocks another request writes in the very forward that frees them: that forward
    # waits for the side stream's work reading them, the direct kernels of the steps before among it
    toy = Toy(rows=1000, num_blocks=16, device="cuda", direct=True, flush_keys=flush_keys, beside=True, slow=True)
    _run_preemption(toy)
    assert toy.stream.direct.computed == 10 + 12 + 11
    assert toy.stream.side.wait_causes["blocks"] >= 1


def test_direct_rows_go_beside_the_forward_only_in_a_forward_with_no_cuda_graph():
    """The adapter's check (vLLM's forward context): a forward replayed as PIECEWISE graphs hands attention queries
    in the graphs' memory pool, so its direct rows stay on vLLM's stream; one with no graph may run them beside;
    outside any forward (unknown) they stay too."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.forward_context import ForwardContext, override_forward_context

    from attn_otel.vllm_adapter import _uncaptured_forward

    assert _uncaptured_forward() is False
    for mode, beside in ((CUDAGraphMode.NONE, True), (CUDAGraphMode.PIECEWISE, False), (CUDAGraphMode.FULL, False)):
        ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={}, cudagraph_runtime_mode=mode)
        with override_forward_context(ctx):
            assert _uncaptured_forward() is beside, mode


def test_direct_rows_beside_decode_steps_and_tokens_not_followed(device):
    """A step with a prefill chunk (direct), another request's decode token and a request attn-otel does not
    follow: the decode and unfollowed tokens take ring rows in the forward's order, the chunk none, and the
    device's row counter keeps to the host's count."""
    toy = Toy(rows=64, device=device, direct=True)
    toy.stream.counter.every = 1
    toy.new("a", 12, prompt_len=8)
    toy.new("b", 14, prompt_len=10)
    toy.new("u", 30, prompt_len=30)  # never scheduled through the stream
    toy.step([("a", 0, 8)])
    toy.step([("a", 8, 1), ("b", 0, 10)], uncaptured=[("u", 0, 5)])
    for p in range(1, 4):
        toy.step([("a", 8 + p, 1), ("b", 9 + p, 1)], uncaptured=[("u", 5 * p, 5)])
    got = toy.step([], finished=["a", "b"])
    toy.check("a", got["a"])
    toy.check("b", got["b"])
    st = toy.stream
    assert st.direct.computed == 8 + 10 and st.counter.drifts == 0
    assert st._head == 4 + 3 + 4 * 5 and int(st.head) == st._head  # a's 4 and b's 3 decode tokens, u's 20


def test_a_step_small_enough_for_a_cuda_graph_has_no_direct_plan_where_beside(device):
    """Beside the forward, a step of no more tokens than vLLM's largest CUDA graph (``graphed``: replayed as
    PIECEWISE graphs, where the kernels could not go beside) makes no plan: its prefill chunk goes through the ring
    and a flush; a larger step's chunk goes direct.  On vLLM's stream the threshold does not apply."""
    for beside, want_direct in ((True, 24), (False, 6 + 24)):
        toy = Toy(64, device=device, direct=True, beside=beside)
        toy.stream.direct.graphed = 16
        toy.new("a", 12, prompt_len=6)
        toy.new("b", 30, prompt_len=24)
        toy.step([("a", 0, 6)])  # 6 tokens: a graph's, so through the ring where beside
        st = toy.stream
        assert st.pending() == (6 if beside else 0) and st.direct.replayed == 0
        toy.step([("b", 0, 24)])  # 24 > 16: no graph, direct
        assert st.pending() == (6 if beside else 0)  # (a's rows wait for a flush: a has no chunk here)
        for p in range(6):
            toy.step([("a", 6 + p, 1), ("b", 24 + p, 1)])
        got = toy.step([], finished=["a", "b"])
        toy.check("a", got["a"])
        toy.check("b", got["b"])
        assert st.direct.computed == want_direct and st.direct.steps == (1 if beside else 2)


def test_graphed_tokens_are_vllms_largest_cuda_graph():
    from vllm.config.compilation import CompilationConfig, CUDAGraphMode

    from attn_otel.vllm_adapter import _graphed_tokens

    def runner(**kw):
        return SimpleNamespace(vllm_config=SimpleNamespace(compilation_config=CompilationConfig(**kw)))

    assert _graphed_tokens(runner(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE, max_cudagraph_capture_size=64)) == 64
    assert _graphed_tokens(runner(cudagraph_mode=CUDAGraphMode.NONE, max_cudagraph_capture_size=64)) == 0  # eager
    assert _graphed_tokens(runner()) == 0  # not resolved: unknown
    assert _graphed_tokens(SimpleNamespace()) == 0


def test_direct_rows_of_a_forward_run_as_a_cuda_graph_go_through_the_ring(device):
    """A forward that never called the taps with the step's plan (a CUDA graph replay: its captured taps write
    every token to the ring) leaves the plan unused: its chunks become pending ring rows, computed by a flush."""
    toy = Toy(64, device=device, direct=True)
    toy.new("a", 14, prompt_len=10)
    toy.step([("a", 0, 6)], replay=True)  # settled after the launch: 6 pending rows
    st = toy.stream
    assert st.direct.plan is None and st.direct.replayed == 1 and st.pending() == 6 and st._head == 6
    flushes = st.flushes
    toy.step([("a", 6, 4)])  # behind its 6 pending rows: they are flushed first, and this chunk goes direct
    assert st.flushes == flushes + 1 and st.direct.computed == 4 and st.pending() == 0 and st._head == 6
    for p in range(10, 14):
        toy.step([("a", p, 1)])
    toy.check("a", toy.step([], finished=["a"])["a"])
    assert st.counter.drifts == 0 and int(st.head) == st._head == 10


@pytest.mark.parametrize("rows", [16, 64])
def test_the_flush_at_half_the_ring_waits_for_the_forward_unless_the_forward_would_overwrite_its_rows(rows, device):
    """With ``defer_flush`` (ATTN_OTEL_AFTER_LAUNCH) the flush at half the ring runs after the step's forward is
    enqueued, and the rows still equal the reference; only where the step's own tokens would wrap the ring over
    a pending row does it run before."""
    toy = Toy(rows, device=device, defer_flush=True)
    _three_requests(toy)  # 8-token chunks and 3-token steps: never more than half the ring past a flush
    st = toy.stream
    assert st.pending() == 0 and st.counter.drifts == 0 and not st.flush_due
    assert toy.flushed_after >= 1 and toy.flushed_before == 0
    plain = Toy(rows, device=device)  # the same requests, every half-ring flush before its forward
    _three_requests(plain)  # (as many flushes or more: one after the launch also takes that step's rows)
    assert plain.flushed_after == 0 and plain.flushed_before >= toy.flushed_after
    if rows == 16:  # 7 rows pending (under half), then a step of 12: it would write over them, so before
        toy.new("d", 19, prompt_len=19)
        toy.step([("d", 0, 7)])
        assert toy.flushed_before == 0 and st.pending() == 7
        toy.step([("d", 7, 12)])
        assert toy.flushed_before == 1 and st.pending() == 12
        toy.check("d", toy.step([], finished=["d"])["d"])


def test_host_time_counts_a_flush_inside_a_schedule_once(monkeypatch):
    """``host_s`` is the engine loop's time in the stream: a half-ring flush that a schedule runs is inside the
    schedule's own time, not added again.  A fake clock moves only in the flushes (1 s each)."""
    import attn_otel.stream as stream_mod

    clock = [0.0]
    monkeypatch.setattr(stream_mod, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    flush = MetricsStream._flush
    calls = []

    def timed_flush(self, lives, t0):
        calls.append(self.flush_due)
        clock[0] += 1.0
        return flush(self, lives, t0)

    monkeypatch.setattr(MetricsStream, "_flush", timed_flush)
    toy = Toy(16)  # every half-ring flush in the schedule (no defer_flush)
    _three_requests(toy)
    assert toy.flushed_before >= 2 and len(calls) > toy.flushed_before  # in schedules, and at finish
    assert toy.stream.host_s == pytest.approx(len(calls))


def test_a_spilled_last_block_outlives_its_reuse(device):
    """A finished request's last block, copied to a spill block (attn_otel.spill) once its pending rows are
    flushed, goes straight to another request (as vLLM hands out a block with no prefix hash), whose rows there
    are computed over the first one's; the first request's rows, gathered through the spill block, still equal
    the reference, and its real block's rows no longer do."""
    toy = Toy(rows=1000, device=device, spill=2 * BS)
    st = toy.stream
    assert st.spill.free() == 2 and st.metrics.shape[1] == st.spill_base + 2 * BS
    assert st.spill_base % BS == 0 and st.spill_base > toy.num_blocks * BS  # past the real slots and padding
    toy.new("a", 14, prompt_len=10)  # 14 tokens: 4 blocks, the last one half full
    toy.step([("a", 0, 10)])
    for p in range(10, 14):
        toy.step([("a", p, 1)])
    t = toy.t["a"]
    last = t.block_ids[0][-1]
    st.finish(["a"])  # as the adapter does in the step a finishes (vllm_adapter._spill_finished)
    (v,) = st.spill.copy([last])
    assert v == st.spill_base // BS and st.spill.free() == 1 and st.spill.spilled == 1
    st.forget(["a"])
    toy.free.append(last)  # the head of the free queue: the next request gets it
    toy.new("c", 6, prompt_len=6)
    assert toy.t["c"].block_ids[0][0] == last
    toy.step([("c", 0, 6)])
    toy.t["c"].written = 6
    toy.step([], finished=["c"])  # c's rows computed: written over a's in the real block
    side = st.side
    side.begin()
    with side.context():
        spilled = gather(st, torch.from_numpy(slots_of(t.block_ids[0][:-1] + [v], BS, 0, 14)).to(toy.device),
                            torch.arange(14, device=toy.device))
        real = gather(st, torch.from_numpy(slots_of(t.block_ids[0], BS, 0, 14)).to(toy.device),
                         torch.arange(14, device=toy.device))
    if side.stream is not None:
        torch.cuda.current_stream().wait_stream(side.stream)
    toy.check("a", spilled)
    assert not torch.equal(real[:, 12:].nan_to_num(), spilled[:, 12:].nan_to_num())
    st.spill.release([v])
    assert st.spill.free() == 2
    assert len(st.spill.copy([1, 2, 3])) == 2 and st.spill.free() == 0  # as many as are free


def test_spill_blocks_hold_a_full_batch_in_at_most_4096_slots():
    from attn_otel.deferred import DeferredFinish
    from attn_otel.spill import SPILL_BLOCKS, spill_bytes, spill_slots

    assert SPILL_BLOCKS > DeferredFinish().max_requests  # a batch taken at 64 still has spill blocks for the step
    assert spill_slots(16) == SPILL_BLOCKS * 16 and spill_slots(128) == 32 * 128 and spill_slots(8192) == 8192
    # the KV budget's bound covers what a stream allocates past its real slots, the alignment included
    toy = Toy(rows=16, num_blocks=10, spill=spill_slots(BS))
    extra = (toy.stream.metrics.shape[1] - (10 * BS + 1)) * toy.stream.metrics[0, 0].numel() * 2 * len(LAYERS)
    assert 0 < extra <= spill_bytes(LAYERS, BS, width=toy.stream.metrics.shape[2])


def test_tokens_of_requests_not_followed_take_ring_rows_too(device):
    """The forward gives every token with a slot the next ring row, whether attn-otel follows its request or
    not: with the step's whole token count, the host flushes before those rows wrap over pending ones."""
    toy = Toy(rows=16, device=device)
    toy.new("a", 12, prompt_len=8)
    toy.new("u", 30, prompt_len=30)  # never scheduled through the stream
    toy.step([("a", 0, 8)], uncaptured=[("u", 0, 5)])
    for p in range(8, 12):
        toy.step([("a", p, 1)], uncaptured=[("u", 5 + 5 * (p - 8), 5)])
    got = toy.step([], finished=["a"])
    toy.check("a", got["a"])
    assert toy.stream._head == 12 + 25 and int(toy.stream.head) == 37 % 16


def test_a_drifted_row_counter_drops_the_running_captures(device):
    """Tokens a forward wrote that the host did not count move the device's ring-row counter away from the
    host's count (attn_otel.stream.RowCounterCheck): a drift is counted and, once it reaches a quarter of the
    ring, the captures of the requests running then are dropped (their pending rows may have been written
    over); requests that start after it are captured."""
    toy = Toy(rows=64, device=device)
    toy.stream.counter.every = 1
    toy.new("a", 40, prompt_len=8)
    toy.new("u", 30, prompt_len=30)
    toy.step([("a", 0, 8)])
    toy.step([("a", 8, 1)], uncounted=[("u", 0, 3)])  # 3 rows: counted, nothing dropped
    for p in range(9, 12):
        toy.step([("a", p, 1)])
    assert toy.stream.counter.drifts == 1 and not toy.stream.lost("a")
    toy.step([("a", 12, 1)], uncounted=[("u", 3, 16)])  # 3 + 16 = 19 rows >= 64 / 4
    for p in range(13, 16):
        toy.step([("a", p, 1)])
    assert toy.stream.counter.drifts == 2 and toy.stream.lost("a")
    toy.new("b", 6, prompt_len=4)
    toy.step([("b", 0, 4)])
    toy.step([("b", 4, 1)])
    toy.step([("b", 5, 1)])
    toy.t["b"].written = 6
    got = toy.step([], finished=["b"])
    toy.check("b", got["b"])
    assert not toy.stream.lost("b") and toy.stream.counter.drifts == 2


@pytest.mark.parametrize("flush_keys", FLUSH_KEYS)
@pytest.mark.parametrize("direct", [False, True])
def test_a_prefix_hit_on_a_live_requests_pending_rows(device, direct, flush_keys):
    """b hits a's first 3 blocks while a's rows there are still pending in the ring (or, with direct rows,
    computed in a's first forward); b finishes first."""
    toy = Toy(rows=1000, device=device, direct=direct, flush_keys=flush_keys)
    toy.new("a", 20, prompt_len=16)
    toy.step([("a", 0, 16)])
    toy.new("b", 18, prompt_len=14, share=("a", 3))
    toy.step([("a", 16, 1), ("b", 12, 2)])  # b's tokens 0..11 are a's (prefix cache), not recomputed
    toy.step([("a", 17, 1), ("b", 14, 1)])
    got = toy.step([("a", 18, 1)], finished=["b"])
    toy.check("b", got["b"])
    toy.t["b"].written = 0
    got = toy.step([], finished=["a"])
    toy.check("a", got["a"])


def _run_preemption(toy, rid="a"):
    """``rid`` is preempted after 11 tokens; its blocks go to request x in that very step's forward; it
    resumes in fresh blocks, recomputed from 0; both finish and every row is right."""
    toy.new(rid, 14, prompt_len=10)
    toy.step([(rid, 0, 10)])
    toy.step([(rid, 10, 1)])
    old_blocks = list(toy.t[rid].block_ids[0])
    # preempted: blocks freed this step (and another request may write into them in this very forward)
    toy.free.extend(old_blocks[::-1])
    toy.new("x", 12, prompt_len=12)
    assert set(toy.t["x"].block_ids[0]) & set(old_blocks)
    toy.step([("x", 0, 12)], preempted=[rid])
    # resumed into fresh blocks, recomputed from 0
    toy.t[rid].block_ids[0] = [toy.free.pop() for _ in range(4)]
    toy.step([(rid, 0, 11)])
    toy.step([(rid, 11, 1)])
    toy.step([(rid, 12, 1)])
    got = toy.step([], finished=[rid, "x"])
    toy.check(rid, got[rid])
    toy.check("x", got["x"])


@pytest.mark.parametrize("flush_keys", FLUSH_KEYS)
@pytest.mark.parametrize("direct", [False, True])
def test_preemption_flushes_before_the_blocks_go(device, direct, flush_keys):
    """A preempted request's pending rows are computed in the step that frees its blocks; its recomputation
    later lands in new blocks (with direct rows, in that step's forward); every row at finish is right."""
    toy = Toy(rows=1000, num_blocks=16, device=device, direct=direct, flush_keys=flush_keys)
    _run_preemption(toy)
    assert toy.stream.direct.computed == (10 + 12 + 11 if direct else 0)


@pytest.mark.parametrize("direct", [False, True])
def test_vision_positions_reach_the_streamed_rows(device, direct):
    toy = Toy(rows=24, device=device, direct=direct)
    vision = np.zeros(40, dtype=bool)
    vision[3:11] = True
    toy.new("v", 30, prompt_len=20, vision=vision)
    for start in range(0, 20, 8):
        toy.step([("v", start, min(8, 20 - start))])
    for p in range(20, 30):
        toy.step([("v", p, 1)])
    got = toy.step([], finished=["v"])
    toy.check("v", got["v"], vision=torch.from_numpy(vision[:30]).to(device))


def test_a_step_larger_than_the_ring_marks_its_requests_lost():
    toy = Toy(rows=8)
    toy.new("big", 12, prompt_len=12)
    toy.step([("big", 0, 12)])
    assert toy.stream.lost("big")
    toy.stream.forget(["big"])
    assert not toy.stream.lost("big")


def test_sizes():
    # per slot: entropy, two sink masses, lookback, and the vision pair for a model that takes images
    # (entropy_norm is derived at the finish: test_gather_derives_entropy_norm_under_windows_and_chunks)
    per = MetricsStream.bytes_per_token(LAYERS, True, torch.bfloat16)
    assert per == 3 * 6 * H * 2 + 8
    assert MetricsStream.bytes_per_token(LAYERS, True, torch.bfloat16, vision=False) == 3 * 4 * H * 2 + 8
    assert MetricsStream.bytes_per_token(LAYERS, False, torch.bfloat16) == per + 3 * HKV * D * 2
    assert MetricsStream.ring_bytes(LAYERS, 100, torch.bfloat16) == 3 * 101 * H * D * 2
    toy = Toy(rows=100, keys_in_cache=False)
    assert toy.stream.nbytes() == (MetricsStream.ring_bytes(LAYERS, 100, torch.bfloat16)
                                   + (toy.num_blocks * BS + 1) * MetricsStream.bytes_per_token(LAYERS, False,
                                                                                               torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_device_summaries_equal_numpy(device, dtype):
    """The finish-time summary computed where the rows are (attn_otel.finish.device_summaries) equals
    attn_otel.metrics.summarize + summary_to_array of the same rows, request by request: prompt-only and
    one-row requests, undefined (NaN) rows, metrics with no defined row at all.  Float16 rows (as the
    streamed layers keep them) are summarised as they are, with float32 sums and interpolation."""
    from attn_otel.finish import device_summaries
    from attn_otel.metrics import summarize, summary_to_array

    g = torch.Generator().manual_seed(3)
    L, M, Hh = 3, 7, 4
    Ts, Ns = [1, 9, 40, 17, 5], [1, 9, 25, 10, 2]
    rows = torch.rand(L, M, Hh, sum(Ts), generator=g).to(dtype)
    rows[:, 2:4, :, ::3] = float("nan")  # sink metrics undefined on some rows
    rows[:, 4:6] = float("nan")  # no image: the vision metrics nowhere defined
    rows[:, 6, 1] = float("nan")  # a head with no lookback value
    cu = np.concatenate([[0], np.cumsum(Ts)]).tolist()
    got = device_summaries(rows.to(device), cu, Ns, vision=False).cpu().numpy()
    np.testing.assert_array_equal(got, device_summaries(rows.to(device), cu, Ns, vision=True).cpu().numpy())
    for b, (T, N) in enumerate(zip(Ts, Ns)):
        r = rows[:, :, :, cu[b]:cu[b + 1]].float().numpy()
        per_row = {name: r[:, i] for i, name in enumerate(("entropy", "entropy_norm", "sink_mass_first",
                                                           "sink_mass_k", "vision_share", "vision_share_norm",
                                                           "lookback_ratio"))}
        want = summary_to_array(summarize(per_row, N), L, Hh)
        assert got[b].shape == want.shape
        np.testing.assert_allclose(got[b], want, rtol=1e-5, atol=1e-6, equal_nan=True, err_msg=f"request {b}")
    # one request with an image: its vision rows defined (on some rows), summarised when vision=True
    rows[:, 4:6, :, cu[2]:cu[2] + 30] = torch.rand(L, 2, Hh, 30, generator=g).to(dtype)
    got = device_summaries(rows.to(device), cu, Ns, vision=True).cpu().numpy()
    r = rows[:, :, :, cu[2]:cu[3]].float().numpy()
    names = ("entropy", "entropy_norm", "sink_mass_first", "sink_mass_k", "vision_share", "vision_share_norm",
             "lookback_ratio")
    want = summary_to_array(summarize({n: r[:, i] for i, n in enumerate(names)}, Ns[2]), L, Hh)
    assert not np.isnan(want[0, 4]).all()
    np.testing.assert_allclose(got[2], want, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_a_device_summarised_capture_is_stored_and_read_back(tmp_path):
    """The writer's side of a capture summarised on the device (no rows): the store keeps its summary, no
    per-row metrics, and Capture.summary() returns it."""
    import attn_otel
    from attn_otel.capture import CaptureEngine
    from attn_otel.finish import device_summaries
    from attn_otel.handoff import Job
    from attn_otel.plan import Plan
    from attn_otel.config import Config
    from attn_otel.ids import new_trace_id
    from attn_otel.metrics import summarize

    for writer in ("thread", "process"):
        eng = CaptureEngine(Config(store=str(tmp_path / writer), writer=writer), LAYERS, 64, torch.float32, "cpu")
        try:
            T, N = 12, 8
            rows = torch.rand(len(LAYERS), 7, H, T, generator=torch.Generator().manual_seed(5))
            rows[:, 4:6] = float("nan")
            rows[:, 6, :, : N + 1] = float("nan")
            trace = new_trace_id()
            req = SimpleNamespace(request_id="r", vision_positions=None, prompt_token_ids=list(range(N)),
                                  output_token_ids=[1] * (T - N), token_ids_device=None)
            rec, _ = eng.planner.record(Plan(req, LAYERS, (), T, False, trace, None, True, 1000, 0.0, True))
            summ = device_summaries(rows, [0, T], [N])[0]
            eng.handoff.reserve(1000)
            eng.handoff.put(Job(rec, None, None, None, 1000, 0.0, summary=summ))
            assert eng.flush(60)
            assert eng.stats.snapshot()["stored"] == 1
            (cap,) = attn_otel.open_trace(trace, store=tmp_path / writer)
            assert not cap.has_row_metrics and not cap.has_maps
            want = summarize({n: rows[:, i].numpy() for i, n in enumerate(("entropy", "entropy_norm",
                              "sink_mass_first", "sink_mass_k", "vision_share", "vision_share_norm",
                              "lookback_ratio")) if i not in (4, 5)}, N)
            got = cap.summary()
            for part in ("prompt", "generated"):
                np.testing.assert_allclose(got[part]["entropy"]["p50"], want[part]["entropy"]["p50"], rtol=1e-5)
                np.testing.assert_allclose(got[part]["sink_mass_k"]["mean"], want[part]["sink_mass_k"]["mean"],
                                           rtol=1e-5)
            np.testing.assert_allclose(got["generated"]["lookback_ratio"]["p90"],
                                       want["generated"]["lookback_ratio"]["p90"], rtol=1e-5)
        finally:
            eng.close()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [16, 64])
def test_capture_work_far_behind_the_forwards_reads_what_they_wrote(rows):
    """Every step's capture work (flushes, finish gathers) starts behind a sleep on the side stream, so the
    toy's forwards run far ahead of it: ring rows a flush frees, and blocks of preempted or finished
    requests, are rewritten only after the work reading them (attn_otel.stream.Side)."""
    toy = Toy(rows, device="cuda", slow=True)
    _three_requests(toy)
    if rows == 16:
        assert toy.stream.side.waits > 0  # the ring filled while flushes were still queued
    _run_preemption(toy, "p")  # a preempted request's blocks go to another request in the same step


@pytest.mark.gpu
def test_the_guard_waits_only_for_blocks_still_read():
    """Capture work queued far behind on the side stream reads block 3.  A forward's write to it overtakes
    the read unless :meth:`Side.guard` made the engine's stream wait; a write elsewhere needs no wait."""
    from attn_otel.stream import Side

    side = Side("cuda")
    buf = torch.zeros(8, 1024, device="cuda")

    def capture():
        side.begin()
        with side.context():
            torch.cuda._sleep(50_000_000)
            seen = buf[3].clone()
        side.taken_back([[3]], side.mark())
        return seen

    seen = capture()  # no guard: the write lands before the read (what the guard is for)
    buf[3].fill_(1.0)
    torch.cuda.synchronize()
    assert seen.sum().item() > 0
    buf.zero_()
    torch.cuda.synchronize()
    seen = capture()
    side.guard({0: [np.array([5, 6])]})
    assert side.waits == 0 and side.busy()
    side.guard({0: [np.array([2, 3])]})
    assert side.waits == 1
    buf[3].fill_(1.0)
    torch.cuda.synchronize()
    assert seen.sum().item() == 0
    assert not side.busy()


def test_slots_many_equals_slots_of_per_request():
    """The flush's vectorised key slots (every position of several requests at once) are each request's own."""
    from attn_otel.slots import slots_many

    rng = np.random.default_rng(0)
    for _ in range(200):
        bs = int(rng.choice([1, 4, 16]))
        blocks = [rng.permutation(1000)[: rng.integers(1, 20)].tolist() for _ in range(rng.integers(1, 6))]
        ends = [int(rng.integers(0, len(b) * bs + 1)) for b in blocks]
        flat, cu = slots_many(blocks, bs, ends)
        assert cu[-1] == sum(ends) == flat.shape[0]
        for b, blk in enumerate(blocks):
            np.testing.assert_array_equal(flat[cu[b]:cu[b + 1]], slots_of(blk, bs, 0, ends[b]))


def test_gather_derives_entropy_norm_under_windows_and_chunks():
    """The per-slot buffer keeps no entropy_norm: gather puts the kept rows in their places and derives it as
    the kernel computes it, entropy / ln n_i with n_i the keys row i sees under each layer's window or chunks
    (NaN where n_i = 1), and leaves a text model's vision pair NaN."""
    from attn_otel.attention import METRICS
    from attn_otel.tap import LayerSpec

    base = dict(num_heads=H, num_kv_heads=HKV, head_dim=D, scale=0.1)
    layers = [LayerSpec(index=0, name="l0", **base), LayerSpec(index=1, name="l1", window=5, **base),
              LayerSpec(index=2, name="l2", chunk=8, **base)]
    st = MetricsStream(layers, 64, 16, torch.bfloat16, "cpu", BS, 4, vision=False)
    assert st.slot_rows == ("entropy", "sink_mass_first", "sink_mass_k", "lookback_ratio")
    g = torch.Generator().manual_seed(0)
    st.metrics.copy_((torch.rand(st.metrics.shape, generator=g) * 3).to(torch.float16))
    slots = torch.randperm(64, generator=g)[:20]
    pos = torch.arange(20)
    got = gather(st, slots, pos)
    assert got.shape == (3, 20, 7, H)
    kept = st.metrics[:, slots].float()
    for i, name in enumerate(st.slot_rows):
        torch.testing.assert_close(got[:, :, METRICS.index(name)].float(), kept[:, :, i], rtol=0, atol=0)
    assert torch.isnan(got[:, :, METRICS.index("vision_share")]).all()
    ent = kept[:, :, 0]
    for li, n_vis in enumerate([pos + 1, torch.clamp(pos + 1, max=5), pos % 8 + 1]):
        want = torch.where(n_vis[:, None] > 1, ent[li] / torch.log(n_vis.float().clamp(min=2))[:, None], torch.nan)
        torch.testing.assert_close(got[li, :, 1].float(), want, rtol=1e-3, atol=1e-3, equal_nan=True)


def test_blocks_many_gives_the_slots_the_flush_kernel_derives_from_them():
    """The flush's block ids (what the kernel reads in place of every key's slot): request ``b``'s at
    ``cu[b]:cu[b + 1]``, position ``p``'s slot ``blocks[cu[b] + p // bs] * bs + p % bs`` as slots_many gives it."""
    from attn_otel.slots import blocks_many, slots_many

    rng = np.random.default_rng(1)
    for _ in range(200):
        bs = int(rng.choice([1, 4, 16]))
        lists = [rng.permutation(1000)[: rng.integers(0, 20)].tolist() for _ in range(rng.integers(1, 6))]
        ends = [int(rng.integers(0, len(b) * bs + 1)) for b in lists]
        flat, cu = blocks_many(lists)
        assert flat.dtype == np.int64 and cu[-1] == flat.shape[0] == sum(map(len, lists))
        slots, cu_s = slots_many(lists, bs, ends)
        for b in range(len(lists)):
            pos = np.arange(ends[b])
            np.testing.assert_array_equal(flat[cu[b] + pos // bs] * bs + pos % bs, slots[cu_s[b]:cu_s[b + 1]])
