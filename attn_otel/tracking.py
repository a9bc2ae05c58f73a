"""Request tracking: what the adapter learns of each request step by step, and where a rank's part of a
capture sits.  vLLM-free: :mod:`attn_otel.vllm_adapter` feeds it plain values from the scheduler's output."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import numpy as np
import torch

from . import arrival
from .store import CapturePart


def model_name(served: object, model: object) -> str:
    """The name a capture records as its ``model`` (attributes, span, Prometheus label): vLLM's
    ``served_model_name`` (the first, when it is a list), else the model as the operator gave it; a local
    filesystem path (absolute, ``~``, ``./`` or ``../``, or one that exists here) becomes its final component
    (``/models/SmolLM2-135M-Instruct/`` -> ``SmolLM2-135M-Instruct``), so no local path is ever exported.
    vLLM fills ``served_model_name`` with the model string when the operator set none
    (``--served-model-name``); a Hugging Face id such as ``HuggingFaceTB/SmolLM2-135M`` stays as it is."""
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    name = str(served or model or "").strip()
    if name and _local_path(name):
        name = os.path.basename(os.path.normpath(os.path.expanduser(name))) or name
    return name


def _local_path(name: str) -> bool:
    if name.startswith(("/", "~", "./", "../", ".\\", "..\\")) or os.path.isabs(name):
        return True
    try:
        return os.path.exists(name)
    except (OSError, ValueError):
        return False


@dataclasses.dataclass
class FinishedRequest:
    """What the adapter knows of a request when it finishes, before its blocks can be reused."""

    request_id: str
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int] | None  # None when only the device holds them (see token_ids_device)
    num_tokens: int  # tokens whose Q/K went through the model (prompt + generated - last sampled)
    block_ids: Sequence[Sequence[int]]  # per KV-cache group
    block_sizes: Sequence[int]  # per KV-cache group
    extra_args: dict[str, Any] | None = None
    vision_positions: np.ndarray | None = None  # bool [>= num_tokens], True on image-embedding tokens
    token_ids_device: torch.Tensor | None = None  # all token ids [>= num_tokens] on the device
    finish_reason: str | None = None  # vLLM's: stop, length, abort, error, repetition (None: not known)
    spill: tuple[int, ...] = ()  # spill blocks in ``block_ids`` standing for its last block (attn_otel.spill)


@dataclasses.dataclass
class Tracked:
    prompt_token_ids: list[int]
    extra_args: dict[str, Any] | None
    block_ids: list[list[int]]
    vision_positions: np.ndarray | None
    written: int = 0
    maps: bool = False  # planned for maps at arrival (attn_otel.arrival): the map tap keeps its queries


class RequestTracker:
    """Follows each request through the scheduler's per-step output: its blocks (per KV-cache group) and
    how many of its tokens have been through the model.  Fed by the adapter; knows nothing of vLLM."""

    def __init__(self) -> None:
        self._reqs: dict[str, Tracked] = {}

    def __len__(self) -> int:
        return len(self._reqs)

    def add(self, req_id: str, prompt_token_ids, extra_args, block_ids, num_computed: int, num_scheduled: int,
            vision_positions=None) -> Tracked:
        t = self._reqs[req_id] = Tracked(list(prompt_token_ids or []), extra_args, [list(b) for b in block_ids],
                                         vision_positions, int(num_computed) + int(num_scheduled),
                                         bool(arrival.planned(extra_args)[1]))
        return t

    def update(self, req_id: str, new_block_ids, num_computed: int, num_scheduled: int,
               resumed: bool) -> Tracked | None:
        t = self._reqs.get(req_id)
        if t is None:
            return None
        if new_block_ids is not None:
            if resumed:
                t.block_ids = [list(b) for b in new_block_ids]
            else:
                for group, extra in zip(t.block_ids, new_block_ids):
                    group.extend(extra)
        t.written = int(num_computed) + int(num_scheduled)
        return t

    def finish(self, req_id: str) -> Tracked | None:
        return self._reqs.pop(req_id, None)

    def get(self, req_id: str) -> Tracked | None:
        return self._reqs.get(req_id)


@dataclasses.dataclass(frozen=True)
class Parallel:
    """Where this engine's rank sits in a tensor- and/or pipeline-parallel model.

    Each rank taps the heads and layers it holds and writes them as one :class:`CapturePart` of the
    request's capture; nothing crosses ranks on the serving path.  Every rank derives the same trace id,
    span id and maps decision for a request from ``id_seed`` (vLLM's instance id, shared by its workers)."""

    tp_rank: int
    tp: int
    pp_rank: int
    pp: int
    total_heads: int  # query heads of the whole model (this rank holds heads_per_rank of them)
    stage_of: dict[int, int]  # model layer -> pipeline stage that holds it
    capture_layers: tuple[int, ...]  # ATTN_OTEL_LAYERS resolved on the whole model, all stages
    id_seed: str = ""

    def part(self, layers: Sequence[int], local_heads: int, local: Sequence[int]) -> CapturePart | None:
        """This rank's part of a capture of ``layers`` (None: this rank's stage holds none of them);
        ``local`` are the layers this rank captures (a stage's layer it refuses stays empty)."""
        stages = sorted({self.stage_of.get(x, -1) for x in layers})
        if self.pp_rank not in stages:
            return None
        mine = tuple(x for x in layers if self.stage_of.get(x) == self.pp_rank and x in local)
        return CapturePart(index=stages.index(self.pp_rank) * self.tp + self.tp_rank, count=len(stages) * self.tp,
                           heads=(self.tp_rank * local_heads, (self.tp_rank + 1) * local_heads), layers=mine,
                           tp=self.tp, pp=self.pp)
