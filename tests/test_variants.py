"""The torch reference's attention terms (soft-cap, sliding window, sinks) against a direct NumPy computation
of each formula on random Q/K, and the metrics' meaning under them (attn_otel.attention's docstring)."""

import math

import attn_otel

import numpy as np
import pytest
import torch

from attn_otel.attention import METRICS, attention_maps, attention_metrics
from attn_otel.metrics import summarize
from attn_otel.tap import LayerSpec

HQ, HKV, D = 4, 2, 32
SCALE = 3 / math.sqrt(D)  # peaky logits, so that a soft-cap of 5 bites


def qk(T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn((T, HQ, D), generator=g).to(torch.bfloat16),
            torch.randn((T, HKV, D), generator=g).to(torch.bfloat16))


def numpy_maps(q, k, scale, soft_cap=0.0, window=0, sinks=None, chunk=0):
    """p_ij = exp(l_ij) / (exp(s_h) + sum_{visible j} exp(l_ij)), l = cap * tanh(q.k * scale / cap)."""
    qn, kn = q.double().numpy(), k.double().numpy()
    T = qn.shape[0]
    kv_of = np.arange(HQ) // (HQ // HKV)
    logits = np.einsum("ihd,jhd->hij", qn, kn[:, kv_of]) * scale
    if soft_cap:
        logits = soft_cap * np.tanh(logits / soft_cap)
    i, j = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
    visible = (j <= i) & ((i - j < window) if window else True) & ((j >= i // chunk * chunk) if chunk else True)
    out = np.zeros_like(logits)
    for h in range(HQ):
        for r in range(T):
            l = logits[h, r, visible[r]]
            m = l.max() if sinks is None else max(l.max(), sinks[h])
            e = np.exp(l - m)
            den = e.sum() + (0.0 if sinks is None else np.exp(sinks[h] - m))
            out[h, r, visible[r]] = e / den
    return out


SINKS = np.array([0.5, 3.0, -1.0, 6.0])
CASES = {
    "softcap": dict(soft_cap=5.0),
    "window": dict(window=16),
    "sinks": dict(sinks=SINKS),
    "all": dict(soft_cap=5.0, window=16, sinks=SINKS),
    "chunk": dict(chunk=32),  # Llama 4's chunked local attention
    "chunk+window": dict(chunk=32, window=20),
}


def torch_terms(terms):
    t = dict(terms)
    if "sinks" in t:
        t["sinks"] = torch.tensor(t["sinks"], dtype=torch.float32)
    return t


@pytest.mark.parametrize("case", CASES, ids=CASES.keys())
@pytest.mark.parametrize("T", [5, 80, 130])
def test_maps_apply_the_terms_as_the_formula_says(case, T):
    q, k = qk(T)
    want = numpy_maps(q, k, SCALE, **CASES[case])
    got = attention_maps(q, k, SCALE, rows=64, **torch_terms(CASES[case])).double().numpy()
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)
    if "sinks" in CASES[case]:
        assert got.sum(-1).max() <= 1 + 1e-6 and got.sum(-1).min() < 0.9  # the sink takes its share
    else:
        np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-5)


def numpy_metrics(maps, N, W, k=4, C=0, sinks=None):
    """The metrics by hand under a window W and chunks of C (0: none), per the docstring of attention_metrics;
    with ``sinks``, the learned sink mass as what the sink leaves of each row (1 - its sum)."""
    H, T, _ = maps.shape
    out = {m: np.full((H, T), np.nan) for m in METRICS}
    if sinks is not None:
        out["learned_sink_mass"] = 1 - maps.sum(-1)
    for i in range(T):
        lo = max(0, i - W + 1) if W else 0
        lo = max(lo, i // C * C) if C else lo
        n = i + 1 - lo
        p = maps[:, i]
        ent = -np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0).sum(-1)
        out["entropy"][:, i] = ent
        if n > 1:
            out["entropy_norm"][:, i] = ent / math.log(n)
        if i >= k and lo == 0:
            out["sink_mass_first"][:, i] = p[:, 0]
        if i >= k and lo < k:
            out["sink_mass_k"][:, i] = p[:, :k].sum(-1)
        if i >= N and N - lo > 0:
            ctx = p[:, lo:N].sum(-1) / (N - lo)
            new = p[:, max(lo, N):i + 1].sum(-1) / (i + 1 - max(lo, N))
            out["lookback_ratio"][:, i] = ctx / (ctx + new)
    return out


