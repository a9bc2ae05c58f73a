import dataclasses
import logging
import sys
from pathlib import Path

import pytest

from attn_otel.config import (
    AUTO_LAYERS,
    Config,
    RequestOptions,
    parse_layers,
    parse_request_options,
    resolve_layers,
)

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # kv_capacity's runner stand-in


# --- Config.from_env -----------------------------------------------------------------------------------

def test_empty_environment_gives_the_defaults():
    assert Config.from_env({}) == Config()


def test_defaults_are_off_and_local():
    config = Config()
    assert (config.enabled, config.store, config.layers) == (False, "./attn-otel-data", "auto")


@pytest.mark.parametrize("value", ["1", "true", " YES ", "on"])
def test_attn_otel_truthy_values_enable(value):
    assert Config.from_env({"ATTN_OTEL": value}).enabled


@pytest.mark.parametrize("value", ["0", "", "false", "maybe"])
def test_attn_otel_other_values_leave_it_off(value):
    assert not Config.from_env({"ATTN_OTEL": value}).enabled


def test_every_variable_is_read():
    config = Config.from_env({
        "ATTN_OTEL_STORE": "s3://bucket/prefix",
        "ATTN_OTEL_LAYERS": "16,0,8",
        "ATTN_OTEL_MAPS_SAMPLE": "0.5",
        "ATTN_OTEL_MAX_MAP_TOKENS": "4096",
        "ATTN_OTEL_QUEUE_BYTES": "1000",
        "ATTN_OTEL_STORE_TOKENS": "0",
        "ATTN_OTEL_SINK_TOKENS": "2",
        "ATTN_OTEL_WRITERS": "3",
        "ATTN_OTEL_KV_WRITE": " VLLM",
        "ATTN_OTEL_LAUNCH": "JIT",
        "ATTN_OTEL_FLUSH_KEYS": "Slots",
        "ATTN_OTEL_ENGINE_PRIORITY": "HIGH ",
        "ATTN_OTEL_EVENT_WAIT": "Spin",
    })
    assert config == Config(store="s3://bucket/prefix", layers=(0, 8, 16), maps_sample=0.5, max_map_tokens=4096,
                            queue_bytes=1000, store_tokens=False, sink_tokens=2, writers=3, kv_write="vllm",
                            launch="jit", flush_keys="slots", engine_priority="high", event_wait="spin")


@pytest.mark.parametrize("raw, url", [
    ("http://vllm-host:8000", "http://vllm-host:8000"),
    (" https://example.com/vllm/ ", "https://example.com/vllm"),  # a --root-path; no trailing slash
    ("", None),
])
def test_the_view_url_is_a_base_url(raw, url):
    assert Config.from_env({"ATTN_OTEL_VIEW_URL": raw}).view_url == url


@pytest.mark.parametrize("raw", ["vllm-host:8000", "ftp://host/", "http://user:pw@host:8000", "http://h/?a=1", "/x"])
def test_a_bad_view_url_is_a_warning_and_unset(raw, caplog):
    with caplog.at_level(logging.WARNING, logger="attn_otel"):
        assert Config.from_env({"ATTN_OTEL_VIEW_URL": raw}).view_url is None
    assert "ATTN_OTEL_VIEW_URL" in caplog.text


# --- token ids: content, stored only when asked ---------------------------------------------------------

GENAI = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"


def test_token_ids_are_not_stored_by_default():
    assert Config().store_tokens is False
    assert Config.from_env({}).store_tokens is False


@pytest.mark.parametrize("value", ["1", "true", " ON ", "yes"])
def test_attn_otel_store_tokens_asks_for_them(value):
    assert Config.from_env({"ATTN_OTEL_STORE_TOKENS": value}).store_tokens is True


@pytest.mark.parametrize("value", ["true", "TRUE", "1", "SPAN_ONLY", "EVENT_ONLY", "SPAN_AND_EVENT", "span",
                                   "event"])
def test_opentelemetry_genai_content_capture_asks_for_them(value):
    assert Config.from_env({GENAI: value}).store_tokens is True


@pytest.mark.parametrize("value", ["false", "0", "NO_CONTENT", ""])
def test_opentelemetry_genai_no_content_stores_none(value):
    assert Config.from_env({GENAI: value}).store_tokens is False


