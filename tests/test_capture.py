"""The vLLM-free capture engine: hand-off bounds, skips and drops are counted, and exit drains."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import attn_otel
from attn_otel import arrival
from attn_otel.capture import CaptureEngine
from attn_otel.tap import LayerSpec
from attn_otel.tracking import FinishedRequest
from attn_otel.attention import METRICS
from attn_otel.config import Config
from attn_otel.handoff import MAPS_HEADROOM, ByteBudget
from attn_otel.ids import new_span_id, new_trace_id

SPEC = LayerSpec(index=0, name="l0", num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25)


_MADE: list = []  # this test's engines (_engine), closed after it


@pytest.fixture(autouse=True)
def _close_engines():
    """Every engine a test makes is closed when the test ends, so that its writer processes (one each, about
    60 MB) stop with it instead of living on, idle, to the end of the session."""
    yield
    while _MADE:
        _MADE.pop().close()


def _engine(tmp_path, store="store", **cfg):
    cfg.setdefault("row_metrics", "all")
    eng = CaptureEngine(Config(store=str(tmp_path / store), **cfg), [SPEC], 256, torch.float32, "cpu")
    _MADE.append(eng)
    eng.tap.write(0, torch.randn(200, 64), torch.randn(200, 32), torch.arange(200))
    return eng


def _req(T, mode="maps", trace=None):
    extra = {"attn_otel": mode}
    if trace:
        extra["traceparent"] = f"00-{trace}-{new_span_id()}-01"
    return FinishedRequest(f"r{T}", list(range(T - 2)), [7, 8], T, [list(range(16))], [16], extra)


def test_a_capture_that_does_not_fit_the_queue_is_dropped_and_counted(tmp_path):
    eng = _engine(tmp_path, queue_bytes=1000)
    eng.on_finished(_req(100, "metrics"))
    eng.flush(30)
    s = eng.stats.snapshot()
    assert s["dropped"] == {"queue_full": 1} and s["stored"] == 0 and s["captured"] == 0


def test_maps_that_never_fit_the_queue_are_declined_as_too_long(tmp_path):
    # one 4-head layer: a capture with maps takes 4 * T * (2 T + 4 len(METRICS)) bytes; the maps' share of a
    # 50 kB queue (less the eighth kept for captures without maps) holds them up to T = 66, not 100
    eng = _engine(tmp_path, queue_bytes=50_000)
    room = 50_000 - int(50_000 * MAPS_HEADROOM)
    limit = max(T for T in range(1, 200) if 4 * T * (2 * T + 4 * len(METRICS)) <= room)
    assert eng.planner.map_tokens((0,)) == limit < 100
    assert arrival.map_tokens(eng.config) == limit  # published: the scheduler declines longer prompts at arrival
    extra, planned = arrival.decide({"attn_otel": "maps"}, limit + 1, eng.config)
    assert not planned and not extra[arrival.MAPS_KEY]
    assert arrival.decide({"attn_otel": "maps"}, limit, eng.config)[1]
    trace, trace_fit = new_trace_id(), new_trace_id()
    eng.on_finished(_req(100, "maps", trace))
    eng.flush(30)  # its metrics leave the queue (else the next one's maps would find it busy: maps_queue_full)
    eng.on_finished(_req(limit, "maps", trace_fit))
    eng.flush(30)
    s = eng.stats.snapshot()
    assert s["skipped"] == {"map_too_long": 1} and s["stored"] == 2 and not s["dropped"]
    (cap,) = attn_otel.open_trace(trace, store=tmp_path / "store")
    assert not cap.has_maps and cap.metrics["entropy"].shape == (1, 4, 100)
    (fit,) = attn_otel.open_trace(trace_fit, store=tmp_path / "store")
    assert fit.has_maps and fit.maps().shape == (1, 4, limit, limit)


def test_maps_that_find_the_queue_busy_fall_back_to_metrics(tmp_path):
    eng = _engine(tmp_path, queue_bytes=200_000)  # maps of T=100 (92.8 kB) fit an empty queue
    assert eng.planner.map_tokens((0,)) >= 100
    busy = 200_000 - int(200_000 * MAPS_HEADROOM) - 50_000
    assert eng.handoff.reserve(busy)  # captures waiting on a slow store hold most of it
    trace = new_trace_id()
    eng.on_finished(_req(100, "maps", trace))
    eng.flush(30)
    assert eng.stats.snapshot()["skipped"] == {"maps_queue_full": 1}
    eng.handoff.release(busy)
    (cap,) = attn_otel.open_trace(trace, store=tmp_path / "store")
    assert not cap.has_maps and cap.metrics["entropy"].shape == (1, 4, 100)


def test_maps_leave_room_in_the_queue_for_captures_without_maps():
    b = ByteBudget(1000)
    assert b.reserve(800, headroom=125)  # maps: within 1000 - 125
    assert not b.reserve(100, headroom=125)  # more maps would eat into the room kept free
    assert b.reserve(190)  # a capture without maps still fits
    assert not b.reserve(20) and b.pending_bytes == 990
    b.release(990)
    assert b.pending_bytes == 0 and b.reserve(875, headroom=125)


def test_maps_that_fit_the_queue_but_not_its_maps_share_are_declined(tmp_path):
    # T=100 on one 4-head layer: metrics take len(METRICS) * 4 * 100 * 4 bytes, maps 80,000 more
    with_maps = len(METRICS) * 4 * 100 * 4 + 4 * 100 * 100 * 2
    queue = int(with_maps / (1 - MAPS_HEADROOM)) - 1000  # the capture fits the queue, not the maps' share
    assert with_maps < queue and with_maps > queue - int(queue * MAPS_HEADROOM)
    eng = _engine(tmp_path, queue_bytes=queue)
    assert eng.handoff.maps_headroom == int(queue * MAPS_HEADROOM)
    trace = new_trace_id()
    eng.on_finished(_req(100, "maps", trace))
    eng.flush(30)
    s = eng.stats.snapshot()
    assert s["skipped"] == {"map_too_long": 1} and s["stored"] == 1 and not s["dropped"]
    (cap,) = attn_otel.open_trace(trace, store=tmp_path / "store")
    assert not cap.has_maps and cap.metrics["entropy"].shape == (1, 4, 100)
    eng2 = _engine(tmp_path, store="store2", queue_bytes=queue + 2000)  # now within the maps' share
    trace2 = new_trace_id()
    eng2.on_finished(_req(100, "maps", trace2))
    eng2.flush(30)
    assert eng2.stats.snapshot()["skipped"] == {}
    (cap2,) = attn_otel.open_trace(trace2, store=tmp_path / "store2")
    assert cap2.has_maps


def test_requests_longer_than_the_map_cap_get_metrics_only(tmp_path):
    eng = _engine(tmp_path, max_map_tokens=50)
    trace = new_trace_id()
    eng.on_finished(_req(100, "maps", trace))
    eng.flush(30)
    assert eng.stats.snapshot()["skipped"] == {"map_too_long": 1}
    (cap,) = attn_otel.open_trace(trace, store=tmp_path / "store")
    assert not cap.has_maps


def test_a_store_that_fails_is_counted_not_raised(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    eng = CaptureEngine(Config(store=str(tmp_path / "file")), [SPEC], 256, torch.float32, "cpu")
    _MADE.append(eng)
    eng.on_finished(_req(20, "metrics"))
    assert eng.flush(30)
    assert eng.stats.snapshot()["dropped"] == {"store_error": 1}


def test_pending_captures_are_written_when_the_process_exits(tmp_path):
    trace = new_trace_id()
    script = textwrap.dedent(f"""
        import torch
        from attn_otel.capture import CaptureEngine
        from attn_otel.tap import LayerSpec
        from attn_otel.tracking import FinishedRequest
        from attn_otel.config import Config
        spec = LayerSpec(index=0, name="l0", num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25)
        eng = CaptureEngine(Config(store={str(tmp_path / "store")!r}), [spec], 4096, torch.float32, "cpu")
        eng.tap.write(0, torch.randn(3000, 64), torch.randn(3000, 32), torch.arange(3000))
        extra = {{"attn_otel": "maps", "traceparent": "00-{trace}-00f067aa0ba902b7-01"}}
        eng.on_finished(FinishedRequest("r", list(range(2990)), [1] * 10, 3000, [list(range(200))], [16], extra))
        # no flush: the interpreter exits with the capture still in the hand-off
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "failed" not in res.stderr
    (cap,) = attn_otel.open_trace(trace, store=tmp_path / "store")
    assert cap.has_maps and cap.num_tokens == 3000


