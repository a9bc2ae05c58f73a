"""The streamed layers' metric kernel alone, on the flush shapes of the overhead benchmark (GPU).

Llama-3-8B attention shape (32 query heads, 8 KV heads, head_dim 128, bf16), keys in a FLASH_ATTN-layout
paged cache (block size 16), random data.  Times one launch (one layer) per shape with CUDA events and
reports milliseconds and the (row, key, head) evaluations per second, and each compiled variant's registers a
thread and spills (``compiled``: what sets its occupancy); ``--sweep`` tries launch
configurations (rows per program, keys per tile, warps, stages); ``--module PATH`` times another copy of
``attn_otel/triton_metrics.py`` (an earlier kernel) for comparison; ``--attention`` also times the attention of
the prefill shapes (square, causal) with torch's SDPA on the same device, the metric kernel's cost against the
attention it summarises (``attention``: ms of each and their ratio; ``peak_share``: the kernel's evaluations per
second against the device's exponentials per second, one per (row, key, head) as in FlashAttention's softmax).

    python3 bench/flush_kernel.py [--sweep] [--module PATH] [--attention] [--paged] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import sys
from pathlib import Path

import torch
from cuda_time import device_ms  # bench/, the script's folder

H, HKV, D, BS = 32, 8, 128, 16
# name: (requests, first row position, rows per request, prompt length)
SHAPES = {
    "prefill 32x512": (32, 0, 512, 512),
    "decode 256x64 at 640": (256, 640, 64, 512),
    "prefill 2x8192": (2, 0, 8192, 8192),
    "finish 256x2 at 766": (256, 766, 2, 512),
    "prefill 32x768": (32, 0, 768, 512),
    "prefill 8x2048": (8, 0, 2048, 2048),
}


def _inputs(reqs: int, first: int, n: int, prompt: int, paged: bool = False, device="cuda"):
    """One launch's arguments, keyword arguments and (row, key, head) evaluations.  ``paged``: the keys as the
    serving stream gives them (``ATTN_OTEL_FLUSH_KEYS=blocks``, the default): each request's block ids, and each
    row's query found through a slot -> row table; else one slot per key and a row index per row."""
    T = first + n
    nb = (T + BS - 1) // BS
    blocks = reqs * nb
    g = torch.Generator(device=device).manual_seed(0)
    kv = torch.randn(blocks, HKV, BS, 2 * D, device=device, generator=g).to(torch.bfloat16)
    key_cache = kv.transpose(1, 2)[..., :D]  # [blocks, BS, HKV, D], FLASH_ATTN 0.26's layout
    rows = reqs * n
    ring = torch.randn(rows + 1, H, D, device=device, generator=g).to(torch.bfloat16)
    perm = torch.randperm(blocks, device=device, generator=g)
    pos = torch.arange(T, device=device)
    key_slots = torch.cat([perm[b * nb:(b + 1) * nb][pos // BS] * BS + pos % BS for b in range(reqs)])
    q_rows = torch.randperm(rows, device=device, generator=g)
    i32 = dict(dtype=torch.int32, device=device)
    cu_rows = torch.arange(reqs + 1, **i32) * n
    cu_keys = torch.arange(reqs + 1, **i32) * T
    firsts = torch.full((reqs,), first, **i32)
    prompts = torch.full((reqs,), prompt, **i32)
    out = torch.empty((blocks * BS + 1, 7, H), dtype=torch.float16, device=device)
    kw = {}
    if paged:
        key_slots = perm  # request b's blocks at cu_keys[b] .., nb of them
        cu_keys = torch.arange(reqs + 1, **i32) * nb
        table = torch.zeros(blocks * BS + 1, dtype=torch.int64, device=device)
        row_slots = torch.cat([perm[b * nb:(b + 1) * nb][pos[first:] // BS] * BS + pos[first:] % BS
                               for b in range(reqs)])
        table[row_slots] = q_rows
        kw = dict(row_table=table, paged=BS)
    return (ring, q_rows, cu_rows, firsts, key_cache, key_slots, cu_keys, prompts, n, D ** -0.5, 4, None, None,
            out), kw, reqs * H * sum(first + i + 1 for i in range(n))


def _time(mod, args, kw, reps: int) -> float:
    return device_ms(lambda: mod.row_metrics_stream(*args, **kw), reps)


def _attention_ms(reqs: int, n: int, reps: int) -> tuple[float, str]:
    """Causal attention of ``reqs`` sequences of ``n`` tokens (queries = keys), H query heads on HKV KV heads
    (GQA), bf16, by torch's SDPA: its flash kernel where torch has one for the device."""
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(reqs, H, n, D, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(reqs, HKV, n, D, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(reqs, HKV, n, D, device="cuda", generator=g, dtype=torch.bfloat16)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                return device_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                                 reps), backend.name
        except RuntimeError:
            continue
    raise RuntimeError("no SDPA backend ran the shape")


def _exp_per_s() -> float:
    """The device's exponentials per second: 16 per clock per SM on sm_80/sm_90 (MUFU), at its maximum clock."""
    props = torch.cuda.get_device_properties(0)
    clock_khz = getattr(props, "clock_rate", 0) or 0
    if not clock_khz:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True)
        clock_khz = int(out.stdout.split()[0]) * 1000
    return props.multi_processor_count * 16 * clock_khz * 1e3


def _load(path: str | None):
    if path is None:  # by path: the kernel needs torch, Triton and its sibling slots.py, not the package's imports
        path = str(Path(__file__).resolve().parent.parent / "attn_otel" / "triton_metrics.py")
    import types

    pkg = f"_flush_kernel_{abs(hash(path))}"  # a bare package around the file's folder, for its relative imports
    if pkg not in sys.modules:
        mod = types.ModuleType(pkg)
        mod.__path__ = [str(Path(path).resolve().parent)]
        sys.modules[pkg] = mod
    spec = importlib.util.spec_from_file_location(f"{pkg}.triton_metrics", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _compiled(mod) -> list[dict]:
    """The metric kernel's compiled variants so far in ``mod``: registers a thread, spilled registers, shared
    memory, warps and stages of each (what sets the kernel's occupancy), from Triton's per-device cache."""
    out = []
    for cache in getattr(mod._row_metrics, "device_caches", {}).values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        for k in list(kernels.values()):
            try:
                k._init_handles()
            except Exception:  # noqa: BLE001 - a Triton without the lazy loader: the fields are set already
                pass
            md = getattr(k, "metadata", None)
            out.append({"n_regs": getattr(k, "n_regs", None), "n_spills": getattr(k, "n_spills", None),
                        "shared": getattr(md, "shared", None), "num_warps": getattr(md, "num_warps", None),
                        "num_stages": getattr(md, "num_stages", None)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--module", action="append", default=[], help="another triton_metrics.py to time")
    ap.add_argument("--configs", help="JSON list of launch configurations to try (instead of --sweep's grid)")
    ap.add_argument("--attention", action="store_true", help="also time SDPA's causal attention on the prefill shapes")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--shape", action="append", choices=list(SHAPES), help="only these shapes (e.g. under ncu)")
    ap.add_argument("--paged", action="store_true",
                    help="keys by block id and rows through a slot table, as the serving stream launches it")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    inputs = {name: _inputs(*shape, paged=args.paged) for name, shape in SHAPES.items()
              if not args.shape or name in args.shape}
    uuid = getattr(torch.cuda.get_device_properties(0), "uuid", "")
    results = {"device": torch.cuda.get_device_name(0), "gpu": f"GPU-{uuid}" if uuid else "",
               "shapes": {k: list(v) for k, v in SHAPES.items()}, "keys": "blocks" if args.paged else "slots",
               "runs": []}
    mods = [("current", None)] + [(f"{Path(m).parent.name}/{Path(m).name}", m) for m in args.module]
    configs = [{}]
    if args.sweep:
        configs += [dict(block_m=m, block_n=n, num_warps=w, num_stages=s)
                    for m, n, w, s in itertools.product([64, 128], [32, 64, 128], [4, 8], [2, 3])]
    if args.configs:
        configs += json.loads(args.configs)
    compiled: dict[str, list] = {}
    for label, path in mods:
        mod = _load(path)
        for cfg in (configs if path is None else [{}]):
            if hasattr(mod, "CONFIG"):
                mod.CONFIG.clear()
                mod.CONFIG.update(cfg)
            row = {"kernel": label, "config": cfg, "ms": {}, "g_evals_per_s": {}}
            try:
                for name, (a, kw, evals) in inputs.items():
                    ms = _time(mod, a, kw, args.reps)
                    row["ms"][name] = ms
                    row["g_evals_per_s"][name] = evals / ms / 1e6
            except Exception as e:  # noqa: BLE001 - a configuration that does not compile
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            seen = len(compiled.setdefault(label, []))
            compiled[label] = _compiled(mod)
            row["compiled"] = compiled[label][seen:]  # the variants this configuration compiled
            results["runs"].append(row)
            print(label, cfg, {k: round(v, 3) for k, v in row["ms"].items()}, row.get("error", ""),
                  [(c["n_regs"], c["n_spills"]) for c in row["compiled"]], flush=True)
    ok = [r for r in results["runs"] if r["kernel"] == "current" and "error" not in r]
    if ok:
        best = min(ok, key=lambda r: sum(r["ms"].values()))
        results["best"] = best
        print("best", best["config"], {k: round(v, 3) for k, v in best["ms"].items()})
    if ok and args.attention:
        cur = ok[0]  # the kernel as it ships (no configuration given)
        peak = _exp_per_s()
        results["peak_exp_per_s"] = peak
        results["peak_share"] = {k: v * 1e9 / peak for k, v in cur["g_evals_per_s"].items()}
        results["attention"] = {}
        for name, (reqs, first, n, _prompt) in SHAPES.items():
            if name in inputs and first == 0 and name.startswith("prefill"):
                ms, backend = _attention_ms(reqs, n, args.reps)
                results["attention"][name] = {"sdpa_ms": ms, "sdpa_backend": backend, "metric_ms": cur["ms"][name],
                                              "metric_over_attention": cur["ms"][name] / ms}
        print("attention", json.dumps(results["attention"]), "peak share",
              {k: round(v, 3) for k, v in results["peak_share"].items()}, flush=True)
    (args.out / ("flush_kernel-paged.json" if args.paged else "flush_kernel.json")).write_text(
        json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
