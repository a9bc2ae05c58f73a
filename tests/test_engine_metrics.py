"""Device-computed metrics equal a plain NumPy computation from the stored maps of the same request.

Real SmolLM2 through vLLM's CPU build, prompts of 300+ tokens, chunked prefill and a shared prefix (which a
maps request recomputes rather than reads from the prefix cache: attn_otel.arrival).
Bounds are what half-precision maps allow: 2e-3 absolute for masses, shares, ratios and normalised
entropy, 1e-2 nats for entropy.
"""

import numpy as np
import pytest
from numpy_metrics import per_row_metrics
from text import prose

import attn_otel
from attn_otel.ids import new_span_id, new_trace_id
from attn_otel.metrics import summarize

pytestmark = pytest.mark.engine

TOL = {"entropy": 1e-2, "entropy_norm": 2e-3, "sink_mass_first": 2e-3, "sink_mass_k": 2e-3,
       "lookback_ratio": 2e-3}


@pytest.fixture(scope="module")
def captures(engine):
    from vllm import SamplingParams

    shared = prose(330, seed=7)
    caps = []
    for tail in (prose(120, seed=8), prose(40, seed=9)):  # the second shares the first's prefix
        trace = new_trace_id()
        sp = SamplingParams(max_tokens=24, temperature=0.0,
                            extra_args={"attn_otel": "maps", "traceparent": f"00-{trace}-{new_span_id()}-01"})
        out = engine.generate([shared + " " + tail], sp)[0]
        (cap,) = attn_otel.open_trace(trace, store=engine.store)
        caps.append((out, cap))
    assert not caps[1][0].num_cached_tokens  # planned for maps at arrival: the cached prefix is not read
    assert len(caps[0][0].prompt_token_ids) > 256  # chunked at max_num_batched_tokens=256
    return caps


@pytest.mark.parametrize("which", [0, 1], ids=["chunked-prefill", "shared-prefix"])
def test_per_row_metrics_equal_numpy_on_stored_maps(captures, which):
    _, cap = captures[which]
    maps = cap.maps()  # float32 from the stored float16
    stored = cap.metrics
    assert "vision_share" not in stored  # text-only: absent, not zero
    for li in range(len(cap.layers)):
        ref = per_row_metrics(maps[li].astype(np.float64), cap.prompt_len, sink_tokens=4)
        for name, tol in TOL.items():
            got, want = stored[name][li], ref[name]
            assert np.array_equal(np.isnan(got), np.isnan(want)), (name, li)
            ok = ~np.isnan(want)
            err = np.abs(got[ok] - want[ok]).max()
            assert err <= tol, (name, cap.layers[li], err)


def test_part_means_equal_numpy(captures):
    _, cap = captures[0]
    maps = cap.maps().astype(np.float64)
    s = summarize(cap.metrics, cap.prompt_len)
    N = cap.prompt_len
    for li in (0, 15, 29):
        ref = per_row_metrics(maps[li], N, sink_tokens=4)
        for part, rows in (("prompt", slice(0, N)), ("generated", slice(N, None))):
            for name, tol in TOL.items():
                if name == "lookback_ratio" and part == "prompt":
                    continue
                want = np.nanmean(ref[name][:, rows], axis=-1)
                got = np.asarray(s[part][name]["mean"])[li]
                assert np.allclose(got, want, atol=tol, equal_nan=True), (part, name, li)


def test_smollm2_has_real_attention_sinks(captures):
    """What the model does: later layers put much of their mass on token 0 (DESIGN.md: up to ~0.65)."""
    _, cap = captures[0]
    s = summarize(cap.metrics, cap.prompt_len)
    sink = np.asarray(s["prompt"]["sink_mass_first"]["layer_mean"])
    assert sink[15:].max() > 0.3 and sink.argmax() > 0