def test_attn_otel_store_tokens_0_wins_over_the_genai_variable():
    for value in ("true", "SPAN_AND_EVENT"):
        assert Config.from_env({GENAI: value, "ATTN_OTEL_STORE_TOKENS": "0"}).store_tokens is False


def test_attn_otel_store_tokens_1_wins_over_the_genai_variable():
    assert Config.from_env({GENAI: "NO_CONTENT", "ATTN_OTEL_STORE_TOKENS": "1"}).store_tokens is True


def test_a_bad_attn_otel_store_tokens_leaves_the_choice_to_the_genai_variable(caplog):
    with caplog.at_level(logging.WARNING, logger="attn_otel"):
        assert Config.from_env({GENAI: "true", "ATTN_OTEL_STORE_TOKENS": "maybe"}).store_tokens is True
        assert Config.from_env({"ATTN_OTEL_STORE_TOKENS": "maybe"}).store_tokens is False
    assert "ATTN_OTEL_STORE_TOKENS" in caplog.text


def test_a_bad_genai_value_warns_and_stores_none(caplog):
    with caplog.at_level(logging.WARNING, logger="attn_otel"):
        assert Config.from_env({GENAI: "everything"}).store_tokens is False
    assert GENAI in caplog.text


def test_the_writer_process_gets_the_decision_not_the_variables():
    # writers rebuild Config from dataclasses.asdict(config): the field carries the decision itself
    config = Config.from_env({GENAI: "true"})
    assert Config(**dataclasses.asdict(config)).store_tokens is True


def test_writer_count_auto_is_between_one_and_four():
    from attn_otel.config import writer_count

    assert 1 <= writer_count(Config()) <= 4
    assert writer_count(Config(writers=6)) == 6


def test_blank_store_falls_back_to_the_default():
    assert Config.from_env({"ATTN_OTEL_STORE": "   "}).store == Config().store


@pytest.mark.parametrize("name, value, field", [
    ("ATTN_OTEL_LAYERS", "0,x", "layers"),
    ("ATTN_OTEL_LAYERS", "-1", "layers"),
    ("ATTN_OTEL_MAPS_SAMPLE", "lots", "maps_sample"),
    ("ATTN_OTEL_MAPS_SAMPLE", "1.5", "maps_sample"),
    ("ATTN_OTEL_MAPS_SAMPLE", "nan", "maps_sample"),
    ("ATTN_OTEL_MAX_MAP_TOKENS", "0", "max_map_tokens"),
    ("ATTN_OTEL_MAX_MAP_TOKENS", "1e3", "max_map_tokens"),
    ("ATTN_OTEL_QUEUE_BYTES", "-5", "queue_bytes"),
    ("ATTN_OTEL_SINK_TOKENS", "four", "sink_tokens"),
    ("ATTN_OTEL_STORE_TOKENS", "maybe", "store_tokens"),
    ("ATTN_OTEL_KV_WRITE", "both", "kv_write"),
    ("ATTN_OTEL_LAUNCH", "cached", "launch"),
    ("ATTN_OTEL_FLUSH_KEYS", "pages", "flush_keys"),
    ("ATTN_OTEL_ENGINE_PRIORITY", "highest", "engine_priority"),
    ("ATTN_OTEL_EVENT_WAIT", "yield", "event_wait"),
    ("ATTN_OTEL_AFTER_LAUNCH", "later", "after_launch_at"),
    ("ATTN_OTEL_HOLD_FINISHED", "yes", "hold_finished"),
    ("ATTN_OTEL_FINISH_BATCH_CHUNK", "-1", "finish_batch_chunk"),
    ("ATTN_OTEL_FINISH_BATCH_CHUNK", "half", "finish_batch_chunk"),
    ("ATTN_OTEL_FINISH_BATCH_REQUESTS", "0", "finish_batch_requests"),
    ("ATTN_OTEL_FINISH_BATCH_REQUESTS", "many", "finish_batch_requests"),
    ("ATTN_OTEL_STREAM_DIRECT", "yes", "stream_direct"),
])
def test_bad_value_warns_and_falls_back(caplog, name, value, field):
    with caplog.at_level(logging.WARNING, logger="attn_otel"):
        config = Config.from_env({name: value})
    assert getattr(config, field) == getattr(Config(), field)
    assert name in caplog.text


