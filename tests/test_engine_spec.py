"""Speculative decoding (ngram) on vLLM's CPU build with the real SmolLM2 model (tests/spec_serve.py, in a
process of its own).

Draft tokens go through the model like any others: their queries and keys land in the taps at their slots,
and a rejected draft's position is computed again on the next step (the stream flushes what is pending first,
the taps are overwritten).  What the worker cannot tell is where the sequence ends: drafts run past it (rejected,
or cut by max_tokens), so the scheduler's own token count rides to the worker with the finish.  Checked: each
capture holds exactly the sequence's positions and token ids, its maps match HF eager fp32 within FACTOR x HF
bf16's drift, and maps x V reproduce the layers' outputs (ATTN_OTEL_VERIFY)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from reference import Calibrated, check_reconstruction, hf_references

import attn_otel

pytestmark = pytest.mark.engine

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def served_spec(tmp_path_factory, smollm2_path):
    tmp = tmp_path_factory.mktemp("spec")
    store, out = tmp / "store", tmp / "out.json"
    proc = subprocess.run([sys.executable, str(HERE / "spec_serve.py"), smollm2_path, str(store), str(out)],
                          cwd=str(tmp), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return store, json.loads(out.read_text())


def test_drafts_were_proposed_accepted_and_rejected_and_every_request_captured(served_spec):
    _, got = served_spec
    drafted = got["spec"]["vllm:spec_decode_num_draft_tokens"]
    accepted = got["spec"]["vllm:spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted, got["spec"]  # both paths: accepted drafts and rejected ones
    assert got["stats"]["captured"] == len(got["requests"]) and got["stats"]["dropped"] == {}


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