@pytest.mark.parametrize("case", CASES, ids=CASES.keys())
def test_metrics_under_the_terms(case):
    T, N = 100, 60
    q, k = qk(T, seed=1)
    terms = CASES[case]
    maps = numpy_maps(q, k, SCALE, **terms)
    want = numpy_metrics(maps, N, terms.get("window", 0), C=terms.get("chunk", 0), sinks=terms.get("sinks"))
    got = attention_metrics(q, k, SCALE, N, rows=64, **torch_terms(terms)).numpy()
    for mi, name in enumerate(METRICS[:4] + METRICS[6:]):
        g = got[METRICS.index(name)]
        np.testing.assert_array_equal(np.isnan(g), np.isnan(want[name]), err_msg=name)
        np.testing.assert_allclose(g, want[name], atol=2e-5, rtol=0, equal_nan=True, err_msg=name)


def test_windowed_rows_far_from_the_start_have_no_sink_mass_and_lookback_only_while_the_prompt_is_visible():
    T, N, W = 80, 40, 16
    got = attention_metrics(*qk(T), SCALE, N, window=W).numpy()
    first, k_mass, lookback = (got[METRICS.index(m)] for m in ("sink_mass_first", "sink_mass_k", "lookback_ratio"))
    assert np.isfinite(first[:, 4:W]).all() and np.isnan(first[:, W:]).all()
    assert np.isfinite(k_mass[:, 4:W + 3]).all() and np.isnan(k_mass[:, W + 3:]).all()
    assert np.isfinite(lookback[:, N:N + W - 1]).all() and np.isnan(lookback[:, N + W - 1:]).all()


def test_vision_share_counts_visible_image_keys_only():
    T, W = 60, 8
    q, k = qk(T)
    vm = torch.zeros(T, dtype=torch.bool)
    vm[2:10] = True
    got = attention_metrics(q, k, SCALE, T, vision_mask=vm, window=W).numpy()
    maps = numpy_maps(q, k, SCALE, window=W)
    share = got[METRICS.index("vision_share")]
    norm = got[METRICS.index("vision_share_norm")]
    for i in range(T):
        lo = max(0, i - W + 1)
        cnt = int(vm[lo:i + 1].sum())
        if cnt == 0:
            assert np.isnan(share[:, i]).all() and np.isnan(norm[:, i]).all()
        else:
            want = maps[:, i, 2:10].sum(-1)
            np.testing.assert_allclose(share[:, i], want, atol=2e-6)
            np.testing.assert_allclose(norm[:, i], want / (cnt / (i + 1 - lo)), atol=2e-5)


def test_a_layer_spec_is_plain_only_without_terms_and_stays_hashable():
    base = dict(index=0, name="l0", num_heads=HQ, num_kv_heads=HKV, head_dim=D, scale=SCALE)
    assert LayerSpec(**base).plain
    for extra in (dict(soft_cap=30.0), dict(window=16), dict(sinks=(0.0,) * HQ), dict(chunk=32)):
        spec = LayerSpec(**base, **extra)
        assert not spec.plain
        assert spec.local == ("window" in extra or "chunk" in extra)  # kept out of the stream, Q/K tapped
        hash(spec)
    t = LayerSpec(**base, sinks=(1.0, 2.0, 3.0, 4.0)).terms("cpu")
    assert t["sinks"].tolist() == [1.0, 2.0, 3.0, 4.0] and t["window"] == 0 and t["soft_cap"] == 0.0


# --- which slots index a windowed layer's tap (vllm_adapter._window_groups; no engine) -----------------

class _Spec:
    def __init__(self, block_size):
        self.block_size = block_size


class FullAttentionSpec(_Spec):
    pass


class SlidingWindowSpec(_Spec):
    pass


