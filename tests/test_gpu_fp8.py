"""fp8 KV cache on an NVIDIA GPU: the maps are what the served model computed from its fp8 cache.

Run on the lent GPU machine: ``python3 -P -m pytest -m gpu tests/test_gpu_fp8.py``; ``TEST_ATTENTION_BACKEND``
(FLASH_ATTN, TRITON_ATTN, ...) and ``TEST_KV_DTYPE`` (fp8, fp8_e4m3, fp8_e5m2) pick another backend or format.
The small random-weight Llama of tests/test_gpu.py, served with ``kv_cache_dtype="fp8"`` in vLLM's default config (FLASH_ATTN with
FlashAttention 3 quantises the queries too).  With ``ATTN_OTEL_VERIFY=1`` each maps capture checks itself:
maps times the values read back from vLLM's fp8 cache (dequantised with the layer's v_scale) must give the
layer's attention output as FA3 computed it, within what FA3's fp8 path allows (it rounds P to e4m3 for the
P.V product: tests/reference.py, ``reconstruction_bound``).  The distance to HF eager float32 is reported
beside it: there the fp8 rounding of K, V and Q is the model's own numerics, not a capture error.

``TEST_KV_SCALES=calibrated`` serves the same weights as a compressed-tensors checkpoint with a
``kv_cache_scheme`` and per-tensor q/k/v scales calibrated on the model's own activations (amax / 448, as
llm-compressor sets them; every layer's differ, none is 1): the maps must use the scales vLLM loaded.
``TEST_KV_SCALES=per-head`` gives one scale per KV head (the scheme's ``attn_head`` strategy), which FLASH_ATTN
applies head by head and attn-otel does not: every layer must be refused by name, and the model still served.
"""

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from reference import Calibrated, check_reconstruction, hf_references
from test_gpu import HEADS, LAYERS, gpu_model  # noqa: F401 - the same model fixture

import attn_otel
from attn_otel.ids import new_span_id, new_trace_id

pytestmark = pytest.mark.gpu
BACKEND = os.environ.get("TEST_ATTENTION_BACKEND") or None  # None: the one vLLM picks (FLASH_ATTN on an H100)
KV_DTYPE = os.environ.get("TEST_KV_DTYPE", "fp8")
KV_SCALES = os.environ.get("TEST_KV_SCALES", "default")  # default (1.0), calibrated or per-head


