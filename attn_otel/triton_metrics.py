"""Per-row attention metrics in one fused Triton kernel (CUDA): no T x T tensor, one launch per request.

Same contract as :func:`attn_otel.attention.attention_metrics` (the torch reference it is tested
against).  :func:`row_metrics_slots` reads several finished requests' rows straight out of the Q/K tap by
slot index (one launch per layer for all the requests that finish in a step, no gather, nothing to keep
alive on the device but the small ``[7, Hq, T]`` result); :func:`row_metrics` is the same kernel on
contiguous ``q [B, T, Hq, D]``, ``k [B, T, Hkv, D]``.  NaN where a metric is undefined.

Each program takes a block of query rows of the query heads sharing one KV head of one layer and walks
their causal keys once, keeping the running max and, relative to it, the sum of exp and the entropy, vision
and lookback sums (all rescaled when the max grows, as FlashAttention keeps its softmax); the sink sums come
after, from the first keys again with the final max.  Logits are float32 accumulations of the model's own
bf16/fp16 Q and K, like the attention kernels vLLM runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import torch

from .slots import upload

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds
    triton = None


def available(device: torch.device, head_dims=()) -> bool:
    """Triton kernels on this device (and, with ``head_dims``, for every one of them: see
    :func:`split_head_dim`)."""
    return triton is not None and device.type == "cuda" and all(split_head_dim(d) is not None for d in head_dims)


if triton is not None:

    @triton.jit
    def _slot(KSL, kstart0, p, mask, PBS: tl.constexpr, PAGED: tl.constexpr, MASK: tl.constexpr):
        # The KV-cache slot of key position p of the request whose entries in KSL start at kstart0: KSL holds
        # the request's slots, one per position, or with PAGED its blocks' ids (a row of vLLM's block table:
        # position p is in block KSL[kstart0 + p // PBS] at offset p % PBS), 16x fewer for the host to build.
        if PAGED:
            if MASK:
                blk = tl.load(KSL + kstart0 + p // PBS, mask=mask, other=0)
            else:
                blk = tl.load(KSL + kstart0 + p // PBS)
            s = blk.to(tl.int64) * PBS + p % PBS
        else:
            if MASK:
                s = tl.load(KSL + kstart0 + p, mask=mask, other=0)
            else:
                s = tl.load(KSL + kstart0 + p)
        return s

    @triton.jit
    def _kaddr(KSL, kstart0, p, mask, BS, PBS: tl.constexpr, sk_b, sk_t, PAGED: tl.constexpr,
               PBS_IS_BS: tl.constexpr, MASK: tl.constexpr):
        # Key position p's element offset in a paged K (block stride sk_b, position stride sk_t).  PBS_IS_BS
        # (PAGED, block ids of the cache's own block size): block and offset straight from the block id and
        # p % PBS, a compile-time block size; else the slot, split by the cache's block size BS at run time
        # (a division per key, the tap's BS = 1 included).
        if PAGED and PBS_IS_BS:
            if MASK:
                blk = tl.load(KSL + kstart0 + p // PBS, mask=mask, other=0)
            else:
                blk = tl.load(KSL + kstart0 + p // PBS)
            return blk.to(tl.int64) * sk_b + (p % PBS) * sk_t
        else:
            scol = _slot(KSL, kstart0, p, mask, PBS, PAGED, MASK)
            return (scol // BS) * sk_b + (scol % BS) * sk_t

    @triton.jit
    def _tile(q, q2, K, KSL, VM, kstart0, kstart, T, rows, N, BS, PBS: tl.constexpr, koff, sk_b, sk_t, c,
              m_i, l_i, h1, vis, ctx, gen, vcnt, lo_r, scale, cap,
              HAS_VISION: tl.constexpr, MASKED: tl.constexpr, CTX: tl.constexpr, LOCAL: tl.constexpr,
              HAS_CAP: tl.constexpr, D: tl.constexpr, D2: tl.constexpr, BLOCK_N: tl.constexpr,
              PAGED: tl.constexpr, PBS_IS_BS: tl.constexpr):
        # One tile of BLOCK_N keys against the program's rows, folded into the online sums (base 2: s is the
        # logit times log2(e), every sum is relative to the running max m_i and rescaled when it grows).
        # m_i starts at -1e30, not -inf, so the first tile needs no case of its own (alpha = 0, and
        # shift * l_i = 0); a masked key's logit is -1e30 too, which exp2 sends to 0 (e * d = 0, not NaN).
        # Every row's first tile holds key 0, so no row meets a tile of masked keys before a real max (but
        # with LOCAL, see below).
        # MASKED: the tile may hold keys after a row (causal) or past T; else every key is <= every row.
        # CTX: 0 every key is at or after the prompt (generated), 1 every key is in the prompt, 2 either.
        # D2 > 0: a head_dim of D + D2 (both powers of two, e.g. MLA's 512 + 64), q2 the query's last D2.
        # LOCAL (a sliding window or chunked local attention; MASKED too): row i sees keys lo_r[i] .. i only;
        # the visible image keys are counted in vcnt.  HAS_CAP: logits soft-capped, cap * tanh(s * scale / cap)
        # where cap > 0, then c = log2(e) takes them to base 2.
        cols = kstart + tl.arange(0, BLOCK_N)
        dd = tl.arange(0, D)
        if MASKED:
            kaddr = _kaddr(KSL, kstart0, cols, cols < T, BS, PBS, sk_b, sk_t, PAGED, PBS_IS_BS, True)
            kt = tl.load(K + koff + kaddr[:, None] + dd[None, :], mask=(cols < T)[:, None], other=0.0).to(q.dtype)
        else:
            kaddr = _kaddr(KSL, kstart0, cols, cols < T, BS, PBS, sk_b, sk_t, PAGED, PBS_IS_BS, False)
            kt = tl.load(K + koff + kaddr[:, None] + dd[None, :]).to(q.dtype)  # fp8: exact
        s = tl.dot(q, tl.trans(kt))  # the logits; c > 0 scales them to base 2 in the one FMA that gives d
        if D2 > 0:
            d2 = D + tl.arange(0, D2)
            kt2 = tl.load(K + koff + kaddr[:, None] + d2[None, :], mask=(cols < T)[:, None], other=0.0).to(q.dtype)
            s += tl.dot(q2, tl.trans(kt2))
        if HAS_CAP:
            s = _soft_cap(s * scale, cap)
        if LOCAL:
            seen_k = (cols[None, :] <= rows[:, None]) & (cols[None, :] < T) & (cols[None, :] >= lo_r[:, None])
            s = tl.where(seen_k, s, -1e30)
        elif MASKED:
            s = tl.where((cols[None, :] <= rows[:, None]) & (cols[None, :] < T), s, -1e30)
        m_new = tl.maximum(m_i, tl.max(s, 1) * c)
        alpha = tl.exp2(m_i - m_new)
        shift = m_i - m_new
        d = s * c - m_new[:, None]
        e = tl.exp2(d)
        if LOCAL:
            # A row's tiles before its first visible key hold no real logit: there its max is the masked
            # logit's own (-1e30 * c), and d = s * c - m_new, one FMA on a GPU, is that product's rounding
            # error (~1e22, either sign), not 0: exp2 gives 0 or inf (NaN once rescaled by 0).  Masked keys
            # are set to 0 outright; the next tile's real max then rescales the row's sums (still 0) by 0.
            e = tl.where(seen_k, e, 0.0)
        tile_l = tl.sum(e, 1)
        h1 = alpha * (h1 + shift * l_i) + tl.sum(e * d, 1)
        l_i = l_i * alpha + tile_l
        if CTX == 1:
            ctx = ctx * alpha + tile_l
            gen = gen * alpha
        elif CTX == 0 and not MASKED:
            ctx = ctx * alpha
            gen = gen * alpha + tile_l
        else:
            tile_ctx = tl.sum(tl.where(cols[None, :] < N, e, 0.0), 1)
            ctx = ctx * alpha + tile_ctx
            if MASKED:  # generated keys up to the row itself, its own key included (Lookback Lens)
                gen = gen * alpha + tl.sum(tl.where((cols[None, :] >= N) & (cols[None, :] <= rows[:, None]), e, 0.0), 1)
            else:  # every key is before every row
                gen = gen * alpha + (tile_l - tile_ctx)
        if HAS_VISION:
            vm = tl.load(VM + kstart0 + cols, mask=cols < T, other=0.0)
            vis = vis * alpha + tl.sum(e * vm[None, :], 1)
            if LOCAL:  # the keys the row sees (seen_k also leaves out keys past T, where vm is 0 anyway)
                vcnt += tl.sum(tl.where(seen_k, vm[None, :], 0.0), 1)
        return m_new, l_i, h1, vis, ctx, gen, vcnt

    @triton.jit
    def _soft_cap(x, cap):
        # cap * tanh(x / cap) where cap > 0 (x where not: a layer without a cap in a launch of several), as
        # 1 - 2 / (exp(2y) + 1): no tanh in every Triton backend (the interpreter's included).
        y = x / tl.where(cap > 0, cap, 1.0)
        t = 1.0 - 2.0 / (tl.exp(tl.minimum(tl.maximum(2.0 * y, -60.0), 60.0)) + 1.0)  # tanh(30) is 1 in fp32
        return tl.where(cap > 0, cap * t, x)

    # Output strides are not specialised on (they vary with a launch's row count: a variant per divisibility
    # would compile mid-serving); Q and K strides are fixed per engine and are.
    @triton.jit(do_not_specialize=["KS", "BS", "HEADS", "GROUP", "NHG", "so_l", "so_r", "so_m", "so_h"])
    def _row_metrics(Q, QR, CUQ, A, K, KSL, CUK, NP, VM, VC, OUT, KOFF, WINP, CHP, CAPP, SINKP, KS, scale, BS,
                     PBS: tl.constexpr,
                     HEADS, GROUP, NHG, sq_l, sq_t, sq_h, sk_b, sk_t, sk_h, so_l, so_r, so_m, so_h,
                     HAS_VISION: tl.constexpr, OUT_BY_SLOT: tl.constexpr, LAYERED: tl.constexpr,
                     QR_TABLE: tl.constexpr, LOCAL: tl.constexpr, HAS_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,
                     ROW_NORM: tl.constexpr, ROW_S0: tl.constexpr, ROW_SK: tl.constexpr, ROW_VIS: tl.constexpr,
                     ROW_LB: tl.constexpr, ROW_SINK: tl.constexpr, PAGED: tl.constexpr, PBS_IS_BS: tl.constexpr,
                     HG: tl.constexpr, D: tl.constexpr, D2: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_N: tl.constexpr):
        # Request b: its query rows are positions A[b] .. A[b] + n - 1 (n = CUQ[b+1] - CUQ[b]), read from Q
        # at rows QR[CUQ[b] + i]; its keys are positions 0 .. T - 1 (T = CUK[b+1] - CUK[b] = A[b] + n), read
        # at slots KSL[CUK[b] + j] of a paged K (block KSL // BS, offset KSL % BS; a tap is BS = 1).  QR_TABLE:
        # QR is a slot -> Q row table instead, and position p's row is QR[KSL[CUK[b] + p]] (the stream's ring).
        # PAGED: KSL holds each request's block ids instead, from CUK[b] (PBS positions a block; see _slot), and
        # T is A[b] + n.  (VM, over the keys, is then not read: no vision with PAGED.)
        # A program takes BLOCK_R consecutive rows of HEADS query heads that share one KV head (HG >= HEADS,
        # a power of two; padded heads are masked): BLOCK_M = HG * BLOCK_R rows against each K tile, loaded
        # once for all of them (GQA).
        # LAYERED: several layers in one launch, program_id(1) = layer * NHG + head group; a layer's Q and OUT
        # are sq_l and so_l elements on, its keys KOFF[layer] elements from K (each layer's own cache).
        # The model's attention terms, per layer (index 0 unless LAYERED): LOCAL, a sliding window WINP[layer]
        # (row i sees keys i - W + 1 .. i; 0: none) and chunked local attention CHP[layer] (keys C * (i // C) ..
        # i; 0: none); HAS_CAP, a logit soft-cap CAPP[layer] (0: none); HAS_SINKS, a learned sink logit per
        # query head, SINKP[layer * NHG * HEADS + head], in the softmax's denominator: the keys' probabilities
        # then sum to 1 - its share, stored as an eighth metric (learned_sink_mass).
        # ROW_*: where each metric goes along OUT's metric axis (entropy at 0; -1: not stored): the metrics'
        # own order (1, 2, 3, 4 and 5, 6, 7), or the stream's per-slot rows, which leave out what the finish
        # derives (entropy_norm; the vision pair of a text-only model): see _rows_at and stream.slot_rows.
        pid_m = tl.program_id(0)
        b = tl.program_id(2)
        layer = 0
        if LAYERED:
            layer = tl.program_id(1) // NHG
            h0 = (tl.program_id(1) % NHG) * HEADS
            Q += layer.to(tl.int64) * sq_l
            OUT += layer.to(tl.int64) * so_l
            K += tl.load(KOFF + layer)
        else:
            h0 = tl.program_id(1) * HEADS
        qstart = tl.load(CUQ + b)
        n = tl.load(CUQ + b + 1) - qstart
        if pid_m * BLOCK_R >= n:
            return
        kstart0 = tl.load(CUK + b)
        a = tl.load(A + b)
        if PAGED:
            T = a + n
        else:
            T = tl.load(CUK + b + 1) - kstart0
        N = tl.load(NP + b)
        kvh = h0 // GROUP
        BLOCK_M: tl.constexpr = HG * BLOCK_R
        i = tl.arange(0, BLOCK_M)
        hh = h0 + i // BLOCK_R
        local = pid_m * BLOCK_R + i % BLOCK_R
        head_ok = i // BLOCK_R < HEADS
        row_ok = (local < n) & head_ok
        rows = a + local
        dd = tl.arange(0, D)
        if QR_TABLE:
            qrow = tl.load(QR + _slot(KSL, kstart0, rows, row_ok, PBS, PAGED, True), mask=row_ok, other=0)
        else:
            qrow = tl.load(QR + qstart + local, mask=row_ok, other=0)
        q = tl.load(Q + qrow[:, None] * sq_t + hh[:, None] * sq_h + dd[None, :], mask=row_ok[:, None], other=0.0)
        if D2 > 0:
            q2 = tl.load(Q + qrow[:, None] * sq_t + hh[:, None] * sq_h + D + tl.arange(0, D2)[None, :],
                         mask=row_ok[:, None], other=0.0)
        else:
            q2 = q
        LOG2E: tl.constexpr = 1.4426950408889634
        cap = 0.0
        if HAS_CAP:  # capped in natural units (s * scale), then to base 2
            cap = tl.load(CAPP + layer)
            c = LOG2E
        else:
            c = scale * LOG2E  # logits in base 2
        r0 = a + pid_m * BLOCK_R  # the block's first row
        hi = tl.minimum(r0 + BLOCK_R, T)  # keys needed: up to the block's last row
        # first visible key of each row (0 unless LOCAL) and of the block's first row, the block's least
        lo_r = tl.zeros([BLOCK_M], tl.int32)
        lo0 = r0 * 0
        if LOCAL:
            win = tl.load(WINP + layer)
            chk = tl.load(CHP + layer)
            wpos = tl.where(win > 0, win, 1)
            cpos = tl.where(chk > 0, chk, 1)
            lo_r = tl.where(win > 0, tl.maximum(rows - wpos + 1, 0), lo_r)
            lo_r = tl.where(chk > 0, tl.maximum(lo_r, rows // cpos * cpos), lo_r)
            lo0 = tl.where(win > 0, tl.maximum(r0 - wpos + 1, 0), lo0)
            lo0 = tl.where(chk > 0, tl.maximum(lo0, r0 // cpos * cpos), lo0)
        lo = (r0 + 1) // BLOCK_N * BLOCK_N  # [0, lo): keys at or before every row
        nf = tl.minimum(N // BLOCK_N * BLOCK_N, lo)  # [0, nf): prompt keys only
        nc = tl.minimum(tl.maximum(tl.cdiv(N, BLOCK_N) * BLOCK_N, nf), lo)  # [nf, nc): the prompt's end
        koff = kvh * sk_h
        m_i = tl.full([BLOCK_M], -1e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        h1 = tl.zeros([BLOCK_M], tl.float32)
        vis = tl.zeros([BLOCK_M], tl.float32)
        ctx = tl.zeros([BLOCK_M], tl.float32)
        gen = tl.zeros([BLOCK_M], tl.float32)
        vcnt = tl.zeros([BLOCK_M], tl.float32)
        if LOCAL:
            # Every tile masked, from the one holding the block's first visible key: a window or chunk bounds
            # the keys, so the loop is short.  A row's tiles before its own first key add e = 0 (_tile zeroes
            # every key a row does not see).
            for kstart in range(lo0 // BLOCK_N * BLOCK_N, hi, BLOCK_N):
                m_i, l_i, h1, vis, ctx, gen, vcnt = _tile(
                    q, q2, K, KSL, VM, kstart0, kstart, T, rows, N, BS, PBS, koff, sk_b, sk_t, c,
                    m_i, l_i, h1, vis, ctx, gen, vcnt, lo_r, scale, cap,
                    HAS_VISION, True, 2, True, HAS_CAP, D, D2, BLOCK_N, PAGED, PBS_IS_BS)
        else:
            # Loops with no branch inside (a branch per tile costs the loop its software pipelining): the
            # diagonal tiles are masked; the tiles before them are not, and only the one holding the prompt's
            # end sorts keys into prompt and generated.
            for kstart in range(0, nf, BLOCK_N):
                m_i, l_i, h1, vis, ctx, gen, vcnt = _tile(
                    q, q2, K, KSL, VM, kstart0, kstart, T, rows, N, BS, PBS, koff, sk_b, sk_t, c,
                    m_i, l_i, h1, vis, ctx, gen, vcnt, lo_r, scale, cap,
                    HAS_VISION, False, 1, False, HAS_CAP, D, D2, BLOCK_N, PAGED, PBS_IS_BS)
            for kstart in range(nf, nc, BLOCK_N):
                m_i, l_i, h1, vis, ctx, gen, vcnt = _tile(
                    q, q2, K, KSL, VM, kstart0, kstart, T, rows, N, BS, PBS, koff, sk_b, sk_t, c,
                    m_i, l_i, h1, vis, ctx, gen, vcnt, lo_r, scale, cap,
                    HAS_VISION, False, 2, False, HAS_CAP, D, D2, BLOCK_N, PAGED, PBS_IS_BS)
            for kstart in range(nc, lo, BLOCK_N):
                m_i, l_i, h1, vis, ctx, gen, vcnt = _tile(
                    q, q2, K, KSL, VM, kstart0, kstart, T, rows, N, BS, PBS, koff, sk_b, sk_t, c,
                    m_i, l_i, h1, vis, ctx, gen, vcnt, lo_r, scale, cap,
                    HAS_VISION, False, 0, False, HAS_CAP, D, D2, BLOCK_N, PAGED, PBS_IS_BS)
            for kstart in range(lo, hi, BLOCK_N):
                m_i, l_i, h1, vis, ctx, gen, vcnt = _tile(
                    q, q2, K, KSL, VM, kstart0, kstart, T, rows, N, BS, PBS, koff, sk_b, sk_t, c,
                    m_i, l_i, h1, vis, ctx, gen, vcnt, lo_r, scale, cap,
                    HAS_VISION, True, 2, False, HAS_CAP, D, D2, BLOCK_N, PAGED, PBS_IS_BS)
        # The sink sums, once the max is final: the first KS keys again, in tiles of 16 (not a running sum
        # carried through every tile; rows before KS get NaN, so every sink key here is at or before its row).
        s0 = tl.zeros([BLOCK_M], tl.float32)
        sk = tl.zeros([BLOCK_M], tl.float32)
        for kstart in range(0, tl.minimum(KS, T), 16):
            cols = kstart + tl.arange(0, 16)
            ok = (cols < KS) & (cols < T)
            kaddr = _kaddr(KSL, kstart0, cols, ok, BS, PBS, sk_b, sk_t, PAGED, PBS_IS_BS, True)
            kt = tl.load(K + koff + kaddr[:, None] + dd[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
            sl = tl.dot(q, tl.trans(kt))
            if D2 > 0:
                kt2 = tl.load(K + koff + kaddr[:, None] + D + tl.arange(0, D2)[None, :], mask=ok[:, None],
                              other=0.0).to(q.dtype)
                sl += tl.dot(q2, tl.trans(kt2))
            if HAS_CAP:
                sl = _soft_cap(sl * scale, cap)
            e = tl.exp2(sl * c - m_i[:, None])
            e = tl.where(ok[None, :] & (cols[None, :] <= rows[:, None]) & (cols[None, :] >= lo_r[:, None]), e, 0.0)
            s0 += tl.sum(tl.where(cols[None, :] == 0, e, 0.0), 1)
            sk += tl.sum(e, 1)
        if HAS_SINKS:
            # the sink's logit joins the denominator: every sum is taken to the max of it and the keys' (mf),
            # so that a sink far above the keys overflows nothing; the keys' entropy, -sum_j p_j ln p_j with
            # p_j = e_j / Z, is (l / Z) ln Z - ln 2 * h1 / Z there.
            snk = tl.load(SINKP + layer * (NHG * HEADS) + hh, mask=head_ok, other=0.0) * LOG2E
            mf = tl.maximum(m_i, snk)
            alpha = tl.exp2(m_i - mf)
            es = tl.exp2(snk - mf)
            lk = l_i * alpha
            hk = alpha * (h1 + (m_i - mf) * l_i)
            z = lk + es
            ent = tl.maximum(lk / z * tl.log(z) - 0.6931471805599453 * hk / z, 0.0)
            inv = alpha / z
            learned = es / z
        else:
            inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)
            # entropy in nats: ln l - ln2 * sum e (s - m) / l, the sums in base 2
            ent = tl.maximum(tl.log(tl.where(l_i > 0, l_i, 1.0)) - 0.6931471805599453 * h1 * inv, 0.0)
        s0 = s0 * inv
        sk = sk * inv
        ctx = ctx * inv
        gen = tl.maximum(gen, 0.0) * inv
        vis = vis * inv
        nan = float("nan")
        rf = rows.to(tl.float32)
        nvis = rf + 1.0 - lo_r.to(tl.float32)  # visible keys
        if OUT_BY_SLOT:  # a per-slot buffer [slots, 7, H]: row i goes to its own key slot
            orow = _slot(KSL, kstart0, rows, row_ok, PBS, PAGED, True)
        else:
            orow = qstart + local
        base = OUT + hh * so_h + orow * so_r
        ty = OUT.dtype.element_ty
        tl.store(base, ent.to(ty), mask=row_ok)
        if ROW_NORM >= 0:
            tl.store(base + ROW_NORM * so_m, tl.where(nvis > 1.0, ent / tl.log(tl.maximum(nvis, 2.0)), nan).to(ty),
                     mask=row_ok)
        tl.store(base + ROW_S0 * so_m, tl.where((rows >= KS) & (lo_r == 0), s0, nan).to(ty), mask=row_ok)
        tl.store(base + ROW_SK * so_m, tl.where((rows >= KS) & (lo_r < tl.maximum(KS, 1)), sk, nan).to(ty),
                 mask=row_ok)
        if ROW_VIS >= 0:
            if HAS_VISION:
                vc = tl.load(VC + qstart + local, mask=row_ok, other=0.0)
                if LOCAL:
                    vc = vcnt
                tl.store(base + ROW_VIS * so_m, tl.where(vc > 0, vis, nan).to(ty), mask=row_ok)
                tl.store(base + (ROW_VIS + 1) * so_m, tl.where(vc > 0, vis / tl.maximum(vc / nvis, 1e-30), nan).to(ty),
                         mask=row_ok)
            else:
                tl.store(base + ROW_VIS * so_m, tl.full([BLOCK_M], nan, tl.float32).to(ty), mask=row_ok)
                tl.store(base + (ROW_VIS + 1) * so_m, tl.full([BLOCK_M], nan, tl.float32).to(ty), mask=row_ok)
        nf32 = N * 1.0
        lof = lo_r.to(tl.float32)
        n_ctx = tl.maximum(nf32 - lof, 0.0)  # visible prompt keys
        ctxm = ctx / tl.maximum(n_ctx, 1.0)
        genm = gen / tl.maximum(rf - tl.maximum(lof, nf32) + 1.0, 1.0)  # keys max(lo, N)..i
        tot = ctxm + genm
        lb_ok = (rows >= N) & (n_ctx > 0) & (tot > 0)
        tl.store(base + ROW_LB * so_m, tl.where(lb_ok, ctxm / tl.where(tot > 0, tot, 1.0), nan).to(ty), mask=row_ok)
        if HAS_SINKS:  # -inf: a layer without sinks in a launch with them
            tl.store(base + ROW_SINK * so_m, tl.where(snk > -1e30, learned, nan).to(ty), mask=row_ok)


    @triton.jit
    def _kth(key, r, NBITS: tl.constexpr):
        # Order statistics of ``key`` ([BLOCK], non-negative, below 2**NBITS): for each rank r[i] (0-based)
        # the largest value P with at most r[i] keys below it, found bit by bit for every rank at once (NBITS
        # counting passes; no sort, so a small kernel to compile).
        prefix = tl.zeros(r.shape, key.dtype)
        for bit in range(NBITS - 1, -1, -1):
            cand = prefix + (tl.full([], 1, key.dtype) << bit)
            below = tl.sum((key[None, :] < cand[:, None]).to(tl.int32), 1)
            prefix = tl.where(below <= r, cand, prefix)
        return prefix

    @triton.jit
    def _unkey(k, NBITS: tl.constexpr):
        # inverse of the order-preserving map float bits -> [0, 2**NBITS) in _summaries
        if NBITS == 16:
            u = tl.where(k >= 32768, k - 32768, 65535 - k)
            return tl.where(u >= 32768, u - 65536, u).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        else:
            u = tl.where(k >= 2147483648, k - 2147483648, 4294967295 - k)
            return tl.where(u >= 2147483648, u - 4294967296, u).to(tl.int32).to(tl.float32, bitcast=True)

    @triton.jit
    def _keys(raw, NBITS: tl.constexpr):
        # A part's rows (as loaded, NaN where masked) as float32 values, whether each is defined, and keys in the
        # floats' order (NBITS 16: float16 rows, read as they are; 32: as float32); undefined rows get the largest
        # key, never selected.
        if NBITS == 16:
            bits = raw.to(tl.int16, bitcast=True).to(tl.int32)
            key = tl.where(bits < 0, -1 - bits, bits + 32768)  # negative floats reversed, below the rest
            top = 65535
            v = raw.to(tl.float32)
        else:
            v = raw.to(tl.float32)
            bits = v.to(tl.int32, bitcast=True).to(tl.int64)
            key = tl.where(bits < 0, -1 - bits, bits + 2147483648)
            top = 4294967295
        ok = v == v
        return tl.where(ok, key, top), v, ok

    @triton.jit
    def _part_keys(ptr, c0, n, sx_t, ar, NBITS: tl.constexpr):
        # Rows c0 + ar of a part (``ptr``: its first row; ``n`` rows ``sx_t`` apart) as :func:`_keys` gives them.
        return _keys(tl.load(ptr + (c0 + ar).to(tl.int64) * sx_t, mask=c0 + ar < n, other=float("nan")), NBITS)

    @triton.jit
    def _kth_looped(ptr, n, sx_t, r, NBITS: tl.constexpr, BLOCK: tl.constexpr):
        # _kth over a part longer than a program holds (``ptr``: its first row; ``n`` rows ``sx_t`` apart): each
        # counting pass reads the part again, BLOCK rows at a time.
        if NBITS == 16:
            prefix = tl.zeros(r.shape, tl.int32)
        else:
            prefix = tl.zeros(r.shape, tl.int64)
        ar = tl.arange(0, BLOCK)
        for bit in range(NBITS - 1, -1, -1):
            cand = prefix + (tl.full([], 1, prefix.dtype) << bit)
            below = tl.zeros(r.shape, tl.int32)
            for c0 in range(0, n, BLOCK):
                key, _, _ = _part_keys(ptr, c0, n, sx_t, ar, NBITS)
                below += tl.sum((key[None, :] < cand[:, None]).to(tl.int32), 1)
            prefix = tl.where(below <= r, cand, prefix)
        return prefix

    # Counts and strides that vary per call are not specialised on: no recompile mid-serving when a count is 1
    # or a row count's divisibility changes.
    @triton.jit(do_not_specialize=["nseg", "sx_l", "sx_m", "sx_h", "sx_t", "so_b", "so_p", "so_m", "so_s", "so_l",
                                   "so_h"])
    def _summaries(X, SEG, OUT, nseg, sx_l, sx_m, sx_h, sx_t, so_b, so_p, so_m, so_s, so_l, so_h,
                   q1, q2, q3, VISION: tl.constexpr, M: tl.constexpr, NBITS: tl.constexpr, BLOCK: tl.constexpr,
                   LOOPED: tl.constexpr = False):
        # One program: one segment (a request's prompt or generated rows: SEG[0..3] = request, part, first
        # row, length) of one layer and head; for each metric the part has, the mean of its defined (non-NaN)
        # rows and NumPy's "linear" quantiles q1..q3 of them.  The order statistics are selected on the floats'
        # bits mapped to keys in the floats' order (NBITS 16: float16 rows, read as they are; 32: any other
        # dtype, as float32); undefined rows get the largest key, never selected.  LOOPED: a part longer than
        # BLOCK rows, read BLOCK rows at a time (once for the sums, once a counting pass), not held in registers.
        # Heads vary fastest across programs: neighbouring programs read neighbouring elements where the rows
        # are a per-slot buffer's gather ([L, T, 7, H] viewed as [L, 7, H, T]: a head's rows lie 7 * H
        # elements apart), so the sectors they load are shared through L2 instead of each fetched for one value.
        hi = tl.program_id(0)
        li = tl.program_id(1)
        sg = tl.program_id(2)
        b = tl.load(SEG + sg)
        part = tl.load(SEG + nseg + sg)
        start = tl.load(SEG + 2 * nseg + sg)
        n = tl.load(SEG + 3 * nseg + sg)
        ar = tl.arange(0, BLOCK)
        obase = OUT + b * so_b + part * so_p + li * so_l + hi * so_h
        for m in tl.static_range(M):
            applies = True
            if m == 4 or m == 5:  # the vision metrics: only where some request has an image
                applies = VISION
            if applies and (m != 6 or part == 1):  # lookback: generated rows only
                ptr = X + li * sx_l + m * sx_m + hi * sx_h + start.to(tl.int64) * sx_t
                if LOOPED:
                    cnt = tl.zeros([], tl.int32)
                    tot = tl.zeros([], tl.float32)
                    for c0 in range(0, n, BLOCK):
                        _, v, ok = _part_keys(ptr, c0, n, sx_t, ar, NBITS)
                        cnt += tl.sum(ok.to(tl.int32), 0)
                        tot += tl.sum(tl.where(ok, v, 0.0), 0)
                else:
                    key, v, ok = _part_keys(ptr, 0, n, sx_t, ar, NBITS)
                    cnt = tl.sum(ok.to(tl.int32), 0)
                    tot = tl.sum(tl.where(ok, v, 0.0), 0)
                last = tl.maximum(cnt - 1, 0)
                nan = float("nan")
                tl.store(obase + m * so_m, tl.where(cnt > 0, tot / tl.maximum(cnt, 1).to(tl.float32), nan))
                # the two order statistics around each quantile's position, all six selected together
                j = tl.arange(0, 8)
                qv = tl.where(j < 2, q1, tl.where(j < 4, q2, q3))
                pos = qv * last.to(tl.float64)
                lo = tl.floor(pos).to(tl.int32)
                rank = tl.where(j % 2 == 0, lo, tl.minimum(lo + 1, last))
                if LOOPED:
                    vals = _unkey(_kth_looped(ptr, n, sx_t, tl.where(j < 6, rank, 0), NBITS, BLOCK), NBITS)
                else:
                    vals = _unkey(_kth(key, tl.where(j < 6, rank, 0), NBITS), NBITS)
                for qi in tl.static_range(3):
                    a = tl.sum(tl.where(j == 2 * qi, vals, 0.0), 0)
                    bv = tl.sum(tl.where(j == 2 * qi + 1, vals, 0.0), 0)
                    t = tl.sum(tl.where(j == 2 * qi, (pos - lo.to(tl.float64)).to(tl.float32), 0.0), 0)
                    val = tl.where(t >= 0.5, bv - (bv - a) * (1 - t), a + (bv - a) * t)
                    tl.store(obase + m * so_m + (qi + 1) * so_s, tl.where(cnt > 0, val, nan))


    @triton.jit
    def _scatter_rows(SRC, DST, IDX, TABLE, SRC2, DST2, src_stride, dst_stride, src2_stride, dst2_stride, pad,
                      K, V, KC, VC, k_stride, v_stride, kc_sb, kc_so, kc_sh, vc_sb, vc_so, vc_sh, block_size,
                      BASE, ring,
                      C: tl.constexpr, C2: tl.constexpr, HAS_TABLE: tl.constexpr, PAIRS: tl.constexpr,
                      BLOCK: tl.constexpr, BLOCK2: tl.constexpr, KV: tl.constexpr, HKV: tl.constexpr,
                      D: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr, RING: tl.constexpr):
        # Token t's row of C values goes to row IDX[t] of DST (IDX[t] < 0: row ``pad``), or, with a table,
        # to row TABLE[IDX[t]] (IDX[t] < 0: TABLE[pad]), or, with RING, to row (BASE[0] + t) % ring
        # (IDX[t] < 0: row ``pad``), which it writes to TABLE[IDX[t]]; with PAIRS == 2 its row of C2 values
        # of SRC2 too, to the same row of DST2 (the tap's query and key in one launch).  With KV, its key and
        # value ([HKV, D] rows) also go to vLLM's paged cache at slot IDX[t] (block IDX[t] // block_size,
        # offset IDX[t] % block_size; nothing for IDX[t] < 0), what vLLM's own KV-cache write would have done.
        # A row bound for the padding row (row ``pad``, or TABLE[pad] with a table) is not written: nothing
        # reads it, and in a decode step of the map tap about 99% of the tokens (the unplanned requests') are
        # bound there, each a program storing the same row.
        t = tl.program_id(0)
        slot = tl.load(IDX + t).to(tl.int64)
        keep = slot >= 0
        if RING:
            row = tl.where(slot < 0, pad, (tl.load(BASE).to(tl.int64) + t) % ring)
            tl.store(TABLE + tl.maximum(slot, 0), row, mask=keep)
        else:
            row = tl.where(slot < 0, pad, slot)
            if HAS_TABLE:
                row = tl.load(TABLE + row).to(tl.int64)
                keep = row != tl.load(TABLE + pad).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = (cols < C) & keep
        v = tl.load(SRC + t.to(tl.int64) * src_stride + cols, mask=ok)
        tl.store(DST + row * dst_stride + cols, v.to(DST.dtype.element_ty), mask=ok)
        if PAIRS == 2:
            cols2 = tl.arange(0, BLOCK2)
            ok2 = (cols2 < C2) & keep
            v2 = tl.load(SRC2 + t.to(tl.int64) * src2_stride + cols2, mask=ok2)
            tl.store(DST2 + row * dst2_stride + cols2, v2.to(DST2.dtype.element_ty), mask=ok2)
        if KV:
            s = tl.maximum(slot, 0)
            blk = s // block_size
            off = s - blk * block_size
            h = tl.arange(0, BH)[:, None]
            d = tl.arange(0, BD)[None, :]
            m = (h < HKV) & (d < D) & (slot >= 0)
            kr = tl.load(K + t.to(tl.int64) * k_stride + h * D + d, mask=m)
            tl.store(KC + blk * kc_sb + off * kc_so + h * kc_sh + d, kr.to(KC.dtype.element_ty), mask=m)
            vr = tl.load(V + t.to(tl.int64) * v_stride + h * D + d, mask=m)
            tl.store(VC + blk * vc_sb + off * vc_so + h * vc_sh + d, vr.to(VC.dtype.element_ty), mask=m)

    @triton.jit
    def _ring_advance(IDX, n, HEAD, BASE, ring, BLOCK: tl.constexpr):
        # One program: BASE[0] = HEAD[0], then HEAD[0] advanced by the tokens of IDX[:n] with a slot (>= 0).
        cnt = tl.zeros((BLOCK,), dtype=tl.int64)
        for i in range(0, n, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            s = tl.load(IDX + offs, mask=offs < n, other=-1)
            cnt += (s >= 0).to(tl.int64)
        h = tl.load(HEAD).to(tl.int64)
        tl.store(BASE, h)
        tl.store(HEAD, (h + tl.sum(cnt, 0)) % ring)


# ------------------------------------------------------------------ launches bound once per specialisation
_BOUND: dict = {}  # (kernel, constexprs, device, the arguments' specialisation) -> Triton's compiled kernel
_LAUNCH = ["bound"]  # "bound" or "jit": see bound_launch()
_BOUND_MAX = 4096  # entries kept (a key per distinct integer argument, e.g. ring_advance's token count)


def bound_launch(mode: str) -> None:
    """How :func:`scatter_rows` and :func:`ring_advance`, the launches of every eager forward, reach the GPU
    (``ATTN_OTEL_LAUNCH``): ``bound`` (default) launches the kernel Triton compiled for the same
    specialisation straight through its launcher, ``jit`` through ``kernel[grid](...)`` on every call (on an
    H100 28 us of host time a call against 10, ``bench/launch_cost.py``).  Process-wide."""
    if mode not in ("bound", "jit"):
        raise ValueError(f"launch mode {mode!r}: expected 'bound' or 'jit'")
    _LAUNCH[0] = mode


def _key(fn, consts: tuple, device: int, args: tuple) -> tuple | None:
    """The bound launch's cache key: finer than Triton's own specialisation of ``args`` (equal here, equal
    there), and cheap enough for every launch of an eager forward.  Integers are keyed by value (Triton tells
    them apart by being 1, by divisibility by 16 and by width); tensors by dtype, where every one of them is
    16-byte aligned (Triton tells tensors apart by dtype and that alignment).  None where a tensor is not
    aligned or an argument is of another kind: the launch takes Triton's JIT call."""
    key = [fn, consts, device]
    ptrs = 0
    try:
        for a in args:
            if type(a) is int:
                key.append(a)
            else:
                key.append(a.dtype)
                ptrs |= a.data_ptr()
    except AttributeError:
        return None
    return tuple(key) if ptrs % 16 == 0 else None


