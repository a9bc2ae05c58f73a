"""The maps' host memory (attn_otel.hostmem): pool segments are reused, bounded and unlinked; the staged
device-to-host copy is exact; a maps capture reaches the store through a pool segment, read in place by the
writer process, and leaves no segment behind."""

import os

import numpy as np
import pytest
import torch

import attn_otel
from attn_otel.capture import CaptureEngine
from attn_otel.tap import LayerSpec
from attn_otel.tracking import FinishedRequest
from attn_otel.config import Config
from attn_otel.hostmem import SegmentPool, Staging, _rounded
from attn_otel.ids import new_span_id, new_trace_id



def _exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name.lstrip('/')}")


def test_sizes_round_up_by_an_eighth_of_their_power_of_two():
    assert _rounded(1) == 1 << 20
    assert _rounded((1 << 20) + 1) == (1 << 20) + (1 << 17)
    for n in (150_000_000, 37_654_321, 5 << 20):
        r = _rounded(n)
        assert n <= r < n * 1.125 + 1
    assert _rounded(_rounded(150_000_000)) == _rounded(150_000_000)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="POSIX shared memory lives in /dev/shm on Linux")
def test_segments_are_reused_bounded_and_unlinked():
    pool = SegmentPool(keep_bytes=3 << 20)
    a = pool.acquire(2 << 20)
    assert a.size >= 2 << 20 and _exists(a.name)
    t = a.tensor((4, 1000), torch.float16)
    t.fill_(3.0)
    pool.release(a)
    b = pool.acquire((2 << 20) - 100)  # fits the free one: the same segment, its bytes still there
    assert b is a and pool.created == 1
    assert float(b.tensor((4, 1000), torch.float16)[3, 999]) == 3.0
    c = pool.acquire(2 << 20)  # the first is out: a new one
    assert c is not a and pool.created == 2
    pool.release(b)  # b (= a) free and c out: 4+ MiB held is over keep_bytes, so the free one goes
    assert pool.free_bytes() == 0 and not _exists(a.name) and _exists(c.name)
    pool.release(c)  # alone it fits
    assert pool.free_bytes() == c.size <= 3 << 20 and _exists(c.name)
    d = pool.acquire(1 << 20)
    pool.close()  # unlinks the free ones and the ones still out
    assert not _exists(c.name) and not _exists(d.name)
    assert pool.acquire(10) is None  # closed
    pool.release(d)  # a late release after close is harmless


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="POSIX shared memory lives in /dev/shm on Linux")
def test_free_segments_unused_for_a_while_are_given_back():
    pool = SegmentPool(keep_bytes=64 << 20, idle_s=60.0)
    a, b = pool.acquire(1 << 20), pool.acquire(1 << 20)
    pool.release(a)
    t_a = a.released
    pool.release(b)
    assert pool.trim(now=t_a + 59.0) == 0 and _exists(a.name)
    assert pool.trim(now=t_a + 60.0) == 1 and not _exists(a.name) and _exists(b.name)  # a went, b is newer
    assert pool.trim(now=b.released + 60.0) == 1 and pool.free_bytes() == 0 and not _exists(b.name)
    c = pool.acquire(1 << 20)  # a new one, and the pool still works
    assert c.name not in (a.name, b.name) and pool.created == 3
    pool.close()


