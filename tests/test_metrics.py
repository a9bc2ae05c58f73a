import json
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
from synthetic import make_record, write

from attn_otel.metrics import summarize, to_json
from attn_otel.reader import open_trace

NAN = np.nan
PROMPT_KEYS = {"entropy", "entropy_norm", "sink_mass_first", "sink_mass_k", "vision_share", "vision_share_norm",
               "learned_sink_mass"}
# One layer, two heads, four rows; prompt_len 2: rows 0-1 are the prompt, rows 2-3 generated.
ENTROPY = np.array([[[1.0, 2.0, 3.0, 5.0],
                     [NAN, 4.0, NAN, NAN]]])


def strict_loads(text: str):
    def refuse(name):
        raise AssertionError(f"{name} in JSON output")

    return json.loads(text, parse_constant=refuse)


def fake_capture(per_row, prompt_len, layers=(0,)):
    return SimpleNamespace(trace_id="t" * 32, request_id="r", layers=list(layers), metrics=per_row,
                           prompt_len=prompt_len)


# --- summarize -----------------------------------------------------------------------------------------

def test_prompt_and_generated_rows_are_averaged_apart():
    s = summarize({"entropy": ENTROPY}, prompt_len=2)
    np.testing.assert_array_equal(s["prompt"]["entropy"]["mean"], [[1.5, 4.0]])
    np.testing.assert_array_equal(s["generated"]["entropy"]["mean"], [[4.0, NAN]])


def test_layer_mean_is_the_mean_of_the_defined_head_means():
    s = summarize({"entropy": ENTROPY}, prompt_len=2)
    np.testing.assert_array_equal(s["prompt"]["entropy"]["layer_mean"], [2.75])
    np.testing.assert_array_equal(s["generated"]["entropy"]["layer_mean"], [4.0])


def test_quantiles_are_over_the_defined_rows_of_each_head():
    s = summarize({"entropy": ENTROPY}, prompt_len=2)["generated"]["entropy"]
    np.testing.assert_allclose([s["p10"][0, 0], s["p50"][0, 0], s["p90"][0, 0]], [3.2, 4.0, 4.8])
    assert np.isnan([s["p10"][0, 1], s["p50"][0, 1], s["p90"][0, 1]]).all()


def test_a_part_without_rows_is_nan_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = summarize({"entropy": ENTROPY}, prompt_len=4)["generated"]["entropy"]
    assert all(np.isnan(s[key]).all() for key in ("mean", "layer_mean", "p10", "p50", "p90"))


def test_a_head_without_defined_rows_is_nan_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = summarize({"entropy": ENTROPY}, prompt_len=2)["generated"]["entropy"]
    assert all(np.isnan(s[key][0, 1]) for key in ("mean", "p10", "p50", "p90"))


def test_lookback_ratio_is_summarised_over_generated_rows_only():
    # defined from the first generated row on (row 2 = prompt_len): Lookback Lens counts the row's own key
    s = summarize({"entropy": ENTROPY, "lookback_ratio": np.array([[[NAN, NAN, 0.5, 0.25]] * 2])}, prompt_len=2)
    assert "lookback_ratio" not in s["prompt"]
    np.testing.assert_array_equal(s["generated"]["lookback_ratio"]["mean"], [[0.375, 0.375]])


def test_vision_metrics_of_a_text_only_capture_are_none():
    s = summarize({"entropy": ENTROPY}, prompt_len=2)
    for part in ("prompt", "generated"):
        assert s[part]["vision_share"] is None and s[part]["vision_share_norm"] is None


def test_metrics_of_a_synthetic_capture_are_nan_means_of_its_rows():
    record, _ = make_record(layers=(0, 3), heads=3, T=12, prompt_len=8, vision=np.arange(12) % 3 == 1)
    s = summarize(record.metrics, record.prompt_len)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for name, rows in record.metrics.items():
            for part, sl in (("prompt", slice(0, 8)), ("generated", slice(8, 12))):
                if name == "lookback_ratio" and part == "prompt":
                    continue
                np.testing.assert_allclose(s[part][name]["mean"], np.nanmean(rows[..., sl], axis=-1), rtol=1e-6)


def test_per_head_arrays_are_refused():
    with pytest.raises(ValueError, match="expected \\[layers, heads, tokens\\]"):
        summarize({"entropy": np.ones((2, 3))}, prompt_len=1)


def test_prompt_len_past_the_rows_is_refused():
    with pytest.raises(ValueError, match="prompt_len 5"):
        summarize({"entropy": ENTROPY}, prompt_len=5)


# --- to_json -------------------------------------------------------------------------------------------

def test_json_has_exactly_the_documented_keys():
    doc = to_json(fake_capture({"entropy": ENTROPY}, 2))
    assert set(doc) == {"trace_id", "request_id", "layers", "prompt", "generated"}
    assert set(doc["prompt"]) == PROMPT_KEYS
    assert set(doc["generated"]) == PROMPT_KEYS | {"lookback_ratio"}


def test_json_values_are_layer_by_head_lists_of_means():
    record, _ = make_record(layers=(0, 3, 7), heads=2, T=12, prompt_len=8)
    doc = to_json(fake_capture(record.metrics, 8, record.layers))
    assert doc["layers"] == [0, 3, 7]
    mean = summarize(record.metrics, 8)["generated"]["sink_mass_k"]["mean"]
    assert doc["generated"]["sink_mass_k"] == mean.tolist()
    assert [len(layer) for layer in doc["prompt"]["entropy"]] == [2, 2, 2]


def test_json_vision_of_a_text_only_capture_is_null():
    record, _ = make_record(T=12, prompt_len=8)
    doc = to_json(fake_capture(record.metrics, 8, record.layers))
    assert doc["prompt"]["vision_share"] is None and doc["generated"]["vision_share_norm"] is None


def test_json_vision_of_an_image_capture_is_a_matrix():
    record, _ = make_record(layers=(0, 3), heads=2, T=12, prompt_len=8, vision=np.arange(12) < 5)
    doc = to_json(fake_capture(record.metrics, 8, record.layers))
    assert all(isinstance(x, float) for layer in doc["prompt"]["vision_share_norm"] for x in layer)


def test_json_undefined_means_are_null():
    doc = to_json(fake_capture({"entropy": ENTROPY}, 2))
    assert doc["generated"]["entropy"] == [[4.0, None]]


def test_json_never_holds_nan():
    record, _ = make_record(T=6, prompt_len=6)  # prompt-only: nothing generated, rows 0-3 have no sink mass
    text = json.dumps(to_json(fake_capture(record.metrics, 6, record.layers)))
    doc = strict_loads(text)
    assert doc["generated"]["lookback_ratio"] == [[None, None], [None, None]]


# --- the reader ----------------------------------------------------------------------------------------

def test_capture_summary_summarises_the_stored_metrics(tmp_path):
    record, _ = make_record(layers=(0, 3), heads=2, T=12, prompt_len=8)
    write(tmp_path, record)
    (cap,) = open_trace(record.trace_id, tmp_path)
    got = cap.summary()
    want = summarize(record.metrics, 8)
    for part in want:
        for name, stats in want[part].items():
            if stats is None:
                assert got[part][name] is None
            else:
                np.testing.assert_array_equal(got[part][name]["mean"], stats["mean"])
