"""Tensor- and pipeline-parallel captures on the CPU: ranks write their parts of one capture concurrently.

What a rank of a ``tensor_parallel_size``/``pipeline_parallel_size`` engine does is simulated here without
GPUs: (1) separate processes each write one part of a capture (its heads of its layers) into the same store
at the same moment, on disk and on S3 (moto's server), and the reader sees one capture equal to the whole;
(2) capture engines given half of a model's heads (or layers) each, fed the same requests, store captures
equal to those of one engine holding the whole model, with one span and one count per capture.
The same on real GPUs with vLLM is ``tests/test_gpu_parallel.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from synthetic import make_record, part_of

import attn_otel
from attn_otel.capture import CaptureEngine
from attn_otel.tap import LayerSpec
from attn_otel.tracking import FinishedRequest, Parallel
from attn_otel.config import Config
from attn_otel.ids import new_span_id, new_trace_id
from attn_otel.attention import METRICS
from attn_otel.handoff import MAPS_HEADROOM
from attn_otel.plan import map_token_limit
from attn_otel.metrics import summarize
from attn_otel.store import (CapturePart, StoreError, collect_garbage, list_partial, open_zarr_store,
                             write_capture_part)

LAYERS = (0, 1, 2, 3)
HEADS = 8
T, PROMPT = 300, 220  # two row chunks per head (ROWS_PER_CHUNK 256)

# (tp, pp): parts hold heads [r*H/tp, (r+1)*H/tp) of the layers of their stage
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp2-pp2": (2, 2), "tp4": (4, 1)}


def _parts(tp: int, pp: int) -> list[CapturePart]:
    per_stage = len(LAYERS) // pp
    hp = HEADS // tp
    return [CapturePart(index=s * tp + r, count=tp * pp, heads=(r * hp, (r + 1) * hp),
                        layers=LAYERS[s * per_stage:(s + 1) * per_stage], tp=tp, pp=pp)
            for s in range(pp) for r in range(tp)]


WRITE_PART = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    from synthetic import make_record, part_of
    from attn_otel.metrics import summarize
    from attn_otel.store import CapturePart, open_zarr_store, write_capture_part
    record, _ = make_record({trace!r}, "req-1", layers={layers!r}, heads={heads}, T={T}, prompt_len={prompt},
                            maps={maps}, seed=7, created=1.0e9)
    rec = part_of(record, CapturePart(**json.loads({part!r})))
    store = open_zarr_store({url!r})
    print("ready", flush=True)
    sys.stdin.readline()  # every part starts writing at the same moment: when the test says go
    n, marker = write_capture_part(store, rec, rows={rows}, summary=summarize(rec.metrics, rec.prompt_len))
    print(json.dumps({{"bytes": n, "completed": marker is not None}}))
""")


def _write_concurrently(url: str, env: dict, trace: str, parts: list[CapturePart], *, maps: bool, rows: bool):
    from pathlib import Path

    procs = [subprocess.Popen(
        [sys.executable, "-c", WRITE_PART.format(
            tests=str(Path(__file__).parent), trace=trace, layers=LAYERS, heads=HEADS, T=T, prompt=PROMPT, maps=maps,
            part=json.dumps(p.to_json()), url=url, rows=rows)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**__import__("os").environ, **env})
        for p in parts]
    for p in procs:  # each has its record and its store open
        line = p.stdout.readline()
        if line != "ready\n":  # it died first: its own error, and no writer left waiting for a go
            for q in procs:
                q.kill()
            _, stderr = p.communicate(timeout=60)
            pytest.fail(f"a part's writer did not start: {line!r}\n{stderr[-3000:]}")
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


@pytest.fixture(params=["local", "s3"])
def backend(request):
    return request.getfixturevalue(f"{request.param}_backend")


