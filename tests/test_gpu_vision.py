"""Vision share end to end on a real multimodal architecture served by vLLM (GPU: vLLM's multimodal code
needs torchvision, which has no CPU build here).

A Qwen2-VL-shaped model with random weights is built from a config, with a word-level tokenizer made in
code, so nothing is downloaded.  Checks: the image-embedding positions
attn-otel stored are exactly where the model's own processor put image tokens; vision share (raw and
normalised) equals NumPy on the stored maps; a text-only request has no vision metrics at all.
"""

import os

import numpy as np
import pytest
from numpy_metrics import per_row_metrics
from text import SENTENCES

from attn_otel.ids import new_span_id, new_trace_id

pytestmark = pytest.mark.gpu


SPECIALS = ["<unk>", "<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w.strip(".,").lower() for s in SENTENCES for w in s.split()} | {"describe", "compare", "image"})
    vocab = {t: i for i, t in enumerate(SPECIALS + words)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=SPECIALS[2:])


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A Qwen2-VL-shaped model (ViT with 2x2 patch merging + Qwen2 text model with M-RoPE)."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
    from transformers.models.qwen2_vl import Qwen2VLImageProcessor

    tok = _tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    cfg = Qwen2VLConfig(
        text_config=dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=4096,
                         rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]}),
        vision_config=dict(depth=2, embed_dim=64, num_heads=2, hidden_size=256, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_chans=3, mlp_ratio=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen2vl")
    model = Qwen2VLForConditionalGeneration(cfg)
    with torch.no_grad():  # sharper attention than the default init, so shares differ between tokens
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(3.0)
    model.to(torch.bfloat16).save_pretrained(path)
    kwargs = {}
    try:
        from transformers.models.qwen2_vl import Qwen2VLVideoProcessor

        kwargs["video_processor"] = Qwen2VLVideoProcessor()
    except ImportError:
        pass
    proc = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=112 * 112, max_pixels=112 * 112),
                            tokenizer=tok, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
                            **kwargs)
    proc.save_pretrained(path)
    return str(path), proc, ids["<|image_pad|>"]


def _images(n):
    from PIL import Image

    rng = np.random.default_rng(1)
    return [Image.fromarray((rng.random((112, 112, 3)) * 255).astype("uint8")) for _ in range(n)]


def test_vision_share_end_to_end_on_qwen2_vl(vlm, tmp_path):
    import attn_otel
    from vllm import LLM, SamplingParams

    path, proc, image_id = vlm
    store = tmp_path / "store"
    os.environ.update({"ATTN_OTEL": "1", "ATTN_OTEL_STORE": str(store), "ATTN_OTEL_LAYERS": "all",
                       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    llm = LLM(model=path, max_model_len=1024, limit_mm_per_prompt={"image": 2}, gpu_memory_utilization=0.3)
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    prompt = f"compare the {image} and the {image} describe the old lighthouse keeper and the ships"
    images = _images(2)
    vis_trace, txt_trace = new_trace_id(), new_trace_id()

    def sp(trace):
        return SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                              extra_args={"attn_otel": "maps", "traceparent": f"00-{trace}-{new_span_id()}-01"})

    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, sp(vis_trace), use_tqdm=False)[0]
    llm.generate("describe the old lighthouse keeper and the ships", sp(txt_trace), use_tqdm=False)
    llm.llm_engine.step()
    from attn_otel import vllm_adapter

    (engine,) = vllm_adapter.engines()
    assert engine.flush(120)

    # The model's own processor, on the same prompt and images, decides where image embeddings go.
    hf_ids = [int(x) for x in proc(text=prompt, images=images)["input_ids"][0]]
    expected = np.asarray(hf_ids) == image_id
    assert expected.sum() == 32  # 2 images x (112/14)^2 patches merged 2x2
    assert list(out.prompt_token_ids) == hf_ids

    (cap,) = attn_otel.open_trace(vis_trace, store=store)
    mask = cap.vision_mask
    N = cap.prompt_len
    assert mask is not None and np.array_equal(mask[:N], expected)
    maps = cap.maps().astype(np.float64)
    stored = cap.metrics
    for li in range(len(cap.layers)):
        ref = per_row_metrics(maps[li], N, sink_tokens=4, vision=mask[: cap.num_tokens])
        for name in ("vision_share", "vision_share_norm"):
            got, want = stored[name][li], ref[name]
            assert np.array_equal(np.isnan(got), np.isnan(want))
            ok = ~np.isnan(want)
            assert ok.sum() > 0 and np.abs(got[ok] - want[ok]).max() <= 2e-3, name
    summary = cap.summary()
    assert summary["prompt"]["vision_share"]["mean"] is not None

    (txt,) = attn_otel.open_trace(txt_trace, store=store)
    assert "vision_share" not in txt.metrics and txt.vision_mask is None
    from attn_otel.metrics import to_json

    js = to_json(txt)
    assert js["prompt"]["vision_share"] is None and js["generated"]["vision_share_norm"] is None
    if os.environ.get("OUT"):
        import json

        with open(os.path.join(os.environ["OUT"], "gpu_vision.json"), "w") as f:
            json.dump({"image_tokens": int(expected.sum()), "vision_share_prompt_layer_mean":
                       summary["prompt"]["vision_share"].get("layer_mean")}, f, default=str)
