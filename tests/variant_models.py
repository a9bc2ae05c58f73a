"""Tiny random-weight models whose attention has the terms of today's production models (issue 21), saved
as Hugging Face folders that vLLM's CPU build serves: Gemma 2 (alternating sliding window, logit
soft-capping, query_pre_attn_scalar != head_dim) and gpt-oss (learned attention sinks, alternating sliding
window, MoE).  No tokenizer: requests go in as token ids."""

from __future__ import annotations

from pathlib import Path

WINDOW = 16
CHUNK = 32
VOCAB = 512


def _save(model, path: Path) -> str:
    import torch

    path.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(str(path))
    return str(path)


def _markov(model) -> None:
    """Zero every attention layer's output projection: the attention still runs (its maps are what is
    checked) but the next token depends on the current token alone, so an ngram proposer's drafts are right
    once the greedy output cycles (speculative decoding tests need accepted drafts as well as rejected ones)."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            if getattr(layer.self_attn.o_proj, "bias", None) is not None:
                layer.self_attn.o_proj.bias.zero_()


def build_gemma2(path: Path, all_window: bool = False, markov: bool = False) -> str:
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=48,
                       sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
                       max_position_embeddings=1024, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                       pad_token_id=0)
    cfg.layer_types = ["sliding_attention" if i % 2 == 0 or all_window else "full_attention" for i in range(4)]
    model = Gemma2ForCausalLM(cfg)
    if markov:
        _markov(model)
    return _save(model, path)


def build_gemma3(path: Path) -> str:
    """A Gemma-3-shaped text model: QK-norm, query_pre_attn_scalar != head_dim, local layers (window 16, RoPE
    base 10k) alternating with global ones (RoPE base 1M), no soft-cap.  Alternating rather than Gemma 3's 5:1
    so that the variant tests' per-layer expectations (window on the even layers) hold for it too."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=48,
                           sliding_window=WINDOW, max_position_embeddings=1024, initializer_range=0.2,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(4)]
    model = Gemma3ForCausalLM(cfg)
    return _save(model, path)


def build_mistral(path: Path) -> str:
    """A Mistral-7B-v0.1-shaped model: sliding window 16 on every layer (so vLLM keeps one SlidingWindowSpec
    KV-cache group and no full-attention one), GQA."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=WINDOW,
                        max_position_embeddings=1024, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                        pad_token_id=0)
    model = MistralForCausalLM(cfg)
    return _save(model, path)


def build_gptoss(path: Path, markov: bool = False) -> str:
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=1024,
                       initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(2)]
    model = GptOssForCausalLM(cfg)
    with torch.no_grad():  # sinks of a visible size: some heads keep much of their mass in the sink
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.tensor([0.0, 2.0, 4.0, -2.0]))
    if markov:
        _markov(model)
    return _save(model, path)


def build_deepseek(path: Path, sharpen: float = 3.0) -> str:
    """A DeepSeek-V3-shaped model: multi-head latent attention (q_lora_rank 64, kv_lora_rank 512, rope 64,
    nope 32, v 32; the CPU build's MLA decode kernel takes only a 512 + 64 latent row), one dense layer then
    one MoE layer (4 routed experts, 2 per token, one shared).  On a CUDA machine nope and v are DeepSeek's own
    128: vLLM 0.26's GPU MLA prefill backends serve no other."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    nope = 128 if torch.cuda.is_available() else 32

    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
                           kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=nope, v_head_dim=nope,
                           n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                           n_group=1, topk_group=1, max_position_embeddings=1024, initializer_range=0.1,
                           rope_scaling=None, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                           tie_word_embeddings=False)
    cfg.topk_method, cfg.scoring_func = "noaux_tc", "sigmoid"  # DeepSeek-V3's router (vLLM reads these)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # sharper attention than the init gives: far from uniform, so maps mean something
        for layer in model.model.layers:
            layer.self_attn.q_b_proj.weight.mul_(sharpen)
            layer.self_attn.kv_b_proj.weight.mul_(sharpen)
    return _save(model, path)