def test_staging_rejects_a_destination_of_another_size():
    st = Staging(half_bytes=64)
    with pytest.raises(ValueError, match="cannot copy"):
        st.copy(torch.zeros(10, dtype=torch.float16), torch.zeros(11, dtype=torch.float16), None)
    with pytest.raises(ValueError, match="cannot copy"):
        st.copy(torch.zeros(10, dtype=torch.float16), torch.zeros(10, dtype=torch.float32), None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n", [1, 1000, 4096, 4097, 50_000])
def test_staged_copy_is_exact_across_halves(n):
    st = Staging(half_bytes=4096)  # 2,048 float16 per half: many turns of the halves
    stream = torch.cuda.Stream()
    src = torch.randn(n, device="cuda").half()
    dst = torch.full((n,), float("nan"), dtype=torch.float16)
    stream.wait_stream(torch.cuda.current_stream())  # the copies read what the default stream made
    with torch.cuda.stream(stream):
        st.copy(src, dst, stream)
    assert torch.equal(dst, src.cpu())
    st2 = Staging(half_bytes=4096)  # a non-contiguous source is copied as laid out
    m = torch.randn(64, 3 * max(1, n // 64 + 1), device="cuda").half()[:, ::3]
    out = torch.empty(m.shape, dtype=torch.float16)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        st2.copy(m, out, stream)
    assert torch.equal(out, m.cpu())


SPEC = LayerSpec(index=0, name="l0", num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25)


def _req(T, trace):
    return FinishedRequest(f"r{T}-{trace[:6]}", list(range(T - 2)), [7, 8], T, [list(range(16))], [16],
                           {"attn_otel": "maps", "traceparent": f"00-{trace}-{new_span_id()}-01"})


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="POSIX shared memory lives in /dev/shm on Linux")
@pytest.mark.parametrize("writer", ["process", "thread"])
def test_maps_go_through_one_reused_segment_and_none_is_left(tmp_path, writer):
    torch.manual_seed(0)
    eng = CaptureEngine(Config(store=str(tmp_path / "store"), writer=writer, writers=1), [SPEC], 256,
                        torch.float32, "cpu")
    q, k = torch.randn(200, 64), torch.randn(200, 32)
    eng.tap.write(0, q, k, torch.arange(200))
    traces = [new_trace_id() for _ in range(3)]
    names = set()
    for i, trace in enumerate(traces):
        eng.on_finished(_req(120 - i, trace))  # nearby lengths share a segment size
        assert eng.flush(60)
        names |= {s.name for s in eng.maps_pool._free}
    assert eng.maps_pool.created == 1 and len(names) == 1  # one segment, reused by all three
    s = eng.stats.snapshot()
    assert s["stored"] == 3 and s["maps_stored"] == 3 and not s["dropped"]
    for i, trace in enumerate(traces):
        T = 120 - i
        (cap,) = attn_otel.open_trace(trace, store=tmp_path / "store")
        got = cap.maps()[0]  # [H, T, T]
        # the reference: softmax of the tapped Q/K rows the request's 16-token blocks point at (slots 0..T-1)
        qh = q[:T].view(T, 4, 16).permute(1, 0, 2)
        kh = k[:T].view(T, 2, 16).permute(1, 0, 2).repeat_interleave(2, 0)
        logits = (qh @ kh.transpose(1, 2)) * 0.25
        logits.masked_fill_(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        ref = torch.softmax(logits, -1).numpy()
        np.testing.assert_allclose(np.asarray(got, dtype=np.float32), ref, atol=1e-3)
    eng.close()
    assert not any(_exists(n) for n in names)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="POSIX shared memory lives in /dev/shm on Linux")
def test_an_idle_engine_gives_its_maps_segments_back(tmp_path):
    import time

    eng = CaptureEngine(Config(store=str(tmp_path / "store"), writer="thread", writers=1), [SPEC], 256,
                        torch.float32, "cpu")
    eng.maps_pool.idle_s = 2.0  # read by the compute thread at its next wait, after the capture below
    eng.tap.write(0, torch.randn(200, 64), torch.randn(200, 32), torch.arange(200))
    eng.on_finished(_req(100, new_trace_id()))
    assert eng.flush(60) and eng.stats.snapshot()["maps_stored"] == 1
    (seg,) = eng.maps_pool._free
    deadline = time.monotonic() + 10
    while _exists(seg.name) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _exists(seg.name) and eng.maps_pool.free_bytes() == 0
    eng.close()
