import json
import re

import matplotlib.image
import numpy as np
import pytest
import zarr
from synthetic import make_record, write

from attn_otel import cli
from attn_otel.ids import new_trace_id
from attn_otel.reader import open_trace
from attn_otel.store import capture_prefix

FP16_ATOL = 5e-4
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def no_store_in_environment(monkeypatch):
    monkeypatch.delenv("ATTN_OTEL_STORE", raising=False)


@pytest.fixture
def store(tmp_path):
    return tmp_path / "store"


@pytest.fixture
def captured(store):
    """One complete capture with maps: layers 0, 3, 7; 3 heads; 12 tokens, 8 of them prompt."""
    record, expected = make_record(layers=(0, 3, 7), heads=3, T=12, prompt_len=8, created=1_700_000_000.0)
    write(store, record)
    return record, expected


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err):
    assert err.startswith("attn-otel: error: ")
    assert err.count("\n") == 1 and err.endswith("\n")
    assert "Traceback" not in err


# --- ls ------------------------------------------------------------------------------------------------

def test_ls_lists_the_capture(capsys, store, captured):
    record, _ = captured
    code, out, _ = run(capsys, "ls", "--store", store)
    assert code == 0
    (row,) = out.splitlines()[1:]
    assert row.split() == [record.trace_id, "req-1", "2023-11-14T22:13:20Z", "12", "8", "0,3,7", "3", "yes"]


def test_ls_prints_a_header(capsys, store, captured):
    _, out, _ = run(capsys, "ls", "--store", store)
    assert out.splitlines()[0].split()[:3] == ["TRACE", "ID", "REQUEST"]


def test_ls_compacts_runs_of_layers(capsys, store):
    write(store, make_record(layers=(0, 1, 2, 3, 8), maps=False)[0])
    _, out, _ = run(capsys, "ls", "--store", store)
    assert out.splitlines()[1].split()[-3:] == ["0-3,8", "2", "no"]


def test_ls_json_is_machine_readable(capsys, store, captured):
    record, _ = captured
    code, out, _ = run(capsys, "ls", "--store", store, "--json")
    assert code == 0
    (row,) = json.loads(out)
    assert {k: row[k] for k in ("trace_id", "request_id", "created", "num_tokens", "prompt_len", "layers", "maps")} \
        == {"trace_id": record.trace_id, "request_id": "req-1", "created": "2023-11-14T22:13:20Z", "num_tokens": 12,
            "prompt_len": 8, "layers": [0, 3, 7], "maps": True}


def test_ls_json_of_an_empty_store_is_an_empty_list(capsys, store):
    store.mkdir()
    code, out, _ = run(capsys, "ls", "--store", store, "--json")
    assert (code, json.loads(out)) == (0, [])


def test_ls_empty_store_says_so_on_stderr(capsys, store):
    store.mkdir()
    code, out, err = run(capsys, "ls", "--store", store)
    assert (code, out) == (0, "")
    assert "no captures" in err


def test_ls_reads_the_store_from_the_environment(capsys, monkeypatch, store, captured):
    monkeypatch.setenv("ATTN_OTEL_STORE", str(store))
    _, out, _ = run(capsys, "ls")
    assert captured[0].trace_id in out


def test_ls_missing_store_is_an_error(capsys, tmp_path):
    code, _, err = run(capsys, "ls", "--store", tmp_path / "nowhere")
    assert code == 1
    assert_one_line_error(err)
    assert "does not exist" in err


def test_ls_hides_control_characters_in_request_ids(capsys, store):
    write(store, make_record(request_id="evil\x1b[2J\nid")[0])
    _, out, _ = run(capsys, "ls", "--store", store)
    assert "\x1b" not in out and len(out.splitlines()) == 2


# --- fetch ---------------------------------------------------------------------------------------------

def test_fetch_writes_exactly_the_contract_arrays(capsys, store, captured, tmp_path):
    record, _ = captured
    out = tmp_path / "out.npz"
    assert run(capsys, "fetch", record.trace_id, "--store", store, "-o", out)[0] == 0
    with np.load(out) as npz:
        got = {name: (npz[name].dtype.kind, npz[name].dtype.itemsize if name == "attn" else None, npz[name].shape)
               for name in npz.files}
    assert got == {"attn": ("f", 4, (3, 3, 12, 12)), "layers": ("i", None, (3,)), "heads": ("i", None, (3,)),
                   "prompt_len": ("i", None, ()), "token_ids": ("i", None, (12,))}


