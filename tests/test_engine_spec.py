"""Speculative decoding (ngram) on vLLM's CPU build with the real SmolLM2 model (tests/spec_serve.py, in a
process of its own, in float32 and without dynamo's trace: it says why).

Draft tokens go through the model like any others: their queries and keys land in the taps at their slots,
and a rejected draft's position is computed again on the next step (the stream flushes what is pending first,
the taps are overwritten).  What the worker cannot tell is where the sequence ends: drafts run past it (rejected,
or cut by max_tokens), so the scheduler's own token count rides to the worker with the finish.  Checked: each
capture holds exactly the sequence's positions and token ids, its maps match HF eager fp32 within FACTOR x HF
bf16's drift, and maps x V reproduce the layers' outputs (ATTN_OTEL_VERIFY)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prefetch import Prefetch, params_of, selected
from reference import Calibrated, check_reconstruction, hf_references

import attn_otel

pytestmark = pytest.mark.engine

HERE = Path(__file__).parent


def _spec_serve(smollm2_path: str, tmp: Path, *method: str, timeout: int = 600) -> tuple[Path, dict]:
    store, out = tmp / "store", tmp / "out.json"
    # none of the session engine's settings (tests/conftest.py leaves ATTN_OTEL_MAP_LAYERS=all and an 8,192-token
    # map tap of every layer in os.environ while it lives): the serve is the same alone and in the suite.  In
    # float32 that tap took the whole KV-cache space ("No available memory for the cache blocks")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTN_OTEL_")}
    proc = subprocess.run([sys.executable, str(HERE / "spec_serve.py"), smollm2_path, str(store), str(out), *method],
                          cwd=str(tmp), env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return store, json.loads(out.read_text())


def _key(item) -> str | None:
    params = params_of(item)
    if "served_spec" in item.fixturenames:
        return "ngram"
    if item.originalname.startswith("test_an_eagle_heads"):
        return f"head:{params['method']}"
    if item.originalname.startswith("test_speculative_decoding_with_windows"):
        return f"variant:{params['which']}"
    return None


@pytest.fixture(scope="module")
def spec_runs(request, tmp_path_factory, smollm2_path):
    """The serves the selected tests need, started as the module begins, two at a time (tests/prefetch.py; one
    after another the module took 123 s of CI)."""
    from test_engine_variants import serve_model
    from variant_models import build_gemma2, build_gptoss

    runs = Prefetch()
    for key in selected(request, _key):
        kind, _, arg = key.partition(":")
        tmp = tmp_path_factory.mktemp(key.replace(":", "-"))
        if kind == "ngram":
            runs.start(key, _spec_serve, smollm2_path, tmp)
        elif kind == "head":
            runs.start(key, _spec_serve, smollm2_path, tmp, arg, timeout=900)
        else:
            # attention outputs zeroed (variant_models._markov): the maps are still the checked attention, and the
            # next token depends on the current one alone, so drafts are accepted once the greedy output cycles
            model = {"gptoss": build_gptoss, "gemma2": build_gemma2}[arg](tmp / "model", markov=True)  # here: seeded
            runs.start(key, serve_model, tmp, model, "--spec")
    yield runs
    runs.close()


@pytest.fixture(scope="module")
def served_spec(spec_runs):
    return spec_runs["ngram"]


def test_drafts_were_proposed_accepted_and_rejected_and_every_request_captured(served_spec):
    _, got = served_spec
    drafted = got["spec"]["vllm:spec_decode_num_draft_tokens"]
    accepted = got["spec"]["vllm:spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted, got["spec"]  # both paths: accepted drafts and rejected ones
    assert got["stats"]["captured"] == len(got["requests"]) and got["stats"]["dropped"] == {}
    # prompts' rows computed in the forward (spec_serve: ATTN_OTEL_STREAM_DIRECT=1), a decode step's chunk of
    # 1 + the drafts through the ring
    assert got["stats"]["stream_direct_rows"] > 0 and got["stats"]["stream_direct_replayed"] == 0, got["stats"]
    # requests counted by the step counter (attn_otel.steady) between drafts came back where vLLM had them
    assert got["stats"]["steady_drift"] == 0


def test_captures_under_speculative_decoding_are_exact(served_spec, smollm2_path):
    store, got = served_spec
    cal = Calibrated()
    for r in got["requests"]:
        (cap,) = attn_otel.open_trace(r["trace_id"], store)
        ids = r["prompt"] + r["output"]
        T = cap.num_tokens
        assert T == len(ids) - 1 and list(cap.token_ids) == ids[:T]  # no draft past the end
        fp32, bf16 = hf_references(smollm2_path, ids[:T])
        cal.add_maps("tv", cap.maps(), fp32[cap.layers], bf16[cap.layers])
        check_reconstruction(cap)
    cal.check("SmolLM2 under ngram speculative decoding")


# CI: an EAGLE-3 head; TEST_SPEC_HEADS adds an EAGLE-1 head (tests/spec_heads.py, both built for SmolLM2 here)
SPEC_HEADS = os.environ.get("TEST_SPEC_HEADS", "eagle3").split(",")


@pytest.mark.parametrize("method", SPEC_HEADS)
def test_an_eagle_heads_drafts_are_never_captured_and_the_targets_rows_are_exact(spec_runs, smollm2_path, method):
    """A draft model with an attention layer of its own (EAGLE-3: fed the target's hidden states after layers 2,
    15 and 30): its layer, numbered after the target's 30, runs with its own KV cache between the target's forwards
    and is never captured, and is named in ``layer_kinds``; the target's captures hold exactly the accepted
    sequence and match HF eager fp32 within the calibrated drift, maps x V as each layer's output."""
    store, got = spec_runs[f"head:{method}"]
    drafted = got["spec"]["vllm:spec_decode_num_draft_tokens"]
    accepted = got["spec"]["vllm:spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted, got["spec"]
    assert got["stats"]["captured"] == len(got["requests"]) and got["stats"]["dropped"] == {}
    kinds = got["layer_kinds"]
    assert kinds["30"] == "not captured: the speculative decoding draft model's layer", kinds
    assert all(kinds[str(i)].startswith("attention") for i in range(30))
    cal = Calibrated()
    for r in got["requests"]:
        (cap,) = attn_otel.open_trace(r["trace_id"], store)
        ids = r["prompt"] + r["output"]
        T = cap.num_tokens
        assert T == len(ids) - 1 and list(cap.token_ids) == ids[:T]
        assert max(cap.layers) < 30  # the target's layers only
        fp32, bf16 = hf_references(smollm2_path, ids[:T])
        cal.add_maps("tv", cap.maps(), fp32[cap.layers], bf16[cap.layers])
        check_reconstruction(cap)
    cal.check(f"SmolLM2 under {method} speculative decoding")
    print(f"\n{method}: {accepted} of {drafted} draft tokens accepted;", json.dumps(cal.report()))


# CI: gpt-oss (a sliding window on layer 0, learned sinks on both layers); TEST_SPEC_VARIANTS adds gemma2
# (windows, soft-cap, query_pre_attn_scalar)
SPEC_VARIANTS = os.environ.get("TEST_SPEC_VARIANTS", "gptoss").split(",")


@pytest.mark.parametrize("which", SPEC_VARIANTS)
def test_speculative_decoding_with_windows_soft_caps_and_sinks_is_exact(spec_runs, which):
    """ngram drafts on a model whose layers carry attention terms: rejected drafts' positions are computed
    again with the window, soft-cap and sink terms, the capture holds exactly the sequence, and every layer's
    maps match HF eager fp32 within its bf16 drift (maps x V as the layer's output)."""
    from test_engine_variants import check_maps

    model, store, got, _ = spec_runs[f"variant:{which}"]  # a model whose drafts are accepted (spec_runs)
    drafted = got["spec"]["vllm:spec_decode_num_draft_tokens"]
    accepted = got["spec"]["vllm:spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted, got["spec"]  # accepted drafts and rejected ones
    assert got["captured"] == len(got["requests"]) and not got["dropped"], (got["captured"], got["dropped"])
    assert all(len(r["output"]) >= 24 for r in got["requests"])  # decoding ran past the window of 16
    report = check_maps(which, model, store, got)
    print(f"\n{which} under ngram speculative decoding ({accepted} of {drafted} drafts accepted):", json.dumps(report))
