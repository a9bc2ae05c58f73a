"""attn_otel.slots.upload on a GPU: small host arrays go through one pinned ring buffer (no pinned allocation
per upload), asynchronously.  A region of the ring is written again only once the copy that read it is done,
even when the stream is held up behind long work and the ring wraps many times.

Run on the lent GPU machine: ``python3 -P -m pytest -m gpu tests/test_gpu_upload.py``.
"""

import threading

import numpy as np
import pytest
import torch

from attn_otel import slots

pytestmark = pytest.mark.gpu


def _arrays(seed: int, n: int):
    rng = np.random.default_rng(seed)
    dtypes = [np.int64, np.int32, np.float32, np.float16, np.uint8]
    for i in range(n):
        shape = (int(rng.integers(1, 700)),) if i % 3 else (2, int(rng.integers(1, 300)))
        yield (rng.integers(-1000, 1000, shape)).astype(dtypes[i % len(dtypes)])


def test_ring_never_overwrites_a_region_its_copy_still_reads():
    dev = torch.device("cuda")
    ring = slots._PinnedRing(dev, nbytes=64 << 10)  # small: wraps every few dozen uploads
    stream = torch.cuda.Stream()
    outs = []
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # the copies queue behind ~0.1 s of device work
        for a in _arrays(0, 400):
            outs.append((a, ring.upload(a)))
    torch.cuda.synchronize()
    assert ring.waits > 0, "the test should make the ring wait for copies still queued"
    for a, t in outs:
        assert t.device.type == "cuda" and tuple(t.shape) == a.shape
        np.testing.assert_array_equal(t.cpu().numpy(), a)


def test_upload_from_two_threads_and_large_arrays():
    dev = torch.device("cuda")
    results: dict[int, list] = {0: [], 1: []}

    def work(k: int) -> None:
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            for a in _arrays(10 + k, 300):
                results[k].append((a, slots.upload(a, dev)))
        s.synchronize()

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    big = np.arange(300_000, dtype=np.int64)  # 2.4 MB: torch's own pinned copy
    pairs = results[0] + results[1] + [(big, slots.upload(big, dev)), (big[:0], slots.upload(big[:0], dev))]
    torch.cuda.synchronize()
    assert len(pairs) == 602
    for a, t in pairs:
        np.testing.assert_array_equal(t.cpu().numpy(), a)