@pytest.mark.parametrize("raw, on, at", [
    ("0", False, "execute"), ("1", True, "execute"), (" Sample", True, "sample"), ("output", True, "output"),
])
def test_after_launch_says_whether_and_where(raw, on, at):
    config = Config.from_env({"ATTN_OTEL_AFTER_LAUNCH": raw})
    assert (config.after_launch, config.after_launch_at) == (on, at)
    assert (Config().after_launch, Config().after_launch_at) == (True, "execute")  # the default


@pytest.mark.parametrize("env, on", [
    ({}, True), ({"ATTN_OTEL_HOLD_FINISHED": "1"}, True), ({"ATTN_OTEL_HOLD_FINISHED": "0"}, False),
    ({"ATTN_OTEL_FINISH_BATCH_STEPS": "0"}, False),  # no batch to hold them for
])
def test_hold_finished_is_on_where_there_are_finish_batches(env, on):
    assert Config.from_env(env).hold_finished is on


def _runner(step, seqs, spec_tokens=0, mixed="PIECEWISE"):
    """The stand-in for vLLM's runner that bench/kv_capacity.py sizes the ring with."""
    import torch
    from kv_capacity import runner_of

    return runner_of(step, seqs, torch.bfloat16, spec_tokens, mixed)


def _llama_layers(n):
    from attn_otel.tap import LayerSpec

    return [LayerSpec(index=i, name=f"l{i}", num_heads=32, num_kv_heads=8, head_dim=128, scale=128 ** -0.5)
            for i in range(n)]


@pytest.mark.parametrize("raw, where, layers, step, mixed, rows, direct", [
    # auto, kernels beside the forward (the default): direct rows wherever the taps can take a step's plan
    ("auto", "side", 4, 16384, "PIECEWISE", 8192, 1),  # the default 4 layers (run 47: x0.975-0.989, ring x0.96-0.98)
    ("auto", "side", 32, 8192, "PIECEWISE", 8192, 1),  # vllm serve's steps: no ring saved, no prefill flushes
    ("auto", "side", 32, 16384, "FULL", 16384, None),  # mixed batches as full CUDA graphs: never
    # auto, kernels on vLLM's stream: where the ring they save is at least 1 GiB (32 layers of an 8B at 16k steps)
    ("auto", "engine", 32, 16384, "PIECEWISE", 8192, 1),
    ("auto", "engine", 4, 16384, "PIECEWISE", 16384, None),  # the default 4 layers: 0.25 GiB saved, not worth it
    ("auto", "engine", 32, 8192, "PIECEWISE", 8192, None),  # vllm serve's steps: nothing saved
    ("1", "engine", 4, 16384, "PIECEWISE", 8192, 1),
    ("1", "side", 32, 16384, "FULL", 16384, None),  # mixed batches as full CUDA graphs: the taps never see a plan
    ("0", "side", 32, 16384, "PIECEWISE", 16384, None),
])
def test_direct_rows_and_the_ring_they_size(raw, where, layers, step, mixed, rows, direct):
    from attn_otel.vllm_adapter import _ring_rows

    config = Config.from_env({"ATTN_OTEL_STREAM_DIRECT": raw, "ATTN_OTEL_DIRECT_STREAM": where})
    assert _ring_rows(_runner(step, 1024, mixed=mixed), config, _llama_layers(layers)) == (rows, direct)
    assert (Config().stream_direct, Config().direct_stream) == ("auto", "side")


@pytest.mark.parametrize("layers, budget_gib, direct", [
    (4, 58, None),  # 0.25 GiB of 58: under 1%
    (4, 9, 1),  # a big model's small budget on one GPU: 2.8%
    (32, 58, 1),
])
def test_auto_on_vllms_stream_weighs_the_ring_saved_against_the_kv_budget(layers, budget_gib, direct):
    from attn_otel.vllm_adapter import _ring_rows

    runner = _runner(16384, 1024)
    engine = Config.from_env({"ATTN_OTEL_DIRECT_STREAM": "engine"})
    assert _ring_rows(runner, engine, _llama_layers(layers), budget_gib << 30)[1] == direct
    runner._attn_otel_kv_available = budget_gib << 30  # the start-up sizing's, where the install reads it
    assert _ring_rows(runner, engine, _llama_layers(layers))[1] == direct
    assert _ring_rows(runner, Config(), _llama_layers(layers), budget_gib << 30)[1] == 1  # beside: on regardless


