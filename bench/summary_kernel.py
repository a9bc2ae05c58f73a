"""The finish-time summary kernel alone (GPU): mean and p10/p50/p90 per request, part, metric, layer and head.

Two inputs, the shapes of one finish of 16 requests of 512 prompt + 256 generated rows at Llama-3-8B's 32
query heads: the 28 streamed layers' float16 rows as the finish path has them (a gather from the per-slot
buffer, ``[L, T, 7, H]`` viewed as ``[L, 7, H, T]``), and the 4 tapped layers' float32 rows (contiguous
``[L, 7, H, T]``).  Times :func:`attn_otel.triton_metrics.summaries` with CUDA events; ``--module PATH``
times another copy of ``attn_otel/triton_metrics.py`` (an earlier kernel) on the same inputs and checks
that it gives the same summaries.

A third input is a finish batch of the mixed workload (bench/workloads.py) with one long request: 15 requests of
512 + 256 rows and one of 7,000 + 128, the default's 4 streamed layers' float16 gather.  It times the whole
finish-time summary (:func:`attn_otel.finish.device_summaries`) against its torch code alone, which is what such a
batch took up to run 44 (a part over 2,048 rows sent the whole batch there), and checks that the two agree.

    python3 bench/summary_kernel.py [--module PATH] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
from cuda_time import device_ms  # bench/, the script's folder

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REQUESTS, PROMPT, GENERATED, H, M = 16, 512, 256, 32, 7
QUANTILES = (0.1, 0.5, 0.9)


def _inputs() -> dict[str, torch.Tensor]:
    T = REQUESTS * (PROMPT + GENERATED)
    g = torch.Generator(device="cuda").manual_seed(0)
    gathered = torch.rand(28, T, M, H, device="cuda", generator=g).half()
    return {"28 streamed layers, float16 gather": gathered.permute(0, 2, 3, 1),
            "4 tapped layers, float32": torch.rand(4, M, H, T, device="cuda", generator=g)}


def _load(path: str, i: int):
    # a submodule of the package, so that its relative imports (attn_otel.stream) resolve
    spec = importlib.util.spec_from_file_location(f"attn_otel._alt_triton_metrics_{i}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _time(mod, rows: torch.Tensor, reps: int) -> tuple[float, torch.Tensor]:
    cu = [i * (PROMPT + GENERATED) for i in range(REQUESTS + 1)]
    prompts = [PROMPT] * REQUESTS
    out = torch.full((REQUESTS, 2, M, 4, rows.shape[0], H), float("nan"), device="cuda")
    assert mod.summaries(rows, cu, prompts, False, QUANTILES, out)  # compile, warm
    return device_ms(lambda: mod.summaries(rows, cu, prompts, False, QUANTILES, out), reps, warmups=0), out


def _mixed_batch(reps: int) -> dict:
    """device_summaries on a mixed finish batch with one long request: the Triton kernel for every part
    against the torch code for the whole batch."""
    from attn_otel.finish import device_summaries

    Ts = [PROMPT + GENERATED] * 15 + [7000 + 128]
    prompts = [PROMPT] * 15 + [7000]
    g = torch.Generator(device="cuda").manual_seed(1)
    rows = torch.rand(4, sum(Ts), M, H, device="cuda", generator=g).half().permute(0, 2, 3, 1)
    cu = [0]
    for t in Ts:
        cu.append(cu[-1] + t)
    res = {}
    outs = {}
    for name, fused in (("kernel", None), ("torch", False)):
        fn = lambda: device_summaries(rows, cu, prompts, vision=False, fused=fused)  # noqa: E731
        outs[name] = fn()
        res[f"{name}_ms"] = device_ms(fn, reps)
    a, b = outs["kernel"], outs["torch"]
    ok = torch.isnan(a) == torch.isnan(b)
    err = ((a - b).abs() / (1e-6 + 1e-5 * b.abs())).nan_to_num(0.0).max().item()
    res.update(kernel_over_torch=res["kernel_ms"] / res["torch_ms"], nan_agree=bool(ok.all()),
               err_in_tolerance_units=err)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--module", action="append", default=[], help="another triton_metrics.py to time")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from attn_otel import triton_metrics

    inputs = _inputs()
    mods = [("current", triton_metrics)] + [(m, _load(m, i)) for i, m in enumerate(args.module)]
    results = {"device": torch.cuda.get_device_name(0), "requests": REQUESTS, "prompt": PROMPT,
               "generated": GENERATED, "heads": H, "runs": []}
    reference = {}
    for label, mod in mods:
        row = {"kernel": label, "ms": {}, "equal_to_current": {}}
        for name, rows in inputs.items():
            ms, out = _time(mod, rows, args.reps)
            row["ms"][name] = ms
            if label == "current":
                reference[name] = out
            else:
                row["equal_to_current"][name] = bool(torch.equal(out.nan_to_num(7.0), reference[name].nan_to_num(7.0)))
        results["runs"].append(row)
        print(label, {k: round(v, 3) for k, v in row["ms"].items()}, row["equal_to_current"] or "", flush=True)
    results["mixed_batch_one_long_request"] = _mixed_batch(args.reps)
    print("mixed finish batch, one long request:", results["mixed_batch_one_long_request"], flush=True)
    (args.out / "summary_kernel.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
