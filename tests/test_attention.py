import math

import numpy as np
import pytest
import torch
from numpy_metrics import per_row_metrics

from attn_otel.attention import METRICS, attention_maps, attention_metrics, vision_mask

HQ, HKV, D = 6, 2, 16
TOL = 1e-5
SCALES = {"plain": 1 / math.sqrt(D), "peaky": 6 / math.sqrt(D)}
# (T, prompt_len): one token; a few; 130 rows cross two 64-row bands, and the prompt ends inside a band.
SHAPES = [(1, 1), (5, 3), (130, 70)]


def qk(T: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 Q [T, HQ, D] and K [T, HKV, D], as a bf16 model hands them over (GQA: 3 query heads per KV head)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn((T, HQ, D), generator=g).to(torch.bfloat16)
    k = torch.randn((T, HKV, D), generator=g).to(torch.bfloat16)
    return q, k


def as_numpy(res: torch.Tensor) -> dict[str, np.ndarray]:
    return {name: res[i].numpy() for i, name in enumerate(METRICS)}


def padded(mask: np.ndarray, T: int) -> np.ndarray:
    out = np.zeros(T, dtype=bool)
    out[: min(T, len(mask))] = mask[:T]
    return out


def assert_same(got: np.ndarray, want: np.ndarray, name: str) -> None:
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{name}: NaN positions differ")
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0, equal_nan=True, err_msg=name)


