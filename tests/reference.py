"""Hugging Face transformers' eager attention in float32: the reference the stored maps must match."""

from __future__ import annotations

import functools

import numpy as np


@functools.lru_cache(maxsize=2)
def hf_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    return model


def hf_attention(path: str, token_ids) -> np.ndarray:
    """float32 [layers, heads, T, T] from an fp32 eager forward over ``token_ids``."""
    import torch

    model = hf_model(path)
    with torch.no_grad():
        out = model(torch.tensor([list(token_ids)]), output_attentions=True)
    return np.stack([a[0].float().numpy() for a in out.attentions])


def row_tv(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-row total-variation distance 0.5 * sum_j |a_ij - b_ij| over the last axis."""
    return 0.5 * np.abs(a.astype(np.float64) - b.astype(np.float64)).sum(-1)


def tv_stats(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    tv = row_tv(a, b).ravel()
    return {"median": float(np.median(tv)), "p99": float(np.quantile(tv, 0.99)), "max": float(tv.max()),
            "rows": int(tv.size)}
