"""Attention probabilities and per-row health metrics from captured queries and keys (torch, no vLLM).

All math runs on the device the tensors live on, in float32, a band of query rows at a time, so the
extra memory is ``heads * ROWS * T * 4`` bytes: linear in T.  Nothing here synchronises with the host.

Per-row metrics (row i is the query of token i; n_i = i + 1 keys are visible; N = prompt length):

- ``entropy``            H_i = -sum_j A_ij ln A_ij
- ``entropy_norm``       H_i / ln(n_i); NaN for row 0 (one visible key)
- ``sink_mass_first``    A_i0, for rows i >= k (else NaN)
- ``sink_mass_k``        sum_{j<k} A_ij, for rows i >= k (StreamingLLM, arXiv:2309.17453)
- ``vision_share``       sum over visible image-embedding keys; NaN where none is visible
- ``vision_share_norm``  vision_share / (|visible image keys| / n_i)
- ``learned_sink_mass``  layers with learned attention sinks (gpt-oss) only, every row: the share of row i's
                         softmax that the head's sink logit s_h takes, exp(s_h) / (exp(s_h) + sum_j exp(l_ij))
                         = 1 - sum_j A_ij (the model's own "no-op" attention); NaN on every other layer
- ``lookback_ratio``     generated rows i >= N only (Lookback Lens, arXiv:2407.07071, Chuang et al. 2024):
                         ctx / (ctx + new), ctx = sum_{j<N} A_ij / N, new = sum_{N<=j<=i} A_ij / (i - N + 1)

Rows 0..N-1 are the prompt's tokens, rows N..T-1 the generated tokens y_1, y_2, .. (row N-1+k is y_k, the
query that generates y_{k+1}; the last generated token never becomes a query row).  Lookback Lens's ratio
at the step that generates y_t compares the mean attention on the context (the N prompt keys) with the mean
on the new tokens so far, y_1 .. y_{t-1}: for row i (generating y_{i-N+2}) those are keys N..i, the query's
own key included.  So it is defined from the first generated row on (row N: new = A_NN, its own key only)
and NaN on the prompt rows (row N-1, generating y_1, has no new token).  Captures before store format 2
left the query's own key out (new = mean_{N<=j<i} A_ij, defined from row N+1).
"""

from __future__ import annotations

import torch

from .metrics import SUMMARY_METRICS

ROWS = 64
# The per-row metrics' order along the metric axis: the summaries' own (attn_otel.metrics), so that a row index
# here is the summary's metric index (device_summaries relies on it).
METRICS = SUMMARY_METRICS
# The metrics of layers without learned sinks: where no captured layer has sinks, rows hold these first seven
# and the learned sink mass (NaN there) takes no room (the stream's per-slot buffer keeps fewer still:
# attn_otel.stream.slot_rows).
KERNEL_METRICS = METRICS[:7]
LEARNED_SINK_ROW = METRICS.index("learned_sink_mass")


def metric_width(layers) -> int:
    """Metric rows per layer that hold ``layers``' per-row metrics: :data:`KERNEL_METRICS`, and the learned sink
    mass where some layer has learned sinks (gpt-oss)."""
    return len(METRICS) if any(getattr(s, "sinks", None) is not None for s in layers) else len(KERNEL_METRICS)


