"""The fused Triton metrics kernel equals the torch reference (attn_otel.attention.attention_metrics)."""

import pytest
import torch

from attn_otel.attention import attention_metrics

pytestmark = pytest.mark.gpu


def _seven(ref: torch.Tensor) -> torch.Tensor:
    """The reference's metric rows that a launch for layers without learned sinks writes: the first seven (the
    eighth, learned_sink_mass, is NaN for such a layer)."""
    assert ref.shape[0] == 8 and torch.isnan(ref[7]).all()
    return ref[:7]


@pytest.mark.parametrize("T, N, hq, hkv, d, vision", [
    (1, 1, 4, 2, 64, False), (5, 3, 4, 2, 64, False), (130, 70, 8, 2, 64, True), (767, 511, 32, 8, 128, False),
    (2100, 2000, 32, 8, 128, True),
    # MLA's latent rows (one KV head of 512 + 64) and a 128 + 64 head: a power of two plus a power-of-two tail
    (300, 200, 16, 1, 576, False), (130, 70, 128, 1, 576, True), (100, 50, 8, 2, 192, False),
])
def test_fused_kernel_matches_torch(T, N, hq, hkv, d, vision):
    from attn_otel import triton_metrics

    g = torch.Generator(device="cuda").manual_seed(T)
    q = (torch.randn(T, hq, d, device="cuda", generator=g) * 1.5).bfloat16()
    k = (torch.randn(T, hkv, d, device="cuda", generator=g) * 1.5).bfloat16()
    vm = (torch.rand(T, device="cuda", generator=g) < 0.3) if vision else None
    scale = d ** -0.5
    ref = _seven(attention_metrics(q, k, scale, N, 4, vm))
    got = triton_metrics.row_metrics(q[None], k[None], scale, N, 4, vm)[0]
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    ok = ~torch.isnan(ref)
    err = (got[ok] - ref[ok]).abs().max().item() if ok.any() else 0.0
    assert err < 2e-4, err


