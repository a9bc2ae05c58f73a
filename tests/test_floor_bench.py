"""bench/floor.py: the metric kernel's work on the benchmark's workloads, counted exactly, and the floors it sets."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import floor  # noqa: E402
import workloads  # noqa: E402


def test_the_half_ring_is_the_streams_own():
    from attn_otel.stream import DEFAULT_ROWS

    assert floor.RING_HALF * 2 == DEFAULT_ROWS


def test_the_fixed_workloads_work_is_the_closed_form():
    got = floor.count("512+256")
    hq, kv_row = 32, 8 * 128 * 2
    assert got["prompt_evaluations"] == 256 * (512 * 513 // 2) * hq
    assert got["decode_evaluations"] == 256 * sum(512 + j + 1 for j in range(255)) * hq  # the last token: no row
    assert got["tokens_computed"] == 256 * (512 + 255) and got["tokens_sampled"] == 256 * 256
    # 256 requests share the half ring's 4,096 rows: each one's keys read every 16 of its generated rows
    assert got["decode_key_bytes"] == 256 * sum(512 + min(255, 16 * (f + 1)) for f in range(16)) * kv_row


def test_a_cached_system_prompt_is_scored_once():
    got = floor.count("mixed")
    reqs = workloads.requests("mixed", 0)
    systems = workloads.system_prompts()
    behind = [i for p, _ in reqs for i, s in enumerate(systems) if p[:1000] == s]
    assert len(behind) == 192 and len(set(behind)) == 4  # half of the requests, behind all four
    computed = sum(len(p) + o - 1 for p, o in reqs) - (len(behind) - 4) * 992  # 62 whole blocks a later hit
    assert got["tokens_computed"] == computed


def test_the_floors_order_and_the_measured_figures_ride_along(tmp_path):
    import json

    (tmp_path / "phase-off.json").write_text(json.dumps({"runs": {"512+256": {"wall_s": 6.5}}}))
    (tmp_path / "overhead.json").write_text(json.dumps({"workloads": {"512+256": {"ratios": {"default": 0.98}}}}))
    out = floor.main(["--bench", str(tmp_path), "--out", str(tmp_path / "floor.json")])
    for name, f in out["workloads"].items():
        assert 0 < f["all_layers"]["at_model_efficiency"] < f["default"]["at_model_efficiency"] < 1, name
        # the metric kernel does half the attention's FLOPs on every captured layer
        assert f["metric_flops_per_layer"] * 2 == f["attention_flops_per_layer"]
    f = out["workloads"]["512+256"]
    assert f["measured"]["ratios"] == {"default": 0.98}
    assert f["all_layers"]["at_peak"] == pytest.approx(1 / (1 + 32 * f["peak_s_per_layer"] / 6.5), abs=1e-4)
    assert out["workloads"]["8k+128"]["default"]["at_peak"] is None  # no capture-off run to set it against
    assert json.loads((tmp_path / "floor.json").read_text())["workloads"].keys() == set(workloads.NAMES)
