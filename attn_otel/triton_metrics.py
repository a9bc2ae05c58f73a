"""Per-row attention metrics in one fused Triton kernel (CUDA): no T x T tensor, one launch per request.

Same contract as :func:`attn_otel.attention.attention_metrics` (the torch reference it is tested
against).  :func:`row_metrics_slots` reads several finished requests' rows straight out of the Q/K tap by
slot index (one launch per layer for all the requests that finish in a step, no gather, nothing to keep
alive on the device but the small ``[7, Hq, T]`` result); :func:`row_metrics` is the same kernel on
contiguous ``q [B, T, Hq, D]``, ``k [B, T, Hkv, D]``.  NaN where a metric is undefined.

Each program takes a block of query rows of one head of one layer and walks its causal keys once, keeping
the running max and, relative to it, the sum of exp and the entropy, sink, vision and lookback sums (all
rescaled when the max grows, as FlashAttention keeps its softmax).  Logits are float32 accumulations of the model's own bf16/fp16
Q and K, like the attention kernels vLLM runs.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds
    triton = None


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit(do_not_specialize=["KS", "BS"])
    def _row_metrics(Q, QR, CUQ, A, K, KSL, CUK, NP, VM, VC, OUT, KS, scale, BS,
                     sq_t, sq_h, sk_b, sk_t, sk_h, so_r, so_m, so_h,
                     HAS_VISION: tl.constexpr, OUT_BY_SLOT: tl.constexpr, GROUP: tl.constexpr,
                     D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # Request b: its query rows are positions A[b] .. A[b] + n - 1 (n = CUQ[b+1] - CUQ[b]), read from Q
        # at rows QR[CUQ[b] + i]; its keys are positions 0 .. e - 1 (e = CUK[b+1] - CUK[b] = A[b] + n), read
        # at slots KSL[CUK[b] + j] of a paged K (block KSL // BS, offset KSL % BS; a tap is BS = 1).
        pid_m = tl.program_id(0)
        h = tl.program_id(1)
        b = tl.program_id(2)
        qstart = tl.load(CUQ + b)
        n = tl.load(CUQ + b + 1) - qstart
        if pid_m * BLOCK_M >= n:
            return
        kstart0 = tl.load(CUK + b)
        T = tl.load(CUK + b + 1) - kstart0
        a = tl.load(A + b)
        N = tl.load(NP + b)
        kvh = h // GROUP
        local = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = local < n
        rows = a + local
        dd = tl.arange(0, D)
        qrow = tl.load(QR + qstart + local, mask=row_ok, other=0)
        q = tl.load(Q + qrow[:, None] * sq_t + h * sq_h + dd[None, :], mask=row_ok[:, None], other=0.0)
        hi = tl.minimum(a + (pid_m + 1) * BLOCK_M, T)
        # One pass, online (as FlashAttention keeps its softmax): every sum is kept relative to the running
        # max m and rescaled by exp(m_old - m_new) when m grows.  h1 = sum e^(s-m) (s-m), so the entropy is
        # log l - h1 / l.
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        h1 = tl.zeros([BLOCK_M], tl.float32)
        s0 = tl.zeros([BLOCK_M], tl.float32)
        sk = tl.zeros([BLOCK_M], tl.float32)
        vis = tl.zeros([BLOCK_M], tl.float32)
        ctx = tl.zeros([BLOCK_M], tl.float32)
        gen = tl.zeros([BLOCK_M], tl.float32)
        for kstart in range(0, hi, BLOCK_N):
            cols = kstart + tl.arange(0, BLOCK_N)
            scol = tl.load(KSL + kstart0 + cols, mask=cols < T, other=0)
            kaddr = (scol // BS) * sk_b + (scol % BS) * sk_t
            kt = tl.load(K + kaddr[:, None] + kvh * sk_h + dd[None, :], mask=(cols < T)[:, None], other=0.0)
            s = tl.dot(q, tl.trans(kt)) * scale
            valid = (cols[None, :] <= rows[:, None]) & (cols[None, :] < T) & row_ok[:, None]
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.where(m_i == float("-inf"), 0.0, tl.exp(m_i - m_safe))
            shift = tl.where(m_i == float("-inf"), 0.0, m_i - m_safe)
            d = tl.where(valid, s - m_safe[:, None], 0.0)
            e = tl.where(valid, tl.exp(d), 0.0)
            h1 = alpha * (h1 + shift * l_i) + tl.sum(e * d, 1)
            l_i = l_i * alpha + tl.sum(e, 1)
            s0 = s0 * alpha + tl.sum(tl.where(cols[None, :] == 0, e, 0.0), 1)
            sk = sk * alpha + tl.sum(tl.where(cols[None, :] < KS, e, 0.0), 1)
            ctx = ctx * alpha + tl.sum(tl.where(cols[None, :] < N, e, 0.0), 1)
            gen = gen * alpha + tl.sum(tl.where((cols[None, :] >= N) & (cols[None, :] < rows[:, None]), e, 0.0), 1)
            if HAS_VISION:
                vm = tl.load(VM + kstart0 + cols, mask=cols < T, other=0.0)
                vis = vis * alpha + tl.sum(e * vm[None, :], 1)
            m_i = m_new
        inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)
        ent = tl.maximum(tl.log(tl.where(l_i > 0, l_i, 1.0)) - h1 * inv, 0.0)
        s0 = s0 * inv
        sk = sk * inv
        ctx = ctx * inv
        gen = gen * inv
        vis = vis * inv
        nan = float("nan")
        rf = rows.to(tl.float32)
        if OUT_BY_SLOT:  # a per-slot buffer [slots, 7, H]: row i goes to its own key slot
            orow = tl.load(KSL + kstart0 + rows, mask=row_ok, other=0)
        else:
            orow = qstart + local
        base = OUT + h * so_h + orow * so_r
        ty = OUT.dtype.element_ty
        tl.store(base + 0 * so_m, ent.to(ty), mask=row_ok)
        tl.store(base + 1 * so_m, tl.where(rows > 0, ent / tl.log(tl.maximum(rf + 1.0, 2.0)), nan).to(ty),
                 mask=row_ok)
        tl.store(base + 2 * so_m, tl.where(rows >= KS, s0, nan).to(ty), mask=row_ok)
        tl.store(base + 3 * so_m, tl.where(rows >= KS, sk, nan).to(ty), mask=row_ok)
        if HAS_VISION:
            vc = tl.load(VC + qstart + local, mask=row_ok, other=0.0)
            tl.store(base + 4 * so_m, tl.where(vc > 0, vis, nan).to(ty), mask=row_ok)
            tl.store(base + 5 * so_m, tl.where(vc > 0, vis / tl.maximum(vc / (rf + 1.0), 1e-30), nan).to(ty),
                     mask=row_ok)
        else:
            tl.store(base + 4 * so_m, tl.full([BLOCK_M], nan, tl.float32).to(ty), mask=row_ok)
            tl.store(base + 5 * so_m, tl.full([BLOCK_M], nan, tl.float32).to(ty), mask=row_ok)
        nf = N * 1.0
        ctxm = ctx / tl.maximum(nf, 1.0)
        genm = gen / tl.maximum(rf - nf, 1.0)
        tot = ctxm + genm
        lb_ok = (rows > N) & (N > 0) & (tot > 0)
        tl.store(base + 6 * so_m, tl.where(lb_ok, ctxm / tl.where(tot > 0, tot, 1.0), nan).to(ty), mask=row_ok)


def row_metrics_slots(q_tap: torch.Tensor, k_tap: torch.Tensor, slots: torch.Tensor, cu_tokens: torch.Tensor,
                      prompt_lens: torch.Tensor, max_tokens: int, scale: float, sink_tokens: int = 4,
                      vision_mask: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Several requests' rows straight from the tap, no gather: ``q_tap [S, Hq, D]``, ``k_tap [S, Hkv, D]``
    (any rows), request b's tokens at ``slots[cu_tokens[b]:cu_tokens[b+1]]`` (int64, on the device),
    ``prompt_lens [B]`` int32 -> ``out [7, Hq, sum T]`` float32 (request b's rows in its ``cu_tokens``
    range).  ``vision_mask`` is float32 ``[sum T]`` (concatenated per request) or None.  Nothing here
    syncs with the host: it can be enqueued on the engine's stream."""
    hq, d = q_tap.shape[1], q_tap.shape[2]
    hkv = k_tap.shape[1]
    total = slots.shape[0]
    B = cu_tokens.shape[0] - 1
    if out is None:
        out = torch.empty((7, hq, total), dtype=torch.float32, device=q_tap.device)
    has_vision = vision_mask is not None
    if has_vision:
        vm = vision_mask.to(dtype=torch.float32).contiguous()
        cum = torch.cumsum(vm, 0)
        starts = cu_tokens[:-1].long()
        before = torch.where(starts > 0, cum[(starts - 1).clamp(min=0)], torch.zeros_like(cum[:1]).expand(B))
        counts = (cu_tokens[1:] - cu_tokens[:-1]).long()
        vc = cum - torch.repeat_interleave(before, counts, output_size=total)
    else:
        vm = vc = out  # unused pointers
    zeros = torch.zeros(B, dtype=torch.int32, device=q_tap.device)
    _launch(q_tap, slots, cu_tokens, zeros, k_tap[:, None], slots, cu_tokens, prompt_lens, vm if has_vision else None,
            vc, out, out.stride(2), out.stride(0), out.stride(1), False, max_tokens, scale, sink_tokens)
    return out


