"""ATTN_OTEL_ENGINE_PRIORITY's hook (attn_otel.engine_stream) on the CPU build's own vLLM modules: the worker's
set-up function wrapped once, the stream made before it runs, and a stream vLLM already made left alone.  The
stream's priority itself needs a GPU: tests/test_gpu_stream.py checks it in a served engine."""

import logging
import types

import pytest
from vllm.utils import torch_utils

from attn_otel import engine_stream


@pytest.fixture
def fresh_state(monkeypatch):
    monkeypatch.setattr(engine_stream, "_STATE", {})
    monkeypatch.setattr(torch_utils._current_stream_tls, "value", None, raising=False)


def test_install_wraps_the_set_up_once_and_runs_the_hook_before_it(fresh_state, monkeypatch):
    order = []
    module = types.SimpleNamespace(init_worker_distributed_environment=lambda *a, **k: order.append(("init", a, k)))
    monkeypatch.setattr(engine_stream, "raise_priority", lambda tu: order.append(("hook", tu)))
    engine_stream.install(module, torch_utils)
    wrapped = module.init_worker_distributed_environment
    engine_stream.install(module, torch_utils)  # idempotent: not wrapped twice
    assert module.init_worker_distributed_environment is wrapped
    wrapped("cfg", 0, local_rank=0)
    assert order == [("hook", torch_utils), ("init", ("cfg", 0), {"local_rank": 0})]


def test_a_stream_vllm_made_already_is_left_and_logged(fresh_state, caplog):
    made = types.SimpleNamespace(priority=0)
    torch_utils._current_stream_tls.value = made
    with caplog.at_level(logging.WARNING, logger="attn_otel"):
        engine_stream.raise_priority(torch_utils)
    assert torch_utils._current_stream_tls.value is made
    assert engine_stream.state() == {"priority": 0, "raised": False}
    assert "left at priority 0" in caplog.text


def test_the_stream_is_made_only_where_there_is_a_gpu(fresh_state):
    import torch

    before = torch.cuda.current_stream() if torch.cuda.is_available() else None
    engine_stream.raise_priority(torch_utils)
    if before is None:  # the CPU build (CI): nothing made, nothing recorded
        assert torch_utils._current_stream_tls.value is None and engine_stream.state() == {}
        return
    try:  # a CUDA machine: this thread's stream is the new one, at PRIORITY
        assert engine_stream.state() == {"priority": engine_stream.PRIORITY, "raised": True}
        assert torch.cuda.current_stream() == torch_utils._current_stream_tls.value != before
        assert torch.cuda.current_stream().priority == engine_stream.PRIORITY
    finally:
        torch.cuda.set_stream(before)