@pytest.mark.parametrize("layout", ["tp2", "pp2", "tp2-pp2"])
def test_ranks_writing_their_parts_at_once_make_one_capture_equal_to_the_whole(backend, layout):
    trace = new_trace_id()
    whole, maps = make_record(trace, "req-1", layers=LAYERS, heads=HEADS, T=T, prompt_len=PROMPT, seed=7,
                              created=1.0e9)
    results = _write_concurrently(backend.url, backend.env, trace, _parts(*LAYOUTS[layout]), maps=True, rows=True)
    assert sum(r["completed"] for r in results) == 1  # exactly one part claims COMPLETE

    (cap,) = attn_otel.open_trace(trace, store=backend.url)
    assert cap.layers == list(LAYERS) and cap.num_heads == HEADS and cap.num_tokens == T
    assert cap.meta["parts"] == len(results) and cap.meta["parallel"] == dict(zip(("tp", "pp"), LAYOUTS[layout]))
    np.testing.assert_array_equal(cap.maps(), whole.maps)  # every head of every layer, bit for bit
    np.testing.assert_array_equal(cap.token_ids, whole.token_ids)
    for name, value in whole.metrics.items():
        np.testing.assert_array_equal(cap.metrics[name], value)
    expected = summarize(whole.metrics, PROMPT)
    got = cap.summary()
    for name, stats in expected["generated"].items():
        if stats is not None:
            np.testing.assert_allclose(got["generated"][name]["p50"], stats["p50"], rtol=1e-6)
    # one layer+head per map chunk, ceil(T/256) row chunks each: no chunk was written by two parts
    chunks = [k for k in backend.keys(f"traces/{trace}/req-1/attn/c/")]
    assert len(chunks) == len(LAYERS) * HEADS * 2


@pytest.mark.parametrize("layout", ["tp4", "tp2-pp2"])
def test_metrics_only_parts_merge_their_stored_summaries(backend, layout):
    """The default for a metrics-only capture: no rows, one summary array, written by 4 parts."""
    trace = new_trace_id()
    whole, _ = make_record(trace, "req-1", layers=LAYERS, heads=HEADS, T=T, prompt_len=PROMPT, seed=7,
                           maps=False, created=1.0e9)
    results = _write_concurrently(backend.url, backend.env, trace, _parts(*LAYOUTS[layout]), maps=False, rows=False)
    assert sum(r["completed"] for r in results) == 1
    (cap,) = attn_otel.open_trace(trace, store=backend.url)
    assert not cap.has_maps and not cap.has_row_metrics
    expected, got = summarize(whole.metrics, PROMPT), cap.summary()
    for part in ("prompt", "generated"):
        for name, stats in expected[part].items():
            if stats is None:
                assert got[part][name] is None
                continue
            for stat in ("mean", "p10", "p50", "p90", "layer_mean"):
                np.testing.assert_allclose(got[part][name][stat], stats[stat], rtol=1e-5, atol=1e-7,
                                           err_msg=f"{part}.{name}.{stat}")


def test_a_capture_missing_a_part_stays_invisible_and_is_collected(local_backend):
    trace = new_trace_id()
    whole, _ = make_record(trace, "req-1", layers=LAYERS, heads=HEADS, T=T, prompt_len=PROMPT, seed=7)
    parts = _parts(2, 2)
    store = open_zarr_store(local_backend.url)
    for part in parts[:3]:  # the fourth rank dropped its part (queue full, or it died)
        rec = part_of(whole, part)
        _, marker = write_capture_part(store, rec, summary=summarize(rec.metrics, PROMPT))
        assert marker is None
    with pytest.raises(attn_otel.TraceNotFound):
        attn_otel.open_trace(trace, store=local_backend.url)
    (partial,) = list_partial(store)
    assert partial.trace_id == trace
    assert [c.trace_id for c in collect_garbage(store, grace_s=0, now=time.time() + 1)] == [trace]
    assert not local_backend.keys(f"traces/{trace}/req-1")


def test_a_part_that_does_not_fit_its_capture_is_refused(local_backend):
    whole, _ = make_record(new_trace_id(), "req-1", layers=LAYERS, heads=HEADS, T=20, prompt_len=10)
    bad = part_of(whole, CapturePart(index=0, count=2, heads=(0, 4), layers=(0, 1), tp=2))
    bad.part = CapturePart(index=0, count=2, heads=(0, 4), layers=(0, 9), tp=2)  # layer 9 is not captured
    with pytest.raises(StoreError, match="layer"):
        write_capture_part(open_zarr_store(local_backend.url), bad)
    with pytest.raises(ValueError):
        CapturePart(index=2, count=2, heads=(0, 4), layers=(0,), tp=2)