def row_metrics_stream(q_ring: torch.Tensor, q_rows: torch.Tensor, cu_rows: torch.Tensor, first: torch.Tensor,
                       key_cache: torch.Tensor, key_slots: torch.Tensor, cu_keys: torch.Tensor,
                       prompt_lens: torch.Tensor, max_rows: int, scale: float, sink_tokens: int,
                       vision_mask: torch.Tensor | None, vision_count: torch.Tensor | None,
                       out: torch.Tensor) -> torch.Tensor:
    """Rows of several live requests, each against its keys in vLLM's paged cache, into a per-slot buffer.

    Request b's query rows are positions ``first[b] ..`` (``cu_rows[b+1] - cu_rows[b]`` of them) at rows
    ``q_rows[cu_rows[b]:cu_rows[b+1]]`` of ``q_ring [R, Hq, D]``; its keys are positions ``0 .. e-1`` at
    slots ``key_slots[cu_keys[b]:cu_keys[b+1]]`` of ``key_cache [blocks, block_size, Hkv, D]`` (any
    strides: a view of vLLM's KV cache, or a tap viewed with block size 1); ``e`` is the last row's
    position + 1.  Row i's metrics go to ``out[slot of position i, metric, head]`` (``out [S, 7, Hq]``,
    float16 or float32).  ``vision_mask`` is float32 over the keys (``cu_keys``), ``vision_count`` the
    number of vision keys up to each row (``cu_rows``).  Enqueued on the current stream, no host sync."""
    _launch(q_ring, q_rows, cu_rows, first, key_cache, key_slots, cu_keys, prompt_lens, vision_mask, vision_count,
            out, out.stride(0), out.stride(1), out.stride(2), True, max_rows, scale, sink_tokens)
    return out