@pytest.mark.parametrize("mode", ["off"])
def test_off_is_skipped(tmp_path, mode):
    eng = _engine(tmp_path)
    eng.on_finished(_req(10, mode))
    assert eng.stats.snapshot()["skipped"] == {"request_off": 1}


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_both_writers_store_every_metric_under_its_own_name(tmp_path, writer):
    from attn_otel.attention import attention_metrics

    eng = _engine(tmp_path, writer=writer)
    trace = new_trace_id()
    eng.on_finished(_req(120, "maps", trace))
    assert eng.flush(60)
    (cap,) = attn_otel.open_trace(trace, store=tmp_path / "store")
    q, k = eng.tap.gather(0, torch.arange(120))
    want = attention_metrics(q, k, SPEC.scale, 118, 4)
    for i, name in enumerate(["entropy", "entropy_norm", "sink_mass_first", "sink_mass_k"]):
        assert torch.allclose(torch.from_numpy(cap.metrics[name][0]), want[i], equal_nan=True), name
    assert torch.allclose(torch.from_numpy(cap.metrics["lookback_ratio"][0]), want[6], equal_nan=True)
    assert "vision_share" not in cap.metrics


def test_a_drop_reaches_the_stats_file_without_any_write(tmp_path):
    """Drops happen on the engine loop, where no writer runs: the stats timer still publishes them."""
    import json
    import os
    import time

    eng = _engine(tmp_path, queue_bytes=1000, stats_dir=str(tmp_path / "stats"))
    eng.on_finished(_req(100, "metrics"))
    path = tmp_path / "stats" / f"attn-otel-stats-{os.getpid()}.json"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if path.exists() and json.loads(path.read_text())["dropped"] == {"queue_full": 1}:
            break
        time.sleep(0.2)
    snap = json.loads(path.read_text())
    assert snap["dropped"] == {"queue_full": 1}
    assert snap["queue_pending_bytes"] == 0 and snap["device_queue_pending_bytes"] == 0
    eng.close()


