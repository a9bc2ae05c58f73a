"""KV-cache capacity with attn-otel on production model shapes, computed by the sizing code the engine runs.

At start-up attn-otel takes its share of vLLM's KV-cache budget (``attn_otel.tap.kv_budget``, called by
``vllm_adapter._scale_available_memory``): the stream's query ring (one scheduler step of queries per streamed
layer) and the map tap's fixed rows come off the budget, then KV tokens shrink by ``kv / (kv + capture bytes
per token)``.  This script runs that same function on layer specs built from the models' published configs
(no engine, no GPU), for ``ATTN_OTEL=1`` alone (``default``: 4 layers, maps for 1% on them) and for all layers,
choosing as the engine does whether windowed and chunked layers are streamed or keep a Q/K tap (whichever
leaves more KV cache), and beside it the rule before 2026-11-26 (every layer with a window, soft-cap or sinks
kept a Q/K tap; seven float16 metric rows a token per streamed layer).  Check of the method: run 14 measured
0.974 with the default and 0.832 for all layers of the Llama-3-8B shape on an H100, where the earlier rule
computes 0.974 and 0.835 here.

The budget a model leaves for its KV cache depends on the deployment; each shape below names the one assumed
(one H100 80GB at ``gpu_memory_utilization=0.9``, bf16 weights unless said).  The per-token factor does not
depend on it; the fixed part (``fixed_gib``) does, and weighs most where the budget is small.

    python3 bench/kv_capacity.py [--out docs/benchmarks/kv-capacity.json] [--step 16384]

writes the JSON and, beside it, a bar chart (``kv-capacity.png``: before and now, default and all layers, for
the step given and for 8,192-token steps).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attn_otel.config import AUTO_LAYERS, Config, resolve_layers, resolve_map_layers  # noqa: E402
from attn_otel.stream import DEFAULT_ROWS, MetricsStream  # noqa: E402
from attn_otel.tap import LayerSpec, MapTap, QKTap, kv_budget  # noqa: E402
from attn_otel.vllm_adapter import _ring_rows  # noqa: E402

GIB = 2 ** 30
# name: layers, query heads, KV heads, head_dim, which layers have a window (and how wide), sinks, chunks,
# soft-cap, takes images, the KV budget assumed (GiB) and where it comes from
SHAPES = {
    "Llama-3-8B": dict(layers=32, hq=32, hkv=8, d=128, window=None, sinks=False, chunk=None, cap=0.0, vision=False,
                       budget=58.0, budget_from="run 14's measured budget (H100 80GB, 0.9, bf16 weights)"),
    "gpt-oss-120b": dict(layers=36, hq=64, hkv=8, d=64, window=(128, lambda i: i % 2 == 0), sinks=True, chunk=None,
                         cap=0.0, vision=False, budget=9.0,
                         budget_from="assumed: one H100 80GB at 0.9 less MXFP4 weights (~61 GiB) and activations"),
    "Gemma-3-27B": dict(layers=62, hq=32, hkv=16, d=128, window=(1024, lambda i: (i + 1) % 6 != 0), sinks=False,
                        chunk=None, cap=0.0, vision=True, budget=14.0,
                        budget_from="assumed: one H100 80GB at 0.9 less bf16 weights (~54 GiB) and activations"),
    # one rank of tensor parallel 2: half of the 40 query and 8 KV heads
    "Llama-4-Scout": dict(layers=48, hq=20, hkv=4, d=128, window=None, sinks=False,
                          chunk=(8192, lambda i: (i + 1) % 4 != 0), cap=0.0, vision=True, budget=16.0,
                          budget_from="assumed: one rank of tensor parallel 2 on two H100 80GB at 0.9, fp8 weights "
                                      "(~51 GiB a rank)"),
}


def specs_of(shape: dict) -> list[LayerSpec]:
    out = []
    for i in range(shape["layers"]):
        window = shape["window"][0] if shape["window"] and shape["window"][1](i) else 0
        chunk = shape["chunk"][0] if shape["chunk"] and shape["chunk"][1](i) else 0
        sinks = (0.0,) * shape["hq"] if shape["sinks"] else None
        out.append(LayerSpec(index=i, name=f"layers.{i}.attn", num_heads=shape["hq"], num_kv_heads=shape["hkv"],
                             head_dim=shape["d"], scale=shape["d"] ** -0.5, window=window, chunk=chunk,
                             sinks=sinks, soft_cap=shape["cap"]))
    return out


def before(available, kv, captured, maps, rows, dtype, map_rows) -> tuple[int, int, int]:
    """The rule before 2026-11-26: layers with any term kept a Q/K tap (and were map layers); plain ones were
    streamed with seven float16 rows a token (eight with sinks: never, sinks were a term) and keys from the
    cache; the ring and the map tap as now."""
    streamed = [s for s in captured if s.plain]
    tapped = [s for s in captured if not s.plain]
    tap = QKTap.bytes_per_token(tapped, dtype)
    if streamed:
        tap += sum(7 * s.num_heads * 2 for s in streamed) + 8
    fixed = MetricsStream.ring_bytes(streamed, rows, dtype) if streamed else 0
    mapped = [s for s in streamed if s.index in maps]
    if mapped:
        fixed += MapTap.nbytes_for(mapped, map_rows, 0, dtype)
        tap += 8
    return int(max(0, available - fixed) * kv / (kv + tap)), tap, fixed


def runner_of(step: int, seqs: int, dtype: torch.dtype, spec_tokens: int = 0, mixed: str = "PIECEWISE"
              ) -> SimpleNamespace:
    """What the engine's ring sizing (``vllm_adapter._ring_rows``) reads of vLLM's runner: the scheduler's
    limits, the CUDA-graph mode of mixed batches (vLLM 0.26's default: PIECEWISE) and the speculative tokens
    (none by default).  (tests/test_config.py checks the sizing rule on the same stand-in.)"""
    mode = SimpleNamespace(mixed_mode=lambda: SimpleNamespace(name=mixed))
    return SimpleNamespace(vllm_config=SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=step, max_num_seqs=seqs),
        compilation_config=SimpleNamespace(cudagraph_mode=mode),
        speculative_config=SimpleNamespace(num_speculative_tokens=spec_tokens) if spec_tokens else None,
        model_config=SimpleNamespace(dtype=dtype)))


def measure(name: str, shape: dict, step: int, seqs: int = 1024) -> dict:
    dtype = torch.bfloat16
    specs = specs_of(shape)
    kv = sum(2 * s.num_kv_heads * s.head_dim * 2 for s in specs)  # bf16 K and V, every layer's page per token
    available = int(shape["budget"] * GIB)
    rows = max(DEFAULT_ROWS, step)  # the ring before direct rows: one step
    map_rows = 8192  # ATTN_OTEL_MAP_TAP_TOKENS's default: ATTN_OTEL_MAX_MAP_TOKENS
    res = {"kv_bytes_per_token": kv, "budget_gib": shape["budget"], "budget_from": shape["budget_from"],
           "layers_with_window": sum(1 for s in specs if s.window),
           "layers_with_chunks": sum(1 for s in specs if s.chunk),
           "sinks": shape["sinks"], "takes_images": shape["vision"], "configs": {}}
    for config, selection in (("default", "auto"), ("all_layers", "all")):
        captured = [specs[i] for i in resolve_layers(selection, len(specs))]
        maps = resolve_map_layers("auto", [s.index for s in captured])
        # the ring as the engine sizes it now (ATTN_OTEL_STREAM_DIRECT=auto: direct rows where they save >= 1% of
        # the budget)
        rows_now, direct = _ring_rows(runner_of(step, seqs, dtype), Config(), captured, available)
        b = kv_budget(available, kv, captured, maps, captured, True, rows_now, dtype, shape["vision"], map_rows)
        old, old_tap, old_fixed = before(available, kv, captured, maps, rows, dtype, map_rows)
        res["configs"][config] = {
            "layers": [s.index for s in captured],
            "now": {"kv_capacity": round(b.kv_bytes / available, 4), "capture_bytes_per_token": b.per_token,
                    "per_token_factor": round(kv / (kv + b.per_token), 4), "fixed_gib": round(b.fixed / GIB, 3),
                    "qk_tapped": len(b.tapped), "streamed": len(b.streamed), "windowed_streamed": b.local_streamed,
                    "streamed_with_k_tap": sum(1 for s in b.streamed if s.local),
                    "ring_rows": rows_now, "direct_rows": direct is not None},
            "before": {"kv_capacity": round(old / available, 4), "capture_bytes_per_token": old_tap,
                       "per_token_factor": round(kv / (kv + old_tap), 4), "fixed_gib": round(old_fixed / GIB, 3)},
        }
    return res


def plot(models: dict, serve: dict | None, step: int, path: Path) -> None:
    """Bars of KV capacity (ratio to capture off) per model: before and now, default and all layers; the
    8,192-token figures (``serve``) as ticks on the "now" bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(models)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, config, title in zip(axes, ("default", "all_layers"), ("ATTN_OTEL=1 (4 layers)", "all layers")):
        x = range(len(names))
        before = [models[n]["configs"][config]["before"]["kv_capacity"] for n in names]
        now = [models[n]["configs"][config]["now"]["kv_capacity"] for n in names]
        ax.bar([i - 0.2 for i in x], before, 0.4, label="before 2026-11-26", color="#b0b0b0")
        ax.bar([i + 0.2 for i in x], now, 0.4, label=f"now, {step}-token steps", color="#3b75af")
        top = now
        if serve is not None:
            ticks = [serve[n]["configs"][config]["now"]["kv_capacity"] for n in names]
            ax.scatter([i + 0.2 for i in x], ticks, marker="_", s=400, color="#d62728", zorder=3,
                       label="now, 8192-token steps")
            top = [max(a, b) for a, b in zip(now, ticks)]
        for i, (v, t) in enumerate(zip(now, top)):
            ax.text(i + 0.2, t + 0.02, f"{v:.2f}", ha="center", fontsize=8)
        ax.axhline(0.97 if config == "default" else 0.90, color="#d62728", lw=0.8, ls="--")
        ax.set_xticks(list(x), [n.replace("-", "-\n", 1) for n in names], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylim(0, 1.05)
    axes[0].set_ylabel("KV-cache capacity, ratio to capture off")
    axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle("KV-cache capacity with attn-otel (computed by the engine's sizing code; dashed: issue 22's "
                 "targets)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/benchmarks/kv-capacity.json")
    ap.add_argument("--step", type=int, default=16384,
                    help="max_num_batched_tokens: the ring holds one step (vLLM 0.26's default on an H100 offline; "
                         "8192 for `vllm serve`)")
    ap.add_argument("--max-num-seqs", type=int, default=1024,
                    help="vLLM's max_num_seqs: with direct rows the ring holds one step's decode tokens (1024: vLLM "
                         "0.26's default on an H100)")
    args = ap.parse_args()
    out = {"method": "attn_otel.tap.kv_budget on layer specs of the published configs (no engine), the ring sized by "
                     "vllm_adapter._ring_rows",
           "step_tokens": args.step, "max_num_seqs": args.max_num_seqs, "auto_layers": AUTO_LAYERS,
           "models": {name: measure(name, shape, args.step, args.max_num_seqs) for name, shape in SHAPES.items()}}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    serve = ({name: measure(name, shape, 8192, args.max_num_seqs) for name, shape in SHAPES.items()}
             if args.step != 8192 else None)
    plot(out["models"], serve, args.step, Path(args.out).with_suffix(".png"))
    print(f"{'model':<15} {'config':<11} {'before':>7} {'now':>7} {'per-token':>9} {'fixed GiB':>9}")
    for name, m in out["models"].items():
        for config, c in m["configs"].items():
            print(f"{name:<15} {config:<11} {c['before']['kv_capacity']:>7.3f} {c['now']['kv_capacity']:>7.3f} "
                  f"{c['now']['per_token_factor']:>9.3f} {c['now']['fixed_gib']:>9.2f}")


if __name__ == "__main__":
    main()