def _launch(q, q_rows, cu_rows, first, key_cache, key_slots, cu_keys, prompt_lens, vision_mask, vision_count,
            out, so_r, so_m, so_h, by_slot, max_rows, scale, sink_tokens) -> None:
    hq, d = q.shape[1], q.shape[2]
    hkv = key_cache.shape[2]
    B = cu_rows.shape[0] - 1
    has_vision = vision_mask is not None
    vm = vision_mask if has_vision else out  # unused pointers
    vc = vision_count if has_vision else out
    block_m = 64 if d <= 128 else 32
    grid = (triton.cdiv(max(int(max_rows), 1), block_m), hq, B)
    _row_metrics[grid](q, q_rows, cu_rows, first, key_cache, key_slots, cu_keys, prompt_lens, vm, vc, out,
                       int(sink_tokens), float(scale), int(key_cache.shape[1]),
                       q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                       so_r, so_m, so_h,
                       HAS_VISION=has_vision, OUT_BY_SLOT=by_slot, GROUP=hq // hkv, D=d, BLOCK_M=block_m,
                       BLOCK_N=64, num_warps=4, num_stages=2)


def row_metrics(q: torch.Tensor, k: torch.Tensor, scale: float, prompt_len: int, sink_tokens: int = 4,
                vision_mask: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q [B, T, Hq, D]``, ``k [B, T, Hkv, D]`` (one request, B layers) -> ``[B, 7, Hq, T]`` float32."""
    B, T, hq, d = q.shape
    if out is None:
        out = torch.empty((B, 7, hq, T), dtype=torch.float32, device=q.device)
    if vision_mask is not None and tuple(vision_mask.shape) != (T,):
        raise ValueError(f"vision_mask has shape {tuple(vision_mask.shape)}, expected ({T},)")
    slots = torch.arange(T, dtype=torch.int64, device=q.device)
    cu = torch.tensor([0, T], dtype=torch.int32, device=q.device)
    np_ = torch.tensor([int(prompt_len)], dtype=torch.int32, device=q.device)
    vm = None if vision_mask is None else vision_mask.to(device=q.device, dtype=torch.float32)
    for b in range(B):
        row_metrics_slots(q[b], k[b], slots, cu, np_, T, scale, sink_tokens, vm, out=out[b])
    return out
