import re

import pytest

from attn_otel.ids import (
    InvalidTraceId,
    canonical_traceparent,
    check_trace_id,
    maps_sampled,
    new_span_id,
    new_trace_id,
    new_traceparent,
    parse_traceparent,
    request_key,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID = "00f067aa0ba902b7"


# --- parse_traceparent: OpenTelemetry's W3C propagator ---------------------------------------------------

def test_traceparent_gives_trace_and_parent_span():
    assert parse_traceparent(f"00-{TRACE_ID}-{SPAN_ID}-01") == (TRACE_ID, SPAN_ID)


def test_traceparent_surrounding_whitespace_is_ignored():
    assert parse_traceparent(f"  00-{TRACE_ID}-{SPAN_ID}-00\n") == (TRACE_ID, SPAN_ID)


def test_a_future_version_with_more_fields_is_read_and_rewritten_as_version_00():
    value = f"cc-{TRACE_ID}-{SPAN_ID}-09-what-the-future-will-be-like"
    assert parse_traceparent(value) == (TRACE_ID, SPAN_ID)
    assert canonical_traceparent(value) == f"00-{TRACE_ID}-{SPAN_ID}-09"


@pytest.mark.parametrize("value", [
    "",
    f"00-{TRACE_ID}-{SPAN_ID}",
    f"00-{TRACE_ID[:-1]}-{SPAN_ID}-01",
    f"00-{TRACE_ID}-{SPAN_ID}0-01",
    f"00-{TRACE_ID[:-1]}g-{SPAN_ID}-01",
    f"ff-{TRACE_ID}-{SPAN_ID}-01",
    f"00-{'0' * 32}-{SPAN_ID}-01",
    f"00-{TRACE_ID}-{'0' * 16}-01",
    f"00_{TRACE_ID}_{SPAN_ID}_01",
    f"00-{TRACE_ID.upper()}-{SPAN_ID}-01",  # W3C: lowercase hex only
    f"00-{TRACE_ID}-{SPAN_ID.upper()}-01",
    f"00-{TRACE_ID}-{SPAN_ID}-0A",
    f"00-{TRACE_ID}-{SPAN_ID}-01-extra",  # version 00 has exactly four fields
    f"0-{TRACE_ID}-{SPAN_ID}-01",
    f"00-{TRACE_ID}-{SPAN_ID}-1",
    f"00-{TRACE_ID}-{SPAN_ID}-01" + "-x" * 300,  # past the propagator's 512 characters
])
def test_malformed_traceparent_is_none(value):
    assert parse_traceparent(value) is None
    assert canonical_traceparent(value) is None


@pytest.mark.parametrize("value", [None, 12, b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", ["x"]])
def test_non_string_traceparent_is_none(value):
    assert parse_traceparent(value) is None  # type: ignore[arg-type]


def test_the_propagator_writes_version_00_lowercase():
    assert canonical_traceparent(f" 00-{TRACE_ID}-{SPAN_ID}-03 ") == f"00-{TRACE_ID}-{SPAN_ID}-03"
    made = new_traceparent()
    assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-01", made) and canonical_traceparent(made) == made


# --- new ids -------------------------------------------------------------------------------------------

def test_new_trace_id_is_a_valid_trace_id():
    trace_id = new_trace_id()
    assert check_trace_id(trace_id) == trace_id


def test_new_trace_ids_differ():
    assert len({new_trace_id() for _ in range(100)}) == 100


def test_new_span_id_is_16_hex_digits():
    assert re.fullmatch(r"[0-9a-f]{16}", new_span_id())


# --- check_trace_id ------------------------------------------------------------------------------------

def test_check_trace_id_normalises_case_and_whitespace():
    assert check_trace_id(f" {TRACE_ID.upper()} ") == TRACE_ID


@pytest.mark.parametrize("value", ["../../etc", "", TRACE_ID[:-1], TRACE_ID + "0", TRACE_ID[:-1] + "/",
                                   f"{TRACE_ID[:16]}/../{TRACE_ID[:13]}", None, 123, TRACE_ID.encode()])
def test_check_trace_id_refuses(value):
    with pytest.raises(InvalidTraceId, match="not a trace id"):
        check_trace_id(value)


def test_invalid_trace_id_is_a_value_error():
    assert issubclass(InvalidTraceId, ValueError)


def test_check_trace_id_message_stays_short_for_huge_input():
    with pytest.raises(InvalidTraceId) as info:
        check_trace_id("x" * 1_000_000)
    assert len(str(info.value)) < 200


# --- request_key ---------------------------------------------------------------------------------------

def test_safe_request_id_is_its_own_key():
    assert request_key("cmpl-3f2a_0.1") == "cmpl-3f2a_0.1"


@pytest.mark.parametrize("request_id", ["../../etc/passwd", ".", "..", "a/b", "a\\b", "", "x" * 1000, "id\x00\n"])
def test_unsafe_request_id_gets_a_path_safe_key(request_id):
    key = request_key(request_id)
    assert re.fullmatch(r"[A-Za-z0-9._-]+", key)
    assert key not in (".", "..") and not key.startswith(".")
    assert len(key) <= 128


def test_request_ids_that_escape_alike_keep_distinct_keys():
    assert request_key("a/b") != request_key("a_b")
    assert request_key("a/b") != request_key("a\\b")


def test_request_key_is_stable():
    assert request_key("a/b") == request_key("a/b")


# --- maps_sampled --------------------------------------------------------------------------------------

def test_full_and_zero_fractions_are_all_or_nothing():
    assert maps_sampled(TRACE_ID, 1.0) and not maps_sampled(TRACE_ID, 0.0)


def test_sampling_is_deterministic_per_trace():
    ids = [new_trace_id() for _ in range(200)]
    assert [maps_sampled(t, 0.3) for t in ids] == [maps_sampled(t, 0.3) for t in ids]


def test_sampling_keeps_about_the_fraction():
    ids = [new_trace_id() for _ in range(4000)]
    share = sum(maps_sampled(t, 0.25) for t in ids) / len(ids)
    assert 0.2 < share < 0.3


def test_traceparent_sampled_flag():
    from attn_otel.ids import traceparent_sampled

    trace, span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    assert traceparent_sampled(f"00-{trace}-{span}-01")
    assert not traceparent_sampled(f"00-{trace}-{span}-00")
    assert traceparent_sampled(f"00-{trace}-{span}-03")  # other flag bits beside sampled
    assert not traceparent_sampled(f"00-{trace}-{span}-02")
    assert traceparent_sampled("garbage")  # not a traceparent: nothing says "not sampled"