def test_several_writers_store_every_capture(tmp_path):
    eng = _engine(tmp_path, writers=3, writer="thread")
    traces = [new_trace_id() for _ in range(9)]
    for i, t in enumerate(traces):
        eng.on_finished(_req(20 + i, "metrics", trace=t))
    assert eng.flush(60)
    assert eng.stats.snapshot()["stored"] == 9
    assert sorted(c.trace_id for c in attn_otel.list_captures(str(tmp_path / "store"))) == sorted(traces)
    eng.close()


def test_by_default_metrics_only_captures_store_their_summary_not_rows(tmp_path):
    """ATTN_OTEL_ROW_METRICS=maps (the default): rows only with maps; the stored summary equals the
    summary of the rows (here, the same tap captured with rows)."""
    import numpy as np

    from attn_otel.cli import main

    trace = new_trace_id()
    summaries = {}
    for rows in ("maps", "all"):
        eng = _engine(tmp_path, store=rows, row_metrics=rows)
        torch.manual_seed(0)
        eng.tap.write(0, torch.randn(200, 64), torch.randn(200, 32), torch.arange(200))
        eng.on_finished(_req(100, "metrics", trace=trace))
        assert eng.flush(30)
        (cap,) = attn_otel.open_trace(trace, str(tmp_path / rows))
        assert cap.has_row_metrics == (rows == "all")
        summaries[rows] = cap.summary()
        eng.close()
    assert attn_otel.open_trace(trace, str(tmp_path / "maps"))[0].metrics == {}
    for part, names in summaries["all"].items():
        for name, stats in names.items():
            got = summaries["maps"][part][name]
            if stats is None:
                assert got is None, (part, name)
                continue
            for stat in ("mean", "p10", "p50", "p90", "layer_mean"):
                np.testing.assert_allclose(got[stat], stats[stat], rtol=1e-6, atol=1e-7, equal_nan=True)
    assert main(["metrics", trace, "--store", str(tmp_path / "maps")]) == 0


def test_maps_captures_keep_their_rows_by_default(tmp_path):
    eng = _engine(tmp_path, row_metrics="maps")
    trace = new_trace_id()
    eng.on_finished(_req(30, "maps", trace=trace))
    assert eng.flush(30)
    (cap,) = attn_otel.open_trace(trace, str(tmp_path / "store"))
    assert cap.has_maps and cap.has_row_metrics and cap.metrics["entropy"].shape == (1, 4, 30)
    eng.close()