def _launch_bound(fn, n: int, args: tuple, consts: tuple) -> None:
    """``fn[(n,)](*args, **constexprs, num_warps=4)``, with ``consts`` the values of ``fn``'s constexpr
    parameters (its last ones, in order).  The first call of each :func:`_key` goes through Triton's JIT, which
    compiles or finds the kernel; the calls after it launch that kernel through its own launcher on the current
    stream (graph-safe like the JIT call), without Triton's per-call binding and cache lookup.  With a launch
    hook set (a profiler's: :func:`_hooks_idle`), an unaligned tensor or an argument of another kind: the JIT
    call every time."""
    key = None
    if _LAUNCH[0] == "bound" and _hooks_idle():
        drv = _driver()
        device = drv.get_current_device()
        key = _key(fn, consts, device, args)
        k = _BOUND.get(key) if key is not None else None
        if k is not None:  # (no hooks: no launch metadata for them either)
            k.run(n, 1, 1, drv.get_current_stream(device), k.function, k.packed_metadata, None, None, None,
                  *args, *consts)
            return
    kernel = fn[(n,)](*args, **dict(zip(_constexpr_names(fn), consts)), num_warps=4)
    if key is not None and all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")):
        if len(_BOUND) >= _BOUND_MAX:
            _BOUND.clear()
        _BOUND[key] = kernel


