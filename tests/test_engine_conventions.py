"""Conventions, through the real engine (CPU build, SmolLM2 from a local folder, served under a name of its
own): the capture records the served model name (never the local path), vLLM's finish reason (stop, length,
abort), and a W3C traceparent only where OpenTelemetry's propagator accepts it."""

import json

import pytest

import attn_otel
from attn_otel.ids import new_span_id, new_trace_id

pytestmark = pytest.mark.engine

PROMPT = "The capital of France is"


def _params(trace_id, **kw):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, extra_args={"traceparent": f"00-{trace_id}-{new_span_id()}-01"}, **kw)


def _capture(engine, trace_id):
    (cap,) = attn_otel.open_trace(trace_id, store=engine.store)
    return cap


def test_a_model_loaded_from_a_local_path_records_its_served_name(engine):
    trace_id = new_trace_id()
    engine.generate([PROMPT], _params(trace_id, max_tokens=2))
    cap = _capture(engine, trace_id)
    assert engine.served_model_name and cap.model == cap.meta["model"] == engine.served_model_name
    assert engine.model_path not in json.dumps(cap.meta)  # the local folder appears nowhere in the capture


def test_finish_reasons_length_and_stop_are_vllms_own(engine):
    length, stop = new_trace_id(), new_trace_id()
    outs = engine.generate([PROMPT, PROMPT], [_params(length, max_tokens=3, ignore_eos=True),
                                              _params(stop, max_tokens=24, stop=["Paris"])])
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "stop"]  # what vLLM told the client
    assert outs[1].outputs[0].stop_reason == "Paris"
    assert _capture(engine, length).finish_reason == "length"
    assert _capture(engine, stop).finish_reason == "stop"


def test_finish_reason_stop_at_eos(engine):
    from vllm import SamplingParams

    tok = engine.llm.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hi."}], tokenize=False,
                                     add_generation_prompt=True)
    trace_id = new_trace_id()
    (out,) = engine.generate([prompt], SamplingParams(
        temperature=0.0, max_tokens=200, extra_args={"traceparent": f"00-{trace_id}-{new_span_id()}-01"}))
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason is None  # EOS, no stop string
    assert _capture(engine, trace_id).finish_reason == "stop"


def test_an_aborted_request_is_captured_as_abort(engine):
    llm_engine = engine.llm.llm_engine
    trace_id = new_trace_id()
    request_id = f"abort-me-{trace_id[:8]}"
    llm_engine.add_request(request_id, PROMPT, _params(trace_id, max_tokens=500, ignore_eos=True))
    generated = 0
    for _ in range(50):  # prefill, then a few decode steps: the request is running when it is aborted
        for out in llm_engine.step():
            if out.request_id == request_id:
                generated = len(out.outputs[0].token_ids)
        if generated >= 3:
            break
    assert 3 <= generated < 500
    llm_engine.abort_request([request_id])
    engine.drain()  # the next step tells the worker; the capture is written
    cap = _capture(engine, trace_id)
    assert cap.finish_reason == "abort"
    assert cap.num_tokens >= cap.prompt_len + 2  # what went through the model before the abort


def test_an_uppercase_traceparent_is_not_trusted_offline(engine):
    trace_id = new_trace_id()
    from vllm import SamplingParams

    upper = f"00-{trace_id.upper()}-{new_span_id()}-01"
    engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=2, extra_args={"traceparent": upper}))
    with pytest.raises(attn_otel.TraceNotFound):
        attn_otel.open_trace(trace_id, store=engine.store)  # a new trace was made instead