# ------------------------------------------------------------------ capture engines as the ranks of a model
D, KV = 16, 4  # head_dim; the model has HEADS query heads over KV key/value heads (GQA 2:1)
ENGINE_LAYERS = 2


def _model_qk(n_tokens: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    q = {i: torch.randn(n_tokens, HEADS, D, generator=g) * 2 for i in range(ENGINE_LAYERS)}
    k = {i: torch.randn(n_tokens, KV, D, generator=g) * 2 for i in range(ENGINE_LAYERS)}
    return q, k


def _rank_engine(store, tp_rank, tp, pp_rank, pp, *, writer="thread", seed="inst-1", **cfg):
    """The capture engine a rank would get: its heads (a contiguous slice, as vLLM shards them) of its
    stage's layers, its tap filled with those heads' Q/K."""
    hq, hk = HEADS // tp, KV // tp
    per_stage = ENGINE_LAYERS // pp
    mine = range(pp_rank * per_stage, (pp_rank + 1) * per_stage)
    specs = [LayerSpec(index=i, name=f"l{i}", num_heads=hq, num_kv_heads=hk, head_dim=D, scale=D ** -0.5)
             for i in mine]
    par = None if tp * pp == 1 else Parallel(
        tp_rank=tp_rank, tp=tp, pp_rank=pp_rank, pp=pp, total_heads=HEADS,
        stage_of={i: i // per_stage for i in range(ENGINE_LAYERS)}, capture_layers=tuple(range(ENGINE_LAYERS)),
        id_seed=seed)
    eng = CaptureEngine(Config(store=str(store), layers="all", writer=writer, row_metrics="all", **cfg),
                        specs, 512, torch.float32, "cpu", parallel=par)
    q, k = _model_qk(400)
    for i in mine:
        eng.tap.write(i, q[i][:, tp_rank * hq:(tp_rank + 1) * hq], k[i][:, tp_rank * hk:(tp_rank + 1) * hk],
                      torch.arange(400))
    return eng


def _requests(traces):
    out = []
    for n, (trace, mode) in enumerate(traces):
        Tn = 120 + 40 * n
        extra = {"attn_otel": mode}
        if trace:
            extra["traceparent"] = f"00-{trace}-{new_span_id()}-01"
        out.append(FinishedRequest(f"req-{n}", list(range(Tn - 10)), list(range(9)), Tn,
                                   [list(range(25))], [16], extra))
    return out


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_rank_engines_store_what_one_engine_holding_the_whole_model_stores(tmp_path, layout):
    tp, pp = LAYOUTS[layout]
    traces = [(new_trace_id(), "maps"), (new_trace_id(), "metrics")]
    single = _rank_engine(tmp_path / "single", 0, 1, 0, 1)
    single.on_finished_many(_requests(traces))
    assert single.flush(60)
    ranks = [_rank_engine(tmp_path / "parallel", r, tp, s, pp) for s in range(pp) for r in range(tp)]
    for eng in ranks:
        eng.on_finished_many(_requests(traces))
    for eng in ranks:
        assert eng.flush(60)
    for trace, mode in traces:
        (want,) = attn_otel.open_trace(trace, store=tmp_path / "single")
        (got,) = attn_otel.open_trace(trace, store=tmp_path / "parallel")
        assert got.layers == want.layers and got.num_heads == want.num_heads == HEADS
        assert got.has_maps == want.has_maps == (mode == "maps")
        if mode == "maps":
            np.testing.assert_allclose(got.maps().astype(np.float32), want.maps().astype(np.float32), atol=1e-3)
        for name, value in want.metrics.items():
            np.testing.assert_allclose(got.metrics[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_array_equal(got.token_ids, want.token_ids)
    stats = [e.stats.snapshot() for e in ranks]
    assert sum(s["captured"] for s in stats) == len(traces)  # counted once per capture, not once per rank
    assert sum(s["stored"] for s in stats) == len(traces)
    assert sum(s["maps_stored"] for s in stats) == 1
    for eng in [single, *ranks]:
        eng.close()


def test_stages_decline_maps_alike_by_the_whole_capture_s_bytes(tmp_path):
    # pp2: each stage holds one of the two layers.  The queue's maps share holds one layer's maps of the 120-token
    # request, not both layers': every stage must decline them (by the whole capture's bytes, not its own), so
    # that no stage stores half of a capture's maps.
    one, both = (L * HEADS * 120 * (2 * 120 + 4 * len(METRICS)) for L in (1, 2))
    queue = int((one + both) / 2 / (1 - MAPS_HEADROOM))
    stages = [_rank_engine(tmp_path / "store", 0, 1, s, 2, queue_bytes=queue) for s in range(2)]
    room = stages[0].planner.maps_room
    assert one <= room < both
    assert map_token_limit(8192, room, 1, HEADS) >= 120  # a stage counting only its own layer would keep them
    limits = {eng.planner.map_tokens(range(ENGINE_LAYERS)) for eng in stages}
    assert len(limits) == 1 and limits.pop() < 120
    trace = new_trace_id()
    for eng in stages:
        eng.on_finished_many(_requests([(trace, "maps")]))
    for eng in stages:
        assert eng.flush(60)
    assert [eng.stats.snapshot()["skipped"] for eng in stages] == [{"map_too_long": 1}] * 2
    (cap,) = attn_otel.open_trace(trace, store=tmp_path / "store")
    assert not cap.has_maps and list(cap.layers) == [0, 1] and cap.metrics["entropy"].shape == (2, HEADS, 120)
    for eng in stages:
        eng.close()


def test_ranks_agree_on_the_trace_id_of_a_request_that_came_without_one(tmp_path):
    ranks = [_rank_engine(tmp_path / "store", r, 2, 0, 1, seed="instance-a") for r in range(2)]
    for eng in ranks:
        eng.on_finished_many(_requests([(None, "metrics")]))
        assert eng.flush(60)
    (trace,) = [c.trace_id for c in attn_otel.list_captures(store=tmp_path / "store")]
    (cap,) = attn_otel.open_trace(trace, store=tmp_path / "store")
    assert cap.num_heads == HEADS
    # another engine instance (another seed) derives other ids for the same request ids
    other = _rank_engine(tmp_path / "other", 0, 2, 0, 1, seed="instance-b")
    other.on_finished_many(_requests([(None, "metrics")]))
    assert other.flush(60)
    assert other.stats.snapshot()["stored"] == 0  # its part waits for a rank 1 that never comes
    with pytest.raises(attn_otel.TraceNotFound):
        attn_otel.open_trace(trace, store=tmp_path / "other")
    for eng in [*ranks, other]:
        eng.close()


def test_one_span_per_parallel_capture_with_every_layer_merged(tmp_path, otlp_receiver, monkeypatch):
    """Writer processes of four ranks (tp 2 x pp 2); the one that completes the capture sends its span,
    and the span's layer events are the whole model's (all heads) layer means."""
    for name in [n for n in __import__("os").environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp_receiver.http_endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    trace = new_trace_id()
    single = _rank_engine(tmp_path / "single", 0, 1, 0, 1)
    single.on_finished_many(_requests([(trace, "metrics")]))
    assert single.flush(60)
    (span,) = otlp_receiver.wait_for(lambda s: s.trace_id == trace, timeout=20)
    ranks = [_rank_engine(tmp_path / "parallel", r, 2, s, 2, writer="process") for s in range(2) for r in range(2)]
    trace2 = new_trace_id()
    for eng in ranks:
        eng.on_finished_many(_requests([(trace2, "metrics")]))
    for eng in ranks:
        assert eng.flush(120)
    for eng in [single, *ranks]:
        eng.close()  # writer processes exit and flush their spans
    otlp_receiver.wait_for(lambda s: s.trace_id == trace2, timeout=20)
    time.sleep(1.0)  # a second span, were there one, has arrived by now (every writer has exited)
    spans = otlp_receiver.find(lambda s: s.trace_id == trace2)
    assert len(spans) == 1
    got = spans[0]
    assert got.attributes["attn_otel.num_heads"] == HEADS
    assert list(got.attributes["attn_otel.layers"]) == list(range(ENGINE_LAYERS))
    want_events = {attrs["attn_otel.layer"]: attrs for _, _, attrs in span.events}
    got_events = {attrs["attn_otel.layer"]: attrs for _, _, attrs in got.events}
    assert sorted(got_events) == list(range(ENGINE_LAYERS))
    for layer, attrs in want_events.items():
        for key, value in attrs.items():
            assert got_events[layer][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (layer, key)