def _hooks_idle() -> bool:
    """No launch hook is set (a profiler's, Proton's): Triton's hooks are None, or (Triton 3.6) empty chains."""
    rt = triton.knobs.runtime
    return all(h is None or not getattr(h, "calls", True) for h in (rt.launch_enter_hook, rt.launch_exit_hook))


@functools.cache
def _driver():
    from triton.runtime.driver import driver

    return driver.active


@functools.cache
def _constexpr_names(fn) -> tuple[str, ...]:
    """``fn``'s constexpr parameters, which must be its last ones (:func:`_launch_bound` appends their values)."""
    params = list(fn.params)
    first = next((i for i, p in enumerate(params) if p.is_constexpr), len(params))
    if not all(p.is_constexpr for p in params[first:]):
        raise TypeError(f"{fn.fn.__name__}: its constexpr parameters must come last")
    return tuple(p.name for p in params[first:])


def ring_advance(index: torch.Tensor, head: torch.Tensor, base: torch.Tensor, ring: int) -> None:
    """Graph-safe, once per forward before its :func:`scatter_rows` with ``base``: ``base = head``, then
    ``head`` (both ``[1]`` int64 on ``index``'s device) moves on by the tokens of ``index`` that have a slot
    (``>= 0``; padded tokens have none), modulo ``ring``."""
    n = index.shape[0]
    if available(index.device):
        _launch_bound(_ring_advance, 1, (index, n, head, base, int(ring)), (1024,))
        return
    base.copy_(head)
    head.copy_((head + (index >= 0).sum()) % int(ring))