def test_fetch_values_equal_what_was_written(capsys, store, captured, tmp_path):
    record, expected = captured
    out = tmp_path / "out.npz"
    run(capsys, "fetch", record.trace_id, "--store", store, "-o", out)
    with np.load(out) as npz:
        np.testing.assert_allclose(npz["attn"], expected, atol=FP16_ATOL, rtol=0)
        assert npz["layers"].tolist() == [0, 3, 7]
        assert npz["heads"].tolist() == [0, 1, 2]
        assert int(npz["prompt_len"]) == 8
        assert npz["token_ids"].tolist() == record.token_ids.tolist()


def test_fetch_subsets_layers_and_heads(capsys, store, captured, tmp_path):
    record, expected = captured
    out = tmp_path / "out.npz"
    code, _, _ = run(capsys, "fetch", record.trace_id, "--store", store, "--layers", "7,0", "--heads", "2,0", "-o", out)
    assert code == 0
    with np.load(out) as npz:
        assert (npz["layers"].tolist(), npz["heads"].tolist()) == ([0, 7], [0, 2])
        np.testing.assert_allclose(npz["attn"], expected[[0, 2]][:, [0, 2]], atol=FP16_ATOL, rtol=0)


def test_fetch_defaults_to_trace_id_npz(capsys, monkeypatch, store, captured, tmp_path):
    monkeypatch.chdir(tmp_path)
    run(capsys, "fetch", captured[0].trace_id, "--store", store)
    assert (tmp_path / f"{captured[0].trace_id}.npz").is_file()


def test_fetch_reports_what_it_wrote_on_stderr(capsys, store, captured, tmp_path):
    code, out, err = run(capsys, "fetch", captured[0].trace_id, "--store", store, "-o", tmp_path / "x.npz")
    assert (code, out) == (0, "")
    assert "x.npz" in err and "[3, 3, 12, 12]" in err


def test_fetch_without_stored_tokens_has_no_token_ids(capsys, store, tmp_path):
    record, _ = make_record(token_ids=False)
    write(store, record)
    run(capsys, "fetch", record.trace_id, "--store", store, "-o", tmp_path / "out.npz")
    with np.load(tmp_path / "out.npz") as npz:
        assert "token_ids" not in npz.files


def test_fetch_of_a_trace_with_several_captures_needs_request(capsys, store, tmp_path):
    trace_id = new_trace_id()
    write(store, make_record(trace_id, "first", created=1.0)[0])
    write(store, make_record(trace_id, "second", created=2.0)[0])
    code, _, err = run(capsys, "fetch", trace_id, "--store", store, "-o", tmp_path / "out.npz")
    assert code == 1
    assert_one_line_error(err)
    assert "--request" in err and "first, second" in err


def test_fetch_request_picks_one_of_several_captures(capsys, store, tmp_path):
    trace_id = new_trace_id()
    write(store, make_record(trace_id, "first", seed=1)[0])
    record, second = make_record(trace_id, "second", seed=2)
    write(store, record)
    run(capsys, "fetch", trace_id, "--store", store, "--request", "second", "-o", tmp_path / "out.npz")
    with np.load(tmp_path / "out.npz") as npz:
        np.testing.assert_allclose(npz["attn"], second, atol=FP16_ATOL, rtol=0)


def test_fetch_unknown_request_lists_the_known_ones(capsys, store, captured):
    code, _, err = run(capsys, "fetch", captured[0].trace_id, "--store", store, "--request", "nope")
    assert code == 1
    assert_one_line_error(err)
    assert "req-1" in err


def test_fetch_of_a_metrics_only_capture_is_an_error(capsys, store, tmp_path):
    record, _ = make_record(maps=False)
    write(store, record)
    code, _, err = run(capsys, "fetch", record.trace_id, "--store", store, "-o", tmp_path / "out.npz")
    assert code == 1
    assert_one_line_error(err)
    assert "metrics only" in err
    assert not (tmp_path / "out.npz").exists()