def test_direct_rows_leave_a_decode_step_with_speculative_tokens_to_the_ring():
    from attn_otel.vllm_adapter import _ring_rows

    config = Config.from_env({"ATTN_OTEL_STREAM_DIRECT": "1", "ATTN_OTEL_STREAM_ROWS": "256"})
    # a chunk of 1 + 3 drafts is a decode step's (the ring's); the ring holds every running request's 4
    assert _ring_rows(_runner(16384, 512, spec_tokens=3), config, _llama_layers(2)) == (2048, 4)


def test_bad_value_leaves_the_other_variables_alone():
    config = Config.from_env({"ATTN_OTEL_MAPS_SAMPLE": "lots", "ATTN_OTEL_SINK_TOKENS": "7"})
    assert config.sink_tokens == 7


def test_explicit_arguments_override_the_environment():
    config = Config.from_env({"ATTN_OTEL_STORE": "/from/env", "ATTN_OTEL": "0"}, store="/explicit", enabled=True)
    assert (config.store, config.enabled) == ("/explicit", True)


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().enabled = True  # type: ignore[misc]


# --- parse_layers / resolve_layers ---------------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [
    ("all", "all"),
    (" AUTO ", "auto"),
    ("16, 0,8,8", (0, 8, 16)),
    ([3, 1], (1, 3)),
    ((2.0,), (2,)),
])
def test_parse_layers_accepts(value, expected):
    assert parse_layers(value) == expected


@pytest.mark.parametrize("value, message", [
    ("0,x", "not an integer"),
    ("-1", "negative"),
    ([0, -3], "negative"),
    ("", "empty"),
    (" , ", "empty"),
    ([True], "not an integer"),
    ([1.5], "not an integer"),
    ([None], "not an integer"),
    (7, "got int"),
    (None, "got NoneType"),
    ({"0": 1}, "got dict"),
    (b"0,1", "got bytes"),
    (list(range(20_000)), "too long"),
    ("0," * 20_000, "too long"),
])
def test_parse_layers_refuses(value, message):
    with pytest.raises(ValueError, match=message):
        parse_layers(value)


def test_parse_layers_checks_the_model_size():
    with pytest.raises(ValueError, match="does not exist"):
        parse_layers("0,30", num_layers=30)


@pytest.mark.parametrize("num_layers", range(1, 65))
def test_auto_layers_are_few_and_include_first_and_last(num_layers):
    layers = resolve_layers("auto", num_layers)
    assert len(layers) <= AUTO_LAYERS
    assert layers[0] == 0 and layers[-1] == num_layers - 1
    assert list(layers) == sorted(set(layers))


def test_auto_layers_are_evenly_spaced():
    assert resolve_layers("auto", 30) == (0, 10, 19, 29)


def test_all_layers_resolve_to_every_layer():
    assert resolve_layers("all", 5) == (0, 1, 2, 3, 4)


def test_explicit_layers_beyond_the_model_are_dropped():
    assert resolve_layers((0, 8, 40), 30) == (0, 8)


# --- parse_request_options -----------------------------------------------------------------------------

@pytest.mark.parametrize("extra_args", [None, {}, ["attn_otel", "maps"], "maps", 42])
def test_no_or_non_mapping_extra_args_give_the_defaults(extra_args):
    assert parse_request_options(extra_args) == RequestOptions()


def test_good_request_options_are_read():
    options = parse_request_options({"attn_otel": " Maps ", "attn_otel_layers": "3,0", "traceparent": TRACEPARENT})
    assert options == RequestOptions(mode="maps", layers=(0, 3), traceparent=TRACEPARENT)


def test_unrelated_extra_args_are_ignored():
    assert parse_request_options({"temperature_schedule": [1, 2], "other": object()}) == RequestOptions()


@pytest.mark.parametrize("layers", ["all", "auto"])
def test_all_or_auto_request_layers_mean_the_default(layers):
    options = parse_request_options({"attn_otel_layers": layers})
    assert options.layers is None and options.warnings == ()


@pytest.mark.parametrize("mode", ["everything", "", 1, True, ["maps"], {"maps": 1}, 3.5])
def test_bad_mode_warns_and_uses_the_default(mode):
    options = parse_request_options({"attn_otel": mode})
    assert options.mode is None
    assert len(options.warnings) == 1 and "attn_otel=" in options.warnings[0]


