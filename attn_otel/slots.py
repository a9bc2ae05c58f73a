"""KV-cache slot ids of a request's positions, and host index arrays moved to the device without a sync.

Shared by the device capture (:mod:`attn_otel.stream`), the finish-time kernels (:mod:`attn_otel.triton_metrics`)
and the finish paths (:mod:`attn_otel.finish`, :mod:`attn_otel.compute`); it imports nothing of theirs.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def upload(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` with no sync: through pinned memory, non-blocking, on a GPU (a blocking
    copy would wait for, and so drain, the work the engine has queued ahead)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def slots_of(block_ids: Sequence[int], block_size: int, start: int, n: int) -> np.ndarray:
    """KV-cache slots of positions ``start .. start + n - 1`` of a request with these blocks."""
    if n == 1:
        return np.asarray([block_ids[start // block_size] * block_size + start % block_size], dtype=np.int64)
    pos = np.arange(start, start + n, dtype=np.int64)
    return np.asarray(block_ids, dtype=np.int64)[pos // block_size] * block_size + pos % block_size
