"""Seconds to compile each metric kernel variant the engine warms up (GPU; a fresh Triton cache).

    python3 bench/compile_times.py
"""

import os
import sys
import tempfile
import time

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from attn_otel import triton_metrics as tm  # noqa: E402

dev = torch.device("cuda")
for block in tm.summary_buckets():
    for dtype in (torch.float16, torch.float32):
        t = time.perf_counter()
        tm.warm_up_summary(block, dtype, dev)
        torch.cuda.synchronize()
        print(f"summaries block {block or 'looped'} {dtype}: {time.perf_counter() - t:.2f} s", flush=True)
H, HKV, D = 32, 8, 128
q = torch.zeros(64, H, D, dtype=torch.bfloat16, device=dev)
k = torch.zeros(64, HKV, D, dtype=torch.bfloat16, device=dev)
slots = torch.zeros(1, dtype=torch.int64, device=dev)
cu = torch.tensor([0, 1], dtype=torch.int32, device=dev)
prompt = torch.ones(1, dtype=torch.int32, device=dev)
t = time.perf_counter()
tm.row_metrics_slots(q, k, slots, cu, prompt, 1, D ** -0.5, 4)
torch.cuda.synchronize()
print(f"row_metrics_slots: {time.perf_counter() - t:.2f} s", flush=True)