def test_fetch_layer_not_captured_is_an_error(capsys, store, captured):
    code, _, err = run(capsys, "fetch", captured[0].trace_id, "--store", store, "--layers", "4")
    assert code == 1
    assert_one_line_error(err)
    assert "layer 4 was not captured" in err


def test_fetch_head_out_of_range_is_an_error(capsys, store, captured):
    code, _, err = run(capsys, "fetch", captured[0].trace_id, "--store", store, "--heads", "3")
    assert code == 1
    assert_one_line_error(err)
    assert "head 3 does not exist" in err


@pytest.mark.parametrize("option, value", [("--heads", "x"), ("--heads", "-1"), ("--layers", "0,x"),
                                           ("--layers", "auto")])
def test_fetch_malformed_selection_is_a_usage_error(capsys, store, captured, option, value):
    code, _, err = run(capsys, "fetch", captured[0].trace_id, "--store", store, option, value)
    assert code == 2
    assert "Traceback" not in err


def test_unknown_trace_id_is_a_one_line_error(capsys, store, captured):
    code, _, err = run(capsys, "fetch", new_trace_id(), "--store", store)
    assert code == 1
    assert_one_line_error(err)
    assert "no capture of trace" in err


def test_malformed_trace_id_is_refused_before_the_store(capsys, tmp_path):
    missing = tmp_path / "no-such-store"
    code, _, err = run(capsys, "fetch", "../../etc", "--store", missing)
    assert code == 1
    assert_one_line_error(err)
    assert "not a trace id" in err and "store" not in err
    assert not missing.exists()


def test_corrupt_chunk_is_an_error_naming_the_capture(capsys, store, captured, tmp_path):
    record, _ = captured
    prefix = capture_prefix(record.trace_id, record.request_id)
    chunk = next(p for p in sorted((store / prefix / "attn" / "c").rglob("*")) if p.is_file())
    chunk.write_bytes(b"garbage")
    code, _, err = run(capsys, "fetch", record.trace_id, "--store", store, "-o", tmp_path / "out.npz")
    assert code == 1
    assert_one_line_error(err)
    assert prefix in err


def test_failed_fetch_leaves_no_file(capsys, store, captured, tmp_path):
    record, _ = captured
    prefix = capture_prefix(record.trace_id, record.request_id)
    chunks = sorted(p for p in (store / prefix / "attn" / "c").rglob("*") if p.is_file())
    chunks[-1].write_bytes(b"garbage")  # the last layer: the first parts were already written
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    run(capsys, "fetch", record.trace_id, "--store", store, "-o", out_dir / "out.npz")
    assert list(out_dir.iterdir()) == []


# --- show ----------------------------------------------------------------------------------------------

def _image(path):
    assert path.read_bytes()[:8] == PNG_MAGIC
    return matplotlib.image.imread(path)


def _distinct_colours(image):
    assert image.shape[-1] == 4  # RGBA floats in [0, 1]: pack each pixel into one uint32
    return len(np.unique(np.ascontiguousarray((image * 255).round().astype(np.uint8)).view(np.uint32)))


def test_show_writes_a_heatmap_png(capsys, store, captured, tmp_path):
    out = tmp_path / "map.png"
    code, _, err = run(capsys, "show", captured[0].trace_id, "--layer", 3, "--store", store, "-o", out)
    assert code == 0, err
    image = _image(out)
    assert image.shape[0] > 400 and image.shape[1] > 400
    assert _distinct_colours(image) > 50


def test_show_log_scale_writes_a_different_heatmap(capsys, store, captured, tmp_path):
    trace_id = captured[0].trace_id
    run(capsys, "show", trace_id, "--layer", 3, "--store", store, "-o", tmp_path / "linear.png")
    code, _, _ = run(capsys, "show", trace_id, "--layer", 3, "--log", "--store", store, "-o", tmp_path / "log.png")
    assert code == 0
    linear, log = _image(tmp_path / "linear.png"), _image(tmp_path / "log.png")
    assert _distinct_colours(log) > 50
    assert linear.shape != log.shape or not np.array_equal(linear, log)


def test_show_one_head_and_a_band_of_rows(capsys, store, captured, tmp_path):
    out = tmp_path / "band.png"
    code, _, err = run(capsys, "show", captured[0].trace_id, "--layer", 7, "--head", 2, "--rows", "6:10",
                       "--store", store, "-o", out)
    assert code == 0, err
    assert _distinct_colours(_image(out)) > 50