def _probs(q: torch.Tensor, k: torch.Tensor, scale: float, r0: int, r1: int, soft_cap: float = 0.0,
           window: int = 0, sinks: torch.Tensor | None = None, chunk: int = 0,
           sink_share: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax rows r0..r1-1 for every query head: float32 [Hq, r1-r0, T]; causal; GQA by head groups.

    The model's own attention terms, in the order vLLM's kernels apply them: logits = q.k * scale, then
    ``soft_cap`` c > 0: logits = c * tanh(logits / c); ``window`` W > 0: row i sees keys i-W+1 .. i only
    (vLLM's and HF's convention: i - j < W); ``chunk`` C > 0 (chunked local attention, Llama 4): row i sees
    keys C * floor(i / C) .. i only; ``sinks`` [Hq]: a learned logit s_h per query head in the
    softmax denominator, p_ij = exp(l_ij) / (exp(s_h) + sum_j exp(l_ij)), so a row sums to 1 - its sink share
    (written to ``sink_share`` [Hq, r1-r0] when given).
    """
    T, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qf = q[r0:r1].float().permute(1, 0, 2).reshape(hkv, g * (r1 - r0), d)  # [Hkv, g*rows, D]
    kf = k.float().permute(1, 2, 0)  # [Hkv, D, T]
    logits = torch.bmm(qf, kf).view(hq, r1 - r0, T).mul_(scale)
    if soft_cap:
        logits = logits.div_(soft_cap).tanh_().mul_(soft_cap)
    rows = torch.arange(r0, r1, device=q.device).view(1, -1, 1)
    cols = torch.arange(T, device=q.device).view(1, 1, -1)
    hidden = cols > rows
    if window and window > 0:
        hidden = hidden | (rows - cols >= window)
    if chunk and chunk > 0:
        hidden = hidden | (cols < rows // chunk * chunk)
    logits.masked_fill_(hidden, float("-inf"))
    if sinks is None:
        return torch.softmax(logits, dim=-1)
    s_h = sinks.float().view(hq, 1)
    lse = torch.logaddexp(torch.logsumexp(logits, dim=-1), s_h)  # [Hq, rows]
    if sink_share is not None:
        sink_share.copy_(torch.exp(s_h - lse))
    return torch.exp(logits - lse.unsqueeze(-1))


def attention_maps(q: torch.Tensor, k: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                   rows: int = ROWS, soft_cap: float = 0.0, window: int = 0,
                   sinks: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
    """Full causal maps [Hq, T, T] (written into ``out`` when given, any float dtype); the terms as in
    :func:`_probs`."""
    T, hq, _ = q.shape
    if out is None:
        out = torch.empty((hq, T, T), dtype=torch.float32, device=q.device)
    for r0 in range(0, T, rows):
        r1 = min(T, r0 + rows)
        out[:, r0:r1] = _probs(q, k, scale, r0, r1, soft_cap, window, sinks, chunk)
    return out


def attention_metrics(q: torch.Tensor, k: torch.Tensor, scale: float, prompt_len: int,
                      sink_tokens: int = 4, vision_mask: torch.Tensor | None = None,
                      maps_out: torch.Tensor | None = None, rows: int = ROWS, start: int = 0,
                      soft_cap: float = 0.0, window: int = 0, sinks: torch.Tensor | None = None,
                      chunk: int = 0, on_band=None) -> torch.Tensor:
    """Per-row metrics float32 [len(METRICS), Hq, T] (NaN where undefined), never holding a full map.

    With ``maps_out`` ([Hq, T, T]), the probabilities are also written there, band by band; ``on_band(r0, r1, p)``
    is called with each band's float32 probabilities ``[Hq, r1-r0, T]`` (ATTN_OTEL_VERIFY's maps x V check, on
    the probabilities before ``maps_out``'s float16 rounding).  With ``start``,
    only rows ``start ..`` are computed (the earlier rows of ``q`` are not read; their results stay NaN).

    The model's attention terms (``soft_cap``, ``window``, ``sinks``) are those of :func:`_probs`.  What the
    metrics mean under them:

    - visible keys: row i sees keys max(0, i-W+1) .. i under a window W, so n_i = min(i+1, W), and keys
      C * floor(i / C) .. i under chunked local attention C (both: the later first key); ``entropy_norm``
      divides by ln(n_i) (NaN where n_i = 1).
    - sinks: the map row is the keys' probabilities as the model computed them, summing to 1 - sink share;
      ``entropy`` is -sum_j A_ij ln A_ij over those key probabilities only (the sink's own share is not a
      term), still normalised by ln(n_i).  The sink logit's own share is ``learned_sink_mass``: computed from
      the log-sum-exp as exp(s_h - lse_i), not as 1 - sum_j A_ij, so a share near 0 keeps its precision.
    - ``sink_mass_first`` / ``sink_mass_k`` (rows i >= k): the mass on keys 0 / 0..k-1 that row i can see;
      NaN where none of them is visible (a windowed row far from the start: the layer cannot attend there,
      as ``vision_share`` is NaN where no image key is visible), never a 0 that would read as "no sink".
    - ``vision_share`` counts visible image keys only (chance share = visible image keys / n_i).
    - ``lookback_ratio``: ctx = mean over the visible prompt keys, new = mean over the visible generated keys
      (N..i, at least the row's own key); NaN where no prompt key is visible.
    """
    T, hq, _ = q.shape
    dev = q.device
    W = int(window) if window and window > 0 else 0
    res = torch.full((len(METRICS), hq, T), float("nan"), dtype=torch.float32, device=dev)
    pos = torch.arange(T, device=dev)
    lo = (pos - W + 1).clamp_min(0) if W else torch.zeros_like(pos)  # first visible key of each row
    if chunk and chunk > 0:
        lo = torch.maximum(lo, pos // int(chunk) * int(chunk))
    n_vis = (pos + 1 - lo).float()
    log_n = torch.log(n_vis)
    if vision_mask is not None and tuple(vision_mask.shape) != (T,):
        raise ValueError(f"vision_mask has shape {tuple(vision_mask.shape)}, expected ({T},)")
    vm = vision_mask.to(device=dev, dtype=torch.float32) if vision_mask is not None else None
    vis_count = None
    if vm is not None:
        cum = torch.cat([torch.zeros(1, device=dev), torch.cumsum(vm, 0)])  # cum[j] = image keys before j
        vis_count = cum[pos + 1] - cum[lo]
    N = int(prompt_len)
    kk = int(sink_tokens)
    for r0 in range(int(start), T, rows):
        r1 = min(T, r0 + rows)
        p = _probs(q, k, scale, r0, r1, soft_cap, W, sinks, chunk,
                   sink_share=None if sinks is None else res[LEARNED_SINK_ROW, :, r0:r1])  # [H, r, T]
        if maps_out is not None:
            maps_out[:, r0:r1] = p
        if on_band is not None:
            on_band(r0, r1, p)
        ent = -torch.xlogy(p, p).sum(-1)
        res[0, :, r0:r1] = ent
        ln = log_n[r0:r1]
        res[1, :, r0:r1] = torch.where(ln > 0, ent / ln.clamp_min(1e-30), torch.nan)
        i = pos[r0:r1]
        ok = i >= kk
        first_ok = ok & (lo[r0:r1] == 0)
        k_ok = ok & (lo[r0:r1] < max(kk, 1))
        res[2, :, r0:r1] = torch.where(first_ok, p[..., 0], torch.nan)
        res[3, :, r0:r1] = torch.where(k_ok, p[..., :kk].sum(-1), torch.nan)
        if vm is not None:
            share = (p * vm).sum(-1)
            cnt = vis_count[r0:r1]
            res[4, :, r0:r1] = torch.where(cnt > 0, share, torch.nan)
            chance = cnt / n_vis[r0:r1]
            res[5, :, r0:r1] = torch.where(cnt > 0, share / chance.clamp_min(1e-30), torch.nan)
        if r1 > N and N > 0:  # Lookback Lens: generated rows i >= N; new keys N..i, the row's own included
            a = max(r0, N)
            pa = p[:, a - r0:]
            ia = pos[a:r1]
            la = lo[a:r1]
            n_ctx = (N - la).clamp_min(0).float()  # visible prompt keys
            n_new = (ia - torch.maximum(la, torch.full_like(la, N)) + 1).float()  # visible generated keys
            ctx = pa[..., :N].sum(-1) / n_ctx.clamp_min(1)
            nmask = (pos >= N).view(1, -1) & (pos.view(1, -1) <= ia.view(-1, 1))  # [r, T]; hidden keys are 0
            new = (pa * nmask).sum(-1) / n_new
            tot = ctx + new
            res[6, :, a:r1] = torch.where((tot > 0) & (n_ctx > 0), ctx / tot.clamp_min(1e-30), torch.nan)
    return res



def vision_mask(ranges) -> "np.ndarray":
    """Boolean mask of image-embedding positions from ``(offset, length, is_embed or None)`` ranges.

    ``is_embed`` marks which of a placeholder's ``length`` positions really receive an image embedding
    (a processor may put break or separator tokens inside a placeholder); None means all of them.
    """
    import numpy as np

    end = max((off + length for off, length, _ in ranges), default=0)
    mask = np.zeros(end, dtype=bool)
    for off, length, is_embed in ranges:
        seg = np.ones(length, dtype=bool) if is_embed is None else np.asarray(is_embed, dtype=bool)
        if seg.shape != (length,):
            raise ValueError(f"is_embed has shape {seg.shape}, expected ({length},)")
        mask[off:off + length] |= seg
    return mask


def reconstruction_error(maps: torch.Tensor, values: torch.Tensor, v_scale: float, out: torch.Tensor,
                         v_up: torch.Tensor | None = None) -> torch.Tensor:
    """``|A V - O| / |O|`` per row and head (flat, float32): maps ``[Hq, R, T]`` (R rows, any float dtype) times
    values ``[T, Hkv, Dv]`` (times ``v_scale``; query head h reads KV head ``h // (Hq / Hkv)``) against those rows'
    attention output ``[R, Hq, Dv]`` as the backend computed it.  MLA: values are the latent rows ``[T, 1, L]`` and
    ``v_up`` (``W_UV``, ``[Hq, L, Dv]``) takes head h's result to its output.  One head at a time.

    The compute thread passes each band's float32 probabilities (:func:`attention_metrics`' ``on_band``), not
    the stored float16 maps: those hold nothing under 6e-8, so a row whose learned sink takes all but 1e-9 of
    the mass (gpt-oss's first token) would read A V = 0 against an output of that size, an error of 1.0."""
    hq, hkv = maps.shape[0], values.shape[1]
    errs = []
    for h in range(hq):
        v = values[:, h // (hq // hkv)].float() * float(v_scale)
        o = out[:, h].float()
        rec = maps[h].float() @ v
        if v_up is not None:
            rec = rec @ v_up[h].float()
        errs.append((rec - o).norm(dim=-1) / o.norm(dim=-1).clamp_min(1e-12))
    return torch.stack(errs).reshape(-1)
