"""Stored maps are the model's own attention: real vLLM (CPU build, bf16) against HF eager float32, within a
stated factor of HF's own bf16 eager drift on the same tokens (tests/reference.py, ``Calibrated``).

One engine, vLLM's default serving features on: prefix caching (with a hit), chunked prefill
(max_num_batched_tokens=256 below the prompt lengths), 16 concurrent requests, GQA (9 q / 3 kv heads).
"""

import pytest
from reference import check_exact, check_reconstruction
from text import prose

from attn_otel.ids import new_span_id, new_trace_id

pytestmark = pytest.mark.engine

def _params(trace_id, max_tokens=8, **extra):
    from vllm import SamplingParams

    args = {"attn_otel": "maps", "traceparent": f"00-{trace_id}-{new_span_id()}-01", **extra}
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=args)


def _check_exact(engine, out, trace_id):
    """Maps against HF eager fp32, and maps x V against the CPU backend's own attention output."""
    import attn_otel

    figures = check_exact(engine.store, engine.model_path, out, trace_id, num_layers=30, num_heads=9)
    (cap,) = attn_otel.open_trace(trace_id, store=engine.store)
    figures["reconstruction"] = check_reconstruction(cap)
    return figures


@pytest.fixture(scope="module")
def long_and_prefix_hit(engine):
    """A 600-token prompt split by chunked prefill, then two requests sharing its first 300+ tokens: one
    without maps (it reads the cached prefix), one with maps (planned at arrival: it reads no cached block,
    so every query of it runs through the map tap)."""
    shared = prose(300, seed=1)
    first, second, third = new_trace_id(), new_trace_id(), new_trace_id()
    out1 = engine.generate([shared + " " + prose(300, seed=2)], _params(first))[0]
    out3 = engine.generate([shared + " " + prose(40, seed=6)], _params(third, attn_otel="metrics"))[0]
    out2 = engine.generate([shared + " " + prose(60, seed=5)], _params(second))[0]
    return (out1, first), (out2, second), (out3, third)


def test_chunked_prefill_maps_match_hf_eager(engine, long_and_prefix_hit):
    (out, trace_id), _, _ = long_and_prefix_hit
    assert len(out.prompt_token_ids) > 2 * 256  # three prefill chunks at max_num_batched_tokens=256
    print("per-row TV:", _check_exact(engine, out, trace_id))


def test_a_maps_request_behind_a_cached_prefix_recomputes_it_and_matches_hf_eager(engine, long_and_prefix_hit):
    _, (out, trace_id), (other, _) = long_and_prefix_hit
    assert other.num_cached_tokens >= 200  # the prefix is in the cache: a request without maps reads it
    assert not out.num_cached_tokens  # the maps request skipped reading it (attn_otel.arrival)
    print("per-row TV:", _check_exact(engine, out, trace_id))


def test_sixteen_concurrent_requests_of_different_lengths(engine):
    traces = [new_trace_id() for _ in range(16)]
    prompts = [prose(15 + 11 * i, seed=i) for i in range(16)]
    params = [_params(t, max_tokens=4 + i % 5) for i, t in enumerate(traces)]
    outs = engine.generate(prompts, params)
    lengths = {len(o.prompt_token_ids) for o in outs}
    assert len(lengths) == 16
    worst = {}
    for out, trace_id in zip(outs, traces):
        s = _check_exact(engine, out, trace_id)["tv"]
        for k in ("median", "p99", "max"):
            if worst.get(k) is None or s[k]["ratio"] > worst[k]["ratio"]:
                worst[k] = s[k]
    print("per-row TV, the request with the highest capture/drift ratio per statistic:", worst)