@pytest.mark.parametrize("layers", ["0,-1", [-2], "x", [0.5], {"a": 1}, 3, list(range(100_000)), "1," * 100_000])
def test_bad_request_layers_warn_and_use_the_default(layers):
    options = parse_request_options({"attn_otel_layers": layers})
    assert options.layers is None
    assert len(options.warnings) == 1 and "attn_otel_layers=" in options.warnings[0]


@pytest.mark.parametrize("traceparent", [
    "not-a-traceparent",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",  # no flags
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # forbidden version
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # all-zero trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # all-zero parent id
    TRACEPARENT.encode(),
    12345,
    TRACEPARENT.upper(),  # OpenTelemetry's propagator: lowercase hex only
    TRACEPARENT + "-extra",  # version 00 has four fields
])
def test_bad_traceparent_warns_and_is_dropped(traceparent):
    options = parse_request_options({"traceparent": traceparent})
    assert options.traceparent is None
    assert len(options.warnings) == 1 and "traceparent=" in options.warnings[0]


def test_a_good_traceparent_is_kept_as_opentelemetry_writes_it():
    assert parse_request_options({"traceparent": f"  {TRACEPARENT}\t"}).traceparent == TRACEPARENT
    future = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-more"
    assert parse_request_options({"traceparent": future}).traceparent == TRACEPARENT[:-2] + "00"


def test_one_bad_option_does_not_drop_the_good_ones():
    options = parse_request_options({"attn_otel": "maps", "attn_otel_layers": "x", "traceparent": TRACEPARENT})
    assert (options.mode, options.traceparent) == ("maps", TRACEPARENT)


def test_huge_hostile_values_give_short_warnings():
    options = parse_request_options({"attn_otel": "m" * 1_000_000, "attn_otel_layers": "9" * 1_000_000,
                                     "traceparent": "0" * 1_000_000})
    assert len(options.warnings) == 3
    assert all(len(w) < 300 for w in options.warnings)


def test_auto_writers_are_shared_among_the_ranks_of_a_parallel_engine(monkeypatch):
    from attn_otel.config import writer_count

    monkeypatch.setattr("os.cpu_count", lambda: 64)
    assert writer_count(Config()) == 4
    assert writer_count(Config(), ranks=8) == 2  # 8 ranks on a 64-CPU host: 16 writers, not 32
    assert writer_count(Config(), ranks=32) == 1
    assert writer_count(Config(writers=3), ranks=8) == 3  # an explicit count is per rank, as given


def test_map_layers_and_stream_rows():
    from attn_otel.config import resolve_map_layers

    c = Config.from_env({"ATTN_OTEL_MAP_LAYERS": "0,16", "ATTN_OTEL_STREAM_ROWS": "4096"})
    assert c.map_layers == (0, 16) and c.stream_rows == 4096
    assert Config.from_env({"ATTN_OTEL_MAP_LAYERS": "x"}).map_layers == "auto"  # a warning and the default
    assert Config.from_env({"ATTN_OTEL_STREAM_ROWS": "-1"}).stream_rows == 0
    # auto: every captured layer when at most 4 are captured, else 4 of them evenly spaced
    assert resolve_map_layers("auto", (0, 10, 19, 29)) == (0, 10, 19, 29)
    assert resolve_map_layers("auto", range(32)) == (0, 10, 21, 31)
    assert resolve_map_layers("auto", (3, 5, 7, 9, 11, 13)) == (3, 7, 9, 13)
    assert resolve_map_layers("all", (1, 2)) == (1, 2)
    assert resolve_map_layers((0, 16, 40), range(32)) == (0, 16)  # only captured layers


def test_finish_batch_requests_default_and_set():
    assert Config().finish_batch_requests == 64  # the count rule of attn_otel.deferred, as before it was a variable
    assert Config.from_env({"ATTN_OTEL_FINISH_BATCH_REQUESTS": "256"}).finish_batch_requests == 256


def test_finish_batch_chunk_default_and_zero():
    assert Config().finish_batch_chunk == 0  # whole batches (run 50: chunks of 32 were no faster)
    assert Config.from_env({"ATTN_OTEL_FINISH_BATCH_CHUNK": "32"}).finish_batch_chunk == 32
    assert Config.from_env({"ATTN_OTEL_FINISH_BATCH_CHUNK": "8"}).finish_batch_chunk == 8
