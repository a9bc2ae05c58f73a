"""Device time of a call, for the kernel benchmarks (GPU): CUDA events around ``reps`` calls, after warm-ups."""

from __future__ import annotations

from typing import Callable

import torch


def device_ms(fn: Callable[[], object], reps: int, warmups: int = 1) -> float:
    """Milliseconds one call of ``fn`` takes on the current device: ``warmups`` calls first (compile, warm
    caches), then CUDA events around ``reps`` calls enqueued back to back, divided by ``reps``."""
    for _ in range(warmups):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps
