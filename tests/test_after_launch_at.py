"""Where the capture work no forward waits for runs (ATTN_OTEL_AFTER_LAUNCH): as vLLM's ``execute_model``
returns, after its ``sample_tokens``, or after the engine core's ``post_step``.  The wrappers are driven here
in the order vLLM calls them, around a stand-in runner (the real engine runs each place in
tests/test_engine_stream.py, output, and tests/test_engine_variants.py, execute and sample)."""

from types import SimpleNamespace

import pytest

from attn_otel import vllm_adapter as va
from attn_otel.config import Config
from attn_otel.stats import Stats


class Stream:
    """A stream whose flush at half the ring is due: it records when it ran."""

    def __init__(self, log):
        self.flush_due, self.log = True, log

    def after_launch(self):
        self.log.append("flush")
        self.flush_due = False


@pytest.fixture
def step(monkeypatch):
    """(engine, runner, log, run) where run(sampled=True, core_here=False) drives one step through the wrappers
    and returns the log: vLLM's calls and the flush, in order."""
    monkeypatch.setattr(va, "_ENGINE_CORE_HERE", [False])
    log = []

    def make(at):
        engine = SimpleNamespace(config=Config(after_launch_at=at), stream=Stream(log), after_launch=None,
                                 stats=Stats(), warn_once=lambda *a, **k: None)
        runner = SimpleNamespace(_attn_otel=engine, execute_model_state=None)
        monkeypatch.setattr(va, "_ENGINES", [engine])

        def execute(r):
            log.append("execute")
            r.execute_model_state = "pending" if sampled[0] else None

        def sample(r):
            log.append("sample")
            r.execute_model_state = None

        sampled = [True]

        def run(sampled_step=True, core_here=False):
            va._ENGINE_CORE_HERE[0] = core_here
            sampled[0] = sampled_step
            engine.stream.flush_due = True
            va._after_launch(execute, runner)
            if sampled_step:
                va._after_sample(sample, runner)
            va._after_output(lambda core: log.append("output"), object())
            out = list(log)
            log.clear()
            return out

        return engine, run

    return make


def test_execute_runs_it_as_the_forward_returns(step):
    engine, run = step("execute")
    assert run() == ["execute", "flush", "sample", "output"]
    assert engine.stats.after_launch_at == {"execute": 1}


def test_sample_runs_it_after_the_sampler(step):
    engine, run = step("sample")
    assert run() == ["execute", "sample", "flush", "output"]
    assert run(core_here=True) == ["execute", "sample", "flush", "output"]
    assert engine.stats.after_launch_at == {"sample": 2}


def test_a_step_without_a_sampler_to_follow_runs_it_as_the_forward_returns(step):
    """execute_model left no execute_model_state (nothing to sample, a failed step): vLLM calls no
    sample_tokens with work for it, so waiting for one would hold the work to the next step's forward."""
    engine, run = step("sample")
    assert run(sampled_step=False) == ["execute", "flush", "output"]
    assert engine.stats.after_launch_at == {"execute": 1}


def test_output_runs_it_after_the_engine_core_took_the_steps_output(step):
    engine, run = step("output")
    assert run(core_here=True) == ["execute", "sample", "output", "flush"]
    assert engine.stats.after_launch_at == {"output": 1}


def test_output_waits_for_the_engine_cores_step_even_where_nothing_is_sampled(step):
    """An empty step (finished requests only): post_step follows it as it follows every step."""
    engine, run = step("output")
    assert run(sampled_step=False, core_here=True) == ["execute", "output", "flush"]
    assert engine.stats.after_launch_at == {"output": 1}


def test_output_without_an_engine_core_here_runs_it_after_the_sampler(step):
    """A worker process of a multiprocess executor: no post_step comes to it, so it falls back to sample."""
    engine, run = step("output")
    assert run(core_here=False) == ["execute", "sample", "flush", "output"]
    assert engine.stats.after_launch_at == {"sample": 1}


def test_nothing_due_is_not_counted(step):
    engine, run = step("execute")
    engine.stream.flush_due = False
    va._after_launch(lambda r: None, SimpleNamespace(_attn_otel=engine, execute_model_state=None))
    assert engine.stats.after_launch_at == {}


def test_a_failed_forward_still_runs_it_and_raises(step):
    engine, _ = step("execute")

    def boom(r):
        raise RuntimeError("forward failed")

    with pytest.raises(RuntimeError, match="forward failed"):
        va._after_launch(boom, SimpleNamespace(_attn_otel=engine, execute_model_state=None))
    assert engine.stats.after_launch_at == {"execute": 1} and not engine.stream.flush_due
