"""The viewer's page data and self-contained file (attn_otel.viewer) and ``attn-otel view``; no browser here
(tests/test_viewer_browser.py drives a real one), no engine."""

import base64
import json
import re
import zlib
from collections import Counter

import numpy as np
import pytest
from synthetic import CountingStore, make_record, write
from zarr.storage import LocalStore

from attn_otel import cli, viewer
from attn_otel.metrics import summarize
from attn_otel.reader import open_trace

STEP = 10 ** (6 / 254)  # one code: a factor 1.056


@pytest.fixture(autouse=True)
def no_store_in_environment(monkeypatch):
    monkeypatch.delenv("ATTN_OTEL_STORE", raising=False)


@pytest.fixture
def store(tmp_path):
    return tmp_path / "store"


@pytest.fixture
def captured(store):
    """Layers 0, 3, 7; 3 heads; 12 tokens, 8 of them prompt; token ids stored."""
    record, expected = make_record(layers=(0, 3, 7), heads=3, T=12, prompt_len=8, created=1_700_000_000.0)
    write(store, record)
    (cap,) = open_trace(record.trace_id, store)
    return cap, record


def _data(page: str) -> dict:
    return json.loads(re.search(r'<script type="application/json" id="attn-otel-data">(.*?)</script>', page, re.S)[1])


def _embedded(page: str) -> dict[str, np.ndarray]:
    return {key: np.frombuffer(zlib.decompress(base64.b64decode(blob)), dtype=np.uint8)
            for key, blob in re.findall(r'<script type="application/octet-stream" id="attn-otel-map-([\w-]+)">'
                                        r'([A-Za-z0-9+/=]*)</script>', page)}


# --- maps as codes ------------------------------------------------------------------------------------

def test_codes_keep_a_weight_to_within_half_a_step():
    values = np.geomspace(1e-6, 1.0, 5000, dtype=np.float32)
    back = viewer.dequantize(viewer.quantize(values))
    assert np.all(np.abs(np.log(back / values)) <= np.log(STEP) / 2 + 1e-5)


def test_weights_under_the_floor_and_zero_are_code_0_and_one_is_255():
    assert viewer.quantize(np.array([0.0, 5e-7, 1e-6, 1.0])).tolist() == [0, 0, 1, 255]
    assert viewer.dequantize(np.array([0], dtype=np.uint8)).tolist() == [0.0]


def test_a_map_is_its_causal_rows_one_after_another(captured):
    cap, record = captured
    codes = viewer.layer_codes(cap, 1, [2], mean=False)
    assert list(codes) == ["1-2"] and codes["1-2"].size == viewer.packed_size(12) == 78
    expected = viewer.quantize(np.tril(record.maps[1, 2].astype(np.float32)))
    np.testing.assert_array_equal(viewer.unpack(codes["1-2"], 12), expected)


def test_the_head_mean_is_the_mean_of_the_stored_heads(captured):
    cap, record = captured
    codes = viewer.layer_codes(cap, 2, [0, 1, 2], mean=True)
    assert sorted(codes) == ["2-0", "2-1", "2-2", "2-mean"]
    mean = record.maps[2].astype(np.float32).mean(axis=0)
    drawn = viewer.dequantize(viewer.unpack(codes["2-mean"], 12))
    visible = np.tril(np.ones((12, 12), dtype=bool)) & (mean >= 1e-6)
    assert np.all(np.abs(np.log(drawn[visible] / mean[visible])) <= np.log(STEP) / 2 + 1e-5)


def test_a_map_reads_only_its_layers_and_heads_chunks(tmp_path):
    record, _ = make_record(layers=(0, 3), heads=3, T=300, prompt_len=200)  # two bands of chunk rows
    write(tmp_path, record)
    counting = CountingStore(LocalStore(str(tmp_path), read_only=True))
    (cap,) = open_trace(record.trace_id, counting)
    counting.reads.clear()
    viewer.layer_codes(cap, 1, [2], mean=False)
    chunks = sorted(k.split("/attn/")[1] for k in counting.reads if "/attn/c/" in k)
    assert chunks == ["c/1/2/0/0", "c/1/2/1/0"]  # layer 1, head 2: its two bands, each once
    counting.reads.clear()
    viewer.layer_codes(cap, 0, [], mean=True)
    chunks = sorted(k.split("/attn/")[1] for k in counting.reads if "/attn/c/" in k)
    assert chunks == [f"c/0/{h}/{b}/0" for h in range(3) for b in range(2)]
    assert max(counting.reads.values()) == 1


# --- the page's data ------------------------------------------------------------------------------------

def test_page_data_describes_the_capture(captured):
    cap, record = captured
    data = viewer.page_data(cap, None, "positions")
    assert {k: data[k] for k in ("trace_id", "request_id", "num_tokens", "prompt_len", "layers", "num_heads",
                                 "has_maps", "model", "requests")} == {
        "trace_id": record.trace_id, "request_id": "req-1", "num_tokens": 12, "prompt_len": 8, "layers": [0, 3, 7],
        "num_heads": 3, "has_maps": True, "model": "synthetic", "requests": ["req-1"]}
    json.dumps(data, allow_nan=False)  # strict JSON: undefined values are null


