"""Per-row attention metrics in one fused Triton kernel (CUDA): no T x T tensor, one launch per request.

Same contract as :func:`attn_otel.attention.attention_metrics` (the torch reference it is tested
against), for a batch of layers of one request: ``q [B, T, Hq, D]``, ``k [B, T, Hkv, D]`` ->
``[B, len(METRICS), Hq, T]`` float32, NaN where a metric is undefined.

Each program takes a block of query rows of one head of one layer and walks its causal keys twice: first
the running max and sum of exp (as FlashAttention does), then the normalised probabilities feed the
entropy, sink, vision and lookback sums.  Logits are float32 accumulations of the model's own bf16/fp16
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

    @triton.jit(do_not_specialize=["T", "N", "KS"])
    def _row_metrics(Q, K, VM, VC, OUT, T, N, KS, scale,
                     sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, so_b, so_m, so_h,
                     HAS_VISION: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_m = tl.program_id(0)
        h = tl.program_id(1)
        b = tl.program_id(2)
        kvh = h // GROUP
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        dd = tl.arange(0, D)
        row_ok = rows < T
        q = tl.load(Q + b * sq_b + rows[:, None] * sq_t + h * sq_h + dd[None, :], mask=row_ok[:, None], other=0.0)
        hi = tl.minimum((pid_m + 1) * BLOCK_M, T)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        for start in range(0, hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            kt = tl.load(K + b * sk_b + cols[:, None] * sk_t + kvh * sk_h + dd[None, :], mask=(cols < T)[:, None],
                         other=0.0)
            s = tl.dot(q, tl.trans(kt)) * scale
            valid = (cols[None, :] <= rows[:, None]) & (cols[None, :] < T)
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), 1)
            m_i = m_new
        m_i = tl.where(row_ok, m_i, 0.0)
        l_i = tl.where(row_ok, l_i, 1.0)
        ent = tl.zeros([BLOCK_M], tl.float32)
        s0 = tl.zeros([BLOCK_M], tl.float32)
        sk = tl.zeros([BLOCK_M], tl.float32)
        vis = tl.zeros([BLOCK_M], tl.float32)
        ctx = tl.zeros([BLOCK_M], tl.float32)
        gen = tl.zeros([BLOCK_M], tl.float32)
        for start in range(0, hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            kt = tl.load(K + b * sk_b + cols[:, None] * sk_t + kvh * sk_h + dd[None, :], mask=(cols < T)[:, None],
                         other=0.0)
            s = tl.dot(q, tl.trans(kt)) * scale
            valid = (cols[None, :] <= rows[:, None]) & (cols[None, :] < T) & row_ok[:, None]
            p = tl.where(valid, tl.exp(s - m_i[:, None]) / l_i[:, None], 0.0)
            ent += tl.sum(tl.where(p > 0, -p * tl.log(tl.where(p > 0, p, 1.0)), 0.0), 1)
            s0 += tl.sum(tl.where(cols[None, :] == 0, p, 0.0), 1)
            sk += tl.sum(tl.where(cols[None, :] < KS, p, 0.0), 1)
            ctx += tl.sum(tl.where(cols[None, :] < N, p, 0.0), 1)
            gen += tl.sum(tl.where((cols[None, :] >= N) & (cols[None, :] < rows[:, None]), p, 0.0), 1)
            if HAS_VISION:
                vm = tl.load(VM + cols, mask=cols < T, other=0.0)
                vis += tl.sum(p * vm[None, :], 1)
        nan = float("nan")
        rf = rows.to(tl.float32)
        base = OUT + b * so_b + h * so_h + rows
        tl.store(base + 0 * so_m, ent, mask=row_ok)
        tl.store(base + 1 * so_m, tl.where(rows > 0, ent / tl.log(tl.maximum(rf + 1.0, 2.0)), nan), mask=row_ok)
        tl.store(base + 2 * so_m, tl.where(rows >= KS, s0, nan), mask=row_ok)
        tl.store(base + 3 * so_m, tl.where(rows >= KS, sk, nan), mask=row_ok)
        if HAS_VISION:
            vc = tl.load(VC + rows, mask=row_ok, other=0.0)
            tl.store(base + 4 * so_m, tl.where(vc > 0, vis, nan), mask=row_ok)
            tl.store(base + 5 * so_m, tl.where(vc > 0, vis / tl.maximum(vc / (rf + 1.0), 1e-30), nan), mask=row_ok)
        else:
            tl.store(base + 4 * so_m, tl.full([BLOCK_M], nan, tl.float32), mask=row_ok)
            tl.store(base + 5 * so_m, tl.full([BLOCK_M], nan, tl.float32), mask=row_ok)
        nf = N * 1.0
        ctxm = ctx / tl.maximum(nf, 1.0)
        genm = gen / tl.maximum(rf - nf, 1.0)
        tot = ctxm + genm
        lb_ok = (rows > N) & (N > 0) & (tot > 0)
        tl.store(base + 6 * so_m, tl.where(lb_ok, ctxm / tl.where(tot > 0, tot, 1.0), nan), mask=row_ok)


def row_metrics(q: torch.Tensor, k: torch.Tensor, scale: float, prompt_len: int, sink_tokens: int = 4,
                vision_mask: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q [B, T, Hq, D]``, ``k [B, T, Hkv, D]`` (one request, B layers) -> ``[B, 7, Hq, T]`` float32."""
    B, T, hq, d = q.shape
    hkv = k.shape[2]
    q = q.contiguous()
    k = k.contiguous()
    if out is None:
        out = torch.empty((B, 7, hq, T), dtype=torch.float32, device=q.device)
    has_vision = vision_mask is not None
    if has_vision:
        if tuple(vision_mask.shape) != (T,):
            raise ValueError(f"vision_mask has shape {tuple(vision_mask.shape)}, expected ({T},)")
        vm = vision_mask.to(device=q.device, dtype=torch.float32).contiguous()
        vc = torch.cumsum(vm, 0)
    else:
        vm = vc = out  # unused pointers
    block_m = 64 if d <= 128 else 32
    grid = (triton.cdiv(T, block_m), hq, B)
    _row_metrics[grid](q, k, vm, vc, out, T, int(prompt_len), int(sink_tokens), float(scale),
                       q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                       out.stride(0), out.stride(1), out.stride(2),
                       HAS_VISION=has_vision, GROUP=hq // hkv, D=d, BLOCK_M=block_m, BLOCK_N=64,
                       num_warps=4, num_stages=2)
    return out