def with_kv_scales(model_dir: str, out_dir, per_head: bool) -> tuple[str, dict]:
    """``model_dir``'s weights as a compressed-tensors checkpoint with an fp8 ``kv_cache_scheme`` and q/k/v
    scales from the activations of HF's fp32 forward over random tokens (amax / 448 with a margin for RoPE, per
    tensor or per head): the folder, and ``{layer: {"q"|"k"|"v": scales}}``."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = model.config
    heads = {"q": cfg.num_attention_heads, "k": cfg.num_key_value_heads, "v": cfg.num_key_value_heads}
    amax: dict = {}

    def hook(li, which):
        def fn(_mod, _inp, out):
            a = out.detach().abs().reshape(-1, heads[which], out.shape[-1] // heads[which]).amax(dim=(0, 2))
            amax[(li, which)] = torch.maximum(amax.get((li, which), a), a)
        return fn

    hooks = [getattr(layer.self_attn, f"{w}_proj").register_forward_hook(hook(li, w))
             for li, layer in enumerate(model.model.layers) for w in "qkv"]
    rng = np.random.default_rng(11)
    with torch.no_grad():
        model(torch.tensor([rng.integers(10, 4000, 512).tolist()]))
    for h in hooks:
        h.remove()
    out = Path(out_dir)
    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    (st,) = list(out.glob("*.safetensors"))
    tensors = load_file(str(st))
    scales: dict = {}
    for (li, w), a in sorted(amax.items()):
        sc = a * 1.5 / 448.0 if per_head else (a.max() * 1.5 / 448.0).reshape(1)
        tensors[f"model.layers.{li}.self_attn.{w}_scale"] = (sc.reshape(-1, 1, 1) if per_head else sc).float()
        scales.setdefault(li, {})[w] = sc.tolist()
    save_file(tensors, str(st), metadata={"format": "pt"})
    conf = json.loads((out / "config.json").read_text())
    conf["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "dense", "config_groups": {}, "ignore": [],
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "attn_head" if per_head else "tensor",
                            "dynamic": False, "symmetric": True}}
    (out / "config.json").write_text(json.dumps(conf))
    return str(out), scales


@pytest.fixture(scope="module")
def fp8_engine(gpu_model, tmp_path_factory):  # noqa: F811
    store = tmp_path_factory.mktemp("store-fp8")
    os.environ.update({"ATTN_OTEL": "1", "ATTN_OTEL_STORE": str(store), "ATTN_OTEL_LAYERS": "all",
                       "ATTN_OTEL_ROW_METRICS": "all", "ATTN_OTEL_VERIFY": "1",
                       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    from vllm import LLM

    model, scales = gpu_model, None
    if KV_SCALES != "default":
        model, scales = with_kv_scales(gpu_model, tmp_path_factory.mktemp("scaled"), KV_SCALES == "per-head")
        print("checkpoint kv scales:", json.dumps(scales))
    warned = _Warnings()
    logging.getLogger("attn_otel").addHandler(warned)
    try:
        llm = LLM(model=model, skip_tokenizer_init=True, max_model_len=4096, max_num_batched_tokens=256,
                  gpu_memory_utilization=0.3, seed=0, kv_cache_dtype=KV_DTYPE,
                  attention_backend=BACKEND)
    finally:
        logging.getLogger("attn_otel").removeHandler(warned)
    return llm, store, scales, warned.lines


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_per_head_fp8_scales_are_refused_by_name_and_the_model_still_served(fp8_engine):
    """attn_head scales: every layer refused with its reason, capture off, the model served as without it."""
    from vllm import SamplingParams

    from attn_otel import vllm_adapter

    llm, _, _, warnings = fp8_engine
    if KV_SCALES != "per-head":
        assert not any("per-head scales" in w for w in warnings), warnings
        return
    assert not vllm_adapter.engines()
    (line,) = [w for w in warnings if "not capturing" in w]
    assert f"not capturing {LAYERS} layer(s)" in line and line.count("per-head scales") == LAYERS, line
    assert any("no layer of this model can be captured" in w for w in warnings), warnings
    out = llm.generate([{"prompt_token_ids": list(range(10, 90))}], SamplingParams(max_tokens=8, temperature=0.0),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    print("GPU fp8 per-head scales:", line)


def test_fp8_maps_reconstruct_the_backends_output(fp8_engine, gpu_model):  # noqa: F811
    from vllm import SamplingParams

    from attn_otel import vllm_adapter

    llm, store, scales, _ = fp8_engine
    if KV_SCALES == "per-head":  # nothing captured: test_per_head_fp8_scales_are_refused_by_name_...
        assert not vllm_adapter.engines()
        return
    (engine,) = vllm_adapter.engines()
    if scales is not None:  # the checkpoint's scales, as vLLM loaded them, in every layer's logit scale
        for spec in engine.layers:  # FA3 takes fp8 queries (q / q_scale): k_scale x q_scale; else k_scale
            sc, base = scales[spec.index], spec.head_dim ** -0.5
            want = [base * sc["k"][0] * sc["q"][0]] + ([] if BACKEND in (None, "FLASH_ATTN") else [base * sc["k"][0]])
            assert any(abs(spec.scale / w - 1) < 1e-5 for w in want), (spec.index, spec.scale, want)
    rng = np.random.default_rng(3)
    shared = rng.integers(10, 4000, 300).tolist()
    prompts = [shared + rng.integers(10, 4000, 350).tolist()]  # chunked at 256
    prompts += [rng.integers(10, 4000, 40 + 60 * i).tolist() for i in range(8)]  # a concurrent batch
    traces = [new_trace_id() for _ in prompts]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                             extra_args={"attn_otel": "maps", "traceparent": f"00-{t}-{new_span_id()}-01"})
              for t in traces]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.step()
    assert engine.flush(120)
    results = {"attention_impl": engine.attrs["attention_impl"], "kv_cache_dtype": KV_DTYPE, "kv_scales": KV_SCALES,
               "cudagraph_mode": str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)}
    recon, cal = [], Calibrated()
    for out, t in zip(outs, traces):
        (cap,) = attn_otel.open_trace(t, store)
        assert cap.has_maps and cap.layers == list(range(LAYERS)) and cap.num_heads == HEADS
        recon.append(check_reconstruction(cap, kv_dtype=KV_DTYPE))
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        fp32, bf16 = hf_references(gpu_model, ids[: cap.num_tokens], device="cuda")
        cal.add_maps("tv", cap.maps(), fp32, bf16)
    results["reconstruction_worst"] = {k: max(r[k] for r in recon) for k in ("median", "p99", "max")}
    results["reconstruction_bound"] = recon[0]["bound"]
    results["against_hf_fp32"] = cal.report()  # reported, not bounded: fp8 is the served model's numerics
    results["stats"] = engine.stats.snapshot()
    print("GPU fp8:", json.dumps(results))
    if os.environ.get("OUT"):
        name = f"gpu_fp8-{BACKEND or 'default'}-{KV_DTYPE}" + ("" if KV_SCALES == "default" else f"-{KV_SCALES}")
        with open(os.path.join(os.environ["OUT"], name + ".json"), "w") as f:
            json.dump(results, f, indent=1)
    assert results["attention_impl"].startswith({"TRITON_ATTN": "Triton", "FLASHINFER": "FlashInfer"}.get(
        BACKEND, "FlashAttention"))
    assert not results["stats"]["dropped"]