def test_page_data_carries_the_row_metrics_as_float16(captured):
    cap, record = captured
    rows = viewer.page_data(cap, None, "positions")["row_metrics"]
    # a text-only request of a model without learned sinks
    assert sorted(rows) == sorted(set(viewer.STRIP_METRICS) - {"vision_share", "learned_sink_mass"})
    got = np.frombuffer(base64.b64decode(rows["sink_mass_k"]), dtype="<f2").reshape(3, 3, 12)
    np.testing.assert_allclose(got, record.metrics["sink_mass_k"], atol=1e-3, equal_nan=True)


def test_page_data_overview_is_the_per_layer_summary(captured):
    cap, record = captured
    overview = viewer.page_data(cap, None, "positions")["overview"]
    summary = summarize(record.metrics, 8)
    for key, stats in overview.items():
        part, name = key.split(".")
        if name in ("vision_share", "learned_sink_mass"):  # text only, no learned sinks
            assert stats is None
            continue
        np.testing.assert_allclose(stats["layer_mean"], summary[part][name]["layer_mean"], rtol=1e-6)
        np.testing.assert_allclose(stats["mean"], summary[part][name]["mean"], rtol=1e-6)


def test_labels_are_positions_ids_or_decoded_tokens(store, captured):
    cap, _ = captured
    assert viewer.token_labels(cap) == ([str(i) for i in range(100, 112)], "ids")

    class Tokenizer:
        def batch_decode(self, ids):
            return [f"<{i[0]}>" for i in ids]

    assert viewer.token_labels(cap, Tokenizer()) == ([f"<{i}>" for i in range(100, 112)], "tokens")
    record, _ = make_record(token_ids=False)
    write(store, record)
    (bare,) = open_trace(record.trace_id, store)
    assert viewer.token_labels(bare, Tokenizer()) == (None, "positions")


def test_a_metrics_only_capture_has_its_metrics_and_no_maps(store):
    record, _ = make_record(maps=False)
    write(store, record)
    (cap,) = open_trace(record.trace_id, store)
    page, report = viewer.build_file(cap)
    data = _data(page)
    assert data["has_maps"] is False and report["embedded"] == [] and not _embedded(page)
    assert data["overview"]["prompt.entropy_norm"] is not None


# --- the self-contained file ------------------------------------------------------------------------------

def test_the_file_embeds_every_map_of_a_small_capture(captured):
    cap, record = captured
    page, report = viewer.build_file(cap)
    maps = _embedded(page)
    assert sorted(maps) == sorted(f"{li}-{h}" for li in range(3) for h in ["mean", 0, 1, 2]) == report["embedded"]
    np.testing.assert_array_equal(maps["2-1"], viewer.layer_codes(cap, 2, [1], mean=False)["2-1"])
    assert _data(page)["maps"] == {"source": "file", "embedded": report["embedded"], "left_out": [],
                                   "limit_mb": 64.0}


def test_the_file_is_self_contained(captured):
    page, _ = viewer.build_file(captured[0])
    assert not re.search(r"<(link|img|iframe|object|embed)\b", page)
    assert not re.search(r"<script[^>]*\bsrc=", page)
    assert not re.search(r"\b(src|href)=[\"']?(https?:)?//", page)
    assert not re.search(r"\b(import|fetch)\(\s*[\"']https?:", page)
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', page)[1]
    assert "default-src &#x27;none&#x27;" in csp and "connect-src &#x27;none&#x27;" in csp


def test_a_cap_embeds_the_head_means_first_and_names_what_it_leaves_out(captured):
    cap, _ = captured
    size = viewer.packed_size(12)
    page, report = viewer.build_file(cap, max_bytes=5 * size)  # the 3 means, and not a whole layer of heads
    assert report["embedded"] == ["0-mean", "1-mean", "2-mean"]
    assert sorted(report["left_out"]) == sorted(f"{li}-{h}" for li in range(3) for h in range(3))
    assert _data(page)["maps"]["left_out"] == report["left_out"]
    page, report = viewer.build_file(cap, max_bytes=1)  # always the first layer's mean
    assert report["embedded"] == ["0-mean"] and "1-mean" in report["left_out"]


def test_token_text_cannot_close_the_pages_script(store):
    record, _ = make_record()
    write(store, record)
    (cap,) = open_trace(record.trace_id, store)

    class Tokenizer:
        def batch_decode(self, ids):
            return ["</script><script>alert(1)</script><!--"] * len(ids)

    labels, kind = viewer.token_labels(cap, Tokenizer())
    page = viewer.render_page({**viewer.page_data(cap, labels, kind), "maps": {"source": "file"}})
    assert "alert(1)</script>" not in page and "<!--" not in page
    assert _data(page)["labels"][0] == "</script><script>alert(1)</script><!--"


