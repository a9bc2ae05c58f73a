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


# (place, the step samples, an engine core steps in this process) -> vLLM's calls and the flush, in order
ORDERS = [
    ("execute", True, False, ["execute", "flush", "sample", "output"]),  # as the forward returns
    ("execute", True, True, ["execute", "flush", "sample", "output"]),
    ("sample", True, False, ["execute", "sample", "flush", "output"]),  # after the sampler
    ("sample", True, True, ["execute", "sample", "flush", "output"]),
    # execute_model left no execute_model_state (nothing to sample, a failed step): vLLM calls no sample_tokens
    # with work for it, so waiting for one would hold the work to the next step's forward
    ("sample", False, False, ["execute", "flush", "output"]),
    ("output", True, True, ["execute", "sample", "output", "flush"]),  # after the engine core took the output
    ("output", False, True, ["execute", "output", "flush"]),  # post_step follows every step, an empty one too
    # a worker process of a multiprocess executor: no post_step comes to it, so it falls back to sample
    ("output", True, False, ["execute", "sample", "flush", "output"]),
    ("output", False, False, ["execute", "flush", "output"]),
]


@pytest.mark.parametrize("at, sampled, core_here, order", ORDERS)
def test_the_work_runs_where_it_is_asked_to_and_is_counted_there(step, at, sampled, core_here, order):
    engine, run = step(at)
    assert run(sampled_step=sampled, core_here=core_here) == order
    where = order[order.index("flush") - 1]  # the call it ran after
    assert engine.stats.after_launch_at == {where: 1}


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
