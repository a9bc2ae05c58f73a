"""The finish-time summary kernel (attn_otel.triton_metrics.summaries) on parts of every length a request can have:
a part of up to SUMMARY_MAX_ROWS rows in one program's registers, in as many warps as its length needs, and a
longer one by the looped program, read SUMMARY_LOOP_ROWS at a time.  Both equal device_summaries' torch code (itself
checked against NumPy in tests/test_stream.py).

In CI the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, in a subprocess: the interpreter is chosen
when a kernel is defined) and is compiled for an H100 by Triton's own ptxas; ``-m gpu`` runs it compiled
(tests/test_gpu_triton.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve().parent


def rows_and_parts(dtype: torch.dtype, device: str, long_part: int):
    """Per-row metrics of 5 requests, ``[L, 7, H, sum T]`` viewed from ``[L, T, 7, H]`` as the stream's gather
    gives them: a short one, one whose prompt is past 2,048 rows (the largest bucket before run 44), one with a
    long generated part, a prompt-only one, and one of ``long_part`` prompt rows; NaN rows and a negative metric."""
    g = torch.Generator().manual_seed(5)
    L, M, H = 1, 7, 2
    Ts = [40, 3000, 2200 + 2600, 700, long_part + 3]
    Ns = [25, 2900, 2200, 700, long_part]
    base = (torch.rand(L, sum(Ts), M, H, generator=g) - 0.3).to(dtype)
    rows = base.permute(0, 2, 3, 1)
    rows[:, 0] = torch.round(rows[:, 0] * 64) / 64  # ties
    rows[:, 1] = -rows[:, 1].abs()
    rows[:, 2:4, :, ::3] = float("nan")
    rows[:, 4:6] = float("nan")  # no image
    cu = np.concatenate([[0], np.cumsum(Ts)]).tolist()
    return rows.to(device), cu, Ns


def cases(device: str) -> dict:
    """(In the interpreter: ``device`` cpu.)  For float16 and float32 rows: the kernel against the torch code,
    request by request."""
    from attn_otel import triton_metrics as tm
    from attn_otel.finish import device_summaries

    if device == "cpu":  # the interpreter runs the kernel on host tensors
        tm.available = lambda *a, **k: True
    res = {}
    for dtype in (torch.float16, torch.float32):
        rows, cu, Ns = rows_and_parts(dtype, device, tm.SUMMARY_MAX_ROWS + 1000)
        want = device_summaries(rows, cu, Ns, vision=False, fused=False)
        out = torch.full(want.shape, float("nan"), device=device)
        done = tm.summaries(rows, cu, Ns, False, (0.1, 0.5, 0.9), out)
        w, o = (t.cpu().double().numpy() for t in (want, out))
        res[str(dtype)] = {
            "done": done,
            "defined": [int((~np.isnan(w[b])).sum()) for b in range(len(Ns))],
            "nan_agree": bool(np.array_equal(np.isnan(o), np.isnan(w))),
            "err": [_err(o[b], w[b]) for b in range(len(Ns))],
        }
    return res


def _err(got: np.ndarray, want: np.ndarray) -> float:
    """The largest difference in units of assert_allclose's rtol=1e-5, atol=1e-6 (<= 1: within them)."""
    return float(np.nanmax(np.abs(got - want) / (1e-6 + 1e-5 * np.abs(want))))


def test_every_part_up_to_the_limit_is_summarised_by_the_kernel_in_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]))
    code = "import json, test_triton_summaries as t; print('RESULT ' + json.dumps(t.cases('cpu')))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _check(json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):]))


@pytest.mark.gpu
def test_every_part_up_to_the_limit_is_summarised_by_the_kernel_on_the_gpu():
    _check(cases("cuda"))


def _check(res: dict) -> None:
    assert set(res) == {"torch.float16", "torch.float32"}
    for dtype, r in res.items():
        assert r["done"] is True and r["nan_agree"], (dtype, r)
        # every request has defined summaries (the prompt-only one no generated part), the long one's by the loop
        assert min(r["defined"]) >= 30 and len(r["defined"]) == 5, (dtype, r)
        # the means are float32 sums in another order; the quantiles are the same order statistics
        assert max(r["err"]) <= 1, (dtype, r)


@pytest.mark.parametrize("block", [2048, 4096, 16384, 0])
@pytest.mark.parametrize("nbits", [16, 32])
def test_every_length_bucket_compiles_for_an_h100_in_its_warps(block, nbits):
    """The interpreter does not check what only the compiler does: compile each new bucket (and the largest of
    the old, and the looped program: bucket 0) to an sm_90 cubin in the warps summaries() launches it with, with
    Triton's own ptxas, no GPU."""
    from sm90 import compile_sm90

    from attn_otel import triton_metrics as tm

    fn = tm._summaries
    assert tm.summary_buckets()[-2:] == [tm.SUMMARY_MAX_ROWS, 0] and tm.SUMMARY_MAX_ROWS == 16384
    rows = block or tm.SUMMARY_LOOP_ROWS
    warps = tm.summary_warps(rows)
    assert warps == max(4, rows // 512)
    consts = dict(VISION=False, M=7, NBITS=nbits, BLOCK=rows, LOOPED=block == 0)
    ptrs = {"X": "*fp16" if nbits == 16 else "*fp32", "SEG": "*i64", "OUT": "*fp32",
            **{q: "fp32" for q in ("q1", "q2", "q3")}}
    compiled = compile_sm90(fn, consts, ptrs, num_warps=warps)
    assert compiled.asm["cubin"] and compiled.metadata.num_warps == warps
    assert f".reqntid {32 * warps}" in compiled.asm["ptx"]  # the threads it launches with