class _Group:
    def __init__(self, spec, names):
        self.kv_cache_spec, self.layer_names = spec, names


class _Config:
    def __init__(self, *groups):
        self.kv_cache_groups = list(groups)


def _spec(i, group, window):
    return LayerSpec(index=i, name=f"model.layers.{i}.attn", num_heads=HQ, num_kv_heads=HKV, head_dim=D,
                     scale=SCALE, group=group, window=window)


def test_windowed_layers_of_a_hybrid_model_tap_by_the_full_attention_groups_slots():
    from attn_otel.vllm_adapter import _window_groups

    cfg = _Config(_Group(SlidingWindowSpec(16), ["model.layers.0.attn", "model.layers.2.attn"]),
                  _Group(FullAttentionSpec(16), ["model.layers.1.attn", "model.layers.3.attn"]))
    specs = [_spec(0, 0, 16), _spec(1, 1, 0), _spec(2, 0, 16), _spec(3, 1, 0)]
    kept, refused = _window_groups(specs, cfg)
    assert not refused
    assert [(s.group, s.slots_from) for s in kept] == [(1, "model.layers.1.attn"), (1, ""),
                                                        (1, "model.layers.1.attn"), (1, "")]


def test_windowed_layers_in_a_full_attention_group_keep_their_own_slots():
    from attn_otel.vllm_adapter import _window_groups

    # the hybrid KV-cache manager off: vLLM promotes window layers to full attention (no block is freed)
    cfg = _Config(_Group(FullAttentionSpec(16), [f"model.layers.{i}.attn" for i in range(2)]))
    kept, refused = _window_groups([_spec(0, 0, 16), _spec(1, 0, 0)], cfg)
    assert not refused and [s.slots_from for s in kept] == ["", ""]


def test_a_window_without_a_full_attention_group_taps_by_attn_otels_own_block_table():
    from attn_otel.vllm_adapter import SHADOW, _window_groups

    cfg = _Config(_Group(SlidingWindowSpec(16), [f"model.layers.{i}.attn" for i in range(2)]))
    kept, refused = _window_groups([_spec(0, 0, 16), _spec(1, 0, 16)], cfg)
    assert not refused
    # one group past vLLM's (attn_otel.shadow's), the layers' own group kept to map the forward's slots
    assert [(s.group, s.own_group, s.slots_from) for s in kept] == [(1, 0, SHADOW), (1, 0, SHADOW)]


def test_windowed_groups_of_two_block_sizes_without_a_full_group_keep_the_first():
    from attn_otel.vllm_adapter import _window_groups

    cfg = _Config(_Group(SlidingWindowSpec(16), ["model.layers.0.attn"]), _Group(SlidingWindowSpec(32), ["model.layers.1.attn"]))
    kept, refused = _window_groups([_spec(0, 0, 16), _spec(1, 1, 8)], cfg)
    assert [s.index for s in kept] == [0]
    assert refused == ["model.layers.1.attn (a windowed KV-cache group of block size 32 beside another of 16, "
                       "with no full-attention group)"]


def test_attn_otels_own_block_table_gives_every_position_a_slot_and_maps_vllms_slots_to_them():
    """attn_otel.shadow without an engine: a request's positions get slots of their own in blocks of the window
    group's size, vLLM's slots of this step map to them (padding -1 stays -1), a request that does not fit is
    lost rather than given another's slots, and released blocks are reused."""
    from types import SimpleNamespace as NS

    import torch

    from attn_otel.shadow import ShadowBlocks

    sh = ShadowBlocks(group=1, num_slots=64, block_size=16, vllm_slots={0: 64}, device="cpu")
    a = NS(block_ids=[[3, 0]])  # vLLM's window group: block 3, then the null block once freed
    b = NS(block_ids=[[1]])
    sh.schedule([("a", a, 0, 20), ("b", b, 0, 10)])
    assert a.block_ids[1] == [0, 1] and b.block_ids[1] == [2]  # appended as group 1
    got = sh.map(torch.tensor([48, 49, 16, -1]), 0)  # a's positions 0, 1; b's position 0; padding
    assert got.tolist() == [0, 1, 32, -1]
    sh.schedule([("a", a, 20, 1)])  # decode: a's position 20 was written to vLLM slot 0*16 + 4 (block 0)
    assert sh.map(torch.tensor([4]), 0).tolist() == [20]
    c = NS(block_ids=[[2, 2, 2]])
    sh.schedule([("c", c, 0, 40)])  # needs 3 blocks, 1 is free: lost, its slots write nothing
    assert "c" in sh.lost and sh.map(torch.tensor([32]), 0).tolist() == [-1]
    sh.release(["a", "c"])
    assert "c" not in sh.lost and sh.free_blocks() == 3
    d = NS(block_ids=[[1, 2, 3]])
    sh.schedule([("d", d, 0, 40)])
    assert d.block_ids[1] == [0, 1, 3] and sh.map(torch.tensor([16, 47, 48]), 0).tolist() == [0, 31, 48]


