"""Speculative-decoding draft heads built for a Llama target, in the checkpoint layouts vLLM loads, so that the
EAGLE tests need no download: ``build_eagle_head`` (EAGLE-1) and ``build_eagle3_head`` (EAGLE-3).

Both heads are one Llama decoder layer whose attention and MLP add nothing to the residual (``o_proj`` and
``down_proj`` zero): the layer's attention still runs, with its own KV cache, between the target's forwards, as a
trained head's does, and what the head proposes is a fixed function of the target's hidden states.  A proposal
that sometimes matches the target and sometimes not is what the capture has to get right."""

from __future__ import annotations

import json
import os


def _zeroed_layer(cfg, seed: int, qkv_in: int | None = None) -> dict:
    """A Llama decoder layer's weights (HF names, no prefix) with ``o_proj`` and ``down_proj`` zero; with
    ``qkv_in`` the q/k/v projections take inputs of that width (EAGLE-3's first layer: [embedding | hidden])."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    one = type(cfg).from_dict({**cfg.to_dict(), "num_hidden_layers": 1})
    layer = LlamaForCausalLM(one).to(torch.bfloat16).model.layers[0]
    state = {}
    for name, w in layer.state_dict().items():
        if name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            w = torch.zeros_like(w)  # the layer adds nothing to its residual
        elif qkv_in is not None and name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                             "self_attn.v_proj.weight"):
            w = torch.randn((w.shape[0], qkv_in), dtype=torch.bfloat16) * 0.05
        state[name] = w.contiguous()
    return state


def build_eagle_head(target: str, path) -> str:
    """An EAGLE-1 head in the layout vLLM's ``EagleLlamaForCausalLM`` loads: weights ``fc.weight``, ``layers.0.*``,
    ``embed_tokens.weight`` (no ``model.`` prefix, no input layernorm on layer 0; no ``lm_head``: in vLLM 0.26
    the head uses the target's), config of a one-layer Llama.  ``fc = [0 | I]`` passes the target's hidden state
    through, so the head proposes what the target's logits at the last position propose: the last token again."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    big = LlamaForCausalLM.from_pretrained(target, dtype=torch.bfloat16)
    cfg = LlamaConfig.from_pretrained(target)
    hidden = cfg.hidden_size
    state = {f"layers.0.{k}": v for k, v in _zeroed_layer(cfg, 1).items() if not k.startswith("input_layernorm")}
    fc = torch.zeros((hidden, 2 * hidden), dtype=torch.bfloat16)
    fc[:, hidden:] = torch.eye(hidden, dtype=torch.bfloat16)  # [embedding | target hidden] -> target hidden
    state["fc.weight"] = fc
    state["embed_tokens.weight"] = big.model.embed_tokens.weight.detach().clone()
    cfg.num_hidden_layers = 1
    os.makedirs(path, exist_ok=True)
    save_file(state, os.path.join(path, "model.safetensors"))
    cfg.save_pretrained(path)
    return str(path)


def build_eagle3_head(target: str, path) -> str:
    """An EAGLE-3 head in the layout vLLM's ``Eagle3LlamaForCausalLM`` loads (``midlayer.*``, ``fc.weight``,
    ``norm.weight``, ``lm_head.weight``, ``embed_tokens.weight``; architecture ``LlamaForCausalLMEagle3``).

    The target hands the head its hidden states after layers min(2, L/4), L/2 and L
    (``eagle_aux_hidden_state_layer_ids``: 2, 15, 30 for SmolLM2; 1, 2, 4 for a 4-layer target; L is the last
    layer's output, before the final norm).  ``fc = [0 | 0 | I]`` keeps the last, the layer adds
    nothing, ``norm`` and ``lm_head`` are the target's own.  The hidden state the head gets is the one that
    predicted the token just sampled, so, like the EAGLE-1 head, it proposes that token again: accepted where
    the target repeats itself, rejected elsewhere."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    big = LlamaForCausalLM.from_pretrained(target, dtype=torch.bfloat16)
    cfg = LlamaConfig.from_pretrained(target)
    hidden, layers = cfg.hidden_size, cfg.num_hidden_layers
    aux = [min(2, layers // 4), layers // 2, layers]
    state = {f"midlayer.{k}": v for k, v in _zeroed_layer(cfg, 3, qkv_in=2 * hidden).items()}
    state["midlayer.hidden_norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    fc = torch.zeros((hidden, 3 * hidden), dtype=torch.bfloat16)
    fc[:, 2 * hidden:] = torch.eye(hidden, dtype=torch.bfloat16)
    state["fc.weight"] = fc
    state["norm.weight"] = big.model.norm.weight.detach().clone()
    state["lm_head.weight"] = big.lm_head.weight.detach().clone()  # tied to the embedding in SmolLM2: a copy
    state["embed_tokens.weight"] = big.model.embed_tokens.weight.detach().clone()
    os.makedirs(path, exist_ok=True)
    save_file(state, os.path.join(path, "model.safetensors"))
    conf = {**cfg.to_dict(), "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
            "tie_word_embeddings": False, "draft_vocab_size": cfg.vocab_size, "target_hidden_size": hidden,
            # top level for vLLM 0.26 (the GPU's), inside eagle_config for 0.32 (the CPU build's)
            "eagle_aux_hidden_state_layer_ids": aux, "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(conf, f, indent=1)
    return str(path)
