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