def scatter_rows(dst: torch.Tensor, src: torch.Tensor, index: torch.Tensor, pad: int,
                 table: torch.Tensor | None = None, dst2: torch.Tensor | None = None,
                 src2: torch.Tensor | None = None, kv: tuple | None = None,
                 base: torch.Tensor | None = None) -> bool:
    """``dst[index[t]] = src[t]`` for the ``len(index)`` first rows of ``src`` (``index[t] < 0``: row
    ``pad``), or ``dst[table[index[t]]]`` with a table (``index[t] < 0``: ``table[pad]``); with ``dst2`` and
    ``src2``, the same rows of ``dst2`` from ``src2`` too.  Graph-safe (the forward's Q/K writes).  ``dst``'s
    rows take ``src``'s rows reshaped to them.  One Triton launch where it applies (CUDA, rows each
    contiguous; torch's index_copy_ is a generic gather-scatter several times slower), and then True; else
    the same with torch (a lookup and index_copy_ per pair), and False.  The padding row (``pad``, or
    ``table[pad]``) holds nothing anyone reads: the Triton launch leaves it unwritten (tokens bound there
    store nothing), torch's path writes whatever token lands last.

    ``kv = (key, value, key_cache, value_cache)`` (caches ``[blocks, block_size, Hkv, D]`` views of vLLM's
    paged cache, ``D`` contiguous) adds vLLM's KV-cache write to the same launch: token t's key and value
    to slot ``index[t]`` (none for ``index[t] < 0``).  Only the Triton launch does this: where it returns
    False the caller still has to write the cache.

    ``base`` (``[1]`` int64, from :func:`ring_advance`) makes ``dst`` a ring written in token order: token
    ``t`` goes to row ``(base + t) % pad`` (``index[t] < 0``: row ``pad``), and ``table[index[t]]`` is set
    to that row, so the host need not give tokens rows before the forward."""
    n = index.shape[0]
    pairs = [(dst, src)] + ([(dst2, src2)] if dst2 is not None else [])
    # (the checks cost host time in every eager forward: device ordinals and sizes, no views made)
    if (triton is not None and dst.is_cuda and n > 0 and all(
            s.get_device() == d.get_device() and s.shape[0] >= n and _row_numel(s) == _row_numel(d)
            and _rows_contiguous(d) and _rows_contiguous(s) for d, s in pairs)
            and (kv is None or _kv_fits(kv, n, dst.get_device()))):
        tab = table if table is not None else index
        d2, s2 = pairs[-1]
        C, C2 = _row_numel(dst), _row_numel(d2)
        if kv is None:
            k = v = kc = vc = src
            kvs, Hkv, D = (0,) * 9, 1, 1
        else:
            k, v, kc, vc = kv
            Hkv, D = kc.shape[2], kc.shape[3]
            kvs = (k.stride(0), v.stride(0), *kc.stride()[:3], *vc.stride()[:3], kc.shape[1])
        _launch_bound(_scatter_rows, n, (src, dst, index, tab, s2, d2, src.stride(0), dst.stride(0), s2.stride(0),
                                         d2.stride(0), int(pad), k, v, kc, vc, *kvs,
                                         base if base is not None else index, int(pad)),
                      (C, C2, table is not None, len(pairs), _pow2(C), _pow2(C2), kv is not None, Hkv, D,
                       _pow2(Hkv), _pow2(D), base is not None))
        return True
    if base is not None:
        idx = index.to(torch.long)
        real = idx >= 0
        rows = torch.where(real, (base + torch.arange(n, device=index.device)) % int(pad), int(pad))
        table.index_copy_(0, idx[real], rows[real])
    else:
        rows = torch.where(index < 0, pad, index.to(torch.long))
        if table is not None:
            rows = table[rows]
    for d, s in pairs:
        d.index_copy_(0, rows, s[:n].reshape((n,) + tuple(d.shape[1:])).to(d.dtype))
    return False


