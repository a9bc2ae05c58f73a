"""Device capture for the map layers: a Q/K tap paged like the KV cache, written inside vLLM's CUDA graphs.

Why a tap and not the KV cache: a query is gone after its step, and a request's rows are only known in
full when it finishes.  Each step, every tapped layer scatters its queries (and keys) into a tap indexed
by the same slot ids as the KV cache (by ``slot_mapping``: no host sync, valid inside CUDA-graph capture).
Prefix caching then comes for free: a cached block still holds the Q/K the request that computed it wrote,
and those are bit-identical for identical tokens and positions.  Keys are tapped too (not read back from
the KV cache) so that one code path serves every backend and KV layout, including the CPU backend's
ISA-specific packing; docs/configuration.md says what that costs.  Streamed layers keep no tap
(:mod:`attn_otel.stream`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import torch

from . import triton_metrics
from .stream import MetricsStream


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    index: int  # model layer number (0-based, in model order)
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # vLLM's impl.scale (carries a model's own query scaling, e.g. Gemma's query_pre_attn_scalar)
    group: int = 0  # KV-cache group whose slots index the layer's tap (its own, or see ``slots_from``)
    soft_cap: float = 0.0  # logits soft-cap c (c * tanh(logits / c)); 0: none
    window: int = 0  # sliding window W (row i sees keys i-W+1 .. i); 0: none
    sinks: tuple[float, ...] | None = None  # learned sink logit per query head (this rank's heads); None: none
    slots_from: str = ""  # a full-attention layer whose slot mapping indexes this (windowed) layer's tap

    @property
    def plain(self) -> bool:
        """No window, soft-cap or sinks: the terms the Triton kernels implement (the torch path does all)."""
        return not self.window and not self.soft_cap and self.sinks is None

    def terms(self, device) -> dict:
        """The keyword arguments of :func:`attn_otel.attention.attention_metrics` for this layer's terms (the
        sinks as a float32 device tensor, made once per device)."""
        sinks = None if self.sinks is None else _sinks_tensor(self.sinks, str(torch.device(device)))
        return dict(soft_cap=float(self.soft_cap), window=int(self.window), sinks=sinks)


@functools.lru_cache(maxsize=256)
def _sinks_tensor(sinks: tuple[float, ...], device: str) -> torch.Tensor:
    return torch.tensor(sinks, dtype=torch.float32, device=device)


class QKTap:
    """Per captured layer, Q ``[slots+1, Hq, D]`` and K ``[slots+1, Hkv, D]`` on the model's device.

    The extra last slot absorbs padded tokens (``slot_mapping == -1``), so a write never branches.
    """

    def __init__(self, layers: Sequence[LayerSpec], num_slots: int, dtype: torch.dtype, device):
        self.layers = {spec.index: spec for spec in layers}
        self.num_slots = int(num_slots)
        self.dtype = dtype
        self.q: dict[int, torch.Tensor] = {}
        self.k: dict[int, torch.Tensor] = {}
        for spec in layers:
            self.q[spec.index] = torch.zeros((num_slots + 1, spec.num_heads, spec.head_dim), dtype=dtype, device=device)
            self.k[spec.index] = torch.zeros((num_slots + 1, spec.num_kv_heads, spec.head_dim), dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(layers: Sequence[LayerSpec], dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        return sum((s.num_heads + s.num_kv_heads) * s.head_dim * size for s in layers)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.q.values(), *self.k.values()))

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def write(self, layer: int, query: torch.Tensor, key: torch.Tensor, slot_mapping: torch.Tensor,
              kv: tuple | None = None) -> bool:
        """One launch for the query and key (padded tokens: slot S), and with ``kv`` vLLM's KV-cache write
        too (see :func:`attn_otel.triton_metrics.scatter_rows`); True where that launch wrote the cache."""
        done = triton_metrics.scatter_rows(self.q[layer], query, slot_mapping, self.num_slots,
                                           dst2=self.k[layer], src2=key, kv=kv)
        return done and kv is not None

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q[layer].index_select(0, slots), self.k[layer].index_select(0, slots)


def capture_bytes_per_token(tapped: Sequence[LayerSpec], streamed: Sequence[LayerSpec], keys_from_cache: bool,
                            dtype: torch.dtype) -> int:
    """Device bytes per KV-cache token of capture: the Q/K tap of the map layers and what streamed layers
    keep per token (see :meth:`attn_otel.stream.MetricsStream.bytes_per_token`); the ring comes on top."""
    per = QKTap.bytes_per_token(tapped, dtype)
    if streamed:
        per += MetricsStream.bytes_per_token(streamed, keys_from_cache, dtype)
    return per