# --- attn-otel view -----------------------------------------------------------------------------------------

def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_view_writes_the_page(capsys, store, captured, tmp_path):
    _, record = captured
    out = tmp_path / "page.html"
    code, stdout, err = run(capsys, "view", record.trace_id, "--store", store, "-o", out)
    assert code == 0 and stdout == "" and f"wrote {out}" in err
    assert _data(out.read_text())["trace_id"] == record.trace_id
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def test_view_defaults_to_trace_id_html(capsys, monkeypatch, store, captured, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert run(capsys, "view", captured[1].trace_id, "--store", store)[0] == 0
    assert (tmp_path / f"{captured[1].trace_id}.html").is_file()


def test_view_of_a_trace_with_several_captures_needs_request(capsys, store, tmp_path):
    trace = make_record(request_id="a")[0].trace_id
    for rid in ("a", "b"):
        write(store, make_record(trace_id=trace, request_id=rid)[0])
    code, _, err = run(capsys, "view", trace, "--store", store, "-o", tmp_path / "x.html")
    assert code == 1 and "choose one with --request" in err and err.count("\n") == 1
    assert run(capsys, "view", trace, "--store", store, "--request", "b", "-o", tmp_path / "x.html")[0] == 0
    data = _data((tmp_path / "x.html").read_text())
    assert (data["request_id"], data["requests"]) == ("b", ["a", "b"])


@pytest.mark.parametrize("trace, message", [("abc", "not a trace id"), ("0" * 31 + "1", "no capture of trace")])
def test_view_of_a_bad_or_unknown_trace_is_a_one_line_error(capsys, store, captured, tmp_path, trace, message):
    code, _, err = run(capsys, "view", trace, "--store", store, "-o", tmp_path / "x.html")
    assert code == 1 and err.startswith("attn-otel: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "x.html").exists()


def test_view_of_a_metrics_only_capture_says_so(capsys, store, tmp_path):
    record, _ = make_record(maps=False)
    write(store, record)
    code, _, err = run(capsys, "view", record.trace_id, "--store", store, "-o", tmp_path / "m.html")
    assert code == 0 and "metrics only, no maps" in err


def test_view_over_its_cap_says_what_it_left_out(capsys, store, captured, tmp_path):
    code, _, err = run(capsys, "view", captured[1].trace_id, "--store", store, "--max-mb", "0.00025",  # 3 maps of 78 bytes
                       "-o", tmp_path / "c.html")
    assert code == 0 and "left out 9 of 12 maps" in err


@pytest.mark.parametrize("value", ["0", "-1", "lots"])
def test_view_max_mb_must_be_positive(capsys, store, captured, value):
    assert run(capsys, "view", captured[1].trace_id, "--store", store, "--max-mb", value)[0] == 2


def test_view_decodes_tokens_with_a_tokenizer_folder(capsys, store, captured, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(200)} | {"[UNK]": 200}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    out = tmp_path / "t.html"
    assert run(capsys, "view", captured[1].trace_id, "--store", store, "--tokenizer", tmp_path / "tok", "-o", out)[0] == 0
    data = _data(out.read_text())
    assert (data["label_kind"], data["labels"][:3]) == ("tokens", ["w100", "w101", "w102"])


def test_view_with_a_tokenizer_but_no_token_ids_shows_positions(capsys, store, tmp_path):
    record, _ = make_record(token_ids=False)
    write(store, record)
    out = tmp_path / "p.html"
    code, _, err = run(capsys, "view", record.trace_id, "--store", store, "--tokenizer", tmp_path / "none", "-o", out)
    assert code == 0 and "no token ids stored" in err
    assert _data(out.read_text())["label_kind"] == "positions"


@pytest.mark.parametrize("load", ["viewer", "show"])
def test_a_tokenizer_is_never_fetched_from_the_network(monkeypatch, load):
    """The served viewer (and ``attn-otel show --tokenizer``) label tokens with a tokenizer whose files are on
    this machine; a name that is not a folder or a cached hub id is an error at once, not a hub lookup that
    retries for most of a minute on a machine that cannot reach the hub (vLLM's server with a model name the
    viewer cannot resolve: 47 s of one CI run went so)."""
    from huggingface_hub import file_download

    tried = []

    def refuse(*args, **kwargs):  # the hub's metadata request for a file, which the retries are made of
        tried.append(args[:1])
        raise OSError("no network in this test")

    monkeypatch.setattr(file_download, "get_hf_file_metadata", refuse)
    with pytest.raises((ValueError, cli.CliError), match="cannot load a tokenizer from no-such-org/no-such-model"):
        if load == "viewer":
            viewer.load_tokenizer("no-such-org/no-such-model")
        else:
            cli._token_labels(np.arange(3), "no-such-org/no-such-model")
    assert not tried