def build_qwen3_next(path: Path) -> str:
    """A Qwen3-Next-shaped hybrid: gated DeltaNet (linear attention; head dims 128, the CPU kernel's) layers 0-2, full attention (gated, with
    a partial rotary) on layer 3, 4 layers in all, a small MoE.  vLLM puts the full-attention layer in a
    KV-cache group of its own, beside the linear layers' state groups."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3NextConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_value_heads=4,
                          linear_num_key_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                          shared_expert_intermediate_size=64, max_position_embeddings=1024,
                          initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.layer_types = ["linear_attention"] * 3 + ["full_attention"]
    model = Qwen3NextForCausalLM(cfg)
    return _save(model, path)


def build_llama4(path: Path) -> str:
    """A Llama-4-shaped text model: chunked local attention (chunk 32; the CPU build wants a block size of 32) with RoPE and QK-norm on layers 0-2, a
    global NoPE layer 3 (Llama 4's one in four), dense MLPs (an MoE's top-1 routing flips between bf16 and
    float32 and would blur the comparison with HF; the attention is what is tested)."""
    import torch
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(0)
    cfg = Llama4TextConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, intermediate_size_mlp=256,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=5,
                           attention_chunk_size=CHUNK, no_rope_layers=[1, 1, 1, 0], max_position_embeddings=1024,
                           initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                           attn_temperature_tuning=True, floor_scale=16, attn_scale=0.1)
    model = Llama4ForCausalLM(cfg)
    return _save(model, path)


def build_deepseek_mtp(path: Path, noise: float = 0.5) -> str:
    """The DeepSeek-V3-shaped model (:func:`build_deepseek`) with one multi-token-prediction layer (DeepSeek's
    MTP, ``num_nextn_predict_layers=1``: weights ``model.layers.2.{enorm,hnorm,eh_proj,shared_head.*}`` and a
    decoder block, MLA attention and MoE, at ``model.layers.2.*``), for vLLM's ``mtp`` speculative decoding.

    Made so that the MTP layer predicts the model's next token, imperfectly: every attention output projection
    is zero and layer 0's MLP adds nothing, so the model's next token is a function of the current token alone
    (its MLA attention still runs: its maps are what is checked), the embedding rows have RMS 1 so the MTP
    layer's ``enorm`` passes them through, ``eh_proj = [I | 0]`` takes the token's embedding, and the MTP block is
    layer 1 again with noise (``noise`` x each weight's spread) on its experts.  Drafts are then sometimes
    accepted and mostly rejected (35 of 298 in tests/test_engine_mla.py), which is what the capture must get right.
    HF's model ignores layer 2 (it has 2 layers), the reference maps are the two target layers'."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    path = Path(build_deepseek(path, sharpen=2.0))
    state = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    for i in (0, 1):
        state[f"model.layers.{i}.self_attn.o_proj.weight"].zero_()
    state["model.layers.0.mlp.down_proj.weight"].zero_()
    emb = state["model.embed_tokens.weight"].float()
    state["model.embed_tokens.weight"] = (emb / emb.pow(2).mean(-1, keepdim=True).sqrt()).to(torch.bfloat16)
    for k in [k for k in state if k.startswith("model.layers.1.")]:
        w = state[k].clone()
        if ".experts." in k and w.dim() == 2:
            w = (w.float() + noise * w.float().std() * torch.randn(w.shape, generator=g)).to(w.dtype)
        state[k.replace("model.layers.1.", "model.layers.2.")] = w
    hidden = state["model.norm.weight"].shape[0]
    ones = torch.ones(hidden, dtype=torch.bfloat16)
    eh = torch.zeros((hidden, 2 * hidden), dtype=torch.bfloat16)
    eh[:, :hidden] = torch.eye(hidden, dtype=torch.bfloat16)
    state.update({"model.layers.2.enorm.weight": ones, "model.layers.2.hnorm.weight": ones.clone(),
                  "model.layers.2.eh_proj.weight": eh,
                  "model.layers.2.shared_head.norm.weight": state["model.norm.weight"].clone(),
                  "model.layers.2.shared_head.head.weight": state["lm_head.weight"].clone()})
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return str(path)