def test_show_mean_over_heads_is_the_mean_of_the_band(store, captured):
    record, expected = captured
    (cap,) = open_trace(record.trace_id, store)
    band = cli._head_mean(cap.attn, 1, 4, 9)
    np.testing.assert_allclose(band, expected[1].mean(axis=0)[4:9, :9], atol=FP16_ATOL, rtol=0)


def test_show_of_many_tokens_uses_ticks_not_labels(capsys, store, tmp_path):
    record, _ = make_record(T=80, prompt_len=70)
    write(store, record)
    out = tmp_path / "long.png"
    code, _, err = run(capsys, "show", record.trace_id, "--layer", 0, "--store", store, "-o", out)
    assert code == 0, err
    assert _image(out).shape[0] > 400


def test_show_defaults_to_a_named_png(capsys, monkeypatch, store, captured, tmp_path):
    monkeypatch.chdir(tmp_path)
    run(capsys, "show", captured[0].trace_id, "--layer", 0, "--head", 1, "--store", store)
    assert (tmp_path / f"{captured[0].trace_id}-layer0-head1.png").is_file()


def test_a_capture_without_token_ids_shows_positions(capsys, monkeypatch, store, tmp_path):
    """Token ids are stored only when asked (ATTN_OTEL_STORE_TOKENS): without them the reader says None,
    ``ls`` says so, and ``show`` labels its axes by position (a --tokenizer has nothing to decode)."""
    record, expected = make_record(layers=(0, 3), heads=2, T=12, prompt_len=8, token_ids=False)
    write(store, record)
    (cap,) = open_trace(record.trace_id, store)
    assert cap.token_ids is None and cap.meta["token_ids"] is False
    np.testing.assert_allclose(cap.maps([3]), expected[1:], atol=FP16_ATOL, rtol=0)  # the maps are all there
    _, out, _ = run(capsys, "ls", "--store", store, "--json")
    assert json.loads(out)[0]["token_ids"] is False
    drawn = []
    monkeypatch.setattr(cli, "_plot", lambda out, data, start, stop, prompt_len, labels, title, log:
                        drawn.append((data.shape, labels)) or out.write_bytes(PNG_MAGIC))
    code, _, err = run(capsys, "show", record.trace_id, "--layer", 3, "--tokenizer", tmp_path / "no-such-tokenizer",
                       "--store", store, "-o", tmp_path / "m.png")
    assert code == 0, err
    assert drawn == [((12, 12), None)]  # positions, no labels
    assert "not labelling tokens: no token ids stored" in err
    code, _, err = run(capsys, "show", record.trace_id, "--layer", 0, "--store", store, "-o", tmp_path / "real.png")
    assert code == 0 and "not labelling" not in err  # no tokenizer asked for: nothing to say


def test_show_without_token_ids_draws_a_real_png(capsys, store, tmp_path):
    record, _ = make_record(token_ids=False)
    write(store, record)
    out = tmp_path / "positions.png"
    code, _, err = run(capsys, "show", record.trace_id, "--layer", 0, "--store", store, "-o", out)
    assert code == 0, err
    assert out.read_bytes()[:8] == PNG_MAGIC and _distinct_colours(_image(out)) > 50


def test_ls_json_names_the_model_and_finish_reason(capsys, store):
    record, _ = make_record()
    record.attrs["finish_reason"] = "abort"
    write(store, record)
    _, out, _ = run(capsys, "ls", "--store", store, "--json")
    (row,) = json.loads(out)
    assert (row["model"], row["finish_reason"]) == ("synthetic", "abort")
    (cap,) = open_trace(record.trace_id, store)
    assert (cap.model, cap.finish_reason) == ("synthetic", "abort")


def test_a_capture_without_a_finish_reason_reads_as_none(capsys, store, captured):
    (cap,) = open_trace(captured[0].trace_id, store)
    assert cap.finish_reason is None
    _, out, _ = run(capsys, "ls", "--store", store, "--json")
    assert json.loads(out)[0]["finish_reason"] is None