def test_the_clients_sampled_flag_reaches_the_record(tmp_path):
    eng = _engine(tmp_path, writer="thread")
    seen = []
    orig = eng.writers._write_in_thread
    eng.writers._write_in_thread = lambda rec, job, names, latency: (seen.append(rec.sampled), orig(rec, job, names, latency))[1]
    for flags in ("01", "00"):
        req = _req(30, "metrics", new_trace_id())
        req.extra_args["traceparent"] = req.extra_args["traceparent"][:-2] + flags
        eng.on_finished(req)
        assert eng.flush(30)
    assert seen == [True, False]


def test_a_writer_process_that_stops_answering_is_replaced(tmp_path):
    """A hung writer (here: SIGSTOPped) costs one capture, counted, not the writer thread for ever."""
    import signal

    eng = _engine(tmp_path, writer="process", writers=1, writer_timeout_s=3.0)
    first = new_trace_id()
    eng.on_finished(_req(20, "metrics", first))
    assert eng.flush(60)
    (proc,) = eng.writers.procs
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        eng.on_finished(_req(21, "metrics", new_trace_id()))
        assert eng.flush(60)
        assert eng.stats.snapshot()["dropped"] == {"store_error": 1}
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
    last = new_trace_id()
    eng.on_finished(_req(22, "metrics", last))
    assert eng.flush(60)
    assert len(eng.writers.procs) == 2 and eng.stats.snapshot()["stored"] == 2
    for trace in (first, last):
        (cap,) = attn_otel.open_trace(trace, store=tmp_path / "store")
    eng.close()


def test_token_ids_are_stored_only_when_asked(tmp_path):
    for store_tokens in (False, True):
        eng = _engine(tmp_path, store=f"store-{store_tokens}", writer="thread", store_tokens=store_tokens)
        trace = new_trace_id()
        eng.on_finished(_req(30, "maps", trace))
        assert eng.flush(30)
        (cap,) = attn_otel.open_trace(trace, store=tmp_path / f"store-{store_tokens}")
        assert cap.has_maps
        if store_tokens:
            assert list(cap.token_ids) == list(range(28)) + [7, 8]
        else:
            assert cap.token_ids is None and cap.meta["token_ids"] is False
        eng.close()
    assert Config().store_tokens is False  # the default


def test_the_finish_reason_reaches_the_capture(tmp_path):
    eng = _engine(tmp_path, writer="thread")
    traces = {}
    for reason in ("stop", "length", "abort", None):
        traces[reason] = new_trace_id()
        req = _req(30, "metrics", traces[reason])
        req.request_id = f"r-{reason}"
        req.finish_reason = reason
        eng.on_finished(req)
    assert eng.flush(30)
    for reason, trace in traces.items():
        (cap,) = attn_otel.open_trace(trace, store=tmp_path / "store")
        assert cap.finish_reason == reason and cap.meta.get("finish_reason") == reason
    eng.close()


@pytest.mark.parametrize("served, model, name", [
    ("smollm2", "/models/SmolLM2-135M-Instruct", "smollm2"),  # --served-model-name wins
    (["chat", "chat-alias"], "/models/x", "chat"),  # the first of several names
    (None, "HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),  # a hub id as given
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct",
     "HuggingFaceTB/SmolLM2-135M-Instruct"),
    # vLLM fills served_model_name with the model string when none was set: a local path is cut to its name
    ("/root/.cache/attn-otel/models/SmolLM2-135M-Instruct", "/root/.cache/attn-otel/models/SmolLM2-135M-Instruct",
     "SmolLM2-135M-Instruct"),
    ("/models/llama/", "/models/llama/", "llama"),
    ("~/models/qwen", "~/models/qwen", "qwen"),
    ("./models/qwen", "./models/qwen", "qwen"),
    ("/models/tiny.gguf", "/models/tiny.gguf", "tiny.gguf"),
    ("/srv/served-as-a-path", "/models/x", "served-as-a-path"),  # a served name that is a path: cut too
])
def test_model_name_is_the_served_name_never_a_local_path(served, model, name):
    from attn_otel.tracking import model_name

    assert model_name(served, model) == name


def test_a_relative_folder_that_exists_here_is_a_local_path(tmp_path, monkeypatch):
    from attn_otel.tracking import model_name

    (tmp_path / "org" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert model_name("org/model", "org/model") == "model"
