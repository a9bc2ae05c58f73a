"""A finish batch's captures handed to the writers together (attn_otel.handoff.Handoff.put_many,
attn_otel.writers.WriterPool.write_many): split among the writer threads, each part one message to its writer
process (one shared-memory segment, one JSON line, a reply per capture), every capture stored and read back by
its trace id as it went in, a bad one counted on its own, a writer that died replaced and the part sent again."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import attn_otel
from attn_otel.capture import CaptureEngine
from attn_otel.config import Config
from attn_otel.finish import device_summaries
from attn_otel.handoff import Job
from attn_otel.ids import new_trace_id
from attn_otel.metrics import summarize
from attn_otel.plan import Plan
from attn_otel.tap import LayerSpec

H, T, N = 4, 12, 8
LAYERS = [LayerSpec(index=i, name=f"l{i}", num_heads=H, num_kv_heads=2, head_dim=16, scale=0.25) for i in range(2)]
NAMES = ("entropy", "entropy_norm", "sink_mass_first", "sink_mass_k", "vision_share", "vision_share_norm",
         "lookback_ratio")


def _capture(eng, seed):
    rows = torch.rand(len(LAYERS), 7, H, T, generator=torch.Generator().manual_seed(seed))
    rows[:, 4:6] = float("nan")
    rows[:, 6, :, : N + 1] = float("nan")
    trace = new_trace_id()
    req = SimpleNamespace(request_id=f"r{seed}", vision_positions=None, prompt_token_ids=list(range(N)),
                          output_token_ids=[1] * (T - N), token_ids_device=None)
    rec, _ = eng.planner.record(Plan(req, LAYERS, (), T, False, trace, None, True, 1000, 0.0, True))
    assert eng.handoff.reserve(1000)
    return trace, rows, Job(rec, None, None, None, 1000, 0.0, summary=device_summaries(rows, [0, T], [N])[0])


def _check(trace, rows, store):
    (cap,) = attn_otel.open_trace(trace, store=store)
    want = summarize({n: rows[:, i].numpy() for i, n in enumerate(NAMES) if i not in (4, 5)}, N)
    got = cap.summary()
    for part in ("prompt", "generated"):
        np.testing.assert_allclose(got[part]["entropy"]["p50"], want[part]["entropy"]["p50"], rtol=1e-5)
        np.testing.assert_allclose(got[part]["sink_mass_k"]["mean"], want[part]["sink_mass_k"]["mean"], rtol=1e-5)
    np.testing.assert_allclose(got["generated"]["lookback_ratio"]["p90"], want["generated"]["lookback_ratio"]["p90"],
                               rtol=1e-5)


@pytest.fixture
def cap_engine(tmp_path):
    eng = CaptureEngine(Config(store=str(tmp_path / "store"), writers=2), LAYERS, 64, torch.float32, "cpu")
    yield eng
    eng.close()


def test_a_batch_goes_to_each_writer_in_one_message_and_every_capture_reads_back(cap_engine, tmp_path, monkeypatch):
    sent = []
    call = type(cap_engine.handoff._writers)._call

    def counting(self, line, captures=1):
        sent.append(captures)
        return call(self, line, captures)

    monkeypatch.setattr(type(cap_engine.handoff._writers), "_call", counting)
    caps = [_capture(cap_engine, s) for s in range(7)]
    cap_engine.handoff.put_many([job for *_, job in caps])
    assert cap_engine.flush(120)
    snap = cap_engine.stats.snapshot()
    assert snap["stored"] == 7 and snap["dropped"] == {}, snap
    assert sorted(sent) == [3, 4]  # two writer threads: 7 captures in two messages, none alone
    for trace, rows, _ in caps:
        _check(trace, rows, tmp_path / "store")


def test_a_bad_capture_in_a_batch_is_counted_alone(cap_engine, tmp_path):
    caps = [_capture(cap_engine, s) for s in range(3)]
    caps[1][2].summary = torch.zeros(3)  # not a summary: its own preparation fails, the others' message goes
    cap_engine.handoff.put_many([job for *_, job in caps])
    assert cap_engine.flush(120)
    snap = cap_engine.stats.snapshot()
    assert snap["stored"] == 2 and snap["dropped"] == {"store_error": 1}, snap
    for i in (0, 2):
        _check(caps[i][0], caps[i][1], tmp_path / "store")


def test_a_writer_that_died_is_replaced_and_the_part_sent_again(cap_engine, tmp_path):
    first = [_capture(cap_engine, s) for s in range(2)]
    cap_engine.handoff.put_many([job for *_, job in first])
    assert cap_engine.flush(120)
    for proc in cap_engine.handoff._writers.procs:
        proc.kill()
        proc.wait(10)
    caps = [_capture(cap_engine, s) for s in range(10, 16)]
    cap_engine.handoff.put_many([job for *_, job in caps])
    assert cap_engine.flush(120)
    snap = cap_engine.stats.snapshot()
    assert snap["stored"] == 8 and snap["dropped"] == {}, snap
    for trace, rows, _ in caps:
        _check(trace, rows, tmp_path / "store")