def _kv_fits(kv: tuple, n: int, ordinal: int) -> bool:
    """Whether the Triton launch can write ``kv = (key, value, key_cache, value_cache)``: token rows of
    ``[Hkv, D]`` each contiguous, caches ``[blocks, block_size, Hkv, D]`` of one shape with ``D`` contiguous,
    everything on the CUDA device of this ``ordinal``."""
    k, v, kc, vc = kv
    return (kc.dim() == 4 and vc.shape == kc.shape and kc.stride(3) == 1 and vc.stride(3) == 1
            and all(t.get_device() == ordinal for t in kv)
            and all(t.shape[0] >= n and _row_numel(t) == kc.shape[2] * kc.shape[3] and _rows_contiguous(t)
                    for t in (k, v)))


SUMMARY_MAX_ROWS = 16384  # the longest part (rows) summarised by one Triton program holding its rows in registers
SUMMARY_LOOP_ROWS = 4096  # a longer part's program reads it this many rows at a time (LOOPED)


def summary_warps(block: int) -> int:
    """Warps of :func:`summaries`' program for parts of up to ``block`` rows: 4 up to 2,048 rows, then one more
    warp for every 512 rows (32 at 16,384), so that a thread holds the same 16 rows' keys, and the same [8, 16]
    comparisons a counting pass, in every bucket (and in a looped program's ``SUMMARY_LOOP_ROWS``)."""
    return max(4, min(32, block // 512))


def summaries(per_row: torch.Tensor, cu: list[int], prompt_lens: list[int], vision: bool,
              quantiles: tuple[float, float, float], out: torch.Tensor) -> bool:
    """Per request, part, metric, layer and head of ``per_row [L, 7, H, sum T]`` (any strides, float16 or
    float32; request b's rows at ``cu[b]:cu[b+1]``, its first ``prompt_lens[b]`` the prompt's): the mean of
    the defined rows and their "linear" quantiles, into ``out [B, 2, 7, 4, L, H]`` float32 (stats: mean and
    the three quantiles; left as they are where a part lacks a metric: vision metrics unless ``vision``,
    lookback in the prompt).  One launch per power-of-two bucket of part lengths up to ``SUMMARY_MAX_ROWS``
    rows, each part's rows in registers, and one for the longer parts, read ``SUMMARY_LOOP_ROWS`` at a time
    (up to run 44 a part over 2,048 rows sent the whole batch to device_summaries' torch code, whose sorts and
    gathers were then half of attn-otel's device time in decode steps).  No host sync.  False (nothing done)
    where this does not apply: not CUDA."""
    if not available(per_row.device):
        return False
    segs: dict[int, list[tuple[int, int, int, int]]] = {}
    for b in range(len(cu) - 1):
        T = cu[b + 1] - cu[b]
        N = min(int(prompt_lens[b]), T)
        for part, (start, n) in enumerate(((cu[b], N), (cu[b] + N, T - N))):
            if n > 0:  # bucket 0: the looped program's
                segs.setdefault(0 if n > SUMMARY_MAX_ROWS else max(16, triton.next_power_of_2(n)), []).append(
                    (b, part, start, n))

    L, M, H, _ = per_row.shape
    for block, all_items in sorted(segs.items()):
        looped = block == 0
        block = SUMMARY_LOOP_ROWS if looped else block
        for i in range(0, len(all_items), 65535):  # a grid's third dimension holds at most 65,535
            items = all_items[i:i + 65535]
            seg = upload(np.asarray(items, dtype=np.int64).T.copy(), per_row.device)
            _summaries[(H, L, len(items))](
                per_row, seg, out, len(items), *per_row.stride(), *out.stride(), *quantiles,
                VISION=bool(vision), M=M, NBITS=16 if per_row.dtype == torch.float16 else 32, BLOCK=block,
                LOOPED=looped, num_warps=summary_warps(block))
    return True


def summary_buckets() -> list[int]:
    """The part-length buckets :func:`summaries` launches a kernel variant for: 16, 32, .. SUMMARY_MAX_ROWS, and
    0 for the looped program of longer parts."""
    return [1 << k for k in range(4, SUMMARY_MAX_ROWS.bit_length())] + [0]


def warm_up_summary(block: int, dtype: torch.dtype, device: torch.device, metrics: int = 7) -> None:
    """Compile (by running it on two parts of ``block`` rows; 0: one part past ``SUMMARY_MAX_ROWS``, the looped
    program) :func:`summaries`' kernel for one bucket, row dtype and number of metric rows (8: learned sinks),
    no vision."""
    from .metrics import SUMMARY_METRICS

    n = 2 * block if block else SUMMARY_MAX_ROWS + 1
    cu, prompt = [0, n], [block if block else n]
    per_row = torch.zeros((1, metrics, 1, n), dtype=dtype, device=device)
    # every summary metric, as device_summaries' output has: with 8 rows the kernel writes the eighth
    out = torch.empty((1, 2, len(SUMMARY_METRICS), 4, 1, 1), dtype=torch.float32, device=device)
    summaries(per_row, cu, prompt, False, (0.1, 0.5, 0.9), out)


def warm_up_summaries(device: torch.device, widths: tuple[int, ...] = (7,)) -> int:
    """Compile :func:`summaries`' kernel for every length bucket, float16 and float32 rows, no vision, rows of
    each of ``widths`` metrics (the variants a text model's finishes use): at engine start, not mid-serving.
    Returns the number of launches."""
    if not available(device):
        return 0
    variants = [(block, dtype, m) for block in summary_buckets() for dtype in (torch.float16, torch.float32)
                for m in widths]
    for block, dtype, m in variants:
        warm_up_summary(block, dtype, device, m)
    return len(variants)


def _row_numel(t: torch.Tensor) -> int:
    """Elements in one row ``t[i]`` (``t[0].numel()`` without making the view)."""
    return math.prod(t.shape[1:])


def _pow2(x: int) -> int:
    """The smallest power of two >= ``x`` (>= 1), as ``triton.next_power_of_2``."""
    return 1 << (x - 1).bit_length() if x > 1 else 1


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Each row ``t[i]`` is one contiguous run of memory."""
    if t.dim() == 2:  # the taps' rows, on every eager forward's path
        return t.stride(1) == 1 or t.shape[1] == 1
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def row_metrics_slots(q_tap: torch.Tensor, k_tap: torch.Tensor, slots: torch.Tensor, cu_tokens: torch.Tensor,
                      prompt_lens: torch.Tensor, max_tokens: int, scale: float, sink_tokens: int = 4,
                      vision_mask: torch.Tensor | None = None, out: torch.Tensor | None = None,
                      terms: Terms | None = None) -> torch.Tensor:
    """Several requests' rows straight from the tap, no gather: ``q_tap [S, Hq, D]``, ``k_tap [S, Hkv, D]``
    (any rows), request b's tokens at ``slots[cu_tokens[b]:cu_tokens[b+1]]`` (int64, on the device),
    ``prompt_lens [B]`` int32 -> ``out [7, Hq, sum T]`` float32 (request b's rows in its ``cu_tokens``
    range; ``[8, ..]`` where ``terms``, the layer's attention terms (:func:`terms`), has learned sinks).
    ``vision_mask`` is float32 ``[sum T]`` (concatenated per request) or None.  Nothing here syncs with the
    host: it can be enqueued on the engine's stream."""
    hq = q_tap.shape[1]
    total = slots.shape[0]
    B = cu_tokens.shape[0] - 1
    if out is None:
        out = torch.empty((terms.width if terms is not None else 7, hq, total), dtype=torch.float32,
                          device=q_tap.device)
    elif terms is not None and out.shape[0] < terms.width:
        raise ValueError(f"out holds {out.shape[0]} metric rows; learned sinks need {terms.width}")
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
            vc, out, out.stride(2), out.stride(0), out.stride(1), False, max_tokens, scale, sink_tokens,
            terms=terms)
    return out


def row_metrics_stream(q_ring: torch.Tensor, q_rows: torch.Tensor, cu_rows: torch.Tensor, first: torch.Tensor,
                       key_cache: torch.Tensor, key_slots: torch.Tensor, cu_keys: torch.Tensor,
                       prompt_lens: torch.Tensor, max_rows: int, scale: float, sink_tokens: int,
                       vision_mask: torch.Tensor | None, vision_count: torch.Tensor | None,
                       out: torch.Tensor, terms: Terms | None = None,
                       rows: tuple[str, ...] | None = None, row_table: torch.Tensor | None = None,
                       paged: int = 0) -> torch.Tensor:
    """Rows of several live requests, each against its keys in vLLM's paged cache, into a per-slot buffer.

    Request b's query rows are positions ``first[b] ..`` (``cu_rows[b+1] - cu_rows[b]`` of them) at rows
    ``q_rows[cu_rows[b]:cu_rows[b+1]]`` of ``q_ring [R, Hq, D]``; its keys are positions ``0 .. e-1`` at
    slots ``key_slots[cu_keys[b]:cu_keys[b+1]]`` of ``key_cache [blocks, block_size, Hkv, D]`` (any
    strides: a view of vLLM's KV cache, or a tap viewed with block size 1); ``e`` is the last row's
    position + 1.  Row i's metrics go to ``out[slot of position i, metric, head]`` (``out [S, 7, Hq]``,
    float16 or float32; ``out [S, len(rows), Hq]`` with the metrics ``rows`` only, see :func:`_rows_at`).
    ``vision_mask`` is float32 over the keys (``cu_keys``), ``vision_count`` the number of vision keys up to
    each row (``cu_rows``).  With ``row_table`` (slot -> row of ``q_ring``, int64; ``q_rows`` is then not read)
    the row of position ``p`` is ``row_table[its slot]``: no per-row index to build or upload.  With ``paged``
    (vLLM's block size), ``key_slots`` holds each request's block ids instead (its block-table row, from
    ``cu_keys[b]``), position ``p`` at slot ``key_slots[cu_keys[b] + p // paged] * paged + p % paged``: a
    sixteenth of the entries for the host to build and upload; no vision mask then.  Enqueued on the current
    stream, no host sync."""
    _launch(q_ring, q_rows if row_table is None else row_table, cu_rows, first, key_cache, key_slots, cu_keys,
            prompt_lens, vision_mask, vision_count, out, out.stride(0), out.stride(1), out.stride(2), True, max_rows,
            scale, sink_tokens, terms=terms, rows=rows, qr_table=row_table is not None, paged=paged)
    return out


def row_metrics_stream_layers(q_ring: torch.Tensor, q_rows: torch.Tensor, cu_rows: torch.Tensor,
                              first: torch.Tensor, key_caches: list[torch.Tensor], key_offsets: torch.Tensor,
                              key_slots: torch.Tensor, cu_keys: torch.Tensor, prompt_lens: torch.Tensor,
                              max_rows: int, scale: float, sink_tokens: int, vision_mask: torch.Tensor | None,
                              vision_count: torch.Tensor | None, out: torch.Tensor,
                              terms: Terms | None = None, rows: tuple[str, ...] | None = None,
                              row_table: torch.Tensor | None = None, paged: int = 0) -> torch.Tensor:
    """:func:`row_metrics_stream` for every layer of ``q_ring [L, R, Hq, D]`` and ``out [L, S, 7, Hq]`` in one
    launch: layer l's keys are ``key_caches[l]`` (one shape, dtype and strides), which lies
    ``key_offsets[l]`` elements from ``key_caches[0]`` (see :func:`key_offsets`)."""
    _launch(q_ring[0], q_rows if row_table is None else row_table, cu_rows, first, key_caches[0], key_slots, cu_keys,
            prompt_lens, vision_mask, vision_count, out[0], out.stride(1), out.stride(2), out.stride(3), True,
            max_rows, scale, sink_tokens, layers=(q_ring.shape[0], key_offsets, q_ring.stride(0), out.stride(0)),
            terms=terms, rows=rows, qr_table=row_table is not None, paged=paged)
    return out


def key_offsets(key_caches: list[torch.Tensor]) -> list[int] | None:
    """Each cache's element offset from the first, where one launch can read them all (one device, dtype,
    shape and strides, addresses a whole number of elements apart), else None."""
    k0 = key_caches[0]
    size = k0.element_size()
    offs = []
    for k in key_caches:
        if (k.device != k0.device or k.dtype != k0.dtype or k.shape != k0.shape or k.stride() != k0.stride()
                or (k.data_ptr() - k0.data_ptr()) % size):
            return None
        offs.append((k.data_ptr() - k0.data_ptr()) // size)
    return offs


def _heads_per_program(hq: int, hkv: int) -> tuple[int, int]:
    """(heads, padded): a program takes ``heads`` query heads of one KV head, ``padded`` (a power of two,
    at most 8 unless the group is one head) rows of heads in its tile."""
    group = hq // hkv
    if group <= 8:
        return group, triton.next_power_of_2(group)
    heads = 8
    while group % heads:
        heads //= 2
    return heads, heads


# Launch configuration: query rows per program (heads x rows), keys per tile, warps, pipeline stages.  Launches
# whose keys come by block id of the cache's own block size (the stream's flushes of a text model: PBS_IS_BS, no
# division per key) take 64 rows of 64 keys a program: the fastest of bench/flush_kernel.py's sweep on an H200
# (docs/benchmarks/flush-kernel-paged-sweep-h200.json), x0.84 / x0.93 / x0.60 / x0.90 of 128 x 128's time on 32 x
# 512 prefill rows, 256 x 64 decode rows, 256 x 2 finish rows and 32 x 768 rows, level on 8 x 2048, x1.07 on
# 2 x 8192 alone.  Launches by key slot (taps, a flush with images) keep 128 x 128, the H100 sweep's choice (run 10
# of docs/benchmarks/history.md): there 64 x 64 took x1.5 its time.  (Per-shape configurations were measured
# slower in the serving benchmark, run 9: a flush launch mixes requests of every length, and each configuration
# is another compiled kernel.)  Settable here for the sweep (both paths), and ``maxnreg`` (a
# register cap a thread, for the occupancy it buys) beside them.
CONFIG: dict[str, int] = {}


def _config(hg: int, d: int, by_block: bool) -> tuple[int, int, int, int]:
    if d > 256:  # MLA's 576-wide latent rows: a smaller tile (the query block alone is 64 x 576 values)
        block_m = int(CONFIG.get("block_m", 64))
        block_r = max(block_m // hg, max(1, 16 // hg))
        return (block_r, int(CONFIG.get("block_n", 32)), int(CONFIG.get("num_warps", 8)),
                int(CONFIG.get("num_stages", 2)))
    block_m = int(CONFIG.get("block_m", 64 if by_block else 128))
    block_r = max(16, block_m // hg)
    return (block_r, int(CONFIG.get("block_n", 64 if by_block or d > 128 else 128)), int(CONFIG.get("num_warps", 4)),
            int(CONFIG.get("num_stages", 2)))


def split_head_dim(d: int) -> tuple[int, int] | None:
    """``(D, D2)``: a head_dim as the kernel's power-of-two part and power-of-two tail (0: none), e.g. MLA's
    576 = 512 + 64; None where it is neither (the torch path computes such layers)."""
    p = 1 << (int(d).bit_length() - 1)
    tail = int(d) - p
    if p < 16 or (tail and (tail < 16 or tail & (tail - 1))):
        return None
    return p, tail


@dataclasses.dataclass(frozen=True)
class Terms:
    """The attention terms of the layers of one launch, on the device (see :func:`terms`): per layer the
    sliding window, the chunk of chunked local attention (int32 ``[L]``, 0: none) and the logit soft-cap
    (float32 ``[L]``, 0: none); the learned sink logits (float32 ``[L * Hq]``, -inf where a layer has none) or
    None; and which of them any layer has (the kernel's compile-time switches)."""

    window: torch.Tensor
    chunk: torch.Tensor
    cap: torch.Tensor
    sinks: torch.Tensor | None
    local: bool
    has_cap: bool

    @property
    def switches(self) -> tuple[bool, bool, bool]:
        """The kernel's compile-time switches these terms set (LOCAL, HAS_CAP, HAS_SINKS): one variant each."""
        return self.local, self.has_cap, self.sinks is not None

    @property
    def width(self) -> int:
        """Metric rows the kernel writes: 8 with learned sinks (learned_sink_mass), else 7."""
        return 8 if self.sinks is not None else 7


def terms(layers, device) -> Terms | None:
    """:class:`Terms` of ``layers`` (:class:`attn_otel.tap.LayerSpec`, or anything hashable with ``window``,
    ``chunk``, ``soft_cap``, ``sinks`` and ``num_heads``), in launch order; None where none has a term (the
    plain kernel).  Made once per layers and device: on the serving path a lookup, no upload."""
    return _terms(tuple(layers), str(torch.device(device)))


@functools.lru_cache(maxsize=256)
def _terms(layers: tuple, device: str) -> Terms | None:
    key = [(int(s.window or 0), int(s.chunk or 0), float(s.soft_cap or 0.0),
            None if s.sinks is None else tuple(float(x) for x in s.sinks), int(s.num_heads)) for s in layers]
    if all(not w and not c and not cap and sinks is None for w, c, cap, sinks, _ in key):
        return None
    hq = max(h for *_, h in key)
    window = torch.tensor([w for w, *_ in key], dtype=torch.int32, device=device)
    chunk = torch.tensor([c for _, c, *_ in key], dtype=torch.int32, device=device)
    cap = torch.tensor([c for _, _, c, *_ in key], dtype=torch.float32, device=device)
    sinks = None
    if any(k[3] is not None for k in key):
        rows = [list(k[3] or ()) + [float("-inf")] * (hq - len(k[3] or ())) for k in key]
        sinks = torch.tensor(rows, dtype=torch.float32, device=device).reshape(-1)
    return Terms(window, chunk, cap, sinks, local=any(w or c for w, c, *_ in key),
                 has_cap=any(c for _, _, c, *_ in key))


@functools.lru_cache(maxsize=64)
def _rows_at(names: tuple[str, ...] | None) -> dict[str, int]:
    """The kernel's ROW_* switches for metric rows ``names`` in that order (None: every metric in
    :data:`attn_otel.attention.METRICS` order): entropy first, vision_share_norm right after vision_share."""
    from .attention import METRICS

    names = tuple(METRICS) if names is None else tuple(names)
    if names[0] != "entropy" or any(n not in METRICS for n in names):
        raise ValueError(f"metric rows {names}: entropy first, names from {METRICS}")
    at = {n: i for i, n in enumerate(names)}
    if ("vision_share" in at) != ("vision_share_norm" in at) or (
            "vision_share" in at and at["vision_share_norm"] != at["vision_share"] + 1):
        raise ValueError(f"metric rows {names}: vision_share_norm must follow vision_share")
    return dict(ROW_NORM=at.get("entropy_norm", -1), ROW_S0=at["sink_mass_first"], ROW_SK=at["sink_mass_k"],
                ROW_VIS=at.get("vision_share", -1), ROW_LB=at["lookback_ratio"],
                ROW_SINK=at.get("learned_sink_mass", -1))


def _launch(q, q_rows, cu_rows, first, key_cache, key_slots, cu_keys, prompt_lens, vision_mask, vision_count,
            out, so_r, so_m, so_h, by_slot, max_rows, scale, sink_tokens, layers=None,
            terms: Terms | None = None, rows: tuple[str, ...] | None = None, qr_table: bool = False,
            paged: int = 0) -> None:
    """``qr_table``: ``q_rows`` is a slot -> row table, read at each row's key slot (``by_slot`` only).
    ``layers``: None, or ``(n, key_offsets, sq_l, so_l)`` for n layers in one launch (``q`` and ``out``
    are then layer 0's, ``key_cache`` layer 0's cache and ``key_offsets`` each layer's element offset from
    it, int64 on the device).  ``terms``: the layers' attention terms (:func:`terms`), None for plain
    layers; with learned sinks ``out`` has an eighth metric row (``so_m`` apart), learned_sink_mass.  ``rows``:
    the metrics ``out`` keeps along its metric axis, in that order (None: all, in METRICS order).  ``paged``:
    ``key_slots`` are block ids of that many positions each (see :func:`row_metrics_stream`), 0: slots."""
    hq, d = q.shape[1], q.shape[2]
    hkv = key_cache.shape[2]
    split = split_head_dim(d)
    if split is None:
        raise ValueError(f"head_dim {d} is not a power of two or a power of two plus a smaller one")
    B = cu_rows.shape[0] - 1
    has_vision = vision_mask is not None
    if paged and has_vision:
        raise ValueError("a vision mask is indexed by key position: give key slots, not blocks (paged=0)")
    vm = vision_mask if has_vision else out  # unused pointers
    vc = vision_count if has_vision else out
    heads, hg = _heads_per_program(hq, hkv)
    by_block = bool(paged) and int(paged) == int(key_cache.shape[1])
    block_r, block_n, warps, stages = _config(hg, d, by_block)
    n_layers, koff, sq_l, so_l = layers if layers is not None else (1, out, 0, 0)
    grid = (triton.cdiv(max(int(max_rows), 1), block_r), n_layers * (hq // heads), B)
    if terms is not None and terms.window.shape[0] != n_layers:
        raise ValueError(f"terms of {terms.window.shape[0]} layers for a launch of {n_layers}")
    win, chk, cap = (terms.window, terms.chunk, terms.cap) if terms is not None else (out, out, out)  # unused
    sinks = terms.sinks if terms is not None and terms.sinks is not None else out
    at = _rows_at(None if rows is None else tuple(rows))
    if has_vision and at["ROW_VIS"] < 0:
        raise ValueError("a vision mask for metric rows without the vision pair")
    if terms is not None and terms.sinks is not None and at["ROW_SINK"] < 0:
        raise ValueError("learned sinks for metric rows without learned_sink_mass")
    _row_metrics[grid](q, q_rows, cu_rows, first, key_cache, key_slots, cu_keys, prompt_lens, vm, vc, out, koff,
                       win, chk, cap, sinks, int(sink_tokens), float(scale), int(key_cache.shape[1]),
                       max(int(paged), 1), heads,
                       hq // hkv, hq // heads,
                       sq_l, q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                       so_l, so_r, so_m, so_h,
                       HAS_VISION=has_vision, OUT_BY_SLOT=by_slot, LAYERED=layers is not None,
                       QR_TABLE=bool(qr_table), LOCAL=terms is not None and terms.local,
                       HAS_CAP=terms is not None and terms.has_cap,
                       HAS_SINKS=terms is not None and terms.sinks is not None, **at, PAGED=bool(paged),
                       PBS_IS_BS=by_block,
                       HG=hg, D=split[0],
                       D2=split[1], BLOCK_R=block_r, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
                       **({"maxnreg": int(CONFIG["maxnreg"])} if "maxnreg" in CONFIG else {}))


def row_metrics(q: torch.Tensor, k: torch.Tensor, scale: float, prompt_len: int, sink_tokens: int = 4,
                vision_mask: torch.Tensor | None = None, out: torch.Tensor | None = None,
                terms: Terms | None = None) -> torch.Tensor:
    """``q [B, T, Hq, D]``, ``k [B, T, Hkv, D]`` (one request, B layers of one set of attention ``terms``,
    :func:`terms`) -> ``[B, 7, Hq, T]`` float32 (``[B, 8, ..]`` with learned sinks)."""
    B, T, hq, d = q.shape
    if out is None:
        out = torch.empty((B, terms.width if terms is not None else 7, hq, T), dtype=torch.float32,
                          device=q.device)
    if vision_mask is not None and tuple(vision_mask.shape) != (T,):
        raise ValueError(f"vision_mask has shape {tuple(vision_mask.shape)}, expected ({T},)")
    slots = torch.arange(T, dtype=torch.int64, device=q.device)
    cu = torch.tensor([0, T], dtype=torch.int32, device=q.device)
    np_ = torch.tensor([int(prompt_len)], dtype=torch.int32, device=q.device)
    vm = None if vision_mask is None else vision_mask.to(device=q.device, dtype=torch.float32)
    for b in range(B):
        row_metrics_slots(q[b], k[b], slots, cu, np_, T, scale, sink_tokens, vm, out=out[b], terms=terms)
    return out
