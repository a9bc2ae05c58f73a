"""Per-request selection, bad input and failure handling, through the real engine (CPU build, SmolLM2)."""

import logging
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from text import prose

import attn_otel
from attn_otel import cli
from attn_otel.ids import new_span_id, new_trace_id

pytestmark = pytest.mark.engine


def _one(engine, extra, max_tokens=4, prompt=None):
    from vllm import SamplingParams

    trace_id = new_trace_id()
    span = new_span_id()
    args = {"traceparent": f"00-{trace_id}-{span}-01", **extra}
    out = engine.generate([prompt or prose(40, seed=3)], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                        extra_args=args))[0]
    assert out.finished and len(out.outputs[0].token_ids) == max_tokens  # always served
    return out, trace_id, span


def test_off_captures_nothing(engine):
    before = engine.capture.stats.snapshot()["skipped"].get("request_off", 0)
    _, trace_id, _ = _one(engine, {"attn_otel": "off"})
    with pytest.raises(attn_otel.TraceNotFound):
        attn_otel.open_trace(trace_id, store=engine.store)
    assert engine.capture.stats.snapshot()["skipped"]["request_off"] == before + 1


def test_metrics_mode_stores_metrics_without_maps(engine):
    out, trace_id, span = _one(engine, {"attn_otel": "metrics"})
    (cap,) = attn_otel.open_trace(trace_id, store=engine.store)
    assert not cap.has_maps and cap.attn is None
    T = len(out.prompt_token_ids) + 3
    assert cap.metrics["entropy"].shape == (30, 9, T)
    assert cap.meta["parent_span_id"] == span  # the offline traceparent extra arg sets trace and parent


def test_default_is_metrics_when_maps_sample_is_zero(engine):
    _, trace_id, _ = _one(engine, {})
    (cap,) = attn_otel.open_trace(trace_id, store=engine.store)
    assert cap.meta["mode"] == "metrics" and not cap.has_maps


def test_request_layers_select_a_subset(engine):
    out, trace_id, _ = _one(engine, {"attn_otel": "maps", "attn_otel_layers": "0,3"})
    (cap,) = attn_otel.open_trace(trace_id, store=engine.store)
    assert cap.layers == [0, 3]
    assert cap.attn.shape[:2] == (2, 9)


@pytest.mark.parametrize("extra, needle", [
    ({"attn_otel": "everything"}, "attn_otel='everything'"),
    ({"attn_otel": 7}, "attn_otel=7"),
    ({"attn_otel_layers": "zero,1"}, "attn_otel_layers='zero,1'"),
    ({"attn_otel_layers": [-1]}, "is negative"),
    ({"attn_otel_layers": list(range(20_000))}, "too long"),
    ({"traceparent": "00-not-a-trace"}, "traceparent='00-not-a-trace'"),
])
def test_bad_values_warn_and_the_request_is_still_served(engine, caplog, extra, needle):
    from vllm import SamplingParams

    engine.capture.warn_once.reset()  # warnings are logged once per kind; this test looks at each
    caplog.set_level(logging.WARNING, logger="attn_otel")
    args = {"attn_otel": "metrics", **extra} if "attn_otel" not in extra else dict(extra)
    before = engine.capture.stats.snapshot()["stored"]
    out = engine.generate([prose(30, seed=4)], SamplingParams(max_tokens=3, temperature=0.0, extra_args=args))[0]
    assert len(out.outputs[0].token_ids) == 3
    assert any(needle in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert engine.capture.stats.snapshot()["stored"] == before + 1  # captured with the defaults instead


def test_layers_that_are_not_captured_are_a_warning(engine, caplog, tmp_path):
    engine.capture.warn_once.reset()
    caplog.set_level(logging.WARNING, logger="attn_otel")
    _one(engine, {"attn_otel": "maps", "attn_otel_layers": "99"})
    assert any("only" in r.getMessage() and "99" in r.getMessage() for r in caplog.records)


def test_a_failure_inside_capture_is_logged_once_counted_and_the_request_completes(engine, caplog, monkeypatch):
    import attn_otel.compute as compute_mod

    def boom(*a, **k):
        raise RuntimeError("injected capture failure")

    monkeypatch.setattr(compute_mod, "attention_metrics", boom)
    engine.capture.warn_once.reset()
    caplog.set_level(logging.WARNING, logger="attn_otel")
    before = engine.capture.stats.snapshot()["dropped"].get("capture_error", 0)
    for _ in range(2):
        _one(engine, {"attn_otel": "maps"})
    assert engine.capture.stats.snapshot()["dropped"]["capture_error"] == before + 2
    logged = [r for r in caplog.records if "failed" in r.getMessage() and r.name == "attn_otel"]
    assert len(logged) == 1 and "injected capture failure" in (logged[0].exc_text or "")


def test_fetch_and_show_on_a_real_capture(engine, tmp_path, capsys):
    out, trace_id, _ = _one(engine, {"attn_otel": "maps", "attn_otel_layers": "0,29"}, max_tokens=5)
    T = len(out.prompt_token_ids) + 4
    npz = tmp_path / "out.npz"
    assert cli.main(["fetch", trace_id, "-o", str(npz), "--store", str(engine.store)]) == 0
    data = np.load(npz)
    assert data["attn"].dtype == np.float32 and data["attn"].shape == (2, 9, T, T)
    assert list(data["layers"]) == [0, 29] and int(data["prompt_len"]) == len(out.prompt_token_ids)
    assert list(data["token_ids"]) == (list(out.prompt_token_ids) + list(out.outputs[0].token_ids))[:T]
    png = tmp_path / "map.png"
    assert cli.main(["show", trace_id, "--layer", "29", "--log", "-o", str(png), "--store", str(engine.store),
                     "--tokenizer", engine.model_path]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_trace_is_one_line_and_nonzero(engine, capsys):
    assert cli.main(["fetch", new_trace_id(), "-o", "/tmp/never.npz", "--store", str(engine.store)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_with_attn_otel_unset_nothing_is_patched_or_allocated(smollm2_path, tmp_path):
    script = textwrap.dedent(f"""
        import os, sys
        os.environ.pop("ATTN_OTEL", None)
        os.environ["ATTN_OTEL_STORE"] = {str(tmp_path / "store")!r}
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
        from vllm import LLM, SamplingParams
        from vllm.v1.worker import gpu_model_runner as g
        # eager: what is looked at here is the plugin, not the model's compiled graph (saves the ~1 min compile)
        llm = LLM(model={smollm2_path!r}, max_model_len=512, enforce_eager=True)
        out = llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
        from attn_otel import vllm_adapter
        patched = [n for n in ("initialize_kv_cache", "_update_states")
                   if getattr(getattr(g.GPUModelRunner, n), "_attn_otel", False)]
        print("RESULT", len(out[0].outputs[0].token_ids), vllm_adapter._PATCHED, patched,
              "attn_otel.capture" in sys.modules, os.path.exists({str(tmp_path / "store")!r}))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT")]
    assert line, res.stderr[-3000:]
    # served; plugin not patched; no hooks; capture module (and so any tap) never imported; no store made
    assert line[0] == "RESULT 2 False [] False False"