def test_show_layer_not_captured_is_an_error(capsys, store, captured, tmp_path):
    code, _, err = run(capsys, "show", captured[0].trace_id, "--layer", 5, "--store", store, "-o", tmp_path / "m.png")
    assert code == 1
    assert_one_line_error(err)
    assert "layer 5 was not captured (captured: [0, 3, 7])" in err


def test_show_head_out_of_range_is_an_error(capsys, store, captured):
    code, _, err = run(capsys, "show", captured[0].trace_id, "--layer", 0, "--head", 9, "--store", store)
    assert code == 1
    assert_one_line_error(err)
    assert "head 9" in err


def test_show_rows_past_the_end_is_an_error(capsys, store, captured):
    code, _, err = run(capsys, "show", captured[0].trace_id, "--layer", 0, "--rows", "20:", "--store", store)
    assert code == 1
    assert_one_line_error(err)
    assert "--rows 20:" in err


def test_show_needs_a_layer(capsys, store, captured):
    assert run(capsys, "show", captured[0].trace_id, "--store", store)[0] == 2


def test_token_labels_escape_what_matplotlib_would_interpret():
    assert cli._label_text("$5\n") == r"\$5\n"


def test_token_labels_are_ids_without_a_tokenizer():
    assert cli._token_labels(np.array([7, 42]), None) == ["7", "42"]


# --- metrics -------------------------------------------------------------------------------------------

def _strict_json(text):
    def refuse(name):
        raise AssertionError(f"{name} in JSON output")

    return json.loads(text, parse_constant=refuse)


def _table_rows(out):
    """{layer: cells} of the table's layer lines (the header, group line and column titles left out)."""
    rows = [line.split() for line in out.splitlines()]
    return {int(cells[0]): cells[1:] for cells in rows if cells and cells[0].isdigit()}


def test_metrics_table_has_a_row_for_every_layer(capsys, store, captured):
    code, out, err = run(capsys, "metrics", captured[0].trace_id, "--store", store)
    assert code == 0, err
    assert sorted(_table_rows(out)) == [0, 3, 7]


def test_metrics_table_names_the_capture(capsys, store, captured):
    _, out, _ = run(capsys, "metrics", captured[0].trace_id, "--store", store)
    assert out.splitlines()[0].split() == ["trace", captured[0].trace_id, "request", "'req-1'", "T=12",
                                            "prompt_len=8", "(means", "over", "3", "heads)"]
    assert out.splitlines()[2].split() == ["LAYER", "ENTROPY_NORM", "SINK[0]", "SINK[0:4]", "VISION",
                                            "ENTROPY_NORM", "LOOKBACK"]


def test_metrics_table_cells_are_means_over_heads(capsys, store, captured):
    record, _ = captured
    _, out, _ = run(capsys, "metrics", record.trace_id, "--store", store)
    (cap,) = open_trace(record.trace_id, store)
    s = cap.summary()
    cells = _table_rows(out)[3]
    assert float(cells[2]) == pytest.approx(s["prompt"]["sink_mass_k"]["layer_mean"][1], abs=5e-4)
    assert float(cells[5]) == pytest.approx(s["generated"]["lookback_ratio"]["layer_mean"][1], abs=5e-4)


def test_metrics_table_shows_a_dash_for_the_vision_of_a_text_only_request(capsys, store, captured):
    _, out, _ = run(capsys, "metrics", captured[0].trace_id, "--store", store)
    assert {cells[3] for cells in _table_rows(out).values()} == {"-"}


def test_metrics_table_shows_the_vision_share_of_an_image_request(capsys, store):
    record, _ = make_record(T=12, prompt_len=8, vision=np.arange(12) < 6)
    write(store, record)
    _, out, _ = run(capsys, "metrics", record.trace_id, "--store", store)
    assert all(0 < float(cells[3]) < 1 for cells in _table_rows(out).values())


def test_metrics_json_round_trips(capsys, store, captured):
    from attn_otel.metrics import to_json

    code, out, _ = run(capsys, "metrics", captured[0].trace_id, "--store", store, "--json")
    assert code == 0
    (cap,) = open_trace(captured[0].trace_id, store)
    assert _strict_json(out) == json.loads(json.dumps(to_json(cap)))


def test_metrics_json_of_a_prompt_only_request_has_nulls_not_nan(capsys, store):
    record, _ = make_record(T=10, prompt_len=10)
    write(store, record)
    _, out, _ = run(capsys, "metrics", record.trace_id, "--store", store, "--json")
    assert _strict_json(out)["generated"]["entropy"] == [[None, None], [None, None]]