def test_slot_kernel_reads_several_requests_from_a_tap():
    """Requests' rows scattered over a tap (random, non-contiguous slots) give the same metrics as each
    request's contiguous Q/K through the torch reference; one request carries a vision mask."""
    from attn_otel import triton_metrics

    g = torch.Generator(device="cuda").manual_seed(7)
    hq, hkv, d, S = 8, 2, 64, 4096
    q_tap = (torch.randn(S + 1, hq, d, device="cuda", generator=g) * 1.5).bfloat16()
    k_tap = (torch.randn(S + 1, hkv, d, device="cuda", generator=g) * 1.5).bfloat16()
    Ts, Ns = [37, 300, 1, 129], [30, 250, 1, 100]
    perm = torch.randperm(S, device="cuda", generator=g)
    slots, off = [], 0
    for T in Ts:
        slots.append(perm[off:off + T])
        off += T
    vision = torch.zeros(sum(Ts), device="cuda")
    vision[37 + 10:37 + 60] = 1.0  # request 1 has an image at positions 10..59
    cu = torch.tensor([0, *torch.tensor(Ts).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    out = triton_metrics.row_metrics_slots(q_tap, k_tap, torch.cat(slots), cu,
                                           torch.tensor(Ns, dtype=torch.int32, device="cuda"), max(Ts),
                                           d ** -0.5, 4, vision)
    for b, (T, N) in enumerate(zip(Ts, Ns)):
        a, z = int(cu[b]), int(cu[b + 1])
        vm = vision[a:z].bool() if vision[a:z].any() else None
        ref = _seven(attention_metrics(q_tap[slots[b]], k_tap[slots[b]], d ** -0.5, N, 4, vm))
        got = out[:, :, a:z]
        if vm is None:
            ref = ref.clone()
            ref[4:6] = float("nan")
        assert torch.equal(torch.isnan(got), torch.isnan(ref)), b
        ok = ~torch.isnan(ref)
        assert (got[ok] - ref[ok]).abs().max().item() < 2e-4, b


def test_scatter_rows_equals_index_copy():
    """The forward's Q/K write (one Triton launch) puts each token's row where index_copy_ would: by slot
    (padded tokens, slot -1, to the pad row) and through the stream's slot -> ring-row table; a query that
    is a view into a fused QKV output (rows not adjacent) is read as it is.  The pad row is left unwritten."""
    from attn_otel import triton_metrics

    g = torch.Generator(device="cuda").manual_seed(5)
    S, R, H, Hkv, D, n = 300, 64, 8, 2, 128, 40
    qkv = torch.randn(n + 3, (H + 2 * Hkv) * D, device="cuda", generator=g).bfloat16()
    q, k = qkv[:, :H * D], qkv[:, H * D:(H + Hkv) * D]
    slots = torch.randperm(S, device="cuda", generator=g)[:n]
    slots[[3, 17]] = -1
    fixed = torch.where(slots < 0, S, slots)
    for src, heads in ((q, H), (k, Hkv)):
        tap = torch.zeros(S + 1, heads, D, device="cuda", dtype=torch.bfloat16)
        assert triton_metrics.scatter_rows(tap, src, slots, S)
        want = torch.zeros_like(tap).index_copy_(0, fixed, src[:n].reshape(n, heads, D))
        assert torch.equal(tap[:S], want[:S])
        assert not tap[S].any()  # row S, the two padded tokens' pad row: not written
    table = torch.full((S + 1,), R, dtype=torch.int64, device="cuda")
    live = fixed[fixed < S][:-8]  # the last 8 real slots' requests unplanned: the table binds them to row R
    table[live] = torch.randperm(R, device="cuda", generator=g)[:live.numel()]
    ring = torch.zeros(R + 1, H, D, device="cuda", dtype=torch.bfloat16)
    assert triton_metrics.scatter_rows(ring, q, slots, S, table=table)
    want = torch.zeros_like(ring).index_copy_(0, table[fixed], q[:n].reshape(n, H, D))
    assert torch.equal(ring[:R], want[:R])
    assert not ring[R].any()  # the tokens the table binds to its pad row (unplanned, padded) store nothing
    assert not triton_metrics.scatter_rows(ring, q.reshape(-1, H, D).transpose(1, 2), slots, S, table=table)
    # the tap's query and key in one launch: both land where two separate writes put them
    tq = torch.zeros(S + 1, H, D, device="cuda", dtype=torch.bfloat16)
    tk = torch.zeros(S + 1, Hkv, D, device="cuda", dtype=torch.bfloat16)
    assert triton_metrics.scatter_rows(tq, q, slots, S, dst2=tk, src2=k)
    assert torch.equal(tq[:S], torch.zeros_like(tq).index_copy_(0, fixed, q[:n].reshape(n, H, D))[:S])
    assert torch.equal(tk[:S], torch.zeros_like(tk).index_copy_(0, fixed, k[:n].reshape(n, Hkv, D))[:S])
    assert tk[:S].abs().sum() > 0 and not tq[S].any() and not tk[S].any()


def test_bound_launches_write_what_the_jit_call_writes():
    """``ATTN_OTEL_LAUNCH=bound``: after the first launch of an argument specialisation, scatter_rows and
    ring_advance launch Triton's compiled kernel through its own launcher.  Call after call, with a source that
    is not 16-byte aligned (a view one element in: Triton's JIT call) and one that is, pads of 1, 16, 17 and 64
    (Triton specialises integers on being 1 and on divisibility by 16), with and without the ring's base, each launch writes what ``kernel[grid]`` (``jit``) writes and
    index_copy_ would; a specialisation met again is launched from the cache (no new entry); and a CUDA graph
    captured on bound launches replays onto new inputs."""
    from attn_otel import triton_metrics as tm

    g = torch.Generator(device="cuda").manual_seed(11)
    H, D, n, S = 4, 64, 24, 200
    big = torch.randn(n + 8, H * D + 2, device="cuda", generator=g).bfloat16()
    srcs = {"aligned": big[:, :H * D], "one element in": big[:, 1:H * D + 1]}
    assert srcs["aligned"].data_ptr() % 16 == 0 and srcs["one element in"].data_ptr() % 16 != 0
    assert tm._key("k", (), 0, (srcs["one element in"],)) is None  # unaligned: Triton's JIT call every time
    # distinct real slots above every pad row used below: no two tokens write one row (a race either way)
    slots = torch.randperm(S - 70, device="cuda", generator=g)[:n] + 70
    slots[5] = -1  # a padded token: the pad row
    real = slots >= 0
    t = torch.arange(n, device="cuda")

    def write(mode, src, pad, ring):
        tm.bound_launch(mode)
        try:
            dst = torch.zeros(max(S, pad) + 1, H * D, device="cuda", dtype=torch.bfloat16)
            table = torch.full((S + 1,), -1, dtype=torch.int64, device="cuda")
            head = torch.tensor([3], dtype=torch.int64, device="cuda")
            base = torch.zeros(1, dtype=torch.int64, device="cuda")
            if ring:  # the ring of ``pad`` rows: token t to row (base + t) % pad
                tm.ring_advance(slots, head, base, pad)
                assert tm.scatter_rows(dst, src, slots, pad, table=table, base=base)
            else:  # by slot, the padded token to row ``pad``
                assert tm.scatter_rows(dst, src, slots, pad)
            return dst, table, head
        finally:
            tm.bound_launch("bound")

    cases = [(False, pad) for pad in (1, 16, 17, 64)] + [(True, pad) for pad in (32, 48, 65)]  # ring >= n rows
    for rnd in range(3):  # the first round may compile and bind; the later ones launch bound
        before = len(tm._BOUND)
        for name, src in srcs.items():
            for ring, pad in cases:
                got = write("bound", src, pad, ring)
                want = write("jit", src, pad, ring)
                for a, b in zip(got, want):
                    assert torch.equal(a, b), (rnd, name, pad, ring)
                dst, table, head = got
                rows = (3 + t) % pad if ring else slots
                ref = torch.zeros_like(dst)
                ref[rows[real]] = src[:n][real]
                assert torch.equal(dst, ref), (rnd, name, pad, ring)  # the padded token's pad row: unwritten
                if ring:
                    assert torch.equal(table[slots[real]], rows[real]) and int(head) == (3 + int(real.sum())) % pad
        if rnd:
            assert len(tm._BOUND) == before, rnd  # nothing new to bind: every launch came from the cache
    assert any(k[0] is tm._scatter_rows for k in tm._BOUND) and any(k[0] is tm._ring_advance for k in tm._BOUND)

    # captured in a CUDA graph (as vLLM captures a forward's taps), replayed onto new inputs
    src = srcs["aligned"].clone()
    idx = slots.clone()
    dst = torch.zeros(S + 1, H * D, device="cuda", dtype=torch.bfloat16)
    tm.scatter_rows(dst, src, idx, S)  # bound before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tm.scatter_rows(dst, src, idx, S)
    src.copy_(torch.randn(src.shape, device="cuda", generator=g).bfloat16())
    idx.copy_(torch.randperm(S, device="cuda", generator=g)[:n])
    dst.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(dst[:S], torch.zeros_like(dst).index_copy_(0, idx, src[:n])[:S])


@pytest.mark.parametrize("block_size, n, pad", [(16, 40, 2), (16, 1, 0), (64, 300, 7)])
def test_fused_kv_write_equals_vllms_cache_write(block_size, n, pad):
    """``ATTN_OTEL_KV_WRITE=fused``: the launch that keeps the queries also writes keys and values into
    vLLM's paged cache ([blocks, Hkv, block_size, K|V], vLLM 0.26's FLASH_ATTN layout), bit for bit what
    vLLM's own ``reshape_and_cache_flash`` writes, padded tokens (slot -1) writing nothing; with the stream's
    ring table and with the tap's query and key (two pairs)."""
    from vllm import _custom_ops as ops

    from attn_otel import triton_metrics

    g = torch.Generator(device="cuda").manual_seed(block_size + n)
    H, Hkv, D, blocks, R = 8, 2, 128, 32, 512
    S = blocks * block_size
    qkv = torch.randn(n + pad + 3, (H + 2 * Hkv) * D, device="cuda", generator=g).bfloat16()
    q = qkv[:, :H * D].view(-1, H, D)
    k = qkv[:, H * D:(H + Hkv) * D].view(-1, Hkv, D)
    v = qkv[:, (H + Hkv) * D:].view(-1, Hkv, D)
    slots = torch.randperm(S, device="cuda", generator=g)[:n + pad]
    if pad:
        slots[-pad:] = -1  # CUDA-graph padding
    cache = torch.randn(blocks, Hkv, block_size, 2 * D, device="cuda", generator=g).bfloat16()
    want = cache.clone()
    wk, wv = want.transpose(1, 2).split(D, dim=-1)
    one = torch.ones((), device="cuda")
    ops.reshape_and_cache_flash(k, v, wk, wv, slots, "auto", one, one)
    assert not torch.equal(want, cache)  # vLLM wrote something
    t = cache.transpose(1, 2)
    kv = (k, v, t[..., :D], t[..., D:])
    fixed = torch.where(slots < 0, S, slots)
    # the stream's ring, through its slot -> row table
    table = torch.full((S + 1,), R, dtype=torch.int64, device="cuda")
    live = fixed[fixed < S]
    table[live] = torch.randperm(R, device="cuda", generator=g)[:live.numel()]
    ring = torch.zeros(R + 1, H, D, device="cuda", dtype=torch.bfloat16)
    assert triton_metrics.scatter_rows(ring, q, slots, S, table=table, kv=kv)
    assert torch.equal(cache, want)
    rows = table[fixed]
    assert torch.equal(ring[:R], torch.zeros_like(ring).index_copy_(0, rows, q[:n + pad])[:R])
    # the tap's query and key, and the cache again (rewritten from scratch)
    cache.copy_(torch.randn(cache.shape, device="cuda", generator=g).bfloat16())
    want = cache.clone()
    wk, wv = want.transpose(1, 2).split(D, dim=-1)
    ops.reshape_and_cache_flash(k, v, wk, wv, slots, "auto", one, one)
    tq = torch.zeros(S + 1, H, D, device="cuda", dtype=torch.bfloat16)
    tk = torch.zeros(S + 1, Hkv, D, device="cuda", dtype=torch.bfloat16)
    assert triton_metrics.scatter_rows(tq, q, slots, S, dst2=tk, src2=k, kv=kv)
    assert torch.equal(cache, want)
    assert torch.equal(tk[:S], torch.zeros_like(tk).index_copy_(0, fixed, k[:n + pad])[:S])
    # a cache whose head_dim is not contiguous is not written: the caller is told to write it itself
    bad = (k, v, t[..., :D].transpose(2, 3), t[..., D:].transpose(2, 3))
    before = cache.clone()
    assert not triton_metrics.scatter_rows(ring, q, slots, S, table=table, kv=bad)
    assert torch.equal(cache, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_summary_kernel_equals_the_torch_summaries(dtype):
    """The finish-time summary on a GPU (one Triton program selects the quantiles of each part of a layer and
    head, bit by bit) equals device_summaries' torch code on the same rows: float16 rows read through the
    stream's strided gather view, parts from 1 to 2048 rows (several length buckets), NaN rows, a metric with
    no defined row, vision metrics on some rows, a metric with many ties, a negative one, and a part longer
    than SUMMARY_MAX_ROWS (the looped program)."""
    import numpy as np

    from attn_otel import triton_metrics
    from attn_otel.finish import device_summaries

    g = torch.Generator(device="cuda").manual_seed(11)
    L, M, H = 5, 7, 8
    Ts, Ns = [1, 9, 40, 700, 2048, 300], [1, 9, 25, 512, 1500, 0]
    base = (torch.rand(L, sum(Ts), M, H, device="cuda", generator=g) - 0.3).to(dtype)
    rows = base.permute(0, 2, 3, 1)
    rows[:, 0] = torch.round(rows[:, 0] * 4) / 4
    rows[:, 1] = -rows[:, 1].abs()
    rows[:, 2:4, :, ::3] = float("nan")
    rows[:, 4:6] = float("nan")
    rows[:, 4:6, :, 60:90] = torch.rand(L, 2, H, 30, device="cuda", generator=g).to(dtype)
    rows[:, 6, 1] = float("nan")
    cu = np.concatenate([[0], np.cumsum(Ts)]).tolist()
    for vision in (False, True):
        want = device_summaries(rows, cu, Ns, vision=vision, fused=False).cpu().numpy()
        out = torch.full(want.shape, float("nan"), device="cuda")
        assert triton_metrics.summaries(rows, cu, Ns, vision, (0.1, 0.5, 0.9), out)  # the kernel, not torch
        got = out.cpu().numpy()
        np.testing.assert_array_equal(got, device_summaries(rows, cu, Ns, vision=vision).cpu().numpy())
        assert np.array_equal(np.isnan(got), np.isnan(want))
        assert (~np.isnan(want)).sum() > 1000
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)
    n = triton_metrics.SUMMARY_MAX_ROWS + 1  # the looped program's
    long = torch.rand(1, 7, 1, n, device="cuda", generator=g)
    long[:, :, :, ::5] = float("nan")
    want = device_summaries(long, [0, n], [n], vision=False, fused=False)
    out = torch.full(want.shape, float("nan"), device="cuda")
    assert triton_metrics.summaries(long, [0, n], [n], False, (0.1, 0.5, 0.9), out)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_all_layers_in_one_launch_equal_one_launch_per_layer():
    """The stream's flush of every layer in one launch (each layer's keys in its own allocation, reached by
    its element offset from the first, which may be negative) gives the per-layer launches' metrics."""
    from attn_otel import triton_metrics as tm

    g = torch.Generator(device="cuda").manual_seed(2)
    L, R, H, Hkv, D, NB, BS = 4, 1024, 32, 8, 128, 64, 16
    S = NB * BS
    q = (torch.randn(L, R + 1, H, D, device="cuda", generator=g) * 1.5).bfloat16()
    caches = [(torch.randn(NB, BS, Hkv, D, device="cuda", generator=g) * 1.5).bfloat16() for _ in range(L)]
    caches = caches[::-1]  # later allocations first: negative offsets
    perm = torch.randperm(S, device="cuda", generator=g)
    T, first = [300, 200, 41, 400], [250, 0, 40, 0]
    counts = [t - f for t, f in zip(T, first)]
    keys = torch.cat([perm[sum(T[:i]):sum(T[:i + 1])] for i in range(len(T))])
    rows = torch.randperm(R, device="cuda", generator=g)[:sum(counts)]
    cu = lambda xs: torch.tensor([0, *torch.tensor(xs).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    fst = torch.tensor(first, dtype=torch.int32, device="cuda")
    prompt = torch.tensor([260, 100, 41, 300], dtype=torch.int32, device="cuda")
    want = torch.full((L, S + 1, 7, H), float("nan"), device="cuda", dtype=torch.float16)
    for li in range(L):
        tm.row_metrics_stream(q[li], rows, cu(counts), fst, caches[li], keys, cu(T), prompt, max(counts),
                              D ** -0.5, 4, None, None, want[li])
    offs = tm.key_offsets(caches)
    assert offs is not None and min(offs) < 0
    got = torch.full_like(want, float("nan"))
    tm.row_metrics_stream_layers(q, rows, cu(counts), fst, caches, torch.tensor(offs, device="cuda"), keys, cu(T),
                                 prompt, max(counts), D ** -0.5, 4, None, None, got)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert (~torch.isnan(want)).sum() > 10000
    assert torch.equal(got, want) or torch.allclose(got.float(), want.float(), atol=1e-3, equal_nan=True)
    assert tm.key_offsets([caches[0], caches[1].float()]) is None


@pytest.mark.parametrize("first", [0, 127, 255])
def test_stream_kernel_from_any_first_row_matches_torch(first):
    """Rows from ``first`` on, against keys in a paged cache, equal the torch reference's rows.  With
    ``first + 1`` a multiple of the key tile (128 at D = 64), the first row's own key closes an unmasked tile
    (prompt and generated keys, or generated keys only): the lookback ratio counts it there as in the masked
    diagonal tiles (Lookback Lens: new keys N..i, the row's own included)."""
    from attn_otel import triton_metrics as tm

    g = torch.Generator(device="cuda").manual_seed(first + 1)
    H, Hkv, D, NB, BS, T, N = 8, 2, 64, 32, 16, 400, 100
    q = (torch.randn(T, H, D, device="cuda", generator=g) * 1.5).bfloat16()
    k = (torch.randn(T, Hkv, D, device="cuda", generator=g) * 1.5).bfloat16()
    slots = torch.randperm(NB * BS, device="cuda", generator=g)[:T]
    cache = torch.zeros(NB, BS, Hkv, D, device="cuda", dtype=torch.bfloat16)
    cache.view(NB * BS, Hkv, D)[slots] = k
    n = T - first
    rows = torch.arange(first, T, device="cuda")  # the query ring is q itself: position i at ring row i
    one = lambda x: torch.tensor([x], dtype=torch.int32, device="cuda")
    cu = lambda x: torch.tensor([0, x], dtype=torch.int32, device="cuda")
    out = torch.full((NB * BS, 7, H), float("nan"), device="cuda")
    tm.row_metrics_stream(q, rows, cu(n), one(first), cache, slots, cu(T), one(N), n, D ** -0.5, 4, None, None,
                          out)
    got = out[slots[first:]].permute(1, 2, 0)  # [7, H, n]
    ref = _seven(attention_metrics(q, k, D ** -0.5, N, 4, None, start=first))[:, :, first:]
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    assert not torch.isnan(ref[6]).all()
    ok = ~torch.isnan(ref)
    assert (got[ok] - ref[ok]).abs().max().item() < 2e-4


@pytest.mark.parametrize("first", [0, 250])
def test_stream_kernel_reads_each_rows_ring_row_from_the_slot_table_as_from_given_rows(first):
    """``row_table`` (the stream's slot -> ring-row table, read at each pending row's key slot) gives bit for
    bit what the same rows given one by one give, with the ring rows in an order of their own (wrapped)."""
    from attn_otel import triton_metrics as tm

    g = torch.Generator(device="cuda").manual_seed(first + 7)
    H, Hkv, D, NB, BS, T, N, R = 8, 2, 64, 32, 16, 400, 100, 512
    k = (torch.randn(T, Hkv, D, device="cuda", generator=g) * 1.5).bfloat16()
    slots = torch.randperm(NB * BS, device="cuda", generator=g)[:T]
    cache = torch.zeros(NB, BS, Hkv, D, device="cuda", dtype=torch.bfloat16)
    cache.view(NB * BS, Hkv, D)[slots] = k
    ring = (torch.randn(R + 1, H, D, device="cuda", generator=g) * 1.5).bfloat16()
    ring_rows = (torch.arange(T, device="cuda") + 300) % R  # position i's query at ring row (i + 300) % R
    table = torch.full((NB * BS + 1,), R, dtype=torch.int64, device="cuda")
    table[slots] = ring_rows
    n = T - first
    one = lambda x: torch.tensor([x], dtype=torch.int32, device="cuda")
    cu = lambda x: torch.tensor([0, x], dtype=torch.int32, device="cuda")
    given = torch.full((NB * BS, 7, H), float("nan"), device="cuda")
    tm.row_metrics_stream(ring, ring_rows[first:], cu(n), one(first), cache, slots, cu(T), one(N), n, D ** -0.5, 4,
                          None, None, given)
    looked_up = torch.full_like(given, float("nan"))
    tm.row_metrics_stream(ring, None, cu(n), one(first), cache, slots, cu(T), one(N), n, D ** -0.5, 4, None, None,
                          looked_up, row_table=table)
    assert not torch.isnan(given[slots[first:], 0]).any()  # every pending row computed
    assert torch.equal(torch.isnan(given), torch.isnan(looked_up))
    ok = ~torch.isnan(given)
    assert torch.equal(given[ok], looked_up[ok])