def test_the_window_is_read_in_each_backends_convention():
    from types import SimpleNamespace as NS

    from attn_otel.vllm_adapter import _refusal, _terms, _window

    assert _window(NS(sliding_window=16)) == 16  # CPU_ATTN: W as given
    assert _window(NS(sliding_window=(15, 0))) == 16  # FLASH_ATTN & co: (W - 1, 0)
    assert _window(NS(sliding_window=-1)) == 0 and _window(NS(sliding_window=(-1, -1))) == 0
    assert _window(NS(sliding_window=None)) == 0
    assert _refusal(NS(impl=NS(attn_type="decoder", sliding_window=(15, 3), alibi_slopes=None))) is not None
    assert _refusal(NS(impl=NS(attn_type="decoder", sliding_window=None, alibi_slopes=None),
                       attention_chunk_size=8192)) is None  # Llama 4's chunks: captured, LayerSpec.chunk
    assert _refusal(NS(impl=NS(attn_type="decoder", sliding_window=16, alibi_slopes=None, sinks=None,
                               logits_soft_cap=30.0))) is None  # captured now, with its terms
    impl = NS(num_heads=4, logits_soft_cap=30.0, sliding_window=-1, sinks=torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert _terms(impl) == dict(soft_cap=30.0, window=0, sinks=(1.0, 2.0, 3.0, 4.0))


# --- routing: layers with terms take the Triton paths too (capture engine, no vLLM) -------------------------

def _capture_engine(tmp_path, **cfg):
    from attn_otel.capture import CaptureEngine
    from attn_otel.config import Config

    plain = LayerSpec(index=0, name="l0", num_heads=HQ, num_kv_heads=HKV, head_dim=D, scale=SCALE)
    variant = LayerSpec(index=1, name="l1", num_heads=HQ, num_kv_heads=HKV, head_dim=D, scale=SCALE,
                        soft_cap=5.0, window=16, sinks=tuple(SINKS.tolist()))
    cfg.setdefault("row_metrics", "all")
    eng = CaptureEngine(Config(store=str(tmp_path / "store"), **cfg), [plain, variant], 256,
                        torch.float32, "cpu")
    g = torch.Generator().manual_seed(3)
    for i in (0, 1):
        eng.tap.write(i, torch.randn(200, HQ * D, generator=g), torch.randn(200, HKV * D, generator=g),
                      torch.arange(200))
    return eng


def _finished(T, layers="all", mode="metrics"):
    from attn_otel.ids import new_span_id, new_trace_id
    from attn_otel.tracking import FinishedRequest

    trace = new_trace_id()
    extra = {"attn_otel": mode, "attn_otel_layers": layers, "traceparent": f"00-{trace}-{new_span_id()}-01"}
    return trace, FinishedRequest(f"r{T}-{layers}", list(range(T - 2)), [7, 8], T, [list(range(16))], [16], extra)


def test_captures_with_a_variant_layer_take_the_gpu_batched_path(tmp_path):
    """The Triton kernels have every term (tests/test_triton_terms.py): metrics-only captures of a variant layer
    are batched and summarised on the device like a plain layer's; maps still go to the compute thread."""
    eng = _capture_engine(tmp_path, row_metrics="maps")  # metrics-only rows summarised where they are
    eng._fused, eng.planner.summarised_on_device = True, True  # as on a GPU with Triton
    batched, computed = [], []
    eng.batched.admit = lambda plan: True
    eng.batched.run = lambda batch: batched.extend(batch)
    eng.compute.submit = lambda plan: computed.append(plan)
    eng.on_finished_many([_finished(50, "0")[1], _finished(60, "all")[1], _finished(70, "1")[1],
                          _finished(80, "all", mode="maps")[1]])
    assert [p.T for p in batched] == [50, 60, 70] and all(p.summarised for p in batched)
    assert [p.T for p in computed] == [80] and computed[0].want_maps and not computed[0].summarised
    for plan in batched + computed:  # what the intercepted paths would have given back (else close waits 30 s)
        eng.handoff.release(plan.nbytes)
    eng.close()


def test_the_compute_thread_applies_a_variant_layers_terms(tmp_path):
    eng = _capture_engine(tmp_path)
    trace, req = _finished(100, "all", mode="maps")
    eng.on_finished(req)
    assert eng.flush(60)
    (cap,) = attn_otel.open_trace(trace, store=tmp_path / "store")
    q, k = eng.tap.q[1][:100], eng.tap.k[1][:100]
    terms = dict(soft_cap=5.0, window=16, sinks=torch.tensor(SINKS, dtype=torch.float32))
    want_maps = attention_maps(q, k, SCALE, **terms).numpy()
    np.testing.assert_allclose(cap.maps()[1], want_maps, atol=1e-3)  # stored in float16
    want = attention_metrics(q, k, SCALE, 98, **terms).numpy()
    for mi, name in enumerate(METRICS):
        if name not in cap.metrics:  # vision share: text only
            continue
        np.testing.assert_allclose(cap.metrics[name][1], want[mi], atol=1e-5, equal_nan=True, err_msg=name)
    assert np.isnan(cap.metrics["sink_mass_first"][1][:, 16:]).all()  # the window layer
    assert np.isfinite(cap.metrics["sink_mass_first"][0][:, 16:]).all()  # the plain one
    sink = cap.metrics["learned_sink_mass"]  # stored: a layer has learned sinks; NaN on the plain layer
    assert np.isnan(sink[0]).all() and np.isfinite(sink[1]).all()
    np.testing.assert_allclose(sink[1], 1 - want_maps.sum(-1), atol=1e-5)
    summary = summarize(cap.metrics, cap.prompt_len)["prompt"]["learned_sink_mass"]
    assert np.isnan(summary["layer_mean"][0]) and 0 < summary["layer_mean"][1] < 1
    eng.close()


def test_the_verify_check_multiplies_float32_probabilities_not_the_float16_maps():
    """A head whose learned sink takes all but ~1e-13 of each row (gpt-oss's first tokens come close): the
    float16 maps underflow to 0, so maps x V would read 0 against an output of that tiny size (error 1.0);
    the check on each band's float32 probabilities reproduces the output."""
    from attn_otel.attention import reconstruction_error

    T = 40
    q, k = qk(T, seed=5)
    v = torch.randn((T, HKV, D), generator=torch.Generator().manual_seed(6))
    sinks = torch.tensor([30.0, 0.0, 0.0, 0.0])  # head 0: exp(30) against logits of a few units
    maps = attention_maps(q, k, SCALE, sinks=sinks)  # float32, the reference
    out = torch.einsum("htj,jhd->thd", maps, v[:, torch.arange(HQ) // (HQ // HKV)])  # [T, Hq, D]
    stored = attention_maps(q, k, SCALE, sinks=sinks).to(torch.float16)
    assert stored[0].abs().max() == 0 and out[:, 0].norm(dim=-1).max() > 0  # underflowed, yet not zero
    assert reconstruction_error(stored, v, 1.0, out).view(HQ, T)[0].median() == 1.0
    errors = []
    attention_metrics(q, k, SCALE, T, rows=16, sinks=sinks,
                      on_band=lambda r0, r1, p: errors.append(reconstruction_error(p, v, 1.0, out[r0:r1])))
    err = torch.cat(errors)
    assert err.numel() == HQ * T and err.max() < 1e-4


@pytest.mark.parametrize("terms", [dict(window=16), dict(chunk=24), dict(window=16, chunk=24),
                                   dict(window=16, soft_cap=5.0, sinks=True)])
def test_the_numpy_reference_and_the_torch_metrics_agree_under_windows_chunks_and_sinks(terms):
    """tests/numpy_metrics.py (row by row from the definitions, on the maps) and attention_metrics (banded
    torch) agree, visible-key counts, NaN rules and lookback means included: the engine tests use the first as
    the reference for captures of windowed, chunked and sink layers."""
    from numpy_metrics import per_row_metrics

    g = torch.Generator().manual_seed(5)
    T, N = 90, 40
    q, k = torch.randn(T, HQ, D, generator=g), torch.randn(T, HKV, D, generator=g)
    t = dict(terms)
    if t.pop("sinks", False):
        t["sinks"] = torch.tensor(SINKS, dtype=torch.float32)
    maps = attention_maps(q, k, SCALE, **t).numpy()
    got = attention_metrics(q, k, SCALE, N, **t).numpy()
    want = per_row_metrics(maps, N, window=terms.get("window", 0), chunk=terms.get("chunk", 0))
    for name, rows in want.items():
        np.testing.assert_allclose(got[METRICS.index(name)], rows, atol=2e-5, equal_nan=True, err_msg=name)
    assert np.isnan(want["sink_mass_first"][:, 20:]).all() or "window" not in terms  # the first key out of view


def test_the_kv_budget_streams_windowed_layers_with_a_k_tap_and_taps_all_window_models():
    """attn_otel.tap.kv_budget (the engine's sizing, before the KV-cache groups are known): a windowed layer
    beside full ones is streamed and pays a K-only tap per token besides its metric rows; a model whose every
    layer has a window will tap Q and K by attn-otel's own table, and pays that."""
    from attn_otel.spill import spill_bytes
    from attn_otel.stream import MetricsStream
    from attn_otel.tap import QKTap, kv_budget

    base = dict(num_heads=HQ, num_kv_heads=HKV, head_dim=D, scale=SCALE)
    full = LayerSpec(index=0, name="l0", **base)
    win = LayerSpec(index=1, name="l1", window=16, **base)
    kv, avail, dt = 2 * 2 * HKV * D * 2, 2 ** 30, torch.bfloat16
    b = kv_budget(avail, kv, [full, win], (), [full, win], True, 64, dt, False, 128)
    scaled, tap, fixed, tapped, streamed, mapped = b.kv_bytes, b.per_token, b.fixed, b.tapped, b.streamed, b.mapped
    assert tapped == [] and streamed == [full, win] and mapped == []
    rows = 4 * HQ * 2  # entropy, two sink masses, lookback: float16
    assert tap == 2 * rows + 8 + HKV * D * 2  # the windowed layer's keys are tapped, the full one's read
    assert fixed == MetricsStream.ring_bytes([full, win], 64, dt) + spill_bytes([full, win], 16)  # ring, spill blocks
    assert scaled == int((avail - fixed) * kv / (kv + tap)) and b.local_streamed
    # a ring that takes most of the budget: the windowed layer keeps the Q/K tap (a map layer) instead
    big = kv_budget(avail, kv, [full, win], (), [full, win], True, 1 << 20, dt, False, 128)
    assert not big.local_streamed and big.streamed == [full] and big.tapped == [win] and big.mapped == []
    big_fixed = MetricsStream.ring_bytes([full, win], 1 << 20, dt) + spill_bytes([full, win], 16)
    assert big.kv_bytes > int((avail - big_fixed) * kv / (kv + tap))
    win0 = LayerSpec(index=0, name="l0", window=16, **base)
    b = kv_budget(avail, kv, [win0, win], (), [win0, win], True, 64, dt, False, 128)
    scaled, tap, fixed, tapped, streamed, mapped = b.kv_bytes, b.per_token, b.fixed, b.tapped, b.streamed, b.mapped
    assert streamed == [] and tapped == [win0, win] and fixed == 0
    assert tap == QKTap.bytes_per_token([win0, win], dt)