def test_metrics_json_of_several_captures_is_a_list(capsys, store):
    trace_id = new_trace_id()
    write(store, make_record(trace_id, "first", created=1.0)[0])
    write(store, make_record(trace_id, "second", created=2.0, seed=1)[0])
    _, out, _ = run(capsys, "metrics", trace_id, "--store", store, "--json")
    assert [doc["request_id"] for doc in _strict_json(out)] == ["first", "second"]


def test_metrics_table_of_several_captures_has_one_table_each(capsys, store):
    trace_id = new_trace_id()
    write(store, make_record(trace_id, "first", created=1.0)[0])
    write(store, make_record(trace_id, "second", created=2.0, layers=(5,))[0])
    _, out, _ = run(capsys, "metrics", trace_id, "--store", store)
    first, second = out.split("\n\n")
    assert "'first'" in first and sorted(_table_rows(first)) == [0, 3]
    assert "'second'" in second and sorted(_table_rows(second)) == [5]


def test_metrics_request_picks_one_capture_as_an_object(capsys, store):
    trace_id = new_trace_id()
    write(store, make_record(trace_id, "first", created=1.0)[0])
    write(store, make_record(trace_id, "second", created=2.0)[0])
    _, out, _ = run(capsys, "metrics", trace_id, "--store", store, "--json", "--request", "second")
    assert _strict_json(out)["request_id"] == "second"


def test_metrics_unknown_request_is_a_one_line_error(capsys, store, captured):
    code, _, err = run(capsys, "metrics", captured[0].trace_id, "--store", store, "--request", "nope")
    assert code == 1
    assert_one_line_error(err)
    assert "req-1" in err


def test_metrics_unknown_trace_is_a_one_line_error(capsys, store, captured):
    code, _, err = run(capsys, "metrics", new_trace_id(), "--store", store)
    assert code == 1
    assert_one_line_error(err)
    assert "no capture of trace" in err


def test_metrics_of_a_capture_without_metrics_is_an_error(capsys, store):
    record, _ = make_record()
    record.metrics = {}
    write(store, record)
    code, _, err = run(capsys, "metrics", record.trace_id, "--store", store)
    assert code == 1
    assert_one_line_error(err)
    assert "no stored metrics" in err


def test_metrics_that_are_not_per_row_are_an_error_naming_the_capture(capsys, store):
    record, _ = make_record()
    write(store, record)
    # the store refuses to write such a capture: damage a written one (a foreign writer, a corrupt object)
    group = zarr.open_group(f"{store}/{capture_prefix(record.trace_id, record.request_id)}", mode="a")
    group.create_array("entropy", data=np.ones((2, 2), dtype=np.float32), overwrite=True)
    code, _, err = run(capsys, "metrics", record.trace_id, "--store", store)
    assert code == 1
    assert_one_line_error(err)
    assert capture_prefix(record.trace_id, record.request_id) in err


# --- the entry point -----------------------------------------------------------------------------------

def test_no_command_is_a_usage_error(capsys):
    assert run(capsys, )[0] == 2


def test_help_exits_zero(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "fetch" in out


def test_a_new_subcommand_can_be_added(capsys, monkeypatch):
    def add_extra(subparsers, common):
        p = subparsers.add_parser("extra", parents=[common])
        p.set_defaults(func=lambda args: 7 if args.store == "s" else 0)

    monkeypatch.setattr(cli, "SUBCOMMANDS", [*cli.SUBCOMMANDS, add_extra])
    assert run(capsys, "extra", "--store", "s")[0] == 7


def test_an_unexpected_failure_is_one_line_with_its_type(capsys, monkeypatch):
    def add_boom(subparsers, common):
        def boom(args):
            raise RuntimeError("first line\nsecond line")

        subparsers.add_parser("boom", parents=[common]).set_defaults(func=boom)

    monkeypatch.setattr(cli, "SUBCOMMANDS", [*cli.SUBCOMMANDS, add_boom])
    code, _, err = run(capsys, "boom")
    assert code == 1
    assert_one_line_error(err)
    assert re.search(r"RuntimeError: first line second line$", err.strip())
