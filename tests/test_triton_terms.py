"""The Triton metric kernel's attention terms (sliding window, chunked local attention, logit soft-cap, learned
sinks) equal the torch reference (attn_otel.attention.attention_metrics) on every path that launches it: one
request (the compute thread's finish), several requests read by slot from a tap (the batched finish), and
several layers with different terms in one launch against paged key caches, from a later position on, into a
per-slot buffer (the stream's flush).

On a GPU the kernels run compiled (``-m gpu``); on the CPU build, in CI, they run in Triton's interpreter
(``TRITON_INTERPRET=1``, in a subprocess: the interpreter is chosen when a kernel is defined).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
# Float32 accumulations of the same bf16 values in another order: the metrics (entropy up to ln 300 = 5.7
# nats) agree to ~3e-6 in the interpreter and ~1e-5 on an H100; 2e-4 is the bound of tests/test_gpu_triton.py.
BOUND = 2e-4
SINKS = [0.5, 3.0, -2.0, 12.0]
TERMS = {  # name: (window, chunk, soft_cap, sinks)
    "plain": (0, 0, 0.0, None),
    "window": (24, 0, 0.0, None),
    "window_past_a_tile": (200, 0, 0.0, None),
    "chunk": (0, 64, 0.0, None),
    "window_and_chunk": (24, 64, 0.0, None),
    "soft_cap": (0, 0, 2.0, None),
    "sinks": (0, 0, 0.0, SINKS),
    "window_cap_sinks": (24, 0, 3.0, SINKS),
    "sink_far_above_keys": (0, 0, 0.0, [200.0, 0.0, -200.0, 40.0]),
}


def _spec(window, chunk, cap, sinks, hq):
    from attn_otel.tap import LayerSpec

    return LayerSpec(index=0, name="l", num_heads=hq, num_kv_heads=1, head_dim=16, scale=1.0, window=window,
                     chunk=chunk, soft_cap=cap, sinks=None if sinks is None else tuple(sinks))


def _ref_terms(window, chunk, cap, sinks, device):
    return dict(window=window, chunk=chunk, soft_cap=cap,
                sinks=None if sinks is None else torch.tensor(sinks, dtype=torch.float32, device=device))


def _compare(got: torch.Tensor, ref: torch.Tensor) -> dict:
    ref = ref[: got.shape[0]]
    nan_agree = bool(torch.equal(torch.isnan(got), torch.isnan(ref)))
    ok = ~torch.isnan(ref) & ~torch.isnan(got)
    err = (got[ok].double() - ref[ok].double()).abs().max().item() if ok.any() else 0.0
    return {"nan_agree": nan_agree, "err": err, "defined": int(ok.sum())}


def cases(device: str) -> dict[str, dict]:
    """Every case's agreement with the reference: ``{name: {nan_agree, err, defined}}``."""
    from attn_otel import triton_metrics as tm
    from attn_otel.attention import attention_metrics

    dev = torch.device(device)
    d = 64 if dev.type == "cuda" else 16  # the interpreter is slow on wide heads
    # bf16 as served; float16 in the interpreter, which gets this kernel wrong on bf16 Q/K (Triton 3.9's numpy
    # emulation: entropy off by up to 5 nats; on float16 or float32 Q/K it agrees to 1e-6)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float16
    hq, hkv = 4, 2
    g = torch.Generator().manual_seed(0)
    res = {}

    # one request (row_metrics): every set of terms, with and without an image, bf16 Q/K
    T, N = 300, 140
    q = (torch.randn(T, hq, d, generator=g) * 1.5).to(dt).to(dev)
    k = (torch.randn(T, hkv, d, generator=g) * 1.5).to(dt).to(dev)
    vm = (torch.rand(T, generator=g) < 0.3).to(dev)
    scale = 0.25
    for name, (w, c, cap, sinks) in TERMS.items():
        for vision in (None, vm):
            t = tm.terms([_spec(w, c, cap, sinks, hq)], dev)
            got = tm.row_metrics(q[None], k[None], scale, N, 4, vision, terms=t)[0]
            ref = attention_metrics(q.float(), k.float(), scale, N, 4, vision, **_ref_terms(w, c, cap, sinks, dev))
            res[f"one/{name}" + ("/vision" if vision is not None else "")] = _compare(got, ref)

    # several requests from a tap by slot (row_metrics_slots): window, cap and sinks together
    S = 1024
    q_tap = (torch.randn(S, hq, d, generator=g) * 1.5).to(dt).to(dev)
    k_tap = (torch.randn(S, hkv, d, generator=g) * 1.5).to(dt).to(dev)
    Ts, Ns = [37, 300, 1, 129], [30, 250, 1, 100]
    perm = torch.randperm(S, generator=g)
    slots = [perm[sum(Ts[:b]):sum(Ts[:b + 1])].to(dev) for b in range(len(Ts))]
    cu = torch.tensor([0, *torch.tensor(Ts).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    w, c, cap, sinks = TERMS["window_cap_sinks"]
    t = tm.terms([_spec(w, c, cap, sinks, hq)], dev)
    out = tm.row_metrics_slots(q_tap, k_tap, torch.cat(slots), cu, torch.tensor(Ns, dtype=torch.int32, device=dev),
                               max(Ts), scale, 4, terms=t)
    assert out.shape[0] == 8, out.shape
    for b, (Tb, Nb) in enumerate(zip(Ts, Ns)):
        a, z = int(cu[b]), int(cu[b + 1])
        ref = attention_metrics(q_tap[slots[b]].float(), k_tap[slots[b]].float(), scale, Nb, 4,
                                **_ref_terms(w, c, cap, sinks, dev))
        res[f"slots/request{b}"] = _compare(out[:, :, a:z], ref)

    # the stream's flush (row_metrics_stream_layers): three layers of different terms in one launch, keys in
    # paged caches (blocks of 16, shuffled), rows from position ``first`` on, written by slot, only the metrics
    # a text model's per-slot buffer keeps (attn_otel.stream.slot_rows: no entropy_norm, no vision pair)
    L, BS, blocks = 3, 16, 64
    layer_terms = [(0, 0, 5.0, SINKS), (0, 0, 0.0, None), (0, 0, 0.0, [1.0, -1.0, 2.0, 0.0])]
    caches = (torch.randn(L, blocks, BS, hkv, d, generator=g) * 1.5).to(dt).to(dev)
    Tr, first = 150, 90  # positions 0..149; rows 90..149 pending
    key_slots = (torch.randperm(blocks, generator=g)[: (Tr + BS - 1) // BS, None] * BS
                 + torch.arange(BS)[None, :]).reshape(-1)[:Tr].to(dev)
    R = 128
    q_ring = (torch.randn(L, R + 1, hq, d, generator=g) * 1.5).to(dt).to(dev)
    ring_rows = torch.randperm(R, generator=g)[: Tr - first].to(dev)
    from attn_otel.attention import METRICS
    from attn_otel.stream import slot_rows

    kept = slot_rows([_spec(*lt, hq) for lt in layer_terms], vision=False)
    assert kept == ("entropy", "sink_mass_first", "sink_mass_k", "lookback_ratio", "learned_sink_mass")
    metrics = torch.full((L, blocks * BS + 1, len(kept), hq), float("nan"), dtype=torch.float32, device=dev)
    offs = tm.key_offsets([caches[i] for i in range(L)])
    i32 = dict(dtype=torch.int32, device=dev)
    tm.row_metrics_stream_layers(
        q_ring, ring_rows, torch.tensor([0, Tr - first], **i32), torch.tensor([first], **i32),
        [caches[i] for i in range(L)], torch.tensor(offs, dtype=torch.int64, device=dev), key_slots,
        torch.tensor([0, Tr], **i32), torch.tensor([60], **i32), Tr - first, scale, 4, None, None, metrics,
        terms=tm.terms([_spec(*lt, hq) for lt in layer_terms], dev), rows=kept)
    for li, lt in enumerate(layer_terms):
        kk = caches[li].reshape(-1, hkv, d)[key_slots].float()
        qq = torch.zeros(Tr, hq, d, device=dev)
        qq[first:] = q_ring[li][ring_rows].float()
        ref = attention_metrics(qq, kk, scale, 60, 4, start=first, **_ref_terms(*lt, dev))[:, :, first:]
        ref = ref[[METRICS.index(n) for n in kept]]
        got = metrics[li][key_slots[first:]].permute(1, 2, 0)  # [kept, H, rows]
        if lt[3] is None:  # a layer without sinks in a launch with them: its learned sink row stays NaN
            assert torch.isnan(got[-1]).all()
            got, ref = got[:-1], ref[:-1]
        res[f"stream/layer{li}"] = _compare(got, ref)

    # the flush as the stream launches it for a text model (FlushKernels.run_fused): keys found by block (each
    # request's block-table row, a spare block at its end; paged=BS) and each pending row's query by the
    # slot -> ring-row table the forwards wrote; two requests, one far into its decode, one whose rows are all
    # pending, their blocks shuffled among each other's
    perm = torch.randperm(blocks, generator=g)
    free = torch.randperm(R, generator=g).to(dev)  # ring rows, handed out to the pending rows in order

    def paged_flush(name: str, pb: int, reqs: list) -> None:
        """Launch the flush of ``reqs`` ((keys, first pending row, prompt, block ids of ``pb`` positions)) with
        keys by block id and compare each request's rows on every layer."""
        table = torch.full((blocks * BS + 1,), R, dtype=torch.int64, device=dev)
        req_slots, used = [], 0
        for Tb, fb, _, bl in reqs:
            pos = torch.arange(Tb)
            sl = (bl[pos // pb] * pb + pos % pb).to(dev)
            table[sl[fb:]] = free[used:used + Tb - fb]
            used += Tb - fb
            req_slots.append(sl)
        metrics = torch.full((L, blocks * BS + 1, len(kept), hq), float("nan"), dtype=torch.float32, device=dev)
        counts = [Tb - fb for Tb, fb, _, _ in reqs]
        cu_blocks = [0, *torch.tensor([len(bl) for *_, bl in reqs]).cumsum(0).tolist()]
        tm.row_metrics_stream_layers(
            q_ring, None, torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], **i32),
            torch.tensor([fb for _, fb, _, _ in reqs], **i32), [caches[i] for i in range(L)],
            torch.tensor(offs, dtype=torch.int64, device=dev), torch.cat([bl for *_, bl in reqs]).to(dev),
            torch.tensor(cu_blocks, **i32), torch.tensor([nb for _, _, nb, _ in reqs], **i32), max(counts), scale, 4,
            None, None, metrics, terms=tm.terms([_spec(*lt, hq) for lt in layer_terms], dev), rows=kept,
            row_table=table, paged=pb)
        for b, ((Tb, fb, nb, _), sl) in enumerate(zip(reqs, req_slots)):
            for li, lt in enumerate(layer_terms):
                kk = caches[li].reshape(-1, hkv, d)[sl].float()
                qq = torch.zeros(Tb, hq, d, device=dev)
                qq[fb:] = q_ring[li][table[sl[fb:]]].float()
                ref = attention_metrics(qq, kk, scale, nb, 4, start=fb, **_ref_terms(*lt, dev))[:, :, fb:]
                ref = ref[[METRICS.index(n) for n in kept]]
                got = metrics[li][sl[fb:]].permute(1, 2, 0)
                if lt[3] is None:
                    assert torch.isnan(got[-1]).all()
                    got, ref = got[:-1], ref[:-1]
                res[f"{name}/request{b}/layer{li}"] = _compare(got, ref)

    paged_flush("paged", BS, [(150, 90, 60, perm[:11]), (40, 0, 25, perm[11:14])])
    # block ids of twice the cache's block size (a manager's block over two of the kernel's, as hybrids' caches
    # may have them): the kernel's general path, each key's slot split again by the cache's block size
    mperm = torch.randperm(blocks // 2, generator=g)
    paged_flush(f"paged{2 * BS}", 2 * BS, [(150, 90, 60, mperm[:5]), (40, 0, 25, mperm[5:7])])

    # the same flush for a model that takes images: the per-slot rows keep the vision pair; a request with an
    # image, one layer at a time (row_metrics_stream), a plain layer and a windowed one with sinks
    vm = torch.zeros(Tr, device=dev)
    vm[20:70] = 1.0  # an image at positions 20..69
    vc = torch.cumsum(vm, 0)[first:]  # image keys up to each pending row
    for name, lt in (("plain", (0, 0, 0.0, None)), ("window_sinks", (24, 0, 0.0, SINKS))):
        kept = slot_rows([_spec(*lt, hq)], vision=True)
        out = torch.full((blocks * BS + 1, len(kept), hq), float("nan"), dtype=torch.float32, device=dev)
        tm.row_metrics_stream(q_ring[0], ring_rows, torch.tensor([0, Tr - first], **i32), torch.tensor([first], **i32),
                              caches[0], key_slots, torch.tensor([0, Tr], **i32), torch.tensor([60], **i32), Tr - first,
                              scale, 4, vm, vc, out, terms=tm.terms([_spec(*lt, hq)], dev), rows=kept)
        kk = caches[0].reshape(-1, hkv, d)[key_slots].float()
        qq = torch.zeros(Tr, hq, d, device=dev)
        qq[first:] = q_ring[0][ring_rows].float()
        ref = attention_metrics(qq, kk, scale, 60, 4, vm.bool(), start=first, **_ref_terms(*lt, dev))[:, :, first:]
        got = out[key_slots[first:]].permute(1, 2, 0)
        res[f"stream_vision/{name}"] = _compare(got, ref[[METRICS.index(n) for n in kept]])
    return res


def _check(results: dict) -> None:
    assert len(results) == 2 * len(TERMS) + 4 + 3 + 6 + 6 + 2
    bad = {k: v for k, v in results.items() if not v["nan_agree"] or v["err"] > BOUND or not v["defined"]}
    assert not bad, bad


def test_the_kernels_terms_match_torch_in_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]))
    code = "import json, test_triton_terms as t; print('RESULT ' + json.dumps(t.cases('cpu')))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    _check(json.loads(line[len("RESULT "):]))


@pytest.mark.gpu
def test_the_kernels_terms_match_torch_on_the_gpu():
    _check(cases("cuda"))


# (LAYERED, LOCAL, HAS_CAP, HAS_SINKS, HAS_VISION, OUT_BY_SLOT, PAGED): the finish's paths (one request, by slot)
# with a windowed layer's terms, the stream's flush of several layers with soft-caps and sinks, the plain kernel,
# and the stream's flush of a text model as it is launched (keys by block) with and without a window
COMPILED = [(False, True, True, True, True, False, False), (False, True, False, True, False, False, False),
            (True, False, True, True, False, True, True), (True, False, False, False, True, True, False),
            (True, False, False, False, False, True, True), (False, True, False, True, False, True, True)]


@pytest.mark.parametrize("flags", COMPILED, ids=["one-local-cap-sinks-vision", "one-local-sinks",
                                                 "stream-cap-sinks-paged", "stream-plain-vision", "stream-plain-paged",
                                                 "stream-local-sinks-paged"])
def test_the_kernel_compiles_for_an_h100(flags):
    """The interpreter runs the kernel as Python and so does not check what only the compiler does (types that
    differ between branches, shapes a loop carries): compile the kernel's variants to an sm_90 cubin, with
    Triton's own ptxas, no GPU needed.  (The GPU machine's Triton is torch 2.11's, not this one's.)"""
    from sm90 import compile_sm90

    from attn_otel import triton_metrics as tm

    fn = tm._row_metrics
    layered, local, cap, sinks, vision, by_slot, paged = flags
    block_r, block_n, warps, stages = tm._config(4, 64, paged)  # the launch configuration these launches ship with
    # the stream's per-slot rows (a text model's, or one that takes images) or every metric
    from attn_otel.stream import slot_rows

    rows = slot_rows([_spec(0, 0, 0.0, [0.0] if sinks else None, 4)], vision) if by_slot else None
    consts = dict(HAS_VISION=vision, OUT_BY_SLOT=by_slot, LAYERED=layered, LOCAL=local, HAS_CAP=cap,
                  HAS_SINKS=sinks, **tm._rows_at(rows), PAGED=paged, PBS=16 if paged else 1, PBS_IS_BS=paged,
                  QR_TABLE=by_slot, HG=4, D=64, D2=0, BLOCK_R=block_r, BLOCK_N=block_n)
    ptrs = {"Q": "*bf16", "K": "*bf16", "QR": "*i64", "KSL": "*i64", "KOFF": "*i64", "VM": "*fp32", "VC": "*fp32",
            "OUT": "*fp16" if by_slot else "*fp32", "CAPP": "*fp32", "SINKP": "*fp32", "scale": "fp32",
            **{p: "*i32" for p in ("CUQ", "A", "CUK", "NP", "WINP", "CHP")}}
    compiled = compile_sm90(fn, consts, ptrs, num_warps=warps, num_stages=stages)
    assert compiled.asm["cubin"] and "_row_metrics" in compiled.asm["ptx"]
