"""The README's main job: `attn-otel demo` serves SmolLM2 with capture on (vLLM's default multiprocess
engine), prints the trace ids of its captures and writes a heatmap."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import attn_otel

pytestmark = pytest.mark.engine


def test_demo_prints_trace_ids_and_writes_a_heatmap(tmp_path, smollm2_path):
    exe = Path(sys.executable).with_name("attn-otel")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATTN_OTEL", "VLLM_"))}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    # where compiled graphs are cached, as for every engine of the suite (tests/conftest.py says why): a demo
    # run after an earlier one on this machine loads its graphs instead of compiling them again
    env["VLLM_USE_AOT_COMPILE"] = os.environ.get("VLLM_USE_AOT_COMPILE", "0")
    res = subprocess.run([str(exe), "demo", "--store", str(tmp_path / "store"), "-o", str(tmp_path / "demo.png"),
                          "--max-tokens", "8"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    traces = re.findall(r"^([0-9a-f]{32})  (maps|metrics)", res.stdout, re.M)
    assert len(traces) == 3, res.stdout
    for trace_id, mode in traces:
        (cap,) = attn_otel.open_trace(trace_id, store=tmp_path / "store")
        assert cap.has_maps == (mode == "maps")
        assert cap.token_ids is not None  # the demo asks for token ids (off by default) to label its heatmap
    assert "Paris" in res.stdout  # the real trained model answers
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"
