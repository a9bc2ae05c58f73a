"""attn_otel.stats.interval_split: the engine loop's step intervals and attn-otel's time in each, split into the
slowest 1% and the rest, against NumPy on intervals made up here."""
import numpy as np
import pytest

from attn_otel.stats import interval_split


def test_the_slowest_percent_and_the_rest_are_numpys():
    rng = np.random.default_rng(5)
    iv = rng.lognormal(np.log(0.01), 0.4, 1234)
    own = rng.uniform(0.0, 0.002, iv.size)
    slowest = np.argsort(iv)[-12:]  # round(1% of 1234) = 12
    own[slowest] += 0.01  # attn-otel's time where the steps are slowest
    r = interval_split(zip(iv, own))
    rest = np.setdiff1d(np.arange(iv.size), slowest)
    assert r["n"] == iv.size and r["p99"] == pytest.approx(np.quantile(iv, 0.99), rel=1e-12)
    assert r["attn_share"] == pytest.approx(own.sum() / iv.sum(), rel=1e-12)
    assert r["slowest_1pct"] == {"n": 12, "interval_mean": pytest.approx(iv[slowest].mean(), rel=1e-12),
                                 "attn_mean": pytest.approx(own[slowest].mean(), rel=1e-12)}
    assert r["rest"]["n"] == iv.size - 12
    assert r["rest"]["interval_mean"] == pytest.approx(iv[rest].mean(), rel=1e-12)
    assert r["rest"]["attn_mean"] == pytest.approx(own[rest].mean(), rel=1e-12)
    assert r["slowest_1pct"]["attn_mean"] > 5 * r["rest"]["attn_mean"]


def test_few_or_no_intervals():
    assert interval_split([]) == {"n": 0}
    r = interval_split([(0.02, 0.001), (0.01, 0.0)])
    assert r["slowest_1pct"] == {"n": 1, "interval_mean": 0.02, "attn_mean": 0.001}
    assert r["rest"] == {"n": 1, "interval_mean": 0.01, "attn_mean": 0.0}


def test_an_interval_counts_only_where_the_loop_did_not_go_idle():
    """vllm_adapter._step_interval on the scheduler outputs' fields it reads (the real engine's in
    tests/test_engine_stream.py): a step that runs no request of the step before it follows an idle wait (the
    last request of a burst finished), and its interval is left out, as is one after a step without tokens."""
    from types import SimpleNamespace as NS

    from attn_otel.stats import Stats
    from attn_otel.vllm_adapter import _step_interval

    eng = NS(stats=Stats(), step_start=None, step_own=0.0, step_ran=False)

    def step(t, tokens, cached, own=0.0):
        _step_interval(eng, NS(total_num_scheduled_tokens=tokens, scheduled_cached_reqs=NS(req_ids=cached)), t)
        eng.step_own += own

    step(0.00, 64, [])            # a burst's first step: new requests only, nothing before it
    step(0.02, 2, ["a", "b"], 0.001)  # counted: 20 ms, attn-otel's 0 ms of the step before
    step(0.05, 1, ["b"])          # counted: 30 ms with the 1 ms above
    step(9.05, 32, [])            # after 9 s idle: only new requests run, left out
    step(9.07, 0, ["c"])          # counted (the step before ran tokens), but it runs none itself
    step(9.08, 3, ["c"])          # left out: the step before had no tokens
    got = list(eng.stats.step_intervals)
    assert [round(iv, 6) for iv, _ in got] == [0.02, 0.03, 0.02] and [own for _, own in got] == [0.0, 0.001, 0.0]