# --- maps ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("T", [5, 130])
def test_maps_are_the_causal_softmax_with_kv_heads_shared_by_groups(T):
    q, k = qk(T)
    scale = SCALES["plain"]
    qn, kn = q.double().numpy(), k.double().numpy()
    kv_of = np.arange(HQ) // (HQ // HKV)
    logits = np.einsum("ihd,jhd->hij", qn, kn[:, kv_of]) * scale
    logits[:, np.triu(np.ones((T, T), dtype=bool), k=1)] = -np.inf
    want = np.exp(logits - logits.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    np.testing.assert_allclose(attention_maps(q, k, scale).numpy(), want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("T", [1, 5, 130])
@pytest.mark.parametrize("scale", SCALES.values(), ids=SCALES.keys())
def test_map_rows_sum_to_one(T, scale):
    maps = attention_maps(*qk(T), scale).double().numpy()
    np.testing.assert_allclose(maps.sum(-1), 1.0, atol=1e-5, rtol=0)


@pytest.mark.parametrize("T", [5, 130])
@pytest.mark.parametrize("scale", SCALES.values(), ids=SCALES.keys())
def test_map_upper_triangle_is_exactly_zero(T, scale):
    maps = attention_maps(*qk(T), scale).numpy()
    assert np.all(maps[:, np.triu(np.ones((T, T), dtype=bool), k=1)] == 0.0)


@pytest.mark.parametrize("T, N", SHAPES)
def test_maps_out_is_the_same_as_attention_maps(T, N):
    q, k = qk(T)
    out = torch.full((HQ, T, T), -1.0)
    attention_metrics(q, k, SCALES["plain"], N, maps_out=out)
    assert torch.equal(out, attention_maps(q, k, SCALES["plain"]))


# --- metrics against the NumPy reference ---------------------------------------------------------------

@pytest.mark.parametrize("T, N", SHAPES)
@pytest.mark.parametrize("scale", SCALES.values(), ids=SCALES.keys())
def test_text_metrics_match_the_numpy_reference(T, N, scale):
    q, k = qk(T, seed=T)
    got = as_numpy(attention_metrics(q, k, scale, N))
    want = per_row_metrics(attention_maps(q, k, scale).numpy(), N)
    for name, value in want.items():
        assert_same(got[name], value, name)


@pytest.mark.parametrize("T, N", SHAPES)
def test_vision_metrics_without_a_mask_are_all_nan(T, N):
    got = as_numpy(attention_metrics(*qk(T), SCALES["plain"], N))
    assert np.isnan(got["vision_share"]).all() and np.isnan(got["vision_share_norm"]).all()


@pytest.mark.parametrize("sink_tokens", [0, 1, 7])
def test_sink_metrics_follow_sink_tokens(sink_tokens):
    q, k = qk(130)
    got = as_numpy(attention_metrics(q, k, SCALES["plain"], 70, sink_tokens=sink_tokens))
    want = per_row_metrics(attention_maps(q, k, SCALES["plain"]).numpy(), 70, sink_tokens=sink_tokens)
    for name in ("sink_mass_first", "sink_mass_k"):
        assert_same(got[name], want[name], name)


@pytest.mark.parametrize("rows", [1, 7, 64, 200])
def test_metrics_do_not_depend_on_the_row_band(rows):
    q, k = qk(130)
    mask = torch.from_numpy(padded(vision_mask([(10, 20, None)]), 130))
    banded = attention_metrics(q, k, SCALES["plain"], 70, vision_mask=mask, rows=rows)
    want = attention_metrics(q, k, SCALES["plain"], 70, vision_mask=mask, rows=130)
    np.testing.assert_allclose(banded.numpy(), want.numpy(), atol=1e-6, rtol=0, equal_nan=True)


# --- vision --------------------------------------------------------------------------------------------

def test_vision_mask_merges_overlapping_ranges():
    mask = vision_mask([(2, 4, None), (4, 5, None), (20, 2, None)])
    want = np.zeros(22, dtype=bool)
    want[2:9] = want[20:22] = True
    np.testing.assert_array_equal(mask, want)


def test_vision_mask_keeps_only_is_embed_positions():
    mask = vision_mask([(3, 6, [True, True, False, True, False, True])])
    assert np.flatnonzero(mask).tolist() == [3, 4, 6, 8]


def test_vision_mask_refuses_is_embed_of_the_wrong_length():
    with pytest.raises(ValueError, match="is_embed"):
        vision_mask([(3, 6, [True, True, False])])


@pytest.mark.parametrize("scale", SCALES.values(), ids=SCALES.keys())
def test_vision_share_of_overlapping_ranges_matches_the_reference(scale):
    T, N = 130, 70
    q, k = qk(T, seed=3)
    mask = padded(vision_mask([(5, 40, None), (30, 50, None)]), T)  # 5..79, across a band and the prompt end
    got = as_numpy(attention_metrics(q, k, scale, N, vision_mask=torch.from_numpy(mask)))
    want_mask = np.zeros(T, dtype=bool)
    want_mask[5:80] = True
    want = per_row_metrics(attention_maps(q, k, scale).numpy(), N, vision=want_mask)
    for name in ("vision_share", "vision_share_norm"):
        assert_same(got[name], want[name], name)


def test_vision_share_leaves_out_positions_is_embed_marks_false():
    T, N = 12, 10
    q, k = qk(T, seed=4)
    mask = padded(vision_mask([(3, 6, [True, True, False, True, False, True])]), T)
    got = as_numpy(attention_metrics(q, k, SCALES["plain"], N, vision_mask=torch.from_numpy(mask)))
    maps = attention_maps(q, k, SCALES["plain"]).double().numpy()
    embeds = [3, 4, 6, 8]
    for i in range(T):
        seen = [j for j in embeds if j <= i]
        if not seen:
            assert np.isnan(got["vision_share"][:, i]).all() and np.isnan(got["vision_share_norm"][:, i]).all()
            continue
        share = maps[:, i, seen].sum(-1)
        np.testing.assert_allclose(got["vision_share"][:, i], share, atol=TOL, rtol=0)
        np.testing.assert_allclose(got["vision_share_norm"][:, i], share * (i + 1) / len(seen), atol=TOL, rtol=0)


# --- lookback ratio ------------------------------------------------------------------------------------

def test_lookback_ratio_is_nan_on_the_prompt_rows_and_defined_from_the_first_generated_row():
    T, N = 130, 70
    lookback = as_numpy(attention_metrics(*qk(T), SCALES["plain"], N))["lookback_ratio"]
    assert np.isnan(lookback[:, :N]).all()
    assert np.isfinite(lookback[:, N:]).all()
    assert ((lookback[:, N:] >= 0) & (lookback[:, N:] <= 1)).all()


# A hand-made causal map, one head, prompt N = 2, rows 2 and 3 generated (tokens y_1, y_2).
HAND_N = 2
HAND = np.array([[1.0, 0.0, 0.0, 0.0],
                 [0.5, 0.5, 0.0, 0.0],
                 [0.2, 0.4, 0.4, 0.0],
                 [0.1, 0.3, 0.2, 0.4]])
# Lookback Lens: ctx = mean over the prompt keys, new = mean over keys N..i (the query's own key included).
# Row 2: ctx (0.2 + 0.4) / 2 = 0.3, new 0.4 -> 3/7.  Row 3: ctx 0.2, new (0.2 + 0.4) / 2 = 0.3 -> 0.4.
# (Leaving the own key out, as store format 1 did, gave NaN on row 2 and 0.2 / (0.2 + 0.2) = 0.5 on row 3.)
HAND_LOOKBACK = [np.nan, np.nan, 3 / 7, 0.4]


def qk_of_map(A: np.ndarray, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 Q [T, 1, T], K [T, 1, T] whose causal softmax is ``A`` (rows summing to 1): K the identity,
    Q's row i the log-probabilities over keys 0..i, divided by the scale."""
    T = A.shape[0]
    k = torch.eye(T, dtype=torch.float32)[:, None, :]
    logq = np.where(np.tril(np.ones((T, T))) > 0, np.log(np.maximum(A, 1e-300)), 0.0) / scale
    return torch.from_numpy(logq.astype(np.float32))[:, None, :], k


def paper_lookback(A: np.ndarray, N: int) -> np.ndarray:
    """Lookback Lens's ratio as its reference code takes it at each generation step: the step's last attention
    row (the query), over the keys it sees (prompt and the new tokens so far, its own the last of them)."""
    T = A.shape[-1]
    out = np.full(A.shape[:-1], np.nan)
    for i in range(N, T):
        seen = A[..., i, : i + 1]
        on_context = seen[..., :N].mean(-1)
        on_new = seen[..., N:].mean(-1)
        out[..., i] = on_context / (on_context + on_new)
    return out


def test_lookback_ratio_of_a_hand_made_map_is_lookback_lens_value():
    np.testing.assert_allclose(paper_lookback(HAND, HAND_N), HAND_LOOKBACK, rtol=1e-12)
    np.testing.assert_allclose(per_row_metrics(HAND[None], HAND_N)["lookback_ratio"][0], HAND_LOOKBACK,
                               rtol=1e-12)
    scale = SCALES["plain"]
    q, k = qk_of_map(HAND, scale)
    np.testing.assert_allclose(attention_maps(q, k, scale)[0].numpy(), HAND, atol=1e-6)
    got = attention_metrics(q, k, scale, HAND_N)[METRICS.index("lookback_ratio"), 0].numpy()
    np.testing.assert_allclose(got, HAND_LOOKBACK, atol=1e-6)


@pytest.mark.parametrize("T,N", [(5, 3), (130, 70), (130, 64), (130, 63)])
def test_lookback_ratio_matches_lookback_lens_reference_code(T, N):
    q, k = qk(T)
    got = as_numpy(attention_metrics(q, k, SCALES["peaky"], N))["lookback_ratio"]
    want = paper_lookback(attention_maps(q, k, SCALES["peaky"]).double().numpy(), N)
    assert_same(got, want, "lookback_ratio")


@pytest.mark.parametrize("T", [1, 5, 130])
def test_lookback_ratio_of_a_prompt_only_request_is_all_nan(T):
    lookback = as_numpy(attention_metrics(*qk(T), SCALES["plain"], T))["lookback_ratio"]
    assert np.isnan(lookback).all()
