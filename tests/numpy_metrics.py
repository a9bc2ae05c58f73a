"""Per-row attention metrics in plain NumPy (float64), straight from the definitions: the reference that
:func:`attn_otel.attention.attention_metrics` (torch, banded, float32) is checked against.

Written row by row on purpose: slow, but each line reads like the formula in attention.py's docstring.
"""

from __future__ import annotations

import numpy as np


def per_row_metrics(A: np.ndarray, prompt_len: int, sink_tokens: int = 4,
                    vision: np.ndarray | None = None, window: int = 0, chunk: int = 0) -> dict[str, np.ndarray]:
    """``{name: float64 [H, T]}`` from causal maps ``A [H, T, T]``; NaN where a metric is undefined.

    Only keys lo_i..i of row i are read (n_i = i + 1 - lo_i visible keys), and 0 * ln 0 counts as 0: lo_i = 0,
    or under a sliding ``window`` W max(0, i - W + 1), under chunked local attention ``chunk`` C also at least
    C * (i // C).  Rows of a layer with learned sinks sum to less than 1; nothing here renormalises them.
    ``vision`` is a boolean mask over key positions (shorter masks are padded with False); without it the
    vision metrics are left out, as they are for a text-only capture.
    """
    A = np.asarray(A, dtype=np.float64)
    H, T, T2 = A.shape
    if T != T2:
        raise ValueError(f"maps must be [H, T, T], got {A.shape}")
    N, k = int(prompt_len), int(sink_tokens)
    image = None
    if vision is not None:
        image = np.zeros(T, dtype=bool)
        v = np.asarray(vision, dtype=bool)[:T]
        image[: len(v)] = v

    names = ["entropy", "entropy_norm", "sink_mass_first", "sink_mass_k", "lookback_ratio"]
    if image is not None:
        names += ["vision_share", "vision_share_norm"]
    out = {name: np.full((H, T), np.nan) for name in names}

    for i in range(T):
        lo = max(0, i - window + 1) if window else 0
        if chunk:
            lo = max(lo, i // chunk * chunk)
        row = A[:, i, lo: i + 1]  # [H, n_i]: the keys row i can see
        n = i + 1 - lo
        safe = np.where(row > 0, row, 1.0)
        entropy = -(np.where(row > 0, row * np.log(safe), 0.0)).sum(axis=1)
        out["entropy"][:, i] = entropy
        if n > 1:
            out["entropy_norm"][:, i] = entropy / np.log(n)
        if i >= k and lo == 0:  # the first keys, where the row can see them
            out["sink_mass_first"][:, i] = A[:, i, 0]
        if i >= k and lo < max(k, 1):  # (k = 0: an empty sum, 0)
            out["sink_mass_k"][:, i] = A[:, i, lo:k].sum(axis=1)
        if image is not None:
            seen = image[lo: i + 1]
            if seen.any():
                share = row[:, seen].sum(axis=1)
                out["vision_share"][:, i] = share
                out["vision_share_norm"][:, i] = share / (seen.sum() / n)
        if N > lo and i >= N:  # Lookback Lens: from the first generated row on, where a prompt key is visible
            ctx = A[:, i, lo:N].mean(axis=1)
            new = A[:, i, max(lo, N):i + 1].mean(axis=1)  # the new tokens so far, the query's own included
            with np.errstate(invalid="ignore"):
                out["lookback_ratio"][:, i] = ctx / (ctx + new)
    return out
